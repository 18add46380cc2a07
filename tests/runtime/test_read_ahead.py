"""qruntime.read_ahead: the weight files the manifest lists, confined as every read of an artifact is
(a link or a junk manifest: nothing read), covered chunk by chunk exactly once and never past the
memory budget, stopped between two chunks, and gone by the time qruntime.load returns."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import types

import pytest
import qruntime
from qruntime.artifact import ArtifactFormatError
from qruntime.read_ahead import ReadAhead, WeightFile, available_memory, chunks, read_chunk, weight_files


@pytest.fixture(scope="module")
def art(tiny_ckpt, compiled):
    return compiled(tiny_ckpt, "ptpc-fp8")


def test_the_files_are_the_manifests_weight_shards(art):
    files = weight_files(art)
    on_disk = sorted((art / "weights").glob("*.safetensors"))
    assert [f.path for f in files] == on_disk and on_disk
    assert [f.size for f in files] == [p.stat().st_size for p in on_disk]


def test_chunks_cover_every_byte_once_within_the_budget(tmp_path, rng):
    files = [WeightFile(tmp_path / f"w{i}", rng.randrange(1, 5000)) for i in range(rng.randrange(1, 6))]
    size = rng.randrange(1, 700)
    covered = [(f.path, o, n) for f, o, n in chunks(files, budget=10**9, chunk_bytes=size)]
    for file in files:
        spans = [(o, n) for p, o, n in covered if p == file.path]
        assert spans[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:], strict=False))
        assert sum(n for _, n in spans) == file.size and all(0 < n <= size for _, n in spans)
    budget = rng.randrange(1, sum(f.size for f in files) + 1)
    assert sum(n for _, _, n in chunks(files, budget, size)) == budget


def test_a_pass_asks_for_every_file_whole_through_its_own_descriptor(art):
    seen: dict[int, list[tuple[int, int]]] = {}  # inode -> (offset, length) asked for
    lock = threading.Lock()

    def fetch(fd, offset, length, scratch):
        assert len(scratch) >= length
        with lock:
            seen.setdefault(os.fstat(fd).st_ino, []).append((offset, length))

    files = weight_files(art)
    ahead = ReadAhead(files, budget=10**12, fetch=fetch, chunk_bytes=4096, threads=3).start()
    ahead.join(30)
    for file in files:  # no gap, no overlap (threads take the chunks in order, finish in any)
        spans = sorted(seen.pop(file.path.stat().st_ino))
        assert [o for o, _ in spans] == list(range(0, file.size, 4096)) and sum(n for _, n in spans) == file.size
    assert not seen  # and nothing but the weight files


def test_stop_ends_the_pass_between_two_chunks(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(os.urandom(4096))
    entered, release = threading.Event(), threading.Event()
    calls = []

    def fetch(fd, offset, length, scratch):
        calls.append(offset)
        entered.set()
        release.wait(10)

    ahead = ReadAhead([WeightFile(path, 4096)], budget=4096, fetch=fetch, chunk_bytes=512, threads=1).start()
    assert entered.wait(10)
    stopper = threading.Thread(target=ahead.stop)
    stopper.start()
    while not ahead._stop.is_set():
        pass
    release.set()
    stopper.join(10)
    assert calls == [0] and not ahead._threads[0].is_alive()
    unstopped = ReadAhead(
        [WeightFile(path, 4096)], 4096, fetch=lambda *a: calls.append(a[1]), chunk_bytes=512, threads=1
    )
    unstopped.start().join(10)
    assert calls == [0, *range(0, 4096, 512)]  # the break was the stop's


@pytest.mark.parametrize("breakage", ["link", "no manifest", "junk manifest", "hub"])
def test_a_bad_artifact_reads_nothing(art, tmp_path, breakage):
    copy = tmp_path / "art"
    shutil.copytree(art, copy)
    target = tmp_path / "outside.safetensors"
    if breakage == "link":
        shard = sorted((copy / "weights").glob("*.safetensors"))[0]
        shutil.move(shard, target)
        shard.symlink_to(target)
    elif breakage == "no manifest":
        (copy / "manifest.json").unlink()
    elif breakage == "junk manifest":
        (copy / "manifest.json").write_text('{"format_version": "1.0", "files": ["../outside.safetensors"]}')
    path = "hf://org/model" if breakage == "hub" else copy
    ahead = ReadAhead.of_artifact(path)
    assert ahead.files == [] and not ahead.start().started


def test_the_budget_is_a_share_of_the_available_memory(art, tmp_path, monkeypatch):
    import qruntime.read_ahead as read_ahead

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  999999 kB\nMemAvailable:  3 kB\n")
    monkeypatch.setattr(read_ahead, "MEMINFO", meminfo)
    assert available_memory() == 3072
    assert ReadAhead.of_artifact(art).budget == int(3072 * read_ahead.MEMORY_SHARE)
    monkeypatch.setattr(read_ahead, "MEMINFO", tmp_path / "none")
    total = sum(f.size for f in weight_files(art))
    assert available_memory() is None and ReadAhead.of_artifact(art).budget == total


def test_a_chunk_is_read_whole(tmp_path, rng):
    data = os.urandom(10_000)
    path = tmp_path / "w"
    path.write_bytes(data)
    offset, length = rng.randrange(0, 5000), rng.randrange(1, 5000)
    scratch = bytearray(5000)
    fd = os.open(path, os.O_RDONLY)
    try:
        read_chunk(fd, offset, length, scratch)
    finally:
        os.close(fd)
    assert bytes(scratch[:length]) == data[offset : offset + length]


def test_the_load_reads_ahead_before_the_loader_and_leaves_no_thread(art, monkeypatch):
    """qruntime.load starts the pass before the loader runs (here the loader waits for the whole
    pass, which in a fresh process overlaps torch's import) and stops it when the load returns."""
    import qruntime.loader
    import qruntime.read_ahead as read_ahead

    asked, total = [], sum(f.size for f in weight_files(art))
    monkeypatch.setattr(read_ahead, "read_chunk", lambda fd, offset, length, scratch: asked.append(length))
    load_artifact = qruntime.loader.load

    def loader(*args, **kwargs):
        deadline = time.monotonic() + 30
        while sum(asked) < total and time.monotonic() < deadline:
            time.sleep(0.001)
        assert sum(asked) == total  # the whole pass, before the loader ran
        return load_artifact(*args, **kwargs)

    monkeypatch.setattr(qruntime.loader, "load", loader)
    engine = qruntime.load(art, "cpu", num_kv_blocks=16)
    assert not any(t.name == "qruntime-read-ahead" for t in threading.enumerate())
    phases = engine.description["load_seconds"]
    assert list(phases)[:2] == ["imports", "setup"] and phases["imports"] >= 0


def test_serves_engine_process_reads_ahead_before_it_imports_the_engine(art, monkeypatch):
    """engine_spawn.run_engine (the engine process's first code) starts the pass, then imports the
    engine side (torch: seconds), whose load (qruntime.loader.load) reads no second time."""
    import types

    import qruntime.read_ahead as read_ahead
    from qruntime.serve import engine_spawn

    asked, total, seen = [], sum(f.size for f in weight_files(art)), []
    monkeypatch.setattr(read_ahead, "read_chunk", lambda fd, offset, length, scratch: asked.append(length))

    def entry(conn, load_kwargs, *rest):
        deadline = time.monotonic() + 30
        while sum(asked) < total and time.monotonic() < deadline:
            time.sleep(0.001)
        seen.append((conn, load_kwargs["path"], rest, sum(asked)))

    module = types.ModuleType("fake_engine_entry")
    module.main = entry
    monkeypatch.setitem(sys.modules, "fake_engine_entry", module)
    engine_spawn.run_engine(("fake_engine_entry", "main"), "conn", {"path": art}, 1, 2)
    assert seen == [("conn", art, (1, 2), total)]


IOPRIO_GET = {"x86_64": 252, "aarch64": 31}


def _io_class() -> int:
    """The calling thread's I/O priority class (ioprio_get on its thread id): 0 none, 2 best effort, 3 idle."""
    import ctypes
    import platform

    libc = ctypes.CDLL(None, use_errno=True)
    value = libc.syscall(IOPRIO_GET[platform.machine()], 1, threading.get_native_id())
    assert value >= 0, os.strerror(ctypes.get_errno())
    return value >> 13


@pytest.mark.parametrize("idle_io", [True, False])
def test_idle_io_puts_each_reading_thread_and_only_it_in_the_idle_class(art, idle_io):
    classes: list[int] = []

    def fetch(fd, offset, length, scratch):
        classes.append(_io_class())

    files = weight_files(art)
    pass_ = ReadAhead(files, budget=10**9, fetch=fetch, chunk_bytes=1 << 12, threads=2, idle_io=idle_io).start()
    pass_.join()
    assert classes and set(classes) == ({3} if idle_io else {_io_class()})
    assert _io_class() != 3  # the loading thread keeps its class


def _count_manifest_parses(monkeypatch) -> list[str]:
    """The documents qruntime.artifact parses from now on (each manifest.json read)."""
    import qruntime.artifact as artifact

    parsed, loads = [], artifact.bounded_json.loads
    monkeypatch.setattr(
        artifact.bounded_json, "loads", lambda raw, **kw: (parsed.append(kw["what"]), loads(raw, **kw))[1]
    )
    return parsed


def test_a_load_reads_its_manifest_once(art, monkeypatch):
    """qruntime.load reads manifest.json once, for the read-ahead, the early kernel build and the loader
    (for qwen3-235b-a22b's 4 MB manifest a read is a fifth of a second here)."""
    parsed = _count_manifest_parses(monkeypatch)
    engine = qruntime.load(art, "cpu", num_kv_blocks=16)
    assert parsed == [str(art / "manifest.json")]
    assert engine.generate([[1, 2, 3]], qruntime.SamplingParams(max_tokens=2))[0].token_ids
    parsed.clear()
    with pytest.raises(ArtifactFormatError, match="manifest.json"):  # a bad path: the loader says what is wrong
        qruntime.load(art / "manifest.json", "cpu", num_kv_blocks=16)
    assert parsed == []


def test_serves_engine_process_hands_the_load_its_manifest(art, monkeypatch):
    """engine_spawn.run_engine reads the manifest once, for its read-ahead and early build, and hands
    it to the load it runs (qruntime.loader.load's manifest)."""
    from qruntime.artifact import read_manifest
    from qruntime.serve import engine_spawn

    parsed, seen = _count_manifest_parses(monkeypatch), []
    module = types.ModuleType("fake_engine_entry")
    module.main = lambda conn, load_kwargs, *rest: seen.append(load_kwargs)
    monkeypatch.setitem(sys.modules, "fake_engine_entry", module)
    engine_spawn.run_engine(("fake_engine_entry", "main"), "conn", {"path": art}, 1, 2)
    assert len(parsed) == 1 and seen[0]["manifest"] == read_manifest(art)
