"""The all-reduce tuner's decision (qcompile/tune/allreduce.py) and how a load reads it back
(qruntime/rank.py). Timing itself needs tp GPUs: tests/gpu/test_custom_allreduce.py runs it."""

from __future__ import annotations

import random
from pathlib import Path

from qruntime.comm.all_reduce import DEFAULT_MAX_CUSTOM_BYTES
from qruntime.kernel_configs import KernelTable
from qruntime.rank import RankConfig, _all_reduce_policy

from qcompile.tune.allreduce import SIZES, crossover


def _rows(custom_wins_up_to: int, rng: random.Random) -> list[dict]:
    rows = []
    for size in SIZES:
        nccl = rng.uniform(15, 40)
        custom = nccl * (rng.uniform(0.2, 0.9) if size <= custom_wins_up_to else rng.uniform(1.0, 2.0))
        rows.append({"bytes": size, "nccl_us": nccl, "custom_us": custom})
    rng.shuffle(rows)  # the order rows come in does not matter
    return rows


def test_crossover_is_the_largest_size_of_an_unbroken_run_of_wins():
    rng = random.Random()
    for edge in (0, *SIZES):
        assert crossover(_rows(edge, rng)) == edge
    rows = _rows(SIZES[5], rng)
    for row in rows:  # a win past a loss does not count: the choice is one threshold
        if row["bytes"] == SIZES[7]:
            row["custom_us"] = row["nccl_us"] / 2
    assert crossover(rows) == SIZES[5]


def _config(tp: int, custom: bool = True) -> RankConfig:
    from qruntime.kv_cache import KVCacheSpec
    from qruntime.kv_layout import KV_LAYOUTS

    kv = KVCacheSpec(KV_LAYOUTS["nhd"], "bf16", 16, 1, 1, 16)
    return RankConfig(
        Path("/nonexistent"), tuple(f"graph.rank{r}.onnx" for r in range(tp)), frozenset(), kv, None, None,
        "triton", 64, None, 1, 64, None, None, None, custom_all_reduce=custom,
    )  # fmt: skip


def test_a_load_takes_the_tuned_crossover_of_its_tp():
    limit = random.randrange(0, 1 << 26)
    table = KernelTable.from_dict(
        {"device": "GPU X", "entries": {"AllReduce:tp4": {"1": {"max_custom_bytes": limit}}}}, "t.json"
    )
    assert _all_reduce_policy(_config(4), table).max_custom_bytes == limit
    assert _all_reduce_policy(_config(2), table).max_custom_bytes == DEFAULT_MAX_CUSTOM_BYTES  # tuned at tp 4 only
    assert _all_reduce_policy(_config(4), None).max_custom_bytes == DEFAULT_MAX_CUSTOM_BYTES
    assert _all_reduce_policy(_config(4, custom=False), table).max_custom_bytes == 0
