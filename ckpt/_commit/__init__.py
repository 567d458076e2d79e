"""How a checkpoint becomes visible (docs/design.md, "The layout"): the commit strategies, owner
records and leftovers, the saver lease, and the coordinator the processes of a save agree through.

``commit_for(store)`` is the strategy of a store, chosen once from what the store declares:
``RenameCommit`` where it renames directories atomically (local disk: a staged sibling
directory renamed into place), ``GenerationCommit`` elsewhere (a fresh generation prefix, the
manifest written if absent). Both are built on the store's byte primitives only, so a wrapper
around the store sees every byte of a commit.
"""

from __future__ import annotations

from ckpt._commit.lease import LEASE_NAME, LEASE_TTL_S
from ckpt._commit.rename import RenameCommit
from ckpt._commit.generation import GenerationCommit
from ckpt._commit.strategy import (OWNER_LIMIT_BYTES, OWNER_NAME, CommitStrategy, Coordinator, Leftover, LocalCoordinator,
                                   SaveLock, Staged, after_failed_commit, commit_checkpoint, commit_for,
                                   current_coordinator, owner_gone, parse_owner)
from ckpt._commit.writes import create, settle_write

__all__ = [
    "LEASE_NAME", "LEASE_TTL_S", "OWNER_LIMIT_BYTES", "OWNER_NAME", "CommitStrategy", "Coordinator",
    "GenerationCommit", "Leftover", "LocalCoordinator", "RenameCommit", "SaveLock", "Staged",
    "after_failed_commit", "commit_checkpoint", "commit_for", "create", "current_coordinator", "owner_gone",
    "parse_owner", "settle_write",
]
