"""What an op implementation is: bound once to a graph node, then called every step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from qruntime.kernel_configs import KernelTable
from qruntime.kv_cache import KVCache, KVCacheSpec


class OpBindError(ValueError):
    """A node's attributes do not fit its op implementation (or the artifact's KV cache)."""


@dataclass(frozen=True)
class OpEnv:
    """What ops may consult when they are bound: the compute dtype, the device, the cache spec."""

    dtype: torch.dtype
    device: torch.device
    kv_spec: KVCacheSpec
    kernels: KernelTable | None = None  # tuned kernel configs for this GPU (fast path only)
    tp_group: Any = None  # the torch.distributed process group of a tp > 1 artifact's ranks (None: tp=1)
    all_reduce: Any = None  # the group's qruntime.comm.all_reduce.AllReducer (fast path; None: torch.distributed)
    pdl: bool = False  # launch the fast path's kernels with programmatic dependent launch (kernels/pdl.py)
    # the FP8 format the fast path quantizes activations to: the artifact's target's (qruntime.target;
    # float8_e4m3fnuz for amd-gfx942, whose FP8 weights are stored so); the reference ops keep e4m3fn
    fp8: torch.dtype = torch.float8_e4m3fn


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-sequence facts of one step, built once by the ModelRunner and shared by every layer.

    `cache_slots[b]` are the cache slots of positions 0 .. context_lens[b]-1 of sequence b (the
    reference ops gather with them; kernels read the block tables): a tuple, or TableSlots, which
    computes a sequence's slots when an op asks. `max_context_len` bounds every context of the
    engine (kernels size their grids with it, so a captured graph stays valid)."""

    query_start: tuple[int, ...]  # [B+1]
    context_lens: tuple[int, ...]  # [B]
    cache_slots: Sequence[torch.Tensor]  # B x [context_len] int64
    max_q_len: int = 0
    max_context_len: int = 0
    # a captured mixed step (engine/mixed_graphs.py): the sequence inputs are padded static buffers
    # and the tuples above are empty; ops launch from the buffers' sizes alone, their kernels reading
    # the step's work list (Op.bounds_work, written before each replay) from `work`
    bounds_only: bool = False
    work: torch.Tensor | None = None

    @property
    def decode_only(self) -> bool:
        """Every sequence adds exactly one token this step."""
        return self.max_q_len == 1


class TableSlots(Sequence[torch.Tensor]):
    """cache_slots computed from the step's block tables on their device, one sequence at a time, when
    an op asks (slot = block_table[pos // block_size] * block_size + pos % block_size): the fast ops
    read the tables themselves, and building every sequence's slots on the host cost a copy of
    B x max_blocks x block_size ids and a slice per sequence, each step."""

    def __init__(self, block_tables: torch.Tensor, context_lens: Sequence[int], block_size: int) -> None:
        self.block_tables, self.context_lens, self.block_size = block_tables, tuple(context_lens), block_size

    def __len__(self) -> int:
        return len(self.context_lens)

    def __getitem__(self, b):  # type: ignore[override]
        if isinstance(b, slice):
            return tuple(self[i] for i in range(*b.indices(len(self))))
        ctx, bs = self.context_lens[b], self.block_size
        blocks = self.block_tables[b, : -(-ctx // bs)].long()
        offsets = torch.arange(bs, dtype=torch.int64, device=blocks.device)
        return (blocks[:, None] * bs + offsets).reshape(-1)[:ctx]


@dataclass(frozen=True)
class StepContext:
    kv_cache: KVCache
    attn: AttentionMetadata


class Op:
    """One node's implementation. Subclasses list their attributes in `attrs` (and `optional_attrs`);
    __init__ reads them once (so a bad graph fails at load, naming the node), __call__(step, *inputs)
    runs the op."""

    attrs: ClassVar[tuple[str, ...]] = ()
    capturable: ClassVar[bool] = True  # no host syncs, no data-dependent shapes: fine inside a CUDA graph
    # its work depends on the step's sequences (query starts, context lengths, block tables), not on its
    # token count alone: a piecewise CUDA graph runs it eagerly between the pieces (engine/piecewise_graphs.py)
    splits_graph: ClassVar[bool] = False
    # a graph-splitting op that also runs from bounds alone (AttentionMetadata.bounds_only), so a whole
    # mixed step can be captured (engine/mixed_graphs.py)
    launches_from_bounds: ClassVar[bool] = False

    optional_attrs: ClassVar[Mapping[str, Any]] = {}  # name -> default

    def __init__(self, attrs: Mapping[str, Any], env: OpEnv, consts: tuple[torch.Tensor | None, ...] = ()) -> None:
        missing = [name for name in self.attrs if name not in attrs]
        if missing:
            raise OpBindError(f"missing attribute(s) {missing}")
        self.a = {**self.optional_attrs, **{k: v for k, v in attrs.items() if k in self.optional_attrs}}
        self.a.update({name: attrs[name] for name in self.attrs})
        self.env = env
        self.consts = consts  # the node's inputs that are graph initializers (None elsewhere), for static shapes

    def __call__(self, step: StepContext, *inputs: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def prefers_eager(self, meta: AttentionMetadata) -> bool:
        """Whether this step runs faster eagerly than from bounds (launches_from_bounds ops only)."""
        return False

    def bounds_work_size(self, tokens: int, seqs: int) -> int:
        """launches_from_bounds ops: the int32 entries of bounds_work for a graph of `tokens` rows and
        `seqs` sequence rows."""
        return 0

    def bounds_work(self, meta: AttentionMetadata, tokens: int, seqs: int) -> np.ndarray:
        """launches_from_bounds ops: the step's work list (from its host metadata) that the kernels of a
        graph of `tokens` rows and `seqs` sequence rows read from AttentionMetadata.work."""
        return np.zeros(0, dtype=np.int32)

    @property
    def row_wise(self) -> bool:
        """Whether each output row depends on its own input row only, so rows padded onto a step
        cannot change the real rows. Per-tensor activation quantization (group_size -1) is the
        exception among the ops: its one scale is the amax over every row of the step."""
        return self.a.get("group_size") != -1


class KVOp(Op):
    """An op that writes or reads a layer's cache: its attributes must match the cache the runtime holds."""

    attrs = ("layer", "layout", "block_size", "kv_dtype", "k_scale", "v_scale")

    def __init__(self, attrs: Mapping[str, Any], env: OpEnv, consts: tuple[torch.Tensor | None, ...] = ()) -> None:
        super().__init__(attrs, env, consts)
        spec = env.kv_spec
        expected = {"layout": spec.layout.name, "block_size": spec.block_size, "kv_dtype": spec.kv_dtype}
        for key, value in expected.items():
            if self.a[key] != value:
                raise OpBindError(f"attribute {key}={self.a[key]!r} but the manifest's kv_cache says {value!r}")
        if not 0 <= self.a["layer"] < spec.num_layers:
            raise OpBindError(f"layer {self.a['layer']} outside the cache's {spec.num_layers} layers")
