"""Issue-24 A/B: the kernel build started at the load's call (qruntime/early_prebuild.py) or at the
rank's build, and with how many workers, timed as cold_start.py times its rows.

Each trial is cold_start's kernels-cold row then its warm row (a fresh Triton cache filled by the
first), in a fresh process from spawn to the first token. Variants:

  early         as shipped: the build starts right after torch's import, beside the engine's imports
  off           start_early replaced by one that starts nothing: the rank's build starts it, after
                the loader's imports, the manifest and the graph
  early:jN      (or off:jN) with N build workers instead of kernel_prebuild.default_jobs()

Compare to_first_token_s only: in the off variants the child imports qruntime.early_prebuild (and so
torch) before the load's call, which moves torch's import out of the load's "imports" phase.
Trials run variant after variant, --repeats times, so a drift of the machine shows in every variant.

    python bench/early_prebuild_ab.py --artifact ART --variants early,off --repeats 3 \\
        --out bench/results/early_prebuild_ab_<commit>_<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))

import cold_start
from compile_bench import gpu_report_header, report_header

ROWS = ("kernels-cold", "warm")
OFF = "import qruntime.early_prebuild as _early\n_early.start_early = lambda *args, **kwargs: None\n"
JOBS = "import qruntime.kernel_prebuild as _prebuild\n_prebuild.default_jobs = lambda: {jobs}\n"
# what the child ran with, checked by the parent: a patch that did not take is not measured
SAYS = """
import qruntime.early_prebuild as _early, qruntime.kernel_prebuild as _prebuild
print("EARLY_AB " + json.dumps({"early": _early.start_early.__name__ == "start_early", "jobs": _prebuild.default_jobs()}))
"""


def parse_variant(variant: str) -> tuple[bool, int | None]:
    """(early, jobs) of "early", "off", "early:jN" or "off:jN"; ValueError naming it otherwise."""
    name, _, jobs = variant.partition(":")
    if name not in ("early", "off") or (jobs and not (jobs[:1] == "j" and jobs[1:].isdigit() and int(jobs[1:]) > 0)):
        raise ValueError(f"{variant!r} is none of early, off, early:jN, off:jN (N > 0)")
    return name == "early", int(jobs[1:]) if jobs else None


def child(variant: str) -> str:
    """cold_start's child with the variant's patches right after `import qruntime`."""
    early, jobs = parse_variant(variant)
    patch = ("" if early else OFF) + (JOBS.format(jobs=jobs) if jobs else "")
    head, sep, tail = cold_start.CHILD.partition("import qruntime\n")
    if not sep:
        raise RuntimeError("cold_start.CHILD no longer imports qruntime on a line of its own")
    return head + sep + patch + tail + SAYS


def trial(art: Path, variant: str, kernels: Path, args: SimpleNamespace) -> list[dict]:
    """The variant's kernels-cold row then its warm row, each a fresh child; their reports."""
    early, jobs = parse_variant(variant)
    results = []
    for row in ROWS:
        env = cold_start.prepare(row, art, kernels, args)
        argv = [sys.executable, "-c", child(variant), str(art), args.device, "{}", json.dumps(cold_start.PROMPT), "0"]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout)
        said = {}
        for line in proc.stdout.splitlines():
            tag, _, body = line.partition(" ")
            if tag in ("COLD_START", "EARLY_AB"):
                said[tag] = json.loads(body)
        if proc.returncode != 0 or len(said) != 2:
            raise RuntimeError(
                f"variant {variant}, row {row}: the child failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
            )
        ran = said["EARLY_AB"]
        if ran["early"] != early or (jobs is not None and ran["jobs"] != jobs):
            raise RuntimeError(f"variant {variant}: the child ran with {ran}, not the variant's patches")
        report = said["COLD_START"]
        phases = report["load_seconds"]
        results.append({
            "variant": variant, "row": row, "jobs": ran["jobs"], "to_first_token_s": report["to_first_token_s"],
            "load_s": report["load_s"], "first_token_s": report["first_token_s"],
            **{name: phases.get(name) for name in ("imports", "setup", "weights", "plan", "kernels")},
            "kernel_prebuild": report["kernel_prebuild"],
        })  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True, help="a compiled, tuned artifact (weights on disk)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--variants", default="early,off")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600, help="seconds a child may take")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/early_prebuild_ab"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    for variant in variants:
        try:
            parse_variant(variant)
        except ValueError as exc:
            parser.error(f"--variants: {exc}")
    if not variants or args.repeats < 1:
        parser.error("--variants needs one variant and --repeats one trial at least")
    settings = SimpleNamespace(device=args.device, timeout=args.timeout, drop="artifact")  # warm rows drop nothing
    report = (
        gpu_report_header("early_prebuild_ab") if args.device.startswith("cuda") else report_header("early_prebuild_ab")
    )
    report.update(device=args.device, artifact=str(args.artifact), trials=[])
    for repeat in range(args.repeats):
        for variant in variants:
            kernels = args.workdir / f"kernels-{variant.replace(':', '-')}-{repeat}"
            for result in trial(args.artifact, variant, kernels, settings):
                report["trials"].append({"repeat": repeat, **result})
                print(json.dumps(report["trials"][-1]), flush=True)
            shutil.rmtree(kernels, ignore_errors=True)
            if args.out is not None:  # after every trial: a run cut short keeps what it measured
                args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("variant, row: median to first token (s)")
    for variant in variants:
        for row in ROWS:
            times = [t["to_first_token_s"] for t in report["trials"] if t["variant"] == variant and t["row"] == row]
            print(f"{variant:>12} {row:>12}  {statistics.median(times):.2f}  ({', '.join(f'{s:.2f}' for s in times)})")


if __name__ == "__main__":
    main()
