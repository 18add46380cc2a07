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


def extend_chain(
    chain: list[bytes],
    salt: bytes,
    token_ids: Sequence[int],
    block_size: int,
    image_keys: Sequence[tuple[int, bytes]] = (),
) -> list[bytes]:
    """Append to `chain` (the hashes of the first len(chain) blocks of a sequence) the hashes of the
    next full blocks of `token_ids`, the sequence's tokens from position len(chain) * block_size on;
    returns chain. `image_keys` (Qwen3-VL): (position, digest) of the sequence's images, each taken
    into the parent of the block holding its first token (sha256(IMAGE_MARK, parent, digest)), so that
    block and every later one are named by the images' pixels too, not only by their token ids."""
    parent = chain[-1] if chain else salt
    first = len(chain)
    count = len(token_ids) // block_size
    mixins: dict[int, list[bytes]] = {}
    for position, digest in image_keys:
        mixins.setdefault(position // block_size, []).append(digest)
    # hash_block's bytes, packed once for every block (a 2,064-token prompt: one pack, not 129)
    data, width = struct.pack(f"<{count * block_size}q", *token_ids[: count * block_size]), 8 * block_size
    for i in range(count):
        for digest in mixins.get(first + i, ()):
            parent = hashlib.sha256(IMAGE_MARK + parent + digest).digest()
        parent = hashlib.sha256(parent + data[i * width : (i + 1) * width]).digest()
        chain.append(parent)
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
