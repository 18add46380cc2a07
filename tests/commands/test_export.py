"""`qcompile export ART --format compressed-tensors -o DIR`, end to end.

Parity: the exported safetensors equal, name for name and byte for byte, what llm-compressor writes
for the same checkpoint and scheme (model_free_ptq; oneshot for a tied FP8 lm_head and for the
KV-cache scales), and config.json's quantization_config is theirs, parsed with compressed-tensors.
A bf16 export is the source checkpoint itself.

Loading: transformers (with compressed-tensors) loads every export and runs it in FP8 — fake-quant:
the FP8 weights dequantized, activations quantized at run time as the config says, K/V through the
exported k_scale / v_scale — and its logits match our runtime's (reference backend), both in float32,
prompt by prompt:

- EXACT where both sides do the same math (dense models with any weight scheme; bf16; an fp8 KV
  cache whose scales are bf16 values): at least half of all positions agree to float32 rounding
  (>= EXACT_DB, measured 110-135 dB; a different activation scheme or scale leaves none). Not all:
  the two sum in a different order, and where a float32 difference lands an activation on the other
  side of an fp8 rounding boundary (~2e-5 per quantized element: the relative float32 difference over
  fp8's 1/8-1/16 step) the positions after it move to 30-80 dB. Measured 88-100% exact.
- Every prompt, and the rest throughout, within FP8_DB: where transformers itself differs by
  fp8-level rounding — MoE experts (transformers 5 merges the per-expert FP8 weights into bf16 3-D
  tensors, bf16(fp8 x scale), checked exactly below, and runs them without activation quantization,
  where we and vLLM quantize per token) and calibrated fp8 KV (the exported scales are bf16, as
  llm-compressor stores them; our runtime uses the manifest's float32 scale). Measured 25-32 dB per
  prompt; 20 dB is about one round of fp8 noise (e4m3 rounds to 3 mantissa bits: ~3.6% RMS relative
  error, ~29 dB per quantized tensor, less through a stack of them), while a wrong or misplaced scale
  gives under 5 dB. The export is also far (< 40 dB) from the bf16 source model on both sides.

In bf16 (transformers' default dtype) the export's logits sit 26-45 dB from ours: bf16 rounding of
every activation, not the export. Every run synthesizes checkpoints with a fresh random seed.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import qruntime
import torch
from click.testing import CliRunner
from compressed_tensors.quantization import QuantizationArgs
from llmc_reference import (
    ATTN_ULPS,
    IGNORE,
    LMHEAD_IGNORE,
    MODEL_FREE_IGNORE,
    OBSERVER,
    SIZE128,
    TENSOR_FP8,
    assert_identical,
    bf16_ulps,
    cached_runs,
    group_dicts,
    ignored_modules,
    linear_modules,
    quantization_config,
    read_tensors,
    run_model_free,
    run_oneshot,
)
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from safetensors import safe_open
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

import qcompile.compile.pipeline
import qcompile.publish.export
from qcompile.cli import main
from qcompile.compile.calibrate import calibration_ids
from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import load_recipe
from qcompile.source.checkpoint import Checkpoint

BF16, FP8, F32 = torch.bfloat16, torch.float8_e4m3fn, torch.float32
EXACT_DB = 100.0
FP8_DB = 20.0
PROMPTS, PROMPT_LEN = 6, 12
KV = ("k_scale", "v_scale")
KV_SCHEME = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
CHECKPOINTS = {  # kind -> synth preset, config overrides
    "dense": ("tiny", {}),
    "tied": ("tiny-tied", {}),
    "moe": ("tiny-moe", {}),
    "dense128": ("tiny", {**SIZE128, "intermediate_size": 256}),  # fused block-fp8 needs 128-row parts
    "moe128": ("tiny-moe", {**SIZE128, "intermediate_size": 256, "moe_intermediate_size": 128}),
}


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def sqnr(reference: torch.Tensor, other: torch.Tensor) -> float:
    return float(10 * torch.log10(reference.pow(2).mean() / (other - reference).pow(2).mean()))


def beside(parent: Path, name: str) -> list[str]:
    """Anything at the output path or a temp dir beside it."""
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------ cached runs


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("export")


@pytest.fixture(scope="module")
def ckpt(make_ckpt: Callable[..., Path]) -> Callable[[str], Path]:
    """`ckpt(kind) -> checkpoint dir`, fresh random weights every run (the seed is printed)."""
    seed = random.randrange(2**31)
    print(f"checkpoint seed {seed}")
    return lambda kind: make_ckpt(CHECKPOINTS[kind][0], seed=seed, **CHECKPOINTS[kind][1])


@pytest.fixture(scope="module")
def calib(work: Path) -> Path:
    words = ["def", "return", "self", "import", "class", "(", ")", ":", "x", "=", "+", "1", "for", "in", "\n"]
    path = work / "calib.txt"
    path.write_text(" ".join(random.choice(words) for _ in range(3000)))
    return path


def _bf16_scales(real: Callable[..., Any]) -> Callable[..., Any]:
    """kv_scales whose float32 scales are rounded to bf16 values (what the export stores)."""

    def rounded(*args, **kwargs):
        scales = real(*args, **kwargs)
        as_bf16 = lambda values: tuple(float(torch.tensor(v).to(BF16)) for v in values)  # noqa: E731
        return dataclasses.replace(scales, k_scale=as_bf16(scales.k_scale), v_scale=as_bf16(scales.v_scale))

    return rounded


@pytest.fixture(scope="module")
def artifact(ckpt, calib: Path, work: Path) -> Callable[..., Path]:
    """`artifact(kind, recipe, bf16_kv=False) -> artifact dir`; kv8 recipes calibrate on `calib`;
    bf16_kv: with the calibrated scales rounded to bf16 before they are stored."""
    built: dict[tuple, Path] = {}

    def get(kind: str, recipe: str, bf16_kv: bool = False) -> Path:
        key = (kind, recipe, bf16_kv)
        if key not in built:
            out = work / f"art-{len(built)}-{kind}-{recipe}"
            with pytest.MonkeyPatch.context() as patch:
                if bf16_kv:
                    patch.setattr(
                        qcompile.compile.pipeline, "kv_scales", _bf16_scales(qcompile.compile.pipeline.kv_scales)
                    )
                data = calib if recipe.endswith("kv8") else None
                compile_checkpoint(prepare(ckpt(kind), load_recipe(recipe), data), out, workers=2, progress=False)
            built[key] = out
        return built[key]

    return get


@pytest.fixture(scope="module")
def exported(artifact, work: Path) -> Callable[..., Path]:
    """`exported(kind, recipe, bf16_kv=False) -> export dir`, through the CLI."""
    built: dict[tuple, Path] = {}

    def get(kind: str, recipe: str, bf16_kv: bool = False) -> Path:
        key = (kind, recipe, bf16_kv)
        if key not in built:
            out = work / f"ct-{len(built)}-{kind}-{recipe}"
            result = run("export", artifact(*key), "--format", "compressed-tensors", "-o", out, "--no-progress")
            assert result.exit_code == 0, result.output
            built[key] = out
        return built[key]

    return get


@pytest.fixture(scope="module")
def model_free(work: Path) -> Callable[..., Path]:
    return cached_runs(work, "model-free", run_model_free)


@pytest.fixture(scope="module")
def one_shot(work: Path) -> Callable[..., Path]:
    return cached_runs(work, "oneshot", run_oneshot)


def assert_same_quantization(ours_dir: Path, ref_dir: Path, ckpt: Path, drop: tuple[str, ...] = ()) -> dict:
    """Both quantization_configs parse with compressed-tensors and say the same; returns the rest of
    our config.json."""
    ours, rest = quantization_config(ours_dir)
    theirs, _ = quantization_config(ref_dir)
    assert (ours.format, ours.quant_method, ours.quantization_status) == (
        theirs.format,
        theirs.quant_method,
        theirs.quantization_status,
    )
    assert ours.kv_cache_scheme == theirs.kv_cache_scheme
    assert group_dicts(ours, drop) == group_dicts(theirs, drop)
    modules = linear_modules(ckpt)
    assert ignored_modules(ours, modules) == ignored_modules(theirs, modules)
    return rest


# ---------------------------------------------------------------------- parity with llm-compressor


@pytest.mark.parametrize(
    ("kind", "recipe", "scheme", "ignore"),
    [
        ("dense", "ptpc-fp8", "FP8_DYNAMIC", MODEL_FREE_IGNORE),
        ("tied", "ptpc-fp8", "FP8_DYNAMIC", MODEL_FREE_IGNORE),
        ("moe", "ptpc-fp8", "FP8_DYNAMIC", MODEL_FREE_IGNORE),
        ("dense", "tensor-fp8", TENSOR_FP8, MODEL_FREE_IGNORE),
        ("moe", "tensor-fp8", TENSOR_FP8, MODEL_FREE_IGNORE),
        ("dense128", "block-fp8", "FP8_BLOCK", MODEL_FREE_IGNORE),
        ("moe128", "block-fp8", "FP8_BLOCK", MODEL_FREE_IGNORE),
        ("dense", "ptpc-fp8-lmhead", "FP8_DYNAMIC", LMHEAD_IGNORE),
    ],
)
def test_export_equals_model_free_ptq(kind, recipe, scheme, ignore, ckpt, exported, model_free):
    """Every tensor byte for byte; config.json the same: the source's, with an equal quantization_config."""
    out, ref = exported(kind, recipe), model_free(ckpt(kind), scheme, tuple(ignore))
    ours = read_tensors(out)
    assert_identical(ours, read_tensors(ref))
    assert any(t.dtype == FP8 for t in ours.values())
    assert assert_same_quantization(out, ref, ckpt(kind)) == quantization_config(ref)[1]
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()


def test_tied_fp8_lm_head_equals_oneshot(ckpt, exported, one_shot):
    """llm-compressor unties a tied model whose lm_head it quantizes: a bf16 embedding table, an FP8
    lm_head.weight with its scale, and `tie_word_embeddings: false`. So does the export."""
    out, ref = exported("tied", "ptpc-fp8-lmhead"), one_shot(ckpt("tied"), "FP8_DYNAMIC", ("re:.*mlp.gate$",))
    ours = read_tensors(out)
    assert ours["lm_head.weight"].dtype == FP8 and ours["lm_head.weight_scale"].shape == (544, 1)
    assert ours["model.embed_tokens.weight"].dtype == BF16
    assert_identical(ours, read_tensors(ref))
    rest = assert_same_quantization(out, ref, ckpt("tied"), drop=OBSERVER)
    source = json.loads((ckpt("tied") / "config.json").read_text())
    assert source["tie_word_embeddings"] is True and quantization_config(ref)[1]["tie_word_embeddings"] is False
    assert rest == {**source, "tie_word_embeddings": False}


def _oneshot_kv(ckpt: Path, out: Path, ids: torch.Tensor) -> None:
    """llm-compressor: FP8_DYNAMIC weights and a static per-tensor FP8 kv_cache_scheme, calibrated on
    `ids` [N, T] in one batch."""
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=BF16)
    loader = DataLoader([{"input_ids": row} for row in ids], batch_size=len(ids))
    modifier = QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=IGNORE, kv_cache_scheme=KV_SCHEME)
    oneshot(model=model, dataset=loader, recipe=modifier)
    model.save_pretrained(out, save_compressed=True)


def test_kv8_equals_oneshot_with_kv_cache_scheme(ckpt, artifact, exported, calib, work):
    """k_scale / v_scale as llm-compressor names and stores them (`model.layers.{i}.self_attn.k_scale`,
    bf16, [1]), holding the manifest's calibrated scales; calibrated by both on the same token
    windows they agree to the bf16 steps of tests/test_kv_calibration_llmc.py."""
    source, out = ckpt("dense"), exported("dense", "ptpc-fp8-kv8")
    ref = work / "oneshot-kv"
    _oneshot_kv(source, ref, calibration_ids(Checkpoint.open(source), calib, 512, 64))  # compile's defaults
    ours, theirs = read_tensors(out), read_tensors(ref)
    names = {f"model.layers.{i}.self_attn.{kind}" for i in range(2) for kind in KV}
    assert {n for n in theirs if n.endswith(KV)} == names
    assert_identical(
        {n: t for n, t in ours.items() if n not in names}, {n: t for n, t in theirs.items() if n not in names}
    )
    scales = json.loads((artifact("dense", "ptpc-fp8-kv8") / "manifest.json").read_text())["kv_cache"]["scales"]
    assert scales["calibrated"] is True
    for name in sorted(names):
        layer, kind = int(name.split(".")[2]), name.rsplit(".", 1)[1]
        assert ours[name].dtype == theirs[name].dtype == BF16 and ours[name].shape == theirs[name].shape == (1,)
        assert torch.equal(ours[name], torch.tensor([scales[kind][layer]]).to(BF16))
        limit = 0 if layer == 0 else ATTN_ULPS
        assert bf16_ulps(float(ours[name]), float(theirs[name])) <= limit, name
    assert_same_quantization(out, ref, source, drop=OBSERVER)
    assert quantization_config(out)[0].kv_cache_scheme.strategy == "tensor"


def test_kv8_moe_weights_equal_model_free_ptq(ckpt, exported, model_free):
    out = exported("moe", "ptpc-fp8-kv8")
    ours = read_tensors(out)
    kv = {n for n in ours if n.endswith(KV)}
    assert len(kv) == 2 * 3 and all(ours[n].dtype == BF16 and ours[n].shape == (1,) for n in kv)
    assert_identical(
        {n: t for n, t in ours.items() if n not in kv},
        read_tensors(model_free(ckpt("moe"), "FP8_DYNAMIC", tuple(MODEL_FREE_IGNORE))),
    )


@pytest.mark.parametrize("kind", ["dense", "tied", "moe"])
def test_bf16_export_is_the_source_checkpoint(kind, ckpt, exported):
    out = exported(kind, "bf16")
    assert_identical(read_tensors(out), read_tensors(ckpt(kind)))
    assert json.loads((out / "config.json").read_text()) == json.loads((ckpt(kind) / "config.json").read_text())


def test_bf16_weights_with_fp8_kv_equal_oneshot_kv_only(ckpt, calib, work, tmp_path):
    """Unquantized weights, calibrated fp8 KV cache: llm-compressor's kv_cache_scheme alone (no config
    groups, format "dense") and the source tensors plus each layer's k_scale / v_scale."""
    source, art, out = ckpt("dense"), tmp_path / "art", tmp_path / "ct"
    kv = ("--set", "kv_cache.dtype=fp8_e4m3", "--set", "kv_cache.calibrate=true", "--calib", calib)
    assert run("compile", source, "-o", art, "-q", "--recipe", "bf16", *kv).exit_code == 0
    assert run("export", art, "-o", out, "--no-progress").exit_code == 0
    model = AutoModelForCausalLM.from_pretrained(source, dtype=BF16)
    ids = calibration_ids(Checkpoint.open(source), calib, 512, 64)
    loader = DataLoader([{"input_ids": row} for row in ids], batch_size=len(ids))
    oneshot(model=model, dataset=loader, recipe=QuantizationModifier(targets=[], kv_cache_scheme=KV_SCHEME))
    ref = work / "oneshot-kv-only"
    model.save_pretrained(ref, save_compressed=True)
    ours, theirs = read_tensors(out), read_tensors(ref)
    names = {n for n in theirs if n.endswith(KV)}
    assert len(names) == 4 and names == {n for n in ours if n.endswith(KV)}
    assert_identical({n: t for n, t in ours.items() if n not in names}, read_tensors(source))
    assert all(ours[n].dtype == theirs[n].dtype == BF16 and ours[n].shape == theirs[n].shape == (1,) for n in names)
    rest = assert_same_quantization(out, ref, source)
    assert quantization_config(out)[0].config_groups == {} and rest == json.loads((source / "config.json").read_text())


# ---------------------------------------------------------------------- transformers loads and runs it


def assert_loaded_in_fp8(model, out: Path) -> None:
    """Before the first forward: each quantized linear holds the exported FP8 weight and its scale,
    with the config's scheme attached; MoE experts (merged by transformers into 3-D bf16 tensors) hold
    exactly bf16(fp8 x scale) of the exported per-expert tensors."""
    tensors = read_tensors(out)
    fp8 = sorted(n.removesuffix(".weight") for n, t in tensors.items() if t.dtype == FP8)
    experts: dict[str, list[str]] = {}
    for name in fp8:
        if ".mlp.experts." in name:
            experts.setdefault(name.split(".mlp.experts.")[0], []).append(name)
            continue
        module = model.get_submodule(name)
        assert module.weight.dtype == FP8 and torch.equal(
            module.weight.view(torch.uint8), tensors[name + ".weight"].view(torch.uint8)
        )
        assert torch.equal(
            module.weight_scale.float(), tensors[name + ".weight_scale"].float()
        )  # bf16 to float32: exact
        assert module.quantization_scheme.input_activations.dynamic is True
    for layer in experts:
        merged = model.get_submodule(layer + ".mlp.experts")
        for e in range(merged.gate_up_proj.shape[0]):
            parts = [_dequantize(tensors, f"{layer}.mlp.experts.{e}.{p}") for p in ("gate_proj", "up_proj")]
            assert torch.equal(merged.gate_up_proj[e], torch.cat(parts).to(BF16))
            assert torch.equal(merged.down_proj[e], _dequantize(tensors, f"{layer}.mlp.experts.{e}.down_proj").to(BF16))
    for name, t in tensors.items():
        if name.endswith(KV):
            attention, kind = name.rsplit(".", 1)
            assert model.get_submodule(attention).get_parameter(kind).detach().item() == t.item()


def _dequantize(tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """fp8 x scale in float32 (exact: 4 x 8 significant bits), scales broadcast per row, tensor or 128 x 128 tile."""
    w, s = tensors[module + ".weight"].float(), tensors[module + ".weight_scale"].float()
    if s.numel() > 1 and s.shape[0] != w.shape[0]:  # block scales: one per 128 x 128 tile
        s = s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
    return w * s


def position_db(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """SQNR in dB of each position's logits [T, V] -> [T] (inf where equal)."""
    return 10 * torch.log10(reference.pow(2).mean(-1) / (other - reference).pow(2).mean(-1))


@pytest.mark.parametrize(
    ("kind", "recipe", "bf16_kv", "exact"),
    [
        ("dense", "ptpc-fp8", False, True),
        ("dense", "tensor-fp8", False, True),
        ("dense128", "block-fp8", False, True),
        ("dense", "ptpc-fp8-lmhead", False, True),
        ("tied", "ptpc-fp8-lmhead", False, True),
        ("dense", "ptpc-fp8-kv8", True, True),
        ("dense", "bf16", False, True),
        ("moe", "bf16", False, True),
        ("dense", "ptpc-fp8-kv8", False, False),
        ("moe", "ptpc-fp8", False, False),
        ("moe", "tensor-fp8", False, False),
        ("moe128", "block-fp8", False, False),
        ("moe", "ptpc-fp8-kv8", False, False),
    ],
)
def test_transformers_runs_the_export_like_our_runtime(kind, recipe, bf16_kv, exact, ckpt, artifact, exported):
    """PROMPTS random prompts, one forward each on both sides (per-tensor activation scales span a
    step's tokens, so no batching). Every prompt within FP8_DB; `exact`: at least half of all
    positions equal to float32 rounding (EXACT_DB), where a different activation scheme or scale
    would leave none."""
    art, out = artifact(kind, recipe, bf16_kv), exported(kind, recipe, bf16_kv)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=F32).eval()
    assert_loaded_in_fp8(model, out)
    source = AutoModelForCausalLM.from_pretrained(ckpt(kind), dtype=F32).eval()
    engine = qruntime.load(art, device="cpu", dtype=F32, backend="reference")
    positions, far_from_source = [], []
    for ids in torch.randint(0, 500, (PROMPTS, PROMPT_LEN)):
        with torch.no_grad():
            theirs = model(ids[None]).logits[0].float()
            reference = source(ids[None]).logits[0].float()
        ours = engine.score(ids.tolist()).float()
        assert sqnr(ours, theirs) >= FP8_DB, f"{sqnr(ours, theirs):.1f} dB on prompt {ids.tolist()}"
        positions.append(position_db(ours, theirs))
        far_from_source.append(sqnr(reference, theirs) < 40 and sqnr(reference, ours) < 40)
    exact_share = float((torch.cat(positions) >= EXACT_DB).float().mean())
    if exact:
        assert exact_share >= 0.5, f"only {exact_share:.0%} of positions agree to float32 rounding"
    if recipe != "bf16":  # the FP8 rounding is really there: far from the source model in float32
        assert all(far_from_source)


# ------------------------------------------------------------------------------ layout and errors


def test_max_shard_size_writes_indexed_shards(artifact, exported, tmp_path):
    art, single = artifact("moe", "ptpc-fp8"), exported("moe", "ptpc-fp8")
    out = tmp_path / "sharded"
    result = run("export", art, "-o", out, "--max-shard-size", "20kB", "--no-progress")
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 3 and files == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = read_tensors(out)
    assert index["weight_map"] == {n: index["weight_map"][n] for n in sorted(tensors)}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for file in files:
        with safe_open(str(out / file), framework="pt") as handle:
            names = set(handle.keys())
            assert handle.metadata() == {"format": "pt"}
        assert names == {n for n, f in index["weight_map"].items() if f == file}
        weights = {n for n in names if not n.endswith("_scale")}
        assert all(n + "_scale" in names for n in weights if tensors[n].dtype == FP8)  # a weight beside its scale
        if len(weights) > 1:
            assert sum(tensors[n].numel() * tensors[n].element_size() for n in names) <= 20_000
    assert_identical(tensors, read_tensors(single))
    ids = torch.randint(0, 500, (1, 16))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(out, dtype=F32)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(single, dtype=F32)(ids).logits
    assert torch.equal(a, b)


def test_side_files_and_readme(ckpt, calib, tmp_path):
    source = tmp_path / "src"
    shutil.copytree(ckpt("dense"), source)
    (source / "LICENSE").write_text(f"license text {random.random()}\n")
    (source / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    art, out = tmp_path / "art", tmp_path / "ct"
    assert run("compile", source, "-o", art, "-q", "--recipe", "ptpc-fp8-kv8", "--calib", calib).exit_code == 0
    result = run("export", art, "-o", out, "--no-progress")
    assert result.exit_code == 0 and f"wrote {out}" in result.output, result.output
    manifest = json.loads((art / "manifest.json").read_text())
    for name in ("LICENSE", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (art / name).read_bytes() == (source / name).read_bytes()
    readme = (out / "README.md").read_text()
    assert readme.startswith("---\n") and "license: apache-2.0" in readme
    assert manifest["source"]["fingerprint"] in readme and "`ptpc-fp8-kv8`" in readme and "calibrated" in readme
    assert not {"graph.onnx", "manifest.json", "weights"} & {p.name for p in out.iterdir()}


@pytest.fixture
def art_copy(artifact, tmp_path) -> Path:
    path = tmp_path / "art"
    shutil.copytree(artifact("dense", "ptpc-fp8"), path)
    return path


def test_tampered_artifact_is_refused_and_dir_untouched(art_copy, tmp_path):
    shard = next((art_copy / "weights").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1 - random.randrange(1000)] ^= 0x01
    shard.write_bytes(bytes(data))
    out = tmp_path / "ct"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for extra in ((), ("--force",)):
        result = run("export", art_copy, "-o", out, "--no-progress", *extra)
        assert result.exit_code == 1
        message = result.output.strip()
        if extra:
            assert message.startswith(f"error: {shard}: sha256 does not match the manifest")
            assert "not exported" in message and message.count("\n") == 0
        else:
            assert "already exists; pass --force" in message
        assert tree(out) == {"keep.txt": b"mine"} and beside(tmp_path, "ct") == ["ct"]


def test_existing_dir_needs_force(art_copy, tmp_path):
    out = tmp_path / "ct"
    out.mkdir()
    (out / "old.txt").write_text("old")
    refused = run("export", art_copy, "-o", out, "--no-progress")
    assert refused.exit_code == 1 and f"error: {out}: already exists; pass --force to replace it" in refused.output
    assert tree(out) == {"old.txt": b"old"}
    replaced = run("export", art_copy, "-o", out, "--no-progress", "--force")
    assert replaced.exit_code == 0, replaced.output
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    assert beside(tmp_path, "ct") == ["ct"]


def test_tp_artifact_is_refused(art_copy, tmp_path):
    manifest = json.loads((art_copy / "manifest.json").read_text())
    # a well-formed tp=2 manifest (graph.files, per-rank entries; the ranks share tp=1's files here)
    graph = manifest["graph"] | {"files": [manifest["graph"]["file"]] * 2}
    tensors = {
        name: {k: v for k, v in info.items() if k != "file"}
        | {"axis": None, "ranks": [{"file": info["file"], "shape": info["shape"]}] * 2}
        for name, info in manifest["tensors"].items()
    }
    (art_copy / "manifest.json").write_text(json.dumps({**manifest, "tp": 2, "graph": graph, "tensors": tensors}))
    result = run("export", art_copy, "-o", tmp_path / "ct", "--no-progress")
    assert result.exit_code == 1 and "tp=2" in result.output and "not supported yet" in result.output
    assert beside(tmp_path, "ct") == []


def test_bad_arguments_are_refused(art_copy, tmp_path):
    fmt = run("export", art_copy, "-o", tmp_path / "ct", "--format", "gguf")
    assert fmt.exit_code == 2 and "Invalid value for '--format'" in fmt.output and "compressed-tensors" in fmt.output
    size = run("export", art_copy, "-o", tmp_path / "ct", "--max-shard-size", "lots")
    assert size.exit_code == 2 and "--max-shard-size" in size.output
    before = tree(art_copy)
    for target in (art_copy, tmp_path):  # --force would delete the artifact it reads
        itself = run("export", art_copy, "-o", target, "--force", "--no-progress")
        assert itself.exit_code == 1 and "would replace the artifact it reads" in itself.output
    assert tree(art_copy) == before
    missing = run("export", tmp_path / "nothing", "-o", tmp_path / "ct")
    assert missing.exit_code == 1 and f"{tmp_path / 'nothing'}: artifact directory not found" in missing.output
    assert beside(tmp_path, "ct") == []


def test_interrupt_leaves_nothing(art_copy, tmp_path, monkeypatch):
    calls = []
    write = qcompile.publish.export.StreamingWriter.write

    def interrupted(self, *args):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        write(self, *args)

    monkeypatch.setattr(qcompile.publish.export.StreamingWriter, "write", interrupted)
    result = run("export", art_copy, "-o", tmp_path / "ct", "--no-progress")
    assert result.exit_code == 130 and "interrupted" in result.output
    assert beside(tmp_path, "ct") == []


def test_help_explains_the_format():
    result = run("export", "--help")
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for word in (
        "compressed-tensors",
        "llm-compressor",
        "transformers",
        "vLLM",
        "SGLang",
        "--max-shard-size",
        "--force",
    ):
        assert word in text
    assert "export" in run("--help").output
