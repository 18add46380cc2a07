"""Synthetic w4a16 artifacts (qruntime.synthetic): packed int4 weights made at load as random words
of symmetric codes with scales that give the FP8 weights' spread, on the reference backend on CPU;
and `qcompile synth PRESET --artifact -r w4a16` at a real size."""

from __future__ import annotations

import qruntime
import torch
from click.testing import CliRunner
from int4_shapes import INT4_SHAPES
from qruntime.ops.functional import dequantize_int4, unpack_int4
from qruntime.synthetic import INT4_SPREAD, WEIGHT_STD, random_tensor

from qcompile.cli import main
from qcompile.compile.pipeline import compile_checkpoint, prepare
from qcompile.recipe.schema import load_recipe


def test_random_int4_words_have_symmetric_codes():
    words = random_tensor("model.layers.0.mlp.down_proj.weight_packed", [512, 64], torch.int32, torch.device("cpu"))
    assert words.dtype == torch.int32 and (words < 0).any()  # the sign bit is a code bit like the others
    codes = unpack_int4(words).float()  # [512, 512] in -8..7
    assert codes.min() == -7 and codes.max() == 7  # -8 is made 0
    counts = torch.bincount((codes + 8).long().flatten(), minlength=16)[1:] / codes.numel()
    expected = torch.full((15,), 1 / 16)
    expected[7] = 2 / 16  # code 0: its own draws and those of -8
    assert (counts - expected).abs().max() < 0.01
    assert abs(float(codes.mean())) < 0.02
    assert abs(float(codes.std()) - INT4_SPREAD) < 0.05


def test_synthetic_w4a16_artifact_loads_and_generates(make_ckpt, tmp_path):
    ckpt = make_ckpt("tiny", **INT4_SHAPES)
    art = tmp_path / "synthetic"
    synthetic = {"preset": "tiny", "weights": "random, generated on the device at load"}
    compile_checkpoint(prepare(ckpt, load_recipe("w4a16")), art, progress=False, synthetic=synthetic)
    engine = qruntime.load(art, device="cpu", dtype="float32", backend="reference")
    assert "synthetic" in engine.description["weights"].lower()
    weights = engine.runner.plan.weights
    packed = weights["model.layers.0.mlp.down_proj.weight_packed"]
    scale = weights["model.layers.0.mlp.down_proj.weight_scale"]
    assert packed.dtype == torch.int32 and packed.shape == (128, 256 // 8) and scale.shape == (128, 2)
    assert (scale > 0).all() and scale.max() <= 1.5 * WEIGHT_STD / INT4_SPREAD + 1e-9
    dequantized = dequantize_int4(packed, scale, 128)
    assert abs(float(dequantized.std()) - WEIGHT_STD) < 0.2 * WEIGHT_STD  # the FP8 weights' spread
    qkv_scale = weights["model.layers.0.self_attn.qkv_proj.weight_scale"]
    assert qkv_scale.shape == (512, 1) and qkv_scale.max() <= 1.5 * WEIGHT_STD / INT4_SPREAD + 1e-9
    params = qruntime.SamplingParams(max_tokens=8, ignore_eos=True)
    first = engine.generate([[5, 6, 7, 8]], params)[0].token_ids
    assert len(first) == 8
    again = qruntime.load(art, device="cpu", dtype="float32", backend="reference")  # values: a function of the name
    assert torch.equal(again.runner.plan.weights["model.layers.0.mlp.down_proj.weight_packed"], packed)
    assert again.generate([[5, 6, 7, 8]], params)[0].token_ids == first


def test_qcompile_synth_writes_a_w4a16_artifact_of_a_real_size(tmp_path):
    out = tmp_path / "qwen3-0.6b-w4a16"
    result = CliRunner().invoke(main, ["synth", "qwen3-0.6b", "-o", str(out), "--artifact", "-r", "w4a16"])
    assert result.exit_code == 0, result.output
    assert "SYNTHETIC" in result.output and "w4a16" in result.output
