"""The tensor-parallel rendezvous (engine/workers.py): rank 0's TCP store listens on 127.0.0.1 only,
and stops listening once every rank has joined the process group. Read from the kernel's socket
tables (/proc/net/tcp, /proc/net/tcp6), not from what torch says it did."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest
import qruntime
import torch.distributed as dist
from qruntime import SamplingParams
from qruntime.engine import workers

LISTEN = "0A"  # the TCP state column of /proc/net/tcp*


def listening(port: int) -> list[str]:
    """The local addresses (ip:port, as /proc writes them) of the sockets listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, state = fields[1], fields[3]
            if state == LISTEN and int(address.rsplit(":", 1)[1], 16) == port:
                found.append(address)
    return found


LOOPBACK = "0100007F"  # 127.0.0.1, little-endian hex as /proc/net/tcp writes it


def refused(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(2)
        return probe.connect_ex(("127.0.0.1", port)) != 0


def test_the_store_listens_on_loopback_only_until_the_ranks_have_met():
    store, listener = workers.serve_store(2)
    port = store.port
    assert listening(port) == [f"{LOOPBACK}:{port:04X}"]  # not 0.0.0.0, not [::]
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    key, value = f"k{random.getrandbits(32)}", str(random.getrandbits(64))
    client.set(key, value)
    assert store.get(key).decode() == value
    workers.stop_listening(listener)
    assert listening(port) == [] and refused(port)
    client.set(key, value + "!")  # the connections made before keep working
    assert store.get(key).decode() == value + "!"
    del client, store


@pytest.fixture(scope="module")
def tp2_art(tiny_ckpt, compiled) -> Path:
    return compiled(tiny_ckpt, "bf16", "tp=2")


def test_a_tp_engine_closes_its_store_once_loaded(tp2_art, monkeypatch):
    seen: dict[str, object] = {}
    serve = workers.serve_store

    def spy(world_size: int):
        store, listener = serve(world_size)
        seen.update(port=store.port, at_start=listening(store.port))
        return store, listener

    monkeypatch.setattr(workers, "serve_store", spy)
    with qruntime.load(tp2_art, "cpu", num_kv_blocks=32) as engine:
        port = seen["port"]
        assert seen["at_start"] == [f"{LOOPBACK}:{port:04X}"]
        assert listening(port) == [] and refused(port)
        prompt = [random.randrange(1, 500) for _ in range(random.randint(3, 9))]
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out.token_ids) == 4  # the ranks still run their collectives
