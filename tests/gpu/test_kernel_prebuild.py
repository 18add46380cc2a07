"""Kernels built ahead, on the GPU: `qcompile tune`'s recording (qcompile.tune.builds) lists the
kernels a load launches; a load in a fresh process with an empty Triton cache builds them in the
helper beside its weights (qruntime.kernel_prebuild), after which its own JIT compiles none (every
launch a hit in Triton's cache), and its greedy tokens are those of a load that built nothing ahead.
A load without the list, in another empty cache, compiles at launch: the count can tell. Each child
generates, then does the idle work a load that captures its graphs at first use leaves."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from qruntime.kernel_builds import builds_file

from qcompile.tune.builds import record_kernel_builds

pytestmark = pytest.mark.gpu

CHILD = r"""
import json, sys
import qruntime, triton
misses = []
triton.knobs.compilation.listener = lambda **kw: misses.append(kw["src"].name) if not kw.get("cache_hit") else None
engine = qruntime.load(sys.argv[1], device="cuda", prebuild_kernels=sys.argv[2] == "1")  # as recorded
at_load = len(misses)
out = engine.generate([json.loads(sys.argv[3])], qruntime.SamplingParams(max_tokens=12, ignore_eos=True))[0]
while engine.idle_work():  # the graphs the generation did not capture, and the warm-up steps
    pass
print(json.dumps({"misses_at_load": at_load, "misses": misses, "tokens": out.token_ids,
                  "prebuild": engine.description.get("kernel_prebuild"),
                  "seconds": engine.description["load_seconds"]}))
engine.close()
"""


def _load_in_fresh_process(artifact, cache, prebuild: bool, prompt) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
    env.pop("TRITON_INTERPRET", None)
    argv = [sys.executable, "-c", CHILD, str(artifact), str(int(prebuild)), json.dumps(prompt)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_recorded_list_leaves_nothing_to_compile_at_launch(gpu_artifact, tmp_path, cuda, rng, monkeypatch):
    artifact = tmp_path / "art"
    shutil.copytree(gpu_artifact, artifact)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache-recording"))
    path = record_kernel_builds(artifact)
    assert path == artifact / builds_file(torch.cuda.get_device_name(cuda))
    listed = json.loads((artifact / "manifest.json").read_text())["files"]
    assert builds_file(torch.cuda.get_device_name(cuda)) in listed  # `qcompile verify` covers it
    kernels = json.loads(path.read_text())["kernels"]
    names = {k["kernel"].split(":")[1] for k in kernels}
    print(len(kernels), "kernels:", sorted(names))
    assert len(kernels) >= 10 and any("gemv" in n or "gemm" in n for n in names)

    vocab = json.loads((artifact / "manifest.json").read_text())["spec"]["vocab_size"]
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(3, 40))]
    ahead = _load_in_fresh_process(artifact, tmp_path / "cache-ahead", True, prompt)
    at_launch = _load_in_fresh_process(artifact, tmp_path / "cache-at-launch", False, prompt)
    print("ahead:", ahead["prebuild"], ahead["seconds"])
    print("at launch:", len(at_launch["misses"]), "compiled at launch,", at_launch["seconds"])
    assert ahead["prebuild"].startswith(f"{len(kernels)} kernels: {len(kernels)} built")
    assert ahead["prebuild"].endswith("started at the load's call)")  # qruntime.early_prebuild, taken over
    # the JIT found every kernel the load, the generation and the idle work (the graphs captured
    # later: load's graph_capture="first-use") launched
    assert ahead["misses"] == []
    assert len(at_launch["misses"]) >= len(kernels) // 2 and at_launch["prebuild"] is None
    assert ahead["tokens"] == at_launch["tokens"]
