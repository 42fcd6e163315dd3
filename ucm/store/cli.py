"""Operator CLI for a Posix store: ``python -m ucm.store {stats,verify,gc,clear}``.

The store is named by ``--storage-backends DIR[:DIR...]`` or by ``--config ucm_config.yaml`` (its
``storage_backends``; relative paths are taken relative to the working directory, as UCM itself does). Every
command walks the directories recursively and sorts what it finds by name (see :mod:`ucm.store.posix.format`):

- block files: ``*.ucmb`` not starting with ``.``;
- temp files: ``.*.tmp``, a dump in progress or left behind by a killed writer; a temp file is *stale* when its
  mtime is older than ``--tmp-age-s`` (default 3600 s); only stale temps are ever removed;
- anything else is counted by ``stats`` and never touched.

Commands:

- ``stats``: block files, their bytes, temp files, blocks grouped by model namespace (the tag in each block's header,
  described by ``namespaces/<tag>.json``: model, KV dtype, block_size, layers, heads...; ``unknown`` for blocks
  written without a namespace) and by payload size (file size minus the 44-byte header).
- ``verify``: reads every block file and validates it as ``load`` does (header, key = the file name, exact size,
  xxh3 checksum). Damaged files are listed; ``--remove`` deletes them. Files of another format version, codec or
  block size are reported as *foreign* and kept (another UCM version may share the directory). Exit status 1 if
  a file is damaged or unreadable. Anything at a block path that is not a regular file (a FIFO, device, socket or
  directory: what a stalled mount or a stray ``mkfifo`` leaves) is damaged, found without opening it; ``--remove``
  deletes it (a directory only when empty).
- ``gc --target-gb X``: deletes the least recently used block files until the block files total at most X GiB
  (2**30 bytes, counted as file sizes), and removes stale temps.
- ``clear --yes [--namespace TAG]``: deletes every block file, everything else at a block path (a FIFO, device,
  socket, empty directory) and every stale temp; with ``--namespace``, only the block files of that namespace (8 hex
  digits, as ``stats`` prints it).

Last use of a block is ``max(atime, mtime)`` (see :mod:`ucm.store.posix.scan`): the store sets a block file's atime
when it serves the block. ``verify`` opens files with ``O_NOATIME`` (or restores the atime afterwards) so that a
verify pass does not make every block look recently used.

Safe to run while vLLM uses the store: a block deleted under a reader is a miss for later loads, never wrong data;
shard directories are never removed (a writer may be about to create its temp file there). Exit status: 0 done,
1 damaged files found or a deletion failed, 2 bad arguments, a missing directory or an invalid config.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from tqdm import tqdm

from ucm.config import GIB, UcmConfigError, load_config_file
from ucm.store.base import FOREIGN, KEY_NBYTES
from ucm.store.codecs import CODEC_KVFOLD, CODEC_RAW
from ucm.store.posix.files import remove_if_unchanged
from ucm.store.posix.format import (
    FILE_SUFFIX,
    FORMAT_VERSION,
    HEADER,
    HEADER_NBYTES,
    MAGIC,
    NAMESPACE_DIR,
    not_regular,
)
from ucm.store.posix.psync import read_encoded, read_validated
from ucm.store.posix.scan import (
    DEFAULT_TMP_AGE_S,
    Deletion,
    FileInfo,
    StoreScan,
    delete_files,
    gc_plan,
    read_namespace_tag,
    scan_store,
)
from ucm.store.posix.scan import open_noatime as _open_noatime

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class StoreLocationError(ValueError):
    """The store's directories cannot be determined or one is missing / not a directory (exit status 2)."""


@dataclass(frozen=True)
class Finding:
    """A block file that failed verification. ``kind``: ``damaged``, ``foreign`` (kept) or ``unreadable``."""

    path: str
    kind: str
    reason: str
    removed: bool = False


def _progress(items: Sequence[Any], desc: str, unit: str = "file") -> Iterator[Any]:
    """Iterate ``items`` with a tqdm bar on stderr, shown only when stderr is a terminal."""
    yield from tqdm(items, desc=desc, unit=unit, disable=not sys.stderr.isatty(), leave=False)


def _delete(files: Sequence[FileInfo], desc: str) -> Deletion:
    return delete_files(files, lambda items: _progress(items, desc))


def resolve_dirs(storage_backends: str | None, config: str | None) -> list[str]:
    """The store's directories (absolute paths, in placement order) from ``--storage-backends`` or ``--config``.

    Raises:
        StoreLocationError: neither or both are given, the config is invalid, or a directory is missing or is not
            a directory (the message names it).
    """
    if (storage_backends is None) == (config is None):
        raise StoreLocationError(
            "name the store with exactly one of --storage-backends DIR[:DIR...] or --config ucm_config.yaml"
        )
    if config is not None:
        try:
            storage_backends = load_config_file(config).store.storage_backends
        except UcmConfigError as err:
            raise StoreLocationError(str(err)) from None
    assert storage_backends is not None
    parts = storage_backends.split(":")
    if any(not p.strip() for p in parts):
        raise StoreLocationError(
            f"storage_backends {storage_backends!r} has an empty entry; give one path or several joined by ':'"
        )
    dirs = [os.path.abspath(p) for p in parts]
    for d in dirs:
        if not os.path.exists(d):
            raise StoreLocationError(f"storage directory {d!r} does not exist")
        if not os.path.isdir(d):
            raise StoreLocationError(f"storage path {d!r} exists but is not a directory")
    return dirs


def namespace_infos(dirs: Sequence[str]) -> dict[int, dict[str, Any]]:
    """The namespace descriptions found in ``<dir>/namespaces/*.json``, by tag (unreadable files are skipped)."""
    infos: dict[int, dict[str, Any]] = {}
    for d in dirs:
        folder = os.path.join(d, NAMESPACE_DIR)
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(folder)):
                if not name.endswith(".json"):
                    continue
                try:
                    with open(os.path.join(folder, name)) as f:
                        info = json.load(f)
                    infos[int(name[: -len(".json")], 16)] = info
                except (OSError, ValueError):
                    continue
    return infos


def _tags(scan: StoreScan) -> list[int | None]:
    return [read_namespace_tag(f.path) for f in _progress(scan.blocks, "read headers")]


def store_stats(scan: StoreScan) -> dict[str, Any]:
    """Summary of a scan as a JSON-ready dict (sizes in bytes; groups largest first). Reads each block's header."""
    groups: dict[int, list[int]] = {}
    for f in scan.blocks:
        g = groups.setdefault(max(f.size - HEADER_NBYTES, 0), [0, 0])
        g[0] += 1
        g[1] += f.size
    by_size = [
        {"payload_nbytes": size, "block_files": n, "bytes": nbytes}
        for size, (n, nbytes) in sorted(groups.items(), key=lambda kv: (-kv[1][1], kv[0]))
    ]
    infos = namespace_infos(scan.dirs)
    by_tag: dict[int | None, list[int]] = {}
    for f, tag in zip(scan.blocks, _tags(scan), strict=True):
        g = by_tag.setdefault(tag, [0, 0])
        g[0] += 1
        g[1] += f.size
    by_namespace = [
        {
            "namespace": "unreadable" if tag is None else ("unknown" if tag == 0 else f"{tag:08x}"),
            "info": infos.get(tag) if tag else None,
            "block_files": n,
            "bytes": nbytes,
        }
        for tag, (n, nbytes) in sorted(by_tag.items(), key=lambda kv: (-kv[1][1], kv[0] or 0))
    ]
    return {
        "dirs": scan.dirs,
        "block_files": len(scan.blocks),
        "block_bytes": scan.block_bytes,
        "tmp_files": len(scan.temps),
        "tmp_bytes": sum(f.size for f in scan.temps),
        "other_files": len(scan.others),
        "irregular_files": len(scan.irregular),
        "by_namespace": by_namespace,
        "by_payload_size": by_size,
    }


def verify_file(path: str) -> tuple[str | None, os.stat_result]:
    """Validate the block file at ``path``; return ``(reason, stat)``, ``reason`` None when the file is valid.

    The key is the file name's hex. A reason starting with ``"foreign: "`` means another format version, codec or
    block size (not damage). Something that is not a regular file (a FIFO, device, directory) is damaged and not
    read; the open never blocks on it (``O_NONBLOCK``). The file's atime is left as it was where the filesystem
    allows.

    Raises:
        OSError: the file cannot be opened or read (including FileNotFoundError when it vanished; ENXIO: a socket).
    """
    hexkey = os.path.basename(path)[: -len(FILE_SUFFIX)]
    fd = _open_noatime(path)
    with open(fd, "rb", buffering=0):  # closes fd
        st = os.fstat(fd)
        irregular = not_regular(st.st_mode)
        if irregular is not None:
            return irregular, st
        os.set_blocking(fd, True)
        try:
            key = bytes.fromhex(hexkey)
        except ValueError:
            key = b""
        if len(key) != KEY_NBYTES:
            return f"file name {os.path.basename(path)!r} is not a {KEY_NBYTES}-byte hex key", st
        head = os.pread(fd, HEADER_NBYTES, 0)
        payload_nbytes = 0
        reason: str | None
        if len(head) == HEADER_NBYTES and HEADER.unpack(head)[:3] == (MAGIC, FORMAT_VERSION, CODEC_KVFOLD):
            # A compressed (KVfold) block: variable size; checked whole (header, key, size, checksum).
            reason, _ = read_encoded(fd, st.st_size, key, st.st_size, None)
        elif len(head) == HEADER_NBYTES:
            magic, version, codec, _reserved, nbytes, _key, _checksum = HEADER.unpack(head)
            if (magic, version, codec) == (MAGIC, FORMAT_VERSION, CODEC_RAW):
                if nbytes > st.st_size - HEADER_NBYTES:
                    # Truncated (or a size flipped in the header): do not allocate what the header claims.
                    return f"file is {st.st_size} bytes, expected {HEADER_NBYTES + nbytes}", st
                payload_nbytes = nbytes
            # Other headers get an empty buffer: read_validated rejects them (bad magic, foreign) before the size.
            reason = read_validated(fd, st.st_size, key, memoryview(bytearray(payload_nbytes)))
        else:
            reason = read_validated(fd, st.st_size, key, memoryview(bytearray(0)))
        after = os.fstat(fd)
        if after.st_atime_ns != st.st_atime_ns:  # O_NOATIME was refused: put the atime back (best effort)
            with contextlib.suppress(OSError):
                os.utime(fd, ns=(st.st_atime_ns, after.st_mtime_ns))
    return reason, st


def verify_store(scan: StoreScan, remove: bool) -> list[Finding]:
    """Validate every block file of ``scan``; return the files that are not valid, in scan order.

    The not regular files at block paths (:attr:`StoreScan.irregular`: FIFOs, devices, sockets, directories) are
    damaged, found from ``lstat`` without opening them. With ``remove``, damaged files are deleted (if unchanged
    since they were read; a directory only when empty); foreign and unreadable files are kept. A file that vanished
    since the scan is skipped.
    """
    findings: list[Finding] = []
    for info in _progress([*scan.blocks, *scan.irregular], "verify"):
        try:
            st = os.lstat(info.path)
            reason = not_regular(st.st_mode)
            if reason is None:
                reason, st = verify_file(info.path)
        except FileNotFoundError:
            continue
        except OSError as err:
            findings.append(Finding(info.path, "unreadable", f"cannot read: {err.strerror or err}"))
            continue
        if reason is None:
            continue
        if reason.startswith(FOREIGN):
            findings.append(Finding(info.path, "foreign", reason.removeprefix(FOREIGN)))
            continue
        removed = remove and remove_if_unchanged(info.path, st)
        findings.append(Finding(info.path, "damaged", reason, removed))
    return findings


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units, e.g. ``'42.2 MiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _print_deletion(what: str, d: Deletion, out: TextIO) -> None:
    print(f"{what}: removed {d.files} files, freed {format_bytes(d.bytes)} ({d.bytes} bytes)", file=out)
    for path, err in d.errors:
        print(f"  cannot remove {path}: {err}", file=out)


def _cmd_stats(args: argparse.Namespace, scan: StoreScan, out: TextIO) -> int:
    stats = store_stats(scan)
    if args.json:
        print(json.dumps(stats, indent=2), file=out)
        return EXIT_OK
    print(f"dirs: {', '.join(scan.dirs)}", file=out)
    print(f"block files: {stats['block_files']}, {format_bytes(stats['block_bytes'])}", file=out)
    print(f"temp files: {stats['tmp_files']}, {format_bytes(stats['tmp_bytes'])}", file=out)
    print(f"other files: {stats['other_files']} (not UCM's; never touched)", file=out)
    if stats["irregular_files"]:
        print(
            f"not regular files at block paths: {stats['irregular_files']} (damaged; verify --remove deletes them)",
            file=out,
        )
    if stats["by_namespace"]:
        print("by model namespace:", file=out)
        for g in stats["by_namespace"]:
            info = g["info"] or {}
            what = ", ".join(f"{k}={info[k]}" for k in ("model", "kv_dtype", "block_size", "tp_size") if k in info)
            print(
                f"  {g['namespace']:>10}: {g['block_files']:>8} files, {format_bytes(g['bytes'])}"
                + (f"  ({what})" if what else ""),
                file=out,
            )
    if stats["by_payload_size"]:
        print("by payload size (one size per model/config):", file=out)
        for g in stats["by_payload_size"]:
            print(
                f"  {g['payload_nbytes']:>12} B payload: {g['block_files']:>8} files, {format_bytes(g['bytes'])}",
                file=out,
            )
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace, scan: StoreScan, out: TextIO) -> int:
    findings = verify_store(scan, remove=args.remove)
    for f in findings:
        note = " (removed)" if f.removed else (" (kept)" if f.kind == "foreign" or args.remove else "")
        print(f"{f.kind}: {f.path}: {f.reason}{note}", file=out)
    counts = {k: sum(1 for f in findings if f.kind == k) for k in ("damaged", "foreign", "unreadable")}
    removed = sum(1 for f in findings if f.removed)
    print(
        f"verified {len(scan.blocks) + len(scan.irregular)} block files: {counts['damaged']} damaged"
        + (f" ({removed} removed)" if args.remove else "")
        + f", {counts['foreign']} foreign (kept), {counts['unreadable']} unreadable",
        file=out,
    )
    return EXIT_FAILED if counts["damaged"] or counts["unreadable"] else EXIT_OK


def _cmd_gc(args: argparse.Namespace, scan: StoreScan, out: TextIO) -> int:
    target = int(args.target_gb * GIB)
    temps = _delete(scan.stale_temps(args.tmp_age_s), "stale temps")
    blocks = _delete(gc_plan(scan, target), "gc")
    _print_deletion("stale temp files", temps, out)
    _print_deletion("least recently used block files", blocks, out)
    left = scan.block_bytes - blocks.bytes
    print(f"block files now total {format_bytes(left)} (target {format_bytes(target)})", file=out)
    return EXIT_FAILED if temps.errors or blocks.errors else EXIT_OK


def _cmd_clear(args: argparse.Namespace, scan: StoreScan, out: TextIO) -> int:
    if args.namespace is not None:
        chosen = [f for f, tag in zip(scan.blocks, _tags(scan), strict=True) if tag == args.namespace]
        blocks = _delete(chosen, "clear")
        _print_deletion(f"block files of namespace {args.namespace:08x}", blocks, out)
        return EXIT_FAILED if blocks.errors else EXIT_OK
    temps = _delete(scan.stale_temps(args.tmp_age_s), "stale temps")
    blocks = _delete(scan.blocks, "clear")
    irregular = _delete(scan.irregular, "clear")
    _print_deletion("stale temp files", temps, out)
    _print_deletion("block files", blocks, out)
    if scan.irregular:
        _print_deletion("not regular files at block paths", irregular, out)
    return EXIT_FAILED if temps.errors or blocks.errors or irregular.errors else EXIT_OK


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _namespace_tag(text: str) -> int:
    try:
        if len(text) == 8:
            return int(text, 16)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected 8 hex digits as printed by stats, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m ucm.store``."""
    parser = argparse.ArgumentParser(
        prog="python -m ucm.store",
        description="Inspect, verify and trim a UCM Posix store (block files <dir>/xx/yy/<key>.ucmb). "
        "Every command takes --storage-backends DIR[:DIR...] or --config ucm_config.yaml.",
        epilog="Exit status: 0 ok; 1 damaged files found or a deletion failed; 2 bad arguments or missing directory.",
    )
    # The location options belong to every command, after its name: `python -m ucm.store stats --config x.yaml`.
    common = argparse.ArgumentParser(add_help=False)
    where = common.add_argument_group("store location (exactly one)")
    where.add_argument("--storage-backends", metavar="DIR[:DIR...]", help="the store's directories, as in the config")
    where.add_argument("--config", metavar="YAML", help="UCM config file; its storage_backends are used")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "stats",
        parents=[common],
        help="count block files, bytes, temp files; group blocks by model namespace and payload size",
    )
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")

    p = sub.add_parser(
        "verify", parents=[common], help="read and validate every block file (header, key, size, checksum)"
    )
    p.add_argument("--remove", action="store_true", help="delete damaged files (foreign-format files are kept)")

    tmp_help = f"temp files older than this many seconds (mtime) are stale and removed (default {DEFAULT_TMP_AGE_S:g})"
    p = sub.add_parser(
        "gc", parents=[common], help="delete least recently used block files down to a size; remove stale temps"
    )
    p.add_argument(
        "--target-gb", type=_non_negative_float, required=True, metavar="X", help="keep at most X GiB of block files"
    )
    p.add_argument("--tmp-age-s", type=_non_negative_float, default=DEFAULT_TMP_AGE_S, metavar="S", help=tmp_help)

    p = sub.add_parser(
        "clear",
        parents=[common],
        help="delete every block file and stale temp, or one namespace's blocks (needs --yes)",
    )
    p.add_argument("--yes", action="store_true", help="confirm: delete every block file in the store")
    p.add_argument(
        "--namespace",
        type=_namespace_tag,
        metavar="TAG",
        help="only the block files of this model namespace (8 hex digits, from stats)",
    )
    p.add_argument("--tmp-age-s", type=_non_negative_float, default=DEFAULT_TMP_AGE_S, metavar="S", help=tmp_help)
    return parser


_COMMANDS = {"stats": _cmd_stats, "verify": _cmd_verify, "gc": _cmd_gc, "clear": _cmd_clear}


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``), printing to ``out`` (default stdout).

    Returns the exit status (0 ok, 1 damaged files or failed deletions, 2 usage or location errors). Bad arguments
    make argparse print usage and raise ``SystemExit(2)``; location errors print ``error: ...`` on stderr.
    """
    out = sys.stdout if out is None else out
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "clear" and not args.yes:
        parser.error("clear deletes every block file in the store and asks nothing: add --yes to confirm")
    try:
        dirs = resolve_dirs(args.storage_backends, args.config)
        scan = scan_store(dirs)
    except (StoreLocationError, OSError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    return _COMMANDS[args.command](args, scan, out)
