"""Issue-24 benchmark: how long a fresh process takes from nothing to its first token, and `qruntime
serve` to ready, with the page cache and Triton's kernel cache each cold or warm.

Each row runs fresh child processes after putting the caches in its state:

  cold          the artifact's pages dropped from the page cache, an empty kernel cache
  pages-cold    pages dropped, the kernel cache the row before filled (run after `cold`)
  kernels-cold  the artifact read into the page cache, an empty kernel cache
  warm          both kept (run after `kernels-cold`)

Rows run in the order given, each kernel cache (TRITON_CACHE_DIR, a fresh folder under --workdir)
shared by a cold-kernel row and the warm-kernel row after it. --drop all drops every clean page
(sync, then `3` to /proc/sys/vm/drop_caches: root), as the issue measured; --drop artifact only the
artifact's files (posix_fadvise DONTNEED: no root, but torch's own libraries stay cached).

The child times, from the parent's spawn: the interpreter's start, `import qruntime`, the load (with
its own split, description["load_seconds"]: imports (torch, the loader, the engine, onnx: a user's
first `qruntime.load` imports them, while the artifact's weights are read ahead), setup, weights,
plan, kernels (waiting for the recorded kernels built beside the weights), cache and graphs, rest;
and description's graph_seconds and kernel_prebuild), and one generated token; then the idle work a load with
graph_capture="first-use" left (the other graphs, the warm-up steps: idle_work_s), and with
--speed the steady speed (decode ms a token at batch 1, a 2000-token prefill). With --serve, a second
child per row (the caches put back in the row's state first) runs `qruntime serve ART --port 0`,
timed from its spawn to the first 200 of /health. The artifact's GB/s (artifact_gb_s) is its size
over the time from the load's call to its weights bound (imports, setup, weights: the read-ahead
starts with the call); weights_gb_s is its size over the weights phase alone (the reader's rate,
from the page cache as far as the read-ahead got). When a row drops pages, the run first times
reading the artifact's files from a cold page cache alone, DISK_READERS threads of 32 MiB reads
(disk_read_s, disk_gb_s): the disk's time for the artifact, which issue 24's pages-cold target adds
2 s to.

    python bench/cold_start.py --artifact ART --device cuda --serve --out bench/results/cold_start_qwen3-8b_h100.json
    python bench/cold_start.py --preset qwen3-8b --device cuda --out ...   # synth + compile + tune it first
    python bench/cold_start.py --preset qwen3-30b-a3b --synthetic-weights --device cuda --out ...  # no checkpoint
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from compile_bench import gpu_report_header, report_header

ROWS = {  # row -> (pages dropped, kernel cache emptied)
    "cold": (True, True),
    "pages-cold": (True, False),
    "kernels-cold": (False, True),
    "warm": (False, False),
}
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]

CHILD = """
import json, os, sys, time
spawned = float(os.environ["COLD_START_SPAWNED"])
started = time.time()
import qruntime
imported = time.time()
art, device, load_kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
engine = qruntime.load(art, device=device, **load_kwargs)  # imports torch and the engine first
import torch
if device.startswith("cuda"):
    torch.cuda.synchronize()
loaded = time.time()
prompt = json.loads(sys.argv[4])
out = engine.generate([prompt], qruntime.SamplingParams(max_tokens=1, ignore_eos=True))[0]
if device.startswith("cuda"):
    torch.cuda.synchronize()
done = time.time()
while engine.idle_work():  # what graph_capture="first-use" left: the other graphs, the warm-up steps
    pass
if device.startswith("cuda"):
    torch.cuda.synchronize()
idle_s = time.time() - done
speed = {}
if sys.argv[5] == "1":  # steady speed once every graph is captured: decode at batch 1, one long prefill
    import random
    rng = random.Random(0)
    def timed(ids, tokens):
        start = time.perf_counter()
        engine.generate([ids], qruntime.SamplingParams(max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - start
    decode = sorted(timed(prompt, 129) - timed(prompt, 1) for _ in range(3))[1]
    n = min(2000, engine.max_model_len - 2)  # fresh ids each time: no prefix-cache hit
    prefill = sorted(timed([rng.randrange(engine.vocab_size) for _ in range(n)], 1) for _ in range(3))[1]
    speed = {"decode_ms_batch1": round(decode / 128 * 1e3, 3), "prefill_tokens": n, "prefill_ms": round(prefill * 1e3, 2)}
print("COLD_START " + json.dumps({
    "interpreter_s": round(started - spawned, 3), "import_qruntime_s": round(imported - started, 3),
    "load_s": round(loaded - imported, 3),
    "first_token_s": round(done - loaded, 3), "to_first_token_s": round(done - spawned, 3),
    "load_seconds": engine.description["load_seconds"], "tokens": len(out.token_ids), "max_model_len": engine.max_model_len,
    "graph_seconds": engine.description.get("graph_seconds"),
    "kernel_prebuild": engine.description.get("kernel_prebuild"),
    "graph_capture": engine.description.get("graph_capture"), "idle_work_s": round(idle_s, 3), **speed,
}), flush=True)
engine.close()
"""


def artifact_files(art: Path) -> list[Path]:
    return sorted(p for p in art.rglob("*") if p.is_file())


def io_scheduler(path: Path) -> str | None:
    """The I/O scheduler of the block device `path` lies on, as sysfs shows it ("[mq-deadline]"
    chosen), or None where sysfs does not say (not a block device, not Linux)."""
    dev = os.stat(path).st_dev
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (node / "queue", node / ".." / "queue"):  # a disk's own, or a partition's disk's
        try:
            return (queue / "scheduler").read_text().strip()
        except OSError:
            continue
    return None


def drop_pages(art: Path, how: str) -> None:
    """Evict the artifact's pages (how="artifact") or every clean page (how="all", root)."""
    if how == "all":
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        except OSError as exc:
            raise SystemExit(
                f"--drop all writes /proc/sys/vm/drop_caches ({exc}): run as root, or --drop artifact"
            ) from None
        return
    for path in artifact_files(art):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: the artifact was written long before
        finally:
            os.close(fd)


DISK_READERS = 8  # as the weight reader reads (qruntime.weight_reader.READERS)
DISK_CHUNK = 32 << 20


def disk_read(art: Path, how: str) -> tuple[float, int]:
    """Seconds and bytes to read every file of the artifact once from a cold page cache (evicted as
    `how` says), DISK_READERS threads of DISK_CHUNK reads at a time, and nothing else done."""
    from concurrent.futures import ThreadPoolExecutor

    spans = [(p, at) for p in artifact_files(art) for at in range(0, p.stat().st_size, DISK_CHUNK)]

    def read(span: tuple[Path, int]) -> int:
        path, at = span
        with open(path, "rb", buffering=0) as f:
            return len(os.pread(f.fileno(), DISK_CHUNK, at))

    drop_pages(art, how)
    began = time.perf_counter()
    with ThreadPoolExecutor(DISK_READERS) as pool:
        total = sum(pool.map(read, spans))
    return time.perf_counter() - began, total


def read_pages(art: Path) -> None:
    """Read every file of the artifact once, into the page cache."""
    for path in artifact_files(art):
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def prepare(row: str, art: Path, kernels: Path, args) -> dict[str, str]:
    """Put the caches in `row`'s state; the child's environment."""
    pages_cold, kernels_cold = ROWS[row]
    if kernels_cold:
        shutil.rmtree(kernels, ignore_errors=True)
    kernels.mkdir(parents=True, exist_ok=True)
    if pages_cold:
        drop_pages(art, args.drop)
    else:
        read_pages(art)
    env = dict(os.environ, TRITON_CACHE_DIR=str(kernels), PYTHONUNBUFFERED="1")
    env["COLD_START_SPAWNED"] = repr(time.time())
    return env


def first_token(art: Path, env: dict, args) -> dict:
    """One child from spawn to its first token; its report."""
    argv = [sys.executable, "-c", CHILD, str(art), args.device, json.dumps(args.load_kwargs), json.dumps(PROMPT)]
    argv.append("1" if args.speed else "0")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("COLD_START ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the first-token child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("COLD_START "))


def serve_ready(art: Path, env: dict, args) -> float:
    """Seconds from spawning `qruntime serve ART --port 0` to the first 200 of its /health."""
    spawned = float(env["COLD_START_SPAWNED"])
    argv = [sys.executable, "-m", "qruntime", "serve", str(art), "--port", "0", "--device", args.device]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in args.load_kwargs.items()]
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url, deadline = None, time.monotonic() + args.timeout
        while url is None:  # the server binds its port first and says where
            line = proc.stderr.readline()
            if not line:
                raise RuntimeError(f"qruntime serve exited with {proc.wait()} before it listened")
            found = re.search(r"http://[0-9.]+:\d+", line)
            url = found.group(0) if found else None
            if time.monotonic() > deadline:
                raise RuntimeError("qruntime serve did not listen in time")
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        return round(time.time() - spawned, 3)
            except OSError:  # 503 while loading (HTTPError is an OSError), or not accepting yet
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"qruntime serve was not ready in {args.timeout} s (exit {proc.poll()})")
            time.sleep(0.02)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


QCOMPILE = (sys.executable, "-m", "qcompile")  # also where the console script is not installed (the lent GPU)


def build_artifact(
    preset: str, workdir: Path, device: str, buckets: str | None = None, synthetic_weights: bool = False
) -> Path:
    """PRESET's random-weight checkpoint compiled to ptpc-fp8 (weights on disk, unlike `synth
    --artifact`), tuned for this GPU at `buckets` (tune's default: all), which records the kernels
    its engine launches; kept under workdir for the next run. synthetic_weights: no checkpoint, a
    synthetic artifact whose random weights are then written into its files (materialize_synthetic:
    qwen3-30b-a3b's checkpoint and artifact together do not fit a 64 GB disk)."""
    art = workdir / f"{preset}-ptpc-fp8"
    if not (art / "manifest.json").is_file():
        if synthetic_weights:
            from materialize_synthetic import materialize

            subprocess.run([*QCOMPILE, "synth", preset, "--artifact", "-o", str(art), "--force"], check=True)
            materialize(art, device)
        else:
            ckpt = workdir / f"{preset}-ckpt"
            subprocess.run([*QCOMPILE, "synth", preset, "-o", str(ckpt), "--force"], check=True)
            subprocess.run([*QCOMPILE, "compile", str(ckpt), "-o", str(art), "--recipe", "ptpc-fp8"], check=True)
            shutil.rmtree(ckpt)
        if device.startswith("cuda"):
            subprocess.run([*QCOMPILE, "tune", str(art), *(["--buckets", buckets] if buckets else [])], check=True)
    return art


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--artifact", type=Path, help="a compiled artifact (weights on disk)")
    source.add_argument("--preset", help="build PRESET's artifact under --workdir first (synth, compile, tune)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, in order, of {', '.join(ROWS)}")
    parser.add_argument("--drop", choices=("all", "artifact"), default="all", help="what a cold-page row evicts")
    parser.add_argument("--serve", action="store_true", help="also time `qruntime serve` to ready, per row")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--load",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a keyword of qruntime.load that is also a serve flag, for both children: num_kv_blocks=64, "
        "max_model_len=4096, max_num_seqs=8, graph_capture=load (an int where it reads as one)",
    )
    parser.add_argument("--speed", action="store_true",
                        help="after the first token and the idle work: decode ms a token at batch 1 and a "
                        "2000-token prefill's ms, each the median of 3 (the speed check of the same run)")  # fmt: skip
    parser.add_argument("--tune-buckets", default=None, help="--preset: token counts `qcompile tune` times")
    parser.add_argument("--build-only", action="store_true", help="--preset: build the artifact, measure nothing")
    parser.add_argument(
        "--synthetic-weights",
        action="store_true",
        help="--preset: build it as a synthetic artifact whose random weights are then written to its files "
        "(no checkpoint on disk: for qwen3-30b-a3b on a 64 GB disk)",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds a child may take")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qcold"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows:
        parser.error(f"--rows: {unknown or 'none given'}; rows are {', '.join(ROWS)}")
    for i, row in enumerate(rows):  # a row that keeps the kernel cache reads the one a row before filled
        if not ROWS[row][1] and not any(ROWS[r][1] for r in rows[:i]):
            parser.error(
                f"--rows: {row} keeps the kernel cache, which no row before it fills (each repeat starts with an "
                "empty one): put cold or kernels-cold before it"
            )
    try:
        pairs = [item.split("=", 1) for item in args.load]
        args.load_kwargs = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in pairs}
    except ValueError:
        parser.error(f"--load takes KEY=VALUE, got {args.load}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    art = args.artifact or build_artifact(
        args.preset, args.workdir, args.device, args.tune_buckets, synthetic_weights=args.synthetic_weights
    )
    if args.build_only:
        print(f"built {art}")
        return
    size = sum(p.stat().st_size for p in artifact_files(art))
    report = gpu_report_header("cold_start") if args.device.startswith("cuda") else report_header("cold_start")
    report.update(device=args.device, artifact=str(art), artifact_bytes=size, drop=args.drop)
    report["io_scheduler"] = io_scheduler(art)
    if any(ROWS[row][0] for row in rows):
        seconds, read = disk_read(art, args.drop)
        report.update(disk_read_s=round(seconds, 6), disk_gb_s=float(f"{read / seconds / 1e9:.3g}"))
        print(f"the artifact's {read / 1e9:.2f} GB read from a cold page cache in {seconds:.2f} s", flush=True)
    report["rows"] = []
    for repeat in range(args.repeats):
        kernels = args.workdir / f"kernels-{os.getpid()}-{repeat}"
        for row in rows:
            result = {"row": row, "repeat": repeat, **first_token(art, prepare(row, art, kernels, args), args)}
            phases = result["load_seconds"]
            to_bound = sum(phases.get(name, 0) for name in ("imports", "setup", "weights"))
            result["artifact_gb_s"] = float(f"{size / to_bound / 1e9:.3g}") if to_bound > 0 else None
            weights_s = phases.get("weights", 0)
            result["weights_gb_s"] = float(f"{size / weights_s / 1e9:.3g}") if weights_s > 0 else None
            if args.serve:
                result["serve_ready_s"] = serve_ready(art, prepare(row, art, kernels, args), args)
            report["rows"].append(result)
            print(json.dumps(result), flush=True)
            if args.out is not None:  # after every row: a run cut short keeps what it measured
                args.out.write_text(json.dumps(report, indent=1) + "\n")
        shutil.rmtree(kernels, ignore_errors=True)


if __name__ == "__main__":
    main()
