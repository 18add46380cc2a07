"""Run `qcompile` / `qruntime` invocations in a fresh Python process, one after another, and report for
each its exit code, its stdout and stderr, and whether torch had been imported by the time it ended:
what a test of "this error comes before any heavy import" needs (the test process has torch loaded).
Modules only accumulate, so the first call whose `torch` is true is the one that imported it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# the child: reads [[cli, args], ...] on stdin, calls each CLI's main as its console script would (the
# SystemExit of click's standalone mode caught), writes one JSON list on stdout
CHILD = r"""
import contextlib, io, json, sys

def qcompile(args):
    from qcompile.cli import main
    try:
        main(args, prog_name="qcompile")
    except SystemExit as exc:
        return exc.code
    return 0

def qruntime(args):
    from qruntime.cli import main
    return main(args)

results = []
for cli, args in json.load(sys.stdin):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = {"qcompile": qcompile, "qruntime": qruntime}[cli](args)
    results.append({"code": code, "out": out.getvalue(), "err": err.getvalue(), "torch": "torch" in sys.modules})
print(json.dumps(results))
"""


@dataclass(frozen=True)
class Outcome:
    code: int | None
    out: str
    err: str
    torch: bool  # whether torch was in sys.modules once the call returned


def run_in_child(calls: Sequence[tuple[str, Sequence[str | Path]]]) -> list[Outcome]:
    """Each (cli, args) of `calls`, cli "qcompile" or "qruntime", run in order in one new process."""
    payload = json.dumps([[cli, [str(a) for a in args]] for cli, args in calls])
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], input=payload, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, f"the child failed:\n{proc.stdout}\n{proc.stderr}"
    return [Outcome(**record) for record in json.loads(proc.stdout)]
