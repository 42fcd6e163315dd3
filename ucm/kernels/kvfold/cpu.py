"""The KVfold kernels' CPU fast path (``impl="cpu"``, the default on CPU), on numpy views of CPU tensors.

- bf16 planes: single-threaded numba loops (``ucm.kernels.kvfold.cpu_numba``, compiled on first use, GIL released)
  that LLVM vectorizes; :func:`split_planes_np` / :func:`merge_planes_np` also take numpy arrays directly (the
  Compress stage decodes into numpy buffers).
- int8 groups: the scales in torch, the division and rounding in numpy (single-threaded; see
  :func:`quantize_groups_cpu`); dequantization is the torch code (``kvfold.torch``).

:func:`split_planes_numpy` / :func:`merge_planes_numpy` are the planes in numpy alone (several passes, much slower
than the numba loops): a second CPU version with no compiler behind it, tested against the reference, reached by no
``impl`` name.
"""

from __future__ import annotations

import numpy as np
import torch

from ucm.kernels.kvfold.naive import QMAX
from ucm.kernels.kvfold.torch import group_scales


def split_planes_np(words: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``words`` uint16 ``[n]`` -> ``(exp, sm)`` uint8 ``[n]`` tensors (numba loop)."""
    from ucm.kernels.kvfold.cpu_numba import split_planes

    exp = np.empty(words.shape, np.uint8)
    sm = np.empty(words.shape, np.uint8)
    split_planes(_read_only(words), exp, sm)
    return torch.from_numpy(exp), torch.from_numpy(sm)


def merge_planes_np(exp: np.ndarray, sm: np.ndarray, words: np.ndarray) -> None:
    """uint8 ``exp``, ``sm`` ``[n]`` (read-only arrays allowed) -> ``words`` uint16 ``[n]`` written in place (numba
    loop).

    Raises:
        ValueError: the three arrays differ in length.
    """
    if not exp.shape[0] == sm.shape[0] == words.shape[0]:
        raise ValueError(f"planes of {exp.shape[0]} and {sm.shape[0]} values for {words.shape[0]} words")
    from ucm.kernels.kvfold.cpu_numba import merge_planes

    merge_planes(_read_only(exp), _read_only(sm), words)


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a``. numba compiles a kernel once per argument type, and writability is part of the
    type: the codec's inputs are read-only (``bytes``) or not (a reused read buffer) depending on where they come
    from, so without this the first load of a process that reads another kind compiled (or loaded from numba's cache)
    a second specialization of the kernel, while every decoding thread waited on numba's compiler lock, on a storage
    hit's TTFT after a fresh install."""
    if not a.flags.writeable:
        return a
    view = a.view()
    view.flags.writeable = False
    return view


def split_planes_numpy(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int16 ``[n]`` CPU bf16 bit patterns -> ``(exp, sm)`` uint8 ``[n]``, in numpy passes (no numba)."""
    v = words.numpy().view(np.uint16)
    exp = np.empty(v.shape, np.uint8)
    sm = np.empty(v.shape, np.uint8)
    np.right_shift(v, 7, out=exp, casting="unsafe")  # the cast to uint8 keeps bits 14-7
    hi = np.right_shift(v, 8)
    np.bitwise_and(hi, 0x80, out=hi)
    np.bitwise_or(hi, np.bitwise_and(v, 0x7F), out=hi)
    sm[...] = hi
    return torch.from_numpy(exp), torch.from_numpy(sm)


def merge_planes_numpy(exp: torch.Tensor, sm: torch.Tensor, words: torch.Tensor) -> None:
    """uint8 ``exp``, ``sm`` ``[n]`` CPU tensors -> ``words`` int16 ``[n]`` written in place, in numpy passes (no
    numba)."""
    e = exp.reshape(-1).numpy()
    s = sm.reshape(-1).numpy()
    v = words.numpy().view(np.uint16)
    np.left_shift(e, 7, out=v, dtype=np.uint16)
    t = np.bitwise_and(s, 0x80).astype(np.uint16)
    np.left_shift(t, 8, out=t)
    np.bitwise_or(v, t, out=v)
    np.bitwise_or(v, np.bitwise_and(s, 0x7F), out=v, casting="unsafe")


def quantize_groups_cpu(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``[G, group]`` CPU tensor -> ``(q, scale)``: int8 ``[G * group]``, bf16 ``[G]``. numpy's ``rint`` rounds
    half to even like ``torch.round``, single-threaded: torch.round's OpenMP loop was seen stalling on a busy 2-core
    machine ("CPU kernel design figures" in benchmarks/RESULTS.md)."""
    g = rows.float()  # [G, group]
    s = group_scales(g.abs().amax(dim=1))
    qn = np.rint(g.numpy() / s.float().numpy()[:, None])
    np.clip(qn, -QMAX, QMAX, out=qn)
    return torch.from_numpy(qn.astype(np.int8).reshape(-1)), s
