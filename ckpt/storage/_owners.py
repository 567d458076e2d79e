"""Who owns staged data: owner records, locks and leases, and the judgement of leftovers.

A save's staged place (a ``<path>.tmp-<hex>`` directory, a ``gen-<hex>/`` generation) holds an
owner record, ``.owner``: host, boot id, pid and the process's start time, written first. From it
(and, on local disk, from the ``flock`` the saving process holds) ``Storage.leftovers`` tells the
leftover of a save that died from a save in progress, on this machine or another; only the first
is ever removed (formats/SPEC.md section 10). A manager directory has one saver at a time: a lock,
or on storage without locks a renewed lease (``_Lease``).
"""

from __future__ import annotations

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
    return json.dumps(owner_record()).encode()


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

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self.release()


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


LEASE_NAME = ".jax-ckpt-saver"
LEASE_TTL_S = 60.0
LEASE_RENEW_S = 15.0


class _Lease(SaveLock):
    """A manager directory's saver lease on storage without locks: an object naming the owner,
    written if absent and renewed every LEASE_RENEW_S seconds."""

    def __init__(self, storage: Storage, record: dict):
        self.storage, self.record = storage, record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="ckpt-saver-lease", daemon=True)

    @classmethod
    def acquire(cls, storage: Storage) -> "_Lease":
        record = {**owner_record(), "token": secrets.token_hex(8)}
        data = json.dumps(record).encode()
        try:
            storage.put_if_absent(LEASE_NAME, data)
        except FileExistsError:
            try:
                holder = parse_owner(storage.get(LEASE_NAME, max_bytes=OWNER_LIMIT_BYTES))
            except FileNotFoundError:
                holder = None
            stale = holder is None or time.time() - holder.get("time", 0) > LEASE_TTL_S \
                or owner_gone({**holder, "time": time.time()})[0]
            if not stale:
                raise CheckpointError(
                    f"another CheckpointManager ({owner_text(holder)}) is saving to {storage.url}: two managers "
                    f"cannot save to one directory (its lease {storage.where(LEASE_NAME)} was renewed "
                    f"{time.time() - holder.get('time', 0):.0f} s ago and expires {LEASE_TTL_S:.0f} s after its "
                    "last renewal)") from None
            storage.put(LEASE_NAME, data).result()
        lease = cls(storage, record)
        lease._thread.start()
        return lease

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_RENEW_S):
            try:
                self.record["time"] = time.time()
                self.storage.put(LEASE_NAME, json.dumps(self.record).encode()).result()
            except (OSError, CheckpointError):
                pass  # retried at the next renewal

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
