"""The storage interface: everything that touches bytes, locations, listing and deletion.

A ``Storage`` is bound to one location (a directory or key prefix) and sees everything below it
by *key*: a relative, ``/``-separated path (``manifest.msgpack``, ``params/w/c/0/1``). It is
shaped like zarr-python's ``Store`` (get / set / set_if_not_exists / delete / list_dir, with
capability flags): bytes only. How a checkpoint becomes visible (staging, the manifest written
last, owner records, leftovers, leases) is ``ckpt._commit``'s, built on these primitives.

Every error an engine raises reaches callers as ``OSError`` (``FileNotFoundError`` for a missing
object, ``PermissionError``, ``ENOSPC``, ``EIO``...) or ``CheckpointError``, naming the object.

Reads are confined, on every engine: a key is a validated relative path inside the location
(``check_key``); only plain objects are read (on file systems: a regular file reached without
following a symbolic link; a link, directory, FIFO or device is a ``CheckpointError``); and no
read returns more bytes than the caller says the object should hold (``get``'s `max_bytes`,
``read_exact``'s `nbytes`), so a damaged or hostile checkpoint cannot make a reader leave it,
block, or allocate more than its files hold. Ranged reads (``read_range`` and ``size``, for files
jax-ckpt did not write: safetensors) are confined the same way, with one difference: on file
systems they follow a symbolic link whose target, resolved with ``realpath``, stays under the
location (a Hugging Face cache is made of links into its ``blobs/`` directory); a link that
leaves it is a ``CheckpointError`` naming the link. A jax-ckpt checkpoint's own files are never
read through a link.
"""

from __future__ import annotations

import contextlib
import errno
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import GROUP_METADATA, ArraySpec, array_metadata_bytes, check_key
from ckpt._geometry import Box, box_shape, chunk_key
from ckpt._host import aligned_empty


class Usage(NamedTuple):
    """What a location holds on disk (``Storage.du``)."""

    bytes: int
    files: int
    modified: float  # newest modification time below it, seconds since the epoch


# Objects larger than this are read in pieces of this size, so that an engine's own buffers stay
# bounded and only the caller's buffer holds a whole object (allocated first, where a failure is
# an error rather than an abort inside a C++ library).
READ_PIECE = 64 << 20


def read_buffer(nbytes: int, where: str) -> np.ndarray:
    """A 64-byte-aligned buffer for an object of `nbytes`; CheckpointError naming it when there
    is not enough memory (a hostile checkpoint may claim anything its files hold)."""
    try:
        return aligned_empty(nbytes)
    except MemoryError:
        raise CheckpointError(f"{where}: not enough memory for its {nbytes} bytes") from None


def chunk_bytes(data: np.ndarray, box: Box, chunk_shape: tuple[int, ...]) -> np.ndarray:
    """The bytes of a chunk file: `data` (the part of the chunk inside the array) padded to the
    full chunk shape with zeros (the fill value), as uint8."""
    if box_shape(box) != tuple(chunk_shape):
        full = np.zeros(chunk_shape, data.dtype)
        full[tuple(slice(0, n) for n in data.shape)] = data
        data = full
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def size_mismatch(where: str, got: int, want: int) -> CheckpointError:
    """The error for an object that does not hold the bytes it should (one wording everywhere)."""
    if got < want:
        return CheckpointError(f"{where} is truncated: {got} of {want} bytes")
    return CheckpointError(f"{where} holds {got} bytes, more than the {want} expected")


def range_short(where: str, start: int, length: int) -> CheckpointError:
    """The error for an object that ends inside a range asked of it (``read_range``)."""
    return CheckpointError(f"{where} is truncated: it ends before byte {start + length} "
                           f"(a read of {length} bytes from offset {start})")


def range_buffer(into: np.ndarray | None, length: int, where: str) -> np.ndarray:
    """Where ``read_range`` puts `length` bytes: the caller's `into` (1-D contiguous uint8 of at
    least `length` bytes) or a fresh 64-byte-aligned buffer."""
    if (into is not None and into.dtype == np.uint8 and into.ndim == 1 and into.flags.c_contiguous
            and len(into) >= length):
        return into[:length]
    return read_buffer(length, where)


def check_range(start: int, length: int) -> None:
    if start < 0 or length < 0:
        raise ValueError(f"a byte range starts at 0 or later and is not negative: got start={start}, length={length}")


# The largest object Storage.read_range's default reads whole to cut a range out of it.
WHOLE_READ_LIMIT = 1 << 40


def too_large(where: str, limit: int) -> CheckpointError:
    """The error for an object larger than it may be, found without reading all of it."""
    return CheckpointError(f"{where} holds more than the {limit} bytes expected")


class Done:
    """A future that is already finished (for engines whose operation is synchronous)."""

    def __init__(self, value: Any = None, error: BaseException | None = None):
        self._value, self._error = value, error

    def result(self, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def done(self) -> bool:
        return True

    def cancel(self) -> bool:
        return False  # (finished: nothing to cancel)


@dataclass(frozen=True)
class StoreCaps:
    """What a store can do, declared once by its engine as data (zarr-python's ``supports_*``),
    never probed. A capability that comes with methods of its own names them; those methods are
    the engine's (and ``WrapperStorage``'s, which forwards them), not the interface's.

    engine: the engine's name (``local``, ``tensorstore``, ``fsspec``).
    renames: the location is a directory of the local file system that the commit stages beside
      it and renames into place (``root``, ``sync``, ``make_dirs``, ``pin``, ``du``; the rename
      commit of ``ckpt._commit``).
    conditional_writes: ``put_if_absent`` is atomic against other writers.
    versioned_writes: ``get_versioned`` / ``put_if_version`` replace an object only if it is still
      the version read (a compare-and-swap: a lease takeover is atomic).
    reads_into_buffers: ``read_exact`` reads into the caller's buffer (``into``), so a restore can
      reuse its read buffers batch after batch.
    reads_refuse_longer: ``read_exact`` refuses an object longer than expected (where it does
      not, ``ckpt verify`` checks sizes itself).
    writes_in_place: ``open_pack`` writes a data object of the packed layout in place, chunk by
      chunk (local disk); otherwise a save assembles each data object and writes it with ``put``.
    response_part_bytes: the engine holds each ranged response (of this many bytes) whole in
      memory of its own until it is taken (TensorStore on object stores): the reader bounds its
      batches by it. None: reads land in the caller's buffers.
    async_ranges: ``read_range_async(key, start, length)`` issues a ranged read from the calling
      thread and returns its future (TensorStore), instead of a blocking ``read_range`` on a pool.
    """

    engine: str = "?"
    renames: bool = False
    conditional_writes: bool = False
    versioned_writes: bool = False
    reads_into_buffers: bool = False
    reads_refuse_longer: bool = True
    writes_in_place: bool = False
    response_part_bytes: int | None = None
    async_ranges: bool = False


class Storage(ABC):
    """One location and everything below it: bytes only (see the module docstring for the
    contract). What the engine can do besides is its ``caps`` (``StoreCaps``); the optional
    protocols a capability brings are ``ChunkFiles`` and ``LocalDirectory``."""

    caps: StoreCaps = StoreCaps()

    # ---- location ----------------------------------------------------------------------

    @property
    @abstractmethod
    def url(self) -> str:
        """The location, as shown in messages (a local path or a URL)."""

    @abstractmethod
    def child(self, key: str) -> "Storage":
        """The storage of the location `key` below this one."""

    @abstractmethod
    def parent(self) -> "Storage":
        """The storage of the location that holds this one."""

    def where(self, key: str) -> str:
        """The full location of `key`, for messages."""
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    @property
    def resolved_name(self) -> str:
        """The name of what the location really is (on file systems: after following a link to
        it), for the rule that no ``.tmp-`` directory is ever read as a checkpoint."""
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    # ---- bytes -------------------------------------------------------------------------

    @abstractmethod
    def get(self, key: str, *, max_bytes: int) -> bytes:
        """The object's bytes. FileNotFoundError when missing; CheckpointError when it holds more
        than `max_bytes` (nothing larger is ever read) or is not a plain object (module
        docstring: confined reads)."""

    def size(self, key: str) -> int | None:
        """The object's size in bytes, or None where the engine cannot tell without reading it.
        FileNotFoundError when missing; confined like ``read_range`` (a link under the location
        is followed). Default: from ``stat_many``."""
        got = self.stat_many([check_key(key)])[key]
        if got is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", self.where(key))
        return None if got < 0 else got

    def read_range(self, key: str, start: int, length: int, into: np.ndarray | None = None) -> np.ndarray:
        """Bytes ``[start, start + length)`` of the object, as a uint8 array of `length` (a view
        of `into` when that is a 1-D contiguous uint8 buffer of at least `length` bytes, else a
        fresh 64-byte-aligned buffer). FileNotFoundError when missing; CheckpointError naming the
        object when it ends before ``start + length`` or is not a plain object. Only the range
        is read where the engine can (every built-in engine can). Confined as the module
        docstring says, links under the location followed.

        Default (an engine without ranged reads): the whole object is read with ``get`` and cut,
        which is correct but reads all of it for every range."""
        check_range(start, length)
        where = self.where(key)
        data = self.get(key, max_bytes=WHOLE_READ_LIMIT)
        if len(data) < start + length:
            raise range_short(where, start, length)
        out = range_buffer(into, length, where)
        out[:] = np.frombuffer(data, np.uint8, length, start)
        return out

    @abstractmethod
    def put(self, key: str, data: bytes) -> Any:
        """Write (or replace) an object; returns a future (``result``, ``done``, ``cancel``),
        durable once it resolves."""

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> None:
        """Write the object only if none exists; FileExistsError otherwise. Atomic where
        ``caps.conditional_writes`` is set."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether the object `key` exists; for ``""``, whether anything exists at or below this
        location (on file systems: the directory itself)."""

    @abstractmethod
    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        """(objects, sub-locations) directly below `prefix`, names only, sorted."""

    def stat_many(self, keys: Iterable[str]) -> dict[str, int | None]:
        """key -> size in bytes, -1 when it exists but the size is unknown without reading it, or
        None when missing (one listing per directory by default)."""
        listed: dict[str, set[str]] = {}
        out: dict[str, int | None] = {}
        for key in keys:
            head, _, name = key.rpartition("/")
            if head not in listed:
                listed[head] = set(self.list_dir(head)[0])
            out[key] = -1 if name in listed[head] else None
        return out

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete one object; a missing one is not an error."""

    @abstractmethod
    def delete_tree(self, prefix: str = "") -> None:
        """Delete everything at or below `prefix` ('' for the whole location)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class ChunkFiles:
    """The optional protocol of engines that write and read a Zarr array's files themselves (every
    built-in engine: direct I/O on local disk, TensorStore's zarr driver, zarr-python), used by
    the files layout (``ckpt._layout``)."""

    def create_array(self, path: str, spec: ArraySpec) -> Any:
        """Write the array's zarr.json; returns a future."""
        return self.put(f"{path}/zarr.json", array_metadata_bytes(spec))

    def put_group(self, path: str) -> Any:
        """Write a group's zarr.json ('' for the root); returns a future."""
        return self.put(f"{path}/zarr.json" if path else "zarr.json", GROUP_METADATA)

    def open_arrays(self, arrays: dict[Any, tuple[str, ArraySpec]]) -> dict[Any, Any]:
        """Handles to write chunks of many arrays (by caller's key), without touching storage."""
        raise NotImplementedError

    def write_chunk(self, handle: Any, box: Box, data: np.ndarray) -> Any:
        """Write one whole chunk (`box` is the chunk's region of the array, `data` its values, in
        the storage dtype); returns a future, durable once it resolves. The caller owns `data` and
        does not change it until then."""
        raise NotImplementedError

    def read_exact(self, key: str, nbytes: int, into: np.ndarray | None = None) -> np.ndarray:
        """The object's bytes into a fresh 64-byte-aligned uint8 buffer. FileNotFoundError when
        missing; CheckpointError naming the object when it does not hold exactly `nbytes` (no
        more than `nbytes` is ever read, nor allocated before the size is known to fit) or is not
        a plain object. `into`: a page-aligned uint8 buffer of `nbytes` rounded up to whole pages
        plus one page, which engines with ``caps.reads_into_buffers`` read into (the result is
        then a view of it); others ignore it."""
        raise NotImplementedError

    def read_chunk(self, path: str, index: tuple[int, ...], nbytes: int, into: np.ndarray | None = None) -> np.ndarray:
        """The bytes of one chunk file of the array at `path` (see read_exact)."""
        return self.read_exact(f"{path}/{chunk_key(index)}", nbytes, into)

    def read_chunk_async(self, path: str, index: tuple[int, ...], nbytes: int, executor: Any,
                         into: np.ndarray | None = None) -> Any:
        """Start reading one chunk file (see read_chunk): a future whose ``result()`` is its
        bytes (possibly a read-only array). The restore reader issues a batch's reads at once
        and checks each as it is used. The default runs read_chunk on `executor` (the reader's
        pool, ``io_concurrency`` threads); engines with asynchronous I/O of their own override
        it to issue the read from the calling thread, with the same checks as read_exact."""
        return executor.submit(self.read_chunk, path, index, nbytes, into)


class LocalDirectory:
    """The optional protocol of a location that is a directory of the local file system
    (``caps.renames``): its path, the commit's directory fsync, and reads pinned to the directory
    that was there when they began. Reach it through ``pinned``, ``usage``, ``make_dirs``."""

    root: str

    def make_dirs(self) -> None:
        """Create this directory (and its parents)."""
        raise NotImplementedError

    def sync(self, key: str = "") -> None:
        """fsync the file or directory `key`."""
        raise NotImplementedError

    def pin(self) -> contextlib.AbstractContextManager["Storage"]:
        """A context whose storage keeps reading what is at this location now, even if the
        location is replaced meanwhile (an overwrite's rename): a reader never mixes two
        checkpoints."""
        raise NotImplementedError

    def du(self) -> Usage:
        """Bytes, files and newest modification time at or below this directory."""
        raise NotImplementedError
