"""`split_to_sources` is lossless: fusing (qkv, gate_up) and stacking (MoE experts) only moves rows.

Unquantized (recipe bf16), every source tensor comes back with the checkpoint's exact bytes.
Quantized, a fused artifact splits back into exactly the weights and scales of the unfused one.
Besides the session's fixed-seed checkpoints, each check also runs on a copy whose tensors are
fresh random bit patterns (any finite bf16: subnormals, -0, values near the bf16 maximum).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qcompile.errors import ArtifactError
from qcompile.publish.unfuse import split_to_sources

SIZE128 = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}
FUSED_SUFFIXES = (".self_attn.qkv_proj.weight", ".mlp.gate_up_proj.weight")
STACKED_SUFFIXES = (".mlp.experts.w13.weight", ".mlp.experts.w2.weight")

Split = dict[str, tuple[torch.Tensor, torch.Tensor | None]]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def split(artifact: Path) -> Split:
    out: Split = {}
    for name, weight, scale in split_to_sources(artifact):
        assert name not in out, f"split_to_sources yielded {name} twice"
        out[name] = (weight, scale)
    return out


def source_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                tensors[key] = handle.get_tensor(key)
    assert tensors
    return tensors


def manifest_tensors(artifact: Path) -> dict[str, dict]:
    return json.loads((artifact / "manifest.json").read_text())["tensors"]


def random_bits_copy(src: Path, dst: Path) -> Path:
    """A copy of `src` with every tensor replaced by random finite bf16 bit patterns."""
    shutil.copytree(src, dst, copy_function=shutil.copyfile)
    for file in sorted(dst.glob("*.safetensors")):
        tensors = load_file(file)
        for name, t in tensors.items():
            assert t.dtype == torch.bfloat16
            bits = torch.randint(-(2**15), 2**15, t.shape, dtype=torch.int16)
            inf_or_nan = (bits & 0x7F80) == 0x7F80  # all-ones exponent: the compiler rejects these
            tensors[name] = torch.where(inf_or_nan, bits ^ 0x0080, bits).view(torch.bfloat16)
        save_file(tensors, file, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def random_moe_ckpt(tiny_moe_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_bits_copy(tiny_moe_ckpt, tmp_path_factory.mktemp("random-bits") / "moe")


@pytest.fixture(scope="module")
def ckpt128(make_ckpt: Callable[..., Path]) -> Path:
    """Dense, every linear dimension a multiple of 128 (fused block-fp8 needs aligned parts)."""
    return make_ckpt("tiny", **SIZE128, intermediate_size=256)


@pytest.fixture(scope="module")
def moe128(make_ckpt: Callable[..., Path]) -> Path:
    return make_ckpt("tiny-moe", **SIZE128, intermediate_size=256, moe_intermediate_size=128)


@pytest.fixture(scope="module")
def random_moe128(moe128: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_bits_copy(moe128, tmp_path_factory.mktemp("random-bits") / "moe128")


def assert_fused(artifact: Path, moe: bool) -> None:
    """The artifact really holds fused (and, for MoE, stacked) tensors: the split has work to do."""
    tensors = manifest_tensors(artifact)
    for suffix in FUSED_SUFFIXES + (STACKED_SUFFIXES if moe else ()):  # tiny-moe's layer 1 is dense
        assert any(n.endswith(suffix) for n in tensors), f"no {suffix} in {artifact}"
    assert any(info.get("stacked") for info in tensors.values()) == moe


@pytest.mark.parametrize(
    "fixture", ["tiny_ckpt", "tiny_tied_ckpt", "tiny_moe_ckpt", "tiny_odd_ckpt", "random_moe_ckpt"]
)
def test_bf16_split_returns_the_source_bytes(request, fixture, compiled):
    ckpt = request.getfixturevalue(fixture)
    artifact = compiled(ckpt, "bf16")
    assert_fused(artifact, moe="moe" in fixture)
    source = source_tensors(ckpt)
    ours = split(artifact)
    missing, extra = sorted(source.keys() - ours.keys()), sorted(ours.keys() - source.keys())
    assert not missing and not extra, f"missing {missing}, extra {extra}"
    bad = [name for name, tensor in source.items() if not same_bytes(ours[name][0], tensor)]
    assert not bad, f"{len(bad)} tensors differ from the checkpoint: {bad[:10]}"
    assert all(scale is None for _, scale in ours.values())


def assert_same_split(fused: Path, unfused: Path) -> None:
    a, b = split(fused), split(unfused)
    assert a.keys() == b.keys()
    assert not any(n.endswith(FUSED_SUFFIXES + STACKED_SUFFIXES) for n in manifest_tensors(unfused))
    bad = []
    for name, (weight, scale) in b.items():
        other_weight, other_scale = a[name]
        if not same_bytes(other_weight, weight):
            bad.append(f"{name}: weight")
        if (scale is None) != (other_scale is None) or (scale is not None and not same_bytes(other_scale, scale)):
            bad.append(f"{name}: scale")
    assert not bad, f"fused and unfused artifacts split differently: {bad[:10]}"
    assert sum(scale is not None for _, scale in b.values()) > len(b) // 2  # most weights are quantized


@pytest.mark.parametrize(
    "fixture", ["tiny_ckpt", "tiny_tied_ckpt", "tiny_moe_ckpt", "tiny_odd_ckpt", "random_moe_ckpt"]
)
def test_ptpc_fp8_fused_splits_into_the_unfused_artifact(request, fixture, compiled):
    ckpt = request.getfixturevalue(fixture)
    fused = compiled(ckpt, "ptpc-fp8")
    assert_fused(fused, moe="moe" in fixture)
    assert_same_split(fused, compiled(ckpt, "ptpc-fp8-unfused"))


def test_ptpc_fp8_lmhead_fused_splits_into_the_unfused_artifact(tiny_tied_ckpt, compiled):
    """With a tied FP8 lm_head too (made from the embedding; reported as lm_head.weight)."""
    fused = compiled(tiny_tied_ckpt, "ptpc-fp8-lmhead")
    unfused = compiled(tiny_tied_ckpt, "ptpc-fp8-lmhead", "passes=[]")
    assert split(fused)["lm_head.weight"][1] is not None
    assert_same_split(fused, unfused)


@pytest.mark.parametrize("fixture", ["ckpt128", "moe128", "random_moe128"])
def test_block_fp8_fused_splits_into_the_unfused_artifact(request, fixture, compiled):
    ckpt = request.getfixturevalue(fixture)
    fused = compiled(ckpt, "block-fp8")
    assert_fused(fused, moe="moe" in fixture)
    unfused = compiled(ckpt, "block-fp8", "passes=[]")
    assert split(unfused)["model.layers.0.self_attn.k_proj.weight"][1].shape == (1, 1)
    assert_same_split(fused, unfused)


@pytest.mark.parametrize("fixture", ["tiny_moe_ckpt", "tiny_odd_ckpt", "random_moe_ckpt"])
def test_tensor_fp8_fused_splits_into_the_unfused_artifact(request, fixture, compiled):
    """Per-tensor scales: the fused artifact repeats each source's scale on its rows; both split back
    to one [1] scale per source tensor, the same bytes."""
    ckpt = request.getfixturevalue(fixture)
    fused = compiled(ckpt, "tensor-fp8")
    assert_fused(fused, moe="moe" in fixture)
    unfused = compiled(ckpt, "tensor-fp8", "passes=[]")
    assert split(unfused)["model.layers.0.self_attn.k_proj.weight"][1].shape == (1,)
    assert_same_split(fused, unfused)


def test_tensor_fp8_scale_rows_that_differ_are_refused(tiny_ckpt, compiled, tmp_path):
    artifact = tmp_path / "art"
    shutil.copytree(compiled(tiny_ckpt, "tensor-fp8"), artifact)
    name = "model.layers.1.self_attn.qkv_proj.weight_scale"
    file = artifact / manifest_tensors(artifact)[name]["file"]
    tensors = load_file(file)
    tensors[name][3] *= 2  # one row of q_proj's part
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ArtifactError, match=f"{name}: the rows of per-tensor scale part .*q_proj"):
        split(artifact)
