"""The step directories a CheckpointManager manages: listing, locating, checking, reading the
facts retention needs, pinning steps being read, and deleting steps (commit marker first)."""

from __future__ import annotations

import contextlib
import errno
import threading
import warnings
from typing import Iterator

from ckpt._errors import CheckpointError
from ckpt._format import GENERATION_MARK, MANIFEST_NAME, is_temp_name, read_manifest
from ckpt._manager.naming import ManagedStep, StepNaming, committed_steps, scan_named_steps
from ckpt._manager.retention import METRICS_KEY, StepFacts
from ckpt._orbax import STEP_METADATA, step_record
from ckpt._commit import OWNER_LIMIT_BYTES, OWNER_NAME, commit_for, owner_gone, parse_owner
from ckpt.storage import Storage


class StepDirectory:
    """A manager directory of steps named by `naming` (plus any Orbax steps in it)."""

    def __init__(self, storage: Storage, naming: StepNaming) -> None:
        self.storage, self.naming = storage, naming
        self._pin_lock = threading.Lock()
        self._pinned: dict[int, int] = {}  # step -> restores/metadata reads in progress
        self._deleting: set[int] = set()  # steps being deleted now
        self._facts: dict[tuple[int, str], StepFacts] = {}  # committed manifests never change
        self._good: set[tuple[int, str]] = set()  # manifests checked whole
        self._damaged: set[tuple[int, str]] = set()  # manifests reported damaged

    def scan(self) -> dict[int, ManagedStep]:
        """The committed steps, listed now."""
        return committed_steps(self.storage, self.naming)

    def name_of(self, step: int) -> str:
        """The directory name of `step`: the naming's, unless the step exists under another
        name (an Orbax step)."""
        name = self.naming.name(step)
        if self.storage.exists(f"{name}/{MANIFEST_NAME}"):
            return name
        entry = self.scan().get(step)
        return entry.name if entry is not None else name

    def manifest_ok(self, entry: ManagedStep) -> bool:
        """Whether the step's manifest is whole (read and checked once); a damaged one is
        reported once with a RuntimeWarning naming it."""
        key = (entry.step, entry.name)
        if entry.orbax or key in self._good:
            return True
        try:
            read_manifest(self.storage.child(entry.name))
        except FileNotFoundError:
            return False  # deleted meanwhile
        except CheckpointError as e:
            if key not in self._damaged:
                self._damaged.add(key)
                warnings.warn(f"checkpoint manager: step {entry.step} at {self.storage.where(entry.name)} is damaged "
                              f"and skipped: {e}", RuntimeWarning, stacklevel=4)
            return False
        self._good.add(key)
        return True

    def facts_of(self, entry: ManagedStep) -> StepFacts:
        """Metrics and save time of a committed step, from its manifest (read once)."""
        key = (entry.step, entry.name)
        if key not in self._facts:
            location = self.storage.child(entry.name)
            if entry.orbax:
                metrics, created = step_record(location)
                self._facts[key] = StepFacts(metrics, created)
            else:
                try:
                    manifest = read_manifest(location)
                except (OSError, CheckpointError):
                    return StepFacts()  # judged without facts; latest_step() reports the damage
                metrics = (manifest.user_metadata or {}).get(METRICS_KEY)
                self._facts[key] = StepFacts(metrics if isinstance(metrics, dict) else None, manifest.created)
        return self._facts[key]

    def retire(self, entry: ManagedStep) -> bool:
        """Delete a committed step, commit marker first; False (nothing done) while it is read."""
        with self._pin_lock:
            if self._pinned.get(entry.step):
                return False
            self._deleting.add(entry.step)
        try:
            location = self.storage.child(entry.name)
            if entry.orbax:
                location.delete(STEP_METADATA)  # no longer a finished Orbax step
                location.delete_tree("")
            else:
                # The manifest goes first (or the directory is renamed away), so a crash never
                # leaves a half-deleted step that looks committed.
                commit_for(location).retire()
        finally:
            with self._pin_lock:
                self._deleting.discard(entry.step)
            self._facts.pop((entry.step, entry.name), None)
            self._good.discard((entry.step, entry.name))
        return True

    def remove_leftovers(self) -> None:
        """Remove what saves that provably died left here. On local disk every commit already
        removes dead temporary directories beside it (``ckpt._commit``); elsewhere an
        uncommitted step prefix holds generations, each judged by its owner record."""
        if self.storage.caps.renames:
            return
        for entry in scan_named_steps(self.storage, self.naming):
            if entry.committed or is_temp_name(entry.name) or self.storage.exists(f"{entry.name}/{STEP_METADATA}"):
                continue
            step = commit_for(self.storage.child(entry.name))
            for leftover in step.leftovers():
                if leftover.dead:
                    step.remove_leftover(leftover)

    def clear_dead(self, step: int) -> str | None:
        """Before saving `step` (process 0, holding the directory's saver lock): remove what a
        save of that step that provably died left under the step's name, so it does not block
        the save (``all_steps`` ignores it already). Returns, when something uncommitted stays
        there, why it is not provably dead (a save in progress, no owner record...); None
        otherwise. A committed step is left alone (the save refuses it as before).

        Local disk (rename commit): the step's directory, without a manifest, is removed when
        it is empty or when every owner record in it (its own ``.owner``: a staged directory
        renamed or copied there; those of its ``gen-*`` generations: another engine's saves)
        names a process that is gone. Elsewhere
        a save stages in a generation of its own, so only the dead generations are removed;
        live ones never clash with this save (the commit is a conditional write)."""
        name = self.naming.name(step)
        location = self.storage.child(name)
        if location.exists(MANIFEST_NAME):
            return None
        if not self.storage.caps.renames:
            generations = commit_for(location)
            for leftover in generations.leftovers():
                if leftover.dead:
                    generations.remove_leftover(leftover)
            return None
        if not location.exists(""):
            return None
        if name not in self.storage.list_dir("")[1]:
            return "it is not a directory"  # a file (or link) by that name: not ours to remove
        files, dirs = location.list_dir("")
        if not files and not dirs:
            location.delete_tree("")  # an empty directory: nothing to lose
            return None
        places = [location] if OWNER_NAME in files else []
        places += [location.child(d) for d in dirs if d.startswith(GENERATION_MARK)]
        if not places:
            return "no owner record shows that its save ended"
        if OWNER_NAME not in files:
            # Only generations carry records: anything beside them but group metadata is not
            # theirs (a user's files), so the directory is not a save's leftover alone.
            others = [n for n in files if n != "zarr.json"] + [d for d in dirs if not d.startswith(GENERATION_MARK)]
            if others:
                return f"it holds {others[0]!r}, which no save of the library writes there"
        for place in places:
            try:
                data = place.get(OWNER_NAME, max_bytes=OWNER_LIMIT_BYTES)
            except FileNotFoundError:
                # A generation's owner record is its first object and goes only after its
                # manifest is written: none, and no manifest, means its save died.
                continue
            owner = parse_owner(data)
            if owner is None:
                return f"its owner record {place.where(OWNER_NAME)} is unreadable"
            dead, why = owner_gone(owner, place=place.url)
            if not dead:
                return why
        if location.exists(MANIFEST_NAME):  # committed meanwhile: not a leftover
            return None
        location.delete_tree("")
        return None

    @contextlib.contextmanager
    def pinned(self, step: int) -> Iterator[tuple[Storage, ManagedStep]]:
        """The storage of committed step `step`, which ``retire`` leaves alone until the block
        ends; FileNotFoundError (listing the committed steps) when it is not one."""
        with self._pin_lock:
            self._pinned[step] = self._pinned.get(step, 0) + 1
            deleting = step in self._deleting
        try:
            name = self.naming.name(step)
            entry: ManagedStep | None = ManagedStep(step, name, False)
            if deleting or not self.storage.exists(f"{name}/{MANIFEST_NAME}"):
                entry = None if deleting else self.scan().get(step)
            if entry is None:
                raise FileNotFoundError(
                    errno.ENOENT,
                    f"step {step} is not a committed checkpoint here (committed steps: {sorted(self.scan())})",
                    self.storage.where(name),
                )
            yield self.storage.child(entry.name), entry
        finally:
            with self._pin_lock:
                self._pinned[step] -= 1
                if not self._pinned[step]:
                    del self._pinned[step]
