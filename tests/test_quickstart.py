"""README's quick start (`bash quickstart.sh`) runs its steps in order, each named as it starts, and
a failing step is named; its test command is the one line .ci/run runs. The environment the tests run
in is the active one, so the script skips its venv and install steps here (they are what .ci/run's
own line exercises on a fresh clone)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
STEPS = ("synth", "compile", "inspect", "verify", "run")


def _quickstart(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "VIRTUAL_ENV": sys.prefix,  # the tests' environment: installed already
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        ["bash", str(ROOT / "quickstart.sh"), *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_the_quick_start_runs_each_step_named(tmp_path):
    result = _quickstart("tiny", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    named = re.findall(r"^== (\w[\w ]*): ", result.stderr, flags=re.M)
    assert named == list(STEPS), named  # installed already: no venv or install step
    assert (tmp_path / "qwen3-tiny-fp8" / "manifest.json").is_file()
    said = result.stdout + result.stderr
    assert "ok: " in said and "TTFT" in said and "quick start done" in result.stderr


def test_a_failing_step_is_named(tmp_path):
    (tmp_path / "qwen3-tiny-fp8").write_text("in the way: compile cannot replace a file")  # compile fails
    result = _quickstart("tiny", str(tmp_path))
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith('quick start failed at step "compile"'), result.stderr[-2000:]
    assert "== inspect" not in result.stderr  # nothing runs after the failed step


def test_the_test_command_is_one_line_that_ci_runs():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- test-command -->")[1].split("<!-- /test-command -->")[0]
    lines = [line for line in block.splitlines() if line.strip() and not line.startswith("```")]
    assert len(lines) == 1 and "pip install" in lines[0] and lines[0].endswith("python -m pytest -n 2 -q --durations=25")
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'eval "$test_command"' in ci and "pip install" not in ci  # CI installs through the line alone
