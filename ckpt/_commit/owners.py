"""Who owns staged data: owner records, directory locks, and the judgement of leftovers.

A save's staged place (a ``<path>.tmp-<hex>`` directory, a ``gen-<hex>/`` generation) holds an
owner record, ``.owner``: host, boot id, pid and the process's start time, written first. From it
(and, on local disk, from the ``flock`` the saving process holds) a commit strategy's
``leftovers`` tells the leftover of a save that died from a save in progress, on this machine or
another; only the first is ever removed (formats/SPEC.md section 10). A manager directory has one
saver at a time: a directory lock (``DirLock``), or on storage without locks a renewed lease
(``lease.SaverLease``).
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
