"""Who owns staged data: owner records, locks and leases, and the judgement of leftovers.

A save's staged place (a ``<path>.tmp-<hex>`` directory, a ``gen-<hex>/`` generation) holds an
owner record, ``.owner``: host, boot id, pid and the process's start time, written first. From it
(and, on local disk, from the ``flock`` the saving process holds) ``Storage.leftovers`` tells the
leftover of a save that died from a save in progress, on this machine or another; only the first
is ever removed (formats/SPEC.md section 10). A manager directory has one saver at a time: a lock,
or on storage without locks a renewed lease (``_Lease``).
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
from dataclasses import dataclass
from typing import Any

from ckpt._errors import CheckpointError

# The ``Storage`` these records live in (typed Any: _base builds on this module, not the reverse).
Storage = Any

# Names of the temporary directories the library itself creates (staged saves, old checkpoints
# being deleted or moved aside): only these are ever removed as leftovers.
_OWN_TEMP = re.compile(r".+\.tmp-(?:(deleted|old)-)?[0-9a-f]{12}")
_GENERATION = re.compile(r"gen-[0-9a-f]{12}")
OWNER_NAME = ".owner"  # inside a staged directory or generation while its save runs
OWNER_LIMIT_BYTES = 4096
# Staged data without an owner record is left alone this long (a save writes its record right
# after creating the place, and removes it just before publishing).
UNOWNED_GRACE_S = 600.0
# Staged data whose owner runs on another machine is presumed dead only after this long.
FOREIGN_OWNER_TTL_S = 24 * 3600.0


def _boot_id() -> str:
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
    return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(),
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
    boot = _boot_id()
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


def _lock_holder(path: str) -> str:
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


# Locations whose server refused a compare-and-swap of an unchanged lease (this process).
_CAS_REFUSED: set[str] = set()

LEASE_NAME = ".jax-ckpt-saver"
LEASE_TTL_S = 60.0
LEASE_RENEW_S = 15.0


class _Lease(SaveLock):
    """A manager directory's saver lease on storage without locks: an object naming the owner
    (with a random token), written if absent and renewed every LEASE_RENEW_S seconds.

    Every write of it is idempotent: a lost answer (the write landed, its retry refused as
    "exists") is recognised by reading the lease back and finding this manager's own bytes, so
    a manager never refuses itself. Taking over an expired lease is a compare-and-swap on the
    version read (``Storage.put_if_version``: a TensorStore generation, an S3 ETag with
    If-Match) where the storage has ``versioned_writes``: of two managers taking over at once,
    one wins and the other gets a CheckpointError naming it. Elsewhere the takeover is a plain
    write checked by a read-back, which is not atomic (docs/storage.md, "Leases")."""

    def __init__(self, storage: Storage, record: dict, version: Any = None):
        self.storage, self.record, self.version = storage, record, version
        self.lost: str | None = None  # why the lease is no longer ours (taken over), if it is not
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="ckpt-saver-lease", daemon=True)

    def _data(self) -> bytes:
        return json.dumps(self.record).encode()

    @classmethod
    def acquire(cls, storage: Storage) -> "_Lease":
        lease = cls(storage, {**owner_record(), "token": secrets.token_hex(8)})
        lease._claim()
        lease._thread.start()
        return lease

    def _read(self) -> tuple[dict | None, Any, bool]:
        """(holder record or None, its version or None, whether it exists)."""
        storage = self.storage
        if storage.versioned_writes:
            data, version = storage.get_versioned(LEASE_NAME, max_bytes=OWNER_LIMIT_BYTES)
            return parse_owner(data), version, data is not None
        try:
            return parse_owner(storage.get(LEASE_NAME, max_bytes=OWNER_LIMIT_BYTES)), None, True
        except FileNotFoundError:
            return None, None, False

    def _claim(self) -> None:
        storage, data, token = self.storage, self._data(), self.record["token"]
        for _ in range(3):
            try:
                storage.create(LEASE_NAME, data, what="saver lease")
                self._refresh_version()
                return
            except FileExistsError:
                pass
            holder, version, there = self._read()
            if holder is not None and holder.get("token") == token:
                self.version = version
                return
            if not there:
                continue  # released meanwhile: claim it again
            stale = holder is None or time.time() - holder.get("time", 0) > LEASE_TTL_S \
                or owner_gone({**holder, "time": time.time()})[0]
            if not stale:
                raise CheckpointError(
                    f"another CheckpointManager ({owner_text(holder)}) is saving to {storage.url}: two managers "
                    f"cannot save to one directory (its lease {storage.where(LEASE_NAME)} was renewed "
                    f"{time.time() - holder.get('time', 0):.0f} s ago and expires {LEASE_TTL_S:.0f} s after its "
                    "last renewal)") from None
            self._take_over(version, holder)
            return
        raise CheckpointError(f"could not claim the saver lease {storage.where(LEASE_NAME)}: it keeps changing")

    def _take_over(self, version: Any, stale: dict | None) -> None:
        """Replace the expired lease `stale`, read at `version`, by ours: exactly one of several
        managers doing so at once wins (where the storage has versioned writes)."""
        storage, data = self.storage, self._data()
        if storage.versioned_writes and not self._cas_refused(version, stale):
            try:
                new = storage.put_if_version(LEASE_NAME, data, version)
                if new is not None:
                    self.version = new
                    return
                error: BaseException = FileExistsError(errno.EEXIST, "changed since it was read",
                                                       storage.where(LEASE_NAME))
            except Exception as e:  # noqa: BLE001 (settled by reading it back)
                error = e
            try:
                storage.settle_write(LEASE_NAME, data, error, what="saver lease", replace=True)
            except FileExistsError as e:  # another manager's lease is there now, or the same one
                holder, now, _ = self._read()
                if stale is None or holder is None or holder.get("token") != stale.get("token") \
                        or holder.get("time") != stale.get("time"):
                    self._refuse_winner(e)
                # The expired lease is still there, unchanged: the server refused a compare-and-
                # swap on an object that did not change (Ceph RGW takes only an unquoted ETag in
                # If-Match). Take it over without one, as where versions are missing.
                _CAS_REFUSED.add(storage.url)
                self._take_over(now, stale)
                return
            self._refresh_version()
            return
        # No compare-and-swap here: a plain write, then a read-back to see who holds it (two
        # managers taking over at the same moment may both see themselves: docs/storage.md).
        try:
            storage.put(LEASE_NAME, data).result()
        except Exception as e:  # noqa: BLE001
            storage.settle_write(LEASE_NAME, data, e, what="saver lease", replace=True)
        holder, _, _ = self._read()
        if holder is None or holder.get("token") != self.record["token"]:
            self._refuse_winner(None)

    def _cas_refused(self, version: Any, stale: dict | None) -> bool:
        return self.storage.url in _CAS_REFUSED

    def _refuse_winner(self, cause: BaseException | None) -> None:
        try:
            holder, _, _ = self._read()
        except (OSError, CheckpointError):
            holder = None
        raise CheckpointError(
            f"another CheckpointManager ({owner_text(holder)}) took over the expired saver lease "
            f"{self.storage.where(LEASE_NAME)} first: two managers cannot save to one directory") from cause

    def _refresh_version(self) -> None:
        if not self.storage.versioned_writes:
            return
        try:
            data, version = self.storage.get_versioned(LEASE_NAME, max_bytes=OWNER_LIMIT_BYTES)
        except (OSError, CheckpointError):
            self.version = None
            return
        holder = parse_owner(data)
        self.version = version if holder is not None and holder.get("token") == self.record["token"] else None

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_RENEW_S):
            try:
                self.renew()
            except (OSError, CheckpointError):
                pass  # retried at the next renewal

    def renew(self) -> None:
        """Write the lease again with the time now. Where the storage has versioned writes, only
        over the version this manager last wrote: a lease taken over meanwhile (this manager
        stalled past LEASE_TTL_S) is not overwritten, and ``lost`` says so."""
        if self.lost is not None:
            return
        self.record["time"] = time.time()
        data = self._data()
        if not self.storage.versioned_writes or self.version is None or self.storage.url in _CAS_REFUSED:
            self.storage.put(LEASE_NAME, data).result()
            self._refresh_version()
            return
        try:
            new = self.storage.put_if_version(LEASE_NAME, data, self.version)
        except Exception as e:  # noqa: BLE001
            self.storage.settle_write(LEASE_NAME, data, e, what="saver lease", replace=True)
            self._refresh_version()
            return
        if new is not None:
            self.version = new
            return
        holder, version, _ = self._read()
        if holder is not None and holder.get("token") == self.record["token"]:
            if holder.get("time") != self.record["time"]:
                # Our own lease, unchanged, and the server refused the compare-and-swap (see
                # _take_over): renew it without one from now on.
                _CAS_REFUSED.add(self.storage.url)
                self.storage.put(LEASE_NAME, data).result()
                self._refresh_version()
                return
            self.version = version  # ours, written (a lost answer)
            return
        self.lost = f"taken over by another CheckpointManager ({owner_text(holder)})"

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            holder = parse_owner(self.storage.get(LEASE_NAME, max_bytes=OWNER_LIMIT_BYTES))
            if holder is not None and holder.get("token") == self.record["token"]:
                self.storage.delete(LEASE_NAME)
        except (OSError, CheckpointError):
            pass  # it expires on its own
