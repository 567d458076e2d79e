"""A manager directory's saver lease on storage without locks (object stores).

One object, ``LEASE_NAME``, names the saving manager with a random token; it is written if
absent and renewed in the background (docs/storage.md, "Leases").
"""

from __future__ import annotations

import errno
import json
import secrets
import threading
import time
from typing import Any

from ckpt._commit.strategy import OWNER_LIMIT_BYTES, SaveLock, owner_gone, owner_record, owner_text, parse_owner
from ckpt._commit.writes import create, settle_write
from ckpt._errors import CheckpointError
from ckpt.storage import Storage

# Locations whose server refused a compare-and-swap of an unchanged lease (this process).
_CAS_REFUSED: set[str] = set()

LEASE_NAME = ".jax-ckpt-saver"
LEASE_TTL_S = 60.0
LEASE_RENEW_S = 15.0


class SaverLease(SaveLock):
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
    def acquire(cls, storage: Storage) -> "SaverLease":
        lease = cls(storage, {**owner_record(), "token": secrets.token_hex(8)})
        lease._claim()
        lease._thread.start()
        return lease

    def _read(self) -> tuple[dict | None, Any, bool]:
        """(holder record or None, its version or None, whether it exists)."""
        storage = self.storage
        if storage.caps.versioned_writes:
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
                create(storage, LEASE_NAME, data, what="saver lease")
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
        if storage.caps.versioned_writes and not self._cas_refused(version, stale):
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
                settle_write(storage, LEASE_NAME, data, error, what="saver lease", replace=True)
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
            settle_write(storage, LEASE_NAME, data, e, what="saver lease", replace=True)
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
        if not self.storage.caps.versioned_writes:
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
        if not self.storage.caps.versioned_writes or self.version is None or self.storage.url in _CAS_REFUSED:
            self.storage.put(LEASE_NAME, data).result()
            self._refresh_version()
            return
        try:
            new = self.storage.put_if_version(LEASE_NAME, data, self.version)
        except Exception as e:  # noqa: BLE001
            settle_write(self.storage, LEASE_NAME, data, e, what="saver lease", replace=True)
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
