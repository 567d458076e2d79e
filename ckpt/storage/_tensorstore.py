"""The TensorStore engine: any TensorStore kvstore (memory, s3, gcs, file), with TensorStore's
own concurrency and retries. Chunks are written through the zarr3 driver, which takes the
library's host buffers without copying them; everything else goes through ``ts.KvStore``.

Size: one backend, one module (zarr-python's storage/: a module per backend): the TensorStore engine
whole, its ranged part reads included.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import threading
import time
from typing import Any

import numpy as np
import tensorstore as ts

from ckpt._errors import CheckpointError
from ckpt._format import ArraySpec, check_key, zarr_metadata
from ckpt._geometry import Box, box_to_index, chunk_index_of, chunk_key
from ckpt.storage._base import (
    ChunkFiles,
    StoreCaps,
    Storage,
    check_range,
    range_buffer,
    range_short,
    read_buffer,
    size_mismatch,
    too_large,
)
from ckpt.storage._confine import check_local_key

# TensorStore reports failures as ValueError("<absl status code>: <message>").
_STATUS = re.compile(r"^([A-Z_]+):")
_ERRNO = {
    "NOT_FOUND": errno.ENOENT,
    "ALREADY_EXISTS": errno.EEXIST,
    "PERMISSION_DENIED": errno.EACCES,
    "UNAUTHENTICATED": errno.EACCES,
    "RESOURCE_EXHAUSTED": errno.ENOSPC,
    "OUT_OF_RANGE": errno.EFBIG,
    "DEADLINE_EXCEEDED": errno.ETIMEDOUT,
    "INVALID_ARGUMENT": errno.EINVAL,  # e.g. a bucket name S3 or GCS does not accept
    "UNAVAILABLE": errno.EIO,
    "DATA_LOSS": errno.EIO,
    "ABORTED": errno.EIO,
    "INTERNAL": errno.EIO,
    "UNKNOWN": errno.EIO,
}


def storage_error(e: BaseException, where: str) -> BaseException:
    """An OSError naming `where` for a TensorStore failure (other exceptions unchanged)."""
    if isinstance(e, (OSError, CheckpointError)) or not isinstance(e, ValueError):
        return e
    text = str(e)
    m = _STATUS.match(text)
    if m is None:
        return e
    code = _ERRNO.get(m.group(1), errno.EIO)
    os_code = re.search(r"os_error_code='?(\d+)", text)
    if os_code:
        code = int(os_code.group(1))
    return OSError(code, f"{text.split(' [', 1)[0]}", where)


def timed_out(where: str, op: str, timeout_s: float) -> TimeoutError:
    """The error of a storage operation that got no answer within its bound (request_timeout_s)."""
    return TimeoutError(errno.ETIMEDOUT, f"{op}: no answer within {timeout_s:g} s (request_timeout_s); gave up", where)


def _deadline(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def wait_for(future: Any, deadline: float | None, timeout_s: float | None, where: str, op: str) -> Any:
    """``future.result()`` (exceptions as raised), waiting no later than `deadline` (a
    time.monotonic(); None: unbounded); then the future is cancelled (TensorStore stops
    retrying it) and a TimeoutError names `where` and `op`."""
    if deadline is None:
        return future.result()
    try:
        return future.result(timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        if not future.done():
            future.cancel()
            raise timed_out(where, op, timeout_s) from None
    return future.result()  # (finished just as the wait ran out)


class MappedFuture:
    """A TensorStore future whose errors come out as storage_error()s, bounded in time from its
    start by `timeout_s` (None: unbounded). `cancellable`: ``cancel()`` reaches TensorStore
    (only where a write cancelled mid-flight cannot recreate anything after a cleanup that
    follows: object stores)."""

    def __init__(self, future: Any, where: str, timeout_s: float | None = None, op: str = "request",
                 cancellable: bool = False):
        self._future, self._where = future, where
        self._timeout_s, self._deadline, self._op, self._cancellable = timeout_s, _deadline(timeout_s), op, cancellable
        self._timed_out: TimeoutError | None = None

    def result(self, timeout: float | None = None) -> Any:
        if self._timed_out is not None:
            raise self._timed_out
        try:
            if timeout is not None and (self._deadline is None or time.monotonic() + timeout < self._deadline):
                return self._future.result(timeout=timeout)  # the caller's wait: nothing cancelled
            return wait_for(self._future, self._deadline, self._timeout_s, self._where, self._op)
        except TimeoutError as e:
            if e.errno == errno.ETIMEDOUT:  # its own bound ran out: it was cancelled
                self._timed_out = e
            raise
        except Exception as e:
            raise storage_error(e, self._where) from None

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        return bool(self._cancellable and self._future.cancel())


# Objects are read as ranged GETs of at most this many bytes, each copied into the caller's
# buffer as it is taken (see _ObjectRead). A threaded reader (read_exact) keeps this many
# in flight per object, so that it keeps requests queued while it copies what arrived (one
# request per object left gaps: docs/benchmarks.md, "Object stores"); the restore's reader
# (read_chunk_async) issues every part of a batch at once.
PART_BYTES = 8 << 20
PARTS_IN_FLIGHT = 4

_contexts: dict[tuple, ts.Context] = {}
_contexts_lock = threading.Lock()


def shared_context(kind: str, concurrency: int) -> ts.Context:
    """One Context per (kind, concurrency), shared by every storage of the process. Every
    ``memory://`` location shares one context: TensorStore's in-memory store lives in it."""
    key = ("memory", 0) if kind == "memory" else (kind, concurrency)
    with _contexts_lock:
        if key not in _contexts:
            spec: dict = {"cache_pool": {"total_bytes_limit": 0}}
            if kind == "local":
                spec.update({
                    "file_io_concurrency": {"limit": concurrency},
                    # Chunks are written once, by one process, into a private temporary directory
                    # whose rename is the atomic step: no lock files or per-chunk renames needed.
                    # Files are still fsynced (file_io_sync defaults to true).
                    "file_io_locking": {"mode": "non_atomic"},
                    # Direct I/O: chunks go from the library's page-aligned host buffers to the
                    # device without a page-cache copy (docs/benchmarks.md).
                    "file_io_mode": {"mode": "direct"},
                })
            elif kind == "file":
                spec["file_io_concurrency"] = {"limit": concurrency}
            elif kind == "s3":
                # Requests in flight, reads and writes together (TensorStore's default: 32). A
                # save keeps at most max_inflight_bytes in flight and a restore reads on
                # io_concurrency threads, so this is the one knob: raise io_concurrency for
                # high-latency stores (docs/storage.md, "Performance").
                spec["s3_request_concurrency"] = {"limit": concurrency}
            elif kind == "gcs":
                spec["gcs_request_concurrency"] = {"limit": concurrency}
            _contexts[key] = ts.Context(spec)
        return _contexts[key]


def _successor(prefix: str) -> str:
    return prefix[:-1] + chr(ord(prefix[-1]) + 1) if prefix else ""


class _ObjectRead:
    """One object read as ranged GETs of PART_BYTES, `window` of them in flight (all: None), the
    parts copied into one aligned buffer as they are taken; ``result()`` is that buffer."""

    def __init__(self, storage: "TensorStoreStorage", key: str, nbytes: int, into: np.ndarray | None,
                 window: int | None, start: int | None = None):
        check_key(key)
        if storage._spec.get("driver") == "file":
            check_local_key(storage._spec["path"], key)
        self._storage, self._key, self._nbytes, self._into = storage, key, nbytes, into
        # `start` given: bytes [start, start + nbytes) of a larger object (a range of a packed
        # data object), with no probe past them.
        self._base = start or 0
        self._ranges = [(a, min(a + PART_BYTES, nbytes)) for a in range(0, nbytes, PART_BYTES)] or [(0, 0)]
        self._window = len(self._ranges) if window is None else window
        self._pending: list = []
        # Only the recorded size is read: an object shorter than that is damage, and so is one
        # longer, which a one-byte probe past the end (sent with the first part) tells, except
        # on S3 and GCS, where that would be a second request per object: there the tail of a
        # longer object is never read (the chunk's checksum covers the bytes that are).
        remote = storage._spec.get("driver") in ("s3", "gcs")
        try:
            self._probe = None if remote or start is not None else storage.kv.read(key, byte_range=slice(nbytes, nbytes + 1))
            self._issue(self._window)
        except Exception as e:
            raise storage_error(e, storage.where(key)) from None
        with storage._lock:
            storage._object_reads += 1

    def _issue(self, n: int) -> None:
        kv = self._storage.kv
        while n > 0 and len(self._pending) < len(self._ranges):
            a, b = self._ranges[len(self._pending)]
            self._pending.append((a, b, kv.read(self._key, byte_range=slice(self._base + a, self._base + b)),
                                  _deadline(self._storage._timeout_s)))
            n -= 1

    def result(self, timeout: float | None = None) -> np.ndarray:
        s, key, nbytes = self._storage, self._key, self._nbytes
        # Each part is copied into the aligned buffer (the one a CPU device adopts, or a
        # writable numpy result) as it is taken, and TensorStore's bytes of it are dropped once
        # the next part's exist. Holding every chunk's bytes until placement faulted the tree in
        # fresh pages twice, and so did dropping each part at once (glibc hands the block back
        # to the kernel): ReadResult.value ran at 1 GB/s, against 4 GB/s this way (measured:
        # docs/benchmarks.md, "Chunk parts copied as they arrive").
        try:
            out = _output(self._into, nbytes, s.where(key))
            for i in range(len(self._ranges)):
                try:
                    self._issue(i + self._window - len(self._pending))
                except Exception as e:
                    raise storage_error(e, s.where(key)) from None
                start, stop, future, deadline = self._pending[i]
                self._pending[i] = None
                data = s._part(key, future, nbytes, deadline)
                if len(data) != stop - start:
                    raise CheckpointError(f"{s.where(key)} is truncated: it holds fewer than the {nbytes} bytes expected")
                out[start:stop] = np.frombuffer(data, np.uint8)
                s._last_part = data
                del data
            _refuse_longer(self._probe, s.where(key), nbytes, s._timeout_s)
            return out
        finally:
            self._pending = []
            s._object_read_done()


def _output(into: np.ndarray | None, nbytes: int, where: str) -> np.ndarray:
    """Where an object of `nbytes` is read to: the caller's buffer (read_exact's `into`) when
    it is one, else a fresh aligned one."""
    if into is not None and into.dtype == np.uint8 and into.ndim == 1 and into.nbytes >= nbytes:
        return into[:nbytes]
    return read_buffer(nbytes, where)


def _refuse_longer(probe, where: str, nbytes: int, timeout_s: float | None = None) -> None:
    """Raise if `probe` (a read of the byte just past the expected end, or None) found one:
    the object is longer than recorded."""
    try:
        longer = probe is not None and wait_for(probe, _deadline(timeout_s), timeout_s, where,
                                                "read").state == "value"
    except TimeoutError:
        raise
    except Exception as e:
        if not str(e).startswith("OUT_OF_RANGE"):
            raise storage_error(e, where) from None
        longer = False
    if longer:
        raise too_large(where, nbytes)


class TensorStoreStorage(ChunkFiles, Storage):
    """A location in a TensorStore kvstore (`kvstore`: a kvstore spec whose path ends in '/')."""

    caps = StoreCaps("tensorstore", reads_into_buffers=True, async_ranges=True)

    def __init__(self, kvstore: dict, url: str, context: ts.Context, *, conditional_writes: bool = True,
                 timeout_s: float | None = None):
        self._spec = dict(kvstore)
        self._url = url.rstrip("/")
        self._context = context
        self._conditional = conditional_writes
        self._remote = self._spec.get("driver") in ("s3", "gcs")
        # Generations: every kvstore driver here has them (memory, file, s3: ETag, gcs); a
        # compare-and-swap needs them honoured, which conditional_writes says. Remote stores
        # skip the one-byte probe past a chunk's end (see _ObjectRead). Every driver but the
        # file driver holds each ranged response whole until it is taken (the reader's window).
        if type(self) is TensorStoreStorage:
            self.caps = StoreCaps("tensorstore", conditional_writes=conditional_writes,
                                  versioned_writes=conditional_writes, reads_into_buffers=True,
                                  reads_refuse_longer=not self._remote,
                                  response_part_bytes=None if self._spec.get("driver") == "file" else PART_BYTES,
                                  async_ranges=True)
        # Every wait on a request is bounded (request_timeout_s); None: local files, unbounded.
        self._timeout_s = timeout_s
        self._kv: ts.KvStore | None = None
        self._lock = threading.Lock()
        # The latest part's bytes, kept while object reads are in flight (see _ObjectRead).
        self._last_part: bytes | None = None
        self._object_reads = 0

    # ---- location ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._url

    def _with_path(self, path: str, url: str) -> "TensorStoreStorage":
        return type(self)({**self._spec, "path": path}, url, self._context,
                          conditional_writes=self._conditional, timeout_s=self._timeout_s)

    def child(self, key: str) -> "TensorStoreStorage":
        key = key.strip("/")
        return self._with_path(self._spec.get("path", "") + key + "/", f"{self._url}/{key}")

    def parent(self) -> "TensorStoreStorage":
        path = self._spec.get("path", "").rstrip("/")
        head = path.rsplit("/", 1)[0] + "/" if "/" in path else ""
        return self._with_path(head, self._url.rsplit("/", 1)[0])

    @property
    def kv(self) -> ts.KvStore:
        with self._lock:
            if self._kv is None:
                try:
                    self._kv = wait_for(ts.KvStore.open(self._spec, context=self._context),
                                        _deadline(self._timeout_s), self._timeout_s, self._url, "open")
                except TimeoutError:
                    raise
                except Exception as e:
                    raise storage_error(e, self._url) from None
            return self._kv

    # ---- bytes -------------------------------------------------------------------------

    def _read(self, key: str, byte_range: slice | None = None, *, links_within_root: bool = False) -> bytes | None:
        """The object's bytes (those in `byte_range` only); None when the range ends past the
        object's end. Confined as the Storage contract says: a validated key, and on local files
        no link followed (with `links_within_root`: none that leaves the location) and nothing
        but a regular file opened (the file driver follows links and would block on a FIFO)."""
        check_key(key)
        if self._spec.get("driver") == "file":
            check_local_key(self._spec["path"], key, links_within_root=links_within_root)
        try:
            r = self._wait(self.kv.read(key, byte_range=byte_range), key, "read")
        except TimeoutError:
            raise
        except Exception as e:
            if byte_range is not None and str(e).startswith("OUT_OF_RANGE"):
                return None
            raise storage_error(e, self.where(key)) from None
        if r.state != "value":
            raise FileNotFoundError(errno.ENOENT, "no such object", self.where(key))
        return r.value

    def get(self, key: str, *, max_bytes: int) -> bytes:
        # Never more than max_bytes: a one-byte probe past the limit first.
        if self._read(key, slice(max_bytes, max_bytes + 1)):
            raise too_large(self.where(key), max_bytes)
        data = self._read(key)
        if len(data) > max_bytes:
            raise size_mismatch(self.where(key), len(data), max_bytes)
        return data

    def read_exact(self, key: str, nbytes: int, into: np.ndarray | None = None) -> np.ndarray:
        return _ObjectRead(self, key, nbytes, into, PARTS_IN_FLIGHT).result()

    def size(self, key: str) -> int | None:
        """Local files: their size (links under the location followed). Elsewhere a kvstore
        tells no size without a read: None once a listing says the object exists."""
        check_key(key)
        if self._spec.get("driver") == "file":
            return os.stat(check_local_key(self._spec["path"], key, links_within_root=True)).st_size
        if not self.exists(key):
            raise FileNotFoundError(errno.ENOENT, "no such object", self.where(key))
        return None

    def read_range(self, key: str, start: int, length: int, into: np.ndarray | None = None) -> np.ndarray:
        """One ``KvStore.read(key, byte_range=...)`` of the range (see Storage.read_range)."""
        check_range(start, length)
        where = self.where(key)
        out = range_buffer(into, length, where)
        data = self._read(key, slice(start, start + length), links_within_root=True)
        if data is None or len(data) != length:  # (TensorStore: OUT_OF_RANGE past the end)
            raise range_short(where, start, length)
        out[:] = np.frombuffer(data, np.uint8)
        return out

    def read_range_async(self, key: str, start: int, length: int) -> Any:
        """Bytes ``[start, start + length)`` of the object as a future, its ranged GETs of
        PART_BYTES issued now from this thread (a packed restore's ranges of data objects, as
        ``read_chunk_async`` reads chunk files: one process restoring 1 GiB from SeaweedFS read
        0.36-0.47x the raw GET rate through a pool of synchronous ``read_range`` calls). Where
        ``caps.async_ranges`` (not the local engine, which reads ranges its own way)."""
        check_range(start, length)
        return _ObjectRead(self, key, length, None, None, start=start)

    def read_chunk_async(self, path: str, index: tuple[int, ...], nbytes: int, executor: Any = None,
                         into: np.ndarray | None = None) -> Any:
        """One chunk file's bytes as a future, the read issued now from this thread (no pool:
        the restore reader issues a batch's reads at once and checks each as it arrives): every
        ranged GET of PART_BYTES of the recorded size issued now; the result is an aligned
        buffer (`into` where given) the parts are copied into as they are taken. Same checks as
        read_exact: a confined key, never more than `nbytes` read, a shorter object is an error,
        and a longer one too (told by a one-byte probe, except on S3 and GCS: see _ObjectRead)."""
        return _ObjectRead(self, f"{path}/{chunk_key(index)}", nbytes, into, None)

    def _object_read_done(self) -> None:
        with self._lock:
            self._object_reads -= 1
            if self._object_reads <= 0:
                self._object_reads, self._last_part = 0, None  # nothing outlives the reads

    def _wait(self, future: Any, key: str, op: str) -> Any:
        """A request's result (TensorStore's exceptions as raised), within request_timeout_s."""
        return wait_for(future, _deadline(self._timeout_s), self._timeout_s, self.where(key), op)

    def _part(self, key: str, future: Any, nbytes: int, deadline: float | None = None) -> bytes:
        try:
            r = wait_for(future, deadline, self._timeout_s, self.where(key), "read")
        except TimeoutError:
            raise
        except Exception as e:
            if str(e).startswith("OUT_OF_RANGE"):
                # Shorter than a part that ends at most at nbytes: reading it whole to say its
                # size reads no more than that.
                raise size_mismatch(self.where(key), len(self._read(key) or b""), nbytes) from None
            raise storage_error(e, self.where(key)) from None
        if r.state != "value":
            raise FileNotFoundError(errno.ENOENT, "no such object", self.where(key))
        return r.value

    def _future(self, future: Any, key: str, op: str, cancellable: bool = False) -> MappedFuture:
        return MappedFuture(future, self.where(key), self._timeout_s, op, cancellable)

    def put(self, key: str, data: bytes) -> Any:
        return self._future(self.kv.write(key, bytes(data)), key, "write")

    def put_if_absent(self, key: str, data: bytes) -> None:
        # b"\x02" is TensorStore's "no value" generation: the write happens only if the key is
        # absent (If-None-Match: * on S3). A failed condition returns an empty generation.
        result = self._future(self.kv.write(key, bytes(data), if_equal=b"\x02"), key, "conditional write").result()
        if not result.generation:
            raise FileExistsError(errno.EEXIST, "already exists", self.where(key))

    def get_versioned(self, key: str, *, max_bytes: int) -> tuple[bytes | None, Any]:
        """(bytes, generation) from one read (a missing object: (None, the "no value"
        generation)); an object over `max_bytes` is a CheckpointError (small objects only:
        leases)."""
        check_key(key)
        try:
            if self._read(key, slice(max_bytes, max_bytes + 1)):  # never more than max_bytes read
                raise too_large(self.where(key), max_bytes)
        except FileNotFoundError:
            pass
        r = self._future(self.kv.read(key), key, "read").result()
        if r.state != "value":
            return None, b"\x02"
        if len(r.value) > max_bytes:
            raise too_large(self.where(key), max_bytes)
        return r.value, r.stamp.generation

    def put_if_version(self, key: str, data: bytes, version: Any) -> Any:
        # S3: PUT with If-Match: <ETag>; GCS: ifGenerationMatch; memory/file: the generation.
        result = self._future(self.kv.write(key, bytes(data), if_equal=version), key, "conditional write").result()
        return result.generation or None

    def _list(self, prefix: str) -> list[str]:
        rng = ts.KvStore.KeyRange(prefix, _successor(prefix))
        try:
            keys = self._wait(self.kv.list(rng, strip_prefix_length=len(prefix)), prefix, "list")
        except TimeoutError:
            raise
        except Exception as e:
            raise storage_error(e, self.where(prefix)) from None
        return [k.decode("utf-8", "surrogateescape") for k in keys]

    def exists(self, key: str) -> bool:
        if not key:
            return bool(self._list(""))
        # One LIST of the keys from `key` up to its successor (not a read of the object). Without
        # strip_prefix_length: TensorStore drops keys that it strips to '' (the s3 kvstore does).
        rng = ts.KvStore.KeyRange(key, _successor(key))
        try:
            keys = self._wait(self.kv.list(rng), key, "list")
        except TimeoutError:
            raise
        except Exception as e:
            raise storage_error(e, self.where(key)) from None
        return key.encode("utf-8", "surrogateescape") in keys

    def stat_many(self, keys) -> dict[str, int | None]:
        """-1 for each key that exists, None for a missing one, from one listing of everything
        below the keys' common directory (on S3/GCS: one LIST per 1000 objects; the default,
        a listing per directory, would be a LIST per row of chunks)."""
        keys = list(keys)
        if not keys:
            return {}
        common = os.path.commonprefix(keys)
        prefix = common[: common.rfind("/") + 1]
        present = set(self._list(prefix))
        return {k: -1 if k[len(prefix):] in present else None for k in keys}

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        files, dirs = set(), set()
        for rest in self._list(prefix):
            head, sep, _ = rest.partition("/")
            (dirs if sep else files).add(head)
        return sorted(files), sorted(dirs)

    def delete(self, key: str) -> None:
        self._future(self.kv.write(key, None), key, "delete").result()

    def delete_tree(self, prefix: str = "") -> None:
        prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        rng = ts.KvStore.KeyRange(prefix, _successor(prefix))
        self._future(self.kv.delete_range(rng), prefix, "delete").result()
        if self._spec.get("driver") == "file":  # the file driver leaves the empty directories
            shutil.rmtree(self._spec["path"] + prefix, ignore_errors=True)

    # ---- arrays ------------------------------------------------------------------------

    def _open_write(self, path: str, spec: ArraySpec) -> Any:
        metadata = zarr_metadata(spec)
        del metadata["zarr_format"], metadata["node_type"]
        return ts.open(
            {
                "driver": "zarr3",
                "kvstore": {**self._spec, "path": self._spec.get("path", "") + path + "/"},
                "metadata": metadata,
                "recheck_cached_metadata": False,
                "recheck_cached_data": False,
                # Every chunk is written, zeros included, so that a missing chunk always means
                # damage and reads can refuse it.
                "store_data_equal_to_fill_value": True,
            },
            assume_metadata=True,
            context=self._context,
        )

    def open_arrays(self, arrays: dict[Any, tuple[str, ArraySpec]]) -> dict[Any, Any]:
        futures = {k: (path, spec, self._open_write(path, spec)) for k, (path, spec) in arrays.items()}
        return {k: (self._future(f, path, "open").result(), path, spec.chunk_shape)
                for k, (path, spec, f) in futures.items()}

    def write_chunk(self, handle: Any, box: Box, data: np.ndarray) -> Any:
        # The library owns `data` and does not change it while the write runs, so TensorStore
        # may reference it instead of copying it (the staging pool reuses a buffer only once
        # nothing references it any more).
        array, path, chunk_shape = handle
        fut = array[box_to_index(box)].write(data, can_reference_source_data_indefinitely=True)
        # Cancellable on object stores (a save that stopped at its first failed chunk drops the
        # writes TensorStore has not sent; an S3 PUT lands whole or not at all).
        return self._future(fut, f"{path}/{chunk_key(chunk_index_of(box, chunk_shape))}", "write",
                            cancellable=self._remote)
