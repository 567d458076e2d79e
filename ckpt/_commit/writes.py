"""Writes whose outcome a lost answer cannot hide: ``create`` (write-if-absent) and
``settle_write`` (what a failed write did), built on a store's ``put_if_absent`` and ``get``.

A request that fails may still have landed (the answer lost after the server stored it, a
500 after storing, a client's own retry refused as "exists" by its first attempt). Every object
the commit writes this way is unique to its writer (a manifest names a fresh generation, owner
records and leases carry a token), so reading it back tells: our bytes there mean the write
succeeded.
"""

from __future__ import annotations

import errno

from ckpt._errors import CheckpointError, OutcomeUnknownError
from ckpt.storage import Storage


def may_still_land(error: BaseException) -> bool:
    """Whether a failed request may still be applied by the server after the caller saw it fail:
    a timeout of the caller's own (the request may be in flight, or queued in a client's retry
    loop), so that an object missing on a read-back does not prove it will stay missing."""
    return isinstance(error, TimeoutError) or getattr(error, "errno", None) == errno.ETIMEDOUT


def _text(e: BaseException) -> str:
    return str(e) or type(e).__name__


def create(store: Storage, key: str, data: bytes, *, what: str = "object") -> None:
    """``put_if_absent`` that is safe against lost answers and its engine's own retries: when the
    write reports that the object exists, or fails in a way that may have landed, the object is
    read back, and if it holds exactly `data` the write succeeded (`data` must be unique to this
    writer). FileExistsError when another writer's object is there; the write's own error when it
    provably did not land; OutcomeUnknownError (naming `what` and the object) when neither the
    write nor the read-back can tell."""
    try:
        store.put_if_absent(key, data)
    except Exception as e:  # noqa: BLE001 (settled below)
        settle_write(store, key, data, e, what=what)


def settle_write(store: Storage, key: str, data: bytes, error: BaseException, *, what: str = "object",
                 replace: bool = False) -> None:
    """After a write of `data` to `key` failed with `error`: return if the object holds exactly
    `data` (the write landed, its answer lost or its retry refused), raise otherwise (see
    ``create``). A missing object (with `replace`, an unconditional write: any other object)
    means the write did not land, and the error is raised, unless the error says it may still
    land (``may_still_land``): then OutcomeUnknownError."""
    try:
        there = store.get(key, max_bytes=max(len(data), 1))
    except FileNotFoundError:
        there = None
    except CheckpointError:
        there = b""  # larger than ours, or no plain object: not ours
    except Exception as e2:
        raise OutcomeUnknownError(
            f"{what} {store.where(key)}: outcome unknown (written or not): the write failed ({_text(error)}) "
            f"and reading it back failed too ({_text(e2)})") from error
    if there == data:
        return
    if there is None or replace:
        if isinstance(error, FileExistsError) and not replace:
            raise error
        if may_still_land(error):
            raise OutcomeUnknownError(
                f"{what} {store.where(key)}: outcome unknown (written or not): the write failed "
                f"({_text(error)}) and may still land") from error
        raise error
    if isinstance(error, FileExistsError):
        raise error
    raise FileExistsError(errno.EEXIST, f"already exists (another writer's; our write failed: {_text(error)})",
                          store.where(key)) from error
