"""The zarr-python + fsspec engine: the same format through zarr-python's ``FsspecStore`` (the
zarr v3 ``Store`` API) over any fsspec file system (``file://``, ``memory://``, ``s3://`` with
s3fs, ``gs://`` with gcsfs, ...).

Chunk files and metadata are written and read as whole objects through the store, many at once
(zarr's event loop does the I/O; ``io_concurrency`` bounds the objects in flight). The one
operation a zarr Store cannot do atomically, write-if-absent (``FsspecStore.set_if_not_exists``
checks, then writes), goes to the file system itself: ``pipe_file(mode="create")``, which is an
exclusive create on local disk and ``If-None-Match: *`` on s3fs.

Size: one backend, one module (zarr-python's storage/: a module per backend): the fsspec engine
whole.
"""

from __future__ import annotations

import asyncio
import errno
import os
from typing import Any

import numpy as np

from ckpt._host import shared_pool
from ckpt._errors import CheckpointError
from ckpt._format import ArraySpec, check_key
from ckpt._geometry import Box, chunk_index_of, chunk_key
from ckpt.storage._base import (
    ChunkFiles,
    StoreCaps,
    READ_PIECE,
    Storage,
    check_range,
    chunk_bytes,
    range_buffer,
    range_short,
    read_buffer,
    size_mismatch,
    too_large,
)
from ckpt.storage._confine import check_local_key

# s3fs and gcsfs raise OSError subclasses without an errno (PermissionError("Forbidden")): the
# subclass says which, and OSError(code, ...) turns the code back into that subclass.
_SUBCLASS_ERRNO = ((FileNotFoundError, errno.ENOENT), (FileExistsError, errno.EEXIST),
                   (PermissionError, errno.EACCES), (TimeoutError, errno.ETIMEDOUT),
                   (ConnectionError, errno.ECONNREFUSED))


def _mapped(e: BaseException, where: str) -> BaseException:
    if isinstance(e, OSError) and e.filename is None:
        code = e.errno or next((c for cls, c in _SUBCLASS_ERRNO if isinstance(e, cls)), errno.EIO)
        return OSError(code, e.strerror or str(e), where)
    if isinstance(e, (OSError, CheckpointError)):
        return e
    return OSError(errno.EIO, f"{type(e).__name__}: {e}", where)


def _range_not_satisfiable(e: BaseException) -> bool:
    """HTTP 416 for a range past the object's end: gcsfs's HttpError(416); s3fs's
    OSError(EINVAL) caused by botocore's InvalidRange (Ceph RGW)."""
    seen = 0
    while e is not None and seen < 5:
        if (getattr(e, "code", None) == 416 or (type(e).__name__ == "HttpError" and "416" in str(e))
                or "InvalidRange" in str(e)):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _timed_out(where: str, op: str, timeout_s: float) -> TimeoutError:
    return TimeoutError(errno.ETIMEDOUT, f"{op}: no answer within {timeout_s:g} s (request_timeout_s); gave up", where)


def _precondition_failed(e: BaseException) -> bool:
    """An S3 412 (If-Match / If-None-Match not met) somewhere in the error's chain."""
    seen = 0
    while e is not None and seen < 5:
        text = str(e)
        if "PreconditionFailed" in text or "412" in text or "ConditionalRequestConflict" in text:
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


class _Future:
    """A pool future (a blocking call on the engine's threads): errors mapped, and its wait
    bounded by the call's own bound (the call times out by itself: request_timeout_s)."""

    def __init__(self, future, where: str):
        self._future, self._where = future, where

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self._future.result(timeout)
        except Exception as e:
            raise _mapped(e, self._where) from None

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        # Only a call not yet started is cancelled (concurrent.futures): nothing half-sent.
        return self._future.cancel()


class FsspecStorage(ChunkFiles, Storage):
    """A location in an fsspec file system, seen through a zarr ``FsspecStore``.

    `fs`: the fsspec file system; `path`: the location in it (no trailing '/'); `url`: as shown.
    """


    def __init__(self, fs, path: str, url: str, concurrency: int, timeout_s: float | None = None):
        from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
        from zarr.storage import FsspecStore

        self.fs, self._path, self._url, self._concurrency = fs, path.rstrip("/"), url.rstrip("/"), concurrency
        # Every operation is bounded as a whole (request_timeout_s; None: unbounded, local).
        self._timeout_s = timeout_s
        self._local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        # Write-if-absent is atomic on local disk (O_EXCL) and on object stores (If-None-Match);
        # elsewhere fsspec checks, then writes.
        self._object_store = bool({"s3", "s3a", "gs", "gcs"} & set(
            fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)))
        # Compare-and-swap on the ETag (PUT with If-Match, botocore >= 1.35.58) on s3fs; gcsfs
        # has no conditional replace through fsspec (docs/storage.md, "Leases").
        protocols = set(fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        self.caps = StoreCaps("fsspec", conditional_writes=self._local or self._object_store,
                              versioned_writes=bool({"s3", "s3a"} & protocols) and bool(getattr(fs, "async_impl", False)))
        async_fs = fs if getattr(fs, "async_impl", False) else AsyncFileSystemWrapper(fs, asynchronous=True)
        self.store = FsspecStore(fs=async_fs, path=self._path, read_only=False)

    @property
    def url(self) -> str:
        return self._url

    def child(self, key: str) -> "FsspecStorage":
        key = key.strip("/")
        return FsspecStorage(self.fs, f"{self._path}/{key}", f"{self._url}/{key}", self._concurrency,
                             self._timeout_s)

    def parent(self) -> "FsspecStorage":
        return FsspecStorage(self.fs, self._path.rsplit("/", 1)[0], self._url.rsplit("/", 1)[0], self._concurrency,
                             self._timeout_s)

    def _full(self, key: str) -> str:
        return f"{self._path}/{key}" if key else self._path

    def _run(self, coroutine, where: str, op: str):
        """Run `coroutine` on zarr's event loop, exceptions as raised, within request_timeout_s:
        past it the coroutine is cancelled (its request abandoned) and a TimeoutError names
        `where` and `op`."""
        from zarr.core.sync import sync

        if self._timeout_s is None:
            return sync(coroutine)
        try:
            return sync(asyncio.wait_for(coroutine, self._timeout_s))
        except (TimeoutError, asyncio.TimeoutError):
            raise _timed_out(where, op, self._timeout_s) from None

    def _sync(self, coroutine, where: str, op: str = "request"):
        try:
            return self._run(coroutine, where, op)
        except TimeoutError as e:
            if e.errno == errno.ETIMEDOUT and e.filename == where:
                raise
            raise _mapped(e, where) from None
        except Exception as e:
            raise _mapped(e, where) from None

    def _fs(self, method: str, *args, **kwargs):
        """``fs.<method>(...)``, exceptions as raised. An asynchronous file system (s3fs, gcsfs:
        opened with ``asynchronous=True``) runs its coroutine on zarr's event loop, where the
        store's own I/O runs: its HTTP session belongs to that loop and may not be used from
        another. Bounded by request_timeout_s there."""
        if getattr(self.fs, "asynchronous", False):
            path = args[0] if args and isinstance(args[0], str) else self._path
            where = self._url + path[len(self._path):] if path.startswith(self._path) else path
            return self._run(getattr(self.fs, "_" + method)(*args, **kwargs), where, method)
        return getattr(self.fs, method)(*args, **kwargs)

    # ---- bytes -------------------------------------------------------------------------

    def _read(self, key: str, limit: int | None, start: int = 0, *, links_within_root: bool = False) -> bytes:
        """At most `limit - start` bytes of the object, from `start` (to its end without a
        `limit`): ``fs.cat_file(path, start, limit)`` through the store. Confined as the Storage
        contract says: a validated key, and on local files no link followed (with
        `links_within_root`: none that leaves the location) and only a regular file opened."""
        from zarr.abc.store import RangeByteRequest
        from zarr.core.buffer import default_buffer_prototype

        check_key(key)
        if self._local:
            check_local_key(self._path, key, links_within_root=links_within_root)
        byte_range = None if limit is None else RangeByteRequest(start, limit)
        try:
            buf = self._run(self.store.get(key, prototype=default_buffer_prototype(), byte_range=byte_range),
                            self.where(key), "read")
        except TimeoutError as e:
            if e.errno == errno.ETIMEDOUT and e.filename == self.where(key):
                raise
            raise _mapped(e, self.where(key)) from None
        except Exception as e:
            if byte_range is not None and _range_not_satisfiable(e):
                return b""  # gcsfs: a range starting at or past the end is HTTP 416, not b""
            raise _mapped(e, self.where(key)) from None
        if buf is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", self.where(key))
        return buf.to_bytes()

    def get(self, key: str, *, max_bytes: int) -> bytes:
        # A one-byte probe past the limit first: a read of `max_bytes` may allocate all of it.
        if self._read(key, max_bytes + 1, max_bytes):
            raise too_large(self.where(key), max_bytes)
        data = self._read(key, None)
        if len(data) > max_bytes:
            raise too_large(self.where(key), max_bytes)
        return data

    def read_exact(self, key: str, nbytes: int, into: np.ndarray | None = None) -> np.ndarray:
        out = read_buffer(nbytes, self.where(key))
        # In pieces (READ_PIECE): no buffer but `out` ever holds the whole object.
        for start in range(0, nbytes + 1, READ_PIECE):
            stop = min(start + READ_PIECE, nbytes + 1)  # the last piece asks for one byte more
            data = self._read(key, stop, start)
            if len(data) > nbytes - start:
                raise too_large(self.where(key), nbytes)
            if len(data) != min(stop, nbytes) - start:
                raise size_mismatch(self.where(key), start + len(data), nbytes)
            out[start:start + len(data)] = np.frombuffer(data, np.uint8)
        return out

    def size(self, key: str) -> int:
        check_key(key)
        if self._local:
            check_local_key(self._path, key, links_within_root=True)
        try:
            return int(self._fs("size", self._full(key)))
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "no such object", self.where(key)) from None
        except Exception as e:
            raise _mapped(e, self.where(key)) from None

    def read_range(self, key: str, start: int, length: int, into: np.ndarray | None = None) -> np.ndarray:
        """One ranged read of ``[start, start + length)`` (see Storage.read_range)."""
        check_range(start, length)
        where = self.where(key)
        out = range_buffer(into, length, where)
        data = self._read(key, start + length, start, links_within_root=True) if length else b""
        if length == 0:
            self.size(key)  # (a missing object is an error even for an empty range)
        if len(data) != length:
            raise range_short(where, start, length)
        out[:] = np.frombuffer(data, np.uint8)
        return out

    def _set(self, key: str, data: bytes) -> None:
        from zarr.core.buffer import cpu

        self._sync(self.store.set(key, cpu.Buffer.from_bytes(data)), self.where(key), "write")

    def put(self, key: str, data: bytes) -> Any:
        return _Future(shared_pool("ckpt-fsspec", self._concurrency).submit(self._set, key, bytes(data)), self.where(key))

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
            if self._fs("exists", path):
                raise FileExistsError(errno.EEXIST, "already exists", self.where(key))
            if not self._object_store:
                # (On s3fs / gcsfs there are no directories, and makedirs would try to create a
                # missing bucket.)
                self._fs("makedirs", path.rsplit("/", 1)[0], exist_ok=True)
            # s3fs: PUT with If-None-Match: *; gcsfs: a multipart upload with ifGenerationMatch=0.
            self._fs("pipe_file", path, bytes(data), mode="create")
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, "already exists", self.where(key)) from None
        except Exception as e:
            # s3fs reports a lost If-None-Match race as OSError(EINVAL) on SeaweedFS and Ceph RGW
            # (412 Precondition Failed); whatever the error, an object there now means we lost.
            try:
                there = self._fs("exists", path)
            except Exception:
                there = False
            if there:
                raise FileExistsError(errno.EEXIST, "already exists", self.where(key)) from None
            raise _mapped(e, self.where(key)) from None

    def _bucket_key(self, key: str) -> tuple[str, str]:
        bucket, _, rest = self._full(key).partition("/")
        return bucket, rest

    def get_versioned(self, key: str, *, max_bytes: int) -> tuple[bytes | None, Any]:
        """s3fs: one GetObject, its bytes and ETag (a missing object: (None, None))."""
        check_key(key)
        bucket, name = self._bucket_key(key)
        fs = self.fs

        async def read() -> tuple[bytes | None, Any]:
            try:
                out = await fs._call_s3("get_object", Bucket=bucket, Key=name, Range=f"bytes=0-{max_bytes}")
            except FileNotFoundError:
                return None, None
            body = out["Body"]
            try:
                data = await body.read()
            finally:
                body.close()
            return data, out.get("ETag")

        data, etag = self._sync(read(), self.where(key), "read")
        if data is not None and len(data) > max_bytes:
            raise too_large(self.where(key), max_bytes)
        return data, etag

    def put_if_version(self, key: str, data: bytes, version: Any) -> Any:
        """s3fs: PutObject with If-Match: <ETag> (If-None-Match: * for a missing object's
        version); the new ETag, or None on 412 Precondition Failed."""
        bucket, name = self._bucket_key(key)
        match = {"IfMatch": version} if version is not None else {"IfNoneMatch": "*"}
        try:
            out = self._run(self.fs._call_s3("put_object", Bucket=bucket, Key=name, Body=bytes(data), **match),
                            self.where(key), "conditional write")
        except FileNotFoundError:
            return None  # (If-Match on an object deleted meanwhile)
        except Exception as e:
            if _precondition_failed(e):
                return None
            raise _mapped(e, self.where(key)) from None
        return out.get("ETag") or True

    def exists(self, key: str) -> bool:
        if not key:
            return not self._sync(self.store.is_empty(""), self.url)
        return bool(self._sync(self.store.exists(key), self.where(key)))

    def stat_many(self, keys) -> dict[str, int | None]:
        """On object stores, sizes from one recursive listing (s3fs / gcsfs ``find``: a LIST per
        1000 objects) instead of a listing per directory (per row of chunks)."""
        keys = list(keys)
        if not self._object_store or not keys:
            return super().stat_many(keys)
        common = os.path.commonprefix(keys)
        head = common[: common.rfind("/") + 1]
        base = self._full(head.rstrip("/")).rstrip("/") + "/"
        try:
            found = self._fs("find", base, detail=True)
        except FileNotFoundError:
            found = {}
        except Exception as e:
            raise _mapped(e, self.where(head)) from None
        sizes = {name[len(base):]: info.get("size", -1) for name, info in found.items() if name.startswith(base)}
        return {k: sizes.get(k[len(head):]) for k in keys}

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        path = self._full(prefix.strip("/"))
        try:
            entries = self._fs("ls", path, detail=True)
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
            self._fs("rm_file", self._full(key))
        except FileNotFoundError:
            pass
        except Exception as e:
            raise _mapped(e, self.where(key)) from None

    def delete_tree(self, prefix: str = "") -> None:
        path = self._full(prefix.strip("/"))
        try:
            if self._fs("exists", path):
                self._fs("rm", path, recursive=True)
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
