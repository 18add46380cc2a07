"""FrontierHasher: the digest of a file written in random order equals hashlib's of the result."""

import hashlib
import os
import random
import threading

import pytest

from qcompile.io.frontier_hash import FrontierHasher


@pytest.mark.parametrize("size", [1, 1000, (8 << 20) * 2 + 12345])
def test_random_order_writes(tmp_path, size):
    path = tmp_path / "f.bin"
    data = os.urandom(size)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, size)
    hasher = FrontierHasher(path, size)
    cuts = sorted(random.sample(range(1, size), min(size - 1, 40))) if size > 1 else []
    pieces = list(zip([0, *cuts], [*cuts, size], strict=True))
    random.shuffle(pieces)

    def write(chunk):
        for begin, end in chunk:
            os.pwrite(fd, data[begin:end], begin)
            hasher.mark(begin, end)

    threads = [threading.Thread(target=write, args=(pieces[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.close(fd)
    assert hasher.result() == hashlib.sha256(data).hexdigest()


def test_cancel_an_incomplete_file(tmp_path):
    path = tmp_path / "g.bin"
    path.write_bytes(b"\0" * 100)
    hasher = FrontierHasher(path, 100)
    hasher.mark(0, 40)
    hasher.mark(50, 100)  # a hole at 40..50: never complete
    hasher.cancel()
    with pytest.raises(RuntimeError, match="cancelled before the file was complete"):
        hasher.result()
