"""Sampling from vocabulary shards (qruntime/engine/sharded_sampler.py) against tp=1's sampler on the
whole rows: on 2 and 3 gloo ranks, each holding its columns of the same random logits, the tokens
chosen together are tp=1's, greedy and seeded, step after step (rank 0's generators advance as
tp=1's do; the other ranks draw from the states rank 0 sends, pickled as a step is). The logits are
rounded to a coarse grid so that rows hold ties, some across the shards' boundary."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from qruntime import SamplingParams
from qruntime.comm.all_reduce import AllReducer
from qruntime.engine import sharded_sampler
from qruntime.engine.sampled_tokens import SampledTokens
from qruntime.engine.sampler import sample_on_device
from qruntime.engine.sharded_sampler import ShardedSampling, VocabShard, sample_shard, shardable

COLS = 40  # each rank's columns


def _case(seed: int, world: int, step: int) -> dict:
    """A step's logits, rows and rules, the same from the same (seed, world, step) in every process."""
    rng = random.Random(seed * 1000 + world * 100 + step)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    vocab, n = COLS * world, rng.randrange(8, 16)
    logits = (torch.randn(n, vocab, generator=gen) * rng.choice([0.5, 2.0, 8.0]) * 4).round() / 4  # ties
    if rng.random() < 0.5:
        logits = logits.to(torch.bfloat16)
    params, banned = [], []
    for row in range(n):
        kinds = ["greedy", "plain", "top_k", "wide_k", "min_p", "seeded"] if step else ["greedy"]  # 0: greedy alone
        kind = "greedy" if row < 3 else rng.choice(kinds)
        p = {"temperature": 0.0 if kind == "greedy" else rng.choice([0.3, 1.0, 1.7])}
        p["top_k"] = {"top_k": rng.randrange(1, 6), "wide_k": COLS + rng.randrange(1, COLS)}.get(kind, 0)
        p["min_p"] = 0.05 if kind == "min_p" else 0.0
        p["seed"] = rng.randrange(1 << 30) if kind == "seeded" else None
        if row >= 3 and rng.random() < 0.3:
            p["logit_bias"] = {rng.randrange(vocab): rng.choice([-100.0, 3.0, 0.5]) for _ in range(3)}
        params.append(SamplingParams(max_tokens=4, **p))
        banned.append(tuple(rng.sample(range(vocab), rng.randrange(0, 4))) if row >= 3 else ())
    for row in (0, 1):  # greedy rows whose best logit is in two shards: the lower id wins, as tp=1's argmax
        logits[row, [rng.randrange(COLS), rng.randrange(COLS, vocab)]] = logits[row].max() + 1
    # a model fault: tp=1 flags these rows (None), so must the shards. Row 2 (greedy) has a NaN in a
    # shard after the first: the rank holding it must win over the first's finite maximum
    faulty = [2, *rng.sample(range(3, n), 2)]
    logits[2, rng.randrange(COLS, vocab)] = float("nan")
    logits[faulty[1]] = float("-inf")
    logits[faulty[2], rng.choice([t for t in range(vocab) if t not in banned[faulty[2]]])] = float("inf")
    kept = [r for r in range(n) if r not in faulty]
    rows = sorted(faulty + rng.sample(kept, len(kept) - 2)) if rng.random() < 0.5 else None
    return {"logits": logits, "params": params, "banned": banned, "rows": rows}


class Streams:
    """The engine's generators: one shared by the unseeded rows, one per seed (kept across steps)."""

    def __init__(self, seed: int) -> None:
        self.shared, self.seeded = torch.Generator().manual_seed(seed), {}

    def of(self, params) -> list[torch.Generator | None]:
        """Per row: None (greedy), its seed's generator, or the shared one."""
        for p in params:
            if not p.greedy and p.seed is not None and p.seed not in self.seeded:
                self.seeded[p.seed] = torch.Generator().manual_seed(p.seed)
        return [None if p.greedy else self.shared if p.seed is None else self.seeded[p.seed] for p in params]


def _selected(case: dict) -> tuple[torch.Tensor, list, list]:
    rows = case["rows"] if case["rows"] is not None else range(len(case["params"]))
    return case["logits"][list(rows)], [case["params"][r] for r in rows], [case["banned"][r] for r in rows]


def _rank(rank: int, world: int, store: str, seed: int, steps: int, out: str, peer: bool, kernels: bool) -> None:
    if not kernels:  # the torch ops a CPU engine without Triton's interpreter takes
        sharded_sampler.kernel_runs_on = lambda device: False
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        reducer = AllReducer.create(dist.group.WORLD, torch.device("cpu")) if peer else None
        assert not peer or reducer.regions is not None
        shard = VocabShard(rank, world, dist.group.WORLD, reducer)
        cases = [_case(seed, world, step) for step in range(steps)]
        streams = Streams(seed)
        results = []
        for case in cases:
            _, params, banned = _selected(case)
            message, generators = [None], None
            if rank == 0:
                generators = streams.of(
                    params
                )  # what rank 0 sends with the step, through pickle as the engine's pipes do
                sampling = ShardedSampling.of(case["rows"], params, generators, banned)
                message = [pickle.dumps(sampling)]
            dist.broadcast_object_list(message, src=0)
            local = case["logits"][:, rank * COLS : (rank + 1) * COLS]
            ids, peaks = sample_shard(local, pickle.loads(message[0]), shard, generators)
            results.append(SampledTokens(ids, peaks).tolist())
        torch.save(results, out.format(rank))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("world", "peer", "kernels"),
    [(2, False, True), (3, False, True), (2, True, True), (2, False, False), (3, False, False)],
    ids=["2-gloo", "3-gloo", "2-peer", "2-gloo-torch", "3-gloo-torch"],
)
def test_shards_choose_the_tokens_tp1_chooses(world: int, peer: bool, kernels: bool, tmp_path: Path, rng) -> None:
    """Exchanged by all-gather (gloo), or by the custom all-reduce's one-shot kernel over peer memory
    (shared files on the CPU, the kernel under Triton's interpreter), as a GPU engine does; the
    candidates packed and picked by the shard_pick kernels (interpreted), or by torch ops."""
    seed, steps = rng.randrange(1 << 30), 3
    args = (world, str(tmp_path / "store"), seed, steps, str(tmp_path / "rank{}.pt"), peer, kernels)
    mp.spawn(_rank, args=args, nprocs=world)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert all(g == got[0] for g in got)  # every rank knows the tokens
    cases = [_case(seed, world, step) for step in range(steps)]
    streams = Streams(seed)
    varied = 0
    for step, case in enumerate(cases):
        logits, params, banned = _selected(case)
        want = sample_on_device(logits, params, streams.of(params), banned).tolist()
        assert got[0][step] == want, f"step {step}"
        assert want.count(None) == 3  # the NaN / +inf / all -inf rows are flagged, not sampled
        varied += sum(not p.greedy for p in params)
    assert varied > 0


def test_what_shards_cannot_sample_gathers_instead() -> None:
    assert shardable(SamplingParams(temperature=0.8, top_k=5, min_p=0.1, logit_bias={3: 1.0}))
    assert shardable(SamplingParams(temperature=0.0, top_p=0.5))  # greedy ignores top_p
    for params in (
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(logprobs=2),
    ):
        assert not shardable(params)
        with pytest.raises(ValueError, match="cannot be sampled from vocabulary shards"):
            ShardedSampling.of(None, [params], [torch.Generator()])
