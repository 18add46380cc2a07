"""The all-reduce tuner's decision (qcompile/tune/allreduce.py) and how a load reads it back
(qruntime/rank.py). Timing itself needs tp GPUs: tests/gpu/test_custom_allreduce.py runs it."""

from __future__ import annotations

import random
from pathlib import Path

from qruntime.comm.all_reduce import DEFAULT_MAX_LL_BYTES, DEFAULT_MAX_ONE_SHOT_BYTES
from qruntime.kernel_configs import KernelTable
from qruntime.rank import RankConfig, _all_reduce_policy

from qcompile.tune.allreduce import LL_SIZES, SIZES, thresholds

ALL_SIZES = sorted({*LL_SIZES, *SIZES})


def _rows(ll_up_to: int, one_up_to: int, two_up_to: int, rng: random.Random) -> list[dict]:
    """Timings where the LL kernel is fastest up to `ll_up_to` (timed at LL_SIZES only), the one-shot
    up to `one_up_to`, the two-shot beats NCCL up to `two_up_to`."""
    rows = []
    for size in ALL_SIZES:
        nccl = rng.uniform(15, 40)
        if size <= one_up_to:
            one = nccl * rng.uniform(0.2, 0.6)
            two = one * rng.uniform(1.05, 2.0)
        elif size <= two_up_to:
            two = nccl * rng.uniform(0.3, 0.9)
            one = two * rng.uniform(1.05, 2.0)
        else:
            one, two = nccl * rng.uniform(1.0, 2.0), nccl * rng.uniform(1.0, 2.0)
        row = {"bytes": size, "nccl_us": nccl, "one_shot_us": one, "two_shot_us": two}
        if size in LL_SIZES:
            best = min(one, two, nccl)
            row["ll_us"] = best * (rng.uniform(0.3, 0.95) if size <= ll_up_to else rng.uniform(1.05, 2.0))
        rows.append(row)
    rng.shuffle(rows)  # the order rows come in does not matter
    return rows


def test_thresholds_are_the_ends_of_unbroken_runs_of_wins():
    rng = random.Random()
    for _ in range(50):
        ll = rng.choice((0, *LL_SIZES))
        one = rng.choice([s for s in (0, *ALL_SIZES) if s >= ll])
        two = rng.choice([s for s in (0, *ALL_SIZES) if s >= one])
        assert thresholds(_rows(ll, one, two, rng)) == (ll, max(ll, one), max(ll, one, two))
    rows = _rows(LL_SIZES[1], SIZES[3], SIZES[6], rng)
    for row in rows:  # a win past a loss does not count: each kernel gets one range
        if row["bytes"] == SIZES[8]:
            row["two_shot_us"] = row["nccl_us"] / 2
        if row["bytes"] == SIZES[5]:
            row["one_shot_us"] = row["two_shot_us"] / 2  # the one-shot back in the two-shot's range
        if row["bytes"] == LL_SIZES[3]:
            row["ll_us"] = row["one_shot_us"] / 2  # LL back in the one-shot's range
    assert thresholds(rows) == (LL_SIZES[1], SIZES[3], SIZES[6])
    nccl_only = [{"bytes": s, "nccl_us": 1.0} for s in ALL_SIZES]  # no peer memory: NCCL everywhere
    assert thresholds(nccl_only) == (0, 0, 0)


def _config(tp: int, custom: bool = True) -> RankConfig:
    from qruntime.kv_cache import KVCacheSpec
    from qruntime.kv_layout import KV_LAYOUTS

    kv = KVCacheSpec(KV_LAYOUTS["nhd"], "bf16", 16, 1, 1, 16)
    return RankConfig(
        Path("/nonexistent"), tuple(f"graph.rank{r}.onnx" for r in range(tp)), frozenset(), kv, None, None,
        "triton", 64, None, 1, 64, None, None, None, custom_all_reduce=custom,
    )  # fmt: skip


def test_a_load_takes_the_tuned_crossover_of_its_tp():
    limit, two = random.randrange(0, 1 << 26), random.randrange(0, 1 << 26)
    table = KernelTable.from_dict(
        {
            "device": "GPU X",
            "entries": {"AllReduce:tp4": {"1": {"max_one_shot_bytes": limit, "max_two_shot_bytes": two}}},
        },
        "t.json",
    )
    policy = _all_reduce_policy(_config(4), table)
    assert (policy.max_one_shot_bytes, policy.max_two_shot_bytes) == (limit, two)
    assert policy.max_ll_bytes == DEFAULT_MAX_LL_BYTES  # a table tuned before the LL kernel
    ll = random.randrange(0, 1 << 18) * 4
    entry = {"max_one_shot_bytes": limit, "max_two_shot_bytes": two, "max_ll_bytes": ll}
    with_ll = KernelTable.from_dict({"device": "GPU X", "entries": {"AllReduce:tp4": {"1": entry}}}, "t.json")
    assert _all_reduce_policy(_config(4), with_ll).max_ll_bytes == ll
    assert _all_reduce_policy(_config(2), table).max_one_shot_bytes == DEFAULT_MAX_ONE_SHOT_BYTES  # tuned at tp 4 only
    assert _all_reduce_policy(_config(4), None).max_one_shot_bytes == DEFAULT_MAX_ONE_SHOT_BYTES
    off = _all_reduce_policy(_config(4, custom=False), table)
    assert off.max_one_shot_bytes == off.max_two_shot_bytes == off.max_ll_bytes == 0
