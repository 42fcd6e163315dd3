"""Codec ids of stored payloads, and the decoder from a stored payload to a canonical block.

A stage that holds encoded payloads (:class:`~ucm.store.base.EncodedStore`) keeps each payload's codec id (u16)
beside it. These are the ids UCM writes:

- ``CODEC_RAW`` (0): the payload is the canonical block's bytes, exactly what a plain ``dump`` stores;
- ``CODEC_KVFOLD`` (1): a KVfold container (:mod:`ucm.store.kvfold`: self-describing, any size), written by the
  ``Compress`` stage.

:func:`decode_into` turns a stored payload of either codec into the canonical block. The ``Compress`` stage decodes
what it loads with it, and so does the ``Posix`` stage when a plain load meets a KVfold file (a store filled by
``Cache|Compress|Posix`` read by ``Cache|Posix``), so both read every block the same way: lossless containers
bit-exact, fixed-rate (int8) containers to their lossy values. The KVfold codec pulls in numba and Triton kernels:
it is imported on the first KVfold payload, so a process that meets raw payloads only never loads it.
"""

from __future__ import annotations

import torch

from ucm.store.base import FOREIGN, BlockCorruptedError, EncodedBlock

CODEC_RAW = 0
CODEC_KVFOLD = 1


def max_encoded_nbytes(block_nbytes: int) -> int:
    """The most bytes a stored payload of a ``block_nbytes``-byte block may hold: a KVfold container is at most the
    raw size plus its headers (incompressible planes are stored raw), so twice the block plus 64 KiB bounds it with
    room to spare. A larger payload is not one of this block size's (foreign)."""
    return 2 * block_nbytes + (1 << 16)


def decode_into(block: EncodedBlock, row: torch.Tensor) -> tuple[str | None, str | None]:
    """Decode a verified stored ``block`` into ``row`` (contiguous CPU ``torch.uint8`` ``[block_nbytes]``) by its
    codec: a raw payload of the row's size is copied, a KVfold container decoded
    (:func:`ucm.store.kvfold.decode_block`).

    Returns:
        ``(reason, mode)``: ``reason`` is ``None`` when ``row`` holds the block, else why not: starting with
        :data:`~ucm.store.base.FOREIGN` for a codec, container version, mode, dtype or block size this version does
        not read (the stored block is to be kept), otherwise the container is damaged (it does not decode).
        ``mode`` is the container's (``"lossless"``, ``"int8"``) or ``"raw"`` when decoded, else ``None``. ``row`` is
        unspecified unless ``reason`` is ``None``. Never raises for a bad payload.
    """
    if block.codec == CODEC_RAW:
        if len(block.payload) != row.numel():
            return f"{FOREIGN}payload is {len(block.payload)} bytes, expected {row.numel()}", None
        row.numpy()[:] = memoryview(block.payload)
        return None, "raw"
    if block.codec != CODEC_KVFOLD:
        return f"{FOREIGN}codec {block.codec}, expected {CODEC_RAW} (raw) or {CODEC_KVFOLD} (KVfold)", None
    # Imported here: the codec pulls in its kernels (numba, triton), which a store of raw payloads never needs.
    from ucm.store.kvfold import decode_block, read_container_header

    try:
        head = read_container_header(block.payload)
        if not head.known:
            return (
                f"{FOREIGN}KVfold container version {head.version}, mode {head.mode_code}, dtype {head.dtype_code}: "
                "not one this version decodes",
                None,
            )
        if head.block_nbytes != row.numel():
            return f"{FOREIGN}KVfold container of a {head.block_nbytes}-byte block, expected {row.numel()}", None
        mode: str = decode_block(block.payload, row)
    except BlockCorruptedError as exc:
        return f"KVfold container does not decode: {exc}", None
    return None, mode
