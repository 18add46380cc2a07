"""bench/spec_corpus.py: the site-packages sources spec_train.py adds to the stdlib corpus, on a fake
site-packages directory (packages, tests, a file named after a held-out module, one copying held-out
text, files too small or too large) with explicit held-out sources; and --site-chars reaching the
training."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import spec_bench  # noqa: E402 -- bench/ is scripts, not a package
import spec_corpus  # noqa: E402
import spec_train  # noqa: E402

# A held-out module of long lines (stripped, COPY_LINE_CHARS or more), each its own.
HELDOUT_LINES = [f"result_{i} = combine_the_widgets(first_{i}, second_{i}, limit={i})" for i in range(8)]
HELDOUT = "def heldout():\n" + "".join(f"    {line}\n" for line in HELDOUT_LINES)


def _module(name: str, lines: int = 12) -> str:
    return "".join(f"def {name}_{i}(x):\n    return x + {i}  # {name}\n\n\n" for i in range(lines))


def _lines(count: int) -> str:
    """The first `count` held-out lines, indented differently from the held-out module."""
    return "".join(f"        {line}\n" for line in HELDOUT_LINES[:count])


def fake_site(root: Path) -> dict[str, str]:
    """A site-packages directory under root; returns the relative paths and texts site_texts should pick."""
    kept = {f"pkga/mod{i}.py": _module(f"a{i}") for i in range(6)}
    kept |= {"pkgb/__init__.py": _module("b"), "solo.py": _module("solo")}
    kept["pkgb/near.py"] = _module("near") + _lines(spec_corpus.COPY_LINES - 1)  # a line or two shared: kept
    left_out = {
        "pkga/tests/test_mod.py": _module("t"),
        "pkga/testing/helpers.py": _module("h"),
        "pkgb/test/conftest.py": _module("c"),
        "pkgb/textwrap.py": _module("w"),  # named after a held-out module
        "pkgb/copied.py": _module("copy") + _lines(spec_corpus.COPY_LINES),  # carries held-out text
        "pkgb/tiny.py": "x = 1\n",  # under MIN_FILE_BYTES
        "pkgc/table.py": "T = [\n" + "    0,\n" * (spec_corpus.MAX_FILE_BYTES // 6) + "]\n",
        "pkgc/notes.txt": _module("n"),
    }
    for rel, text in (kept | left_out).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return kept


@pytest.fixture
def site(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "site-packages"
    return root, fake_site(root)


def test_site_texts_are_the_package_files_less_tests_heldout_names_copies_and_sizes(site):
    root, kept = site
    texts, record = spec_corpus.site_texts(10**9, [HELDOUT], roots=[root])
    assert sorted(texts) == sorted(kept.values())
    assert record["files"] == len(kept) and record["chars"] == sum(map(len, kept.values()))
    assert record["roots"] == [str(root.resolve())] and record["candidates"] == len(kept) + 1  # + the copy
    assert record["skipped_heldout_names"] == 1 and record["skipped_copies"] == 1
    assert record["copies"] == [str(root.resolve() / "pkgb" / "copied.py")]
    assert record["packages"] == 3  # pkga, pkgb, solo.py


def test_site_texts_stop_before_the_file_that_would_pass_the_limit(site):
    root, kept = site
    everything, _ = spec_corpus.site_texts(10**9, [HELDOUT], roots=[root], seed=3)
    limit = sum(map(len, everything[:3])) + len(everything[3]) // 2
    texts, record = spec_corpus.site_texts(limit, [HELDOUT], roots=[root], seed=3)
    assert texts == everything[:3] and record["chars"] == sum(map(len, texts)) <= limit
    assert spec_corpus.site_texts(0, [HELDOUT], roots=[root / "absent"])[0] == []  # 0: nothing read


def test_site_texts_order_follows_the_seed(site):
    root, kept = site
    first, _ = spec_corpus.site_texts(10**9, [HELDOUT], roots=[root], seed=1)
    again, _ = spec_corpus.site_texts(10**9, [HELDOUT], roots=[root], seed=1)
    other, _ = spec_corpus.site_texts(10**9, [HELDOUT], roots=[root], seed=2)
    assert first == again and sorted(other) == sorted(first) and other != first


def test_site_texts_without_files_name_the_roots(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError, match="empty"):
        spec_corpus.site_texts(1000, [HELDOUT], roots=[tmp_path / "empty", tmp_path / "absent"])


def test_roots_never_reach_the_stdlib(tmp_path):
    stdlib = tmp_path / "lib" / "python3"
    for name in ("json", "site-packages", "dist-packages"):
        (stdlib / name).mkdir(parents=True)
    (tmp_path / "venv").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "venv")
    roots = [stdlib, tmp_path / "lib", tmp_path, stdlib / "json", stdlib / "site-packages", tmp_path / "absent"]
    roots += [stdlib / "dist-packages", tmp_path / "venv", tmp_path / "link", stdlib / "site-packages"]
    kept = spec_corpus.usable_roots(roots, stdlib)
    assert kept == [p.resolve() for p in (stdlib / "site-packages", stdlib / "dist-packages", tmp_path / "venv")]


def test_token_stream_is_each_texts_ids_then_endoftext():
    """train_small_qwen3.token_stream (encoded a chunk of texts at a time into arrays) gives what a
    list of every text's ids and <|endoftext|> gives."""
    tokenizer = Tokenizer.from_file(str(ROOT / "tests" / "fixtures" / "qwen3-stdlib" / "tokenizer.json"))
    texts = ["import os\n", "", "def f(x):\n    return x\n", "é ☃ \x00", "class A:\n    pass\n"]
    eot = tokenizer.token_to_id("<|endoftext|>")
    ids = [i for e in tokenizer.encode_batch(texts, add_special_tokens=False) for i in [*e.ids, eot]]
    for vocab, dtype in ((4096, torch.int16), (40_000, torch.int32)):
        stream = spec_train.trainer.token_stream(tokenizer, texts, vocab, chunk=2)
        assert stream.dtype == dtype and stream.tolist() == ids
    assert spec_train.trainer.token_stream(tokenizer, [], 4096).tolist() == []


class _Stop(Exception):
    pass


@pytest.mark.parametrize(("argv", "chars"), [(["--site-chars", "1234"], 1234), ([], 0)], ids=["given", "plan"])
def test_site_chars_reach_train_pair(tmp_path, monkeypatch, argv, chars):
    plans = []

    def train_pair(plan, *args, **kwargs):
        plans.append(plan)
        raise _Stop

    monkeypatch.setattr(spec_train, "train_pair", train_pair)
    with pytest.raises(_Stop):
        spec_bench.main(["--train", "--train-plan", "tiny", "--device", "cpu", "--workdir", str(tmp_path), *argv])
    assert plans == [replace(spec_train.TRAIN_PLANS["tiny"], site_chars=chars)]


@pytest.mark.parametrize(
    "argv", [["--site-chars", "-1", "--train"], ["--site-chars", "5"]], ids=["negative", "no-train"]
)
def test_site_chars_are_refused_unless_counted_and_training(tmp_path, capsys, argv):
    extra = [] if "--train" in argv else [str(tmp_path)]
    with pytest.raises(SystemExit) as info:
        spec_bench.parse_args([*extra, *argv])
    assert info.value.code == 2 and "a character count of 0 or more, with --train" in capsys.readouterr().err


def test_tiny_plan_trains_on_stdlib_and_site_text(site, tmp_path, monkeypatch):
    """The stream is the stdlib files' tokens then the site files'; the tokenizer is the stdlib's.
    (No held-out scoring: on a CPU it is most of a tiny training's minute.)"""
    root, kept = site
    monkeypatch.setattr(spec_train.trainer, "mean_nll", lambda *args, **kwargs: 0.0)
    monkeypatch.setattr(spec_corpus, "site_roots", lambda: [root])
    monkeypatch.setattr(spec_train, "heldout_sources", lambda _: [HELDOUT])
    plan = replace(spec_train.TRAIN_PLANS["tiny"], site_chars=10**9)
    work = tmp_path / "work"
    record = spec_train.train_pair(plan, work, torch.device("cpu"), {}, print, steps={"target": 1, "draft": 1})
    site_record = record["corpus"]["site"]
    assert site_record["files"] == len(kept) and site_record["skipped_copies"] == 1, site_record
    tokenizer = Tokenizer.from_file(str(work / "target" / "tokenizer.json"))
    stdlib = spec_train.trainer.training_texts(spec_train.trainer.stdlib_root())[: plan.max_files]
    site_texts, _ = spec_corpus.site_texts(10**9, [HELDOUT], roots=[root])
    expected = spec_train.trainer.token_stream(tokenizer, stdlib + site_texts, 4096)
    assert record["corpus"]["tokens"] == len(expected) > len(spec_train.trainer.token_stream(tokenizer, stdlib, 4096))
