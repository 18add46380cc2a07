"""`atomic_output_dir`: the target appears only when complete, and no temp dir outlives the process,
whichever statement an interruption lands on."""

import gc
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from qcompile.errors import ArtifactError
from qcompile.io.atomic import atomic_output_dir


def names(parent):
    return sorted(p.name for p in parent.iterdir())


def test_success_renames_into_place(tmp_path):
    payload = uuid.uuid4().hex
    with atomic_output_dir(tmp_path / "art") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".art.")
        (tmp / "f").write_text(payload)
        assert names(tmp_path) == [tmp.name]
    assert names(tmp_path) == ["art"]
    assert (tmp_path / "art" / "f").read_text() == payload


def test_error_in_the_body_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="boom"), atomic_output_dir(tmp_path / "art") as tmp:
        (tmp / "f").write_text("x")
        raise ValueError("boom")
    assert names(tmp_path) == []


def test_force_replaces_only_when_complete(tmp_path):
    old, new = uuid.uuid4().hex, uuid.uuid4().hex
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "f").write_text(old)
    with pytest.raises(ArtifactError, match="already exists"), atomic_output_dir(tmp_path / "art"):
        pass
    with pytest.raises(KeyboardInterrupt), atomic_output_dir(tmp_path / "art", force=True) as tmp:
        (tmp / "f").write_text(new)
        raise KeyboardInterrupt
    assert (tmp_path / "art" / "f").read_text() == old
    with atomic_output_dir(tmp_path / "art", force=True) as tmp:
        (tmp / "f").write_text(new)
    assert names(tmp_path) == ["art"]
    assert (tmp_path / "art" / "f").read_text() == new


def test_exit_never_called_still_removes_the_temp_dir_when_collected(tmp_path):
    """An exception that lands as `__exit__` is entered skips its body; the finalizer still removes
    the directory once the context manager is gone."""
    manager = atomic_output_dir(tmp_path / "art")
    tmp = manager.__enter__()
    (tmp / "f").write_text("x")
    del manager
    gc.collect()
    assert names(tmp_path) == []


def test_exit_never_called_removes_the_temp_dir_at_interpreter_exit(tmp_path):
    """The same, where the context manager is still referenced when the process exits (here by a
    daemon thread that never ends, as a kept traceback or a worker can): the directory is gone
    once the process has exited."""
    script = textwrap.dedent(
        f"""
        import sys, threading
        from qcompile.io.atomic import atomic_output_dir
        manager = atomic_output_dir({str(tmp_path / "art")!r})
        tmp = manager.__enter__()
        (tmp / "f").write_text("x")
        threading.Thread(target=lambda m, e: e.wait(), args=(manager, threading.Event()), daemon=True).start()
        del manager
        print(tmp.name, flush=True)
        sys.exit(143)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143, proc.stderr
    assert proc.stdout.strip().startswith(".art.")
    assert names(tmp_path) == []


@pytest.mark.parametrize("receiver", ["main thread", "other thread"])
def test_signal_held_while_the_temp_dir_is_made_is_raised_inside_the_guard(tmp_path, monkeypatch, receiver):
    """A SIGTERM that arrives while mkdtemp runs is held and raised before the body starts, and the
    just-made directory is removed; also when another thread of the process takes the signal (as
    torch's or a writer pool's can), where a signal mask on the main thread would hold nothing."""
    from qcompile.io import atomic

    class Terminated(BaseException):
        pass

    def terminate(signum, frame):
        raise Terminated

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    real_mkdtemp = atomic.tempfile.mkdtemp

    def mkdtemp_then_signal(**kwargs):
        path = real_mkdtemp(**kwargs)
        signal.pthread_kill(threading.get_ident() if receiver == "main thread" else other.ident, signal.SIGTERM)
        time.sleep(0.05)  # the other thread has taken it by now: Python runs the handler at the next call
        return path

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        monkeypatch.setattr(atomic.tempfile, "mkdtemp", mkdtemp_then_signal)
        with pytest.raises(Terminated), atomic_output_dir(tmp_path / "art"):
            pytest.fail("the body ran although a signal was pending")
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop.set()
    assert names(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is previous


def test_an_ignored_sigint_stays_ignored_while_the_temp_dir_is_made(tmp_path, monkeypatch):
    """A process started with SIGINT ignored (as a shell script's `cmd &` is) keeps ignoring it: the
    guard around mkdtemp swaps no recorder in for it (which would note a SIGINT and raise it again),
    and one that arrives meanwhile is dropped; the directory is made and published as usual."""
    from qcompile.io import atomic

    seen = []
    real_mkdtemp = atomic.tempfile.mkdtemp

    def mkdtemp_during_sigint(**kwargs):
        seen.append(signal.getsignal(signal.SIGINT))
        signal.raise_signal(signal.SIGINT)
        return real_mkdtemp(**kwargs)

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        monkeypatch.setattr(atomic.tempfile, "mkdtemp", mkdtemp_during_sigint)
        with atomic_output_dir(tmp_path / "art") as tmp:
            (tmp / "f").write_text("x")
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [signal.SIG_IGN]
    assert names(tmp_path) == ["art"]
