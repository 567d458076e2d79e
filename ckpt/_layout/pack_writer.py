"""The packed layout's writer (format version 3, formats/SPEC.md section 13): one process's
chunks go into a few data objects, ``~data/<process>.<k>``, at aligned offsets, instead of one
object per chunk, so that a save makes O(processes) objects, not O(chunks) (issue 23: 13.8 M
objects at 1,024 hosts).

``PackWriter`` is the layout's ``ChunkWriter``: the save's writer hands it each chunk
(``write_chunk``). Two ways, by engine:

* an engine that writes files in place (``StoreCaps.writes_in_place``: local disk) gets each chunk
  written at its offset as it arrives (direct I/O where aligned), each data object fsynced when
  it is full and at ``close``; a chunk's write is done once its bytes are in the file;
* any other engine (object stores) gets whole objects: each chunk is copied into an assembly
  buffer of the save's budget (two, so that one is sent while the next fills) and its write is
  done at once; a full buffer is sent as one PUT. ``close`` sends the last and waits for all.

Either way every data object is durable once ``close`` returns, and everything written is in
``locations`` and ``objects``, from which the save builds its index object.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ckpt._format import ALIGN, DATA_DIR, SMALL_ALIGN, ArraySpec
from ckpt._geometry import Box, chunk_grid, chunk_index_of, flat_chunk_index
from ckpt._layout.base import ChunkWriter
from ckpt.storage import Done, Storage


def _aligned(n: int, length: int) -> int:
    """Where a chunk of `length` bytes starts after `n` bytes (SPEC 13.2)."""
    step = ALIGN if length >= ALIGN else SMALL_ALIGN
    return -(-n // step) * step


def _bytes_of(data: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


class _Pack:
    """One data object being filled."""

    __slots__ = ("number", "end", "file", "buffer", "future")

    def __init__(self, number: int) -> None:
        self.number, self.end, self.file, self.buffer, self.future = number, 0, None, None, None


class PackWriter(ChunkWriter):
    """Write chunks into this process's data objects below `storage` (the staged place), of the
    arrays `specs` (``array_specs``: by array id).

    `target_bytes`: the size at which a data object is closed and a new one begun (a chunk
    that would cross it starts the next one). `buffers`: the assembly buffers (uint8 arrays,
    counted in the save's budget by the caller) for an engine without ``writes_in_place``; a data
    object is then at most one buffer, and a chunk larger than a buffer is written as an object
    of its own, from its own memory. One thread calls write_chunk."""

    def __init__(self, storage: Storage, process: int, target_bytes: int, specs: dict[int, tuple[str, ArraySpec]],
                 buffers: list = (), data_dir: str = DATA_DIR) -> None:
        self.storage, self.process, self.data_dir = storage, process, data_dir
        self.streams = storage.caps.writes_in_place
        self.target_bytes = max(ALIGN, int(target_bytes))
        self._free = list(buffers)  # assembly buffers not in use
        self._buffer_bytes = min((len(b) for b in self._free), default=0)
        if not self.streams and self._buffer_bytes:
            self.target_bytes = min(self.target_bytes, self._buffer_bytes)
        self._sent: list[_Pack] = []  # packs whose buffer's PUT may still run
        self._packs: list[_Pack] = []
        self._current: _Pack | None = None
        self._specs = {a: spec for a, (_, spec) in specs.items()}
        self._grids = {a: chunk_grid(spec.shape, spec.chunk_shape) for a, spec in self._specs.items()}
        # (array id, flat chunk index) -> (object number, offset, length)
        self.locations: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.requests = 0

    def object_key(self, number: int) -> str:
        return f"{self.data_dir}/{self.process}.{number}"

    def write_metadata(self) -> list:
        return []  # array metadata is in the manifest (no zarr.json in version 3)

    def write_chunk(self, array: int, box: Box, data: np.ndarray) -> Any:
        handle = array
        spec = self._specs[handle]
        chunk_shape = tuple(spec.chunk_shape)
        if data.shape != chunk_shape:  # an edge chunk: stored whole, the part outside zeros
            padded = np.zeros(chunk_shape, data.dtype)
            padded[tuple(slice(0, n) for n in data.shape)] = data
            data = padded
        flat = flat_chunk_index(chunk_index_of(box, chunk_shape), self._grids[handle])
        length = math.prod(chunk_shape) * data.dtype.itemsize
        if not self.streams and length > self._buffer_bytes:
            if not self._buffer_bytes:  # (a writer for whole objects needs its buffers)
                raise ValueError("PackWriter: this storage writes data objects whole (writes_in_place "
                                 "is False) and no assembly buffers were given")
            return self._alone(handle, flat, data, length)  # (no assembly buffer holds it)
        pack = self._current
        if pack is not None and pack.end and _aligned(pack.end, length) + length > self.target_bytes:
            self._close(pack)
            pack = None
        if pack is None:
            pack = self._begin()
        offset = _aligned(pack.end, length)
        if pack.buffer is not None and offset > pack.end:
            # SPEC 13.2: the padding is zeros (an assembly buffer holds an earlier object's bytes)
            pack.buffer[pack.end:offset] = 0
        pack.end = offset + length
        self.locations[(handle, flat)] = (pack.number, offset, length)
        if self.streams:
            self.requests += 1
            return pack.file.write_at(offset, data)
        pack.buffer[offset:offset + length] = _bytes_of(data)
        return Done(None)

    def _alone(self, handle: int, flat: int, data: np.ndarray, length: int) -> Any:
        """A chunk larger than an assembly buffer: an object of its own, sent from its memory."""
        pack = _Pack(len(self._packs))
        self._packs.append(pack)
        pack.end = length
        self.locations[(handle, flat)] = (pack.number, 0, length)
        self.requests += 1
        pack.future = self.storage.put(self.object_key(pack.number), memoryview(_bytes_of(data)))
        return pack.future

    def _begin(self) -> _Pack:
        pack = _Pack(len(self._packs))
        self._packs.append(pack)
        if self.streams:
            pack.file = self.storage.open_pack(self.object_key(pack.number))
        else:
            if not self._free:  # both buffers sent: wait for the older send, reuse its buffer
                old = self._sent.pop(0)
                old.future.result()
                self._free.append(old.buffer)
                old.buffer = None
            pack.buffer = self._free.pop()
        self._current = pack
        return pack

    def _close(self, pack: _Pack) -> None:
        """Finish `pack`: fsync its file, or send its buffer (its first bytes) as one PUT."""
        if self._current is pack:
            self._current = None
        self.requests += 1
        if self.streams:
            pack.future = pack.file.close(pack.end)
            return
        try:
            pack.future = self.storage.put(self.object_key(pack.number), memoryview(pack.buffer[: pack.end]))
        except BaseException as e:  # reported by close()
            pack.future = Done(error=e)
        self._sent.append(pack)

    def close(self) -> None:
        """Make every data object durable (raises the first failure)."""
        if self._current is not None:
            self._close(self._current)
        error = None
        for pack in self._packs:
            try:
                if pack.future is not None:
                    pack.future.result()
            except BaseException as e:  # noqa: BLE001 (the first is raised, after all finished)
                error = error or e
        for pack in self._sent:
            if pack.buffer is not None:
                self._free.append(pack.buffer)
                pack.buffer = None
        self._sent.clear()
        if error is not None:
            raise error

    def abandon(self) -> None:
        """After a failure: let every write started finish (or fail) before the staged place is
        removed; errors are not raised (the save's own error is)."""
        try:
            self.close()
        except BaseException:  # noqa: BLE001
            pass

    @property
    def objects(self) -> list[tuple[str, int]]:
        """(key below the staged place, size) of every data object, in number order."""
        return [(self.object_key(p.number), p.end) for p in self._packs]

