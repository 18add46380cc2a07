"""The Qwen3-VL text graph at tp = 2 computes Qwen3-VL's logits: both rank graphs (each rank's weight
slices, its own KV cache of its KV heads) run with the runtime's reference ops in two threads whose
collectives meet at a barrier, and every rank's logits agree with reference_text.decode_layers within 1e-5
relative, fused and unfused. The DeepStack feature is added once, to the all-reduced hidden state, on
every rank alike; added to a rank's partial sum it would count twice."""

from __future__ import annotations

import dataclasses
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from graph_helpers import PASS_NAMES, kv, random_sources, recipe
from graph_reference import Reference, materialize
from qruntime.kv_cache import KVCache, KVCacheSpec
from qruntime.kv_layout import KV_LAYOUTS
from qruntime.ops import collective
from qruntime.ops.base import OpEnv
from qruntime.ops.registry import reference_ops
from vision_reference import BLOCK, CHUNKS, MAX_BLOCKS, assert_steps, reference_weights, sequences
from vision_specs import vl_dense, vl_moe

from qcompile.compile.sharding import Sharding, local_heads
from qcompile.graph import Graph, compile_graph
from qcompile.source.model import expected_tensors

TP = 2


class ThreadGroup:
    """A stand-in for a process group of `size` ranks run as threads: an all-reduce is a barrier, the
    parts summed in rank order (the same sum on every rank), and a second barrier before the next one."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)
        self.parts: list[torch.Tensor | None] = [None] * size

    def all_reduce(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        self.parts[rank] = x
        self.barrier.wait()
        total = self.parts[0].clone()  # type: ignore[union-attr]
        for part in self.parts[1:]:
            total += part  # type: ignore[operator]
        self.barrier.wait()
        return total


@dataclasses.dataclass(frozen=True)
class RankOf:
    """What a rank's ops hold as their tp_group: the shared ThreadGroup and the rank."""

    group: ThreadGroup
    rank: int


class RankReference(Reference):
    """graph_reference.Reference for rank `rank` of a tp > 1 graph: its slices of the weights, a cache of
    its KV heads, ops bound with a RankOf group."""

    def __init__(self, graph: Graph, sources: dict[str, torch.Tensor], num_slots: int, group: RankOf) -> None:
        spec, shapes = graph.spec, expected_tensors(graph.spec)
        sharding = Sharding(spec, graph.tp)
        self.tensors = {n: torch.from_numpy(c) for n, c in graph.constants.items()}
        for job in graph.weights.values():
            splits = sharding.splits(job, shapes)
            for name, whole in materialize(job, sources).items():
                self.tensors[name] = splits[name].take(whole, group.rank) if name in splits else whole
        kv_attrs = next(node.attrs for node in graph.nodes if "kv_dtype" in node.attrs)  # what the cache ops say
        kv_spec = KVCacheSpec(
            KV_LAYOUTS[kv_attrs["layout"]],
            kv_attrs["kv_dtype"],
            kv_attrs["block_size"],
            spec.num_hidden_layers,
            local_heads(spec, graph.tp)[1],
            spec.head_dim,
        )
        self.cache = KVCache(kv_spec, -(-num_slots // kv_spec.block_size), graph.model_dtype, torch.device("cpu"))
        env = OpEnv(graph.model_dtype, torch.device("cpu"), kv_spec, tp_group=group)
        registry = reference_ops()
        self.nodes = [
            (registry[(n.domain, n.op_type)](n.attrs, env, tuple(self.tensors.get(i) for i in n.inputs)), n)
            for n in graph.nodes
        ]
        self.output = graph.outputs[0]


@pytest.mark.parametrize("passes", ["none", "all"])
@pytest.mark.parametrize("make_spec", [vl_dense, vl_moe], ids=["dense", "moe"])
def test_rank_graphs_compute_qwen3_vl(
    rng: random.Random, monkeypatch: pytest.MonkeyPatch, make_spec, passes: str
) -> None:
    monkeypatch.setattr(collective, "all_reduce", lambda x, group: group.group.all_reduce(x, group.rank))
    torch.manual_seed(rng.randrange(1 << 30))
    spec = make_spec(dtype="float32")
    sources = random_sources(spec)
    rec = recipe("bf16", passes=PASS_NAMES if passes == "all" else ())
    graph = compile_graph(spec, dataclasses.replace(rec, kv_cache=kv(BLOCK), tp=TP))
    assert not any(n.op_type == "AllGather" for n in graph.nodes)  # vocab 97: each rank has the whole head
    group = ThreadGroup(TP)
    slots = len(CHUNKS) * MAX_BLOCKS * BLOCK
    ranks = [RankReference(graph, sources, slots, RankOf(group, r)) for r in range(TP)]

    def run(feeds: dict[str, torch.Tensor]) -> torch.Tensor:
        with ThreadPoolExecutor(TP) as pool:
            logits = list(pool.map(lambda ref: ref.run(feeds), ranks))
        torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)  # the ranks agree bit for bit
        return logits[0]

    assert_steps(run, spec, sequences(spec, rng), reference_weights(spec, sources))
