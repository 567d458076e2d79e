"""Reading a packed checkpoint (format version 3, formats/SPEC.md section 13): where each chunk is.

``PackedChunks`` wraps the checkpoint's storage so that everything reading chunks by Zarr path
and chunk index (the restore's Reader, ``ckpt diff``, exports) reads them from the data objects
instead: a chunk's place and CRC-32C come from the index object of the process that wrote it,
found by the manifest's rule (a recorded writer; else the processes that held the chunk's shard
at save time, from the saved mesh's process table, whose index holds the place or a pointer to
the writer's). A restoring process so reads the manifest and the index objects of the processes
whose chunks it reads, not every index (issue 23): one or two with the saving topology.
Index objects are loaded once each, checked against the manifest (size, CRC-32C) and decoded
(``decode_index``: every entry checked) before any of their entries is used.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import Manifest, PackedIndex, chunk_holders, decode_index, display_path
from ckpt._geometry import chunk_grid, flat_chunk_index
from ckpt._layout.base import ChunkRuns
from ckpt.storage import ChunkFiles, Done, Storage, WrapperStorage

# read_chunks reads chunks of one data object as one range when at most MERGE_GAP bytes lie
# between them (the alignment padding of SPEC 13.2) and the range stays within MERGE_MAX (the
# chunk cap: a range is held whole until its last chunk is used).
MERGE_GAP = 4096
MERGE_MAX = 64 << 20


class _Part:
    """The future of one chunk read as part of a larger range: a view of the range's bytes."""

    __slots__ = ("_whole", "_start", "_length")

    def __init__(self, whole: Any, start: int, length: int) -> None:
        self._whole, self._start, self._length = whole, start, length

    def result(self, timeout: float | None = None) -> np.ndarray:
        return self._whole.result(timeout)[self._start:self._start + self._length]

    def done(self) -> bool:
        return self._whole.done()


class _Once:
    """A future whose result is taken once and kept (an engine's read future may read again on
    every ``result()``): every chunk of a range shares one read."""

    __slots__ = ("_future", "_lock", "_value", "_error", "_taken")

    def __init__(self, future: Any) -> None:
        self._future, self._lock, self._taken = future, threading.Lock(), False
        self._value = self._error = None

    def result(self, timeout: float | None = None) -> np.ndarray:
        with self._lock:
            if not self._taken:
                try:
                    self._value = self._future.result(timeout)
                except BaseException as e:  # noqa: BLE001 (raised to every chunk of the range)
                    self._error = e
                self._taken, self._future = True, None
        if self._error is not None:
            raise self._error
        return self._value

    def done(self) -> bool:
        return self._taken


# A place must end within this many bytes of its object's start: every engine's ranged read
# takes the offset as a signed 64-bit number (2**63 would overflow in the read, not be refused).
MAX_OBJECT_BYTES = 1 << 62


class PackedChunks(WrapperStorage, ChunkRuns):
    """`inner` (a packed checkpoint's location) read chunk by chunk through its index objects."""

    # The Reader's executor reads a chunk (the index lookup runs there too): the inner engine's
    # asynchronous chunk reads take Zarr keys, which a packed checkpoint does not have.
    read_chunk_async = ChunkFiles.read_chunk_async

    def __init__(self, inner: Storage, manifest: Manifest, process: int = 0) -> None:
        super().__init__(inner)
        self.manifest, self.layout, self.process = manifest, manifest.layout, process
        self._arrays: dict[str, int] = {}
        for i, leaf in enumerate(manifest.leaves):
            if leaf.zarr is not None:
                self._arrays[leaf.zarr.path] = i
        for s, stack in enumerate(manifest.stacks):
            self._arrays[stack.zarr.path] = -1 - s
        self._indexes: dict[int, PackedIndex] = {}
        self._locks = {p: threading.Lock() for p in range(len(self.layout.indexes))}
        self.indexes_read = 0  # index objects loaded (bytes: index_bytes_read), for stats and tests
        self.index_bytes_read = 0
        self.ranges_read = 0  # read_chunks' requests
        self._placed: dict[tuple, tuple[str, int, int, int]] = {}  # read_chunks' places, until checked

    def wrap(self, inner: Storage) -> WrapperStorage:
        return WrapperStorage(inner)  # (a derived location is not this checkpoint)

    # ---- the index ------------------------------------------------------------------------

    def _index(self, p: int) -> PackedIndex:
        index = self._indexes.get(p)
        if index is not None:
            return index
        with self._locks[p]:
            index = self._indexes.get(p)
            if index is None:
                ref = self.layout.indexes[p]  # (its size checked with the manifest: packed_section_check)
                data = self.inner.get(ref.name, max_bytes=ref.size)
                index = decode_index(data, where=self.inner.where(ref.name), process=p,
                                     processes=len(self.layout.indexes), expected_size=ref.size,
                                     expected_crc=ref.crc32c)
                self.indexes_read += 1
                self.index_bytes_read += len(data)
                self._indexes[p] = index
        return index

    def index_of(self, p: int) -> PackedIndex:
        """Process `p`'s index object, loaded and checked (once): CheckpointError, or
        FileNotFoundError when it is missing (``ckpt verify`` reads every one)."""
        return self._index(p)

    def _first_choice(self, array: int, index: tuple[int, ...]) -> list[int]:
        """The processes whose index objects say where the chunk is, in the order to look."""
        if array < 0:
            writer = self.manifest.stacks[-1 - array].zarr.writer
            return [writer] if writer is not None else list(range(len(self.layout.indexes)))
        rec = self.manifest.leaves[array]
        if rec.zarr.writer is not None:
            return [rec.zarr.writer]
        sharding = rec.sharding or {}
        m = sharding.get("mesh_processes")
        if sharding.get("kind") == "named" and m is not None:
            sizes, table = self.layout.meshes[m]
            holders = chunk_holders(sizes, table, sharding["spec"], rec.shape, rec.zarr.chunk_shape, index,
                                    axis_names=sharding["mesh"]["axis_names"])
            if holders:
                return [self.process] if self.process in holders else [min(holders)]
        return list(range(len(self.layout.indexes)))

    def locate(self, path: str, index: tuple[int, ...]) -> tuple[str, int, int, int]:
        """(data object, offset, length, CRC-32C) of chunk `index` of the array at `path`."""
        array = self._arrays.get(path)
        if array is None:
            raise CheckpointError(f"{self.inner.where(path)}: no array of this checkpoint is stored there")
        st = self.manifest.stacks[-1 - array].zarr if array < 0 else self.manifest.leaves[array].zarr
        shape = self.manifest.stacks[-1 - array].shape if array < 0 else self.manifest.leaves[array].shape
        flat = flat_chunk_index(index, chunk_grid(shape, st.chunk_shape))
        if st.places:  # (an array written whole by one process: its places are in the manifest)
            return st.places[flat]
        looked = []
        for p in self._first_choice(array, index):
            entry = self._index(p).find(array, flat)
            looked.append(p)
            if entry is not None and int(entry["object"]) < 0:
                q = -1 - int(entry["object"])
                entry = self._index(q).find(array, flat)
                looked.append(q)
                p = q
                if entry is not None and int(entry["object"]) < 0:
                    entry = None  # (a pointer to a pointer: never written)
            if entry is not None:
                idx = self._indexes[p]
                name, size = idx.objects[int(entry["object"])]
                return name, int(entry["offset"]), int(entry["length"]), int(entry["crc32c"])
        what = (f"stack {-1 - array}" if array < 0 else f"leaf {display_path(self.manifest.leaves[array].path)!r}")
        raise CheckpointError(
            f"{what}, chunk {list(index)}: not in the index object(s) of process(es) "
            f"{sorted(set(looked))} ({', '.join(self.inner.where(self.layout.indexes[p].name) for p in sorted(set(looked))[:3])})"
            f": the checkpoint is damaged")

    # ---- the chunk reads of Storage ----------------------------------------------------------

    def _place(self, path: str, index: tuple[int, ...], nbytes: int) -> tuple[str, int, int, int]:
        """``locate``, checked against the chunk's size (`nbytes`, from its shape)."""
        place = self.locate(path, index)
        if place[2] != nbytes:
            raise CheckpointError(f"{self.inner.where(place[0])}: the index gives chunk {list(index)} of {path} "
                                  f"{place[2]} bytes, its chunk shape has {nbytes}")
        if not 0 <= place[1] <= MAX_OBJECT_BYTES - nbytes:
            raise CheckpointError(f"{self.inner.where(place[0])}: the index places chunk {list(index)} of {path} "
                                  f"at offset {place[1]}, beyond any data object")
        return place

    def read_chunk(self, path: str, index: tuple[int, ...], nbytes: int, into: np.ndarray | None = None) -> np.ndarray:
        name, offset, length, _ = self._place(path, index, nbytes)
        return self.inner.read_range(name, offset, length, into)

    def read_chunks(self, requests: list[tuple], executor: Any) -> dict[Any, Any]:
        """Start reading many chunks, {key: future of its bytes} for `requests` of (key, array
        path, chunk index, bytes): the chunks of one data object that follow each other (gaps of
        at most MERGE_GAP bytes: alignment) are read as one range of at most MERGE_MAX bytes. A
        restore onto the saving topology so reads a process's own chunks in a few requests
        instead of one each (bench/scale.py, 1,024 hosts: 483 GETs a host instead of 13,971)."""
        out: dict[Any, Any] = {}
        by_object: dict[str, list] = {}
        for key, path, index, nbytes in requests:
            try:
                place = self._place(path, index, nbytes)
            except (OSError, CheckpointError) as e:
                out[key] = Done(error=e)
                continue
            self._placed[(path, index)] = place  # (for chunk_check, once the chunk is read)
            by_object.setdefault(place[0], []).append((place[1], place[2], key))
        for name, parts in by_object.items():
            parts.sort()
            run = [parts[0]]
            for part in parts[1:]:
                start, end = run[0][0], run[-1][0] + run[-1][1]
                if part[0] >= end and part[0] - end <= MERGE_GAP and part[0] + part[1] - start <= MERGE_MAX:
                    run.append(part)
                    continue
                self._read_run(name, run, executor, out)
                run = [part]
            self._read_run(name, run, executor, out)
        return out

    def _read_run(self, name: str, run: list, executor: Any, out: dict) -> None:
        start = run[0][0]
        length = run[-1][0] + run[-1][1] - start
        # The engine's own asynchronous ranged read where it has one (TensorStore on object
        # stores), else a read on the executor.
        if self.inner.caps.async_ranges:
            try:
                whole = _Once(self.inner.read_range_async(name, start, length))
            except (OSError, CheckpointError) as e:  # (reported by each chunk of the range)
                whole = Done(error=e)
        else:
            whole = executor.submit(self.inner.read_range, name, start, length)
        self.ranges_read += 1
        for offset, length, key in run:
            out[key] = _Part(whole, offset - start, length)

    def chunk_check(self, path: str, index: tuple[int, ...]) -> tuple[int, str]:
        """(CRC-32C, where it is, for messages) of a chunk: the place ``read_chunks`` found for
        it (each chunk's lookup is done once), else looked up now."""
        place = self._placed.pop((path, index), None) or self.locate(path, index)
        name, offset, length, crc = place
        return crc, f"{self.inner.where(name)} bytes {offset}-{offset + length}"

    def open_arrays(self, arrays: dict[Any, tuple[str, Any]]) -> dict[Any, Any]:
        raise CheckpointError(f"{self.url}: a committed checkpoint is read-only")


def packed_reads(storage: Storage, manifest: Manifest | None) -> Storage:
    """`storage` itself, or its chunks read through the index objects when `manifest` is a
    packed checkpoint's (``PackedChunks``, looking first in this process's index)."""
    if manifest is None or manifest.layout is None or isinstance(storage, PackedChunks):
        return storage
    import jax

    return PackedChunks(storage, manifest, jax.process_index())
