"""`qcompile eval` / `eval-recipes` and qcompile.evaluate.accuracy: perplexity, KL and top-1 agreement of an
artifact against its reference on the same text.

The tiny checkpoints have random weights, so their next-token distributions are nearly flat
(perplexity close to the vocabulary size): the numbers are checked against what must hold whatever
the weights are (a bf16 artifact is its checkpoint, within compute rounding; doubling lm_head's FP8
scales sharpens the logits, and on text the model does not predict that raises the cross-entropy,
which is convex in the logit scale with its minimum at 0). The text is random words, fresh each run.
"""

from __future__ import annotations

import builtins
import json
import keyword
import math
import random
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from qruntime.artifact import verify_files
from qruntime.tokenizer import Tokenizer

from qcompile.cli import main
from qcompile.errors import EvalError
from qcompile.evaluate.accuracy import evaluate, window_starts
from qcompile.io.safetensors_stream import read_header

WORDS = (*keyword.kwlist, *(name for name in dir(builtins) if name.islower() and name[0] != "_"))


@pytest.fixture
def rng() -> random.Random:
    seed = random.randrange(1 << 30)
    print(f"text seed {seed}")
    return random.Random(seed)


@pytest.fixture
def text_file(tmp_path, rng):
    """About 400 tokens of random words, numbers and punctuation."""
    parts = []
    for _ in range(220):
        roll = rng.random()
        parts.append(
            rng.choice(WORDS) if roll < 0.8 else str(rng.randrange(1000)) if roll < 0.9 else rng.choice(".,:()")
        )
    path = tmp_path / "text.txt"
    path.write_text(" ".join(parts) + "\n", encoding="utf-8")
    return path


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def double_scale(artifact, name):
    """Multiply the tensor `name` of the artifact by 2 in place (same bytes count, so the graph's
    offsets stay right; the manifest's sha256 no longer matches, and the runtime loads without verify)."""
    info = json.loads((artifact / "manifest.json").read_text())["tensors"][name]
    entry = read_header(artifact / info["file"])[0][name]
    doubled = (entry.read() * 2).contiguous().view(torch.uint8)
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.begin)
        handle.write(doubled.numpy().tobytes())


def test_windows_predict_every_token_after_the_first_once(rng):
    for _ in range(50):
        num_tokens, window = rng.randrange(2, 300), rng.randrange(2, 70)
        predicted = [p for s in window_starts(num_tokens, window) for p in range(s + 1, min(s + window, num_tokens))]
        assert predicted == list(range(1, num_tokens))


def test_eval_twice_gives_identical_numbers(tiny_ckpt, compiled, text_file):
    artifact = compiled(tiny_ckpt, "ptpc-fp8")
    first = evaluate(artifact, tiny_ckpt, text_file, window=64, progress=False)
    second = evaluate(artifact, tiny_ckpt, text_file, window=64, progress=False)
    assert first.to_dict() == second.to_dict()
    ids = Tokenizer.from_dir(artifact).encode(text_file.read_text())
    assert first.tokens == len(ids) - 1
    assert first.windows == len(window_starts(len(ids), 64)) > 1
    assert (first.reference_kind, first.recipe, first.window) == ("transformers", "ptpc-fp8", 64)


@pytest.mark.parametrize("field", ["spec", "kv_cache"])
def test_an_artifact_without_the_fields_eval_reads_is_an_error_naming_them(
    tiny_ckpt, compiled, text_file, tmp_path, field
):
    artifact = tmp_path / "art"
    shutil.copytree(compiled(tiny_ckpt, "ptpc-fp8"), artifact)
    manifest = json.loads((artifact / "manifest.json").read_text())
    del manifest[field]
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EvalError, match=rf"cannot be loaded: .*manifest.json: {field}\.\w+ is missing"):
        evaluate(artifact, tiny_ckpt, text_file, window=64, progress=False)


@pytest.mark.parametrize(
    ("dtype", "ratio_tol", "kl_tol", "min_agreement"),
    [("fp32", 1e-6, 1e-12, 0.99), ("bf16", 1e-3, 1e-5, 0.95)],  # bf16: the two implementations round differently
)
def test_bf16_artifact_matches_its_source(tiny_ckpt, compiled, text_file, dtype, ratio_tol, kl_tol, min_agreement):
    result = evaluate(compiled(tiny_ckpt, "bf16"), tiny_ckpt, text_file, window=96, dtype=dtype, progress=False)
    assert abs(result.ppl_ratio - 1) <= ratio_tol
    assert abs(result.kl) <= kl_tol
    assert result.top1_agreement >= min_agreement
    assert math.isclose(result.ppl_ratio, result.ppl_artifact / result.ppl_reference, rel_tol=1e-12)
    assert result.dtype == {"fp32": "float32", "bf16": "bfloat16"}[dtype]


def test_fp8_error_is_measured_and_a_broken_scale_degrades_it(tiny_ckpt, compiled, text_file, tmp_path):
    intact = compiled(tiny_ckpt, "ptpc-fp8-lmhead")
    broken = tmp_path / "broken"
    shutil.copytree(intact, broken)
    double_scale(broken, "lm_head.weight_scale")
    assert [p.path for p in verify_files(broken)] == ["weights/model-00001-of-00001.safetensors"]
    good = evaluate(intact, tiny_ckpt, text_file, window=96, progress=False)
    bad = evaluate(broken, tiny_ckpt, text_file, window=96, progress=False)
    assert 1e-7 < good.kl < 1e-3 and abs(good.ppl_ratio - 1) < 0.005  # fp8 error: present, and small
    assert bad.kl > 50 * good.kl
    assert bad.ppl_ratio > good.ppl_ratio + 0.01
    assert bad.ppl_reference == good.ppl_reference  # the same reference, token for token


@pytest.mark.parametrize(("dtype", "tolerance"), [("fp32", 1e-6), ("bf16", 1e-3)])
def test_transformers_and_runtime_references_agree(tiny_ckpt, compiled, text_file, dtype, tolerance):
    """The checkpoint run by transformers and its bf16 artifact run by qruntime's reference backend
    are the same reference: perplexities within `tolerance` (relative), and so the metrics of an
    fp8 artifact against either."""
    artifact = compiled(tiny_ckpt, "ptpc-fp8")
    hf = evaluate(artifact, tiny_ckpt, text_file, window=96, dtype=dtype, progress=False)
    ours = evaluate(artifact, compiled(tiny_ckpt, "bf16"), text_file, window=96, dtype=dtype, progress=False)
    assert (hf.reference_kind, ours.reference_kind) == ("transformers", "qruntime")
    assert hf.ppl_artifact == ours.ppl_artifact
    assert math.isclose(hf.ppl_reference, ours.ppl_reference, rel_tol=tolerance)
    assert math.isclose(hf.ppl_ratio, ours.ppl_ratio, rel_tol=tolerance)
    assert math.isclose(hf.kl, ours.kl, rel_tol=0.02)


def test_vocabulary_mismatch_names_both_sizes(tiny_ckpt, make_ckpt, compiled, text_file):
    other = make_ckpt("tiny", vocab_size=576)
    with pytest.raises(EvalError, match=r"vocabulary mismatch.* 544 tokens.* 576"):
        evaluate(compiled(tiny_ckpt, "bf16"), other, text_file, progress=False)


def test_tokenizer_mismatch_is_an_error(tiny_ckpt, compiled, text_file, tmp_path):
    reference = tmp_path / "ref"
    shutil.copytree(tiny_ckpt, reference)
    tokenizer = json.loads((reference / "tokenizer.json").read_text())
    del tokenizer["model"]["merges"][:100]  # the most frequent merges: the text splits differently
    (reference / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(EvalError, match="tokenize the text differently"):
        evaluate(compiled(tiny_ckpt, "bf16"), reference, text_file, progress=False)


@pytest.mark.parametrize("problem", ["missing", "directory", "blank", "binary", "one token"])
def test_bad_data_is_an_error_naming_the_file(tiny_ckpt, compiled, tmp_path, problem):
    path = tmp_path / "data.txt"
    if problem == "directory":
        path.mkdir()
    elif problem == "blank":
        path.write_text(" \n\t\n")
    elif problem == "binary":
        path.write_bytes(b"\xff\xfe\x00text")
    elif problem == "one token":
        path.write_text("a")
    with pytest.raises(EvalError, match=str(path)):
        evaluate(compiled(tiny_ckpt, "bf16"), tiny_ckpt, path, progress=False)


def test_eval_cli_table_and_json(tiny_ckpt, compiled, text_file):
    artifact = compiled(tiny_ckpt, "ptpc-fp8")
    args = ("eval", artifact, "--reference", tiny_ckpt, "--data", text_file, "--window", 80, "--no-progress")
    table = run(*args)
    assert table.exit_code == 0, table.output
    assert [line.split()[0] for line in table.stdout.splitlines()] == [
        "artifact",
        "reference",
        "data",
        "ppl",
        "ppl",
        "KL",
        "top-1",
    ]
    as_json = run(*args, "--json", "--max-tokens", 150)
    assert as_json.exit_code == 0, as_json.output
    record = json.loads(as_json.stdout)
    expected = evaluate(artifact, tiny_ckpt, text_file, window=80, max_tokens=150, progress=False).to_dict()
    assert record == json.loads(json.dumps(expected))
    assert record["tokens"] == 149


def test_eval_cli_missing_data_file(tiny_ckpt, compiled, tmp_path):
    missing = tmp_path / "nowhere" / "heldout.txt"
    result = run("eval", compiled(tiny_ckpt, "bf16"), "--reference", tiny_ckpt, "--data", missing)
    assert result.exit_code == 1
    assert result.output.startswith("error: ") and str(missing) in result.output
    assert "Traceback" not in result.output


def test_eval_recipes_side_by_side(tiny_ckpt, compiled, text_file, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    args = ("eval-recipes", tiny_ckpt, "--data", text_file, "-r", "bf16", "-r", "ptpc-fp8", "--window", 80)
    result = run(*args, "--workdir", work, "--json", "--no-progress")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert [row["recipe"] for row in summary["rows"]] == ["bf16", "ptpc-fp8"]
    bf16, fp8 = summary["rows"]
    assert abs(bf16["ppl_ratio"] - 1) < 1e-3 and bf16["kl"] < fp8["kl"]
    # compiled again in a temporary directory, the artifact gives the numbers of the fixture's compile
    alone = evaluate(compiled(tiny_ckpt, "ptpc-fp8"), tiny_ckpt, text_file, window=80, progress=False)
    assert (fp8["ppl_artifact"], fp8["kl"], fp8["top1_agreement"]) == (
        alone.ppl_artifact,
        alone.kl,
        alone.top1_agreement,
    )
    assert summary["tokens"] == alone.tokens and summary["reference_kind"] == "transformers"
    assert list(work.iterdir()) == []

    table = run(*args, "--no-progress")
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert lines[2].split() == ["recipe", "ppl", "ppl", "ratio", "KL", "nats/tok", "top-1"]
    assert [line.split()[0] for line in lines[3:]] == ["bf16", "ptpc-fp8"]


def test_eval_recipes_cleans_up_and_names_the_recipe_on_error(tiny_ckpt, make_ckpt, text_file, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    # block-fp8 cannot fuse the tiny model's 64-row projections: refused before anything is compiled
    result = run("eval-recipes", tiny_ckpt, "--data", text_file, "-r", "bf16", "-r", "block-fp8", "--workdir", work)
    assert result.exit_code == 1 and "recipe 'block-fp8'" in result.output
    # a reference of another vocabulary fails after the first compile: its artifact is removed too
    other = make_ckpt("tiny", vocab_size=576)
    args = ("eval-recipes", tiny_ckpt, "--data", text_file, "-r", "bf16", "--reference", other, "--workdir", work)
    result = run(*args, "--no-progress")
    assert result.exit_code == 1 and "vocabulary mismatch" in result.output
    assert list(work.iterdir()) == []


def test_eval_recipes_calibrates_the_kv8_recipe_on_its_own_text(tiny_ckpt, text_file, tmp_path, rng):
    """ptpc-fp8-kv8 in the comparison: calibrated on --calib (not on --data), its row differs from
    ptpc-fp8's by the fp8 KV cache alone; without --calib it is refused before anything compiles."""
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(rng.choice(WORDS) for _ in range(2000)), encoding="utf-8")
    args = ("eval-recipes", tiny_ckpt, "--data", text_file, "-r", "ptpc-fp8", "-r", "ptpc-fp8-kv8", "--window", 80)
    result = run(*args, "--calib", calib, "--json", "--no-progress")
    assert result.exit_code == 0, result.output
    fp8, kv8 = json.loads(result.stdout)["rows"]
    assert kv8["recipe"] == "ptpc-fp8-kv8" and kv8["kl"] != fp8["kl"]
    assert abs(kv8["ppl_ratio"] - 1) < 0.05
    refused = run(*args, "--no-progress")
    assert refused.exit_code == 1 and "--calib" in refused.output


def test_trained_fixture_ptpc_fp8_keeps_perplexity_within_one_percent(compiled):
    """On the small trained Qwen3 (tests/fixtures/qwen3-stdlib), ptpc-fp8 costs under 1% perplexity on
    its held-out text (fp32 compute: quantization error only), and the error is really there."""
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3-stdlib"
    result = evaluate(
        compiled(fixture, "ptpc-fp8"),
        fixture,
        fixture / "heldout.txt",
        window=256,
        max_tokens=4096,
        dtype="fp32",
        progress=False,
    )
    assert result.tokens >= 4000 and result.ppl_reference < 40  # a trained model, far from uniform (4096)
    assert abs(result.ppl_ratio - 1) < 0.01
    assert result.kl > 1e-4 and result.top1_agreement < 1.0
