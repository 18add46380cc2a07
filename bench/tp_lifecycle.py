"""A tensor-parallel engine's whole life, timed phase by phase: load, decode, close, interpreter exit.

Each `PRESET:TP` run writes a synthetic artifact (random weights made on the devices at load), then
a fresh child process (its own process group, so its workers go with it) loads it with `tp=TP`,
decodes a few tokens, closes the engine and exits. The child reports each phase as it ends; the
parent times the exit from the child's last report to its end. A phase that outlasts `--timeout`
is a hang: every process of the group gets SIGUSR1 (rank 0 and the workers register faulthandler
on it), so their Python stacks land in the log, and the group is then killed.

    python bench/tp_lifecycle.py --runs tiny-moe:2 --device cuda --out bench/results/tp_lifecycle.json
    python bench/tp_lifecycle.py --runs tiny-moe:2 --device cpu     # gloo: the same lifecycle on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PHASES = ("load", "decode", "close", "exit")
STARTUP_S = 60  # the child's interpreter start, before it can dump its stacks: not timed as a phase


def child(art: Path, tp: int, device: str, tokens: int) -> None:
    """Rank 0's process: one line of JSON per phase on stdout, as each ends."""
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    print(json.dumps({"phase": "started"}), flush=True)  # from here on a hang's stacks can be dumped
    import qruntime

    def report(phase: str, start: float, **extra) -> None:
        print(json.dumps({"phase": phase, "s": round(time.perf_counter() - start, 3), **extra}), flush=True)

    start = time.perf_counter()
    engine = qruntime.load(art, device=device, tp=tp, max_model_len=256, max_num_seqs=2, kv_cache_memory=256 << 20)
    report("load", start, graphs=engine.runner.decode_graphs is not None)
    start = time.perf_counter()
    out = engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]], qruntime.SamplingParams(max_tokens=tokens, ignore_eos=True))
    report("decode", start, tokens=len(out[0].token_ids), tpot_ms=round(out[0].timings.tpot * 1e3, 3))
    start = time.perf_counter()
    engine.close()
    report("close", start)
    print(json.dumps({"phase": "exiting", "at": time.time()}), flush=True)


def run(preset: str, tp: int, args) -> dict:
    from qcompile.recipe.schema import load_recipe
    from qcompile.synth.artifact import write_synthetic_artifact

    art = args.workdir / f"{preset}-tp{tp}"
    shutil.rmtree(art, ignore_errors=True)
    write_synthetic_artifact(preset, art, load_recipe("ptpc-fp8"), tp=tp, progress=False)
    cmd = [sys.executable, __file__, "--child", str(art), "--tp", str(tp), "--device", args.device]
    cmd += ["--tokens", str(args.tokens)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    row: dict = {"preset": preset, "tp": tp, "device": args.device, "process_group": proc.pid, "phases": {}}
    lines: queue.Queue[str] = queue.Queue()  # read on a thread: no line waits in a buffer unseen
    threading.Thread(target=pump, args=(proc.stdout, lines), daemon=True).start()
    exiting_at, started = None, False
    while True:  # each phase gets its own `--timeout`; the interpreter's start is not a phase
        try:
            line = lines.get(timeout=args.timeout if started else max(args.timeout, STARTUP_S))
        except queue.Empty:
            waiting = next((p for p in PHASES if p not in row["phases"]), "exit")
            row["hung_in"] = waiting
            print(
                f"{preset}:{tp}: no end of '{waiting}' after {args.timeout} s: dumping every rank's stacks", flush=True
            )
            os.killpg(proc.pid, signal.SIGUSR1)
            time.sleep(3)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        if not line:  # the child's stdout closed: it has exited (or is about to)
            proc.wait()
            if exiting_at is not None:
                row["phases"]["exit"] = round(time.time() - exiting_at, 3)
            break
        event = json.loads(line)
        if event["phase"] == "started":
            started = True
            continue
        if event["phase"] == "exiting":
            exiting_at = event["at"]
        else:
            row["phases"][event["phase"]] = event["s"]
            row.update({k: v for k, v in event.items() if k not in ("phase", "s")})
        print(f"{preset}:{tp}: {line.strip()}", flush=True)
    row["returncode"] = proc.returncode
    kill_group(proc.pid)
    shutil.rmtree(art, ignore_errors=True)
    return row


def pump(stream, lines: queue.Queue[str]) -> None:
    """Every line of `stream` into `lines` as it comes, then "" at its end."""
    for line in stream:
        lines.put(line)
    lines.put("")


def kill_group(pgid: int) -> None:
    """Kill whatever of the child's process group is left (workers of a child that exited early)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="tiny-moe:2", help="comma-separated PRESET:TP")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tokens", type=int, default=16, help="tokens decoded before the close")
    parser.add_argument("--timeout", type=float, default=60, help="seconds one phase may take")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qtp-lifecycle"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.tp, args.device, args.tokens)
        return
    from compile_bench import report_header

    args.workdir.mkdir(parents=True, exist_ok=True)
    report = report_header("tp_lifecycle")
    if args.device == "cuda":
        import torch
        import triton

        report["machine"]["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
        report["versions"].update(torch=torch.__version__, triton=triton.__version__)
    report["runs"] = []
    for item in args.runs.split(","):
        preset, tp = item.split(":")
        report["runs"].append(run(preset, int(tp), args))
        if args.out:
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    for r in report["runs"]:
        phases = "  ".join(f"{p} {r['phases'][p]:.2f} s" for p in PHASES if p in r["phases"])
        status = f"HUNG in {r['hung_in']}" if "hung_in" in r else f"rc {r['returncode']}"
        print(f"{r['preset']:>14} tp={r['tp']} {r['device']}: {phases}  {status}")


if __name__ == "__main__":
    main()
