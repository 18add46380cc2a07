"""Piecewise graphs on CPU: the capture step is injected (eager_capture runs a piece where a CUDA graph
would replay it), so everything else is what a GPU runs: the cut into pieces, the bucket a step
takes, its padding into the static inputs, attention run eagerly between the pieces on the real
rows, the static buffers in between, and the eager tail. A piecewise step gives the eager plan's
logits and KV cache for prefill and mixed steps, dense and MoE; padding rows write the scratch
block alone."""

from __future__ import annotations

import random

import onnx
import pytest
import torch
from qruntime.artifact import read_manifest
from qruntime.engine.graph_capture import eager_capture
from qruntime.engine.model_runner import ModelRunner
from qruntime.engine.piecewise_graphs import EagerPiece, PiecewiseGraphs, token_buckets, unfit_reason
from qruntime.engine.step_chunk import StepChunk
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.ops import attention
from qruntime.ops.base import OpEnv
from qruntime.ops.registry import QCOMPILE_DOMAIN, reference_ops
from qruntime.plan import Plan
from qruntime.weights import load_initializers

BLOCKS = 24  # blocks the sequences may use; block BLOCKS is the scratch block
MAX_CONTEXT = 160


def _plan(artifact, moe_kernel: bool = False) -> tuple[Plan, KVCacheSpec, int]:
    """The artifact's plan in fp32 on CPU with the reference ops (with moe_kernel, the fused Triton
    MoE, which Triton's interpreter runs on CPU: the reference MoE syncs with the host)."""
    graph = onnx.load(str(artifact / "graph.onnx"), load_external_data=False).graph
    manifest = read_manifest(artifact)
    spec = KVCacheSpec.from_manifest(manifest["kv_cache"])
    weights = load_initializers(artifact, graph, torch.device("cpu"), torch.float32)
    registry = dict(reference_ops())
    if moe_kernel:
        from qruntime.ops.triton_ops import MoE

        registry[(QCOMPILE_DOMAIN, "MoE")] = MoE
    plan = Plan.build(graph, weights, OpEnv(torch.float32, torch.device("cpu"), spec), registry)
    return plan, spec, int(manifest["spec"]["vocab_size"])


def _caches(spec: KVCacheSpec, rng: random.Random) -> tuple[KVCache, KVCache]:
    """Two caches of BLOCKS + 1 blocks holding the same random values (nothing is zero by luck),
    drawn from a generator of their own: torch's global one is left to the tests that use it."""
    caches = [KVCache(spec, BLOCKS + 1, torch.float32, torch.device("cpu")) for _ in range(2)]
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for layer in range(spec.num_layers):
        for pools in (caches[0].k, caches[0].v):
            pools[layer].copy_(torch.randn(pools[layer].shape, generator=generator))
        caches[1].k[layer].copy_(caches[0].k[layer])
        caches[1].v[layer].copy_(caches[0].v[layer])
    return caches[0], caches[1]


def _scratch_blocks(cache: KVCache) -> list[torch.Tensor]:
    """The scratch block of every K and V pool (views)."""
    layout = cache.spec.layout
    pools = [(k, layout.k_dims) for k in cache.k] + [(v, layout.v_dims) for v in cache.v]
    return [pool.movedim(dims.index("blocks"), 0)[BLOCKS] for pool, dims in pools]


def _block_diff(a: KVCache, b: KVCache) -> set[int]:
    """Blocks where the two caches differ (by more than float noise), in any layer, K or V."""
    differ = set()
    layout = a.spec.layout
    for layer in range(a.spec.num_layers):
        for x, y, dims in ((a.k[layer], b.k[layer], layout.k_dims), (a.v[layer], b.v[layer], layout.v_dims)):
            per_block = (x.float() - y.float()).abs().movedim(dims.index("blocks"), 0).flatten(1)
            differ |= {int(i) for i in torch.nonzero(per_block.amax(-1) > 1e-4)}
    return differ


class Sequences:
    """Random prompts on disjoint blocks, advanced chunk by chunk."""

    def __init__(self, rng: random.Random, vocab: int, count: int, block_size: int) -> None:
        per_seq = min(BLOCKS // count, -(-MAX_CONTEXT // block_size))
        blocks = rng.sample(range(BLOCKS), BLOCKS)
        self.tables = [tuple(blocks[i * per_seq : (i + 1) * per_seq]) for i in range(count)]
        room = per_seq * block_size
        self.tokens = [[rng.randrange(vocab) for _ in range(room)] for _ in range(count)]
        self.done = [0] * count

    def chunk(self, seq: int, n: int) -> StepChunk:
        start = self.done[seq]
        self.done[seq] += n
        return StepChunk(tuple(self.tokens[seq][start : start + n]), start, self.tables[seq])


def _runners(plan, spec, buckets, rng, capture=eager_capture) -> tuple[ModelRunner, ModelRunner]:
    eager_cache, piece_cache = _caches(spec, rng)
    eager = ModelRunner(plan, eager_cache, torch.device("cpu"), MAX_CONTEXT)
    graphs = PiecewiseGraphs(plan, piece_cache, buckets, BLOCKS, MAX_CONTEXT, capture=capture)
    return eager, ModelRunner(plan, piece_cache, torch.device("cpu"), MAX_CONTEXT, piecewise_graphs=graphs)


def _steps(rng: random.Random, seqs: Sequences, largest: int, mixed: int = 3) -> list[list[StepChunk]]:
    """A prefill-only step of every prompt's first chunk, then mixed steps: some sequences decode,
    the others go on with a chunk of their prompt (fresh random sizes, at most `largest` tokens)."""
    count = len(seqs.tokens)
    first = [rng.randint(1, largest // count) for _ in range(count)]
    steps = [[seqs.chunk(s, n) for s, n in enumerate(first)]]
    for _ in range(mixed):
        room = largest
        step = []
        for s in rng.sample(range(count), count):
            left = min(len(seqs.tokens[s]) - seqs.done[s], room)
            n = 1 if rng.random() < 0.5 else rng.randint(1, max(1, left // 2))
            if 0 < n <= left:
                step.append(seqs.chunk(s, n))
                room -= n
        steps.append(step)
    return steps


def _check_same(eager: ModelRunner, piecewise: ModelRunner, steps, atol: float) -> None:
    scratch = BLOCKS
    for chunks in steps:
        tokens = sum(c.num_tokens for c in chunks)
        assert piecewise.piecewise_graphs.fits(tokens), tokens
        want, got = eager.execute(chunks), piecewise.execute(chunks)
        assert got.shape == want.shape == (len(chunks), want.shape[1])
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m, tokens=tokens: f"{tokens} tokens: {m}")
        # padding rows wrote the scratch block and nothing else; real rows wrote what the eager plan wrote
        assert _block_diff(eager.kv_cache, piecewise.kv_cache) <= {scratch}


@pytest.mark.parametrize("recipe", ["bf16", "ptpc-fp8"])
def test_dense_prefill_and_mixed_steps_equal_the_eager_plan(tiny_ckpt, compiled, recipe, rng):
    plan, spec, vocab = _plan(compiled(tiny_ckpt, recipe))
    buckets = sorted(rng.sample(range(8, 64), 3)) + [64]
    print("buckets", buckets)
    eager, piecewise = _runners(plan, spec, buckets, rng)
    seqs = Sequences(rng, vocab, 4, spec.block_size)
    # fp8 activations: a tie in a quantization step may round either way if M changes a GEMM's blocking
    _check_same(eager, piecewise, _steps(rng, seqs, 64), atol=1e-4 if recipe == "bf16" else 2e-3)


def test_moe_prefill_and_mixed_steps_equal_the_eager_plan(tiny_moe_ckpt, compiled, rng):
    plan, spec, vocab = _plan(compiled(tiny_moe_ckpt, "ptpc-fp8"), moe_kernel=True)
    assert unfit_reason(plan) is None
    eager, piecewise = _runners(plan, spec, (16, 32), rng)
    seqs = Sequences(rng, vocab, 3, spec.block_size)
    _check_same(eager, piecewise, _steps(rng, seqs, 32, mixed=2), atol=2e-3)  # the interpreter is slow


def test_padding_fills_the_bucket_and_only_the_scratch_block(tiny_ckpt, compiled, rng):
    plan, spec, vocab = _plan(compiled(tiny_ckpt, "bf16"))
    buckets = (8, 16, 32)
    eager, piecewise = _runners(plan, spec, buckets, rng)
    graphs = piecewise.piecewise_graphs
    seqs = Sequences(rng, vocab, 2, spec.block_size)
    for tokens in (1, 7, 8, 9, rng.randint(10, 31), 32):
        a = rng.randint(1, tokens) if tokens > 1 else 1
        chunks = [seqs.chunk(0, a)] + ([seqs.chunk(1, tokens - a)] if tokens > a else [])
        feeds, _ = piecewise.prepare(chunks)
        bucket = graphs.bucket_for(tokens)
        assert bucket == min(b for b in buckets if b >= tokens)
        for block in _scratch_blocks(piecewise.kv_cache):
            block.fill_(float("nan"))  # were a real row to read it, its logits would be NaN
        torch.testing.assert_close(piecewise.execute(chunks), eager.execute(chunks), atol=1e-4, rtol=0)
        for name, pad in graphs.padding.items():
            assert torch.equal(graphs.inputs[name][:tokens], feeds[name]), name
            assert bool((graphs.inputs[name][tokens:bucket] == pad).all()), name
        assert _block_diff(eager.kv_cache, piecewise.kv_cache) <= {BLOCKS}
        wrote = all(bool(torch.isfinite(block.float()).any()) for block in _scratch_blocks(piecewise.kv_cache))
        assert wrote == (tokens < bucket)  # the padding rows' KV, and only theirs, went to the scratch block
    assert graphs.bucket_for(33) is None and not graphs.fits(33) and graphs.fits(32)


def test_default_buckets_follow_the_tuner_and_halve_its_gaps_up_to_the_token_budget(rng):
    assert token_buckets(2048) == (128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
    assert token_buckets(3000) == (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3000)
    assert token_buckets(48) == (48,)
    # a speculating engine's: verification steps of k + 1 tokens a request pad to 8..64, not 128
    assert token_buckets(2048, verify=True) == (8, 16, 32, 64, *token_buckets(2048))
    assert token_buckets(48, verify=True) == (8, 16, 32, 48)
    budget = rng.randint(1, 9000)
    print("budget", budget)
    buckets = token_buckets(budget)
    assert buckets[-1] == budget and list(buckets) == sorted(set(buckets))
    # a step of n > 128 tokens pads by less than half of itself: at most a third of its bucket is padding
    for n in range(129, budget + 1):
        bucket = next(b for b in buckets if b >= n)
        assert bucket - n < n / 2, (n, bucket)


def _held(graphs: PiecewiseGraphs) -> dict[int, int]:
    """Storage address -> bytes of every tensor an eager piece reads or writes at replay, any bucket."""
    held = [
        t
        for stages in graphs.stages.values()
        for stage in stages
        if isinstance(stage, EagerPiece)
        for t in (*stage.rows.values(), *stage.into.values())
    ]
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}


def test_what_eager_code_reads_lives_in_buffers_every_bucket_and_layer_shares(tiny_ckpt, compiled, rng):
    """Attention's inputs and the tail's rows are copied into shared static buffers by the piece before
    them, rather than held where each bucket's capture left them (one of every layer per bucket):
    more buckets hold no more memory, and the steps still give the eager plan's logits."""
    plan, spec, vocab = _plan(compiled(tiny_ckpt, "bf16"))
    largest = 32
    buckets = sorted(rng.sample(range(4, largest), 3)) + [largest]
    print("buckets", buckets)
    eager, piecewise = _runners(plan, spec, buckets, rng)
    alone = PiecewiseGraphs(plan, _caches(spec, rng)[0], (largest,), BLOCKS, MAX_CONTEXT, capture=eager_capture)
    many, one = _held(piecewise.piecewise_graphs), _held(alone)
    assert len(many) == len(one) and sum(many.values()) == sum(one.values())  # not one set per bucket
    seqs = Sequences(rng, vocab, 3, spec.block_size)
    _check_same(eager, piecewise, _steps(rng, seqs, largest), atol=1e-4)


def test_attention_runs_eagerly_between_the_pieces_on_the_real_rows(tiny_ckpt, compiled, rng, monkeypatch):
    plan, spec, vocab = _plan(compiled(tiny_ckpt, "bf16"))
    log: list[tuple] = []

    def capture(run_piece):
        outputs, replay = eager_capture(run_piece)
        index = sum(1 for entry in log if entry[0] == "captured")
        log.append(("captured", index))
        return outputs, lambda: (log.append(("piece", index)), replay())

    eager, piecewise = _runners(plan, spec, (32,), rng, capture)
    called = attention.PagedAttention.__call__

    def attend(op, step, q, *rest):
        log.append(("attention", op.a["layer"], q.shape[0], step.attn.query_start))
        return called(op, step, q, *rest)

    monkeypatch.setattr(attention.PagedAttention, "__call__", attend)
    seqs = Sequences(rng, vocab, 2, spec.block_size)
    chunks = [seqs.chunk(0, rng.randint(1, 10)), seqs.chunk(1, rng.randint(1, 10))]
    tokens = sum(c.num_tokens for c in chunks)
    starts = (0, chunks[0].num_tokens, tokens)
    log.clear()
    piecewise.execute(chunks)
    layers = spec.num_layers
    pieces = [entry[1] for entry in log if entry[0] == "piece"]
    assert pieces == list(
        range(layers + 1)
    )  # the bucket's pieces in capture order: before each attention, after the last
    assert log == [
        entry
        for layer in range(layers)
        for entry in (("piece", layer), ("attention", layer, tokens, starts))  # the step's rows and sequences
    ] + [("piece", layers)]
    assert len([p for p in plan.pieces() if p.eager]) == layers + 1  # every attention, and the tail


def test_plans_that_cannot_be_cut_into_pieces_are_refused(tiny_ckpt, tiny_moe_ckpt, compiled):
    per_tensor, spec, _ = _plan(compiled(tiny_ckpt, "tensor-fp8"))
    assert "mixes rows" in unfit_reason(per_tensor)
    with pytest.raises(ValueError, match="mixes rows"):
        PiecewiseGraphs(
            per_tensor, _caches(spec, random.Random(0))[0], (16,), BLOCKS, MAX_CONTEXT, capture=eager_capture
        )
    reference_moe, _, _ = _plan(compiled(tiny_moe_ckpt, "ptpc-fp8"))
    assert "cannot be captured" in unfit_reason(reference_moe)


def test_the_runner_sends_each_step_where_it_fits(tiny_ckpt, compiled, rng, monkeypatch):
    """Decode-only steps to the decode graphs, other steps of up to the largest bucket to the
    piecewise graphs, the rest and all_logits steps to the eager plan."""
    plan, spec, vocab = _plan(compiled(tiny_ckpt, "bf16"))
    eager, runner = _runners(plan, spec, (8, 16), rng)
    calls = []

    class Decode:
        def fits(self, chunks, sampled=None):
            return all(c.num_tokens == 1 for c in chunks)

        def run(self, chunks, sampled=None):
            calls.append("decode")
            return eager.execute(chunks)

    runner.decode_graphs = Decode()
    runner.decode_rows_reads = 0  # short chunks stay whole (their split: tests/runtime/test_decode_rows.py)
    graphs = runner.piecewise_graphs
    run = graphs.run
    graphs.run = lambda feeds, meta: (calls.append("piecewise"), run(feeds, meta))[1]
    seqs = Sequences(rng, vocab, 2, spec.block_size)
    runner.execute([seqs.chunk(0, 1), seqs.chunk(1, 1)])
    runner.execute([seqs.chunk(0, 1), seqs.chunk(1, rng.randint(2, 15))])
    runner.execute([seqs.chunk(0, 9), seqs.chunk(1, 8)])  # 17 tokens: over the largest bucket
    runner.execute([seqs.chunk(0, 3)], all_logits=True)
    assert calls == ["decode", "piecewise"]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # a CPU build has no CUDA to wait for
    runner.drop_graphs()
    assert runner.decode_graphs is None and runner.piecewise_graphs is None
