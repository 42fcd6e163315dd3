"""Keys and blocks shared by the store tests: random 16-byte keys, random uint8 blocks, poisoned buffers."""

from __future__ import annotations

import random

import torch

POISON = 0xA5  # fill byte of ``poisoned`` buffers: a row a load did not write still holds it


def make_keys(n: int, seed: int) -> list[bytes]:
    """``n`` random 16-byte keys, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def make_blocks(n: int, nbytes: int, seed: int) -> torch.Tensor:
    """``n`` random blocks of ``nbytes`` bytes, as a ``(n, nbytes)`` uint8 tensor reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=gen)


def poisoned(n: int, nbytes: int) -> torch.Tensor:
    """A ``(n, nbytes)`` uint8 buffer of ``POISON`` bytes, to load into."""
    return torch.full((n, nbytes), POISON, dtype=torch.uint8)
