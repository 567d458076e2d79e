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
block, or allocate more than its files hold.

Saves in progress are never disturbed by anyone else: each staged directory or generation
carries an owner record (``OWNER_NAME``: host, boot, process) and, on local disk, a lock its
saving process holds; ``leftovers`` tells dead staged data (its owner provably gone) from a save
in progress, and only dead leftovers are ever removed (by the next save, or ``ckpt clean``).
"""

from __future__ import annotations

import contextlib
import errno
import json
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
    GENERATION_MARK, GROUP_METADATA, MANIFEST_NAME, TEMP_MARK, ArraySpec, array_metadata_bytes, is_temp_name,
)
from ckpt._geometry import Box, box_shape, chunk_key
from ckpt._memory import aligned_empty
from ckpt.storage._confine import check_key, check_local_key, file_kind
from ckpt.storage._owners import (
    _GENERATION,
    _OWN_TEMP,
    FOREIGN_OWNER_TTL_S,
    OWNER_LIMIT_BYTES,
    OWNER_NAME,
    UNOWNED_GRACE_S,
    Leftover,
    LiveMark,
    SaveLock,
    _boot_id,
    _Lease,
    owner_bytes,
    owner_gone,
    owner_record,
    owner_text,
    parse_owner,
)


class NotDurableError(CheckpointError):
    """The checkpoint WAS committed (it is in place and readable), but making the commit durable
    failed (an fsync after the rename): a crash now could still lose it."""

    committed = True


class Usage(NamedTuple):
    """What a location holds on disk (``Storage.du``)."""

    bytes: int
    files: int
    modified: float  # newest modification time below it, seconds since the epoch


_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def shared_pool(name: str, concurrency: int) -> ThreadPoolExecutor:
    """The process's thread pool `name` of `concurrency` threads (engines doing blocking I/O
    share one per name and width rather than starting threads per storage or per save)."""
    with _pools_lock:
        if (name, concurrency) not in _pools:
            _pools[name, concurrency] = ThreadPoolExecutor(concurrency, thread_name_prefix=name)
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
      restore can reuse its read buffers batch after batch.
    """

    engine: str = "?"
    renames: bool = False
    conditional_writes: bool = False
    reads_into_buffers: bool = False

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

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> None:
        """Write the object only if none exists; FileExistsError otherwise. Atomic where
        ``conditional_writes`` is set."""

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
        `overwrite`.

        Default (no rename): a fresh generation prefix inside this location."""
        if not overwrite and self.exists(MANIFEST_NAME):
            raise FileExistsError(errno.EEXIST, "checkpoint already exists (pass overwrite=True to replace it)", self.url)
        generation = f"{GENERATION_MARK}{secrets.token_hex(6)}"
        place = self.child(generation)
        mark = LiveMark(place.url)
        try:
            place.put_if_absent(OWNER_NAME, owner_bytes())
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
        then the previous checkpoint's data is deleted. `old_data()` names the top-level entries
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
        try:
            if overwrite:
                self.put(MANIFEST_NAME, manifest).result()
            else:
                self.put_if_absent(MANIFEST_NAME, manifest)
        except BaseException:
            # The write may have landed (an answer lost): the staged data stays, in case the
            # manifest points to it. Without its owner record it is a dead leftover the next
            # cleanup removes, unless a manifest references it.
            try:
                staged.storage.delete(OWNER_NAME)
            except OSError:
                pass
            raise
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

