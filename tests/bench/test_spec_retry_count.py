"""bench/spec_retry_count.py on CPU: a never-right draft's verifications and synchronous steps are
counted per batch, the report carries a bench header, and bad arguments are refused by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import spec_retry_count  # noqa: E402 -- bench/ is scripts, not a package


def test_a_never_right_draft_retries_on_the_shared_step_clock(tiny_ckpt, compiled, tmp_path):
    art = compiled(tiny_ckpt, "bf16")
    out = tmp_path / "count.json"
    spec_retry_count.main([str(art), "--batches", "1,3", "--max-tokens", "40", "--out", str(out)])
    report = json.loads(out.read_text())
    for key in ("benchmark", "date", "command", "git_commit", "machine", "versions"):
        assert report[key], key
    rows = report["rows"]
    print(rows)
    assert [r["batch"] for r in rows] == [1, 3]
    for row in rows:
        assert row["accepted"] == 0 and row["steps"] >= 40  # a launch a token at least
        # rounds at steps 1, 8 and 32 (k = 4, then 1 and 1), the batch's requests in the same steps
        assert row["synchronous_steps"] == 3 and row["verifications"] == 3 * row["batch"], row
        assert row["drafted"] == 6 * row["batch"], row


@pytest.mark.parametrize(("argv", "message"), [(["--batches", "1,x"], "1,x"), (["--batches", "0"], "positive")])
def test_bad_arguments_are_refused_by_name(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        spec_retry_count.main([str(tmp_path), *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err
