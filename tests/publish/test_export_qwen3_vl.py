"""`qcompile export` of Qwen3-VL artifacts, loaded back by transformers 5.17.

Tiny random Qwen3-VL checkpoints (tests/qwen3_vl_checkpoints.py: dense with a tied head, MoE with its own head and a dense layer;
float32, fresh seeds printed) are saved by transformers, compiled and exported; transformers loads
every export with `from_pretrained` (missing / unexpected / mismatched keys all empty) and runs prompts
with images:

- bf16 (dense and MoE): the export holds the source checkpoint's tensors, name for name and bit for
  bit, and its logits equal the source model's within 1e-5 of the largest.
- FP8 (dense ptpc-fp8 and ptpc-fp8-lmhead; MoE with its experts in the ignore list): transformers
  runs the FP8 weights dequantized with activations quantized per token, as our runtime does:
  at least EXACT_SHARE of all positions of four prompts agree with qruntime's logits on the artifact
  to float32 rounding (>= EXACT_DB; 80% of prompts agree at every position, but where a float32
  difference in the sum order puts an activation on the other side of an fp8 rounding step the
  positions that attend to it move: of 225 prompts, 17 kept under half their positions and one 3%;
  three prompts pooled gave 58-100% in 75 runs and 37% once, in CI, when the bound was 50%) and
  every prompt is within FP8_DB (measured 28-135 dB), while the source model is < SOURCE_DB from
  both (measured 11-29 dB: the fp8 rounding is really there). Broken on purpose: every scale's rows
  reversed gave 8-11 dB per prompt; one linear's scale times 1.01 (layer 1 o_proj) 26-36 dB per
  prompt, which passes FP8_DB, but 0% exact positions.
- A quantized Qwen3-VL-MoE expert is refused (transformers 5.17 cannot load one), and a failed or
  interrupted export leaves nothing at or beside its output.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import qruntime
import torch
from click.testing import CliRunner
from PIL import Image
from qruntime.engine.multimodal import ImagePrompt
from qruntime.vision.preprocess import VisionPreprocessConfig, preprocess_images
from qwen3_vl_checkpoints import END, IMAGE, PREPROCESSOR, START, write_checkpoint
from safetensors import safe_open
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

import qcompile.publish.export
from qcompile.cli import main
from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import Recipe, load_recipe, recipe_from_dict

F32, FP8 = torch.float32, torch.float8_e4m3fn
TOLERANCE = 1e-5
FP8_DB = 20.0
EXACT_DB = 100.0
PROMPTS = 4
EXACT_SHARE = 0.2  # of all positions (broken on purpose: 0%; measured 58-100%, once 37%)
SOURCE_DB = 45.0
SIZES = [(40, 24), (33, 47), (16, 16)]  # (width, height) of the images a prompt may hold
CLASSES = {"dense": Qwen3VLForConditionalGeneration, "moe": Qwen3VLMoeForConditionalGeneration}
NO_EXPERTS = "ptpc-fp8-noexperts"  # ptpc-fp8 with the MoE experts in its ignore list (no_experts_recipe)


def run(*args: Any):
    return CliRunner().invoke(main, [str(a) for a in args])


def sqnr(reference: torch.Tensor, other: torch.Tensor) -> float:
    return float(10 * torch.log10(reference.pow(2).mean() / (other - reference).pow(2).mean()))


def position_db(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """SQNR in dB of each position's logits [T, V] -> [T] (inf where equal)."""
    return 10 * torch.log10(reference.pow(2).mean(-1) / (other - reference).pow(2).mean(-1))


def beside(parent: Path, name: str) -> list[str]:
    """Anything at the output path or a temp dir beside it."""
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))


def tensors(root: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(root / "model.safetensors"), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)


def no_experts_recipe() -> Recipe:
    ignore = ["lm_head", "re:.*mlp.gate$", "re:.*mlp.experts.*"]
    return recipe_from_dict({"name": NO_EXPERTS, "quantization": {"scheme": "ptpc-fp8", "ignore": ignore}}, "test")


# ------------------------------------------------------------------------------ cached runs


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("export-vl")


@pytest.fixture(scope="module")
def source(work: Path):
    """`source(kind) -> (checkpoint dir, transformers model)`: fresh random weights, seed printed."""
    built: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(kind: str) -> tuple[Path, torch.nn.Module]:
        if kind not in built:
            path = work / f"{kind}-ckpt"
            built[kind] = path, write_checkpoint(path, kind)
        return built[kind]

    return get


@pytest.fixture(scope="module")
def artifact(source, work: Path):
    """`artifact(kind, recipe) -> artifact dir` (recipe: a shipped one's name, or NO_EXPERTS)."""
    built: dict[tuple[str, str], Path] = {}

    def get(kind: str, name: str) -> Path:
        key = (kind, name)
        if key not in built:
            out = work / f"art-{kind}-{name}"
            recipe = no_experts_recipe() if name == NO_EXPERTS else load_recipe(name)
            compile_checkpoint(prepare(source(kind)[0], recipe, tokenizer=False), out, workers=1, progress=False)
            built[key] = out
        return built[key]

    return get


@pytest.fixture(scope="module")
def exported(artifact, work: Path):
    """`exported(kind, recipe) -> export dir`, through the CLI."""
    built: dict[tuple[str, str], Path] = {}

    def get(kind: str, recipe: str) -> Path:
        key = (kind, recipe)
        if key not in built:
            out = work / f"ct-{kind}-{recipe}"
            result = run("export", artifact(kind, recipe), "--format", "compressed-tensors", "-o", out, "--no-progress")
            assert result.exit_code == 0, result.output
            built[key] = out
        return built[key]

    return get


def load_export(kind: str, path: Path) -> torch.nn.Module:
    """The export through transformers' from_pretrained, every tensor used: nothing missing or unexpected."""
    model, info = CLASSES[kind].from_pretrained(path, dtype=F32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"], info
    return model.eval()


# ------------------------------------------------------------------------------ prompts


def image_prompt(rng: random.Random) -> ImagePrompt:
    """Text ids, then one to three images (each: vision_start, an image token, vision_end, text)."""
    generator = np.random.default_rng(rng.randrange(1 << 30))
    sizes = rng.sample(SIZES, rng.randint(1, len(SIZES)))
    ids = [rng.randrange(IMAGE) for _ in range(rng.randint(1, 5))]
    for _ in sizes:
        ids += [START, IMAGE, END] + [rng.randrange(IMAGE) for _ in range(rng.randint(1, 4))]
    images = [Image.fromarray(generator.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    return ImagePrompt(ids, images)


def transformers_logits(model: torch.nn.Module, prompt: ImagePrompt) -> torch.Tensor:
    """Logits [T, V] of transformers on the prompt (image tokens expanded), its images preprocessed as
    qruntime does (equal to transformers' own processor: tests/runtime/vision/test_vision_preprocess.py)."""
    vision = preprocess_images(prompt.images, VisionPreprocessConfig.from_dict(PREPROCESSOR))
    counts = (vision.image_grid_thw.prod(-1) // 4).tolist()
    expanded: list[int] = []
    for token in prompt.prompt:
        expanded += [IMAGE] * counts.pop(0) if token == IMAGE else [token]
    ids = torch.tensor(expanded)[None]
    with torch.no_grad():
        return model(
            input_ids=ids,
            pixel_values=vision.pixel_values,
            image_grid_thw=vision.image_grid_thw,
            mm_token_type_ids=(ids == IMAGE).to(torch.int32),
        ).logits[0]


# ------------------------------------------------------------------------------ bf16


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_bf16_export_is_the_source_checkpoint(kind, source, exported, rng):
    """Name for name (transformers' state_dict less the tied head), bit for bit; the same logits."""
    ckpt, model = source(kind)
    out = exported(kind, "bf16")
    ours, theirs = tensors(out), tensors(ckpt)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(ours) == set(model.state_dict()) - tied == set(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    loaded = load_export(kind, out)
    for _ in range(2):
        prompt = image_prompt(rng)
        expected, got = transformers_logits(model, prompt), transformers_logits(loaded, prompt)
        error = float((got - expected).abs().max() / expected.abs().max())
        print(f"max relative error {error:.2e}")
        assert error < TOLERANCE


# ------------------------------------------------------------------------------ fp8


def fp8_linears(model: torch.nn.Module, head: bool) -> set[str]:
    """The Linear modules an FP8 export quantizes: the text model's, and the head if `head`."""
    return {
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and (name.startswith("model.language_model.") or head and name == "lm_head")
    }


@pytest.mark.parametrize(("kind", "recipe"), [("dense", "ptpc-fp8"), ("dense", "ptpc-fp8-lmhead"), ("moe", NO_EXPERTS)])
def test_fp8_export_loads_and_runs_like_our_runtime(kind, recipe, source, artifact, exported, rng):
    """The tensors: transformers' names (the FP8 linears with their weight_scale), the rest as the
    source's bytes; config.json: the source's plus quantization_config; then logits per prompt."""
    ckpt, model = source(kind)
    out = exported(kind, recipe)
    ours = tensors(out)
    head = recipe == "ptpc-fp8-lmhead"  # an FP8 head of the tied embedding: its own lm_head.weight
    linears = fp8_linears(model, head)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings and not head else set()
    assert set(ours) == (set(model.state_dict()) - tied) | {f"{m}.weight_scale" for m in linears}
    assert linears and all(ours[f"{m}.weight"].dtype == FP8 for m in linears)
    reference = tensors(ckpt)  # the tower, embeddings, norms, experts and head as they were
    kept = [name for name in ours if name.rpartition(".")[0] not in linears]
    assert any(n.startswith("model.visual.") for n in kept)
    assert all(torch.equal(ours[n], reference[n]) for n in kept)
    config = json.loads((out / "config.json").read_text())
    source_config = json.loads((ckpt / "config.json").read_text())
    untied = {"tie_word_embeddings": False} if head else {}
    assert {k: v for k, v in config.items() if k != "quantization_config"} == source_config | untied
    ignore = set(config["quantization_config"]["ignore"])
    assert {"re:visual.*", "re:model.visual.*"} <= ignore and ("lm_head" in ignore) != head
    assert json.loads((out / "preprocessor_config.json").read_text()) == PREPROCESSOR

    loaded = load_export(kind, out)
    positions = []
    with qruntime.load(artifact(kind, recipe), device="cpu", dtype=F32, prefix_cache=False) as engine:
        for _ in range(PROMPTS):
            prompt = image_prompt(rng)
            theirs = transformers_logits(loaded, prompt)
            original = transformers_logits(model, prompt)
            logits = engine.score(prompt).float()
            assert logits.shape == theirs.shape
            db, from_source = sqnr(logits, theirs), max(sqnr(original, theirs), sqnr(original, logits))
            each = position_db(logits, theirs)
            moved = (each < EXACT_DB).nonzero()
            first = int(moved[0]) if len(moved) else len(each)
            print(
                f"{db:.1f} dB from qruntime, {from_source:.1f} dB from the source model; exact up to {first}/{len(each)}, {float((each >= EXACT_DB).float().mean()):.0%}"
            )
            assert db >= FP8_DB and from_source < SOURCE_DB
            positions.append(each)
    exact = float((torch.cat(positions) >= EXACT_DB).float().mean())
    print(f"{exact:.0%} of positions within float32 rounding")
    assert exact >= EXACT_SHARE


# ------------------------------------------------------------------------------ refusals, atomicity


def test_quantized_vl_moe_experts_are_refused(artifact, tmp_path):
    result = run("export", artifact("moe", "ptpc-fp8"), "-o", tmp_path / "ct", "--no-progress")
    assert result.exit_code == 1
    assert "mlp.experts.0.gate_proj.weight' is quantized (ptpc-fp8)" in result.output
    assert "stacked mlp.experts.gate_up_proj / down_proj" in result.output and "bf16 recipe" in result.output
    assert beside(tmp_path, "ct") == []


@pytest.mark.parametrize("fail", [KeyboardInterrupt, OSError])
def test_a_failed_export_leaves_nothing(fail, artifact, tmp_path, monkeypatch, rng):
    """Interrupted or failing while writing the stacked experts' rows: nothing at or beside DIR."""
    calls, stop = [], rng.randint(1, 8)  # the stop-th write of an expert's rows
    write = qcompile.publish.export.StreamingWriter.write

    def failing(self, name, *args):
        calls.append(name)
        if sum(".experts." in n for n in calls) == stop:
            raise fail("stopped here")
        write(self, name, *args)

    art = artifact("moe", "bf16")
    monkeypatch.setattr(qcompile.publish.export.StreamingWriter, "write", failing)
    result = run("export", art, "-o", tmp_path / "ct", "--no-progress")
    assert sum(".experts." in name for name in calls) == stop
    assert result.exit_code == (130 if fail is KeyboardInterrupt else 1), result.output
    assert beside(tmp_path, "ct") == []


def test_sharded_export_streams_each_expert_into_its_shard(source, artifact, exported, tmp_path):
    """--max-shard-size small enough that the stacked experts spread over several files: the same
    tensors as the single-file export, and transformers loads them (nothing missing or unexpected)."""
    out = tmp_path / "sharded"
    result = run("export", artifact("moe", "bf16"), "-o", out, "--max-shard-size", "20kB", "--no-progress")
    assert result.exit_code == 0, result.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    stacks = {index["weight_map"][n] for n in index["weight_map"] if n.endswith((".gate_up_proj", ".down_proj"))}
    assert len(files) > 3 and len(stacks) > 1
    single = tensors(exported("moe", "bf16"))
    sharded: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(out / file), framework="pt") as handle:
            sharded |= {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    assert set(sharded) == set(single) == set(index["weight_map"])
    assert all(torch.equal(sharded[name], single[name]) for name in single)
    load_export("moe", out)


def test_fp8_kv_cache_scales_load_into_the_text_attention(tmp_path, rng):
    """`qcompile synth tiny-vl` (bf16, with a tokenizer to calibrate with) compiled ptpc-fp8-kv8 and
    exported: each text layer's k_scale / v_scale sit under model.language_model. and transformers
    loads them into its attention modules, equal to the manifest's scales in bf16."""
    ckpt, art, out, calib = tmp_path / "ckpt", tmp_path / "art", tmp_path / "ct", tmp_path / "calib.txt"
    words = ["def", "return", "self", "import", "class", "(", ")", ":", "x", "=", "+", "1", "for", "in", "\n"]
    calib.write_text(" ".join(rng.choice(words) for _ in range(2000)))
    assert run("synth", "tiny-vl", "-o", ckpt, "--seed", rng.randrange(1 << 30)).exit_code == 0
    compiled = run("compile", ckpt, "-o", art, "-q", "--recipe", "ptpc-fp8-kv8", "--calib", calib)
    assert compiled.exit_code == 0, compiled.output
    result = run("export", art, "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    kv = json.loads((art / "manifest.json").read_text())["kv_cache"]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"]["num_bits"] == 8 and config["kv_cache_scheme"]["strategy"] == "tensor"
    model, info = Qwen3VLForConditionalGeneration.from_pretrained(out, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    layers = model.model.language_model.layers
    assert len(layers) == kv["num_layers"]
    for i, layer in enumerate(layers):
        for kind in ("k", "v"):
            want = torch.tensor([kv["scales"][f"{kind}_scale"][i]]).to(torch.bfloat16)
            assert torch.equal(getattr(layer.self_attn, f"{kind}_scale").detach(), want)
