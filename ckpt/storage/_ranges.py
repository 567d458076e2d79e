"""Byte ranges of one object, for formats whose tensors live at offsets inside a file
(safetensors). Kept beside the engines because it touches bytes: each engine has its own way to
read part of an object without reading the rest.

- ``local``: ``preadv`` on the file (one ``open`` per object, kept by ``RangeReader``);
- ``tensorstore``: ``KvStore.read(key, byte_range=...)``;
- ``fsspec``: ``fs.cat_file(path, start, end)``;
- anything else (a custom engine, a wrapper): the whole object is read once and cut, which is
  correct but reads more than the ranges (``RangeReader.whole_reads`` counts such objects).
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

import numpy as np

from ckpt._errors import CheckpointError
from ckpt.storage._base import Storage
from ckpt._memory import aligned_empty

# The largest object read whole by the fallback (a safetensors shard is a few GB at most).
WHOLE_READ_LIMIT = 1 << 40


class RangeReader:
    """Reads byte ranges of the objects below one location; thread-safe; counts bytes read.

    ``close()`` releases the open files of the local engine.
    """

    def __init__(self, storage: Storage):
        self.storage = storage
        self.bytes_read = 0
        self.reads = 0
        self.whole_reads = 0
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._whole: dict[str, bytes] = {}

    # ---- sizes ---------------------------------------------------------------------------

    def size(self, key: str) -> int | None:
        """The object's size in bytes; None where the engine cannot tell without reading it.
        FileNotFoundError when it does not exist."""
        engine = self.storage.engine
        where = self.storage.where(key)
        if engine == "local":
            return os.stat(where).st_size
        if engine == "fsspec":
            fs = self.storage.fs  # type: ignore[attr-defined]
            try:
                return int(fs.size(self.storage._full(key)))  # type: ignore[attr-defined]
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "no such object", where) from None
        if engine == "tensorstore" and hasattr(self.storage, "kv"):
            if not self.storage.exists(key):
                raise FileNotFoundError(errno.ENOENT, "no such object", where)
            return None
        return len(self._whole_object(key))

    # ---- reads ---------------------------------------------------------------------------

    def read(self, key: str, offset: int, nbytes: int, out: np.ndarray | None = None) -> np.ndarray:
        """`nbytes` bytes of object `key` from `offset`, into `out` (uint8, at least `nbytes`
        long) or a fresh 64-byte-aligned buffer. CheckpointError naming the object when it ends
        before ``offset + nbytes``."""
        buf = aligned_empty(nbytes) if out is None else out[:nbytes]
        if nbytes == 0:
            return buf
        engine = self.storage.engine
        if engine == "local":
            got = self._pread(key, offset, buf)
        elif engine == "tensorstore" and hasattr(self.storage, "kv"):
            got = self._copy(buf, self._tensorstore_range(key, offset, nbytes))
        elif engine == "fsspec" and hasattr(self.storage, "fs"):
            data = self.storage.fs.cat_file(self.storage._full(key), start=offset,  # type: ignore[attr-defined]
                                            end=offset + nbytes)
            got = self._copy(buf, data)
        else:
            whole = self._whole_object(key)
            got = self._copy(buf, whole[offset:offset + nbytes])
        with self._lock:
            self.bytes_read += got
            self.reads += 1
        if got != nbytes:
            raise CheckpointError(
                f"{self.storage.where(key)} is truncated: it ends before byte {offset + nbytes} "
                f"(read {got} of {nbytes} bytes from offset {offset})")
        return buf

    @staticmethod
    def _copy(buf: np.ndarray, data: Any) -> int:
        view = np.frombuffer(data, np.uint8)
        n = min(len(view), len(buf))
        buf[:n] = view[:n]
        return len(view)

    def _fd(self, key: str) -> int:
        with self._lock:
            fd = self._fds.get(key)
            if fd is None:
                fd = os.open(self.storage.where(key), os.O_RDONLY)
                self._fds[key] = fd
            return fd

    def _pread(self, key: str, offset: int, buf: np.ndarray) -> int:
        fd = self._fd(key)
        filled = 0
        while filled < len(buf):
            n = os.preadv(fd, [memoryview(buf)[filled:]], offset + filled)
            if n == 0:
                break
            filled += n
        return filled

    def _tensorstore_range(self, key: str, offset: int, nbytes: int) -> bytes:
        try:
            r = self.storage.kv.read(key, byte_range=slice(offset, offset + nbytes)).result()  # type: ignore[attr-defined]
        except Exception as e:  # OUT_OF_RANGE when the object is shorter than the range
            if "OUT_OF_RANGE" in str(e) or "out of range" in str(e).lower():
                return b""
            raise OSError(errno.EIO, f"cannot read: {e}", self.storage.where(key)) from None
        if r.state != "value":
            raise FileNotFoundError(errno.ENOENT, "no such object", self.storage.where(key))
        return r.value

    def _whole_object(self, key: str) -> bytes:
        with self._lock:
            data = self._whole.get(key)
        if data is None:
            data = self.storage.get(key, max_bytes=WHOLE_READ_LIMIT)
            with self._lock:
                self._whole[key] = data
                self.whole_reads += 1
        return data

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
            self._whole.clear()
        for fd in fds:
            os.close(fd)
