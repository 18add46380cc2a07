"""Paged KV-cache block allocation with reference counts and a prefix cache (plain Python: no torch)."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence


class NoFreeBlocks(Exception):
    """Not enough free blocks for a growth; nothing was allocated."""


class BlockManager:
    """Paged KV-cache block allocation for requests over block ids 0..num_blocks-1.

    Each request owns a block table (block i holds its tokens [i*block_size, (i+1)*block_size));
    tables only grow until the request's blocks are freed. A block is held by every table it is in
    (a reference count): a cached block (`cache`: full, named by its prefix_cache hash) may start the
    tables of several requests (`grow(..., cached=lookup(hashes))`). When its last holder frees it, a
    cached block keeps its KV and its name and becomes evictable: it counts as free, a later lookup
    can revive it, and only when a fresh block is wanted and no uncached block is free does the
    least recently freed one lose its name and get reused. Requests free their tables tail first,
    so a chain's later blocks are evicted before its earlier ones (a lookup matches prefixes only).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1 (got {num_blocks}, {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks))  # uncached blocks in no table, a min-heap: lowest ids first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks in no table, oldest-freed first
        self._refs = [0] * num_blocks  # tables each block is in
        self._tables: dict[str, list[int]] = {}
        self._hash_of: dict[int, bytes] = {}  # cached block -> its hash
        self._block_of: dict[bytes, int] = {}  # hash -> the one block cached under it
        self._num_offered: dict[str, int] = {}  # leading blocks of a table cache() has considered
        self._num_named: dict[str, int] = {}  # leading blocks of a table grow() took from the cache
        # bumped by every change of tables, references or names (grow, cache, free): _cost's answer for a
        # tuple of cached blocks (can_grow's, then grow's for the same request) stands while it does
        self._changes = 0
        self._last_cost: tuple[str, int, tuple[int, ...], int, int] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks in no request's table, evictable cached ones included."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a name in the prefix cache, held or evictable."""
        return len(self._block_of)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens: ceil(num_tokens / block_size)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0 (got {num_tokens})")
        return -(-num_tokens // self.block_size)

    def num_missing(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks the request needs so that its table holds num_tokens tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def lookup(self, hashes: Iterable[bytes]) -> tuple[int, ...]:
        """The cached blocks of the longest prefix of `hashes` (a request's hash chain) found in the cache."""
        found = list(map(self._block_of.get, hashes))  # one C-level pass (a 2,000-token prefix: 125 lookups)
        if None in found:
            del found[found.index(None) :]
        return tuple(found)

    def can_grow(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Whether grow(request_id, num_tokens, cached) would succeed now."""
        return self._cost(request_id, num_tokens, cached) <= self.num_free_blocks

    def grow(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> tuple[int, ...]:
        """Ensure the request's table covers num_tokens tokens and return the whole table.

        cached: blocks from lookup() to start a request's new table with (it must hold none yet);
        their KV is reused, the rest of the table gets fresh blocks. Raises NoFreeBlocks, changing
        nothing, when too few blocks are free (an evictable cached block taken counts as one)."""
        cost = self._cost(request_id, num_tokens, cached)
        if cost > self.num_free_blocks:
            raise NoFreeBlocks(
                f"request {request_id!r} needs {cost} more blocks for {num_tokens} tokens; {self.num_free_blocks} free"
            )
        self._changes += 1
        table = self._tables.setdefault(request_id, [])
        if cached:
            refs = self._refs
            if cost > max(0, self.blocks_for(num_tokens) - len(cached)):  # some are evictable: in a table again
                for block in cached:
                    if refs[block] == 0:
                        del self._evictable[block]
            for block in cached:
                refs[block] += 1
            table += cached
            # their names are the request's chain already (lookup found them by it): cache() checks them at C speed
            self._num_named[request_id] = len(cached)
        for _ in range(self.blocks_for(num_tokens) - len(table)):
            block = self._take()
            self._refs[block] = 1
            table.append(block)
        return tuple(table)

    def cache(self, request_id: str, hashes: Sequence[bytes], num_blocks: int) -> None:
        """Name the first num_blocks blocks of the request's table, now full of computed KV, by
        hashes[:num_blocks] (its hash chain), so that later requests find them. A block whose hash
        another block already has stays unnamed (no two blocks answer one name)."""
        table = self._tables.get(request_id, [])
        if num_blocks > min(len(table), len(hashes)):
            raise ValueError(
                f"request {request_id!r}: cannot cache {num_blocks} blocks with a table of {len(table)} "
                f"and {len(hashes)} hashes"
            )
        self._changes += 1
        first = self._num_offered.get(request_id, 0)
        # the leading blocks grow() took from the cache: named already; compared in one pass, not block by block
        found = min(self._num_named.get(request_id, 0), num_blocks)
        if first < found and list(map(self._hash_of.get, table[first:found])) == hashes[first:found]:
            first = found  # else the walk below meets the block named otherwise and raises
        for i in range(first, num_blocks):
            block, h = table[i], hashes[i]
            named = self._hash_of.get(block)
            if named is not None:
                if named != h:
                    raise ValueError(f"request {request_id!r}: block {block} at {i} is cached under another hash")
                continue  # a block the request found in the cache
            if h not in self._block_of:
                self._hash_of[block], self._block_of[h] = h, block
        self._num_offered[request_id] = max(num_blocks, self._num_offered.get(request_id, 0))

    def table(self, request_id: str) -> tuple[int, ...]:
        """The request's block table; () when it holds none."""
        return tuple(self._tables.get(request_id, ()))

    def free(self, request_id: str) -> None:
        """Drop the request's hold on its blocks (no-op when it holds none), last block first: those
        no other table holds become free, cached ones evictable, most recently freed last."""
        self._changes += 1
        self._num_offered.pop(request_id, None)
        self._num_named.pop(request_id, None)
        for block in reversed(self._tables.pop(request_id, ())):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                heapq.heappush(self._free, block)

    def _cost(self, request_id: str, num_tokens: int, cached: Sequence[int]) -> int:
        """Free blocks grow() would take: fresh ones, plus the evictable ones among `cached`."""
        if not cached:
            return self.num_missing(request_id, num_tokens)
        last = self._last_cost
        if last is not None and last[2] is cached and last[3] == self._changes and last[:2] == (request_id, num_tokens):
            return last[4]  # nothing changed since the same question (can_grow, then grow): the same answer
        if self._tables.get(request_id):
            raise ValueError(f"request {request_id!r} already holds blocks: cached blocks start a new table only")
        distinct = set(cached)
        if len(distinct) != len(cached) or not self._hash_of.keys() >= distinct:
            raise ValueError(f"request {request_id!r}: {list(cached)} are not distinct cached blocks")
        refs = self._refs
        revived = [refs[b] for b in cached].count(0)  # evictable ones: they leave the free count
        cost = max(0, self.blocks_for(num_tokens) - len(cached)) + revived
        if type(cached) is tuple:  # immutable: the same object is the same blocks
            self._last_cost = (request_id, num_tokens, cached, self._changes, cost)
        return cost

    def _take(self) -> int:
        """A fresh block: an uncached free one if any, else the least recently freed cached one, unnamed."""
        if self._free:
            return heapq.heappop(self._free)
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        return block
