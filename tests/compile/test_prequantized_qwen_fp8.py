"""Qwen's own FP8 checkpoints (`quant_method: fp8`, 128x128 blocks, `weight_scale_inv`) as compiler input
(issue 20): transcoded into the block-fp8 artifact, never re-quantized.

`write_qwen_fp8` writes that layout from its published description, with its own arithmetic (fp32
block amax / 448, the scale rounded to bf16, the weight divided in fp32), from fresh random bf16
checkpoints (the seed printed): each linear's `weight` float8_e4m3fn [rows, cols] and
`weight_scale_inv` bf16 [ceil(rows/128), ceil(cols/128)], the embedding, norms, lm_head and routers
left bf16. The artifact must hold exactly those weights and scales (so its dequantized weights are
the checkpoint's), the recipe block-fp8 taken from config.json; dense, MoE, ragged blocks, tp=2;
it generates. Configs and tensors we cannot honour are errors naming the key or tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import qruntime
import torch
from llmc_reference import BF16, FP8, Tensors, read_tensors
from prequantized_inputs import (
    assert_same_artifact,
    compile_to,
    copy_checkpoint,
    edit_config,
    make_checkpoints,
    rewrite_tensors,
)
from qruntime.artifact import read_manifest

from qcompile.errors import CheckpointError, PlanError, TensorValueError
from qcompile.publish.unfuse import split_to_sources
from qcompile.recipe.prequantized import default_recipe

SIZE128 = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}
PRESETS = {
    "dense": ("tiny", {**SIZE128, "intermediate_size": 256}),
    "moe": ("tiny-moe", {**SIZE128, "intermediate_size": 256, "moe_intermediate_size": 128}),
    "odd": ("tiny-odd", {}),  # hidden 96, intermediate 72: every block ragged
}
CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def quantize_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] bf16 -> (float8_e4m3fn [rows, cols], bf16 scale [ceil(rows/128), ceil(cols/128)])
    with w ~ fp8 * scale per 128x128 block: fp32 amax / 448, then the scale rounded to bf16."""
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -cols % 128, 0, -rows % 128))
    tiles = padded.reshape(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
    scale = (tiles.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12).to(BF16)
    full = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return (w.float() / full).clamp(-448, 448).to(FP8), scale


def write_qwen_fp8(src: Path, dst: Path, modules_to_not_convert: list[str] | None = None) -> Path:
    """`src` (bf16) in Qwen's FP8 layout at `dst`: every 2-D linear weight but lm_head and the MoE
    routers (and those named in `modules_to_not_convert`) as weight + weight_scale_inv."""
    copy_checkpoint(src, dst)

    def skipped(name: str) -> bool:
        return (
            name.startswith(("lm_head", "model.embed_tokens"))
            or name.endswith(".mlp.gate.weight")
            or any(m in name for m in modules_to_not_convert or [])
        )

    def edit(tensors: Tensors) -> None:
        for name in [n for n, t in tensors.items() if t.dim() == 2 and not skipped(n)]:
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = quantize_block(tensors[name])

    rewrite_tensors(dst, edit)
    config = {**CONFIG} | ({"modules_to_not_convert": modules_to_not_convert} if modules_to_not_convert else {})
    edit_config(dst, lambda c: c.update(quantization_config=config))
    return dst


@pytest.fixture(scope="module")
def ckpts(make_ckpt: Callable[..., Path]) -> dict[str, Path]:
    return make_checkpoints(make_ckpt, PRESETS)


@pytest.fixture(scope="module")
def qwen(ckpts, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen-fp8")
    return {
        "dense": write_qwen_fp8(ckpts["dense"], root / "dense", ["lm_head"]),
        "moe": write_qwen_fp8(ckpts["moe"], root / "moe"),
        "odd": write_qwen_fp8(ckpts["odd"], root / "odd", ["down_proj"]),
    }


def split(art: Path) -> Tensors:
    out: Tensors = {}
    for name, weight, scale in split_to_sources(art):
        out[name] = weight
        if scale is not None:
            out[name.removesuffix("weight") + "weight_scale_inv"] = scale
    return out


def dequantize(tensors: Tensors) -> Tensors:
    """Every weight as the checkpoint means it: fp8 x its block's scale_inv, the rest as stored."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        scale = tensors.get(name.removesuffix("weight") + "weight_scale_inv")
        if scale is not None:
            rows, cols = t.shape
            t = t.float() * scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
        out[name] = t
    return out


@pytest.mark.parametrize(
    ("kind", "overrides"), [("dense", ()), ("moe", ()), ("odd", ("passes=[]",)), ("dense", ("tp=2",))]
)
def test_the_artifact_holds_the_checkpoints_weights_and_scales(kind, overrides, qwen, tmp_path):
    ckpt = qwen[kind]
    assert default_recipe(ckpt) == "block-fp8"
    art = compile_to(ckpt, tmp_path / "art", None, overrides)
    manifest = read_manifest(art)
    assert manifest["source"]["quantization"] == {
        "method": "fp8",
        "format": "e4m3 128x128 blocks",
        "scheme": "block-fp8",
    }
    if "tp=2" in overrides:
        single = compile_to(ckpt, tmp_path / "tp1")
        for name, info in manifest["tensors"].items():  # every rank's tensor a slice of the tp=1 one
            whole = read_tensors(single / "weights")[name]
            for r, entry in enumerate(info["ranks"]):
                mine = read_tensors(art / "weights" / f"rank{r}")[name]
                want = whole
                if info["axis"] is not None:
                    want = torch.cat([whole.narrow(info["axis"], b, e - b) for b, e in entry["spans"]], info["axis"])
                assert torch.equal(mine.view(torch.uint8), want.contiguous().view(torch.uint8)), (name, r)
        return
    stored, ours = read_tensors(ckpt), split(art)
    assert sorted(ours) == sorted(stored)
    for name, tensor in stored.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name].view(torch.uint8), tensor.view(torch.uint8))
    want, got = dequantize(stored), dequantize(ours)
    assert all(torch.equal(got[n], want[n]) for n in want)
    if kind == "odd":
        assert stored["model.layers.0.mlp.down_proj.weight"].dtype == BF16  # modules_to_not_convert
        assert "model.layers.0.mlp.down_proj" in manifest["recipe"]["quantization"]["ignore"]


def test_fused_blocks_need_aligned_parts(qwen, tmp_path):
    """The ragged checkpoint with the recipe's fusions: qkv parts of 96 rows cut 128-row blocks."""
    with pytest.raises(PlanError, match=r"block"):
        compile_to(qwen["odd"], tmp_path / "art")
    assert not (tmp_path / "art").exists()


def test_the_transcoded_artifact_generates(qwen, tmp_path):
    art = compile_to(qwen["moe"], tmp_path / "art")
    params = qruntime.SamplingParams(max_tokens=6, temperature=0.0)
    engine = qruntime.load(art, device="cpu")
    first, again = (engine.generate([3, 17, 42, 5], params)[0].token_ids for _ in range(2))
    assert len(first) == 6 and first == again


@pytest.fixture
def hostile(qwen, tmp_path) -> Path:
    return copy_checkpoint(qwen["dense"], tmp_path / "ckpt")


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["quantization_config"].update(activation_scheme="static"), r"static activation scales"),
        (lambda c: c["quantization_config"].update(weight_block_size=[64, 64]), r"weight_block_size is \[64, 64\]"),
        (lambda c: c["quantization_config"].update(fmt="e5m2"), r"fmt is 'e5m2'"),
        (
            lambda c: c["quantization_config"].update(ignored_layers=["x"]),
            r"quantization_config\.'ignored_layers' is not read",
        ),
        (
            lambda c: c["quantization_config"].update(modules_to_not_convert="lm_head"),
            r"modules_to_not_convert must be a list",
        ),
        (
            lambda c: c["quantization_config"].update(quant_method="bitsandbytes"),
            r"quant_method 'bitsandbytes' is not supported",
        ),
    ],
    ids=["static", "block-64", "e5m2", "unknown-key", "not-a-list", "method"],
)
def test_configs_we_cannot_honour_are_refused(edit, message, hostile, tmp_path):
    edit_config(hostile, edit)
    with pytest.raises(CheckpointError, match=message):
        compile_to(hostile, tmp_path / "out", "block-fp8")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop(f"{Q}.weight_scale_inv"), rf"'{Q}\.weight_scale_inv' is missing"),
        (
            lambda t: t.update({f"{Q}.weight_scale_inv": t[f"{Q}.weight_scale_inv"].float()}),
            rf"tensor '{Q}\.weight_scale_inv' is F32; .* stores it as BF16",
        ),
        (
            lambda t: t.update({f"{Q}.weight_scale_inv": t[f"{Q}.weight_scale_inv"].repeat(1, 2)}),
            rf"tensor '{Q}\.weight_scale_inv' has shape \[2, 2\]; fp8 .* stores it as \[2, 1\]",
        ),
        (
            lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale_inv"].clone()}),
            rf"unexpected tensor '{Q}\.weight_scale'",
        ),
        (
            lambda t: t.update({"lm_head.weight_scale_inv": torch.ones(5, 1, dtype=BF16)}),
            r"tensor 'lm_head\.weight' is BF16; fp8 e4m3 128x128 blocks stores it as F8_E4M3",
        ),
    ],
    ids=["no-scale", "f32-scale", "scale-shape", "compressed-tensors-name", "lm-head"],
)
def test_broken_tensors_are_refused(edit, message, hostile, tmp_path):
    rewrite_tensors(hostile, edit)
    with pytest.raises(CheckpointError, match=message):
        compile_to(hostile, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_zero_block_scale_is_refused_naming_the_block(hostile, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight_scale_inv"  # [2, 1]

    def edit(tensors):
        scale = tensors[name].clone()
        scale[1, 0] = 0
        tensors[name] = scale

    rewrite_tensors(hostile, edit)
    with pytest.raises(TensorValueError, match=rf"tensor '{name}' holds 0\.0 at index \[1, 0\]"):
        compile_to(hostile, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert json.loads((hostile / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"


def test_export_turns_qwen_fp8_into_compressed_tensors_losslessly(qwen, tmp_path):
    """Qwen's layout in, compressed-tensors FP8_BLOCK out (`qcompile export`): the exported checkpoint
    transcodes back to the same artifact, its weight_scale the checkpoint's weight_scale_inv."""
    from qcompile.publish.export import export_compressed_tensors

    art = compile_to(qwen["moe"], tmp_path / "art")
    export_compressed_tensors(art, tmp_path / "exported", progress=False)
    config = json.loads((tmp_path / "exported" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "float-quantized"
    exported, stored = read_tensors(tmp_path / "exported"), read_tensors(qwen["moe"])
    name = "model.layers.0.mlp.experts.5.down_proj.weight"
    assert torch.equal(exported[name + "_scale"], stored[name + "_scale_inv"])
    assert_same_artifact(compile_to(tmp_path / "exported", tmp_path / "again"), art)
