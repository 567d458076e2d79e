"""How a checkpoint becomes visible (docs/design.md, "The layout"): the commit strategies, owner
records and leftovers, the saver lease, and the coordinator the processes of a save agree through.

``commit_for(store)`` is the strategy of a store, chosen once from what the store declares:
``RenameCommit`` where it renames directories atomically (local disk: a staged sibling
directory renamed into place), ``GenerationCommit`` elsewhere (a fresh generation prefix, the
manifest written if absent). Both are built on the store's byte primitives only, so a wrapper
around the store sees every byte of a commit.
"""

from __future__ import annotations

from typing import Callable, Iterable

from ckpt._commit.coordinator import Coordinator, LocalCoordinator, current_coordinator
from ckpt._commit.lease import LEASE_NAME, LEASE_TTL_S
from ckpt._commit.owners import OWNER_LIMIT_BYTES, OWNER_NAME, Leftover, SaveLock, owner_gone, parse_owner
from ckpt._commit.rename import RenameCommit
from ckpt._commit.strategy import CommitStrategy, GenerationCommit, Staged
from ckpt._commit.writes import create, settle_write
from ckpt._errors import CheckpointError, NotDurableError, OutcomeUnknownError
from ckpt._format import DATA_DIR, GENERATION_MARK, Manifest, read_manifest
from ckpt.storage import Storage

__all__ = [
    "LEASE_NAME", "LEASE_TTL_S", "OWNER_LIMIT_BYTES", "OWNER_NAME", "CommitStrategy", "Coordinator",
    "GenerationCommit", "Leftover", "LocalCoordinator", "RenameCommit", "SaveLock", "Staged",
    "after_failed_commit", "commit_checkpoint", "commit_for", "create", "current_coordinator", "owner_gone",
    "parse_owner", "settle_write",
]


def commit_for(store: Storage) -> CommitStrategy:
    """The commit strategy of `store`'s location."""
    return RenameCommit(store) if store.caps.renames else GenerationCommit(store)


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
