"""WrapperStorage: a Storage that forwards every call to another (like zarr's WrapperStore).

Subclass it and override the operations to observe, delay or fail; locations derived from a
wrapped storage (children, parents, staged directories) are wrapped the same way, so a wrapper
sees every primitive of a save, restore or manager: chunk and metadata writes, reads, listing,
deletion, and every step of the commit (the manifest write, the syncs, a rename backend's
``publish``); a renaming backend's ``stage`` and ``retire`` (local disk) are seen as one call each.
The test suite injects its faults this way.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterable, Iterator

import numpy as np

from ckpt._geometry import Box
from ckpt._format import ArraySpec
from ckpt.storage._owners import Leftover, SaveLock
from ckpt.storage._base import Staged, Storage


class WrapperStorage(Storage):
    def __init__(self, inner: Storage):
        self.inner = inner

    def wrap(self, inner: Storage) -> "WrapperStorage":
        """The wrapper of a location derived from this one (override when the constructor
        takes more than `inner`)."""
        return type(self)(inner)

    @property
    def engine(self) -> str:  # type: ignore[override]
        return self.inner.engine

    @property
    def renames(self) -> bool:  # type: ignore[override]
        return self.inner.renames

    @property
    def conditional_writes(self) -> bool:  # type: ignore[override]
        return self.inner.conditional_writes

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def name(self) -> str:
        return self.inner.name

    def where(self, key: str) -> str:
        return self.inner.where(key)

    @property
    def resolved_name(self) -> str:
        return self.inner.resolved_name

    @contextlib.contextmanager
    def pin(self) -> Iterator[Storage]:
        with self.inner.pin() as pinned:
            yield self.wrap(pinned)

    def child(self, key: str) -> Storage:
        return self.wrap(self.inner.child(key))

    def parent(self) -> Storage:
        return self.wrap(self.inner.parent())

    def make_dirs(self) -> None:
        self.inner.make_dirs()

    def get(self, key: str, *, max_bytes: int) -> bytes:
        return self.inner.get(key, max_bytes=max_bytes)

    @property
    def reads_into_buffers(self) -> bool:
        return self.inner.reads_into_buffers

    def read_window_bytes(self, io_concurrency: int) -> int | None:
        return self.inner.read_window_bytes(io_concurrency)

    def read_exact(self, key: str, nbytes: int, into: np.ndarray | None = None) -> np.ndarray:
        return self.inner.read_exact(key, nbytes, into)

    def put(self, key: str, data: bytes) -> Any:
        return self.inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> None:
        self.inner.put_if_absent(key, data)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def exists_any(self) -> bool:
        return self.inner.exists_any()

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        return self.inner.list_dir(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def delete_tree(self, prefix: str = "") -> None:
        self.inner.delete_tree(prefix)

    def sync(self, key: str = "") -> None:
        self.inner.sync(key)

    def stat_many(self, keys) -> dict[str, int | None]:
        return self.inner.stat_many(keys)

    # Without renames these are built from the primitives (run here, seen by the wrapper); a
    # renaming backend's own (locks) run inside the inner storage.
    def leftovers(self, referenced: Iterable[str] = ()) -> list[Leftover]:
        if not self.inner.renames:
            return Storage.leftovers(self, referenced)
        return self.inner.leftovers(referenced)

    def remove_leftover(self, leftover: Leftover) -> bool:
        if not self.inner.renames:
            return Storage.remove_leftover(self, leftover)
        return self.inner.remove_leftover(leftover)

    def lock_saves(self) -> SaveLock:
        return self.inner.lock_saves()

    def open_arrays(self, arrays: dict[Any, tuple[str, ArraySpec]]) -> dict[Any, Any]:
        return self.inner.open_arrays(arrays)

    def write_chunk(self, handle: Any, box: Box, data: np.ndarray) -> Any:
        return self.inner.write_chunk(handle, box, data)

    def _wrapped(self, staged: Staged) -> Staged:
        return dataclasses.replace(staged, storage=self.wrap(staged.storage))

    def _unwrapped(self, staged: Staged) -> Staged:
        inner = staged.storage.inner if isinstance(staged.storage, WrapperStorage) else staged.storage
        return dataclasses.replace(staged, storage=inner)

    # The commit and abort are built from the primitives above (Storage.commit), so they run
    # here, through the wrapper, which then sees every step; a renaming backend's staging,
    # rename (publish) and retire are its own and run inside the inner storage.

    def stage(self, *, overwrite: bool) -> Staged:
        if not self.inner.renames:
            return Storage.stage(self, overwrite=overwrite)
        return self._wrapped(self.inner.stage(overwrite=overwrite))

    def staged_from(self, info: dict) -> Staged:
        if not self.inner.renames:
            return Storage.staged_from(self, info)
        return self._wrapped(self.inner.staged_from(info))

    def publish(self, staged: Staged, *, overwrite: bool) -> Storage | None:
        displaced = self.inner.publish(self._unwrapped(staged), overwrite=overwrite)
        return None if displaced is None else self.wrap(displaced)

    def retire(self) -> None:
        if not self.inner.renames:
            return Storage.retire(self)
        self.inner.retire()
