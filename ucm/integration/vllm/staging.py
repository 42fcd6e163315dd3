"""Reusable host buffers for the worker's dumps.

A dump gathers the step's newly full blocks into a staging buffer that the store reads until the dump's task is
done, so a buffer per dump is needed, of a size that changes every step (1 to hundreds of blocks of up to a few
MiB each). A fresh ``torch.empty`` per dump pays the page faults of fresh memory on the step's path, and under a
long load it fragments the process heap: glibc's malloc raises its mmap threshold to the size of the largest chunk
freed (up to 32 MiB), after which buffers of varying size below it come from the heap, whose free gaps are rarely
the size asked for next, so the heap keeps growing. :class:`StagingPool` hands out buffers of a power-of-two
number of blocks (the smallest idle one large enough, else a new one) and takes them back when the store is done
with them, keeping the most recently given back up to a bound on the bytes it holds idle.
"""

from __future__ import annotations

import threading

import torch


class StagingPool:
    """Host buffers of ``[capacity, *block_shape]`` ``dtype``, ``capacity`` a power of two, reused across dumps.

    Args:
        block_shape: one block's shape (the canonical ``[num_layers, 2, block_size, num_kv_heads, head_dim]``).
        dtype: the KV dtype.
        max_idle_bytes: most bytes of buffers kept for reuse while no dump holds them; past it, the buffers given
            back longest ago are freed (a buffer larger than it is freed at once). In-flight buffers are not
            bounded here: they are the store's in-flight dumps.

    Raises:
        ValueError: ``max_idle_bytes`` < 0 or an empty ``block_shape``.
    """

    def __init__(self, block_shape: tuple[int, ...], dtype: torch.dtype, max_idle_bytes: int) -> None:
        if max_idle_bytes < 0:
            raise ValueError(f"max_idle_bytes must be >= 0, got {max_idle_bytes}")
        if not block_shape:
            raise ValueError("block_shape must not be empty")
        self._block_shape = tuple(block_shape)
        self._dtype = dtype
        self._block_nbytes = torch.Size(block_shape).numel() * torch.empty((), dtype=dtype).element_size()
        self._max_idle_bytes = max_idle_bytes
        self._idle: list[torch.Tensor] = []  # idle buffers, oldest given back first
        self._idle_bytes = 0
        self._lock = threading.Lock()  # give() may come from a store thread's callback
        self.taken = 0  # buffers handed out by take()
        self.reused = 0  # of them, buffers given back earlier

    @staticmethod
    def capacity(n: int) -> int:
        """The buffer size (blocks) that serves ``n`` blocks: the least power of two >= ``n``."""
        return 1 << max(0, n - 1).bit_length()

    def take(self, n: int) -> torch.Tensor:
        """A buffer of at least ``n`` blocks (contents unspecified; its first ``n`` rows are the caller's): the
        smallest idle buffer that has them (the most recently given back of that size), else a new one of
        :meth:`capacity` ``(n)`` blocks.

        Raises:
            ValueError: ``n`` < 1.
        """
        if n < 1:
            raise ValueError(f"a staging buffer needs >= 1 block, got {n}")
        with self._lock:
            self.taken += 1
            best = -1
            for i in range(len(self._idle) - 1, -1, -1):  # newest first: its pages are the most likely resident
                size = self._idle[i].shape[0]
                if size >= n and (best < 0 or size < self._idle[best].shape[0]):
                    best = i
            if best >= 0:
                buffer = self._idle.pop(best)
                self._idle_bytes -= buffer.shape[0] * self._block_nbytes
                self.reused += 1
                return buffer
        return torch.empty((self.capacity(n), *self._block_shape), dtype=self._dtype)

    def give(self, buffer: torch.Tensor) -> None:
        """Take back a buffer from :meth:`take` that nothing reads or writes any more (kept for reuse or freed)."""
        with self._lock:
            self._idle.append(buffer)
            self._idle_bytes += buffer.shape[0] * self._block_nbytes
            while self._idle_bytes > self._max_idle_bytes:
                self._idle_bytes -= self._idle.pop(0).shape[0] * self._block_nbytes

    @property
    def idle_bytes(self) -> int:
        """Bytes of the buffers kept for reuse."""
        return self._idle_bytes
