"""Where a serving step's wall time goes, measured inside a running `qruntime serve` process.

`python bench/step_profile.py OUT.json [--switch-interval S] serve ART [serve options]` runs the server as `qruntime serve`
would, with timers wrapped (at class level) around the engine thread's work, in the engine process
(spawned with `setup=engine_setup`; with `--engine thread`, in this one):

    loop      EngineLoop._add (engine.add_request), _dispatch (deltas to the event loops), _publish
    step      Engine.step, inside it: Scheduler.schedule, ModelRunner.execute (graph replay or eager
              plan: ModelRunner.prepare + the op-by-op run), sample (sampler.sample_on_device: queues
              the greedy argmax; a batch with a sampled row waits for the GPU there), read
              (SampledTokens.tolist: the wait for a step's tokens, the step launched by the call
              before with async scheduling), Scheduler.update, detokenization, stop checks
    gpu       CUDA events around ModelRunner.execute: the device span of the forward pass (with async
              scheduling it starts at the launch, so it includes the time queued behind the step before)

Nothing is synchronised that the server does not synchronise itself, so the timings are those of
the real server plus the wrappers' own cost (~1 us per call). Each step is one record; a sampler
thread adds each thread's CPU time (from /proc) every 0.5 s, to show how busy the asyncio thread
that encodes the SSE streams is (the HTTP process's threads under "http_threads" when the engine
runs apart). The records are written to OUT.json when the server exits (SIGTERM). bench/serve_profile.py drives it and aggregates per concurrency level.
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STEP_KEYS = (
    "schedule", "execute", "prepare", "graph_host", "fill", "event_wait", "replay", "sample", "read", "update",
    "detok", "stop",
)  # fmt: skip
LOOP_KEYS = ("add", "dispatch", "publish")


class StepProfiler:
    """Per-step records of the engine thread's time, in seconds."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.threads: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None
        self.pending: dict[str, float] = dict.fromkeys(LOOP_KEYS, 0.0)  # loop work since the last step
        self.calls: dict[str, int] = {}  # how many calls of each loop part since the last step
        self.last_step_end: float | None = None
        self.events: list[tuple[Any, Any, dict[str, Any]]] = []  # CUDA events read after the step's sync
        self.http_threads: list[dict[str, Any]] = []
        self.requests: dict[str, dict[str, float]] = {}  # request id -> when it reached each stage (time.time())
        self.http_text: dict[str, float] = {}  # unix second -> seconds the HTTP side spent turning ids into text

    def stamped(self, owner: Any, name: str, stage: str, request_id: Callable[..., str]) -> None:
        """Wrap owner.name: each call records when its request (request_id(*args)) reached `stage`."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.requests.setdefault(request_id(*args, **kwargs), {})[stage] = time.time()
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)

    def timed(self, owner: Any, name: str, key: str, loop: bool = False) -> None:
        """Wrap owner.name: its wall time adds to the current step's `key` (or the loop's)."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                if loop:
                    self.pending[key] += spent
                    self.calls[key] = self.calls.get(key, 0) + 1
                elif self.current is not None:
                    self.current[key] = self.current.get(key, 0.0) + spent

        setattr(owner, name, wrapper)

    def install(self) -> None:
        import torch
        from qruntime.engine import engine as engine_module
        from qruntime.engine.cuda_graphs import DecodeGraphs
        from qruntime.engine.decode_inputs import DecodeInputs
        from qruntime.engine.engine import Engine
        from qruntime.engine.model_runner import ModelRunner
        from qruntime.engine.sampled_tokens import SampledTokens
        from qruntime.engine.scheduler import Scheduler
        from qruntime.serve.engine_loop import EngineLoop
        from qruntime.serve.engine_process import EngineProcess
        from qruntime.tokenizer import IncrementalDetokenizer

        # a request's way in: the HTTP process hands it over, the engine process receives it, the
        # engine thread adds it (serve_profile.py puts the client's send and first token beside these)
        self.stamped(EngineProcess, "submit", "submit", lambda process, request_id, *_: request_id)
        # and before that, when its handler started (the request's line and headers read): kept in
        # the handler's task, and stamped with the id once the engine process is handed the request
        from qruntime.serve.app import OpenAIRoutes

        arrived: contextvars.ContextVar[float] = contextvars.ContextVar("arrived")
        generate, submit = OpenAIRoutes._generate, EngineProcess.submit

        @functools.wraps(generate)
        async def arriving(*args: Any, **kwargs: Any) -> Any:
            arrived.set(time.time())
            return await generate(*args, **kwargs)

        @functools.wraps(submit)
        def submitting(process: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
            if (at := arrived.get(None)) is not None:
                self.requests.setdefault(request_id, {})["arrive"] = at
            return submit(process, request_id, *args, **kwargs)

        OpenAIRoutes._generate, EngineProcess.submit = arriving, submitting
        self.stamped(EngineLoop, "submit", "recv", lambda loop, submission: submission.request_id)
        self.stamped(EngineLoop, "_add", "add", lambda loop, submission: submission.request_id)

        for name, key in (("_add", "add"), ("_dispatch", "dispatch"), ("_publish", "publish")):
            self.timed(EngineLoop, name, key, loop=True)
        stop_loop = EngineLoop.stop

        @functools.wraps(stop_loop)
        def snapshot_and_stop(loop: Any, *args: Any, **kwargs: Any) -> Any:
            self.snapshot()  # the engine thread's CPU while it is still there to read
            return stop_loop(loop, *args, **kwargs)

        EngineLoop.stop = snapshot_and_stop
        self.timed(Scheduler, "schedule", "schedule")
        self.timed(Scheduler, "update", "update")
        self.timed(ModelRunner, "prepare", "prepare")
        self.timed(DecodeGraphs, "run", "graph_host")
        self.timed(DecodeInputs, "fill", "fill")  # inside graph_host: the inputs written on the host
        self.timed(torch.cuda.CUDAGraph, "replay", "replay")  # inside graph_host: the launch
        self.timed(torch.cuda.Event, "synchronize", "event_wait")  # inside graph_host: the inputs' guard
        self.timed(engine_module, "sample_on_device", "sample")
        self.timed(SampledTokens, "tolist", "read")
        self.timed(IncrementalDetokenizer, "add", "detok")  # in the engine: a served request should never get here
        # serve turns ids into text in the HTTP process, as each request's reader takes its deltas
        from qruntime.serve.engine_client import Handle

        with_text = Handle._with_text

        @functools.wraps(with_text)
        def timed_with_text(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return with_text(*args, **kwargs)
            finally:
                second = str(int(time.time()))
                self.http_text[second] = self.http_text.get(second, 0.0) + time.perf_counter() - start

        Handle._with_text = timed_with_text
        self.timed(Engine, "_stop_reason", "stop")

        execute = ModelRunner.execute
        profiler = self

        @functools.wraps(execute)
        def timed_execute(runner: Any, chunks: Any, all_logits: bool = False, sampled: Any = None) -> Any:
            step = profiler.current
            on_gpu = runner.device.type == "cuda"
            if on_gpu:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            start = time.perf_counter()
            graph = runner.decode_graphs is not None and not all_logits and runner.decode_graphs.fits(chunks, sampled)
            out = execute(runner, chunks, all_logits, sampled=sampled)
            if step is not None:
                step["execute"] = step.get("execute", 0.0) + time.perf_counter() - start
                step["graph"] = graph
                step["chunks"] = len(chunks)
                step["decodes"] = sum(1 for c in chunks if c.num_tokens == 1)
                step["tokens"] = sum(c.num_tokens for c in chunks)
                if on_gpu:
                    end.record()
                    profiler.events.append((begin, end, step))
            return out

        ModelRunner.execute = timed_execute

        step_fn = Engine.step

        @functools.wraps(step_fn)
        def timed_step(engine: Any) -> Any:
            start = time.perf_counter()
            record: dict[str, Any] = {"t": time.time()}
            if profiler.last_step_end is not None:
                record["between"] = start - profiler.last_step_end  # loop work, waits and GIL since the last step
            record.update(profiler.pending)
            record["added"] = profiler.calls.get("add", 0)  # requests handed to the engine since the last step
            profiler.pending, profiler.calls = dict.fromkeys(LOOP_KEYS, 0.0), {}
            profiler.current = record
            try:
                return step_fn(engine)
            finally:
                profiler.current = None
                end = time.perf_counter()
                record["wall"] = end - start
                profiler.last_step_end = end
                waiting = []  # with async scheduling the step launched by this call is still running
                for begin_event, end_event, step in profiler.events:
                    if end_event.query():
                        step["gpu"] = begin_event.elapsed_time(end_event) / 1e3
                    else:
                        waiting.append((begin_event, end_event, step))
                profiler.events = waiting
                if "chunks" in record:
                    profiler.steps.append(record)

        Engine.step = timed_step

    def sample_threads(self, stop: threading.Event) -> None:
        """A snapshot now and every 0.5 s until `stop`."""
        self.snapshot()
        while not stop.wait(0.5):
            self.snapshot()

    def snapshot(self) -> None:
        """Each thread's CPU seconds so far (from /proc), by thread name."""
        tick = os.sysconf("SC_CLK_TCK")
        snapshot: dict[str, float] = {}
        names = {t.native_id: t.name for t in threading.enumerate()}  # e.g. qruntime-engine, MainThread
        for task in Path("/proc/self/task").iterdir():
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue  # the thread ended
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
            snapshot[names.get(int(task.name), f"{name}:{task.name}")] = cpu
        self.threads.append({"t": time.time(), "cpu_s": snapshot})

    def dump(self, path: Path) -> None:
        """The records; with the engine in its own process, the HTTP process's threads apart (http_threads)."""
        body = {
            "steps": self.steps,
            "threads": self.threads,
            "http_threads": self.http_threads,
            "requests": self.requests,
            "http_text": self.http_text,
        }
        path.write_text(json.dumps(body) + "\n")


def start_profiler(out: Path) -> StepProfiler:
    """Timers on the engine's classes in this process, a thread sampler, and the dump at exit."""
    profiler = StepProfiler()
    profiler.install()
    stop = threading.Event()
    threading.Thread(target=profiler.sample_threads, args=(stop,), name="profile-sampler", daemon=True).start()

    def finish() -> None:
        stop.set()
        profiler.snapshot()  # the last: a short-lived process has one besides its first
        profiler.dump(out)

    atexit.register(finish)
    return profiler


def engine_setup(out: str) -> None:
    """Run first in the server's engine process (spawned: this module is its __mp_main__)."""
    start_profiler(Path(out))


def main(argv: list[str]) -> int:
    out, rest = Path(argv[0]), argv[1:]
    if rest[:1] == ["--switch-interval"]:  # an experiment: what the GIL's hand-over costs the engine thread
        sys.setswitchinterval(float(rest[1]))  # seconds (Python's default 0.005)
        rest = rest[2:]
    from qruntime.serve import startup

    engine_out = out.with_suffix(".engine.json")
    engine_out.unlink(missing_ok=True)
    in_thread = "thread" in [b for a, b in zip(rest, rest[1:], strict=False) if a == "--engine"]
    if not in_thread:  # the engine runs in a process of its own: the timers go there, this process samples its threads
        spawn = startup.spawn_engine

        def profiled_spawn(load_kwargs: dict[str, Any], threads: int | None = None, setup: Any = None, **kwargs: Any):
            return spawn(load_kwargs, threads, functools.partial(engine_setup, str(engine_out)), **kwargs)

        startup.spawn_engine = profiled_spawn  # the server spawns its engine process through startup.start
    profiler = start_profiler(out)

    def merge() -> None:  # registered after start_profiler's dump, so it runs before it (atexit is LIFO): dump last
        if engine_out.is_file():
            engine = json.loads(engine_out.read_text())
            profiler.steps = engine["steps"]
            profiler.http_threads = profiler.threads
            profiler.threads = engine["threads"]
            for request_id, stages in engine["requests"].items():
                profiler.requests.setdefault(request_id, {}).update(stages)

    atexit.register(merge)
    from qruntime.cli import main as qruntime_main

    return qruntime_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
