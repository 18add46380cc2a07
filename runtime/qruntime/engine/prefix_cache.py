"""Automatic prefix caching: the names of full KV blocks and the lookup counters (plain Python: no torch).

A full block is named by a hash chain: block i's hash is sha256(block i-1's hash, its block_size
token ids), and block 0's parent is the engine's salt, a digest of how the artifact encodes KV
(kv_salt). Two blocks get one name only when they hold the same tokens after the same prefix,
encoded the same way, so a block found by name holds exactly the KV its request would compute.
The hash is sha256 over a fixed-width encoding (32-byte parent, 8 bytes a token), not Python's
hash(): clients choose the tokens, and a collision would hand one client another's context.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SALT_DOMAIN = b"qruntime prefix cache v1\0"  # changes whenever the encoding below does
IMAGE_MARK = b"qruntime image\0"  # an image's digest taken into a chain (a different length: never a block's bytes)


def kv_salt(identity: Mapping[str, Any]) -> bytes:
    """The 32-byte root of every hash chain: sha256 of `identity` (what decides the bytes a block holds:
    KV dtype, layout, block size, per-layer scales, compute dtype) as canonical JSON."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(SALT_DOMAIN + text.encode()).digest()


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The name of a full block holding `token_ids` after the block named `parent` (the salt for block 0)."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


class ChainMemo:
    """A bounded, exact memo of hash chains, so that requests sharing a prefix (a system prompt, a
    burst of one conversation) name its blocks without hashing them again:

    - links: the bytes sha256 takes for a block (its parent's name, then its token ids as extend_chain
      encodes them) -> the block's name;
    - runs: for a chain named from block 0 without images, its first link -> (its encoded tokens, its
      names), the newest chain per first link: a later one starting with the same link takes the names
      of the blocks where both chains' bytes agree (one bytes comparison per halving, no lookups).

    Keyed and compared by whole bytes, never a hash of them, so every name it gives is the digest of
    exactly the bytes extend_chain would hash: it only skips work, it never changes a name. At most
    `capacity` links and `capacity` names in runs (with their blocks' bytes), the oldest inserted
    dropped first: about capacity * (2 * 8 * block_size + 200) bytes. Owned by one Scheduler: no
    state is shared between engines."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"ChainMemo capacity must be >= 0 (got {capacity})")
        self.capacity = capacity
        self._links: OrderedDict[bytes, bytes] = OrderedDict()
        self._runs: OrderedDict[bytes, tuple[bytes, list[bytes]]] = OrderedDict()
        self._run_names = 0  # names held by _runs

    def __len__(self) -> int:
        """Links and run names held (at most 2 * capacity)."""
        return len(self._links) + self._run_names

    def _remember(self, link: bytes, name: bytes) -> None:
        if len(self._links) >= self.capacity:
            self._links.popitem(last=False)
        self._links[link] = name

    def _remember_run(self, head: bytes, data: bytes, names: list[bytes]) -> None:
        old = self._runs.pop(head, None)
        if old is not None:
            self._run_names -= len(old[1])
        if len(names) > self.capacity:
            return
        self._runs[head] = (data, names)
        self._run_names += len(names)
        while self._run_names > self.capacity:
            self._run_names -= len(self._runs.popitem(last=False)[1][1])


def _common_blocks(data: bytes, other: bytes, width: int, most: int) -> int:
    """The most leading blocks (of `width` bytes, at most `most`, at least 1) that data and other share,
    given that they share the first: a binary search of bytes comparisons (about 2 * most blocks' bytes)."""
    view = memoryview(data)  # compared in place: no copies
    if other.startswith(view[: most * width]):
        return most
    same, differ = 1, most  # data[:same * width] == other[:same * width], and not so at differ
    while differ - same > 1:
        mid = (same + differ) // 2
        if other.startswith(view[same * width : mid * width], same * width):  # only the bytes not compared yet
            same = mid
        else:
            differ = mid
    return same


def extend_chain(
    chain: list[bytes],
    salt: bytes,
    token_ids: Sequence[int],
    block_size: int,
    image_keys: Sequence[tuple[int, bytes]] = (),
    memo: ChainMemo | None = None,
) -> list[bytes]:
    """Append to `chain` (the hashes of the first len(chain) blocks of a sequence) the hashes of the
    next full blocks of `token_ids`, the sequence's tokens from position len(chain) * block_size on;
    returns chain. `image_keys` (Qwen3-VL): (position, digest) of the sequence's images, each taken
    into the parent of the block holding its first token (sha256(IMAGE_MARK, parent, digest)), so that
    block and every later one are named by the images' pixels too, not only by their token ids.
    `memo`: names already computed (by this or another request) are taken from it; they are the same."""
    parent = chain[-1] if chain else salt
    first = len(chain)
    count = len(token_ids) // block_size
    mixins: dict[int, list[bytes]] = {}
    for position, digest in image_keys:
        mixins.setdefault(position // block_size, []).append(digest)
    # hash_block's bytes, packed once for every block (a 2,064-token prompt: one pack, not 129)
    full = token_ids if len(token_ids) == count * block_size else token_ids[: count * block_size]
    data, width = struct.pack(f"<{count * block_size}q", *full), 8 * block_size
    sha256 = hashlib.sha256
    if memo is None or memo.capacity == 0 or count == 0:
        for i in range(count):
            for digest in mixins.get(first + i, ()):
                parent = sha256(IMAGE_MARK + parent + digest).digest()
            parent = sha256(parent + data[i * width : (i + 1) * width]).digest()
            chain.append(parent)
        return chain
    done = 0
    head = parent + data[:width] if first == 0 and not mixins else None
    if head is not None and (run := memo._runs.get(head)) is not None:
        done = _common_blocks(data, run[0], width, min(count, len(run[1])))
        chain += run[1][:done]
        parent = chain[-1]
    # the links' hits, per block: one slice, one concatenation, one dict lookup (no hash object)
    known, remember, append = memo._links.get, memo._remember, chain.append
    for i, offset in enumerate(range(done * width, count * width, width), first + done):
        if mixins:
            for digest in mixins.get(i, ()):
                parent = sha256(IMAGE_MARK + parent + digest).digest()
        link = parent + data[offset : offset + width]
        parent = known(link)
        if parent is None:
            parent = sha256(link).digest()
            remember(link, parent)
        append(parent)
    if head is not None:
        memo._remember_run(head, data, chain[:count])
    return chain


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Lookups since the engine started, in tokens. A new value replaces the old one at each
    admission, so another thread reads a consistent pair without a lock."""

    queries: int = 0  # tokens of admitted requests looked up (the prompt; prompt + outputs after a preemption)
    hits: int = 0  # of those, tokens whose KV came from cached blocks

    @property
    def hit_rate(self) -> float:
        """hits / queries (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0

    def add(self, queries: int, hits: int) -> PrefixCacheStats:
        return PrefixCacheStats(self.queries + queries, self.hits + hits)
