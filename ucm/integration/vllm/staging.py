"""The worker's host memory for dumps: one staging arena, allocated and paged in once.

A dump gathers the step's newly full blocks into staging memory that the store reads until the dump's task is done,
so every dump in flight holds its own rows, of a count that changes every step (1 to hundreds of blocks of up to a
few MiB each). Buffers allocated per dump, or kept in a pool of varying sizes, come from the process's allocator
(glibc's malloc, or tcmalloc where it is preloaded as vLLM's CPU guide advises), which keeps freed memory for reuse
and whose free gaps are rarely the size asked for next, so the process's memory can keep growing under a long load.
:class:`StagingArena` is a single ``[num_blocks, *block_shape]`` tensor, allocated once and never freed while the
worker lives, from which each dump takes a contiguous run of rows and gives it back when the store is done: the
dumps' host memory is fixed at start, and a dump that finds no run long enough waits for a later step (see
``ucm.integration.vllm.worker``, "Dumps in flight").
"""

from __future__ import annotations

import bisect
import threading

import torch


class StagingArena:
    """``num_blocks`` rows of ``[*block_shape]`` ``dtype`` in one host tensor, handed out as contiguous runs.

    Runs are taken first fit (the lowest rows free), so the rows in use stay packed at the start and the largest
    free run stays large; a run given back merges with its free neighbours.

    Args:
        num_blocks: rows of the arena (blocks); 0 makes an arena that hands out nothing.
        block_shape: one block's shape (the canonical ``[num_layers, 2, block_size, num_kv_heads, head_dim]``).
        dtype: the KV dtype.

    Raises:
        ValueError: ``num_blocks`` < 0 or an empty ``block_shape``.
    """

    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if not block_shape:
            raise ValueError("block_shape must not be empty")
        self.buffer = torch.empty((num_blocks, *block_shape), dtype=dtype)
        self._row_nbytes = self.buffer[0].nbytes if num_blocks else 0
        # Free runs as sorted starts and their lengths; runs taken: start -> length.
        self._free_starts: list[int] = [0] if num_blocks else []
        self._free_lengths: list[int] = [num_blocks] if num_blocks else []
        self._taken: dict[int, int] = {}
        self._lock = threading.Lock()  # give() may come from a store thread's callback
        self.taken_runs = 0  # runs handed out by take()

    @property
    def num_blocks(self) -> int:
        return self.buffer.shape[0]

    def page_in(self) -> None:
        """Write every page of the arena (zeros), so that no dump pays the page faults of fresh memory."""
        self.buffer.view(torch.uint8).zero_()

    def take(self, n: int) -> torch.Tensor | None:
        """Rows for a dump of ``n`` blocks: a ``[n, *block_shape]`` view of the arena's first free run of at least
        ``n`` rows (contents unspecified), or None when no free run has ``n`` rows.

        Raises:
            ValueError: ``n`` < 1.
        """
        if n < 1:
            raise ValueError(f"a staging run needs >= 1 block, got {n}")
        with self._lock:
            for i, length in enumerate(self._free_lengths):
                if length >= n:
                    start = self._free_starts[i]
                    if length == n:
                        del self._free_starts[i], self._free_lengths[i]
                    else:
                        self._free_starts[i] += n
                        self._free_lengths[i] -= n
                    self._taken[start] = n
                    self.taken_runs += 1
                    return self.buffer[start : start + n]
        return None

    def give(self, rows: torch.Tensor) -> None:
        """Take back a run from :meth:`take` that nothing reads or writes any more.

        Raises:
            ValueError: ``rows`` is not a run this arena handed out (or was given back already).
        """
        offset = rows.data_ptr() - self.buffer.data_ptr()
        start = offset // self._row_nbytes if self._row_nbytes and offset >= 0 else -1
        with self._lock:
            n = self._taken.get(start)
            if n is None or start * self._row_nbytes != offset or rows.shape[0] != n:
                raise ValueError(f"rows at byte offset {offset} of {rows.shape[0]} blocks are not a run taken here")
            del self._taken[start]
            i = bisect.bisect(self._free_starts, start)
            if i < len(self._free_starts) and start + n == self._free_starts[i]:  # merge with the next free run
                n += self._free_lengths[i]
                del self._free_starts[i], self._free_lengths[i]
            if i > 0 and self._free_starts[i - 1] + self._free_lengths[i - 1] == start:  # and with the previous
                self._free_lengths[i - 1] += n
            else:
                self._free_starts.insert(i, start)
                self._free_lengths.insert(i, n)

    def owns(self, rows: torch.Tensor) -> bool:
        """Whether ``rows`` lies in this arena's memory."""
        begin = self.buffer.data_ptr()
        return begin <= rows.data_ptr() < begin + self.buffer.nbytes

    @property
    def largest_free(self) -> int:
        """Rows of the largest free run: the most blocks one :meth:`take` can get now."""
        with self._lock:
            return max(self._free_lengths, default=0)

    @property
    def blocks_in_use(self) -> int:
        """Rows held by runs not given back."""
        with self._lock:
            return sum(self._taken.values())
