"""The examples/ scripts run as documented (they are the first thing a new user tries)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_example(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", str(ROOT / "examples" / "quickstart.sh"), str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((tmp_path / "custom" / "manifest.json").read_text())
    assert manifest["recipe"]["name"] == "custom-ptpc-fp8"
    assert manifest["kv_cache"]["block_size"] == 32 and manifest["kv_cache"]["layout"]["name"] == "hnd"
    assert manifest["tensors"]["model.layers.1.mlp.down_proj.weight"]["dtype"] == "BF16"
    assert manifest["tensors"]["lm_head.weight"]["dtype"] == "F8_E4M3"
    assert json.loads((tmp_path / "ptpc-fp8.json").read_text())["scheme"] == "ptpc-fp8"
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["output_tokens"] == len(run["token_ids"]) > 0 and run["ttft_s"] > 0
