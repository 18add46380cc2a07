"""Peer memory: one region per rank that every rank of the group has mapped, so a kernel on one GPU
reads and writes the others' (qruntime.kernels.custom_allreduce).

On GPUs the regions are device allocations shared through CUDA IPC handles (the mechanism
torch.multiprocessing shares CUDA tensors with; opened with lazy peer access), exchanged with one
all_gather_object. That needs every pair of the group's GPUs to reach each other's memory
(`torch.cuda.can_device_access_peer`); where one pair cannot, every rank learns it in the same
exchange and `create` raises PeerMemoryUnavailable on all of them, so they all take NCCL. No NVLink
multicast object is made.

On the CPU (the tests' ranks: gloo processes running the kernels under Triton's interpreter) each
region is a shared file that the other ranks map; it is unlinked once every rank holds it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

ALIGN = 64  # bytes every region's distance to the others is a multiple of (the kernels' vector loads)


class PeerMemoryUnavailable(RuntimeError):
    """Some pair of the group's devices cannot map each other's memory."""


@dataclass(frozen=True)
class PeerRegions:
    """This rank's view of the group's regions: `bases[r]` is rank r's region in this process."""

    rank: int
    world: int
    nbytes: int
    bases: torch.Tensor  # [world] int64 on the device
    local: torch.Tensor  # [nbytes] uint8: this rank's region
    mapped: tuple[object, ...]  # the other ranks' storages, kept alive while the regions are used


def _gather(value: object, group) -> list:
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _cuda_regions(group, device: torch.device, nbytes: int) -> tuple[torch.Tensor, list]:
    with torch.cuda.device(device):
        indices = _gather(device.index, group)
        reachable = all(i == device.index or torch.cuda.can_device_access_peer(device.index, i) for i in indices)
        if not all(_gather(reachable, group)):
            raise PeerMemoryUnavailable(f"GPUs {indices}: not every pair can access the other's memory (no P2P)")
        local = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        handles = _gather(local.untyped_storage()._share_cuda_(), group)
        rank = dist.get_rank(group)
        # opened on this rank's device (the handle names the owner's): the mapping, with lazy peer
        # access, is then this GPU's to read and write
        mapped = [
            local.untyped_storage() if r == rank else torch.UntypedStorage._new_shared_cuda(device.index, *handle[1:])
            for r, handle in enumerate(handles)
        ]
    return local, mapped


def _file_regions(group, nbytes: int) -> tuple[torch.Tensor, list]:
    fd, path = tempfile.mkstemp(prefix="qruntime-peer-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.close(fd)
    try:
        storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
        storage.fill_(0)
        paths = _gather(path, group)
        rank = dist.get_rank(group)
        mapped = [
            storage if r == rank else torch.UntypedStorage.from_file(p, shared=True, nbytes=nbytes)
            for r, p in enumerate(paths)
        ]
        dist.barrier(group=group)  # every rank has mapped every file
    finally:
        os.unlink(path)
    local = torch.empty(0, dtype=torch.uint8).set_(storage)
    return local, mapped


def create_regions(group, device: torch.device, nbytes: int) -> PeerRegions:
    """Map a zeroed region of `nbytes` per rank on every rank of `group` (a collective call)."""
    if device.type == "cuda":
        local, mapped = _cuda_regions(group, device, nbytes)
    else:
        local, mapped = _file_regions(group, nbytes)
    rank = dist.get_rank(group)
    addresses = [s.data_ptr() for s in mapped]
    if any((a - addresses[rank]) % ALIGN for a in addresses):  # the same on every rank (a mapping keeps offsets)
        raise PeerMemoryUnavailable(f"regions at {[hex(a) for a in addresses]}: not {ALIGN}-byte aligned to each other")
    bases = torch.tensor(addresses, dtype=torch.int64, device=device)
    others = tuple(s for r, s in enumerate(mapped) if r != rank)
    return PeerRegions(rank, len(mapped), nbytes, bases, local, others)
