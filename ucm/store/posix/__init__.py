"""``Posix`` store stage: one file per block under one or more directories (:class:`PosixStore`).

Modules:

- :mod:`~ucm.store.posix.store`: :class:`PosixStore`, the stage (contract verbs, encoded payloads, namespaces);
- :mod:`~ucm.store.posix.format`: placement, the block file format (header, codec, checksum) and its validation;
- :mod:`~ucm.store.posix.psync`, :mod:`~ucm.store.posix.uring`: the I/O engines (``posix_io_engine: psync`` and
  ``aio``), with :mod:`~ucm.store.posix.direct` (aligned buffers for ``io_direct``) and
  :mod:`~ucm.store.posix.sharded` (layerwise loads);
- :mod:`~ucm.store.posix.files`: what both engines do around a block's write and read, and the fault log;
- :mod:`~ucm.store.posix.scan`: listing and garbage collection, shared with the operator CLI (``python -m
  ucm.store``).
"""

from ucm.store.codecs import CODEC_KVFOLD, CODEC_RAW
from ucm.store.posix.files import remove_if_unchanged
from ucm.store.posix.format import (
    DIR_MODE,
    FILE_MODE,
    FILE_SUFFIX,
    FORMAT_VERSION,
    HEADER,
    HEADER_NBYTES,
    MAGIC,
    NAMESPACE_DIR,
    TMP_SUFFIX,
    block_file_path,
    namespace_tag,
)
from ucm.store.posix.psync import read_encoded, read_validated
from ucm.store.posix.scan import (
    DEFAULT_TMP_AGE_S,
    Deletion,
    FileInfo,
    GcResult,
    StoreScan,
    delete_files,
    gc_plan,
    scan_store,
)
from ucm.store.posix.store import PosixStore
from ucm.store.posix.uring import aio_unusable_reason

__all__ = [
    "CODEC_KVFOLD",
    "CODEC_RAW",
    "DEFAULT_TMP_AGE_S",
    "DIR_MODE",
    "FILE_MODE",
    "FILE_SUFFIX",
    "FORMAT_VERSION",
    "HEADER",
    "HEADER_NBYTES",
    "MAGIC",
    "NAMESPACE_DIR",
    "TMP_SUFFIX",
    "Deletion",
    "FileInfo",
    "GcResult",
    "PosixStore",
    "StoreScan",
    "aio_unusable_reason",
    "block_file_path",
    "delete_files",
    "gc_plan",
    "namespace_tag",
    "read_encoded",
    "read_validated",
    "remove_if_unchanged",
    "scan_store",
]
