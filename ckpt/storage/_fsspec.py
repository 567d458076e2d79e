"""The zarr-python + fsspec engine: the same format through zarr-python's ``FsspecStore`` (the
zarr v3 ``Store`` API) over any fsspec file system (``file://``, ``memory://``, ``s3://`` with
s3fs, ``gs://`` with gcsfs, ...).

Chunk files and metadata are written and read as whole objects through the store, many at once
(zarr's event loop does the I/O; ``io_concurrency`` bounds the objects in flight). The one
operation a zarr Store cannot do atomically, write-if-absent (``FsspecStore.set_if_not_exists``
checks, then writes), goes to the file system itself: ``pipe_file(mode="create")``, which is an
exclusive create on local disk and ``If-None-Match: *`` on s3fs.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ckpt._errors import CheckpointError
from ckpt._layout import Box, chunk_index_of, chunk_key
from ckpt.storage._base import ArraySpec, Storage, aligned_empty, chunk_bytes, size_mismatch

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(concurrency: int) -> ThreadPoolExecutor:
    with _pools_lock:
        if concurrency not in _pools:
            _pools[concurrency] = ThreadPoolExecutor(concurrency, thread_name_prefix="ckpt-fsspec")
        return _pools[concurrency]


def _mapped(e: BaseException, where: str) -> BaseException:
    if isinstance(e, OSError) and e.filename is None:
        return OSError(e.errno or errno.EIO, e.strerror or str(e), where)
    if isinstance(e, (OSError, CheckpointError)):
        return e
    return OSError(errno.EIO, f"{type(e).__name__}: {e}", where)


class _Future:
    def __init__(self, future, where: str):
        self._future, self._where = future, where

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self._future.result(timeout)
        except Exception as e:
            raise _mapped(e, self._where) from None


class FsspecStorage(Storage):
    """A location in an fsspec file system, seen through a zarr ``FsspecStore``.

    `fs`: the fsspec file system; `path`: the location in it (no trailing '/'); `url`: as shown.
    """

    engine = "fsspec"
    conditional_writes = True

    def __init__(self, fs, path: str, url: str, concurrency: int):
        from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
        from zarr.storage import FsspecStore

        self.fs, self._path, self._url, self._concurrency = fs, path.rstrip("/"), url.rstrip("/"), concurrency
        self._local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        # Write-if-absent is atomic on local disk (O_EXCL) and on object stores (If-None-Match);
        # elsewhere fsspec checks, then writes.
        self.conditional_writes = self._local or bool({"s3", "s3a", "gs", "gcs"} & set(
            fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)))
        async_fs = fs if getattr(fs, "async_impl", False) else AsyncFileSystemWrapper(fs, asynchronous=True)
        self.store = FsspecStore(fs=async_fs, path=self._path, read_only=False)

    @property
    def url(self) -> str:
        return self._url

    def child(self, key: str) -> "FsspecStorage":
        key = key.strip("/")
        return FsspecStorage(self.fs, f"{self._path}/{key}", f"{self._url}/{key}", self._concurrency)

    def parent(self) -> "FsspecStorage":
        return FsspecStorage(self.fs, self._path.rsplit("/", 1)[0], self._url.rsplit("/", 1)[0], self._concurrency)

    def _full(self, key: str) -> str:
        return f"{self._path}/{key}" if key else self._path

    def _sync(self, coroutine, where: str):
        from zarr.core.sync import sync

        try:
            return sync(coroutine)
        except Exception as e:
            raise _mapped(e, where) from None

    # ---- bytes -------------------------------------------------------------------------

    def _read(self, key: str) -> bytes:
        from zarr.core.buffer import default_buffer_prototype

        buf = self._sync(self.store.get(key, prototype=default_buffer_prototype()), self.where(key))
        if buf is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", self.where(key))
        return buf.to_bytes()

    def get(self, key: str, *, max_bytes: int) -> bytes:
        data = self._read(key)
        if len(data) > max_bytes:
            raise size_mismatch(self.where(key), len(data), max_bytes)
        return data

    def read_exact(self, key: str, nbytes: int) -> np.ndarray:
        data = self._read(key)
        if len(data) != nbytes:
            raise size_mismatch(self.where(key), len(data), nbytes)
        out = aligned_empty(nbytes)
        out[:] = np.frombuffer(data, np.uint8)
        return out

    def _set(self, key: str, data: bytes) -> None:
        from zarr.core.buffer import cpu

        self._sync(self.store.set(key, cpu.Buffer.from_bytes(data)), self.where(key))

    def put(self, key: str, data: bytes) -> Any:
        return _Future(_pool(self._concurrency).submit(self._set, key, bytes(data)), self.where(key))

    def put_if_absent(self, key: str, data: bytes) -> None:
        path = self._full(key)
        try:
            if self._local:
                # fsspec's pipe_file(mode="create") checks, then writes, on local disk: an
                # exclusive create (O_EXCL) is the atomic form, and fsync makes it durable.
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "xb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                return
            if self.fs.exists(path):
                raise FileExistsError(errno.EEXIST, "already exists", self.where(key))
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(path, bytes(data), mode="create")
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, "already exists", self.where(key)) from None
        except OSError as e:
            # s3fs reports a lost If-None-Match race as OSError(EINVAL) on some servers.
            if self.fs.exists(path):
                raise FileExistsError(errno.EEXIST, "already exists", self.where(key)) from None
            raise _mapped(e, self.where(key)) from None

    def exists(self, key: str) -> bool:
        return bool(self._sync(self.store.exists(key), self.where(key)))

    def exists_any(self) -> bool:
        return not self._sync(self.store.is_empty(""), self.url)

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        path = self._full(prefix.strip("/"))
        try:
            entries = self.fs.ls(path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return [], []
        except Exception as e:
            raise _mapped(e, self.where(prefix)) from None
        files, dirs = set(), set()
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if entry["name"].rstrip("/") == path.rstrip("/"):
                continue
            (dirs if entry.get("type") == "directory" else files).add(name)
        return sorted(files), sorted(dirs)

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._full(key))
        except FileNotFoundError:
            pass
        except Exception as e:
            raise _mapped(e, self.where(key)) from None

    def delete_tree(self, prefix: str = "") -> None:
        path = self._full(prefix.strip("/"))
        try:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise _mapped(e, self.where(prefix)) from None

    # ---- arrays ------------------------------------------------------------------------

    def open_arrays(self, arrays: dict[Any, tuple[str, ArraySpec]]) -> dict[Any, Any]:
        return {k: (path, spec.chunk_shape) for k, (path, spec) in arrays.items()}

    def write_chunk(self, handle: Any, box: Box, data: np.ndarray) -> Any:
        path, chunk_shape = handle
        key = f"{path}/{chunk_key(chunk_index_of(box, chunk_shape))}"
        # A copy: the store may keep what it is given (memory://), and the caller reuses buffers.
        return self.put(key, chunk_bytes(data, box, chunk_shape).tobytes())
