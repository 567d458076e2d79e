"""WrapperStorage: a Storage that forwards every call to another (like zarr's WrapperStore).

Subclass it and override the operations to observe, delay or fail; locations derived from a
wrapped storage (children, parents, staged directories) are wrapped the same way, so a wrapper
sees every primitive of a save, restore or manager: chunk and metadata writes, reads, listing,
deletion, and every step of the commit (the manifest write, the syncs, a rename backend's
``publish``); a renaming backend's ``stage`` and ``retire`` (local disk) are seen as one call each.
The test suite injects its faults this way.

Every member of the Storage interface is defined here (tests/test_storage_interface.py checks it
against the interface), so that a wrapped storage does what the inner one does: the inner
engine's own ``read_chunk_async`` (asynchronous I/O issued from the reader's thread), ``du``,
``read_range`` and the rest, never the base class's fallback. The exceptions are the methods
built from the primitives (``RUN_HERE``, and ``RUN_HERE_WITHOUT_RENAME`` when the inner storage
has no rename): they run here, over this wrapper, so that the wrapper sees each of their steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ckpt._format import ArraySpec
from ckpt._geometry import Box
from ckpt.storage._base import Staged, Storage, Usage
from ckpt.storage._owners import Leftover, SaveLock


class WrapperStorage(Storage):
    # Built from the primitives: run here whatever the inner storage is.
    RUN_HERE = frozenset({"commit", "abort", "staging_area", "remove_dead_leftovers", "create", "settle_write"})
    # Built from the primitives where the inner storage has no rename; a renaming backend's own
    # (a staged directory, its lock, the rename) run inside it.
    RUN_HERE_WITHOUT_RENAME = frozenset({"stage", "staged_from", "leftovers", "remove_leftover", "retire"})

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
    def versioned_writes(self) -> bool:  # type: ignore[override]
        return self.inner.versioned_writes

    @property
    def reads_refuse_longer(self) -> bool:  # type: ignore[override]
        return self.inner.reads_refuse_longer

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

    def size(self, key: str) -> int | None:
        return self.inner.size(key)

    def read_range(self, key: str, start: int, length: int, into: np.ndarray | None = None) -> np.ndarray:
        return self.inner.read_range(key, start, length, into)

    def put(self, key: str, data: bytes) -> Any:
        return self.inner.put(key, data)

    @property
    def streams_packs(self) -> bool:  # type: ignore[override]
        return self.inner.streams_packs

    def open_pack(self, key: str) -> Any:
        return self.inner.open_pack(key)

    def put_if_absent(self, key: str, data: bytes) -> None:
        self.inner.put_if_absent(key, data)

    def get_versioned(self, key: str, *, max_bytes: int) -> tuple[bytes | None, Any]:
        return self.inner.get_versioned(key, max_bytes=max_bytes)

    def put_if_version(self, key: str, data: bytes, version: Any) -> Any:
        return self.inner.put_if_version(key, data, version)

    # Built from the primitives (put_if_absent, get): run here, seen step by step.
    def create(self, key: str, data: bytes, *, what: str = "object") -> None:
        Storage.create(self, key, data, what=what)

    def settle_write(self, key: str, data: bytes, error: BaseException, *, what: str = "object",
                     replace: bool = False) -> None:
        Storage.settle_write(self, key, data, error, what=what, replace=replace)

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

    def du(self) -> Usage | None:
        return self.inner.du()

    def staging_area(self) -> Storage:
        return Storage.staging_area(self)

    def remove_dead_leftovers(self, keep: Staged | None = None) -> list[str]:
        return Storage.remove_dead_leftovers(self, keep)

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

    def create_array(self, path: str, spec: ArraySpec) -> Any:
        return self.inner.create_array(path, spec)

    def put_group(self, path: str) -> Any:
        return self.inner.put_group(path)

    def read_chunk(self, path: str, index: tuple[int, ...], nbytes: int, into: np.ndarray | None = None) -> np.ndarray:
        return self.inner.read_chunk(path, index, nbytes, into)

    def read_chunk_async(self, path: str, index: tuple[int, ...], nbytes: int, executor: Any,
                         into: np.ndarray | None = None) -> Any:
        # The inner engine's own: TensorStore issues the read from this thread, as in production.
        return self.inner.read_chunk_async(path, index, nbytes, executor, into)

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

    def commit(self, staged: Staged, manifest: bytes, *, overwrite: bool,
               old_data: Callable[[], Iterable[str]] | None = None) -> None:
        Storage.commit(self, staged, manifest, overwrite=overwrite, old_data=old_data)

    def abort(self, staged: Staged) -> None:
        Storage.abort(self, staged)

    def publish(self, staged: Staged, *, overwrite: bool) -> Storage | None:
        displaced = self.inner.publish(self._unwrapped(staged), overwrite=overwrite)
        return None if displaced is None else self.wrap(displaced)

    def retire(self) -> None:
        if not self.inner.renames:
            return Storage.retire(self)
        self.inner.retire()
