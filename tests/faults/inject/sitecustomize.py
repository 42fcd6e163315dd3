"""Test-only I/O fault injection for engine subprocesses (put this directory on ``PYTHONPATH``).

Only for the faults that cannot be caused for real on this machine (EIO needs failing hardware or a device-mapper
``error`` target). ``UCM_TEST_FAULTS`` is a JSON object; each list names block keys (hex) whose files misbehave:

- ``"read_eio"``: reading a block file (``*.ucmb``) of one of these keys fails with ``EIO`` after it was opened
  (``os.open`` then ``os.pread``/``os.preadv``, as the Posix store reads);
- ``"write_eio"``: writing the temp file of one of these keys fails with ``EIO``.

And ``"publish_delay_s"`` (a number): every rename of a temp file onto a block file (``os.replace`` to ``*.ucmb``,
how the Posix store publishes a block) first sleeps that long: a slow shared filesystem, where a block becomes
visible to other instances well after its data was handed to the store.

Without ``UCM_TEST_FAULTS`` nothing is patched.
"""

from __future__ import annotations

import errno
import json
import os
import time

_SPEC = os.environ.get("UCM_TEST_FAULTS")


def _matches(path: object, keys: list[str]) -> bool:
    name = os.path.basename(os.fsdecode(path)) if isinstance(path, (str, bytes, os.PathLike)) else ""
    return any(k in name for k in keys)


_eio_fds: set[int] = set()  # descriptors of open block files whose reads fail


def _eio(*args, **kwargs):
    raise OSError(errno.EIO, os.strerror(errno.EIO))


if _SPEC:
    _faults = json.loads(_SPEC)
    _read_eio = list(_faults.get("read_eio", []))
    _write_eio = list(_faults.get("write_eio", []))
    _real_os_open = os.open
    _real_os_write = os.write
    _real_preadv = os.preadv
    _real_pread = os.pread
    _bad_fds: set[int] = set()

    def _os_open(path, flags, *args, **kwargs):
        fd = _real_os_open(path, flags, *args, **kwargs)
        _bad_fds.discard(fd)
        _eio_fds.discard(fd)
        if flags & (os.O_WRONLY | os.O_RDWR):
            if _write_eio and _matches(path, _write_eio):
                _bad_fds.add(fd)
        elif _read_eio and os.fsdecode(path).endswith(".ucmb") and _matches(path, _read_eio):
            _eio_fds.add(fd)
        return fd

    def _os_write(fd, data):
        if fd in _bad_fds:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return _real_os_write(fd, data)

    def _os_preadv(fd, *args, **kwargs):
        return _eio() if fd in _eio_fds else _real_preadv(fd, *args, **kwargs)

    def _os_pread(fd, *args, **kwargs):
        return _eio() if fd in _eio_fds else _real_pread(fd, *args, **kwargs)

    _publish_delay_s = float(_faults.get("publish_delay_s", 0))
    _real_replace = os.replace

    def _os_replace(src, dst, *args, **kwargs):
        if _publish_delay_s and os.fsdecode(dst).endswith(".ucmb"):
            time.sleep(_publish_delay_s)
        return _real_replace(src, dst, *args, **kwargs)

    os.replace = _os_replace
    os.open = _os_open
    os.write = _os_write
    os.preadv = _os_preadv
    os.pread = _os_pread
