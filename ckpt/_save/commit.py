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

from typing import Callable, Iterable, Protocol

from ckpt._errors import CheckpointError
from ckpt._format import Manifest, read_manifest
from ckpt._format import GENERATION_MARK, TEMP_MARK, is_temp_name
from ckpt.storage import Staged, Storage


__all__ = ["TEMP_MARK", "is_temp_name"]


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
