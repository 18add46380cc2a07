"""The custom all-reduce (qruntime.comm + kernels/custom_allreduce.py) on gloo ranks: each rank a
process running the kernels under Triton's interpreter over the other ranks' regions mapped from
shared files — the same protocol (copy in, signal, wait, sum from every region) as CUDA IPC memory on
GPUs. Checked against the sum of the ranks' inputs and the reference norm ops, over repeated calls of
changing sizes (both data halves, counts moving on per slot), beside messages that take gloo."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hopper_ptx import hopper_ptx
from qruntime.comm.all_reduce import AllReducePolicy, AllReducer
from qruntime.kernels.add_rmsnorm_quant import add_rmsnorm, add_rmsnorm_quant
from qruntime.ops import functional as fn
from test_kernel_quant import assert_fp8_close

MAX_BYTES = 16 << 10
LATE_S = 0.2  # the last rank's delay before each call
WATCHDOG_S = 300.0  # a rank's calls take seconds under the interpreter; past this its waits are aborted
# the ranks launch at most TEST_SLOTS programs (peer_sync.MAX_SLOTS, 128 on GPUs) of blocks of
# TEST_BLOCK elements (2048 on GPUs; LL blocks of TEST_BLOCK // 2 words), so that a few hundred elements
# run more blocks (or rows) than programs: each program loops, as a GPU's do on large messages, at a
# sixteenth of the interpreter's work of 128 programs
TEST_SLOTS, TEST_BLOCK = 8, 16
# one-shot up to 512 bytes (16 blocks: more than programs), two-shot up to 2 KiB, gloo beyond; the
# two-shot's runs of blocks (cdiv(blocks, world)) end off the programs' grid
POLICY = AllReducePolicy(max_one_shot_bytes=512, max_two_shot_bytes=2 << 10, max_ll_bytes=0)
# (tokens, hidden) of successive calls, in both data halves and counts moving on per slot: one element,
# a two-shot message (44 blocks, runs of 22 / 15), a message too large for the custom kernels (gloo),
# more one-shot blocks than programs ending in a partial block, gloo again, a partial block, two-shot
# (63 blocks), whole blocks, more blocks than programs, ...
SHAPES = ((1, 1), (3, 233), (2, 601), (9, 20), (16, 80), (1, 2), (1, 1000), (5, 48), (1, 250), (2, 120))


def _rank(rank: int, world: int, store: str, inputs: dict, out: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        from qruntime.kernels import custom_allreduce, ll_allreduce, peer_sync, two_shot_allreduce

        peer_sync.MAX_SLOTS = TEST_SLOTS  # before the reducer sizes its counters by it
        custom_allreduce.BLOCK = two_shot_allreduce.BLOCK = TEST_BLOCK
        ll_allreduce.BLOCK_WORDS = TEST_BLOCK // 2
        reducer = AllReducer.create(dist.group.WORLD, torch.device("cpu"), inputs["policy"])
        watchdog = threading.Timer(WATCHDOG_S, reducer.abort)  # a lost signal fails the sums, never hangs CI
        watchdog.daemon = True
        watchdog.start()
        results = {"regions": reducer.regions is not None, "sums": [], "took": [], "fused": [], "took_fused": []}
        late = rank == world - 1  # the last rank comes to every call late: the others wait for its words
        # the fused calls first, from fresh counts (LL_FUSED's reset check counts on them)
        for x, residual, w, quant in inputs["fused"]:
            time.sleep(LATE_S if late else 0)
            results["took_fused"].append(reducer.kernel(x[rank]))
            results["fused"].append(reducer.all_reduce_add_rmsnorm(x[rank].clone(), residual, w, 1e-6, quant))
            # the unfused kernels on the sum: the fused kernel shares their code after the sum
            summed = x.float().sum(0).to(x.dtype)
            unfused = add_rmsnorm_quant if quant else add_rmsnorm
            results.setdefault("unfused", []).append(unfused(summed, residual, w, 1e-6))
        for x in inputs["x"]:
            time.sleep(LATE_S if late else 0)
            mine = x[rank].clone()
            results["took"].append(reducer.kernel(mine))
            results["sums"].append(reducer.all_reduce(mine))
        watchdog.cancel()
        watchdog.join()  # it holds the reducer: gone before the group is destroyed
        torch.save(results, out.format(rank))
    finally:
        dist.destroy_process_group()


def _fused_want(x: torch.Tensor, residual, w, quant: bool) -> tuple:
    summed = x.float().sum(0).to(x.dtype)  # fp32 sum in rank order, rounded once
    h = summed if residual is None else summed + residual
    y = fn.rms_norm(h, w, 1e-6)
    return (*fn.dynamic_quant(y, 0), h) if quant else (y, h)


# LL up to 512 bytes (128 words: 16 blocks of 8, more than programs; whole 4-byte words), one-shot up
# to 1 KiB, two-shot up to 2 KiB, gloo beyond
LL_POLICY = AllReducePolicy(max_one_shot_bytes=1 << 10, max_two_shot_bytes=2 << 10, max_ll_bytes=512)
# LL: one word, more blocks than programs ending in a partial block, an odd element count (2 bytes:
# not a whole word, so one-shot), the largest LL message; then the other kernels' sizes, and LL again
LL_SHAPES = ((1, 2), (3, 60), (1, 1), (2, 128), (9, 24), (1, 1000), (2, 200), (1, 2), (5, 26), (2, 601))
# fused: (tokens, hidden, residual, quant), the first calls of fresh counts. Program 0 reads words
# 0..47 of parity 1 at count 2 (1 x 96); at 2 x 48 program 1 reads words 24..47 of parity 1 at count
# 2 too: a word not reset after reading would still hold that flag, and a rank whose peer is late
# would sum the first call's data. Then an odd width (one-shot), a message past LL's limit (one-shot,
# more rows than programs), and LL after them
LL_FUSED = ((1, 96, False, True), (1, 96, False, False), (2, 48, True, True), (3, 47, True, True))
LL_FUSED += ((26, 12, True, True), (5, 48, True, False), (1, 96, True, True))
# one-shot: rows of a partial block, one row, more rows than programs
FUSED = ((5, 48, True, True), (1, 96, False, False), (13, 12, True, True))


def _fused_inputs(world: int, gen: torch.Generator, cases) -> list:
    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    return [
        (randn(world, t, h), randn(t, h) if res else None, (torch.rand(h, generator=gen) + 0.5).to(torch.bfloat16), q)
        for t, h, res, q in cases
    ]


@pytest.mark.parametrize(
    "world,policy,shapes,fused",
    [
        (2, POLICY, SHAPES, FUSED),
        (3, POLICY, SHAPES, FUSED),
        (2, LL_POLICY, LL_SHAPES, LL_FUSED),
        (3, LL_POLICY, LL_SHAPES, LL_FUSED),
    ],
    ids=["one-shot-2", "one-shot-3", "ll-2", "ll-3"],
)
def test_ranks_sum_through_peer_memory(tmp_path: Path, world: int, policy, shapes, fused) -> None:
    seed = random.randrange(1 << 31)
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    inputs = {
        "policy": policy,
        "x": [torch.randn(world, *shape, generator=gen).to(torch.bfloat16) for shape in shapes],
        "fused": _fused_inputs(world, gen, fused),
    }
    mp.spawn(_rank, args=(world, str(tmp_path / "store"), inputs, str(tmp_path / "rank{}.pt")), nprocs=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    kinds = {"one_shot", "two_shot", None} | ({"ll"} if policy.max_ll_bytes else set())
    assert {policy.kernel(t * h * 2) for t, h in shapes} == kinds
    assert {policy.kernel(t * h * 2) for t, h, *_ in fused} == kinds - {"two_shot", None}
    # every kernel gets a message of more blocks (LL: TEST_BLOCK // 2 words) than programs, and the
    # fused one more rows than programs
    for kind in kinds - {None}:
        assert any(policy.kernel(t * h * 2) == kind and t * h > TEST_SLOTS * TEST_BLOCK for t, h in shapes), kind
    assert any(t > TEST_SLOTS for t, *_ in fused)
    for results in ranks:
        assert results["regions"]
        assert results["took_fused"] == [policy.kernel(t * h * 2) for t, h, *_ in fused]
        for (tokens, hidden), x, took, got in zip(shapes, inputs["x"], results["took"], results["sums"], strict=True):
            assert took == policy.kernel(tokens * hidden * 2)
            want = x.float().sum(0).to(torch.bfloat16)
            if took is not None or world == 2:  # gloo sums in its own order: the same bits only with two addends
                assert torch.equal(got, want), (tokens, hidden)
            else:  # gloo rounds each partial sum to bf16 (half an ulp: <= 2^-8 of its size, <= 2^-8 sum |x_r|)
                partials = (world - 1) * x.float().abs().sum(0)
                bound = 2**-8 * (partials + 2 * want.float().abs())  # and `want` and the last add round once each
                err = (got.float() - want.float()).abs()
                assert (err <= bound).all(), (tokens, hidden, float((err - bound).max()))
        for case, got, unfused in zip(inputs["fused"], results["fused"], results["unfused"], strict=True):
            want = _fused_want(*case)
            assert len(got) == len(want) == len(unfused)
            for g, u in zip(got, unfused, strict=True):  # bit for bit the unfused kernels' result
                assert g.shape == u.shape and torch.equal(g.view(torch.uint8), u.view(torch.uint8))
            assert torch.equal(got[-1], want[-1])  # residual_out: exact
            if case[-1]:  # the reference: up to the rare last-bit RMSNorm differences test_kernel_quant allows
                assert_fp8_close(got[0], want[0], 1 + got[0].numel() // 2000)
                torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
            else:
                torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2**-7, atol=0)
    for r in range(1, world):  # every rank holds the same bits
        for a, b in zip(ranks[0]["sums"], ranks[r]["sums"], strict=True):
            assert torch.equal(a, b)


def test_the_gpu_branch_compiles_with_system_scope_signals_and_vector_peer_loads():
    """What the interpreter cannot show: the HW branch compiles (a global a kernel reads must be a
    constexpr, inline asm must assemble), signals are one system-scope fence then relaxed system-scope
    exchanges, waits are system-scope acquires bounded by the global timer (a trap past the timeout),
    and peer data moves in 16-byte vectors that skip L1 (.cv)."""
    from qruntime.kernels import custom_allreduce as car

    common = {"n": "i32", "data": "*bf16", "deltas": "*i64", "half": "i32", "bases": "*i64", "counters": "*i64"}
    common |= {"timeout_ns": "i64", "abort": "i64"}
    unaligned = ("timeout_ns", "abort")
    one_shot = hopper_ptx(
        "qruntime.kernels.custom_allreduce",
        "_one_shot_kernel",
        {"x_ptr": "*bf16", "out_ptr": "*bf16", **common},
        {"RANK": 1, "WORLD": 4, "BLOCK": car.BLOCK, "HW": True, "PDL": False},
        8,
        unaligned,
    )
    fused_types = {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "ro_ptr": "*bf16", "y_ptr": "*u8"}
    fused_types |= {"s_ptr": "*fp32", "T": "i32", "H": "i32", "stride_x": "i32", "stride_r": "i32", **common}
    fused = hopper_ptx(
        "qruntime.kernels.custom_allreduce",
        "_fused_kernel",
        fused_types | {"eps": "fp32"},
        {"RANK": 0, "WORLD": 2, "HAS_RES": True, "QUANT": True, "BLOCK": 4096, "HW": True, "PDL": False},
        16,
        unaligned,
    )
    two_shot = hopper_ptx(
        "qruntime.kernels.two_shot_allreduce",
        "_two_shot_kernel",
        {"x_ptr": "*bf16", "out_ptr": "*bf16", "run": "i32", **common},
        {"RANK": 2, "WORLD": 4, "BLOCK": 2048, "HW": True, "PDL": False},
        8,
        unaligned,
    )
    for ptx, world, barriers in ((one_shot, 4, 1), (fused, 2, 1), (two_shot, 4, 2)):
        assert ptx.count("fence.acq_rel.sys;") >= barriers
        assert ptx.count("atom.global.sys.relaxed.exch.b64") == world * barriers
        assert "ld.global.sys.acquire.b64" in ptx and "%globaltimer" in ptx and "trap;" in ptx
        assert "ld.volatile.global.b32" in ptx  # the host's abort word, polled while waiting
        # ... once a wait has lasted more than POLL_AFTER_NS (1 ms): never in the short waits of a healthy group
        assert ptx.count(", 1000001;") == ptx.count("ld.volatile.global.b32") > 0
        assert "ld.global.cv.v4.b32" in ptx and "ld.global.cv.b16" not in ptx  # vectors, never scalar


def test_the_ll_kernels_push_flagged_words_and_spin_on_their_own_without_a_fence():
    """The LL kernels' GPU branch: no barrier (no system-scope fence, no signal exchange); each word
    goes to the peers as one 8-byte store and is waited for with volatile 8-byte loads of this rank's
    own area; a wait is bounded by the global timer (trap), the host's abort word polled only once a
    wait has lasted more than POLL_AFTER_NS, in every receive (one per peer)."""
    common = {"ll": "*i64", "ll_deltas": "*i64", "words": "i32", "counters": "*i64", "timeout_ns": "i64"}
    common |= {"abort": "i64"}
    unaligned = ("timeout_ns", "abort", "words", "n_words")
    plain = hopper_ptx(
        "qruntime.kernels.ll_allreduce",
        "_ll_kernel",
        {"xw_ptr": "*i32", "out_ptr": "*bf16", "n_words": "i32", **common},
        {"RANK": 1, "WORLD": 4, "EPW": 2, "BW": 1024, "HW": True, "PDL": False},
        8,
        unaligned,
    )
    fused_types = {"xw_ptr": "*i32", "r_ptr": "*bf16", "w_ptr": "*bf16", "ro_ptr": "*bf16", "y_ptr": "*u8"}
    fused_types |= {"s_ptr": "*fp32", "T": "i32", "H": "i32", "stride_xw": "i32", "stride_r": "i32", "eps": "fp32"}
    fused = hopper_ptx(
        "qruntime.kernels.ll_allreduce",
        "_ll_fused_kernel",
        fused_types | common,
        {"RANK": 0, "WORLD": 2, "HAS_RES": True, "QUANT": True, "EPW": 2, "BLOCK": 2048, "HW": True, "PDL": False},
        8,
        unaligned,
    )
    for ptx, peers in ((plain, 3), (fused, 1)):
        assert "fence." not in ptx and "atom." not in ptx and ".acquire" not in ptx
        assert "ld.volatile.global.b64" in ptx and "st.global.b64" in ptx
        assert "%globaltimer" in ptx and "trap;" in ptx
        assert ptx.count(", 1000001;") == ptx.count("ld.volatile.global.b32") == peers


def _abandoned_rank(rank: int, store: str, out: str, policy: AllReducePolicy) -> None:
    """Rank 0 all-reduces while rank 1 does not (it died, as far as rank 0 can tell); the abort word,
    raised from another thread a second later, ends rank 0's wait instead of leaving it spinning.
    Should the abort not work, rank 1 joins the all-reduce after RESCUE_S, so the test fails (waited
    too long) instead of hanging."""
    import time

    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        reducer = AllReducer.create(dist.group.WORLD, torch.device("cpu"), policy)
        x = torch.randn(300).to(torch.bfloat16)  # 600 bytes: LL where the policy has it, else one-shot
        assert reducer.kernel(x) == ("ll" if policy.max_ll_bytes else "one_shot")
        returned = Path(out + ".returned")
        if rank == 0:
            timer = threading.Timer(1.0, reducer.abort)
            timer.start()
            start = time.monotonic()
            reducer.all_reduce(x)
            torch.save({"waited": time.monotonic() - start}, out)
            returned.touch()
            timer.join()
        else:
            deadline = time.monotonic() + RESCUE_S
            while not returned.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            if not returned.exists():
                reducer.all_reduce(x)  # release rank 0: the abort did not
        dist.barrier()
    finally:
        dist.destroy_process_group()


RESCUE_S = 30.0


@pytest.mark.parametrize(
    "policy", [AllReducePolicy(MAX_BYTES, max_ll_bytes=0), AllReducePolicy(MAX_BYTES, max_ll_bytes=1 << 10)]
)
def test_the_abort_word_ends_a_wait_for_a_rank_that_never_comes(tmp_path: Path, policy) -> None:
    mp.spawn(_abandoned_rank, args=(str(tmp_path / "store"), str(tmp_path / "out.pt"), policy), nprocs=2)
    waited = torch.load(tmp_path / "out.pt")["waited"]
    assert 0.9 < waited < RESCUE_S / 2, waited
