"""Record the Triton kernels an artifact's engine launches on this GPU: kernel_builds/<device>.json.

The last step of `qcompile tune`: a fresh process (its JIT has compiled nothing yet, so it sees every
kernel the load launches, including those Triton's cache already holds) loads the artifact with its
new tuned configs and the runtime's defaults, captures its graphs, runs its warm-up steps and
generates a few tokens, while qruntime.kernel_builds.recorded_builds notes each kernel
specialization compiled. The list lets a later load on this GPU model build them all in parallel
beside reading the weights (qruntime.kernel_prebuild) instead of one by one at their first launch.
The records are then built once more into an empty cache, each timed, and written longest compile
first (kernel_prebuild.longest_first): the order a load's workers take them in.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from qcompile.errors import QCompileError

RECORD_TIMEOUT_S = 3600.0
PROMPT = (1, 2, 3, 4, 5, 6, 7, 8)


def record_kernel_builds(
    root: str | Path, timeout: float = RECORD_TIMEOUT_S, progress: Callable[[str], None] | None = None
) -> Path:
    """Record the list in a fresh process and write it into the artifact (its manifest entry updated);
    returns its path. A QCompileError with the child's last lines when it fails. `progress` hears
    how many kernels were recorded and each compile no record could hold."""
    proc = subprocess.run(
        [sys.executable, "-m", "qcompile.tune.builds", str(root)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise QCompileError(f"{root}: recording the engine's kernel builds failed (exit {proc.returncode}):\n{tail}")
    path = Path(proc.stdout.strip().splitlines()[-1])
    if progress is not None:
        for line in proc.stderr.splitlines():
            if line.startswith(("not recorded: ", "ordered longest compile first: ")):
                progress(line)
        count = len(json.loads(path.read_text())["kernels"])
        progress(f"{count} kernel builds recorded in {path.relative_to(root)}")
    return path


def _record(root: Path) -> Path:
    import qruntime
    import torch
    import triton
    from qruntime.artifact import read_manifest
    from qruntime.kernel_builds import BuildList, builds_file, recorded_builds
    from qruntime.kernel_prebuild import default_jobs, longest_first, nvidia_target

    from qcompile.compile.manifest import write_listed_json

    device = torch.device("cuda")
    with (
        recorded_builds() as recording,
        qruntime.load(
            root,
            device=device,
            prebuild_kernels=False,
            graph_capture="load",  # every graph's kernels
        ) as engine,
    ):
        engine.generate([list(PROMPT)], qruntime.SamplingParams(max_tokens=4, ignore_eos=True))
    for skipped in recording.skipped:
        print(f"not recorded: {skipped}", file=sys.stderr)
    name, capability = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
    timed = longest_first(recording.kernels, nvidia_target(capability), default_jobs())
    seconds = [s for _, s in timed if s is not None]
    print(
        f"ordered longest compile first: {sum(seconds):.1f} s of compiling, the longest {max(seconds, default=0):.2f} s",
        file=sys.stderr,
    )
    builds = BuildList(name, capability, triton.__version__, tuple(record for record, _ in timed))
    return write_listed_json(root, read_manifest(root), builds_file(name), builds.to_dict())


if __name__ == "__main__":
    print(_record(Path(sys.argv[1])))
