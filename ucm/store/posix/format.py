"""The Posix store's block files: where a key's file lives, its header, and the checks a read makes.

Placement: a key goes to directory ``dirs[int.from_bytes(key[:8], "little") % len(dirs)]`` and, inside it, to
``<hex[0:2]>/<hex[2:4]>/<hex>.ucmb`` where ``hex = key.hex()``. Shard directories are created on demand. The
mapping depends only on the key and on the ordered directory list, so every process configured with the same
``storage_backends`` finds the same files.

File format (version 1), all integers little-endian, ``HEADER_NBYTES`` = 44 bytes of header then the payload:

======  =====  =============================================================
offset  size   field
======  =====  =============================================================
0       4      magic ``b"UCMB"``
4       2      format version (u16, ``FORMAT_VERSION`` = 1)
6       2      codec (u16, :mod:`ucm.store.codecs`): ``CODEC_RAW`` = 0: the payload is the block's bytes;
               ``CODEC_KVFOLD`` = 1: a KVfold container (``ucm.store.kvfold``) written through ``dump_encoded``
8       4      namespace tag (u32): the first 4 bytes of the model namespace digest, 0 when not set (see
               ``set_namespace``); informational (the key already separates namespaces), not checked on load
12      8      payload size in bytes (u64)
20      16     the block key
36      8      checksum of the payload: ``xxhash.xxh3_64_intdigest(payload)`` (u64)
44      n      payload
======  =====  =============================================================

A file is complete or absent: a write goes to a hidden temporary file (``.<hex>.<pid>.<thread id>.<random
hex>.tmp``, :func:`temp_file_path`) in the final shard directory, renamed over the final name (``os.replace``), so
``lookup`` never sees a half-written block. Files are not fsync'ed: a file torn by a power loss fails the size or
checksum check on load and is reported as a miss, never as data.

What else lives under a storage directory: temp files ``.*.tmp`` (a write in progress, or left by a killed writer),
``namespaces/<tag>.json`` (one per model namespace that wrote blocks there), anything else (never touched).

Validation (:func:`check_block`): magic, version, codec, payload size, key, exact file size (no trailing bytes) and
checksum. A failure reason starting with :data:`~ucm.store.base.FOREIGN` (another format version, codec or block
size: another UCM version sharing the directory, or a caller's size mismatch) means the file is to be kept; any
other reason means it is damaged. Only a regular file can be a block file (:func:`not_regular`): a FIFO, device,
socket or directory at a block path is a miss for ``lookup``, damage for a read (never opened in a way that can
block), and is replaced by the next write of that key. Files are created with mode ``FILE_MODE`` (``0o600``) and
shard directories with ``DIR_MODE`` (``0o700``).
"""

from __future__ import annotations

import os
import secrets
import stat
import struct
import threading
from collections.abc import Sequence

import xxhash

from ucm.store.base import FOREIGN
from ucm.store.codecs import CODEC_KVFOLD, CODEC_RAW

MAGIC = b"UCMB"
FORMAT_VERSION = 1
FILE_MODE = 0o600
DIR_MODE = 0o700
FILE_SUFFIX = ".ucmb"
TMP_SUFFIX = ".tmp"
NAMESPACE_DIR = "namespaces"
# Subdirectory of the first storage directory that holds the traces of enable_record_traces by default (not blocks).
TRACES_DIR = "traces"
# magic, version, codec, namespace tag, payload nbytes, key, checksum
HEADER = struct.Struct("<4sHHIQ16sQ")
HEADER_NBYTES = HEADER.size  # 44
# check_block's reason for a KVfold file (codec 1): a plain load reads it whole and decodes it. Foreign-prefixed so
# that a caller not handling it keeps the file.
KVFOLD_FILE = f"{FOREIGN}codec {CODEC_KVFOLD} (KVfold container)"


def dir_of(dirs: Sequence[str], key: bytes) -> str:
    """The directory of ``dirs`` (ordered) that holds ``key``'s block (16-byte key)."""
    return dirs[int.from_bytes(key[:8], "little") % len(dirs)]


def block_file_path(dirs: Sequence[str], key: bytes) -> str:
    """Path of ``key``'s block file (16-byte key) in a store over the ordered directories ``dirs`` (see the module
    docstring's placement rule), whether or not it exists."""
    h = key.hex()
    return os.path.join(dir_of(dirs, key), h[0:2], h[2:4], h + FILE_SUFFIX)


def key_of_path(path: str) -> bytes | None:
    """The 16-byte key of the block file at ``path`` (its name: the key in hex, then ``FILE_SUFFIX``), or ``None``
    when the name is not a block file's."""
    name = os.path.basename(path)
    if not name.endswith(FILE_SUFFIX) or len(name) != 32 + len(FILE_SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:32])
    except ValueError:
        return None


def not_regular(mode: int) -> str | None:
    """Why a file of ``mode`` (``st_mode`` from ``stat``/``fstat``) cannot be a block file, naming what it is (a FIFO,
    a device, a socket, a directory), or ``None`` for a regular file. A block file is always a regular file: anything
    else at a block path is damage (a FIFO or a stalled device would block a reader for as long as nobody writes
    to it)."""
    if stat.S_ISREG(mode):
        return None
    for test, what in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return f"not a regular file: {what}"
    return f"not a regular file: mode {stat.S_IFMT(mode):#o}"


def temp_file_path(path: str) -> str:
    """A new hidden temp file name beside the block file ``path``, unique to this process, thread and call."""
    shard, name = os.path.split(path)
    return os.path.join(
        shard,
        f".{name[: -len(FILE_SUFFIX)]}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}{TMP_SUFFIX}",
    )


def namespace_tag(digest: bytes) -> int:
    """The u32 namespace tag of a namespace ``digest`` (its first 4 bytes, little-endian; 0 is bumped to 1 so that
    0 keeps meaning "not set").

    Raises:
        ValueError: ``digest`` is shorter than 4 bytes.
    """
    if len(digest) < 4:
        raise ValueError(f"namespace digest must have at least 4 bytes, got {len(digest)}")
    return int.from_bytes(digest[:4], "little") or 1


def pack_header(codec: int, ns_tag: int, key: bytes, payload: memoryview) -> bytes:
    """The ``HEADER_NBYTES``-byte header of a block file holding ``payload`` (``B``-format memoryview) for ``key``
    (16 bytes), with ``codec`` (u16) and namespace tag ``ns_tag`` (u32)."""
    return HEADER.pack(MAGIC, FORMAT_VERSION, codec, ns_tag, payload.nbytes, key, xxhash.xxh3_64_intdigest(payload))


def check_block(
    key: bytes, payload: memoryview, size: int, got: int, header: memoryview, aligned: memoryview | None = None
) -> str | None:
    """Check a raw block file read by either engine; return ``None`` when valid, else the reason.

    The reader read ``got`` bytes of a ``size``-byte file: header and payload (into ``payload``, a ``B``-format
    memoryview of the expected payload size, or into ``aligned`` at offset ``HEADER_NBYTES`` for ``O_DIRECT``
    reads: copied to ``payload`` once the header checks pass) when ``size`` is the expected one, else the header
    only. Fewer bytes than that means the file shrank. A reason starting with ``FOREIGN`` (another version, codec or
    block size) means the file is to be kept; :data:`KVFOLD_FILE` (which starts so too) means a KVfold file, to be
    read whole and decoded.
    """
    expected = HEADER_NBYTES + payload.nbytes
    want = expected if size == expected else HEADER_NBYTES
    if got < want:
        if want == expected:
            return f"file shrank while read: {got} of {expected} bytes"
        return f"file is {got} bytes, shorter than the {HEADER_NBYTES}-byte header"
    magic, version, codec, _ns_tag, nbytes, file_key, checksum = HEADER.unpack(header)
    if magic != MAGIC:
        return f"bad magic {bytes(magic)!r}, expected {MAGIC!r}"
    if version != FORMAT_VERSION:
        return f"{FOREIGN}format version {version}, expected {FORMAT_VERSION}"
    if codec == CODEC_KVFOLD:  # the caller reads it whole and decodes it
        return KVFOLD_FILE
    if codec != CODEC_RAW:
        return f"{FOREIGN}codec {codec}, expected {CODEC_RAW} (raw) or {CODEC_KVFOLD} (KVfold)"
    if nbytes != payload.nbytes:  # a caller's size mismatch must not destroy a block: keep the file
        return f"{FOREIGN}payload is {nbytes} bytes, expected {payload.nbytes}"
    if file_key != key:
        return f"file holds key {file_key.hex()}, expected {key.hex()}"
    if size != expected:
        return f"file is {size} bytes, expected {expected}"
    if aligned is not None:
        payload[:] = aligned[HEADER_NBYTES:expected]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        return "checksum mismatch"
    return None


def check_encoded(buf: memoryview, size: int, got: int, key: bytes) -> str | None:
    """Check a whole block file of any codec and payload size, read into ``buf`` (``got`` of its ``size`` bytes,
    header first); return ``None`` when valid (the payload is ``buf[HEADER_NBYTES:size]``), else the reason
    (starting with ``FOREIGN`` for another format version: the file is to be kept)."""
    if got < size:
        return f"file shrank while read: {got} of {size} bytes"
    magic, version, _codec, _ns_tag, nbytes, file_key, checksum = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        return f"bad magic {bytes(magic)!r}, expected {MAGIC!r}"
    if version != FORMAT_VERSION:
        return f"{FOREIGN}format version {version}, expected {FORMAT_VERSION}"
    if file_key != key:
        return f"file holds key {file_key.hex()}, expected {key.hex()}"
    if nbytes != size - HEADER_NBYTES:
        return f"file is {size} bytes, expected {HEADER_NBYTES + nbytes}"
    if xxhash.xxh3_64_intdigest(buf[HEADER_NBYTES:size]) != checksum:
        return "checksum mismatch"
    return None
