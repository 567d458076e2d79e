"""The commit protocol: how a save becomes a checkpoint, atomically, in one or many processes.

1. Every process computes the save plan and a fingerprint of it; the fingerprints are compared.
2. The primary process (index 0) checks the destination and stages the save
   (``Storage.stage``: a temporary sibling directory ``<path>.tmp-<token>`` on local disk, a fresh
   generation prefix ``<path>/gen-<token>/`` elsewhere); where it is is broadcast.
3. Every process writes its chunks there (each durable before it reports) and reports its status
   and chunk checksums to the primary.
4. When all succeeded, the primary writes the manifest last (``Storage.commit``: inside the
   temporary directory, which is then renamed into place; or write-if-absent of
   ``<path>/manifest.msgpack``). Otherwise it removes what was staged (``Storage.abort``).
5. The outcome is broadcast; every process returns or raises.

A crash at any point leaves the previous checkpoint (or nothing) at ``<path>``, plus at most
staged data that no manifest points to, which readers never read. Processes talk through a
Coordinator: a local one here, the jax.distributed key-value store in ckpt._distributed.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Protocol

import crc32c
import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import (
    GENERATION_MARK,
    GROUP_METADATA,
    STACKS_VERSION,
    TEMP_MARK,
    ArraySpec,
    LeafRecord,
    Manifest,
    Stack,
    array_metadata_bytes,
    is_temp_name,
    read_manifest,
)
from ckpt._geometry import chunk_grid, chunk_key
from ckpt.storage import NotDurableError, OutcomeUnknownError, Staged, Storage

__all__ = ["TEMP_MARK", "is_temp_name"]

# Where each process but the primary puts its index object in the staged place: the checksums
# of the chunks it wrote, read once by the primary at the commit (so statuses stay O(1) bytes
# in the coordination service). '~' never begins a leaf's escaped storage path (except the
# '~<leaf index>' of a clash, which is never '~index'); the manifest does not reference it.
INDEX_DIR = "~index"


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
        tops = {p.split("/", 1)[0] for p in paths}
        tops |= {st.zarr.path.split("/", 1)[0] for st in old.stacks}
        flat = [t for t in tops if not t.startswith(GENERATION_MARK)]
        return sorted(tops) + (["zarr.json"] if flat else [])

    return entries


def commit_checkpoint(storage: Storage, staged: Staged, manifest: Manifest, *, overwrite: bool) -> None:
    """Write the manifest last, making what `staged` holds the checkpoint at `storage`."""
    storage.commit(staged, manifest.encode(), overwrite=overwrite, old_data=_old_data(storage))


def commit_written(storage: Storage, staged: Staged, tree: dict, records: list[LeafRecord],
                   specs: dict[int, tuple[str, ArraySpec]], *, overwrite: bool, stacks: list[Stack] = (),
                   user_metadata: dict | None = None, action: str = "save", check_files: bool = True) -> None:
    """Step 4 of the protocol, the one way anything becomes a checkpoint (``save`` and
    ``convert``): check that every file written is in the staged place, whole; record the
    CRC-32C of every zarr.json; build the manifest at the lowest format version that describes
    it; commit it (``commit_checkpoint``).

    `records`: every leaf as the manifest records it (storage paths with ``staged.prefix``,
    chunk checksums filled in); `specs`: (storage path without the prefix, spec) of every Zarr
    array written, as ``array_specs`` gives them; `stacks` likewise complete. `action` names
    the operation in messages. On failure see ``after_failed_commit``. `check_files` False:
    the files are not listed (a multi-process save checks what its processes reported instead);
    the zarr.json checksums are computed all the same.
    """
    from ckpt._version import __version__

    zarr_json = _check_written(staged, specs, storage.url, action, check_files)
    # A manifest without stacks is version 1, which every reader reads (_format.records).
    manifest = Manifest(tree, list(records), user_metadata=user_metadata, library_version=__version__,
                        stacks=list(stacks), format_version=STACKS_VERSION if stacks else 1, zarr_json=zarr_json)
    commit_checkpoint(storage, staged, manifest, overwrite=overwrite)


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
        storage.abort(staged)
    except OSError:
        pass  # left for cleanup: never a checkpoint, since no manifest points to it


def group_paths(array_paths: Iterable[str], prefix: str) -> set[str]:
    """The Zarr groups a save writes a zarr.json for, so stock zarr can browse the tree: the root
    and every group above an array. None in a generation prefix without arrays: no manifest path
    would reference it, so no overwrite could ever find and delete it."""
    array_paths = list(array_paths)
    groups = {""} if array_paths or not prefix else set()
    for path in array_paths:
        parts = path.split("/")
        groups.update("/".join(parts[:k]) for k in range(1, len(parts)))
    return groups


def _check_written(staged: Staged, specs: dict[int, tuple[str, ArraySpec]], final: str,
                   action: str = "save", check_files: bool = True) -> dict[str, int]:
    """Check that every file the save wrote is still in the staged place, whole (a save never
    commits what someone removed or truncated meanwhile); return the CRC-32C of every zarr.json,
    keyed as the manifest records them."""
    expected: dict[str, int] = {}
    zarr_json: dict[str, int] = {}
    for path, spec in specs.values():
        meta = array_metadata_bytes(spec)
        expected[f"{path}/zarr.json"] = len(meta)
        zarr_json[f"{staged.prefix}{path}/zarr.json"] = crc32c.crc32c(meta)
        chunk_bytes = math.prod(spec.chunk_shape) * spec.dtype.itemsize
        if check_files:
            for index in np.ndindex(*chunk_grid(spec.shape, spec.chunk_shape)):
                expected[f"{path}/{chunk_key(index)}"] = chunk_bytes
    for group in group_paths((path for path, _ in specs.values()), staged.prefix):
        key = f"{group}/zarr.json" if group else "zarr.json"
        expected[key] = len(GROUP_METADATA)
        zarr_json[staged.prefix + key] = crc32c.crc32c(GROUP_METADATA)
    if not check_files:
        return zarr_json
    found = staged.storage.stat_many(expected)
    bad = [f"{staged.storage.where(k)} ({'missing' if found[k] is None else f'{found[k]} of {n} bytes'})"
           for k, n in expected.items() if found[k] is None or (found[k] >= 0 and found[k] != n)]
    if bad:
        raise CheckpointError(
            f"{action} to {final}: {len(bad)} file(s) it wrote are gone or changed before the commit, e.g. {bad[0]} "
            f"(did another process remove the {action}'s temporary data?); nothing was committed")
    return zarr_json
