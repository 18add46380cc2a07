"""Paged KV-cache block allocation (plain Python: no torch)."""

from __future__ import annotations

import heapq


class NoFreeBlocks(Exception):
    """Not enough free blocks for a growth; nothing was allocated."""


class BlockManager:
    """Paged KV-cache block allocation for requests: a free list of block ids 0..num_blocks-1.

    Each request owns a block table (block i holds its tokens [i*block_size, (i+1)*block_size)).
    Tables only grow until the request's blocks are freed; a block is in at most one table.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1 (got {num_blocks}, {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks))  # a min-heap: lowest free ids are handed out first
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks in no request's table."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests."""
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens: ceil(num_tokens / block_size)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0 (got {num_tokens})")
        return -(-num_tokens // self.block_size)

    def num_missing(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks the request needs so that its table holds num_tokens tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def can_grow(self, request_id: str, num_tokens: int) -> bool:
        """Whether grow(request_id, num_tokens) would succeed now."""
        return self.num_missing(request_id, num_tokens) <= len(self._free)

    def grow(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        """Ensure the request's table covers num_tokens tokens and return the whole table.

        Raises NoFreeBlocks, allocating nothing, when too few blocks are free.
        """
        missing = self.num_missing(request_id, num_tokens)
        if missing > len(self._free):
            raise NoFreeBlocks(
                f"request {request_id!r} needs {missing} more blocks for {num_tokens} tokens; {len(self._free)} free"
            )
        if missing == 0:
            return self.table(request_id)
        table = self._tables.setdefault(request_id, [])
        table.extend(heapq.heappop(self._free) for _ in range(missing))
        return tuple(table)

    def table(self, request_id: str) -> tuple[int, ...]:
        """The request's block table; () when it holds none."""
        return tuple(self._tables.get(request_id, ()))

    def free(self, request_id: str) -> None:
        """Return the request's blocks to the free list (no-op when it holds none)."""
        for block in self._tables.pop(request_id, ()):
            heapq.heappush(self._free, block)
