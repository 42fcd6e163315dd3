"""Listing and garbage collection of a Posix store's files, shared by the store itself and the operator CLI.

What lives under a storage directory (see :mod:`ucm.store.posix` for the placement and the file format):

- block files: ``*.ucmb`` not starting with ``.``;
- temp files: ``.*.tmp``, a dump in progress or left behind by a killed writer. A temp file is *stale* when its
  mtime is older than a given age (default :data:`DEFAULT_TMP_AGE_S`); a live writer finishes a block in well
  under that, so only stale temps are ever removed, which is safe with several instances sharing the directory;
- namespace files: ``namespaces/<tag>.json`` directly under a storage directory, one per model namespace that
  wrote blocks there (see :meth:`ucm.store.posix.PosixStore.set_namespace`); not listed by :func:`scan_store`;
- anything else: never touched.

Last use of a block is ``max(atime, mtime)``: a block file is never modified after its rename, so its mtime is its
write time; :class:`~ucm.store.posix.PosixStore` sets the atime of a block file when it serves it (a hit), so
least-recently-used order holds whatever the mount's ``relatime`` / ``noatime`` setting.

Deleting a block file is safe while other processes use the store: a reader that has the file open keeps reading
it (POSIX unlink semantics); a later lookup or load sees a miss, never wrong data. Shard directories are never
removed (a writer may be about to create its temp file there).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

FILE_SUFFIX = ".ucmb"
TMP_SUFFIX = ".tmp"
NAMESPACE_DIR = "namespaces"
DEFAULT_TMP_AGE_S = 3600.0


@dataclass(frozen=True)
class FileInfo:
    """One file found in the store: absolute path, size in bytes, last use and mtime in ns since the epoch."""

    path: str
    size: int
    last_used_ns: int
    mtime_ns: int


@dataclass
class StoreScan:
    """What :func:`scan_store` found, sorted by kind (see the module docstring)."""

    dirs: list[str]
    blocks: list[FileInfo] = field(default_factory=list)
    temps: list[FileInfo] = field(default_factory=list)
    others: list[FileInfo] = field(default_factory=list)

    @property
    def block_bytes(self) -> int:
        """Total size of the block files in bytes."""
        return sum(f.size for f in self.blocks)

    def stale_temps(self, tmp_age_s: float, now_ns: int | None = None) -> list[FileInfo]:
        """Temp files whose mtime is more than ``tmp_age_s`` seconds before ``now_ns`` (default: now)."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        limit = now_ns - int(tmp_age_s * 1e9)
        return [f for f in self.temps if f.mtime_ns < limit]


def _walk_files(root: str) -> Iterator[os.DirEntry[str]]:
    """Regular files under ``root``, recursively, except ``root/namespaces/``; symlinks are neither followed nor
    listed."""
    stack = [root]
    skip = os.path.join(root, NAMESPACE_DIR)
    while stack:
        with contextlib.suppress(FileNotFoundError), os.scandir(stack.pop()) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    if entry.path != skip:
                        stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    yield entry


def scan_store(dirs: Sequence[str]) -> StoreScan:
    """List the block, temp and other files under ``dirs`` with their sizes and times (reads no file data).

    A file or directory that disappears during the scan (a concurrent gc or rename) is skipped.

    Raises:
        OSError: a directory cannot be listed (permissions).
    """
    scan = StoreScan(dirs=list(dirs))
    for d in dirs:
        for entry in _walk_files(d):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            info = FileInfo(entry.path, st.st_size, max(st.st_atime_ns, st.st_mtime_ns), st.st_mtime_ns)
            name = entry.name
            if name.endswith(FILE_SUFFIX) and not name.startswith("."):
                scan.blocks.append(info)
            elif name.endswith(TMP_SUFFIX) and name.startswith("."):
                scan.temps.append(info)
            else:
                scan.others.append(info)
    return scan


def gc_plan(scan: StoreScan, target_bytes: int) -> list[FileInfo]:
    """The block files to delete, least recently used first, so that the rest total at most ``target_bytes``.

    Raises:
        ValueError: ``target_bytes`` < 0.
    """
    if target_bytes < 0:
        raise ValueError(f"target must be >= 0 bytes, got {target_bytes}")
    excess = scan.block_bytes - target_bytes
    plan: list[FileInfo] = []
    for f in sorted(scan.blocks, key=lambda f: (f.last_used_ns, f.path)):
        if excess <= 0:
            break
        plan.append(f)
        excess -= f.size
    return plan


@dataclass
class Deletion:
    """Result of :func:`delete_files`: files and bytes freed, and ``(path, error)`` for each failed deletion."""

    files: int = 0
    bytes: int = 0
    errors: list[tuple[str, str]] = field(default_factory=list)


def delete_files(
    files: Sequence[FileInfo], progress: Callable[[Sequence[FileInfo]], Iterable[FileInfo]] = iter
) -> Deletion:
    """Unlink ``files`` (iterated through ``progress``, e.g. a progress bar); a file already gone counts as freed,
    other errors are collected, never raised."""
    result = Deletion()
    for f in progress(files):
        try:
            os.unlink(f.path)
        except FileNotFoundError:
            pass
        except OSError as err:
            result.errors.append((f.path, err.strerror or str(err)))
            continue
        result.files += 1
        result.bytes += f.size
    return result
