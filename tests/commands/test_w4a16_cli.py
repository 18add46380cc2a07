"""The `w4a16` recipe end to end through the CLI (issue 20): `qcompile compile CKPT -o ART --recipe
w4a16`, inspect / verify, `qcompile run` generating what the Python API generates, and `qcompile
export`: the compressed-tensors checkpoint llm-compressor's W4A16 preset writes (`pack-quantized`:
`weight_packed`, `weight_scale`, `weight_shape`, the same config), which transformers loads and runs
to our runtime's logits in float32. A checkpoint whose K is not whole groups, or a tp that cuts one,
fails naming the tensor and leaves nothing behind. Fresh random checkpoints each run."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import qruntime
import torch
from click.testing import CliRunner
from int4_shapes import INT4_SHAPES
from llmc_reference import (
    MODEL_FREE_IGNORE,
    OBSERVER,
    assert_identical,
    group_dicts,
    quantization_config,
    read_tensors,
    run_model_free,
)
from transformers import AutoModelForCausalLM

from qcompile.cli import main
from qcompile.publish.unfuse import split_to_sources
from qcompile.quant.int4 import dequantize


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    return float(10 * torch.log10(reference.pow(2).mean() / (reference - other).pow(2).mean()))


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))


@pytest.fixture(scope="module")
def seed() -> int:
    seed = random.randrange(1 << 30)
    print(f"checkpoint seed {seed}")
    return seed


@pytest.mark.parametrize("preset", ["tiny", "tiny-tied", "tiny-moe"])
def test_compile_run_export_round_trip(make_ckpt, seed, preset, tmp_path):
    moe = {"moe_intermediate_size": 128} if preset == "tiny-moe" else {}
    ckpt = make_ckpt(preset, seed=seed, **INT4_SHAPES, **moe)
    art = tmp_path / "art"
    result = run("compile", ckpt, "-o", art, "--recipe", "w4a16", "-q")
    assert result.exit_code == 0, result.output
    assert run("verify", art).exit_code == 0
    info = json.loads(run("inspect", art, "--json").output)
    assert info["scheme"] == "w4a16" and info["quantized_weights"] > 0
    source_params = sum(t.numel() for t in read_tensors(ckpt).values())
    assert info["model"]["parameters"] == source_params  # packed words count their 8 values

    result = run("run", art, "Hello there", "--max-tokens", "8", "--ignore-eos", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    generated = json.loads(result.output)
    engine = qruntime.load(art, "cpu", num_kv_blocks=64)
    params = qruntime.SamplingParams(max_tokens=8, ignore_eos=True)
    want = engine.generate(engine.tokenizer.encode("Hello there"), params)[0]
    assert generated["token_ids"] == list(want.token_ids) and generated["finish_reason"] == "length"

    exported = tmp_path / "ct"
    result = run("export", art, "-o", exported, "--format", "compressed-tensors")
    assert result.exit_code == 0, result.output
    reference = tmp_path / "llmc"
    run_model_free(ckpt, reference, "W4A16", MODEL_FREE_IGNORE)
    ours = read_tensors(exported)
    assert_identical(ours, read_tensors(reference))
    assert any(name.endswith(".weight_shape") for name in ours)
    config, rest = quantization_config(exported)
    their_config, their_rest = quantization_config(reference)
    assert group_dicts(config, OBSERVER) == group_dicts(their_config, OBSERVER)
    assert config.format == "pack-quantized" and rest["tie_word_embeddings"] == their_rest["tie_word_embeddings"]

    # transformers decompresses the int4 weights (q * scale) and runs them: our runtime's logits
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    fp32 = qruntime.load(art, "cpu", dtype=torch.float32, num_kv_blocks=64)
    rng = random.Random(seed)
    ids = [rng.randrange(fp32.vocab_size) for _ in range(rng.randrange(20, 60))]
    with torch.inference_mode():
        theirs = model(torch.tensor([ids])).logits[0].float()
    ours_logits = fp32.score(ids)
    if preset != "tiny-moe":
        assert float((ours_logits - theirs).abs().max()) <= 1e-5 * max(1.0, float(theirs.abs().max()))
        return
    # transformers 5 merges the decompressed experts into bf16 3-D tensors, bf16(q * scale), where we
    # multiply in fp32: every weight it holds is exactly the artifact's (the experts that bf16
    # rounding of it), so the logits differ by that rounding only (measured 45-67 dB; a routing
    # near-tie gives the low end), far from the int4 error itself (~11 dB). That bound is coarse (a
    # 10% error in the experts' down scales read 38.6 dB): the exact check of the runtime's MoE is
    # tests/runtime/test_w4a16_reference.py's, against transformers on the fp32 weights at 1e-5.
    for name, w, scale in split_to_sources(art):
        if scale is None:
            continue
        module, _, proj = name.removesuffix(".weight").rpartition(".")
        if ".experts." not in module:
            assert torch.equal(model.get_submodule(f"{module}.{proj}").weight, dequantize(w, scale.float(), 128))
            continue
        experts, _, e = module.rpartition(".")
        merged = dict(model.get_submodule(experts).named_parameters())
        rows = w.shape[0]
        held = {"gate_proj": merged["gate_up_proj"][int(e), :rows], "up_proj": merged["gate_up_proj"][int(e), rows:]}
        held["down_proj"] = merged["down_proj"][int(e)]
        assert torch.equal(held[proj], dequantize(w, scale, 128).float()), name
    assert sqnr_db(theirs, ours_logits) >= 35
    source = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.inference_mode():
        assert sqnr_db(source(torch.tensor([ids])).logits[0].float(), ours_logits) < 25


def test_groups_that_do_not_divide_fail_naming_the_tensor_and_leave_nothing(make_ckpt, tmp_path):
    result = run("compile", make_ckpt("tiny"), "-o", tmp_path / "art", "--recipe", "w4a16", "-q")
    assert result.exit_code == 1
    assert "model.layers.0.self_attn.q_proj.weight [64, 64]: its 64 input columns are not a multiple" in result.output
    assert "quantization.ignore" in result.output
    assert leftovers(tmp_path, "art") == []
    ckpt = make_ckpt("tiny", **{**INT4_SHAPES, "intermediate_size": 384})
    result = run("compile", ckpt, "-o", tmp_path / "art", "--recipe", "w4a16", "--tp", "2", "-q")
    assert result.exit_code == 1
    assert "tp=2 gives each rank 192 of the 384 input columns of model.layers.0.mlp.down_proj.weight" in result.output
    assert leftovers(tmp_path, "art") == []
