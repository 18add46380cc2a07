"""qruntime.engine.block_manager: paged KV-block allocation, checked by hand and by random op sequences."""

import os
import random
import subprocess
import sys

import pytest
from qruntime.engine.block_manager import BlockManager, NoFreeBlocks


def test_engine_core_does_not_import_torch():
    code = (
        "import sys, qruntime.engine.request, qruntime.engine.block_manager, qruntime.engine.scheduler\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, loaded"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 16), (16, 0), (-1, 16), (4, -2)])
def test_bad_config(num_blocks, block_size):
    with pytest.raises(ValueError, match=">= 1"):
        BlockManager(num_blocks, block_size)


def test_grow_table_free():
    bm = BlockManager(4, 16)
    assert (bm.num_blocks, bm.block_size, bm.num_free_blocks, bm.num_used_blocks) == (4, 16, 4, 0)
    assert [bm.blocks_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        bm.blocks_for(-1)
    assert bm.table("a") == ()
    assert bm.num_missing("a", 17) == 2
    assert bm.grow("a", 17) == (0, 1)
    assert bm.grow("a", 32) == (0, 1)  # still covered: nothing new
    assert bm.grow("a", 5) == (0, 1)  # never shrinks
    assert bm.grow("b", 0) == ()
    assert bm.grow("b", 1) == (2,)
    assert (bm.num_free_blocks, bm.num_used_blocks) == (1, 3)
    assert bm.num_missing("b", 48) == 2 and not bm.can_grow("b", 48)
    assert bm.can_grow("b", 32) and bm.num_missing("a", 32) == 0

    with pytest.raises(NoFreeBlocks, match="needs 2 more blocks"):
        bm.grow("b", 48)
    assert (bm.table("a"), bm.table("b"), bm.num_free_blocks) == ((0, 1), (2,), 1)  # nothing allocated

    bm.free("a")
    bm.free("a")  # no-op
    bm.free("never-seen")  # no-op
    assert (bm.table("a"), bm.num_free_blocks) == ((), 3)
    assert bm.grow("b", 48) == (2, 0, 1)  # freed blocks are reused, lowest first
    with pytest.raises(NoFreeBlocks):
        bm.grow("c", 64)  # needs 4, 1 free
    bm.free("b")
    assert bm.grow("c", 64) == (0, 1, 2, 3) and bm.num_free_blocks == 0


def _check_invariants(bm: BlockManager, ids: list[str], want_len: dict[str, int], msg: str) -> None:
    tables = {rid: bm.table(rid) for rid in ids}
    held = [b for t in tables.values() for b in t]
    assert len(held) == len(set(held)), f"a block is in two tables: {tables} ({msg})"
    assert all(0 <= b < bm.num_blocks for b in held), msg
    assert bm.num_used_blocks == len(held) and bm.num_free_blocks == bm.num_blocks - len(held), msg
    for rid, table in tables.items():
        assert len(table) == want_len.get(rid, 0), f"{rid}: {table} ({msg})"


def test_random_ops_keep_tables_disjoint():
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    bm = BlockManager(rng.randint(1, 24), rng.choice([1, 2, 4, 16]))
    ids = [f"r{i}" for i in range(6)]
    want_len: dict[str, int] = {}  # the model: blocks each request should hold
    failures = 0
    for step in range(2000):
        msg = f"seed={seed} step={step}"
        rid = rng.choice(ids)
        if rng.random() < 0.25:
            bm.free(rid)
            want_len.pop(rid, None)
        else:
            num_tokens = rng.randint(0, bm.num_blocks * bm.block_size + 3)
            need = max(want_len.get(rid, 0), bm.blocks_for(num_tokens))
            fits = need - want_len.get(rid, 0) <= bm.num_free_blocks
            assert bm.can_grow(rid, num_tokens) == fits, msg
            before = {r: bm.table(r) for r in ids}
            if fits:
                table = bm.grow(rid, num_tokens)
                assert table[: len(before[rid])] == before[rid], f"existing blocks moved ({msg})"
                assert table == bm.table(rid), msg
                want_len[rid] = need
            else:
                failures += 1
                with pytest.raises(NoFreeBlocks):
                    bm.grow(rid, num_tokens)
                assert {r: bm.table(r) for r in ids} == before, f"failed grow changed state ({msg})"
        _check_invariants(bm, ids, want_len, msg)
    assert failures > 0, f"the workload never ran out of blocks (seed={seed})"
    for rid in ids:
        bm.free(rid)
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
