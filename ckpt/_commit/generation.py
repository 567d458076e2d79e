"""The commit strategy of object stores: a fresh generation prefix per save, the manifest written
if absent (formats/SPEC.md section 10), the saver lease where a store has no locks."""

from __future__ import annotations

import errno
import secrets
import warnings
from typing import Callable, Iterable

from ckpt._commit.lease import SaverLease
from ckpt._commit.strategy import (
    GENERATION,
    OWN_TEMP,
    OWNER_LIMIT_BYTES,
    OWNER_NAME,
    Leftover,
    LiveMark,
    SaveLock,
    owner_bytes,
    owner_gone,
    parse_owner,
    CommitStrategy,
    Staged,
    not_a_checkpoint,
    some,
)
from ckpt._commit.writes import create, settle_write
from ckpt._errors import CheckpointError, OutcomeUnknownError
from ckpt._format import GENERATION_MARK, MANIFEST_NAME
from ckpt.storage import Storage


class GenerationCommit(CommitStrategy):
    """Object stores (and any store without an atomic rename): a save writes below a fresh
    generation prefix ``gen-<hex>/`` inside the location, and the manifest, written if absent
    (or replaced in one write when overwriting), makes it the checkpoint."""

    for_renames = False

    def stage(self, *, overwrite: bool) -> Staged:
        store = self.store
        files, dirs = store.list_dir("")
        if MANIFEST_NAME not in files:
            # Generation prefixes without a manifest are what failed saves leave: not data.
            others = files + [f"{d}/" for d in dirs if not d.startswith(GENERATION_MARK)]
            if others:
                raise not_a_checkpoint(store.url, f"it holds {some(others)}")
        elif not overwrite:
            raise FileExistsError(errno.EEXIST, "checkpoint already exists (pass overwrite=True to replace it)",
                                  store.url)
        generation = f"{GENERATION_MARK}{secrets.token_hex(6)}"
        place = store.child(generation)
        mark = LiveMark(place.url)
        try:
            # (A lost answer retried is our own record, recognised: owner records carry a token.)
            try:
                create(place, OWNER_NAME, owner_bytes(), what="owner record")
            except OutcomeUnknownError as e:
                # Nothing can have been committed yet: a plain failure of the save.
                raise CheckpointError(f"save to {store.url} failed before writing anything else, nothing "
                                      f"committed: {e}") from e
        except BaseException:
            mark.release()
            raise
        return Staged(place, generation + "/", {"generation": generation}, mark)

    def staged_from(self, info: dict) -> Staged:
        generation = info["generation"]
        return Staged(self.store.child(generation), generation + "/", info)

    def _commit(self, staged: Staged, manifest: bytes, *, overwrite: bool,
                old_data: Callable[[], Iterable[str]] | None) -> None:
        store = self.store
        stale = list(old_data()) if (overwrite and old_data is not None) else []
        # The manifest names this save's fresh generation, so its bytes are this save's own: a
        # write that reports failure (or "exists": its own retry of a write whose answer was
        # lost) is settled by reading the manifest back (``settle_write``). Raises
        # FileExistsError (another save committed first), OutcomeUnknownError (neither the
        # write nor the read-back can tell: nothing may be deleted), or the write's own error
        # when it provably did not land.
        if overwrite:
            try:
                store.put(MANIFEST_NAME, manifest).result()
            except Exception as e:  # noqa: BLE001 (settled)
                settle_write(store, MANIFEST_NAME, manifest, e, what="manifest", replace=True)
        else:
            create(store, MANIFEST_NAME, manifest, what="manifest")
        # Committed: from here on nothing may fail the save. Old data that cannot be deleted
        # now is unreferenced and only costs space.
        keep = staged.prefix.rstrip("/")
        for entry in stale:
            if entry == keep:
                continue
            try:
                store.delete(entry) if entry.endswith(".json") else store.delete_tree(entry)
            except OSError as e:
                warnings.warn(f"checkpoint {store.url} committed, but its previous data {store.where(entry)} "
                              f"could not be deleted: {e}", RuntimeWarning, stacklevel=4)
        try:
            staged.storage.delete(OWNER_NAME)
        except OSError as e:
            warnings.warn(f"checkpoint {store.url} committed, but its owner record could not be removed: {e}",
                          RuntimeWarning, stacklevel=4)

    def staging_area(self) -> Storage:
        return self.store

    def leftovers(self, referenced: Iterable[str] = ()) -> list[Leftover]:
        """Temporary directories the library names (``<name>.tmp-<hex>``) and generation prefixes
        not in `referenced` (the generations a manifest here points to). Dead when the owner
        record is missing (a generation's record is its first object, and goes only once its
        manifest is written) or names a process provably gone."""
        files, dirs = self.store.list_dir("")
        keep = {r.strip("/") for r in referenced}
        return [self._judge(name) for name in dirs
                if name not in keep and (OWN_TEMP.fullmatch(name) or GENERATION.fullmatch(name))]

    def _judge(self, name: str) -> Leftover:
        store = self.store
        try:
            owner = parse_owner(store.get(f"{name}/{OWNER_NAME}", max_bytes=OWNER_LIMIT_BYTES))
        except FileNotFoundError:
            return Leftover(name, True, "no save owns it (no owner record)")
        except (OSError, CheckpointError) as e:
            return Leftover(name, False, f"its owner record cannot be read ({e})")
        if owner is None:
            return Leftover(name, False, "its owner record is unreadable")
        dead, why = owner_gone(owner, place=store.where(name))
        return Leftover(name, dead, why, owner)

    def remove_leftover(self, leftover: Leftover) -> bool:
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
        self.store.delete_tree(leftover.name)
        return True

    def _manifest_mentions(self, name: str) -> bool:
        """Whether the manifest here (if any) holds the text `name` anywhere (a storage path in
        it, so its generation is referenced); True when it cannot be read (keep, to be safe)."""
        try:
            return name.encode() in self.store.get(MANIFEST_NAME, max_bytes=1 << 30)
        except FileNotFoundError:
            return False
        except (OSError, CheckpointError):
            return True

    def remove_dead_leftovers(self, keep: Staged | None = None, *, overwrite: bool = True) -> list[str]:
        """Only the generations inside this checkpoint are looked at, and only when it has a
        manifest (the manager handles uncommitted steps); only an overwritten location can hold
        some after a commit."""
        store, removed = self.store, []
        if not overwrite:
            return removed
        try:
            if not store.exists(MANIFEST_NAME):
                return []
            for leftover in self.leftovers([keep.prefix] if keep is not None else []):
                if leftover.dead and self.remove_leftover(leftover):
                    removed.append(store.where(leftover.name))
        except (OSError, CheckpointError) as e:
            warnings.warn(f"could not remove leftovers of earlier saves in {store.url}: {e}", RuntimeWarning,
                          stacklevel=3)
        return removed

    def lock(self) -> SaveLock:
        """A lease object renewed in the background while held and presumed abandoned after
        LEASE_TTL_S without renewal."""
        return SaverLease.acquire(self.store)

    def retire(self) -> None:
        """The manifest goes first, then the data."""
        self.store.delete(MANIFEST_NAME)
        self.store.delete_tree("")
