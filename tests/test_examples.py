"""The examples/ scripts run as documented (they are the first thing a new user tries): each is run
as a user would, in a subprocess with the venv's commands on PATH, and what it wrote is checked."""

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run_example(name: str, work: Path) -> str:
    """Run examples/NAME with WORK as its work directory; its stdout (fails with its stderr).

    One torch thread per example: CI runs two tests at once on two cores, and torch's default of a
    thread per core then oversubscribes them (its waiting threads spin: eval_recipes.sh took 29 s of
    CPU instead of 14 on a busy 2-core machine)."""
    script = ROOT / "examples" / name
    command = ["bash", str(script)] if script.suffix == ".sh" else [sys.executable, str(script)]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*command, str(work)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, f"{name} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return result.stdout


def test_quickstart_example(tmp_path):
    run_example("quickstart.sh", tmp_path)
    manifest = json.loads((tmp_path / "custom" / "manifest.json").read_text())
    assert manifest["recipe"]["name"] == "custom-ptpc-fp8"
    assert manifest["kv_cache"]["block_size"] == 32 and manifest["kv_cache"]["layout"]["name"] == "hnd"
    assert manifest["tensors"]["model.layers.1.mlp.down_proj.weight"]["dtype"] == "BF16"
    assert manifest["tensors"]["lm_head.weight"]["dtype"] == "F8_E4M3"
    assert json.loads((tmp_path / "ptpc-fp8.json").read_text())["scheme"] == "ptpc-fp8"
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["output_tokens"] == len(run["token_ids"]) > 0 and run["ttft_s"] > 0


def test_compile_and_generate_example(tmp_path):
    out = run_example("compile_and_generate.py", tmp_path)
    assert json.loads((tmp_path / "tiny-fp8" / "manifest.json").read_text())["recipe"]["name"] == "ptpc-fp8"
    # texts are printed as reprs (one line each); the streamed pieces as they come (any characters)
    generated = re.findall(r"^generate: .+ \((stop|length), (\d+) tokens, ttft \d+ ms\)$", out, re.M)
    assert len(generated) == 2 and all(int(n) > 0 for _, n in generated), out
    assert re.search(r"^stream: .+?\n +\((stop|length), [1-9]\d* tokens in \d+ ms\)\nchat: ", out, re.M | re.S), out
    assert re.search(r"^chat: +.+ \((stop|length), e2e \d+ ms\)$", out, re.M), out


def test_custom_recipe_example(tmp_path):
    out = run_example("custom_recipe.sh", tmp_path)
    info = json.loads((tmp_path / "lean.json").read_text())
    assert info["recipe"] == "lean-fp8" and info["ignore"] == ["re:.*mlp.gate$"]
    assert info["kv_cache"]["dtype"] == "fp8_e4m3" and info["kv_cache"]["layout"] == "hnd"
    assert info["kv_cache"]["block_size"] == 32  # the --set override beat the file's default
    manifest = json.loads((tmp_path / "lean" / "manifest.json").read_text())
    assert manifest["tensors"]["lm_head.weight"]["dtype"] == "F8_E4M3"  # not ignored any more
    assert "kv cache fp8_e4m3 hnd, block_size 32" in out


def test_serve_openai_example(tmp_path):
    out = run_example("serve_openai.py", tmp_path)
    replies = json.loads((tmp_path / "responses.json").read_text())
    [choice] = replies["chat"]["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    assert replies["chat"]["usage"]["completion_tokens"] > 0
    chunks = [c["choices"][0] for c in replies["stream"]]
    assert len(chunks) > 1 and "".join(c["text"] for c in chunks)
    assert chunks[-1]["finish_reason"] in ("stop", "length")
    assert [m["id"] for m in replies["models"]] == ["tiny-fp8"]
    assert "models: ['tiny-fp8']" in out
    log = (tmp_path / "server.log").read_text()
    assert "serving tiny-fp8 on http://127.0.0.1:" in log and "Finished server process" in log  # stopped cleanly


def test_publish_folder_example(tmp_path):
    out = run_example("publish_folder.sh", tmp_path)
    published = tmp_path / "published"
    [wheel] = (published / "runtime").glob("qcompile_runtime-*-py3-none-any.whl")
    assert "qruntime/__init__.py" in zipfile.ZipFile(wheel).namelist()
    listed = json.loads((published / "manifest.json").read_text())["files"]
    assert "README.md" in listed and f"runtime/{wheel.name}" in listed
    card = (published / "README.md").read_text()
    assert card.startswith("---\n") and "\n# tiny-ptpc-fp8\n" in card
    assert "ok:" in out and "./runtime/" in out
    verify = subprocess.run([BIN / "qcompile", "verify", "-q", published], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_eval_recipes_example(tmp_path):
    out = run_example("eval_recipes.sh", tmp_path)
    report = json.loads((tmp_path / "eval.json").read_text())
    rows = {row["recipe"]: row for row in report["rows"]}
    assert list(rows) == ["bf16", "ptpc-fp8", "ptpc-fp8-lmhead"] and report["tokens"] == 255
    assert abs(rows["bf16"]["ppl_ratio"] - 1) < 1e-4 and rows["bf16"]["kl"] < 1e-6  # fp32: same numbers
    for row in rows.values():  # the trained fixture: FP8 costs well under 5% perplexity
        assert 0.95 < row["ppl_ratio"] < 1.05 and row["top1_agreement"] > 0.9, row
    assert list(tmp_path.iterdir()) == [tmp_path / "eval.json"]  # the temporary artifacts are gone
    assert re.search(r"^ptpc-fp8-lmhead +[01]\.\d{4} +\d", out, re.M), out  # its table


def test_amd_check_example(tmp_path):
    """Without an AMD GPU (CI): the CPU checks run and pass, the gfx942 ones say they did not run."""
    out = run_example("amd_check.py", tmp_path)
    rows = {cells[0]: cells[1] for cells in (re.split(r"\s{2,}", line) for line in out.splitlines()[1:] if line)}
    assert rows["weights: e4m3fnuz codes, doubled scales"] == "ok", out
    assert rows["reference ops, CPU: logits and greedy"] == "ok", out
    for check in ("FP8 quantization kernel", "Triton fast path vs reference", "e4m3fnuz kernel tests"):
        assert rows[f"gfx942: {check}"] == "not run", out  # no AMD GPU here
    assert json.loads((tmp_path / "amd-gfx942" / "manifest.json").read_text())["target"] == "amd-gfx942"
