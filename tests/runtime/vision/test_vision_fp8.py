"""Recipe vision.scheme ptpc-fp8 (docs/vision.md, "FP8 tower"): a tiny random Qwen3-VL checkpoint
(dense and MoE, float32) compiled with the tower's block linears FP8, against the same checkpoint
compiled with the tower in the model dtype. The FP8 weights are the text quantizer's bytes for the
same tensors; the graph runs them through the text model's DynamicQuant + PTPCLinear; the FP8
tower's embeddings (with their DeepStack features) are within FP8's error of the model-dtype tower's;
the artifact loads, generates and shows its scheme in inspect; bad values are refused by name. Every
weight and image is drawn from a fresh seed, printed."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import qruntime
import qruntime.loader
import torch
from click.testing import CliRunner
from PIL import Image
from qruntime.engine.multimodal import ImagePrompt
from qruntime.engine.sampling_params import SamplingParams
from qruntime.manifest_schema import SchemaError, check_manifest
from qruntime.vision.encoder import load_vision_encoder
from qruntime.vision.preprocess import VisionPreprocessConfig, preprocess_images
from qwen3_vl_checkpoints import END, IMAGE, PREPROCESSOR, START, VISION, write_checkpoint
from safetensors.torch import load_file

from qcompile.cli import main as qcompile_cli
from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.errors import RecipeError
from qcompile.quant import get_scheme
from qcompile.recipe.schema import load_recipe

BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")
# SQNR of the FP8 tower's vision_embeds against the model-dtype tower's: measured 22.9-28.6 dB on the
# tiny towers (embeddings and DeepStack features, dense and MoE, several seeds; bench/vision_fp8_accuracy.py).
# One weight scale doubled (the last block's fc2, the break tried) gives 8-9 dB.
MIN_SQNR_DB = 18.0


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.double().pow(2).sum() / (x.double() - ref.double()).pow(2).sum()))


@pytest.fixture(scope="module", params=["dense", "moe"])
def towers(request, tmp_path_factory):
    """(checkpoint dir, model-dtype artifact, FP8-tower artifact) of one random checkpoint."""
    ckpt = tmp_path_factory.mktemp(f"{request.param}-ckpt")
    write_checkpoint(ckpt, request.param)
    arts = []
    for scheme in ("none", "ptpc-fp8"):
        out = tmp_path_factory.mktemp(f"{request.param}-{scheme}") / "artifact"
        recipe = load_recipe("bf16", [f"vision.scheme={scheme}"])
        compile_checkpoint(prepare(ckpt, recipe, tokenizer=False), out, workers=1, progress=False)
        arts.append(out)
    return ckpt, *arts


def _manifest(root):
    return json.loads((root / "manifest.json").read_text())


def _encoder(root):
    return load_vision_encoder(root, _manifest(root)["vision"], "cpu", torch.float32)


def _images(rng: random.Random, sizes=((40, 24), (33, 47), (16, 16))) -> list[Image.Image]:
    generator = np.random.default_rng(rng.randrange(1 << 30))
    return [Image.fromarray(generator.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def test_tower_weights_are_the_text_quantizers_bytes(towers):
    ckpt, _, fp8 = towers
    source = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        source |= load_file(f)
    manifest = _manifest(fp8)
    assert manifest["vision"]["scheme"] == "ptpc-fp8"
    stored = {}
    for f in sorted((fp8 / "weights").rglob("*.safetensors")):
        stored |= load_file(f)
    scheme = get_scheme("ptpc-fp8")
    for i in range(VISION["depth"]):
        for linear in BLOCK_LINEARS:
            name = f"model.visual.blocks.{i}.{linear}"
            codes, scale = scheme.quantize(source[f"{name}.weight"])
            assert stored[f"{name}.weight"].dtype == torch.float8_e4m3fn
            assert torch.equal(stored[f"{name}.weight"].view(torch.uint8), codes.view(torch.uint8)), name
            assert torch.equal(stored[f"{name}.weight_scale"], scale.to(stored[f"{name}.weight_scale"].dtype)), name
            assert torch.equal(stored[f"{name}.bias"], source[f"{name}.bias"])  # the bias stays
    for kept in ("patch_embed.proj.weight", "merger.linear_fc1.weight", "blocks.0.norm1.weight"):
        assert torch.equal(stored[f"model.visual.{kept}"], source[f"model.visual.{kept}"])


def test_graph_runs_the_text_models_fp8_linear(towers):
    _, _, fp8 = towers
    encoder = _encoder(fp8)
    ops = [type(node.op).__name__ for node in encoder.plan.nodes]
    assert ops.count("PTPCLinear") == 4 * VISION["depth"]
    assert ops.count("DynamicQuant") == 4 * VISION["depth"]  # norm1, attn, norm2, act: one each
    assert encoder.weights["model.visual.blocks.0.attn.qkv.weight"].dtype == torch.float8_e4m3fn


def test_fp8_embeddings_are_within_fp8_error_of_the_model_dtype_towers(towers, rng):
    _, bf, fp8 = towers
    vision = preprocess_images(_images(rng), VisionPreprocessConfig.from_dict(PREPROCESSOR))
    ref = _encoder(bf)(vision.pixel_values, vision.image_grid_thw)
    out = _encoder(fp8)(vision.pixel_values, vision.image_grid_thw)
    assert out.shape == ref.shape
    width = ref.shape[1] // (1 + len(VISION["deepstack_visual_indexes"]))
    for k, part in enumerate(torch.split(torch.arange(ref.shape[1]), width)):
        db = sqnr_db(out[:, part], ref[:, part])
        print(f"{'embeddings' if k == 0 else f'deepstack {k - 1}'}: SQNR {db:.1f} dB")
        assert db > MIN_SQNR_DB


def test_triton_ops_run_the_fp8_tower_as_the_reference_ops(towers, rng):
    """backend "triton" binds the text path's DynamicQuant / PTPCLinear kernels (run by Triton's
    interpreter here; tests/gpu/test_vision_fp8.py on a GPU): the same embeddings within FP8 rounding
    (here in float32 they were equal bit for bit; a bfloat16 run gave 29.4 dB, activation codes that
    round across a step differing; a doubled scale gives 8-9 dB)."""
    _, _, fp8 = towers
    entry = _manifest(fp8)["vision"]
    vision = preprocess_images(_images(rng, ((40, 24),)), VisionPreprocessConfig.from_dict(PREPROCESSOR))
    out = {}
    for backend in ("reference", "triton"):
        encoder = load_vision_encoder(fp8, entry, "cpu", torch.float32, backend=backend)
        linears = {type(n.op).__module__ for n in encoder.plan.nodes if type(n.op).__name__ == "PTPCLinear"}
        assert linears == {"qruntime.ops.triton_ops" if backend == "triton" else "qruntime.ops.quant"}
        out[backend] = encoder(vision.pixel_values, vision.image_grid_thw)
    db = sqnr_db(out["triton"], out["reference"])
    print(f"triton vs reference ops: {db:.1f} dB")
    assert db > MIN_SQNR_DB


def test_an_amd_fp8_tower_on_the_triton_ops_equals_the_nvidia_one(tmp_path, monkeypatch, rng):
    """amd-gfx942 (qruntime.target): the tower's FP8 weights stored as e4m3fnuz with doubled scales,
    and the loader hands the target's format to the encoder's ops, which quantize activations to
    e4m3fnuz: every product is the e4m3fn one, so the embeddings equal the nvidia artifact's bit for
    bit (float32, Triton's interpreter; the dense checkpoint only: the towers are alike)."""
    monkeypatch.setattr(qruntime.loader, "resolve_backend", lambda backend, device, dtype: "triton")
    write_checkpoint(tmp_path / "ckpt", "dense")
    vision = preprocess_images(_images(rng, ((16, 16),)), VisionPreprocessConfig.from_dict(PREPROCESSOR))
    out = {}
    for target, fp8 in (("nvidia-sm90", torch.float8_e4m3fn), ("amd-gfx942", torch.float8_e4m3fnuz)):
        recipe = load_recipe("bf16", ["vision.scheme=ptpc-fp8", f"target={target}"])
        compile_checkpoint(
            prepare(tmp_path / "ckpt", recipe, tokenizer=False), tmp_path / target, workers=1, progress=False
        )
        load = {"device": "cpu", "dtype": torch.float32, "backend": "triton", "cuda_graphs": False, "num_kv_blocks": 8}
        with qruntime.load(tmp_path / target, **load) as engine:
            encoder = engine.vision.encoder
            linears = [n.op for n in encoder.plan.nodes if type(n.op).__name__ == "PTPCLinear"]
            assert linears and {type(op).__module__ for op in linears} == {"qruntime.ops.triton_ops"}
            assert {op.env.fp8 for op in linears} == {fp8}
            assert {w.dtype for w in encoder.weights.values() if w.dtype.itemsize == 1} == {fp8}
            out[fp8] = encoder(vision.pixel_values, vision.image_grid_thw)
    assert torch.equal(out[torch.float8_e4m3fn], out[torch.float8_e4m3fnuz])


def test_fp8_tower_generates_and_inspect_shows_it(towers, rng):
    _, _, fp8 = towers
    prompt = ImagePrompt([3, 5, START, IMAGE, END, 7], _images(rng, ((40, 24),)))
    params = SamplingParams(max_tokens=3, ignore_eos=True, logit_bias={t: -100.0 for t in range(IMAGE, IMAGE + 8)})
    with qruntime.load(fp8, device="cpu", dtype=torch.float32) as engine:
        (out,) = engine.generate([prompt], params)
    assert len(out.token_ids) == 3
    result = CliRunner().invoke(qcompile_cli, ["inspect", str(fp8), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["vision"]["scheme"] == "ptpc-fp8"
    text = CliRunner().invoke(qcompile_cli, ["inspect", str(fp8)])
    assert "blocks' linears ptpc-fp8" in text.output


def test_bad_values_are_refused_by_name(towers):
    with pytest.raises(RecipeError, match=r"vision\.scheme 'fp4' is unknown; known: none, ptpc-fp8"):
        load_recipe("bf16", ["vision.scheme=fp4"])
    with pytest.raises(RecipeError, match=r"unknown key 'vision\.schema'"):
        load_recipe("bf16", ["vision.schema=ptpc-fp8"])
    manifest = _manifest(towers[2])
    manifest["vision"]["scheme"] = "int4"
    with pytest.raises(SchemaError, match=r"vision\.scheme"):
        check_manifest(manifest)
