"""int4 weights (qcompile/quant/int4.py, the groundwork of issue 20's w4a16 recipe) against
llm-compressor's W4A16 preset, byte for byte: every `weight_packed` int32 and bf16 `weight_scale`
that `model_free_ptq` and `oneshot` write for a fresh random checkpoint, whose weights also hold the
groups where the arithmetic is delicate (all zeros, one outlier, only negative values, values on
the rounding boundaries); then the packing's round trip and the refusals."""

from __future__ import annotations

import random

import pytest
import torch
from llmc_reference import BF16, EMBED, read_tensors, run_model_free, run_oneshot
from safetensors.torch import load_file, save_file

from qcompile.quant.int4 import check_groups, dequantize, pack_int4, quantize_int4, unpack_int4
from qcompile.synth.presets import get_preset

# every linear's input width a multiple of the 128-column group: hidden 256, intermediate 384
SHAPES = {
    "hidden_size": 256,
    "intermediate_size": 384,
    "head_dim": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _delicate(w: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """w with some groups of 128 made hard: all zero, one outlier, all negative, and k * scale / 2
    values (quotients on a .5, where round-half-even and the bf16 quotient decide)."""
    w = w.clone()
    rows = rng.sample(range(w.shape[0]), 4)
    w[rows[0], :128] = 0
    w[rows[1], 128 * (w.shape[1] // 128 - 1) + rng.randrange(128)] = 40.0
    w[rows[2], :128] = -w[rows[2], :128].abs()
    scale = float(w[rows[3], :128].abs().max()) / 7.5
    w[rows[3], :128] = torch.tensor([scale * (rng.randrange(-15, 16) / 2) for _ in range(128)]).to(w.dtype)
    return w


@pytest.fixture(scope="module")
def llmc_outputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, dict]:
    """(source tensors, model_free_ptq's, oneshot's) for one fresh random checkpoint."""
    from qcompile.synth.checkpoint import write_checkpoint

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    root = tmp_path_factory.mktemp("int4")
    ckpt = root / "ckpt"
    write_checkpoint({**get_preset("tiny").config(), **SHAPES}, ckpt, seed=seed)
    for file in ckpt.glob("*.safetensors"):
        tensors = load_file(file)
        for name, t in tensors.items():
            if name.endswith("proj.weight"):
                tensors[name] = _delicate(t, rng)
        save_file(tensors, file, metadata={"format": "pt"})
    run_model_free(ckpt, root / "model_free", "W4A16", ["lm_head", EMBED])
    run_oneshot(ckpt, root / "oneshot", "W4A16", ["lm_head"])
    return read_tensors(ckpt), read_tensors(root / "model_free"), read_tensors(root / "oneshot")


@pytest.mark.parametrize("path", ["model_free", "oneshot"])
def test_every_int4_tensor_is_llmcompressors(llmc_outputs, path):
    source, free, one = llmc_outputs
    theirs = free if path == "model_free" else one
    linears = [name[: -len("weight")] for name in source if name.endswith("proj.weight")]
    assert len(linears) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    for base in linears:
        w = source[base + "weight"]
        assert w.dtype == BF16
        packed, scale = quantize_int4(w)
        assert torch.equal(packed, theirs[base + "weight_packed"]), base
        assert scale.dtype == BF16 and torch.equal(
            scale.view(torch.int16), theirs[base + "weight_scale"].view(torch.int16)
        ), base
        assert theirs[base + "weight_shape"].tolist() == list(w.shape)
        # what a W4A16 linear multiplies by: within half a step of each weight, or a little more at
        # a group's largest positive value (it maps to 7.5, rounds to 8 and is clamped to 7, and the
        # bf16 roundings of the scale and the quotient can push it to ~7.53)
        error = (dequantize(packed, scale, 128).float() - w.float()).abs()
        step = scale.float().repeat_interleave(128, dim=1)
        assert torch.all(error <= 0.54 * step), base


def test_packing_round_trips_and_puts_the_first_column_low(rng):
    q = torch.tensor([[rng.randrange(-8, 8) for _ in range(64)] for _ in range(5)], dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    word = pack_int4(torch.tensor([[-8, -7, 0, 0, 0, 0, 0, 7]], dtype=torch.int8))
    assert word.tolist() == [[0 + (1 << 4) + (8 << 8) + (8 << 12) + (8 << 16) + (8 << 20) + (8 << 24) - (1 << 28)]]


def test_groups_that_do_not_divide_are_refused_naming_the_weight():
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight \[8, 200\].*not a multiple of the group size 128"
    ):
        check_groups((8, 200), 128, "model.layers.0.mlp.down_proj.weight")
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize_int4(torch.randn(4, 128, dtype=BF16), group_size=12)
    with pytest.raises(ValueError, match="2-D float"):
        quantize_int4(torch.ones(4, 128, dtype=torch.int32))
