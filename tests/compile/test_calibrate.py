"""KV-cache calibration: the layer-by-layer run over the shards observes the same keys and values
as the whole transformers model run at once."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from qcompile.compile.calibrate import CalibrationError, calibration_ids, kv_scales
from qcompile.source.checkpoint import Checkpoint


def _text(path: Path, words: int) -> Path:
    vocab = ["def", "return", "self", "import", "class", "(", ")", ":", "x", "=", "+", "1", "for", "in", "\n"]
    path.write_text(" ".join(random.choice(vocab) for _ in range(words)))
    return path


@pytest.mark.parametrize("ckpt_name", ["tiny_ckpt", "tiny_moe_ckpt"])
def test_layer_by_layer_scales_equal_the_whole_model_run(ckpt_name, request, tmp_path):
    ckpt = request.getfixturevalue(ckpt_name)
    data = _text(tmp_path / "calib.txt", 400)
    checkpoint = Checkpoint.open(ckpt)
    scales = kv_scales(checkpoint, data, seq_len=32, max_sequences=6, batch=4)
    ids = calibration_ids(checkpoint, data, 32, 6)
    assert scales.tokens == ids.numel() and ids.shape[0] >= 2

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    cache = DynamicCache()
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True)
    layers = checkpoint.spec.num_hidden_layers
    assert len(scales.k_scale) == len(scales.v_scale) == layers
    for i in range(layers):
        k_ref = float(cache.layers[i].keys.abs().max().float()) / 448
        v_ref = float(cache.layers[i].values.abs().max().float()) / 448
        # bf16 activations: batching 4 vs 6 sequences may round a layer's output differently
        assert scales.k_scale[i] == pytest.approx(k_ref, rel=2e-2), i
        assert scales.v_scale[i] == pytest.approx(v_ref, rel=2e-2), i
    assert len(set(scales.k_scale)) > 1 or layers == 1  # per layer, not one global value


def test_too_little_text_is_refused_naming_the_file(tiny_ckpt, tmp_path):
    data = _text(tmp_path / "short.txt", 3)
    with pytest.raises(CalibrationError, match="short.txt"):
        kv_scales(Checkpoint.open(tiny_ckpt), data, seq_len=512)
    with pytest.raises(CalibrationError, match="missing.txt"):
        kv_scales(Checkpoint.open(tiny_ckpt), tmp_path / "missing.txt")


def _cli(*args):
    from click.testing import CliRunner

    from qcompile.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def test_compile_kv8_stores_calibrated_scales_the_runtime_uses(tiny_ckpt, tmp_path):
    """`compile --recipe ptpc-fp8-kv8 --calib FILE`: the manifest records the calibrated scales, every
    KV op of graph.onnx carries its layer's, and the runtime's logits stay close to the bf16-KV
    artifact's (fp8 rounding of K/V only) while differing from it (the fp8 cache is really used)."""
    import onnx
    import qruntime

    data = _text(tmp_path / "calib.txt", 3000)
    art, base = tmp_path / "kv8", tmp_path / "bf16kv"
    result = _cli("compile", tiny_ckpt, "-o", art, "--recipe", "ptpc-fp8-kv8", "--calib", data, "-q")
    assert result.exit_code == 0, result.output
    assert _cli("compile", tiny_ckpt, "-o", base, "-q").exit_code == 0
    expected = kv_scales(Checkpoint.open(tiny_ckpt), data)
    manifest = qruntime.artifact.read_manifest(art)
    scales = manifest["kv_cache"]["scales"]
    assert manifest["kv_cache"]["dtype"] == "fp8_e4m3" and scales["calibrated"] is True
    assert scales["k_scale"] == list(expected.k_scale) and scales["v_scale"] == list(expected.v_scale)
    assert scales["calibration"]["tokens"] == expected.tokens
    seen = 0
    for node in onnx.load(str(art / "graph.onnx"), load_external_data=False).graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if "k_scale" in attrs:
            assert attrs["k_scale"] == pytest.approx(scales["k_scale"][attrs["layer"]], rel=1e-7)
            assert attrs["v_scale"] == pytest.approx(scales["v_scale"][attrs["layer"]], rel=1e-7)
            seen += 1
    assert seen >= 2 * len(scales["k_scale"])  # the cache write and the attention of every layer

    ids = torch.randint(0, 500, (40,)).tolist()
    got = qruntime.load(art, device="cpu", dtype=torch.float32).score(ids).float()
    ref = qruntime.load(base, device="cpu", dtype=torch.float32).score(ids).float()
    sqnr = 10 * torch.log10(ref.pow(2).mean() / (got - ref).pow(2).mean())
    assert 20 < float(sqnr) < 120


def test_compile_refuses_a_missing_or_unwanted_calibration_file(tiny_ckpt, tmp_path):
    out = tmp_path / "art"
    missing = _cli("compile", tiny_ckpt, "-o", out, "--recipe", "ptpc-fp8-kv8", "-q")
    assert missing.exit_code == 1 and "--calib" in missing.output and not out.exists()
    absent = _cli("compile", tiny_ckpt, "-o", out, "--recipe", "ptpc-fp8-kv8", "--calib", tmp_path / "no.txt")
    assert absent.exit_code == 1 and "no.txt" in absent.output and not out.exists()
    unwanted = _cli("compile", tiny_ckpt, "-o", out, "--calib", _text(tmp_path / "c.txt", 10), "-q")
    assert unwanted.exit_code == 1 and "calibrate" in unwanted.output and not out.exists()
