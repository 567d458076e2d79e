"""Storage engines: how chunk data gets into and out of Zarr v3 arrays.

An engine is bound to one checkpoint directory and sees arrays by their storage path inside it.
The interface is four calls, each returning a future (anything with ``.result()``):

    create(path, spec)        write the array's zarr.json (done once, by the primary process)
    put(key, data)            write a small file (group metadata)
    open_write_all(arrays)    handles to write chunks into, without touching storage
    write(handle, box, data)  write one whole chunk
    read_chunk(path, index, shape, dtype)  one whole chunk (blocking; callers run it on threads)
    open_read(path) / read(handle, box)    any region (used to compare differently chunked arrays)

Chunks are always whole (a chunk is a saved shard), so no write reads or locks anything.
"""

from __future__ import annotations

import errno
import math
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import tensorstore as ts

from ckpt._errors import CheckpointError
from ckpt._layout import Box, box_to_index, chunk_key

# Width of the engine's file I/O; the benchmark's raw-disk baseline uses the same.
IO_CONCURRENCY = int(os.environ.get("CKPT_IO_CONCURRENCY", max(8, 2 * (os.cpu_count() or 1))))


@dataclass(frozen=True)
class ArraySpec:
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    dtype: np.dtype  # storage dtype
    attributes: dict = field(default_factory=dict)


class Engine(Protocol):
    def create(self, path: str, spec: ArraySpec) -> Any: ...
    def put(self, key: str, data: bytes) -> Any: ...
    def open_write_all(self, arrays: dict[Any, tuple[str, ArraySpec]]) -> dict[Any, Any]: ...
    def write(self, handle: Any, box: Box, data: np.ndarray) -> Any: ...
    def read_chunk(self, path: str, index: tuple[int, ...], shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray: ...
    def open_read(self, path: str) -> Any: ...
    def read(self, handle: Any, box: Box) -> Any: ...


_PAGE = 4096
_direct_reads: bool | None = None  # unknown until the first open


def _open_for_read(file: str) -> int:
    """An fd for reading `file`, with O_DIRECT unless the file system refuses it."""
    global _direct_reads
    if _direct_reads is not False and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(file, os.O_RDONLY | os.O_DIRECT)
            _direct_reads = True
            return fd
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _direct_reads = False
    return os.open(file, os.O_RDONLY)


def aligned_empty(nbytes: int, alignment: int = 64) -> np.ndarray:
    """An uninitialised uint8 buffer whose data starts on an `alignment`-byte boundary
    (XLA's CPU client adopts such host buffers without copying them)."""
    raw = np.empty(nbytes + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset : offset + nbytes]


def _fill_value(dtype: np.dtype):
    if dtype == np.bool_:
        return False
    if dtype.kind == "c":
        return [0.0, 0.0]
    return 0


def _zarr_metadata(spec: ArraySpec) -> dict:
    return {
        "shape": list(spec.shape),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(spec.chunk_shape)}},
        "chunk_key_encoding": {"name": "default"},
        "data_type": spec.dtype.name,
        "fill_value": _fill_value(spec.dtype),
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "attributes": spec.attributes,
    }


class TensorStoreEngine:
    """Zarr v3 on the local file system.

    Writes go through TensorStore's zarr3 driver with direct I/O, each chunk fsynced before the
    checkpoint commits. Whole-chunk reads (restore) go straight to the chunk file (see
    read_chunk); region reads (used to compare differently chunked checkpoints) go through
    TensorStore opened with ``fill_missing_data_reads: false``. Either way a missing chunk is an
    error naming the file, never the fill value.
    """

    _context: ts.Context | None = None

    def __init__(self, root: str):
        self.root = root
        self._kvstore = None
        if TensorStoreEngine._context is None:
            TensorStoreEngine._context = ts.Context(
                {
                    "file_io_concurrency": {"limit": IO_CONCURRENCY},
                    "cache_pool": {"total_bytes_limit": 0},
                    # Chunks are written once, by one process, into a private temporary
                    # directory whose rename is the atomic step: no lock files or per-chunk
                    # renames needed. Files are still fsynced (file_io_sync defaults to true).
                    "file_io_locking": {"mode": "non_atomic"},
                    # Direct I/O: chunks go from the library's page-aligned host buffers to the
                    # device without a page-cache copy, so writing does not compete with the
                    # host copies of the next shards for memory bandwidth (measured: see
                    # docs/benchmarks.md).
                    "file_io_mode": {"mode": "direct"},
                }
            )

    def _spec(self, path: str) -> dict:
        return {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": os.path.join(self.root, path) + "/"},
            "recheck_cached_metadata": False,
            "recheck_cached_data": False,
        }

    def create(self, path: str, spec: ArraySpec):
        return ts.open(
            {**self._spec(path), "metadata": _zarr_metadata(spec)},
            create=True,
            context=self._context,
        )

    def put(self, key: str, data: bytes):
        if self._kvstore is None:
            self._kvstore = ts.KvStore.open(
                {"driver": "file", "path": self.root + "/"}, context=self._context).result()
        return self._kvstore.write(key, data)

    def _open_write(self, path: str, spec: ArraySpec):
        return ts.open(
            {
                **self._spec(path),
                "metadata": _zarr_metadata(spec),
                # Every chunk is written, zeros included, so that a missing file always means
                # damage and reads can refuse it.
                "store_data_equal_to_fill_value": True,
            },
            assume_metadata=True,
            context=self._context,
        )

    def open_write_all(self, arrays: dict[Any, tuple[str, ArraySpec]]) -> dict[Any, Any]:
        """open_write for many arrays at once (the opens run concurrently)."""
        futures = {k: self._open_write(path, spec) for k, (path, spec) in arrays.items()}
        return {k: f.result() for k, f in futures.items()}

    def write(self, handle, box: Box, data: np.ndarray):
        # The library owns `data` and does not change it while the write runs, so TensorStore
        # may reference it instead of copying it (the staging pool reuses a buffer only once
        # nothing references it any more).
        return handle[box_to_index(box)].write(data, can_reference_source_data_indefinitely=True)

    def read_chunk(self, path: str, index: tuple[int, ...], shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """One whole chunk, read straight from its file into a page-aligned buffer.

        With the ``bytes`` codec a chunk file is exactly the chunk's little-endian bytes, so this
        is one read, with O_DIRECT where the file system allows it (no page-cache copy). The
        alignment also lets JAX adopt the buffer as a CPU device buffer without a copy
        (TensorStore returns 16-byte-aligned arrays, which device_put must copy).
        Raises FileNotFoundError for a missing file, CheckpointError for a wrong size.
        """
        file = os.path.join(self.root, path, chunk_key(index))
        nbytes = math.prod(shape) * dtype.itemsize
        padded = -(-nbytes // _PAGE) * _PAGE  # direct reads want whole pages
        buf = aligned_empty(padded + _PAGE, _PAGE)  # one page more, to see a too-long file
        fd = _open_for_read(file)
        try:
            filled = 0
            while filled < len(buf):
                n = os.readv(fd, [memoryview(buf)[filled:]])
                if n == 0:
                    break
                filled += n
        finally:
            os.close(fd)
        if filled < nbytes:
            raise CheckpointError(f"chunk file {file} is truncated: {filled} of {nbytes} bytes")
        if filled > nbytes:
            raise CheckpointError(f"chunk file {file} is longer than the {nbytes} bytes of its chunk")
        return buf[:nbytes].view(dtype.newbyteorder("<")).reshape(shape)

    def open_read(self, path: str):
        return ts.open(
            {**self._spec(path), "fill_missing_data_reads": False},
            read=True,
            context=self._context,
        )

    def read(self, handle, box: Box):
        return handle[box_to_index(box)].read()


def engine_for(root: str) -> Engine:
    return TensorStoreEngine(root)
