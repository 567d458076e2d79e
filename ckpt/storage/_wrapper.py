"""WrapperStorage: a Storage that forwards every call to another (like zarr's WrapperStore).

Subclass it and override the operations to observe, delay or fail; locations derived from a
wrapped storage (children, parents, staged directories) are wrapped the same way, so a wrapper
sees every primitive of a save, restore or manager: chunk and metadata writes, reads, listing,
deletion, and every byte of the commit (owner records, the manifest write, the syncs), which
``ckpt._commit`` builds on these primitives. The test suite injects its faults this way.

Every member of the Storage interface and of the optional protocols (``ChunkFiles``,
``LocalDirectory``, versioned writes, ``open_pack``) is defined here (tests/test_storage_interface.py
checks it against them), so that a wrapped storage does what the inner one does: the inner
engine's own ``read_chunk_async`` (asynchronous I/O issued from the reader's thread), ``du``,
``read_range`` and the rest, never a fallback. An optional member is called only where the inner
storage's ``caps`` declare it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import numpy as np

from ckpt._format import ArraySpec
from ckpt._geometry import Box
from ckpt.storage._base import ChunkFiles, LocalDirectory, Storage, StoreCaps, Usage


class WrapperStorage(ChunkFiles, LocalDirectory, Storage):
    def __init__(self, inner: Storage):
        self.inner = inner

    def wrap(self, inner: Storage) -> "WrapperStorage":
        """The wrapper of a location derived from this one (override when the constructor
        takes more than `inner`)."""
        return type(self)(inner)

    @property
    def caps(self) -> StoreCaps:  # type: ignore[override]
        # Ranged reads go through read_range, which a wrapper sees, never through the inner
        # engine's asynchronous ranged reads.
        caps = self.inner.caps
        return dataclasses.replace(caps, async_ranges=False) if caps.async_ranges else caps

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def root(self) -> str:
        """The directory of a store with ``renames`` (local disk), for the rename commit."""
        return self.inner.root

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

    def read_exact(self, key: str, nbytes: int, into: np.ndarray | None = None) -> np.ndarray:
        return self.inner.read_exact(key, nbytes, into)

    def size(self, key: str) -> int | None:
        return self.inner.size(key)

    def read_range(self, key: str, start: int, length: int, into: np.ndarray | None = None) -> np.ndarray:
        return self.inner.read_range(key, start, length, into)

    def put(self, key: str, data: bytes) -> Any:
        return self.inner.put(key, data)

    def open_pack(self, key: str) -> Any:
        return self.inner.open_pack(key)

    def put_if_absent(self, key: str, data: bytes) -> None:
        self.inner.put_if_absent(key, data)

    def get_versioned(self, key: str, *, max_bytes: int) -> tuple[bytes | None, Any]:
        return self.inner.get_versioned(key, max_bytes=max_bytes)

    def put_if_version(self, key: str, data: bytes, version: Any) -> Any:
        return self.inner.put_if_version(key, data, version)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

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

    def open_arrays(self, arrays: dict[Any, tuple[str, ArraySpec]]) -> dict[Any, Any]:
        return self.inner.open_arrays(arrays)

    def write_chunk(self, handle: Any, box: Box, data: np.ndarray) -> Any:
        return self.inner.write_chunk(handle, box, data)

    # A zarr.json goes out through this wrapper's own put, so that the wrapper sees its bytes.
    create_array = ChunkFiles.create_array
    put_group = ChunkFiles.put_group

    def read_chunk(self, path: str, index: tuple[int, ...], nbytes: int, into: np.ndarray | None = None) -> np.ndarray:
        return self.inner.read_chunk(path, index, nbytes, into)

    def read_chunk_async(self, path: str, index: tuple[int, ...], nbytes: int, executor: Any,
                         into: np.ndarray | None = None) -> Any:
        # The inner engine's own: TensorStore issues the read from this thread, as in production.
        return self.inner.read_chunk_async(path, index, nbytes, executor, into)
