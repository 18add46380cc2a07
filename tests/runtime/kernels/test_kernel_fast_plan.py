"""The fast path's op table bound to a whole compiled graph: under the Triton interpreter on CPU, a
prefill step and a decode step of the tiny dense model give the reference plan's logits (ptpc-fp8;
and tensor-fp8, whose per-tensor quantization ops fall back to the reference while its GEMMs run the
PTPC kernel)."""

from __future__ import annotations

import collections

import onnx
import pytest
import torch
from qruntime.artifact import read_manifest
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.ops.base import AttentionMetadata, OpEnv, StepContext
from qruntime.ops.registry import reference_ops, triton_ops
from qruntime.plan import Plan
from qruntime.weights import load_initializers

BLOCK = 16


def _step(chunks: list[tuple[list[int], int]], tables: list[list[int]], max_context: int):
    """Feeds and metadata for sequences given as (new tokens, tokens already cached)."""
    ids, positions, slots, starts, lens = [], [], [], [0], []
    for (tokens, start), table in zip(chunks, tables, strict=True):
        for i, token in enumerate(tokens):
            pos = start + i
            ids.append(token)
            positions.append(pos)
            slots.append(table[pos // BLOCK] * BLOCK + pos % BLOCK)
        starts.append(starts[-1] + len(tokens))
        lens.append(start + len(tokens))
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    cache_slots = tuple(
        torch.tensor([tables[b][p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]) for b, n in enumerate(lens)
    )
    feeds = {
        "input_ids": torch.tensor(ids),
        "positions": torch.tensor(positions),
        "slot_mapping": torch.tensor(slots),
        "block_tables": block_tables,
        "context_lens": torch.tensor(lens, dtype=torch.int32),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
        "logits_indices": torch.tensor(starts[1:]) - 1,
    }
    meta = AttentionMetadata(tuple(starts), tuple(lens), cache_slots, max(len(t) for t, _ in chunks), max_context)
    return feeds, meta


def load_artifact(artifact):
    """(graph, KV-cache spec, weights in bf16 on the CPU, op env) of a compiled artifact."""
    graph = onnx.load(str(artifact / "graph.onnx"), load_external_data=False).graph
    spec = KVCacheSpec.from_manifest(read_manifest(artifact)["kv_cache"])
    weights = load_initializers(artifact, graph, torch.device("cpu"), torch.bfloat16)
    return graph, spec, weights, OpEnv(torch.bfloat16, torch.device("cpu"), spec)


def two_steps(artifact, lens: tuple[int, int]) -> list:
    """A prefill of two fresh random prompts of `lens` tokens (cache blocks [3, 6] and [1]), then a
    decode step of both: (feeds, metadata) of each. The tests' first prompt of 19 tokens crosses a
    cache block (16) and with the second makes two GEMM row tiles of 16, the second partial; every
    token costs interpreter programs in the row kernels, so they take no more."""
    vocab = int(read_manifest(artifact)["spec"]["vocab_size"])
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in lens]
    tables = [[3, 6], [1]]
    return [
        _step([(prompts[0], 0), (prompts[1], 0)], tables, 64),
        _step([([7], lens[0]), ([9], lens[1])], tables, 64),
    ]


@pytest.mark.parametrize(("recipe", "layout"), [("ptpc-fp8", "nhd"), ("ptpc-fp8", "x-packed"), ("tensor-fp8", "nhd")])
def test_fast_plan_matches_the_reference_plan(tiny_ckpt, compiled, recipe, layout):
    artifact = compiled(tiny_ckpt, recipe, f"kv_cache.layout={layout}")
    graph, spec, weights, env = load_artifact(artifact)
    plans = {
        name: Plan.build(graph, weights, env, table)
        for name, table in (("ref", reference_ops()), ("fast", triton_ops()))
    }
    assert type(plans["fast"].nodes[1].op).__module__ == "qruntime.ops.triton_ops"
    caches = {name: KVCache(spec, 8, torch.bfloat16, torch.device("cpu")) for name in plans}
    steps = two_steps(artifact, (19, 2))
    for feeds, meta in steps:
        # node by node, each fast op fed the reference's inputs: the kernels' own error only (under the
        # interpreter their bf16 outputs are truncated, not rounded: ~1 ulp on half the elements)
        env = {**weights, **feeds, "": None}
        shadow = KVCache(spec, 8, torch.bfloat16, torch.device("cpu"))
        for node, fast_node in zip(plans["ref"].nodes, plans["fast"].nodes, strict=True):
            shadow.k[:] = [k.clone() for k in caches["ref"].k]
            shadow.v[:] = [v.clone() for v in caches["ref"].v]
            args = [env[name] for name in node.inputs]
            ref_out = node.op(StepContext(caches["ref"], meta), *args)
            fast_out = fast_node.op(StepContext(shadow, meta), *args)
            ref_out = ref_out if isinstance(ref_out, tuple) else (ref_out,)
            fast_out = fast_out if isinstance(fast_out, tuple) else (fast_out,)
            for name, x, y in zip(node.outputs, ref_out, fast_out, strict=True):
                if x.is_floating_point() and x.numel():
                    noise = (x.float() - y.float()).pow(2).mean() / x.float().pow(2).mean().clamp(min=1e-30)
                    assert float(noise) < 1e-4, f"{type(node.op).__name__} -> {name}: relative noise {float(noise):.2e}"
            for layer in range(spec.num_layers):  # the cache the fast op wrote matches the reference's
                for mine, theirs in (
                    (shadow.k[layer], caches["ref"].k[layer]),
                    (shadow.v[layer], caches["ref"].v[layer]),
                ):
                    diff = (mine.float() - theirs.float()).pow(2).sum() / theirs.float().pow(2).sum().clamp(min=1e-30)
                    assert float(diff) < 1e-4, f"{type(node.op).__name__}: layer {layer} cache differs"
            env.update(zip(node.outputs, ref_out, strict=True))
        # the whole plan: those ulps pass through later fp8 activation quantization, so logits agree
        # to the level of fp8 rounding (>= 25 dB), not to the ulp
        logits = plans["fast"].run(StepContext(caches["fast"], meta), feeds).float()
        noise = (logits - env[plans["ref"].output].float()).pow(2).mean() / logits.pow(2).mean()
        assert float(noise) < 10**-2.5


def test_split_k_reductions_fold_into_the_next_kernel_to_the_same_bits(tiny_ckpt, compiled):
    """Each GEMM whose only reader is the next node's row kernel (qkv -> QK-norm/RoPE/KV write, o and
    down -> AddRMSNorm[Quant], gate_up -> SiLU-mul-quant) hands it split-K partials; with every GEMM
    forced to split K, a prefill and a decode step give the unfolded plan's logits and cache bits."""
    from qruntime.kernels.fp8_gemm import GemmConfig
    from qruntime.ops.triton_ops import PTPCLinear, fold_split_k_reductions

    artifact = compiled(tiny_ckpt, "ptpc-fp8")
    graph, spec, weights, env = load_artifact(artifact)
    plans = [Plan.build(graph, weights, env, triton_ops()) for _ in range(2)]
    assert fold_split_k_reductions(plans[1]) == 4 * spec.num_layers
    deferred = [
        type(n.op).__name__
        for n, m in zip(plans[1].nodes, plans[1].nodes[1:], strict=False)
        if getattr(n.op, "defer_reduce", 0)
    ]
    assert len(deferred) == 4 * spec.num_layers and set(deferred) == {"PTPCLinear"}
    readers = {
        type(m.op).__name__
        for n, m in zip(plans[1].nodes, plans[1].nodes[1:], strict=False)
        if getattr(n.op, "defer_reduce", 0)
    }
    assert readers == {"QKNormRoPEKVWrite", "AddRMSNormQuant", "AddRMSNorm", "SiluMulQuant"}
    steps = two_steps(artifact, (19, 2))
    caches = [KVCache(spec, 8, torch.bfloat16, torch.device("cpu")) for _ in plans]
    for feeds, meta in steps:
        tokens = len(feeds["input_ids"])
        for plan in plans:
            for node in plan.nodes:
                if isinstance(node.op, PTPCLinear):
                    node.op.plans[tokens] = ("triton", GemmConfig(16, 32, 32, 4, 4, 2))
        logits = [plan.run(StepContext(cache, meta), feeds) for plan, cache in zip(plans, caches, strict=True)]
        assert torch.equal(logits[0].view(torch.int16), logits[1].view(torch.int16))
        for layer in range(spec.num_layers):
            assert torch.equal(caches[0].k[layer].view(torch.int16), caches[1].k[layer].view(torch.int16))
            assert torch.equal(caches[0].v[layer].view(torch.int16), caches[1].v[layer].view(torch.int16))


def test_a_moe_combine_folds_into_the_next_norm_to_the_same_bits(tiny_moe_ckpt, compiled, monkeypatch):
    """The MoE combine's folding is off by default (measured slower); turned on, the fused MoE of each
    MoE layer hands its weighted expert rows to the AddRMSNorm[Quant] after it, which adds them as
    the combine launch did: the same logits and cache bits as the unfolded plan over a prefill and a
    decode step (the dense layer's GEMMs fold too)."""
    from qruntime.ops import triton_ops as fast_ops
    from qruntime.ops.triton_ops import MoE, fold_split_k_reductions

    artifact = compiled(tiny_moe_ckpt, "ptpc-fp8")
    graph, spec, weights, env = load_artifact(artifact)
    plans = [Plan.build(graph, weights, env, triton_ops()) for _ in range(3)]
    fold_split_k_reductions(plans[2])  # the default
    assert not any(n.op.defer_combine for n in plans[2].nodes if isinstance(n.op, MoE))
    monkeypatch.setattr(fast_ops, "PAIR_ROWS_READERS", (fast_ops.AddRMSNorm, fast_ops.AddRMSNormQuant))
    fold_split_k_reductions(plans[1])
    moes = [n.op for n in plans[1].nodes if isinstance(n.op, MoE)]
    assert moes and all(op.defer_combine for op in moes)
    assert not any(getattr(n.op, "defer_combine", False) for n in plans[0].nodes)
    steps = two_steps(artifact, (13, 6))
    caches = [KVCache(spec, 8, torch.bfloat16, torch.device("cpu")) for _ in plans[:2]]
    for feeds, meta in steps:
        logits = [plan.run(StepContext(cache, meta), feeds) for plan, cache in zip(plans[:2], caches, strict=True)]
        assert torch.equal(logits[0].view(torch.int16), logits[1].view(torch.int16))


def _prefill_then_decode(artifact, spec, plans, linears=None) -> None:
    """A fresh 7-token prompt's prefill, then its batch-1 decode step, through each plan: every plan
    gives the first's logits and K/V cache bits. linears(node) -> tiles?, when given: every PTPCLinear
    runs the GEMV at one token, or 16-row tiles where it says so (and tiles at 7 tokens)."""
    from qruntime.kernels.fp8_gemm import GemmConfig
    from qruntime.ops.triton_ops import PTPCLinear

    vocab = int(read_manifest(artifact)["spec"]["vocab_size"])
    prompt, table = torch.randint(0, vocab, (7,)).tolist(), [[2]]
    steps = [_step([(prompt, 0)], table, 64), _step([([torch.randint(0, vocab, ()).item()], 7)], table, 64)]
    gemv, tiles = GemmConfig(1, 4, 32, 1, 2, 1), GemmConfig(16, 32, 32, 1, 4, 2)
    caches = [KVCache(spec, 4, torch.bfloat16, torch.device("cpu")) for _ in plans]
    for feeds, meta in steps:
        for plan in plans if linears is not None else ():
            for node in plan.nodes:
                if isinstance(node.op, PTPCLinear):
                    node.op.plans[1] = ("triton", tiles if linears(node) else gemv)
                    node.op.plans[7] = ("triton", tiles)
        logits = [plan.run(StepContext(cache, meta), feeds) for plan, cache in zip(plans, caches, strict=True)]
        for other, cache in zip(logits[1:], caches[1:], strict=True):
            assert torch.equal(logits[0].view(torch.int16), other.view(torch.int16))
            for layer in range(spec.num_layers):
                assert torch.equal(caches[0].k[layer].view(torch.int16), cache.k[layer].view(torch.int16))
                assert torch.equal(caches[0].v[layer].view(torch.int16), cache.v[layer].view(torch.int16))


@pytest.mark.parametrize("o_proj", ["gemv", "tiles"])
def test_o_proj_quantization_folds_into_the_gemv_to_the_same_bits(tiny_ckpt, compiled, o_proj, monkeypatch):
    """Each DynamicQuant whose outputs only the next PTPCLinear reads (attention output -> o_proj)
    hands one token's row to it: a batch-1 decode step gives the unfolded plan's logits and cache bits,
    whether o_proj runs the GEMV (which quantizes the row itself, no quantization launch) or tiles
    (which quantize it in a launch first); the prefill step (7 tokens) is not deferred."""
    from qruntime.kernels.dynamic_quant import DeferredQuant
    from qruntime.ops.triton_ops import DynamicQuant, PTPCLinear, fold_dynamic_quant

    artifact = compiled(tiny_ckpt, "ptpc-fp8")
    graph, spec, weights, env = load_artifact(artifact)
    plans = [Plan.build(graph, weights, env, triton_ops()) for _ in range(2)]
    assert fold_dynamic_quant(plans[1]) == spec.num_layers
    folded = [(n, m) for n, m in zip(plans[1].nodes, plans[1].nodes[1:], strict=False) if getattr(n.op, "defer", 0)]
    assert all(type(n.op) is DynamicQuant and type(m.op) is PTPCLinear for n, m in folded)
    deferred: list[int] = []
    call = PTPCLinear.__call__

    def counted(op, step, xq, *rest):
        deferred.append(len(xq.x) if isinstance(xq, DeferredQuant) else 0)
        return call(op, step, xq, *rest)

    monkeypatch.setattr(PTPCLinear, "__call__", counted)
    _prefill_then_decode(artifact, spec, plans, lambda node: o_proj == "tiles" and any(node is m for _, m in folded))
    assert sum(deferred) == spec.num_layers  # one token's row, to each o_proj of the decode step


def test_the_norm_before_a_moe_folds_into_its_routing_launch_to_the_same_bits(tiny_moe_ckpt, compiled, monkeypatch):
    """fold_router_norm (a default fold): the AddRMSNorm before each fused MoE hands the MoE one
    token's x, residual and norm weight, and at batch-1 decode the routing launch normalizes the row
    (at the prefill's 7 tokens the norm launches as before): the logits and cache bits of the plan
    without the fold over both steps (the residual stream included: the next layer reads residual_out)."""
    from qruntime.kernels.add_rmsnorm_quant import DeferredRMSNorm
    from qruntime.ops.triton_ops import MoE, fold_dynamic_quant, fold_router_norm, fold_split_k_reductions

    artifact = compiled(tiny_moe_ckpt, "ptpc-fp8")
    graph, spec, weights, env = load_artifact(artifact)
    plans = [Plan.build(graph, weights, env, triton_ops()) for _ in range(2)]
    for plan in plans:
        fold_split_k_reductions(plan)
        fold_dynamic_quant(plan)
    assert fold_router_norm(plans[1]) == 2  # the norms before layers 0 and 2's MoEs (layer 1 is dense)
    routed: list[bool] = []
    route = MoE.__call__

    def spied(op, step, x, *rest):
        routed.append(isinstance(x, DeferredRMSNorm))
        return route(op, step, x, *rest)

    monkeypatch.setattr(MoE, "__call__", spied)
    _prefill_then_decode(artifact, spec, plans)
    assert sum(routed) == 2  # the decode step's two MoEs normalized their rows in their routing launches


def _decode_launches(artifact, router_norm: bool, monkeypatch) -> collections.Counter:
    """The Triton kernels a one-token step launches (by name: a batch-1 decode's kernels), with the
    runtime's default folds (fold_router_norm left out unless router_norm; the interpreter counts
    each launch)."""
    import triton.runtime.interpreter as interpreter
    from qruntime.kernels.fp8_gemm import GemmConfig
    from qruntime.ops import triton_ops as fast_ops

    graph, spec, weights, env = load_artifact(artifact)
    plan = Plan.build(graph, weights, env, triton_ops())
    for fold in ("fold_split_k_reductions", "fold_dynamic_quant") + ("fold_router_norm",) * router_norm:
        getattr(fast_ops, fold)(plan)
    for node in plan.nodes:  # the GEMV every linear runs at one token, in few (interpreted) programs
        if isinstance(node.op, fast_ops.PTPCLinear):
            node.op.plans[1] = ("triton", GemmConfig(1, 32, 64, 1, 2, 1))
    vocab = int(read_manifest(artifact)["spec"]["vocab_size"])
    feeds, meta = _step([([int(torch.randint(0, vocab, ()))], 0)], [[2]], 64)  # one token: a decode's launches
    names: list[str] = []
    run = interpreter.InterpretedFunction.run

    def counted(kernel, *args, **kwargs):
        names.append(kernel.fn.__name__)
        return run(kernel, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted)
    plan.run(StepContext(KVCache(spec, 4, torch.bfloat16, torch.device("cpu")), meta), feeds)
    monkeypatch.undo()
    return collections.Counter(names)


def test_kernels_per_decode_layer(tiny_ckpt, tiny_moe_ckpt, compiled, monkeypatch):
    """Issue 17's count of kernels per decode layer, as the plan launches them at batch 1 (one decode
    attention launch: the interpreter's short context takes one partition; a GPU adds the reduce):
    dense 9 (input norm, qkv GEMV, QK-norm/RoPE/KV write, attention, o_proj GEMV with its input's
    quantization, norm, gate_up, SiLU-mul-quant, down); a MoE layer 10 (input norm, qkv, QK-norm,
    attention, o_proj, norm, routing, up, down, combine), 9 with fold_router_norm (the norm in the
    routing launch)."""
    dense = compiled(tiny_ckpt, "ptpc-fp8")
    layers = read_manifest(dense)["kv_cache"]["num_layers"]
    default = _decode_launches(dense, True, monkeypatch)
    print(f"dense, {layers} layers: {dict(default)}")
    assert sum(default.values()) == 9 * layers + 1  # + the final norm
    assert default["_ptpc_fp8_gemv_kernel"] == 4 * layers and "_dynamic_quant_kernel" not in default
    moe = compiled(tiny_moe_ckpt, "ptpc-fp8")  # layers 0 and 2 MoE, 1 dense
    default, launched = (_decode_launches(moe, router_norm, monkeypatch) for router_norm in (True, False))
    print(f"moe: default {dict(default)}; norms before the MoEs launched {dict(launched)}")
    assert sum(default.values()) == 9 * 2 + 9 + 1 and sum(launched.values()) == 10 * 2 + 9 + 1
    assert launched["_add_rmsnorm_kernel"] - default["_add_rmsnorm_kernel"] == 2
