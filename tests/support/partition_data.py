"""What the partition tests save and expect (tests/test_partitions.py): one deployment, prompts and
KV bytes made from a fixed seed, so the holder host that saves them and the lookup host that
checks them agree without being told."""

from __future__ import annotations

import random
from typing import List

import mooncake_keys as mk

MODEL = "netns-model"
LAYOUT = mk.ParallelLayout(tp_size=1, num_kv_heads=1)
GROUPS = [mk.FullAttentionSpec(16)]
HASH_BLOCK = 16  # tokens per block
PROMPTS, CHUNKS, BLOCK = 8, 8, 256  # prompts, blocks per prompt, bytes per block
TOKENS = CHUNKS * HASH_BLOCK  # a whole prompt, in tokens: a full hit
FULL = TOKENS + 1  # num_tokens one past the prefix: a full hit is not shortened


def prompts() -> List[List[bytes]]:
    """The block hashes of every prompt (32 bytes each)."""
    rng = random.Random(22)
    return [[rng.randbytes(32) for _ in range(CHUNKS)] for _ in range(PROMPTS)]


def kv_bytes() -> bytes:
    """The KV cache the holder saves: block ``p * CHUNKS + c`` is prompt p's chunk c."""
    return random.Random(23).randbytes(PROMPTS * CHUNKS * BLOCK)


def block_ids(prompt: int) -> List[int]:
    """The KV-cache blocks of prompt ``prompt``."""
    return list(range(prompt * CHUNKS, (prompt + 1) * CHUNKS))
