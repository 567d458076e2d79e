"""How a checkpoint becomes visible: the ``CommitStrategy`` interface, what every strategy shares
(owner records and locks, the judgement of leftovers, the coordinator the processes of a save
agree through), and the commit door (``commit_for``, ``commit_checkpoint``). The strategies
themselves are ``rename.RenameCommit`` (local disk) and ``generation.GenerationCommit`` (object
stores).

The contract every strategy keeps (formats/SPEC.md section 10):

* the manifest is the commit point: written last, and only where none is;
* a location without a manifest is never a checkpoint;
* an overwrite never exposes a mix of old and new data: new data goes to a fresh place that only
  the new manifest points to, and old data is deleted only after the new manifest is in place;
* staged data carries an owner record, and only the leftovers of saves provably gone are removed.

A strategy works on a store only through the store's own members, so a wrapper around the store
(``ckpt.storage.WrapperStorage``) sees every byte a commit reads and writes.

Owners. A save's staged place (a ``<path>.tmp-<hex>`` directory, a ``gen-<hex>/`` generation)
holds an owner record, ``.owner``: host, boot id, pid and the process's start time, written
first. From it (and, on local disk, from the ``flock`` the saving process holds) a strategy's
``leftovers`` tells the leftover of a save that died from a save in progress, on this machine or
another; only the first is ever removed. A manager directory has one saver at a time: a
directory lock, or on storage without locks a renewed lease (``lease.SaverLease``).

Size: the commit's contract and what both strategies share (owner records, the coordinator, the
door) run on every local save; one module keeps that walk short (docs/design.md).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import socket
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from ckpt._errors import CheckpointError, NotDurableError, OutcomeUnknownError
from ckpt._format import DATA_DIR, GENERATION_MARK, Manifest, read_manifest
from ckpt.storage import Storage


# ---- owners -------------------------------------------------------------------------

# Names of the temporary directories the library itself creates (staged saves, old checkpoints
# being deleted or moved aside): only these are ever removed as leftovers.
OWN_TEMP = re.compile(r".+\.tmp-(?:(deleted|old)-)?[0-9a-f]{12}")
GENERATION = re.compile(r"gen-[0-9a-f]{12}")
OWNER_NAME = ".owner"  # inside a staged directory or generation while its save runs
OWNER_LIMIT_BYTES = 4096
# Staged data without an owner record is left alone this long (a save writes its record right
# after creating the place, and removes it just before publishing).
UNOWNED_GRACE_S = 600.0
# Staged data whose owner runs on another machine is presumed dead only after this long.
FOREIGN_OWNER_TTL_S = 24 * 3600.0


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> str:
    """The process's start time (clock ticks since boot), which tells a pid reused from it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def owner_record() -> dict:
    """Who is writing: enough to tell later whether that process is still alive."""
    return {"host": socket.gethostname(), "boot_id": boot_id(), "pid": os.getpid(),
            "start": _process_start(os.getpid()), "time": time.time()}


def owner_bytes() -> bytes:
    # A token makes each record unique, so that a writer recognises its own on a read-back
    # (a retried write-if-absent whose first answer was lost: Storage.create).
    return json.dumps({**owner_record(), "token": secrets.token_hex(8)}).encode()


def parse_owner(data: bytes | None) -> dict | None:
    try:
        rec = json.loads(data) if data is not None else None
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def owner_text(owner: dict | None) -> str:
    if not owner:
        return "no owner record"
    return f"pid {owner.get('pid')} on host {owner.get('host')}"


# Staged places this process is saving to now (their URLs): the one owner a process can judge
# exactly is itself.
_LIVE: set[str] = set()
_LIVE_LOCK = threading.Lock()


class LiveMark:
    """Marks a staged place as being saved to by this process until released."""

    def __init__(self, place: str):
        self.place = place
        with _LIVE_LOCK:
            _LIVE.add(place)

    def release(self) -> None:
        with _LIVE_LOCK:
            _LIVE.discard(self.place)


def owner_gone(owner: dict, *, now: float | None = None, place: str | None = None) -> tuple[bool, str]:
    """(True, why) when the owning process provably no longer runs that save: it is this process
    and `place` is none of its saves in progress; on this machine (same boot), its pid is gone or
    now belongs to a process started at another time; on this host before its last restart;
    on another machine, when the record is older than FOREIGN_OWNER_TTL_S. (False, why)
    otherwise."""
    now = time.time() if now is None else now
    pid, who = owner.get("pid"), owner_text(owner)
    boot = boot_id()
    if place is not None and boot and owner.get("boot_id") == boot and pid == os.getpid() \
            and owner.get("start") == _process_start(os.getpid()):
        with _LIVE_LOCK:
            live = place in _LIVE
        return (False, f"a save in progress ({who}: this process)") if live else \
            (True, f"its save ({who}: this process) ended without committing it")
    if boot and owner.get("boot_id") == boot and isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True, f"its owner ({who}) has exited"
        except PermissionError:
            pass
        except OverflowError:
            return True, f"its owner record names an impossible pid {pid}"
        start = _process_start(pid)
        if start and owner.get("start") and start != owner.get("start"):
            return True, f"its owner ({who}) has exited (the pid now belongs to another process)"
        return False, f"a save in progress ({who})"
    if boot and owner.get("host") == socket.gethostname() and owner.get("boot_id") and owner.get("boot_id") != boot:
        return True, f"its owner ({who}) ran before this machine last started"
    age = now - owner["time"] if isinstance(owner.get("time"), (int, float)) else float("inf")
    if age > FOREIGN_OWNER_TTL_S:
        return True, f"its owner ({who}) last wrote {age / 3600:.0f} h ago"
    return False, f"a save in progress ({who}, another machine, {age:.0f} s ago)"


@dataclass(frozen=True)
class Leftover:
    """Staged data of a save directly below a location: a temporary directory (``<name>.tmp-...``)
    or a generation prefix no manifest references. `dead`: its save provably ended without
    committing it (or it is an old checkpoint being deleted), so removing it disturbs nobody."""

    name: str
    dead: bool
    why: str
    owner: dict | None = None


class SaveLock:
    """A lock held while saving: ``release()`` (idempotent) gives it back."""

    def release(self) -> None:
        pass


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class DirLock(SaveLock):
    """An exclusive ``flock`` on a directory, held through an open descriptor of it (so it
    follows the directory through renames and ends when the descriptor is closed, at the latest
    when the process exits)."""

    def __init__(self, fd: int):
        self.fd: int | None = fd

    @classmethod
    def acquire(cls, path: str) -> "DirLock":
        """The lock, waiting for another holder (a cleaner judging the directory holds it for
        a moment) to let go."""
        fd = os.open(path, _DIR_FLAGS)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd)

    @classmethod
    def try_acquire(cls, path: str) -> "DirLock | None":
        """The lock, or None when another open descriptor holds it (this process's included)."""
        fd = os.open(path, _DIR_FLAGS)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return cls(fd)

    def identity(self) -> tuple[int, int]:
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino

    def release(self, _close=os.close) -> None:
        # os.close is bound at definition: at interpreter teardown the module's globals may
        # already be None when a lock still held is collected.
        fd, self.fd = self.fd, None
        if fd is not None:
            _close(fd)

    def __del__(self) -> None:
        # A lock dropped without release() (a manager never closed): the descriptor is closed
        # quietly; whatever fails at interpreter teardown is not worth a traceback, since the
        # kernel drops the flock with the process anyway.
        try:
            self.release()
        except Exception:
            pass


def lock_holder(path: str) -> str:
    """Who holds the flock on `path`, from /proc/locks (Linux), for messages."""
    try:
        st = os.stat(path)
        want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == want:
                    return f"process {fields[4]}"
    except (OSError, ValueError):
        pass
    return "another process"


# ---- the processes of a save ---------------------------------------------------------

class Coordinator(Protocol):
    """What the save and commit steps need from the processes of a job."""

    process_index: int
    process_count: int

    def new_save_id(self) -> str:
        """An id for the next save; every process gets the same one for the same save.
        Each call is matched by one ``end_save`` once this process is done with the save."""

    def all_gather(self, key: str, value: bytes) -> list[bytes]:
        """Every process's `value`, by process index. Raises naming processes that never sent.
        `key` is ``<save id>/<step>``, used once per save."""

    def gather(self, key: str, value: bytes) -> list[bytes] | None:
        """Every process's `value`, by process index, on the primary (process 0); None on the
        others, which do not wait. Raises on the primary naming processes that never sent."""

    def broadcast(self, key: str, make: Callable[[], bytes]) -> bytes:
        """The primary's `make()`, on every process (if it raises there, the others raise too)."""

    def end_save(self, save_id: str) -> None:
        """This process made its last exchange of `save_id` (or gave up on the save)."""


class LocalCoordinator:
    """The coordinator of a single-process job."""

    process_index = 0
    process_count = 1

    def __init__(self) -> None:
        self._count = 0

    def new_save_id(self) -> str:
        self._count += 1
        return str(self._count)

    def all_gather(self, key: str, value: bytes) -> list[bytes]:
        return [value]

    def gather(self, key: str, value: bytes) -> list[bytes] | None:
        return [value]

    def broadcast(self, key: str, make: Callable[[], bytes]) -> bytes:
        return make()

    def end_save(self, save_id: str) -> None:
        pass


_local = LocalCoordinator()


def current_coordinator() -> Coordinator:
    import jax

    if jax.process_count() == 1:
        return _local
    from ckpt._distributed import distributed_coordinator

    return distributed_coordinator()


# ---- the strategy interface ----------------------------------------------------------

def not_a_checkpoint(where: str, what: str) -> FileExistsError:
    """The error of a save to a location that holds something other than a jax-ckpt checkpoint
    (user files, another library's checkpoint, a manager directory): never replaced, whatever
    `overwrite` says."""
    return FileExistsError(errno.EEXIST, f"exists and is not a jax-ckpt checkpoint ({what}); nothing was written, "
                                         "and overwrite replaces only a jax-ckpt checkpoint", where)


def some(names: list[str], most: int = 3) -> str:
    shown = ", ".join(repr(n) for n in sorted(names)[:most])
    return f"{len(names)} entr{'y' if len(names) == 1 else 'ies'}: {shown}" + (", ..." if len(names) > most else "")


@dataclass(frozen=True)
class Staged:
    """Where a save writes before its commit.

    storage: the location array keys are written under; prefix: prepended to every storage path
    recorded in the manifest (a generation prefix, or '' when the staged directory becomes the
    checkpoint by rename); info: what other processes need to find the same place
    (``CommitStrategy.staged_from(info)``), msgpack-able.
    """

    storage: Storage
    prefix: str
    info: dict
    # The primary's hold on the staged place (released by commit or abort), None elsewhere.
    lock: Any = field(default=None, compare=False, repr=False)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


class CommitStrategy(ABC):
    """How saves to one location (`store`) stage, commit, abort and are cleaned up after.
    `for_renames`: the value of ``store.caps.renames`` a strategy is for; ``commit_for`` picks by
    it among the strategies defined (``ckpt._commit`` defines both)."""

    for_renames: bool
    _by_renames: dict[bool, type["CommitStrategy"]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        CommitStrategy._by_renames[cls.for_renames] = cls

    def __init__(self, store: Storage):
        self.store = store

    @abstractmethod
    def stage(self, *, overwrite: bool) -> Staged:
        """Check the location and prepare the place a save writes to (primary process only), its
        owner record written first. FileExistsError when a checkpoint is here and not
        `overwrite`, and, overwrite or not, when something that is not a jax-ckpt checkpoint is
        here (``not_a_checkpoint``): an overwrite replaces only a checkpoint."""

    @abstractmethod
    def staged_from(self, info: dict) -> Staged:
        """The same Staged as the primary's ``stage`` returned, from its `info`."""

    def commit(self, staged: Staged, manifest: bytes, *, overwrite: bool,
               old_data: Callable[[], Iterable[str]] | None = None) -> None:
        """Write the manifest last, making the staged data a checkpoint at this location; then
        remove leftovers of dead saves beside it. The staged place's lock is released in every
        case. `old_data()` names the top-level entries the previous manifest referenced
        (evaluated before the new manifest is written)."""
        try:
            self._commit(staged, manifest, overwrite=overwrite, old_data=old_data)
        finally:
            staged.release()
        self.remove_dead_leftovers(keep=staged, overwrite=overwrite)

    @abstractmethod
    def _commit(self, staged: Staged, manifest: bytes, *, overwrite: bool,
                old_data: Callable[[], Iterable[str]] | None) -> None:
        """The commit proper (see ``commit``)."""

    def abort(self, staged: Staged) -> None:
        """Remove what a save that will not commit staged, then release its lock."""
        try:
            staged.storage.delete_tree("")
        finally:
            staged.release()

    @abstractmethod
    def staging_area(self) -> Storage:
        """Where saves to this location stage (and so where their leftovers are)."""

    @abstractmethod
    def leftovers(self, referenced: Iterable[str] = ()) -> list[Leftover]:
        """Staged data of saves directly below this location, each judged dead or alive."""

    @abstractmethod
    def remove_leftover(self, leftover: Leftover) -> bool:
        """Remove a dead leftover below this location if it is still dead; whether it was."""

    @abstractmethod
    def remove_dead_leftovers(self, keep: Staged | None = None, *, overwrite: bool = True) -> list[str]:
        """Remove the dead leftovers of saves where saves to this location stage; failures are
        warnings. Returns what was removed."""

    @abstractmethod
    def lock(self) -> SaveLock:
        """Claim this location (a manager directory) for one saver: CheckpointError naming the
        holder when another one has it."""

    @abstractmethod
    def retire(self) -> None:
        """Delete the checkpoint at this location so that no moment shows a half-deleted one as
        committed."""


# ---- the door -------------------------------------------------------------------------

def commit_for(store: Storage) -> CommitStrategy:
    """The commit strategy of `store`'s location."""
    return CommitStrategy._by_renames[store.caps.renames](store)


def _old_data(storage: Storage) -> Callable[[], Iterable[str]]:
    """The top-level entries the checkpoint now at `storage` keeps its data in (none if there is
    no readable checkpoint): what an overwrite deletes after its commit."""

    def entries() -> list[str]:
        try:
            old = read_manifest(storage)
        except (OSError, CheckpointError):
            return []
        paths = [l.zarr.path for l in old.leaves if l.zarr is not None]
        paths += [s.zarr.path for s in getattr(old, "stacks", ())]
        if old.layout is not None:  # (format version 3: its index objects, even with no arrays)
            paths += [ref.name for ref in old.layout.indexes]
            if any(not ref.name.startswith(GENERATION_MARK) for ref in old.layout.indexes):
                paths.append(DATA_DIR)  # (the flat layout's data objects, beside ~index)
        tops = {p.split("/", 1)[0] for p in paths}
        tops |= {st.zarr.path.split("/", 1)[0] for st in old.stacks}
        flat = [t for t in tops if not t.startswith(GENERATION_MARK)]
        return sorted(tops) + (["zarr.json"] if flat else [])

    return entries


def commit_checkpoint(storage: Storage, staged: Staged, manifest: Manifest, *, overwrite: bool) -> None:
    """Write the manifest last, making what `staged` holds the checkpoint at `storage`."""
    commit_for(storage).commit(staged, manifest.encode(), overwrite=overwrite, old_data=_old_data(storage))


def after_failed_commit(storage: Storage, staged: Staged, error: BaseException) -> None:
    """Clean up after ``commit_written`` raised `error`: remove the staged data unless it may
    now be a checkpoint's. A NotDurableError committed. An OutcomeUnknownError (the manifest
    write failed in a way that may have landed, and reading it back could not tell) deletes
    nothing: a manifest that did land points to this data. Anything else committed nothing of
    ours, as the storage's commit settles a failed manifest write by reading it back: a lost
    race (FileExistsError: another save's manifest is there), a write that provably did not
    land, or a failure before the manifest write; its generation is removed (what cannot be
    removed now is a dead leftover for cleanup, never a checkpoint). An interruption
    (KeyboardInterrupt...) may have come at any moment: nothing is deleted."""
    if isinstance(error, (NotDurableError, OutcomeUnknownError)) or not isinstance(error, Exception):
        return
    try:
        commit_for(storage).abort(staged)
    except OSError:
        pass  # left for cleanup: never a checkpoint, since no manifest points to it
