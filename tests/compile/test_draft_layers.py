"""`qcompile compile --draft-layers`: the self-speculative draft's skipped layers, searched on
calibration text (compile/draft_layers.py) or given, recorded in the manifest and used by the
runtime's layer-skip draft."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import qruntime
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from qcompile.cli import main
from qcompile.compile.draft_layers import modelled_speedup, parse_draft_layers
from qcompile.errors import QCompileError

FIXTURE = Path(__file__).parents[1] / "fixtures" / "qwen3-stdlib"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def calib(tmp_path, rng):
    """Calibration text: held-out code of the trained fixture, from a random offset."""
    text = Path(FIXTURE, "heldout.txt").read_text()
    start = rng.randrange(0, len(text) - 40000)
    path = tmp_path / "calib.txt"
    path.write_text(text[start : start + 40000])
    return path


def test_auto_finds_a_layer_that_does_nothing(make_ckpt, tmp_path, calib, rng):
    """A 5-layer model whose layer `idle` adds nothing to the stream (its o_proj and down_proj are
    zero): the search skips exactly it, with full agreement."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(make_ckpt("tiny", seed=rng.randrange(1 << 20), num_hidden_layers=5), ckpt)
    idle = rng.randrange(1, 4)
    tensors = load_file(ckpt / "model.safetensors")
    for name in (f"model.layers.{idle}.self_attn.o_proj.weight", f"model.layers.{idle}.mlp.down_proj.weight"):
        tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, ckpt / "model.safetensors")
    out = tmp_path / "art"
    result = run("compile", ckpt, "-o", out, "-q", "--recipe", "bf16", "--draft-layers", "auto", "--calib", calib)
    assert result.exit_code == 0, result.output
    entry = json.loads((out / "manifest.json").read_text())["speculative"]
    assert entry["draft_layers"] == [idle] and entry["agreement"] == 1.0, entry
    assert entry["calibration"]["file"] == "calib.txt" and entry["calibration"]["tokens"] > 0


def test_auto_on_the_trained_fixture_drafts_plain_greedy(tmp_path, calib):
    out = tmp_path / "art"
    result = run("compile", FIXTURE, "-o", out, "--recipe", "bf16", "--draft-layers", "auto", "--calib", calib)
    assert result.exit_code == 0, result.output
    assert "layer-skip: layers" in result.output and "top-1 agreement" in result.output
    entry = json.loads((out / "manifest.json").read_text())["speculative"]
    assert entry["draft_layers"] and set(entry["draft_layers"]) <= {1, 2} and 0 < entry["agreement"] <= 1
    layers = json.loads(Path(FIXTURE, "config.json").read_text())["num_hidden_layers"]
    speedup = modelled_speedup(entry["agreement"], (layers - len(entry["draft_layers"])) / layers)
    assert f"modelled speed-up {speedup:.2f}x" in " ".join(result.output.split()), result.output
    assert ("below 1" in result.output) == (speedup < 1)
    prompt = Path(FIXTURE, "heldout.txt").read_text()[:400]
    params = qruntime.SamplingParams(max_tokens=48, ignore_eos=True)
    plain = qruntime.load(out, device="cpu", dtype=torch.float32).generate([prompt], params)[0]
    engine = qruntime.load(out, device="cpu", dtype=torch.float32, speculative="layer-skip")
    assert engine.generate([prompt], params)[0].token_ids == plain.token_ids
    assert engine.speculative_stats.accepted > 0
    assert engine.speculator.proposer.skip == tuple(entry["draft_layers"])


def test_given_layers_are_recorded_without_a_search(tiny_moe_ckpt, tmp_path):
    out = tmp_path / "art"
    assert run("compile", tiny_moe_ckpt, "-o", out, "-q", "--draft-layers", "2,1").exit_code == 0
    assert json.loads((out / "manifest.json").read_text())["speculative"] == {"draft_layers": [1, 2]}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--draft-layers", "5"), "some but not all of the model's layers 0..2"),
        (("--draft-layers", "0,1,2"), "some but not all"),
        (("--draft-layers", "two"), "expected 'auto' or layer indexes"),
        (("--draft-layers", "auto"), "--calib FILE"),
        (("--draft-layers", "1", "--tp", "2"), "tp = 1 only"),
    ],
)
def test_bad_draft_layers_are_refused_before_any_output(tiny_moe_ckpt, tmp_path, args, message):
    out = tmp_path / "art"
    result = run("compile", tiny_moe_ckpt, "-o", out, "-q", *args)
    assert result.exit_code != 0 and message in result.output, result.output
    assert not out.exists()


def test_calib_without_a_use_is_refused(tiny_ckpt, tmp_path, calib):
    result = run("compile", tiny_ckpt, "-o", tmp_path / "art", "-q", "--calib", calib)
    assert result.exit_code != 0 and "--draft-layers auto is not asked for" in result.output


def test_parse_and_model():
    assert parse_draft_layers(" auto ", 4) == "auto" and parse_draft_layers("3, 1,1", 4) == (1, 3)
    with pytest.raises(QCompileError):
        parse_draft_layers("-1", 4)
    assert modelled_speedup(1.0, 0.5, 4) == pytest.approx(5 / 3)
    assert modelled_speedup(0.0, 0.5, 4) == pytest.approx(1 / 3)
    rng = random.Random()
    a, b = sorted(rng.random() for _ in range(2))
    assert modelled_speedup(a, 0.5) <= modelled_speedup(b, 0.5)  # more agreement never models slower
    assert modelled_speedup(b, 0.75) <= modelled_speedup(b, 0.5)  # nor a cheaper draft
