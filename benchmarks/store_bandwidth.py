"""Store bandwidth: dump and load GB/s of the real UCM stores against raw file I/O of the same bytes.

Run ``python benchmarks/store_bandwidth.py [--total-gb 2] [--repeats 4] [--dir DIR] [--io-engine psync|aio]
[--io-direct]``. GB = 1e9 bytes; GB/s counts block payload bytes only (the store's 44-byte file headers
are not counted, so they count against the store).

Block sizes (block_size 128, bf16): a Llama-8B block, 32 layers x 2 (K, V) x 128 tokens x 8 KV heads x 128 head_dim
x 2 bytes = 16 MiB, and one layer of it (a layerwise shard), 512 KiB. ``--total-gb`` of blocks of each size (whole
blocks, at least one) are moved per phase, with fresh random 16-byte keys every repeat.

Stores: ``Posix`` and ``Cache|Posix``, each built by :func:`ucm.store.pipeline.build_store` from a config parsed by
:func:`ucm.config.config_from_extra_config`, as the connector does, with ``posix_io_engine`` / ``io_direct`` /
``posix_io_threads`` / ``cache_buffer_capacity_gb`` from the options. A configuration that the config (or the store)
refuses is reported as ``{"unsupported": <reason>}`` for that store; the raw baseline still runs. Figures per store:

- ``dump``: keys and rows handed to ``dump`` in batches of ``--batch-mb`` (all batches submitted, then every task
  waited for: the bytes are in files, in the page cache; the store does not fsync). ``dump_synced`` adds a
  ``syncfs`` of the file system (the bytes are on the disk). ``Cache|Posix`` also gives ``dump_accept``: until the
  last ``dump`` call returned (rows copied into DRAM; the write-back runs on), and ``load_dram_hit``: a load of
  every block from the instance that dumped them (DRAM hits, when ``--total-gb`` fits the cache).
- ``load_cold``: a *fresh* store instance (so the ``Cache`` stage is empty and every block comes from its file)
  loads every block, in batches, after the page cache was emptied; ``load_warm``: another fresh instance loads them
  again right after (files in the page cache). Every load is checked: no failed key, bytes equal to what was dumped.
- ``load_layerwise_cold`` (16 MiB blocks only): as ``load_cold``, with ``load_sharded`` into 32 shards of 512 KiB
  (one per layer), the read pattern of ``use_layerwise: true``; timed until every block is validated.

Raw baseline, same bytes, same directory, same run, one thread, plain ``open`` / ``write`` / ``read`` / ``close``
(``O_DIRECT`` when ``--io-direct`` is given and the file system takes it; ``raw_io`` says which): ``write_files``
(one file per block), ``write_bigfile`` (all blocks into one file, one ``write`` per block), their ``_synced``
variants, and ``read_files_cold`` / ``read_bigfile_cold`` / ``read_files_warm`` / ``read_bigfile_warm``.

Ratios are *paired*: each repeat divides each store figure by the raw figure of the same kind measured in the same
repeat (``dump`` by ``write_*``, ``load_cold`` and ``load_layerwise_cold`` by ``read_*_cold``, ...), and ``ratios``
is the median of those per-repeat ratios (the per-repeat values are in ``ratio_samples``); ``ratios_of_medians`` is
the store's median GB/s over the raw median GB/s, which pairs samples from different repeats and so different
machine states. ``posix_below_0.9x_raw`` lists the ``Posix`` dump and cold-load paired ratios (``ratios``) under the
issue's 0.9 target. The raw baseline is sequential (one thread) while ``Posix`` runs ``posix_io_threads`` files at
once, so a ratio above 1 (typically cold loads, where the disk serves several requests at once) is the store's
parallelism.

Page cache: ``--page-cache auto`` (default) writes ``3`` to ``/proc/sys/vm/drop_caches`` after a sync (needs root;
drops the whole machine's page cache) and, if that is refused or does not empty a probe file's pages (checked with
``mincore``), falls back to ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file of the benchmark directory after a
``syncfs``. ``--page-cache drop_caches|fadvise_dontneed`` forces one method; the JSON says which was used and
whether the probe confirmed it. Before every write phase the file system is synced, so earlier dirty pages do not
slow it.

Phase order: in every repeat all write phases (``raw write_files``, ``raw write_bigfile``, then each store's
``dump``) run before all read phases (``raw read_files``, ``raw read_bigfile``, then each store's ``load`` and
``load_layerwise_cold``; a read phase is its cold read followed by its warm read of the same files), and each of the
two lists is rotated left by the repeat index, so that over as many repeats as there are phases every phase runs
once in every position; ``phase_orders`` in the JSON gives the order of every repeat. Why: on the development VMs
16 MiB writes into the page cache ran at one of two speeds, several times apart, for the same code, the first write
phase of a repeat mostly fast and the last mostly slow (figures in benchmarks/RESULTS.md, "Store bandwidth"); with a
fixed order, a phase's position decided its figure. The rotation gives every phase every position (``--repeats`` a
multiple of the number of write phases, ``2 + stores``, completes it), and a paired ratio compares a store with the
raw I/O of the same repeat.

Every figure is the median over ``--repeats`` repeats (the samples are in the JSON too). Human-readable lines come
first; the LAST line printed is one JSON object with every figure and ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    PAGE_CACHE_METHODS,
    emit_summary,
    evict_page_cache,
    libc,
    load_avg,
    machine_info,
    sync_fs,
    utc_now,
)
from ucm.config import UcmConfigError, config_from_extra_config  # noqa: E402
from ucm.store.base import UcmKVStoreBase  # noqa: E402
from ucm.store.pipeline import build_store  # noqa: E402

GB = 1e9
MIB = 1 << 20
PAGE = mmap.PAGESIZE
# Llama-8B at block_size 128, bf16: layers, K/V, tokens, KV heads, head_dim, bytes per element.
LLAMA8B_BLOCK = 32 * 2 * 128 * 8 * 128 * 2  # 16 MiB
LAYER_SHARD = LLAMA8B_BLOCK // 32  # 512 KiB
BLOCKS = {"llama8b_block_16MiB": LLAMA8B_BLOCK, "layer_shard_512KiB": LAYER_SHARD}
STORES = ("Posix", "Cache|Posix")
PROBE_NBYTES = 32 * MIB
T = TypeVar("T")


# ------------------------------------------------------------------------------------------ file system helpers
def resident_fraction(path: Path) -> float | None:
    """Fraction of ``path``'s pages in the page cache (``mincore``); ``None`` if it cannot be asked."""
    size = path.stat().st_size
    if size == 0:
        return 0.0
    fd = os.open(path, os.O_RDONLY)
    try:
        c = libc()
        addr = c.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = ctypes.create_string_buffer(pages)
            if c.mincore(addr, size, vec) != 0:
                return None
            return sum(b & 1 for b in vec.raw) / pages
        finally:
            c.munmap(addr, size)
    except (OSError, AttributeError):
        return None
    finally:
        os.close(fd)


def filesystem(path: Path) -> dict[str, str]:
    """The mount holding ``path`` from ``/proc/mounts`` (longest matching mount point), with its type."""
    real = os.path.realpath(path)
    best = ("", "", "?", "")
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype, opts = line.split()[:4]
            mnt = mnt.replace("\\040", " ")
            inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best[1]):
                best = (dev, mnt, fstype, opts)
    return {"type": best[2], "mount_point": best[1], "device": best[0], "options": best[3]}


class PageCache:
    """Empties the page cache of the benchmark's files by the method chosen at start (see the module docstring)."""

    def __init__(self, root: Path, wanted: str) -> None:
        self.root = root
        self.method = "none"
        self.verified: bool | None = None
        self.notes: list[str] = []
        probe = root / "page_cache_probe.bin"
        write_file(probe, memoryview(os.urandom(PROBE_NBYTES)))
        candidates = list(PAGE_CACHE_METHODS) if wanted == "auto" else [wanted]
        for method in candidates:
            sync_fs(root)
            read_file_discard(probe)  # make sure the probe is cached before checking that it is evicted
            before = resident_fraction(probe)
            try:
                evict_page_cache(method, self.root)
            except OSError as exc:
                self.notes.append(f"{method}: {exc}")
                continue
            after = resident_fraction(probe)
            self.notes.append(f"{method}: probe resident before {before}, after {after}")
            if after is None or before is None:  # mincore unavailable: trust the method, say it is unverified
                self.method, self.verified = method, None
                break
            if after <= 0.05:
                self.method, self.verified = method, True
                break
            self.notes.append(f"{method}: the probe file stayed in the page cache")
        probe.unlink()
        if self.method == "none":
            self.notes.append("no method emptied the page cache: cold figures are NOT cold")

    def evict(self) -> None:
        """Empty the page cache of every file under ``root`` (after writing dirty pages back)."""
        if self.method != "none":
            evict_page_cache(self.method, self.root)


# ------------------------------------------------------------------------------------------------- raw I/O
def write_all(fd: int, data: memoryview) -> None:
    off = 0
    while off < data.nbytes:
        off += os.write(fd, data[off:])


def read_into(fd: int, buf: memoryview) -> int:
    off = 0
    while off < buf.nbytes:
        n = os.readv(fd, [buf[off:]])
        if n == 0:
            break
        off += n
    return off


def write_file(path: Path, data: memoryview, direct: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


def read_file_discard(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(16 * MIB):
            pass


def direct_refusal(root: Path) -> str | None:
    """Why ``O_DIRECT`` writes and reads of one page-aligned block fail under ``root``, or ``None`` when they work."""
    path = root / "o_direct_probe.bin"
    buf = mmap.mmap(-1, LAYER_SHARD)  # page-aligned
    try:
        write_file(path, memoryview(buf), direct=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            read_into(fd, memoryview(buf))
        finally:
            os.close(fd)
    except (OSError, AttributeError) as exc:  # EINVAL where the file system refuses; no O_DIRECT off Linux
        return f"{type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        buf.close()
    return None


def raw_write_files(root: Path, rows: Sequence[memoryview], direct: bool) -> None:
    root.mkdir(exist_ok=True)
    for i, row in enumerate(rows):
        write_file(root / f"{i:07d}.blk", row, direct)


def raw_write_bigfile(path: Path, rows: Sequence[memoryview], direct: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        for row in rows:
            write_all(fd, row)
    finally:
        os.close(fd)


def raw_read_files(root: Path, rows: Sequence[memoryview], direct: bool) -> None:
    for i, row in enumerate(rows):
        fd = os.open(root / f"{i:07d}.blk", os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            if read_into(fd, row) != row.nbytes:
                raise OSError(f"short read of {root / f'{i:07d}.blk'}")
        finally:
            os.close(fd)


def raw_read_bigfile(path: Path, rows: Sequence[memoryview], direct: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        for row in rows:
            if read_into(fd, row) != row.nbytes:
                raise OSError(f"short read of {path}")
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------- stores
def store_config_extra(args: argparse.Namespace, pipeline: str, directory: Path) -> dict[str, Any]:
    """kv_connector_extra_config for ``pipeline`` over ``directory`` with the I/O options of the command line."""
    store: dict[str, Any] = {
        "store_pipeline": pipeline,
        "storage_backends": str(directory),
        "posix_io_engine": args.io_engine,
        "io_direct": args.io_direct,
    }
    if args.io_threads is not None:
        store["posix_io_threads"] = args.io_threads
    if args.cache_gb is not None and "Cache" in pipeline:
        store["cache_buffer_capacity_gb"] = args.cache_gb
    return {"ucm_connectors": [{"ucm_connector_name": "UcmPipelineStore", "ucm_connector_config": store}]}


def open_store(args: argparse.Namespace, pipeline: str, directory: Path) -> UcmKVStoreBase:
    """Build ``pipeline`` the way the connector does. Raises UcmConfigError / ValueError when refused."""
    return build_store(config_from_extra_config(store_config_extra(args, pipeline, directory)).store)


def cache_capacity(args: argparse.Namespace, pipeline: str) -> int | None:
    """DRAM capacity in bytes of ``pipeline``'s Cache stage, ``None`` without one."""
    if "Cache" not in pipeline.split("|"):
        return None
    config = config_from_extra_config(store_config_extra(args, pipeline, Path("unused")))
    return config.store.cache_buffer_capacity_bytes


def refusal(args: argparse.Namespace, pipeline: str, directory: Path) -> str | None:
    """Why the config or the store refuses ``pipeline`` with these options, or ``None`` when it builds."""
    try:
        open_store(args, pipeline, directory).close()
    except (UcmConfigError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def batches(n: int, per_batch: int) -> list[slice]:
    return [slice(i, min(n, i + per_batch)) for i in range(0, n, per_batch)]


def run_tasks(
    store: UcmKVStoreBase, op: str, keys: list[bytes], buf: torch.Tensor, parts: list[slice]
) -> tuple[float, float, int]:
    """``store.dump`` or ``store.load`` (``op``) of ``keys`` / rows of ``buf``, one call per batch of ``parts``, all
    started, then all waited for. Returns (seconds until the last call returned, seconds until every task was done,
    failed keys)."""
    t0 = time.perf_counter()
    if op == "dump":
        tasks = [store.dump(keys[s], buf[s]) for s in parts]
    elif op == "load":
        tasks = [store.load(keys[s], buf[s]) for s in parts]
    else:  # load_sharded: one shard per layer, as a layerwise load reads
        tasks = [store.load_sharded(keys[s], buf[s], buf.shape[1] // LAYER_SHARD) for s in parts]
    t_started = time.perf_counter() - t0
    failed = sum(len(store.wait(t).failed) for t in tasks)
    return t_started, time.perf_counter() - t0, failed


# ------------------------------------------------------------------------------------------------ benchmark
def timed(fn: Callable[..., object], *args: Any) -> float:
    """Wall seconds of ``fn(*args)``."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def rotated(phases: Sequence[T], rep: int) -> list[T]:
    """``phases`` rotated left by ``rep``: over ``len(phases)`` repeats, every phase runs once in every position."""
    k = rep % len(phases) if phases else 0
    return [*phases[k:], *phases[:k]]


def sig3(x: float) -> float:
    """``x`` rounded to 3 significant digits (a ratio of 0.0316 keeps its third digit, unlike ``round(x, 3)``)."""
    return float(f"{x:.3g}")


class Samples:
    """Per-figure samples (seconds) over the repeats of one block size."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds.setdefault(name, []).append(seconds)

    def gbps(self, nbytes: int) -> dict[str, float]:
        return {name: sig3(nbytes / statistics.median(s) / GB) for name, s in self.seconds.items()}

    def samples_gbps(self, nbytes: int) -> dict[str, list[float]]:
        return {name: [sig3(nbytes / x / GB) for x in s] for name, s in self.seconds.items()}

    def last_gbps(self, nbytes: int) -> dict[str, float]:
        return {name: sig3(nbytes / s[-1] / GB) for name, s in self.seconds.items()}


class BlockBench:
    """The phases of one block size: ``n`` blocks of ``block_nbytes``, rows of page-aligned ``src`` / ``dst``."""

    def __init__(
        self,
        args: argparse.Namespace,
        label: str,
        block_nbytes: int,
        src_mm: mmap.mmap,
        dst_mm: mmap.mmap,
        work: Path,
        cache: PageCache,
        supported: list[str],
        raw_direct: bool,
    ) -> None:
        self.args, self.label, self.work, self.cache, self.supported = args, label, work, cache, supported
        self.raw_direct = raw_direct
        self.n = max(1, int(args.total_gb * GB) // block_nbytes)
        self.block_nbytes = block_nbytes
        self.nbytes = self.n * block_nbytes
        # [n, block_nbytes] uint8 views of the mmaps, and one memoryview per row for the raw I/O.
        self.src = torch.frombuffer(src_mm, dtype=torch.uint8, count=self.nbytes).view(self.n, block_nbytes)
        self.dst = torch.frombuffer(dst_mm, dtype=torch.uint8, count=self.nbytes).view(self.n, block_nbytes)
        src_view, dst_view = memoryview(src_mm), memoryview(dst_mm)
        self.src_rows = [src_view[i * block_nbytes : (i + 1) * block_nbytes] for i in range(self.n)]
        self.dst_rows = [dst_view[i * block_nbytes : (i + 1) * block_nbytes] for i in range(self.n)]
        self.per_batch = max(1, int(args.batch_mb * MIB) // block_nbytes)
        self.parts = batches(self.n, self.per_batch)
        self.raw = Samples()
        self.stores = {name: Samples() for name in supported}
        self.failed_keys = dict.fromkeys(supported, 0)
        self.problems: list[str] = []
        self.orders: list[dict[str, list[str]]] = []  # per repeat: the write phases and read phases, in run order

    def run(self) -> dict[str, Any]:
        print(
            f"\n== {self.label}: {self.n} blocks of {self.block_nbytes / MIB:g} MiB = {self.nbytes / GB:.3f} GB, "
            f"{len(self.parts)} calls of {self.per_batch} blocks"
        )
        for rep in range(self.args.repeats):
            root = self.work / f"{self.label}-r{rep}"
            root.mkdir()
            try:
                self.repeat(rep, root)
            finally:
                shutil.rmtree(root, ignore_errors=True)
        raw_gbps = self.raw.gbps(self.nbytes)
        stores: dict[str, Any] = {}
        for name in self.supported:
            figures = self.stores[name].gbps(self.nbytes)
            if self.failed_keys[name]:
                self.problems.append(f"{self.label} {name}: {self.failed_keys[name]} failed keys over all repeats")
            paired = paired_ratios(self.stores[name].seconds, self.raw.seconds)
            stores[name] = {
                "gbps": figures,
                "ratios": {key: sig3(statistics.median(rs)) for key, rs in paired.items()},
                "ratio_samples": {key: [sig3(r) for r in rs] for key, rs in paired.items()},
                "ratios_of_medians": ratios(figures, raw_gbps),
                "failed_keys": self.failed_keys[name],
                "samples_gbps": self.stores[name].samples_gbps(self.nbytes),
            }
            capacity = cache_capacity(self.args, name)
            if capacity is not None and self.nbytes > capacity:
                stores[name]["note"] = (
                    f"{self.nbytes} bytes do not fit the {capacity}-byte DRAM cache: load_dram_hit partly reads files"
                )
        return {
            "block_bytes": self.block_nbytes,
            "blocks": self.n,
            "bytes": self.nbytes,
            "blocks_per_call": self.per_batch,
            "raw_gbps": raw_gbps,
            "raw_samples_gbps": self.raw.samples_gbps(self.nbytes),
            "phase_orders": self.orders,
            "stores": stores,
        }

    def repeat(self, rep: int, root: Path) -> None:
        args, work, direct, raw = self.args, self.work, self.raw_direct, self.raw
        # New bytes every repeat, and every row different: the repeat and the row index in the first 16 bytes.
        self.src[:, :8] = torch.tensor(list(rep.to_bytes(8, "little")), dtype=torch.uint8)
        self.src[:, 8:16] = torch.arange(self.n, dtype=torch.int64).view(torch.uint8).view(self.n, 8)
        keys = [os.urandom(16) for _ in range(self.n)]
        files, bigfile = root / "raw_files", root / "raw_bigfile.bin"
        files.mkdir()

        # -- writes: the file system synced first, so that earlier dirty pages do not slow the phase
        def raw_write(figure: str, write: Callable[[], object]) -> None:
            sync_fs(work)
            t = timed(write)
            raw.add(figure, t)
            raw.add(f"{figure}_synced", t + timed(sync_fs, work))

        def store_dump(name: str) -> None:
            sync_fs(work)
            samples = self.stores[name]
            store = open_store(args, name, root / store_dirname(name))
            try:
                started, done, failed = run_tasks(store, "dump", keys, self.src, self.parts)
                samples.add("dump", done)
                samples.add("dump_synced", done + timed(sync_fs, work))
                if name.startswith("Cache"):
                    samples.add("dump_accept", started)
                    self.dst.zero_()
                    _, hit, hit_failed = run_tasks(store, "load", keys, self.dst, self.parts)
                    samples.add("load_dram_hit", hit)
                    failed += hit_failed
                    self.check(f"{name} load_dram_hit")
                self.failed_keys[name] += failed
            finally:
                store.close()

        writes: list[tuple[str, Callable[[], None]]] = [
            (
                "raw write_files",
                lambda: raw_write("write_files", lambda: raw_write_files(files, self.src_rows, direct)),
            ),
            (
                "raw write_bigfile",
                lambda: raw_write("write_bigfile", lambda: raw_write_bigfile(bigfile, self.src_rows, direct)),
            ),
        ]
        writes += [(f"{name} dump", lambda name=name: store_dump(name)) for name in self.supported]

        # -- reads: cold (page cache emptied), then warm (the files just read, still cached); a phase is the cold
        # read and its warm read of the same files, so the warm read always follows the cold one
        temps = ("cold", "warm") if args.warm else ("cold",)

        def raw_read(figure: str, read: Callable[[], object]) -> None:
            for temp in temps:
                self.before_read(temp)
                raw.add(f"{figure}_{temp}", timed(read))
                self.check(f"raw {figure}_{temp}")

        def store_load(name: str, op: str, figures: Sequence[str]) -> None:
            for figure in figures:
                self.before_read("cold" if figure.endswith("_cold") else "warm")
                store = open_store(args, name, root / store_dirname(name))  # fresh instance: its Cache stage is empty
                try:
                    _, done, failed = run_tasks(store, op, keys, self.dst, self.parts)
                finally:
                    store.close()
                self.stores[name].add(figure, done)
                self.failed_keys[name] += failed
                self.check(f"{name} {figure}")

        reads: list[tuple[str, Callable[[], None]]] = [
            ("raw read_files", lambda: raw_read("read_files", lambda: raw_read_files(files, self.dst_rows, direct))),
            (
                "raw read_bigfile",
                lambda: raw_read("read_bigfile", lambda: raw_read_bigfile(bigfile, self.dst_rows, direct)),
            ),
        ]
        for name in self.supported:
            reads.append((f"{name} load", lambda name=name: store_load(name, "load", [f"load_{t}" for t in temps])))
            if self.block_nbytes > LAYER_SHARD:
                reads.append(
                    (
                        f"{name} load_layerwise_cold",
                        lambda name=name: store_load(name, "load_sharded", ["load_layerwise_cold"]),
                    )
                )

        # Every write phase before every read phase (the reads read what the writes wrote), each group in an order
        # rotated by one every repeat, so that no phase always runs first (see "Phase order" in the docstring).
        order = {"write": rotated(writes, rep), "read": rotated(reads, rep)}
        self.orders.append({group: [what for what, _ in phases] for group, phases in order.items()})
        for phases in order.values():
            for _, phase in phases:
                phase()

        print(f"-- repeat {rep}, GB/s; write order: {', '.join(self.orders[-1]['write'])}")
        for what, samples in [("raw", raw), *self.stores.items()]:
            print(f"   {what:12} " + "  ".join(f"{k} {v}" for k, v in samples.last_gbps(self.nbytes).items()))

    def before_read(self, temp: str) -> None:
        """Outside the timed region: empty the page cache for a cold read; zero ``dst`` (also faulting its pages
        in, so no phase pays for that)."""
        if temp == "cold":
            self.cache.evict()
        self.dst.zero_()

    def check(self, what: str) -> None:
        if not torch.equal(self.dst, self.src):
            self.problems.append(f"{self.label} {what}: loaded bytes differ from the dumped bytes")


def store_dirname(pipeline: str) -> str:
    return "store_" + pipeline.replace("|", "_")


# Store figure -> the raw figures it is compared with.
RATIO_BASES = {
    "dump": ("write_files", "write_bigfile"),
    "dump_synced": ("write_files_synced", "write_bigfile_synced"),
    "load_cold": ("read_files_cold", "read_bigfile_cold"),
    "load_layerwise_cold": ("read_files_cold", "read_bigfile_cold"),
    "load_warm": ("read_files_warm", "read_bigfile_warm"),
}


def ratios(figures: dict[str, float], raw: dict[str, float]) -> dict[str, float]:
    """Store figure over raw figure, for every pair of ``RATIO_BASES`` (medians over medians: unpaired)."""
    out = {}
    for fig, bases in RATIO_BASES.items():
        for base in bases:
            if fig in figures and raw.get(base):
                out[f"{fig}/{base}"] = sig3(figures[fig] / raw[base])
    return out


def paired_ratios(store: dict[str, list[float]], raw: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per repeat, store GB/s over raw GB/s *of the same repeat* (= raw seconds / store seconds), for every pair of
    ``RATIO_BASES``; the i-th sample of a figure is the i-th repeat's."""
    out = {}
    for fig, bases in RATIO_BASES.items():
        for base in bases:
            if fig in store and base in raw and len(store[fig]) == len(raw[base]):
                out[f"{fig}/{base}"] = [r / s for s, r in zip(store[fig], raw[base], strict=True)]
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Dump/load GB/s of the UCM stores against raw file I/O.")
    p.add_argument("--total-gb", type=float, default=2.0, help="GB (1e9 bytes) moved per phase and block size")
    p.add_argument(
        "--repeats",
        type=int,
        default=4,
        help="repeats of every phase (median reported; 4 = a full rotation of the 4 write phases)",
    )
    p.add_argument("--dir", default=None, help="where to write (a temp dir inside it; default: inside the repo)")
    p.add_argument("--stores", nargs="+", default=list(STORES), help="store pipelines to measure")
    p.add_argument("--blocks", nargs="+", default=list(BLOCKS), choices=list(BLOCKS), help="block sizes")
    p.add_argument("--io-engine", default="psync", help="posix_io_engine of the store config: psync or aio")
    p.add_argument("--io-direct", action="store_true", help="io_direct: true in the store config; raw I/O O_DIRECT")
    p.add_argument("--io-threads", type=int, default=None, help="posix_io_threads (default: the config's)")
    p.add_argument("--cache-gb", type=float, default=None, help="cache_buffer_capacity_gb (default: the config's)")
    p.add_argument("--batch-mb", type=float, default=256, help="MiB of blocks per dump/load call (whole blocks)")
    p.add_argument("--page-cache", default="auto", choices=["auto", *PAGE_CACHE_METHODS])
    p.add_argument("--no-warm", dest="warm", action="store_false", help="skip the warm (page-cached) reads")
    p.add_argument("--out", default=None, help="also write the JSON summary to this file")
    args = p.parse_args(argv)
    if args.total_gb <= 0 or args.repeats < 1 or args.batch_mb <= 0:
        p.error("need --total-gb > 0, --repeats >= 1, --batch-mb > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_start = load_avg()
    base = Path(args.dir) if args.dir else REPO
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".store_bandwidth-", dir=base))
    problems: list[str] = []
    results: dict[str, Any] = {}
    try:
        fs = filesystem(work)
        cache = PageCache(work, args.page_cache)
        print(f"directory {work} on {fs['type']} ({fs['device']} at {fs['mount_point']})")
        print(f"page cache: {cache.method} (verified: {cache.verified}); {'; '.join(cache.notes)}")
        raw_io = "buffered"
        if args.io_direct:
            why = direct_refusal(work)
            raw_io = "O_DIRECT" if why is None else f"buffered (O_DIRECT refused by the file system: {why})"
        print(f"raw baseline I/O: {raw_io}")
        unsupported = {name: refusal(args, name, work / "config_check") for name in args.stores}
        shutil.rmtree(work / "config_check", ignore_errors=True)
        supported = [name for name, why in unsupported.items() if why is None]
        for name, why in unsupported.items():
            if why is not None:
                print(f"{name}: unsupported: {why}")
        # Page-aligned buffers (anonymous mmap), so O_DIRECT can use them; one pair serves every block size.
        nbytes = max(max(1, int(args.total_gb * GB) // BLOCKS[b]) * BLOCKS[b] for b in args.blocks)
        src_mm, dst_mm = mmap.mmap(-1, nbytes), mmap.mmap(-1, nbytes)
        src_flat = torch.frombuffer(src_mm, dtype=torch.uint8)
        chunk = torch.frombuffer(bytearray(os.urandom(min(nbytes, 16 * MIB))), dtype=torch.uint8)
        for off in range(0, nbytes, chunk.numel()):
            m = min(chunk.numel(), nbytes - off)
            src_flat[off : off + m] = chunk[:m]
        for label in args.blocks:
            bench = BlockBench(args, label, BLOCKS[label], src_mm, dst_mm, work, cache, supported, raw_io == "O_DIRECT")
            r = bench.run()
            problems.extend(bench.problems)
            for name, why in unsupported.items():
                if why is not None:
                    r["stores"][name] = {"unsupported": why}
            results[label] = r
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'block':22} {'store':12} {'figure':22} {'GB/s':>8}  paired ratios to raw (files, bigfile)")
    for label, r in results.items():
        for fig, v in r["raw_gbps"].items():
            print(f"{label:22} {'raw':12} {fig:22} {v:>8}")
        for name, s in r["stores"].items():
            if "unsupported" in s:
                print(f"{label:22} {name:12} unsupported: {s['unsupported']}")
                continue
            for fig, v in s["gbps"].items():
                rs = [str(s["ratios"][f"{fig}/{b}"]) for b in RATIO_BASES.get(fig, ()) if f"{fig}/{b}" in s["ratios"]]
                print(f"{label:22} {name:12} {fig:22} {v:>8}  {' '.join(rs)}")
    below = [
        f"{label} {name} {key}"
        for label, r in results.items()
        for name, s in r["stores"].items()
        if name == "Posix"
        for key, v in s.get("ratios", {}).items()
        if key.startswith(("dump/", "load_cold/")) and v < 0.9
    ]
    summary = {
        "benchmark": "store_bandwidth",
        "date": utc_now(),
        "unit": "GB/s, GB = 1e9 bytes of block payload",
        "dir": str(work),
        "filesystem": fs,
        "page_cache": {"method": cache.method, "verified": cache.verified, "notes": cache.notes},
        "raw_io": raw_io,
        "options": {
            "total_gb": args.total_gb,
            "repeats": args.repeats,
            "io_engine": args.io_engine,
            "io_direct": args.io_direct,
            "io_threads": args.io_threads,
            "cache_gb": args.cache_gb,
            "batch_mb": args.batch_mb,
            "warm": args.warm,
        },
        "ratio_method": "ratios: median over repeats of store GB/s / raw GB/s of the same repeat (paired); "
        "ratios_of_medians: median store GB/s / median raw GB/s",
        "results": results,
        "posix_below_0.9x_raw": below,
        "problems": problems,
        "machine": machine_info(load_avg_start=load_start),
    }
    return emit_summary(summary, args.out, failed=bool(problems))


if __name__ == "__main__":
    sys.exit(main())
