"""The storage interface: everything that touches bytes, locations, listing and deletion.

A ``Storage`` is bound to one location (a directory or key prefix) and sees everything below it
by *key*: a relative, ``/``-separated path (``manifest.msgpack``, ``params/w/c/0/1``). It is
shaped like zarr-python's ``Store`` (get / set / set_if_not_exists / delete / list_dir, with
capability flags) for bytes, and like PyTorch DCP's ``StorageWriter`` for the commit: the save
path stages data with ``stage``, and ``commit(staged, manifest)`` makes it a checkpoint in one
step (``finish(metadata)`` in DCP). Engines implement the primitives; the commit built on them
lives here, once, for every backend:

* the manifest is the commit point: written last, and only where none is (a rename of a staged
  directory on local disk, a write-if-absent elsewhere);
* a location without a manifest is never a checkpoint;
* an overwrite never exposes a mix of old and new data: new data goes to a fresh place that only
  the new manifest points to (a staged directory swapped in by rename, or a fresh generation
  prefix), and old data is deleted only after the new manifest is in place.

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

Saves in progress are never disturbed by anyone else: each staged directory or generation
carries an owner record (``OWNER_NAME``: host, boot, process) and, on local disk, a lock its
saving process holds; ``leftovers`` tells dead staged data (its owner provably gone) from a save
in progress, and only dead leftovers are ever removed (by the next save, or ``ckpt clean``).
"""

from __future__ import annotations

import contextlib
import errno
import queue
import secrets
import threading
import warnings
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple

import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import (
    GENERATION_MARK,
    GROUP_METADATA,
    MANIFEST_NAME,
    ArraySpec,
    array_metadata_bytes,
)
from ckpt._geometry import Box, box_shape, chunk_key
from ckpt._memory import aligned_empty
from ckpt.storage._confine import check_key
from ckpt.storage._owners import (
    _GENERATION,
    _OWN_TEMP,
    OWNER_LIMIT_BYTES,
    OWNER_NAME,
    Leftover,
    LiveMark,
    SaveLock,
    _Lease,
    owner_bytes,
    owner_gone,
    parse_owner,
)


def not_a_checkpoint(where: str, what: str) -> FileExistsError:
    """The error of a save to a location that holds something other than a jax-ckpt checkpoint
    (user files, another library's checkpoint, a manager directory): never replaced, whatever
    `overwrite` says."""
    return FileExistsError(errno.EEXIST, f"exists and is not a jax-ckpt checkpoint ({what}); nothing was written, "
                                         "and overwrite replaces only a jax-ckpt checkpoint", where)


def _some(names: list[str], most: int = 3) -> str:
    shown = ", ".join(repr(n) for n in sorted(names)[:most])
    return f"{len(names)} entr{'y' if len(names) == 1 else 'ies'}: {shown}" + (", ..." if len(names) > most else "")


class NotDurableError(CheckpointError):
    """The checkpoint WAS committed (it is in place and readable), but making the commit durable
    failed (an fsync after the rename): a crash now could still lose it."""

    committed = True


class OutcomeUnknownError(CheckpointError):
    """A write whose outcome cannot be told: it failed in a way that may have landed (an answer
    lost, a timeout), and reading the object back failed too. For a manifest: the checkpoint may
    or may not be committed, and nothing the save wrote was deleted (docs/storage.md, "What a
    save's error means")."""

    committed = None


def may_still_land(error: BaseException) -> bool:
    """Whether a failed request may still be applied by the server after the caller saw it fail:
    a timeout of the caller's own (the request may be in flight, or queued in a client's retry
    loop), so that an object missing on a read-back does not prove it will stay missing."""
    return isinstance(error, TimeoutError) or getattr(error, "errno", None) == errno.ETIMEDOUT


class Usage(NamedTuple):
    """What a location holds on disk (``Storage.du``)."""

    bytes: int
    files: int
    modified: float  # newest modification time below it, seconds since the epoch


class _ExitSafePool(ThreadPoolExecutor):
    """A ThreadPoolExecutor whose work still runs where no thread may start: Python 3.12.0 and
    3.12.1 refuse every new thread once the interpreter is exiting ("can't create new thread at
    interpreter shutdown", even in the threading exit hooks; allowed again from 3.12.2, CPython
    gh-113964), which is when a save the program did not wait() for finishes (_save's exit hook).
    Such work runs on the threads the pool already has or, where it has none, in the submitting
    thread (the engines' work never submits to its own pool, so this cannot deadlock)."""

    def _adjust_thread_count(self) -> None:
        try:
            super()._adjust_thread_count()
        except RuntimeError as e:
            if "interpreter shutdown" not in str(e):
                raise
            if getattr(self, "_threads", None):
                return  # (queued: a thread of the pool takes it)
            while True:  # no thread at all: run what is queued here (submit queued it before)
                try:
                    item = self._work_queue.get_nowait()
                except queue.Empty:
                    return
                if item is not None:
                    item.run()


_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def shared_pool(name: str, concurrency: int) -> ThreadPoolExecutor:
    """The process's thread pool `name` of `concurrency` threads (engines doing blocking I/O
    share one per name and width rather than starting threads per storage or per save)."""
    with _pools_lock:
        if (name, concurrency) not in _pools:
            _pools[name, concurrency] = _ExitSafePool(concurrency, thread_name_prefix=name)
        return _pools[name, concurrency]


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


def _text(e: BaseException) -> str:
    return str(e) or type(e).__name__


def os_error(code: int, what: str, where: str) -> OSError:
    """An OSError of the right subclass for `code` (e.g. FileNotFoundError for ENOENT)."""
    return OSError(code, what, where)


@dataclass(frozen=True)
class Staged:
    """Where a save writes before its commit.

    storage: the location array keys are written under; prefix: prepended to every storage path
    recorded in the manifest (a generation prefix, or '' when the staged directory becomes the
    checkpoint by rename); info: what other processes need to find the same place
    (``Storage.staged_from(info)``), msgpack-able.
    """

    storage: "Storage"
    prefix: str
    info: dict
    # The primary's hold on the staged place (released by commit or abort), None elsewhere.
    lock: Any = field(default=None, compare=False, repr=False)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


class Storage(ABC):
    """One location and everything below it. See the module docstring for the contract.

    Capability flags:
      ``renames``: a staged directory is published by an atomic rename (local disk);
      ``conditional_writes``: ``put_if_absent`` is atomic against other writers;
      ``reads_into_buffers``: ``read_exact`` reads into the caller's buffer (``into``), so a
      restore can reuse its read buffers batch after batch;
      ``versioned_writes``: ``get_versioned`` / ``put_if_version`` replace an object only if it
      is still the version read (a compare-and-swap: a lease takeover is atomic);
      ``reads_refuse_longer``: ``read_exact`` refuses an object longer than expected (where it
      does not, ``ckpt verify`` checks sizes itself).
    """

    engine: str = "?"
    renames: bool = False
    conditional_writes: bool = False
    reads_into_buffers: bool = False
    versioned_writes: bool = False
    reads_refuse_longer: bool = True

    # ---- location ----------------------------------------------------------------------

    @property
    @abstractmethod
    def url(self) -> str:
        """The location, as shown in messages (a local path or a URL)."""

    @property
    def name(self) -> str:
        """The last component of the location."""
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @abstractmethod
    def child(self, key: str) -> "Storage":
        """The storage of the location `key` below this one."""

    @abstractmethod
    def parent(self) -> "Storage":
        """The storage of the location that holds this one."""

    def make_dirs(self) -> None:
        """Create this location where the backend has directories (a no-op on object stores)."""

    def where(self, key: str) -> str:
        """The full location of `key`, for messages."""
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    # ---- bytes -------------------------------------------------------------------------

    @property
    def resolved_name(self) -> str:
        """The name of what the location really is (on file systems: after following a link to
        it), for the rule that no ``.tmp-`` directory is ever read as a checkpoint."""
        return self.name

    @abstractmethod
    def get(self, key: str, *, max_bytes: int) -> bytes:
        """The object's bytes. FileNotFoundError when missing; CheckpointError when it holds more
        than `max_bytes` (nothing larger is ever read) or is not a plain object (module
        docstring: confined reads)."""

    @abstractmethod
    def read_exact(self, key: str, nbytes: int, into: np.ndarray | None = None) -> np.ndarray:
        """The object's bytes into a fresh 64-byte-aligned uint8 buffer. FileNotFoundError when
        missing; CheckpointError naming the object when it does not hold exactly `nbytes` (no
        more than `nbytes` is ever read, nor allocated before the size is known to fit) or is not
        a plain object. `into`: a page-aligned uint8 buffer of `nbytes` rounded up to whole pages
        plus one page, which engines with ``reads_into_buffers`` read into (the result is then
        a view of it); others ignore it."""

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

    def read_window_bytes(self, io_concurrency: int) -> int | None:
        """The most chunk bytes a restore reads in one batch here, with `io_concurrency`
        requests in flight (None: as many as the host budget allows). An engine whose reads
        land in memory of its own before they reach the caller's buffers bounds it, so that
        this memory is reused batch after batch instead of faulted in fresh for every byte."""
        return None

    def pin(self) -> contextlib.AbstractContextManager["Storage"]:
        """A context whose storage keeps reading what is at this location now, even if the
        location is replaced meanwhile (an overwrite): a reader never mixes two checkpoints.
        Generations are never rewritten, so by default that is this storage itself; the local
        engine reads through the directory it opened."""
        return contextlib.nullcontext(self)

    @abstractmethod
    def put(self, key: str, data: bytes) -> Any:
        """Write (or replace) a small object; returns a future, durable once it resolves."""

    # Whether ``open_pack`` writes a data object of the packed layout in place, chunk by chunk
    # (local disk); otherwise the save assembles each data object and writes it with ``put``.
    streams_packs = False

    def open_pack(self, key: str) -> Any:
        """A data object of the packed layout (formats/SPEC.md section 13), written in place:
        ``write_at(offset, array) -> future`` (done once the bytes are in the file; the caller
        does not change the array until then) and ``close(size) -> future`` (after every write
        finished: the object's size set and it made durable). Where ``streams_packs``."""
        raise NotImplementedError(f"{type(self).__name__} writes data objects whole (streams_packs is False)")

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> None:
        """Write the object only if none exists; FileExistsError otherwise. Atomic where
        ``conditional_writes`` is set."""

    def get_versioned(self, key: str, *, max_bytes: int) -> tuple[bytes | None, Any]:
        """(bytes or None when missing, version) of the object, for ``put_if_version``. Only
        where ``versioned_writes``."""
        raise NotImplementedError(f"{type(self).__name__} has no versioned writes")

    def put_if_version(self, key: str, data: bytes, version: Any) -> Any:
        """Replace the object only if it is still at `version` (from ``get_versioned``; a
        missing object's version means: only if still missing). Returns the new version, or None
        when the object changed meanwhile (nothing written). Only where ``versioned_writes``."""
        raise NotImplementedError(f"{type(self).__name__} has no versioned writes")

    def create(self, key: str, data: bytes, *, what: str = "object") -> None:
        """``put_if_absent`` that is safe against lost answers and its engine's own retries:
        when the write reports that the object exists, or fails in a way that may have landed
        (a reset after the server stored it, a 500, a timeout), the object is read back, and
        if it holds exactly `data` the write succeeded (`data` must be unique to this writer:
        a manifest names a fresh generation, owner records and leases carry a token).
        FileExistsError when another writer's object is there; the write's own error when it
        provably did not land; OutcomeUnknownError (naming `what` and the object) when neither
        the write nor the read-back can tell."""
        try:
            self.put_if_absent(key, data)
            return
        except Exception as e:  # noqa: BLE001 (settled below)
            self.settle_write(key, data, e, what=what)

    def settle_write(self, key: str, data: bytes, error: BaseException, *, what: str = "object",
                     replace: bool = False) -> None:
        """After a write of `data` to `key` failed with `error`: return if the object holds
        exactly `data` (the write landed, its answer lost or its retry refused), raise otherwise
        (see ``create``). A missing object (with `replace`, an unconditional write: any other
        object) means the write did not land, and the error is raised, unless the error says it
        may still land (``may_still_land``): then OutcomeUnknownError."""
        try:
            there = self.get(key, max_bytes=max(len(data), 1))
        except FileNotFoundError:
            there = None
        except CheckpointError:
            there = b""  # larger than ours, or no plain object: not ours
        except Exception as e2:
            raise OutcomeUnknownError(
                f"{what} {self.where(key)}: outcome unknown (written or not): the write failed ({_text(error)}) "
                f"and reading it back failed too ({_text(e2)})") from error
        if there == data:
            return
        if there is None or replace:
            if isinstance(error, FileExistsError) and not replace:
                raise error
            if may_still_land(error):
                raise OutcomeUnknownError(
                    f"{what} {self.where(key)}: outcome unknown (written or not): the write failed "
                    f"({_text(error)}) and may still land") from error
            raise error
        if isinstance(error, FileExistsError):
            raise error
        raise FileExistsError(errno.EEXIST, f"already exists (another writer's; our write failed: {_text(error)})",
                              self.where(key)) from error

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether the object `key` exists."""

    @abstractmethod
    def exists_any(self) -> bool:
        """Whether anything exists at or below this location."""

    @abstractmethod
    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        """(objects, sub-locations) directly below `prefix`, names only, sorted."""

    def du(self) -> Usage | None:
        """Bytes, objects and newest modification time at or below this location, or None where
        the engine cannot tell without reading every object (``ckpt ls`` then sizes committed
        checkpoints from their manifests)."""
        return None

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete one object; a missing one is not an error."""

    @abstractmethod
    def delete_tree(self, prefix: str = "") -> None:
        """Delete everything at or below `prefix` (this whole location for '')."""

    def sync(self, key: str = "") -> None:
        """Make the directory `key` and its entries durable (fsync). A no-op where objects are
        durable once written."""

    def stat_many(self, keys: Iterable[str]) -> dict[str, int | None]:
        """Size in bytes of each object (-1 where the engine can only tell that it exists), None
        for a missing one. By default one listing per directory the keys are in."""
        listed: dict[str, set[str]] = {}
        out: dict[str, int | None] = {}
        for key in keys:
            head, _, name = key.rpartition("/")
            if head not in listed:
                listed[head] = set(self.list_dir(head)[0])
            out[key] = -1 if name in listed[head] else None
        return out

    # ---- arrays ------------------------------------------------------------------------

    def create_array(self, path: str, spec: ArraySpec) -> Any:
        """Write the array's zarr.json; returns a future."""
        return self.put(f"{path}/zarr.json", array_metadata_bytes(spec))

    def put_group(self, path: str) -> Any:
        """Write a group's zarr.json ('' for the root); returns a future."""
        return self.put(f"{path}/zarr.json" if path else "zarr.json", GROUP_METADATA)

    @abstractmethod
    def open_arrays(self, arrays: dict[Any, tuple[str, ArraySpec]]) -> dict[Any, Any]:
        """Handles to write chunks of many arrays (by caller's key), without touching storage."""

    @abstractmethod
    def write_chunk(self, handle: Any, box: Box, data: np.ndarray) -> Any:
        """Write one whole chunk (`box` is the chunk's region of the array, `data` its values, in
        the storage dtype); returns a future, durable once it resolves. The caller owns `data` and
        does not change it until then."""

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

    # ---- commit ------------------------------------------------------------------------

    def stage(self, *, overwrite: bool) -> Staged:
        """Check this location and prepare the place a save writes to (primary process only),
        its owner record written first. FileExistsError when a checkpoint is here and not
        `overwrite`, and, overwrite or not, when something that is not a jax-ckpt checkpoint is
        here (``not_a_checkpoint``): an overwrite replaces only a checkpoint.

        Default (no rename): a fresh generation prefix inside this location."""
        files, dirs = self.list_dir("")
        if MANIFEST_NAME not in files:
            # Generation prefixes without a manifest are what failed saves leave: not data.
            others = files + [f"{d}/" for d in dirs if not d.startswith(GENERATION_MARK)]
            if others:
                raise not_a_checkpoint(self.url, f"it holds {_some(others)}")
        elif not overwrite:
            raise FileExistsError(errno.EEXIST, "checkpoint already exists (pass overwrite=True to replace it)", self.url)
        generation = f"{GENERATION_MARK}{secrets.token_hex(6)}"
        place = self.child(generation)
        mark = LiveMark(place.url)
        try:
            # (A lost answer retried is our own record, recognised: owner records carry a token.)
            try:
                place.create(OWNER_NAME, owner_bytes(), what="owner record")
            except OutcomeUnknownError as e:
                # Nothing can have been committed yet: a plain failure of the save.
                raise CheckpointError(f"save to {self.url} failed before writing anything else, nothing "
                                      f"committed: {e}") from e
        except BaseException:
            mark.release()
            raise
        return Staged(place, generation + "/", {"generation": generation}, mark)

    def staged_from(self, info: dict) -> Staged:
        """The same Staged as the primary's ``stage`` returned, from its `info`."""
        generation = info["generation"]
        return Staged(self.child(generation), generation + "/", info)

    def publish(self, staged: Staged, *, overwrite: bool) -> "Storage | None":
        """Rename backends only: move the staged directory (manifest inside) to this location in
        one atomic step, replacing what is here when `overwrite`. Returns the storage now holding
        what was displaced (to delete once the commit is durable), or None. Raises only if
        nothing was moved (an engine that cannot tell checks where its staged directory is)."""
        raise NotImplementedError(f"{type(self).__name__} has no rename")

    def commit(self, staged: Staged, manifest: bytes, *, overwrite: bool,
               old_data: Callable[[], Iterable[str]] | None = None) -> None:
        """Write the manifest last, making the staged data a checkpoint at this location; then
        remove leftovers of dead saves beside it (``leftovers``). The staged place's lock is
        released in every case.

        Rename backends: the owner record is removed, the manifest written (fsynced) into the
        staged directory and the directory fsynced; ``publish`` renames it into place; then the
        parent is fsynced (a failure there raises NotDurableError: committed, maybe not durable,
        and the displaced old checkpoint is kept), and the displaced checkpoint is deleted.

        Otherwise: the manifest is written if absent (FileExistsError when another save
        committed first; its data is untouched), or, when overwriting, replaced in one write;
        then the previous checkpoint's data is deleted. A manifest write that fails is settled
        by reading the manifest back: ours there is a commit; OutcomeUnknownError when that
        cannot be told (the caller then deletes nothing: ``_save.commit.after_failed_commit``). `old_data()` names the top-level entries
        the previous manifest referenced (evaluated before the new manifest is written).
        """
        try:
            if self.renames:
                self._commit_by_rename(staged, manifest, overwrite=overwrite)
            else:
                self._commit_by_conditional_write(staged, manifest, overwrite=overwrite, old_data=old_data)
        finally:
            staged.release()
        if self.renames or overwrite:  # (elsewhere only an overwritten location can hold some)
            self.remove_dead_leftovers(keep=staged)

    def _commit_by_rename(self, staged: Staged, manifest: bytes, *, overwrite: bool) -> None:
        place = staged.storage
        place.delete(OWNER_NAME)  # the checkpoint holds only what the format describes
        place.put_if_absent(MANIFEST_NAME, manifest)
        place.sync("")
        displaced = self.publish(staged, overwrite=overwrite)
        # Committed: from here on the save has succeeded, whatever fails.
        try:
            self.parent().sync("")
        except OSError as e:
            raise NotDurableError(
                f"checkpoint {self.url} was committed (it is in place and readable), but it may not be durable: "
                f"syncing its directory entry failed: {e}"
                + (f"; the previous checkpoint is kept at {displaced.url}" if displaced is not None else "")
            ) from e
        if displaced is not None:
            try:
                displaced.delete_tree("")
            except OSError as e:
                warnings.warn(f"checkpoint {self.url} committed, but the previous one at {displaced.url} could not "
                              f"be deleted: {e}", RuntimeWarning, stacklevel=3)

    def _commit_by_conditional_write(self, staged: Staged, manifest: bytes, *, overwrite: bool,
                                     old_data: Callable[[], Iterable[str]] | None) -> None:
        stale = list(old_data()) if (overwrite and old_data is not None) else []
        # The manifest names this save's fresh generation, so its bytes are this save's own: a
        # write that reports failure (or "exists": its own retry of a write whose answer was
        # lost) is settled by reading the manifest back (``settle_write``). Raises
        # FileExistsError (another save committed first), OutcomeUnknownError (neither the
        # write nor the read-back can tell: nothing may be deleted), or the write's own error
        # when it provably did not land.
        if overwrite:
            try:
                self.put(MANIFEST_NAME, manifest).result()
            except Exception as e:  # noqa: BLE001 (settled)
                self.settle_write(MANIFEST_NAME, manifest, e, what="manifest", replace=True)
        else:
            self.create(MANIFEST_NAME, manifest, what="manifest")
        # Committed: from here on nothing may fail the save. Old data that cannot be deleted
        # now is unreferenced and only costs space.
        keep = staged.prefix.rstrip("/")
        for entry in stale:
            if entry == keep:
                continue
            try:
                self.delete(entry) if entry.endswith(".json") else self.delete_tree(entry)
            except OSError as e:
                warnings.warn(f"checkpoint {self.url} committed, but its previous data {self.where(entry)} "
                              f"could not be deleted: {e}", RuntimeWarning, stacklevel=3)
        try:
            staged.storage.delete(OWNER_NAME)
        except OSError as e:
            warnings.warn(f"checkpoint {self.url} committed, but its owner record could not be removed: {e}",
                          RuntimeWarning, stacklevel=3)

    def abort(self, staged: Staged) -> None:
        """Remove what a save that will not commit staged, then release its lock."""
        try:
            staged.storage.delete_tree("")
        finally:
            staged.release()

    # ---- leftovers of saves ----------------------------------------------------------------

    def staging_area(self) -> "Storage":
        """Where saves to this location stage (the parent on rename backends, else here)."""
        return self.parent() if self.renames else self

    def leftovers(self, referenced: Iterable[str] = ()) -> list[Leftover]:
        """Staged data of saves directly below this location, each judged dead or alive:
        temporary directories the library names (``<name>.tmp-<hex>``) and generation prefixes
        not in `referenced` (the generations a manifest here points to). Default (no locks):
        dead when the owner record is missing (a generation's record is its first object, and
        goes only once its manifest is written) or names a process provably gone."""
        files, dirs = self.list_dir("")
        keep = {r.strip("/") for r in referenced}
        out = []
        for name in dirs:
            if name in keep or not (_OWN_TEMP.fullmatch(name) or _GENERATION.fullmatch(name)):
                continue
            out.append(self._judge(name))
        return out

    def _judge(self, name: str) -> Leftover:
        try:
            owner = parse_owner(self.get(f"{name}/{OWNER_NAME}", max_bytes=OWNER_LIMIT_BYTES))
        except FileNotFoundError:
            return Leftover(name, True, "no save owns it (no owner record)")
        except (OSError, CheckpointError) as e:
            return Leftover(name, False, f"its owner record cannot be read ({e})")
        if owner is None:
            return Leftover(name, False, "its owner record is unreadable")
        dead, why = owner_gone(owner, place=self.where(name))
        return Leftover(name, dead, why, owner)

    def remove_leftover(self, leftover: Leftover) -> bool:
        """Remove a dead leftover if it is still dead; whether it was removed."""
        now = self._judge(leftover.name)
        if not now.dead:
            return False
        # A committed save writes its manifest before it removes its owner record, so a
        # generation seen without an owner may be the data of a checkpoint that committed since
        # this location was judged uncommitted: a generation the manifest here now mentions
        # stays (at worst a crashed save's bytes are left behind; never a checkpoint's data
        # deleted). Generations it does not mention (an overwritten checkpoint's) still go.
        if leftover.name.startswith(GENERATION_MARK) and self._manifest_mentions(leftover.name):
            return False
        self.delete_tree(leftover.name)
        return True

    def _manifest_mentions(self, name: str) -> bool:
        """Whether the manifest here (if any) holds the text `name` anywhere (a storage path in
        it, so its generation is referenced); True when it cannot be read (keep, to be safe)."""
        try:
            return name.encode() in self.get(MANIFEST_NAME, max_bytes=1 << 30)
        except FileNotFoundError:
            return False
        except (OSError, CheckpointError):
            return True

    def remove_dead_leftovers(self, keep: Staged | None = None) -> list[str]:
        """Remove the dead leftovers of saves where saves to this location stage (the next save
        to the same parent cleans up after crashed ones); failures are warnings. Returns what was
        removed. On backends without rename only the generations inside this checkpoint are
        looked at, and only when it has a manifest (the manager handles uncommitted steps)."""
        area = self.staging_area()
        removed = []
        try:
            if self.renames:
                found = area.leftovers()
            else:
                if not self.exists(MANIFEST_NAME):
                    return []
                found = self.leftovers([keep.prefix] if keep is not None else [])
            for leftover in found:
                if leftover.dead and area.remove_leftover(leftover):
                    removed.append(area.where(leftover.name))
        except (OSError, CheckpointError) as e:
            warnings.warn(f"could not remove leftovers of earlier saves in {area.url}: {e}", RuntimeWarning,
                          stacklevel=2)
        return removed

    def lock_saves(self) -> SaveLock:
        """Claim this location (a manager directory) for one saver: CheckpointError naming the
        holder when another one has it. Default (no locks): a lease object renewed in the
        background while held and presumed abandoned after LEASE_TTL_S without renewal."""
        return _Lease.acquire(self)

    def retire(self) -> None:
        """Delete the checkpoint at this location so that no moment shows a half-deleted one as
        committed: the manifest goes first, then the data."""
        self.delete(MANIFEST_NAME)
        self.delete_tree("")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

