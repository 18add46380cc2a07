"""The paged attention kernels (decode with split context, varlen prefill) against the reference op
qruntime.ops.attention.PagedAttention, for every KV layout with model-dtype and fp8 pools."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest
import torch
from qruntime.kernels import paged_decode_attention as decode_kernel
from qruntime.kernels import paged_prefill_attention as prefill_kernel
from qruntime.kernels.paged_decode_attention import decode_num_splits, paged_decode_attention
from qruntime.kernels.paged_prefill_attention import paged_prefill_attention
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS
from qruntime.ops.attention import PagedAttention
from qruntime.ops.base import AttentionMetadata, OpEnv, StepContext

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (q heads, kv heads, head_dim, block_size): GQA groups of 2, 3 (not a power of two) and 8
SHAPES = {"g2": (4, 2, 32, 16), "g3": (6, 3, 64, 16), "g8-bs8": (8, 1, 32, 8)}
# (kv_dtype, model dtype): bf16 pools, fp8 pools with bf16 queries, an fp32 model (fp32 pools)
POOLS = {"bf16": ("bf16", torch.bfloat16), "fp8": ("fp8_e4m3", torch.bfloat16), "fp32": ("bf16", torch.float32)}
# every layout with every pool, and each shape once with each layout and once with each pool (a Latin square)
CASES = [
    pytest.param(layout, POOLS[pool], SHAPES[shape], id=f"{layout}-{pool}-{shape}")
    for i, layout in enumerate(KV_LAYOUTS)
    for j, pool in enumerate(POOLS)
    for shape in [list(SHAPES)[(i + j) % len(SHAPES)]]
]


class Step:
    """A cache filled with random K/V for sequences (context_len, q_len) through random non-contiguous
    block tables, the queries, and the reference op's output (as tests/runtime/test_qruntime_ops.py)."""

    def __init__(
        self,
        layout: str,
        kv_dtype: str,
        dtype: torch.dtype,
        shape: tuple,
        seqs: list[tuple[int, int]],
        rng: random.Random | None = None,
    ):
        rng = rng or random.Random(random.randrange(1 << 30))
        nh, kvh, d, block_size = shape
        if layout == "x-packed" and block_size % KV_LAYOUTS[layout].pack(kv_dtype):
            block_size = 16  # x-packed fp8 packs 16 tokens
        self.nh, self.kvh, self.d, self.block_size, self.layout = nh, kvh, d, block_size, layout
        self.k_scale, self.v_scale = (rng.uniform(0.02, 0.05), rng.uniform(0.02, 0.05))
        spec = KVCacheSpec(KV_LAYOUTS[layout], kv_dtype, block_size, 1, kvh, d)
        per_seq = [-(-ctx // block_size) for ctx, _ in seqs]
        blocks = sum(per_seq) + 5
        self.cache = KVCache(spec, blocks, dtype, DEVICE)
        free = torch.randperm(blocks).tolist()
        table = torch.full((len(seqs), max(per_seq) + 2), -1, dtype=torch.int32)  # unused entries: -1
        starts, slots_per_seq = [0], []
        for b, (ctx, q_len) in enumerate(seqs):
            table[b, : per_seq[b]] = torch.tensor([free.pop() for _ in range(per_seq[b])], dtype=torch.int32)
            pos = torch.arange(ctx)
            slots = table[b].long()[pos // block_size] * block_size + pos % block_size
            k, v = torch.randn(ctx, kvh, d, dtype=dtype), torch.randn(ctx, kvh, d, dtype=dtype)
            self.cache.write(0, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE), self.k_scale, self.v_scale)
            slots_per_seq.append(slots.to(DEVICE))
            starts.append(starts[-1] + q_len)
        self.meta = AttentionMetadata(tuple(starts), tuple(c for c, _ in seqs), tuple(slots_per_seq))
        self.q = torch.randn(starts[-1], nh, d, dtype=dtype, device=DEVICE)
        self.block_tables = table.to(DEVICE)
        self.context_lens = torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=DEVICE)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
        self.max_q_len = max(q for _, q in seqs)
        attrs = {"layer": 0, "layout": layout, "block_size": block_size, "kv_dtype": kv_dtype}
        attrs |= {"k_scale": self.k_scale, "v_scale": self.v_scale, "num_heads": nh, "num_kv_heads": kvh}
        attrs |= {"head_dim": d, "scale": d**-0.5}
        self.attrs, self.env = attrs, OpEnv(dtype, DEVICE, spec)
        self.ref = PagedAttention(attrs, self.env)(StepContext(self.cache, self.meta), self.q, None, None, None, None)

    def kwargs(self) -> dict:
        return {
            "layout": self.layout,
            "block_size": self.block_size,
            "scale": self.d**-0.5,
            "k_scale": self.k_scale,
            "v_scale": self.v_scale,
            "num_kv_heads": self.kvh,
        }

    def decode(self, **extra) -> torch.Tensor:
        args = (self.q, self.cache.k[0], self.cache.v[0], self.block_tables, self.context_lens)
        return paged_decode_attention(*args, **self.kwargs(), **extra)

    def prefill(self, **extra) -> torch.Tensor:
        args = (self.q, self.cache.k[0], self.cache.v[0], self.block_tables, self.context_lens, self.query_start_loc)
        return paged_prefill_attention(*args, **self.kwargs(), max_q_len=self.max_q_len, **extra)

    def rows(self, decodes: bool) -> list[int]:
        """The step's token rows of its decode sequences (q_len 1), or of the others."""
        starts = self.meta.query_start
        return [starts[b] for b in range(len(starts) - 1) if (starts[b + 1] - starts[b] == 1) == decodes]


def mixed_step(
    rng: random.Random,
    prompt_len: tuple[int, int] = (2, 40),
    prefixes: bool = True,
    pools: tuple[str, ...] = tuple(POOLS),
    prompt_first: bool = False,
) -> Step:
    """A mixed step drawn from rng, printed: a random layout, pool and shape; 1-5 decodes over contexts
    of 1-90 beside 2-3 prompts of prompt_len tokens (with prefixes, the second after a cached prefix
    and the third either), in random order. Small: the interpreter takes ~0.1 s a program."""
    torch.manual_seed(rng.randrange(1 << 30))  # the cache's blocks and values, q
    layout, pool, shape = rng.choice(list(KV_LAYOUTS)), rng.choice(pools), rng.choice(list(SHAPES))
    seqs = [(rng.randint(1, 90), 1) for _ in range(rng.randint(1, 5))]
    for i in range(rng.randint(2, 3)):
        q_len = rng.randint(*prompt_len)
        prefix = rng.randint(1, 50) if prefixes and (i == 1 or (i == 2 and rng.random() < 0.5)) else 0
        seqs.append((prefix + q_len, q_len))
    rng.shuffle(seqs)
    if prompt_first:  # a prompt's row where a stray program for "the 0th sequence" would write
        seqs.sort(key=lambda seq: seq[1] == 1)
    print(f"{layout} {pool} {shape} (context, q_len): {seqs}")
    return Step(layout, *POOLS[pool], SHAPES[shape], seqs, rng)


BF16_ATOL = 4e-5


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: 1e-5. bf16: both round an fp32 result, which may land on either side of a rounding
    boundary: within 2 bf16 ulps of the reference value, plus BF16_ATOL for outputs near 0. Those are
    sums of terms of size ~|v| / context that cancel, and the kernel's fp32 (exp2, scales folded into
    qk) and the reference's differ there by more than an ulp of the result: with fp8 pools, 3 of 120
    draws of nhd-fp8-g3 needed more than 1e-5 (the largest 1.34e-5); a wrong mask, block or scale is
    off by 1e-2 and more."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.isfinite(got).all()
    err = (got.float() - ref.float()).abs()
    if ref.dtype == torch.float32:
        tol = 1e-5 + 1e-5 * ref.abs()
    else:
        exponent = torch.floor(torch.log2(ref.float().abs().clamp_min(2.0**-100)))
        tol = 2 * torch.exp2(exponent - 7) + BF16_ATOL
    assert (err <= tol).all(), f"max err {err.max().item():.3g} (worst excess {(err - tol).max().item():.3g})"


@pytest.mark.parametrize(("layout", "pool", "shape"), CASES)
def test_decode_equals_reference_with_one_and_many_splits(layout, pool, shape):
    seqs = [(ctx, 1) for ctx in (1, 17, 63, random.randint(2, 100))]
    step = Step(layout, *pool, shape, seqs)
    one = step.decode(num_splits=1)
    assert_close(one, step.ref)
    many = step.decode(num_splits=3, max_context_len=100)  # each context in 3 partitions, sized on the device
    assert_close(many, step.ref)
    assert torch.allclose(one.float(), many.float(), rtol=1e-5, atol=1e-5) or one.dtype != torch.float32
    assert_close(step.decode(), step.ref)  # the default: splits from the block tables' capacity


def test_decode_past_max_context_len_and_empty_rows():
    """A context longer than max_context_len still counts every token (partitions are sized from each
    sequence's own context); more partitions than a context needs, and a padding row with context 0
    (zeros), are right too."""
    step = Step("hnd", "bf16", torch.float32, (4, 2, 32, 16), [(150, 1), (5, 1), (1, 1)])
    assert_close(step.decode(max_context_len=64, num_splits=2), step.ref)
    assert_close(step.decode(max_context_len=400, num_splits=6), step.ref)
    padded = step.context_lens.clone()
    padded[1] = 0
    kwargs = step.kwargs()
    out = paged_decode_attention(step.q, step.cache.k[0], step.cache.v[0], step.block_tables, padded, **kwargs)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out[[0, 2]], step.ref[[0, 2]])


def test_decode_split_count_fills_the_gpu_and_is_host_only():
    assert decode_num_splits(1, 8, 8000, 132) == 50  # 3 programs per SM
    assert decode_num_splits(1, 8, 512, 132) == 8  # MIN_PARTITION-sized partitions
    assert decode_num_splits(64, 8, 8000, 132) == 1  # the batch alone fills the GPU
    assert decode_num_splits(1, 8, 50, 132) == 1


def test_a_batch_and_its_graph_bucket_get_the_same_partitions():
    """Eager decode of a batch and the CUDA graph of the bucket it is padded to must split contexts
    alike (same sums, same tokens): the split count may not change inside a bucket's range."""
    from bisect import bisect_left

    from qruntime.engine.cuda_graphs import DEFAULT_BUCKETS

    for batch in range(1, DEFAULT_BUCKETS[-1] + 1):
        bucket = DEFAULT_BUCKETS[bisect_left(DEFAULT_BUCKETS, batch)]
        for kvh, ctx in ((8, 8000), (4, 40960), (2, 512)):
            assert decode_num_splits(batch, kvh, ctx, 132) == decode_num_splits(bucket, kvh, ctx, 132), (batch, bucket)


@pytest.mark.parametrize(("layout", "pool", "shape"), CASES)
def test_prefill_equals_reference_for_a_mixed_batch(layout, pool, shape):
    # a full prompt, a chunk after a cached prefix, a decode row, a 1-token prompt, a prompt of 17
    seqs = [(40, 40), (63, random.randint(2, 40)), (30, 1), (1, 1), (17, 17)]
    random.shuffle(seqs)
    step = Step(layout, *pool, shape, seqs)
    assert_close(step.prefill(), step.ref)


def test_mixed_step_rows_split_between_the_kernels(rng):
    """A mixed step as the fast op runs it: the prefill kernel for the prompts only (num_prefills),
    the decode kernel for the decode rows only (query_start_loc), into one output: the reference's on
    every row. The decode kernel, in one partition or several, writes no other row."""
    step = mixed_step(rng)
    decode_rows, prompt_rows = step.rows(decodes=True), step.rows(decodes=False)
    out = step.prefill(num_prefills=len(prompt_rows))
    varlen = {"query_start_loc": step.query_start_loc, "num_decodes": len(decode_rows)}
    out[decode_rows] = float("nan")
    assert step.decode(**varlen, out=out, num_splits=1) is out
    assert_close(out, step.ref)
    alone = step.decode(**varlen, num_splits=2, out=torch.full_like(out, float("nan")))
    assert alone[prompt_rows].isnan().all()
    assert_close(alone[decode_rows], step.ref[decode_rows])


class Spy:
    """Records the keyword arguments of each call of a kernel wrapper, then calls it."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs)
        return self.fn(*args, **kwargs)


def run_fast_op(step: Step) -> tuple[torch.Tensor, Spy, Spy]:
    """The fast path's PagedAttention on the step (engine-like metadata), its kernel calls recorded."""
    from qruntime.ops.triton_ops import PagedAttention as FastPagedAttention

    op = FastPagedAttention(step.attrs, step.env)
    op.decode, op.prefill = Spy(op.decode), Spy(op.prefill)
    meta = dataclasses.replace(step.meta, max_q_len=step.max_q_len, max_context_len=256)
    feeds = (step.block_tables, step.context_lens, step.query_start_loc)
    return op(StepContext(step.cache, meta), step.q, None, *feeds), op.decode, op.prefill


def test_fast_op_sends_the_decode_rows_of_a_mixed_step_to_the_decode_kernel(rng, monkeypatch):
    """One prefill launch over the prompts, one decode launch over the decode rows, one output equal
    to the reference's. A scan block of 4 makes the kernels find their sequences over several blocks."""
    monkeypatch.setattr(decode_kernel, "SCAN_BLOCK", 4)
    monkeypatch.setattr(prefill_kernel, "SCAN_BLOCK", 4)
    step = mixed_step(rng)
    out, decode, prefill = run_fast_op(step)
    assert_close(out, step.ref)
    decodes = len(step.rows(decodes=True))
    assert [c["num_prefills"] for c in prefill.calls] == [len(step.meta.context_lens) - decodes]
    assert [(c["num_decodes"], c["out"] is out) for c in decode.calls] == [(decodes, True)]


def test_fast_op_runs_long_fresh_prompts_beside_decodes_with_sdpa(rng):
    """Fresh prompts of SDPA_MIN_TOKENS or more beside decodes: torch's fused attention for the
    prompts, the decode kernel for the decode rows, no prefill kernel. An fp32 model: torch's CPU
    attention in bf16 is several bf16 ulps off (the kernels are not)."""
    from qruntime.ops.triton_ops import PagedAttention as FastPagedAttention

    n = FastPagedAttention.SDPA_MIN_TOKENS
    step = mixed_step(rng, prompt_len=(n, n + 20), prefixes=False, pools=("fp32",))
    out, decode, prefill = run_fast_op(step)
    assert_close(out, step.ref)
    assert not prefill.calls and len(decode.calls) == 1


def test_a_captured_steps_attention_launches_from_bounds(rng, monkeypatch):
    """bounds_only (engine/mixed_graphs.py): a mixed step padded as a captured graph pads it, with
    more token rows (padding) and more sequences (empty ones, whose context lengths and block tables
    hold stale values) than the step has; the grids come from those sizes alone. The step's rows equal
    the reference, the padding rows are zero although their memory held NaN, and the decode kernel's
    programs past the step's decodes write nothing (they would overwrite a prompt's row)."""
    from qruntime.ops.triton_ops import PagedAttention as FastPagedAttention

    step = mixed_step(rng, prompt_first=True)
    tokens = step.q.shape[0]
    pad_rows, pad_seqs = rng.randint(1, 20), rng.randint(1, 6)
    print("padding rows", pad_rows, "empty sequences", pad_seqs)
    device, width = step.q.device, step.block_tables.shape[1]
    q = torch.cat([step.q, torch.randn(pad_rows, *step.q.shape[1:], dtype=step.q.dtype, device=device)])
    blocks = step.cache.k[0].shape[KV_LAYOUTS[step.layout].k_dims.index("blocks")]
    stale_tables = torch.randint(0, blocks, (pad_seqs, width), dtype=torch.int32, device=device)
    stale_lens = torch.randint(1, 90, (pad_seqs,), dtype=torch.int32, device=device)
    feeds = (
        torch.cat([step.block_tables, stale_tables]),
        torch.cat([step.context_lens, stale_lens]),
        torch.cat([step.query_start_loc, torch.full((pad_seqs,), tokens, dtype=torch.int32, device=device)]),
    )
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", nan_empty)
    op = FastPagedAttention(step.attrs, step.env)
    rows, seqs = q.shape[0], feeds[0].shape[0]
    # the list sits in a larger buffer (the graphs' holds the largest bucket's), its tail stale
    work = torch.full((op.bounds_work_size(rows, seqs) + 7,), 10**6, dtype=torch.int32, device=device)
    listed = op.bounds_work(step.meta, rows, seqs)
    work[: listed.size] = torch.from_numpy(listed)
    meta = AttentionMetadata((), (), (), max_context_len=256, bounds_only=True, work=work)
    out = op(StepContext(step.cache, meta), q, None, *feeds)
    monkeypatch.setattr(torch, "empty", empty)
    assert_close(out[:tokens], step.ref)
    assert torch.equal(out[tokens:], torch.zeros_like(out[tokens:]))


def test_a_steps_work_list_names_every_tile_once_heaviest_first(rng):
    """bounds_work for random steps in random buckets: the header, the decodes in step order, every
    prompt tile once (BOUNDS_BLOCK_M rows each), in order of the cached positions they walk, and tiles
    left over in the grid for every padding row past the step's rows."""
    block = prefill_kernel.BOUNDS_BLOCK_M
    for _ in range(200):
        q_lens = [rng.choice([1, 1, rng.randint(2, 300)]) for _ in range(rng.randint(1, 12))]
        contexts = [n + rng.randint(0, 3000) for n in q_lens]
        rows = sum(q_lens)
        tokens, seqs = rng.randint(rows, rows + 200), rng.randint(len(q_lens), len(q_lens) + 5)
        starts = [0, *itertools.accumulate(q_lens)]
        work = prefill_kernel.bounds_work(starts, contexts, tokens, seqs)
        grid = prefill_kernel.bounds_tiles(tokens, seqs)
        tiles = [(b, t) for b, n in enumerate(q_lens) if n > 1 for t in range(-(-n // block))]
        decodes = [b for b, n in enumerate(q_lens) if n == 1]
        assert work.dtype == np.int32 and work.size == prefill_kernel.work_size(tokens, seqs)
        assert list(work[:3]) == [len(tiles), len(decodes), rows]
        assert list(work[4 : 4 + len(decodes)]) == decodes
        base = 4 + seqs
        seq_of, tile_of = work[base : base + len(tiles)].tolist(), work[base + grid : base + grid + len(tiles)].tolist()
        listed = list(zip(seq_of, tile_of, strict=True))
        assert sorted(listed) == tiles
        walked = [contexts[b] - q_lens[b] + min((t + 1) * block, q_lens[b]) for b, t in listed]
        assert walked == sorted(walked, reverse=True)
        assert (grid - len(tiles)) * block >= tokens - rows  # the leftover programs zero every padding row


@pytest.mark.parametrize("most", [1, 3, None])
def test_decode_rows_split_as_the_device_counts_them(rng, most):
    """A work list (bounds_work): the decode rows of a mixed step over a 1-D grid sized by a bound, each
    step's split count chosen on the device from its count of decodes (at most `most`; None: what
    one decode would take). Every decode row equals the reference; no other row is written."""
    step = mixed_step(rng)
    decode_rows, prompt_rows = step.rows(decodes=True), step.rows(decodes=False)
    pad = rng.randint(0, 3)  # empty sequences after the step's own, as a captured step has them
    print("empty sequences", pad)
    tables = torch.cat([step.block_tables, step.block_tables[:1].expand(pad, -1)])
    lens = torch.cat([step.context_lens, step.context_lens[:1].expand(pad)])
    starts = torch.cat([step.query_start_loc, step.query_start_loc[-1:].expand(pad)])
    bound = tables.shape[0]
    work = torch.from_numpy(
        prefill_kernel.bounds_work(step.meta.query_start, step.meta.context_lens, len(step.q), bound)
    )
    out = torch.full_like(step.ref, float("nan"))
    args = (step.q, step.cache.k[0], step.cache.v[0], tables, lens)
    paged_decode_attention(
        *args, **step.kwargs(), query_start_loc=starts, num_decodes=bound, work=work.to(DEVICE),
        num_splits=most, max_context_len=256, out=out,
    )  # fmt: skip
    assert_close(out[decode_rows], step.ref[decode_rows])
    assert out[prompt_rows].isnan().all()


def test_prefill_rows_of_decode_steps_equal_the_decode_kernel():
    step = Step("nhd", "fp8_e4m3", torch.bfloat16, (6, 3, 64, 16), [(33, 1), (1, 1), (70, 1)])
    prefill = step.prefill()
    assert_close(prefill, step.ref)
    assert torch.allclose(prefill.float(), step.decode(num_splits=2).float(), rtol=2**-7, atol=BF16_ATOL)


def test_bad_inputs_are_refused():
    step = Step("nhd", "bf16", torch.bfloat16, (4, 2, 32, 16), [(5, 1)])
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(
            step.q, step.cache.k[0], step.cache.v[0], step.block_tables.long(), step.context_lens, **step.kwargs()
        )
    with pytest.raises(ValueError, match="shape"):
        kwargs = step.kwargs() | {"num_kv_heads": 1}
        paged_decode_attention(step.q, step.cache.k[0], step.cache.v[0], step.block_tables, step.context_lens, **kwargs)
    with pytest.raises(ValueError, match="dtype"):
        paged_prefill_attention(
            step.q.float(), step.cache.k[0], step.cache.v[0], step.block_tables, step.context_lens,
            step.query_start_loc, **step.kwargs(), max_q_len=1,
        )  # fmt: skip
    with pytest.raises(ValueError, match="num_decodes"):
        step.decode(query_start_loc=step.query_start_loc)
    with pytest.raises(ValueError, match="out must be"):
        step.decode(out=torch.empty(1, 4 * 32))
    with pytest.raises(ValueError, match="num_prefills"):
        step.prefill(num_prefills=2)
