"""Compile targets (qruntime.target, `qcompile compile --target`): an amd-gfx942 artifact stores its
FP8 weights as float8_e4m3fnuz — the nvidia-sm90 artifact's codes (0x80 as 0x00) with the scales
doubled — so every weight dequantizes to the same value, and on the reference ops the two artifacts
give the same logits bit for bit. A GPU of another family is refused at load, naming both."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import qruntime
import qruntime.loader
import torch
from qruntime.target import TARGETS, TargetMismatch, check_device, to_e4m3fnuz
from safetensors import safe_open

from qcompile.compile.pipeline import prepare
from qcompile.errors import PlanError
from qcompile.publish.export import ExportError, export_compressed_tensors
from qcompile.recipe.schema import RecipeError, load_recipe

AMD = ("target=amd-gfx942",)


def test_every_e4m3fn_code_dequantizes_to_the_same_value_as_e4m3fnuz(rng):
    """All 256 bit patterns, each under random bf16 scales: fnuz(code) * 2s == fn(code) * s for every
    finite code (e4m3fn's two NaNs are never written: the quantizer clamps to +-448)."""
    rows = 64
    codes = torch.arange(256, dtype=torch.uint8).repeat(rows, 1).view(torch.float8_e4m3fn)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    scale = (torch.rand(rows, 1, generator=gen) * 10.0 ** torch.randint(-6, 2, (rows, 1), generator=gen)).bfloat16()
    fnuz, doubled = to_e4m3fnuz(codes, scale)
    assert fnuz.dtype == torch.float8_e4m3fnuz and doubled.dtype == torch.bfloat16
    assert torch.equal(doubled.float(), scale.float() * 2)  # exact: a power of two
    want, got = codes.float() * scale.float(), fnuz.float() * doubled.float()
    finite = torch.isfinite(want)
    assert int(finite[0].sum()) == 254 and torch.equal(got[finite], want[finite])
    raw = fnuz.view(torch.uint8)[0]
    assert raw[0x80] == 0 and torch.equal(
        raw[torch.arange(256) != 0x80], torch.arange(256)[torch.arange(256) != 0x80].to(torch.uint8)
    )
    assert not torch.isnan(fnuz.float()).any()  # 0x80, fnuz's NaN, is never written
    with pytest.raises(ValueError, match="float8_e4m3fn codes"):
        to_e4m3fnuz(fnuz, scale)


def _tensors(art: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(art.glob("weights/*.safetensors")):
        with safe_open(path, "pt") as f:
            out |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
    return out


@pytest.mark.parametrize("preset,recipe", [("tiny", "ptpc-fp8"), ("tiny-moe", "tensor-fp8")])
def test_the_amd_artifact_holds_the_same_weights_and_gives_the_same_logits(make_ckpt, compiled, preset, recipe):
    ckpt = make_ckpt(preset)
    nvidia, amd = compiled(ckpt, recipe), compiled(ckpt, recipe, *AMD)
    manifests = [json.loads((art / "manifest.json").read_text()) for art in (nvidia, amd)]
    assert [m["target"] for m in manifests] == ["nvidia-sm90", "amd-gfx942"]
    assert "target" not in manifests[0]["recipe"] and manifests[1]["recipe"]["target"] == "amd-gfx942"
    ours, theirs = _tensors(nvidia), _tensors(amd)
    assert ours.keys() == theirs.keys()
    fp8 = [name for name, t in ours.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) >= 4  # every quantized linear (and the experts, stacked)
    for name, t in ours.items():
        other = theirs[name]
        if name in fp8:
            assert other.dtype == torch.float8_e4m3fnuz
            assert torch.equal(
                other.view(torch.uint8), torch.where(t.view(torch.uint8) == 0x80, 0, t.view(torch.uint8))
            )
            scale = name.removesuffix(".weight") + ".weight_scale"
            assert torch.equal(theirs[scale].float(), ours[scale].float() * 2), scale
            assert manifests[1]["tensors"][name]["dtype"] == "F8_E4M3FNUZ"
        elif not name.endswith(".weight_scale"):
            assert torch.equal(other, t), name  # norms, embeddings, router: as they are
    prompt = [random.randrange(1, 200) for _ in range(random.randrange(5, 12))]
    logits = []
    for art in (nvidia, amd):
        with qruntime.load(art, device="cpu", backend="reference", dtype=torch.float32) as engine:
            logits.append(engine.score(prompt))
            params = qruntime.SamplingParams(max_tokens=8, ignore_eos=True)
            logits.append(engine.generate([prompt], params)[0].token_ids)
    assert torch.equal(logits[0], logits[2]) and logits[1] == logits[3], prompt


def test_a_gpu_of_another_family_is_refused_naming_both(make_ckpt, compiled, monkeypatch):
    amd, nvidia = TARGETS["amd-gfx942"], TARGETS["nvidia-sm90"]
    check_device(amd, ("amd", "gfx942"), "art")
    check_device(amd, None, "art")  # the CPU runs every target
    for found in (("nvidia", "sm90"), ("nvidia", "sm100"), ("amd", "gfx950"), ("amd", "gfx90a")):
        with pytest.raises(TargetMismatch, match=rf"compiled for amd-gfx942 .* this GPU is {found[0]} {found[1]}"):
            check_device(amd, found, "art")
    check_device(nvidia, ("nvidia", "sm90"), "art")
    check_device(nvidia, ("nvidia", "sm89"), "art")  # an NVIDIA target's kernels compile where they run
    with pytest.raises(TargetMismatch, match=r"compiled for nvidia-sm90 .* amd gfx942; .*--target amd-gfx942"):
        check_device(nvidia, ("amd", "gfx942"), "art")
    # at load: the artifact's manifest against the device
    art = compiled(make_ckpt("tiny"), "ptpc-fp8", *AMD)
    monkeypatch.setattr(qruntime.loader, "device_target", lambda device: ("nvidia", "sm90"))
    with pytest.raises(TargetMismatch, match=rf"{art}: compiled for amd-gfx942 .* this GPU is nvidia sm90"):
        qruntime.load(art, device="cpu", backend="reference")


def test_the_kv_layout_is_the_targets_unless_the_recipe_names_one(make_ckpt, compiled):
    """`kv_cache.layout: auto` (the shipped recipes) or none: nhd for nvidia-sm90, AITER's x-packed
    (K [blocks, kv_heads, head_dim/x, block_size, x], x = 16 bytes of bf16) for amd-gfx942; a
    layout the recipe names is kept. The amd artifact's greedy tokens equal the nvidia one's."""
    from qcompile.recipe.schema import recipe_from_dict

    assert load_recipe("ptpc-fp8").kv_cache.layout == "nhd"
    assert load_recipe("ptpc-fp8", AMD).kv_cache.layout == "x-packed"
    assert load_recipe("ptpc-fp8", [*AMD, "kv_cache.layout=hnd"]).kv_cache.layout == "hnd"
    assert recipe_from_dict({"target": "amd-gfx942"}).kv_cache.layout == "x-packed"  # no kv_cache at all
    assert recipe_from_dict({"kv_cache": {"dtype": "bf16"}}).kv_cache.layout == "nhd"
    ckpt = make_ckpt("tiny")
    amd = compiled(ckpt, "ptpc-fp8", *AMD)
    layout = json.loads((amd / "manifest.json").read_text())["kv_cache"]["layout"]
    assert (layout["name"], layout["k_dims"][-3:]) == ("x-packed", ["head_dim/x", "block_size", "x"])
    prompt = [random.randrange(1, 200) for _ in range(9)]
    params = qruntime.SamplingParams(max_tokens=6, ignore_eos=True)
    tokens = []
    for art in (compiled(ckpt, "ptpc-fp8"), amd):
        with qruntime.load(art, device="cpu", backend="reference", dtype=torch.float32) as engine:
            tokens.append(engine.generate([prompt], params)[0].token_ids)
    assert tokens[0] == tokens[1], prompt


def test_an_fp8_kv_cache_in_e4m3fnuz_gives_the_nvidia_artifacts_logits(make_ckpt, compiled):
    """kv_cache.dtype fp8_e4m3 for amd-gfx942: the manifest keeps the e4m3fn scales, the runtime's
    cache stores e4m3fnuz codes (e4m3fn's, -0 as 0) and reads them at twice those scales, so on the
    reference ops the logits of a prompt and of the steps after it equal the nvidia artifact's bit
    for bit (x-packed caches both)."""
    ckpt = make_ckpt("tiny")
    overrides = ("kv_cache.dtype=fp8_e4m3", "kv_cache.layout=x-packed")
    prompt = [random.randrange(1, 200) for _ in range(random.randrange(5, 12))]
    params = qruntime.SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
    results, manifests = [], []
    for target in ((), AMD):
        art = compiled(ckpt, "ptpc-fp8", *overrides, *target)
        manifests.append(json.loads((art / "manifest.json").read_text())["kv_cache"])
        with qruntime.load(art, device="cpu", backend="reference", dtype=torch.float32) as engine:
            pools = engine.runner.kv_cache.k
            assert {p.dtype for p in pools} == {torch.float8_e4m3fnuz if target else torch.float8_e4m3fn}
            out = engine.generate([prompt], params)[0]
            results.append((engine.score(prompt), out.token_ids, out.logprobs))
    assert manifests[0] == manifests[1]  # the same scales, dtype fp8_e4m3: the runtime transcodes
    assert torch.equal(results[0][0], results[1][0]) and results[0][1:] == results[1][1:], prompt


def test_what_the_amd_target_does_not_take_yet_is_refused(make_ckpt, compiled, tmp_path):
    ckpt = make_ckpt("tiny")
    with pytest.raises(RecipeError, match=r"'target' must be one of nvidia-sm90, amd-gfx942, got 'amd-gfx950'"):
        load_recipe("ptpc-fp8", ["target=amd-gfx950"])
    exported = tmp_path / "ct"
    export_compressed_tensors(compiled(ckpt, "ptpc-fp8"), exported, progress=False)  # a pre-quantized input
    with pytest.raises(PlanError, match=r"--target amd-gfx942: .* is pre-quantized"):
        prepare(exported, load_recipe("ptpc-fp8", AMD))
    with pytest.raises(ExportError, match=r"compiled for amd-gfx942 \(float8_e4m3fnuz weights\)"):
        export_compressed_tensors(compiled(ckpt, "ptpc-fp8", *AMD), tmp_path / "ct-amd", progress=False)
    assert not (tmp_path / "ct-amd").exists()
