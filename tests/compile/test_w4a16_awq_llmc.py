"""An llm-compressor AWQModifier recipe compiles to `-r w4a16-awq`'s artifact (issue 20): the same
weight files and graph (sha256; the recipe file named as ours: the graph records the recipe's
name), the same manifest quantization and AWQ sections, on a fresh random
checkpoint and calibration text each run (the seed printed); without --calib it is refused naming
the option."""

from __future__ import annotations

import random

import pytest
from qruntime.artifact import read_manifest

from qcompile.compile import awq_search
from qcompile.compile.awq_search import CalibrationSize
from qcompile.quant.awq import AwqConfig

SHAPES = {"hidden_size": 128, "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 4}
SMALL = CalibrationSize(seq_len=64, max_sequences=8, batch=4)
QUICK = AwqConfig(n_grid=4)
IGNORE = '      targets: [Linear]\n      ignore: [lm_head, "re:.*mlp.gate$"]\n'
RECIPES = {
    "awq+quantization": "default_stage:\n  default_modifiers:\n    AWQModifier: {duo_scaling: true, n_grid: 20}\n"
    f"    QuantizationModifier:\n{IGNORE}      scheme: W4A16\n",
    "awq with config_groups": "quant_stage:\n  quant_modifiers:\n    AWQModifier:\n"
    f"{IGNORE}      offload_device: cpu\n      config_groups:\n        group_0:\n          targets: [Linear]\n"
    "          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128}\n",
}


@pytest.fixture
def seed() -> int:
    value = random.randrange(1 << 30)
    print(f"seed {value}")
    return value


def _cli(*args):
    from click.testing import CliRunner

    from qcompile.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def _compared(art):
    """What must be equal: every file's sha256 but the manifest's, the recipe's quantization section
    and the AWQ search's record."""
    manifest = read_manifest(art)
    files = {path: entry["sha256"] for path, entry in manifest["files"].items()}
    return files, manifest["recipe"]["quantization"], manifest["awq"]


@pytest.mark.parametrize("form", RECIPES)
def test_awq_modifier_recipe_compiles_to_w4a16_awqs_artifact(make_ckpt, seed, tmp_path, monkeypatch, form):
    monkeypatch.setattr(awq_search, "CalibrationSize", lambda: SMALL)  # small text: a fast test
    monkeypatch.setattr(awq_search, "AwqConfig", lambda: QUICK)
    ckpt = make_ckpt("tiny", seed=seed, **SHAPES)
    rng = random.Random(seed)
    words = ["def", "return", "self", "import", "class", "(", ")", ":", "x", "=", "+", "1", "for", "in", "\n"]
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(rng.choice(words) for _ in range(3000)))
    recipe = tmp_path / "llmc" / "w4a16-awq.yaml"  # the name the graph records is the file's stem: ours
    recipe.parent.mkdir()
    recipe.write_text(RECIPES[form])
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    result = _cli("compile", ckpt, "-o", ours, "-r", "w4a16-awq", "--calib", calib, "-q")
    assert result.exit_code == 0, result.output
    result = _cli("compile", ckpt, "-o", theirs, "-r", recipe, "--calib", calib, "-q")
    assert result.exit_code == 0, result.output
    files, quantization, awq = _compared(theirs)
    assert quantization == {"scheme": "w4a16", "ignore": ["lm_head", "re:.*mlp.gate$"], "method": "awq"}
    assert any(path.startswith("weights/") for path in files) and "graph.onnx" in files
    assert (files, quantization, awq) == _compared(ours)
    assert len(awq["groups"]) == 4 * 2  # the search ran on every group of both layers (it may choose s = 1)
    assert "AWQModifier" in read_manifest(theirs)["recipe"]["description"]

    missing = _cli("compile", ckpt, "-o", tmp_path / "none", "-r", recipe, "-q")
    assert missing.exit_code == 1 and "--calib" in missing.output and "w4a16-awq" in missing.output
    assert not (tmp_path / "none").exists()
