"""The all-reduce of a tensor-parallel group: the smallest messages through the LL kernel (data and
flag pushed together into every peer's memory: qruntime.kernels.ll_allreduce), then decode-sized
messages through the one-shot kernel over peer memory (qruntime.kernels.custom_allreduce), then — where `qcompile tune` measured it faster than
NCCL — the two-shot kernel (kernels/two_shot_allreduce.py), larger ones and every message where peer
memory is unavailable through torch.distributed (NCCL on GPUs, gloo on the CPU).

Every rank makes the same choice for the same call: it depends only on the message's bytes and the
policy, which all ranks share, and `create` succeeds or fails on all ranks together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from qruntime.comm.peer_memory import PeerMemoryUnavailable, PeerRegions, create_regions

DEFAULT_MAX_ONE_SHOT_BYTES = 512 << 10  # the default crossover to NCCL (a tuned table may move it)
DEFAULT_TIMEOUT_S = 120.0  # a kernel waiting longer for a peer traps (a rank died or hung)
DEFAULT_MAX_LL_BYTES = 64 << 10  # the LL kernel's default limit (a tuned table may set another)
LL_WORD_BYTES = 4  # bytes of x an LL word carries (kernels/ll_allreduce.py's WORD_BYTES)


@dataclass(frozen=True)
class AllReducePolicy:
    """Messages of at most `max_ll_bytes` (whole 4-byte words) take the LL kernel, then up to
    `max_one_shot_bytes` the one-shot kernel, then up to `max_two_shot_bytes` the two-shot kernel
    (0: none; measured by `qcompile tune`, off by default), larger ones torch.distributed; a kernel
    that waits more than `timeout_s` for a peer traps."""

    max_one_shot_bytes: int = DEFAULT_MAX_ONE_SHOT_BYTES
    max_two_shot_bytes: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_ll_bytes: int = DEFAULT_MAX_LL_BYTES

    def __post_init__(self) -> None:
        limits = (self.max_one_shot_bytes, self.max_two_shot_bytes, self.max_ll_bytes)
        if min(limits) < 0 or self.timeout_s <= 0 or self.max_ll_bytes % LL_WORD_BYTES:
            raise ValueError(f"bad all-reduce policy {self}: byte limits >= 0 (LL's whole words), timeout_s > 0")

    @property
    def region_bytes(self) -> int:
        """The largest message the one-shot or two-shot kernel takes (a data half of every rank's region)."""
        return max(self.max_one_shot_bytes, self.max_two_shot_bytes)

    def ll_area_bytes(self, world: int) -> int:
        """Bytes of a rank's LL area: two parities of `world` sources' words (8 bytes per 4 of x)."""
        return 2 * world * (self.max_ll_bytes // LL_WORD_BYTES) * 8

    def kernel(self, nbytes: int) -> str | None:
        """ "ll", "one_shot", "two_shot", or None (torch.distributed) for a message of `nbytes`."""
        if 0 < nbytes <= self.max_ll_bytes and nbytes % LL_WORD_BYTES == 0:
            return "ll"
        if 0 < nbytes <= self.max_one_shot_bytes:
            return "one_shot"
        if 0 < nbytes <= self.max_two_shot_bytes:
            return "two_shot"
        return None


class AllReducer:
    """Sums over the group's ranks, choosing the custom kernel or torch.distributed per message."""

    def __init__(self, group, regions: PeerRegions | None, policy: AllReducePolicy, unavailable: str = "") -> None:
        self.group, self.regions, self.policy = group, regions, policy
        self.unavailable = unavailable  # why there is no peer memory, when there is none
        self._peers: dict[torch.dtype, object] = {}  # kernels' Peers per model dtype
        self.counters = self.abort_word = None
        if regions is not None:
            device = regions.bases.device
            self.counters = torch.zeros(_layout().MAX_SLOTS, dtype=torch.int64, device=device)
            # the kernels read it across PCIe while they wait (mapped pinned memory: the host pointer works there)
            self.abort_word = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")

    @classmethod
    def create(cls, group, device: torch.device, policy: AllReducePolicy = AllReducePolicy()) -> AllReducer:
        """Set up peer memory on every rank of `group` (a collective call) sized for the policy's
        messages; where it cannot be (no P2P between some pair, more ranks than the kernel takes, a
        policy of 0 bytes, a ROCm build: the kernels' waits and flags are PTX), every rank gets the
        torch.distributed path alone (RCCL on ROCm)."""
        if torch.version.hip is not None:
            return cls(group, None, policy, "ROCm: the peer-memory kernels are built for NVIDIA GPUs only")
        layout = _layout()
        world = dist.get_world_size(group)
        if policy.region_bytes == 0 and policy.max_ll_bytes == 0:
            return cls(group, None, policy, "off")
        if world > layout.MAX_WORLD:
            return cls(group, None, policy, f"{world} ranks, more than {layout.MAX_WORLD}")
        try:
            regions = create_regions(
                group, device, layout.DATA_OFFSET + 2 * _half_bytes(policy) + policy.ll_area_bytes(world)
            )
        except PeerMemoryUnavailable as exc:
            return cls(group, None, policy, str(exc))
        return cls(group, regions, policy)

    def abort(self) -> None:
        """Stop every wait of this rank's kernels, now and later (a rank died): their sums are garbage
        from here on, which the caller must not use (qruntime.engine.workers raises instead)."""
        if self.abort_word is not None:
            self.abort_word.fill_(1)

    def describe(self) -> str:
        """How messages are summed, for the engine's description."""
        if self.regions is None:
            return f"nccl ({self.unavailable})"
        p = self.policy
        ll = f"LL up to {p.max_ll_bytes >> 10} KiB, " if p.max_ll_bytes else ""
        two = (
            f", two-shot up to {p.max_two_shot_bytes >> 10} KiB" if p.max_two_shot_bytes > p.max_one_shot_bytes else ""
        )
        return f"custom {ll}one-shot up to {p.max_one_shot_bytes >> 10} KiB{two}, nccl above"

    def peers(self, dtype: torch.dtype):
        """The kernels' view of the regions for `dtype` (made once per dtype)."""
        if dtype not in self._peers:
            layout, r = _layout(), self.regions
            size = torch.empty((), dtype=dtype).element_size()
            half_bytes = _half_bytes(self.policy)
            half = half_bytes // size
            data = r.local[layout.DATA_OFFSET : layout.DATA_OFFSET + 2 * half * size].view(dtype)
            deltas = (r.bases - r.bases[r.rank]) // size
            ll = ll_deltas = None
            if self.policy.max_ll_bytes:  # the LL area: the same offset in every region
                start = layout.DATA_OFFSET + 2 * half_bytes
                ll = r.local[start : start + self.policy.ll_area_bytes(r.world)].view(torch.int64)
                ll_deltas = (r.bases - r.bases[r.rank]) // 8
            self._peers[dtype] = layout.Peers(
                data, deltas, r.bases, self.counters, r.rank, r.world, int(self.policy.timeout_s * 1e9),
                self.abort_word, ll, ll_deltas,
            )  # fmt: skip
        return self._peers[dtype]

    def kernel(self, x: torch.Tensor) -> str | None:
        """The custom kernel x goes through ("ll" | "one_shot" | "two_shot"), or None: torch.distributed
        (every rank decides the same for the same x)."""
        if self.regions is None or not x.is_contiguous():
            return None
        return self.policy.kernel(x.numel() * x.element_size())

    def all_reduce(self, x: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
        """The sum over the ranks of x, reduced in place (x is the rank's partial sum, read by nothing
        else); pdl: the custom kernels with programmatic dependent launch (kernels/pdl.py)."""
        kernel = self.kernel(x)
        if kernel == "ll":
            from qruntime.kernels.ll_allreduce import fits_ll, ll_all_reduce

            if fits_ll(x, self.peers(x.dtype)):
                return ll_all_reduce(x, self.peers(x.dtype), out=x, pdl=pdl)
            kernel = "one_shot" if x.numel() * x.element_size() <= self.policy.max_one_shot_bytes else None
        if kernel == "one_shot":
            from qruntime.kernels.custom_allreduce import one_shot_all_reduce

            return one_shot_all_reduce(x, self.peers(x.dtype), out=x, pdl=pdl)
        if kernel == "two_shot":
            from qruntime.kernels.two_shot_allreduce import two_shot_all_reduce

            return two_shot_all_reduce(x, self.peers(x.dtype), out=x, pdl=pdl)
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_add_rmsnorm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        w: torch.Tensor,
        eps: float,
        quant: bool,
        *,
        pdl: bool = False,
    ) -> tuple[torch.Tensor, ...] | None:
        """AddRMSNorm[Quant] of the sum over the ranks of x in one kernel, or None when the message
        does not take the custom path (the caller all-reduces and normalizes itself)."""
        from qruntime.kernels.custom_allreduce import all_reduce_add_rmsnorm, fits_fused
        from qruntime.kernels.ll_allreduce import fits_ll_fused, ll_all_reduce_add_rmsnorm

        kernel = self.kernel(x)
        if kernel not in ("ll", "one_shot") or (residual is not None and residual.stride(1) != 1):
            return None
        peers = self.peers(x.dtype)
        if kernel == "ll" and fits_ll_fused(x, peers):
            return ll_all_reduce_add_rmsnorm(x, residual, w, eps, quant, peers, pdl=pdl)
        if x.numel() * x.element_size() <= self.policy.max_one_shot_bytes and fits_fused(x, peers):
            return all_reduce_add_rmsnorm(x, residual, w, eps, quant, peers, pdl=pdl)
        return None


def _half_bytes(policy: AllReducePolicy) -> int:
    """Bytes of one data half of a rank's region (64-byte multiples: the LL area after them stays aligned)."""
    return -(-policy.region_bytes // 64) * 64


def _layout():
    """The kernels' region layout and Peers (imported when used: the reference path never imports triton)."""
    from qruntime.kernels import peer_sync

    return peer_sync
