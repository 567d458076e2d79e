"""WrapperStorage: a Storage that forwards every call to another (like zarr's WrapperStore).

Subclass it and override the operations to observe, delay or fail; locations derived from a
wrapped storage (children, parents, staged directories) are wrapped the same way, so a wrapper
sees every primitive of a save, restore or manager: chunk and metadata writes, reads, listing,
deletion, and on backends without renames the manifest write of the commit. A renaming
backend's commit, abort and retire (local disk) are seen as one call each. The test suite
injects its faults this way.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from ckpt._layout import Box
from ckpt.storage._base import ArraySpec, Staged, Storage


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

    def child(self, key: str) -> Storage:
        return self.wrap(self.inner.child(key))

    def parent(self) -> Storage:
        return self.wrap(self.inner.parent())

    def make_dirs(self) -> None:
        self.inner.make_dirs()

    def get(self, key: str, *, max_bytes: int) -> bytes:
        return self.inner.get(key, max_bytes=max_bytes)

    def read_exact(self, key: str, nbytes: int) -> np.ndarray:
        return self.inner.read_exact(key, nbytes)

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

    def open_arrays(self, arrays: dict[Any, tuple[str, ArraySpec]]) -> dict[Any, Any]:
        return self.inner.open_arrays(arrays)

    def write_chunk(self, handle: Any, box: Box, data: np.ndarray) -> Any:
        return self.inner.write_chunk(handle, box, data)

    def _wrapped(self, staged: Staged) -> Staged:
        return Staged(self.wrap(staged.storage), staged.prefix, staged.info)

    def _unwrapped(self, staged: Staged) -> Staged:
        inner = staged.storage.inner if isinstance(staged.storage, WrapperStorage) else staged.storage
        return Staged(inner, staged.prefix, staged.info)

    # The commit of a backend without renames is built from the primitives above, so it runs
    # here, through the wrapper (which then sees the manifest write and every deletion); a
    # renaming backend's commit is its own and runs inside the inner storage.

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
        if not self.inner.renames:
            return Storage.commit(self, staged, manifest, overwrite=overwrite, old_data=old_data)
        self.inner.commit(self._unwrapped(staged), manifest, overwrite=overwrite, old_data=old_data)

    def abort(self, staged: Staged) -> None:
        if not self.inner.renames:
            return Storage.abort(self, staged)
        self.inner.abort(self._unwrapped(staged))

    def retire(self) -> None:
        if not self.inner.renames:
            return Storage.retire(self)
        self.inner.retire()
