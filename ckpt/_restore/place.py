"""Placing restored data: what each leaf is built as (``_Want``), the units the reader cuts it
into, the host memory they hold (``HostBudget``, ``_Lease``), and the building of a leaf's
numpy result or its devices' arrays unit by unit.

Each device's shard is its own ``jax.device_put`` of a host buffer; a shard larger than the host
budget arrives in pieces, each put on the device and written into a device buffer there
(``dynamic_update_slice`` with the buffer donated, so the device holds one copy of the shard
plus one piece; a CPU device's shard is instead filled in place in a host buffer the device
then adopts, which compiles nothing); ``jax.make_array_from_single_device_arrays`` makes the
array. Host buffers handed to ``device_put`` are never written afterwards (on CPU the device may
adopt them).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from ckpt._geometry import Box, box_shape, full_box, index_to_box, relative
from ckpt._format import NUMPY_SCALAR, PRNG_KEY, LeafRecord
from ckpt._memory import aligned_empty
from ckpt._restore.plan import _key_data_sharding, _Want


class HostBudget:
    """Host bytes the reader holds now, and the most it ever held (thread-safe counters)."""

    def __init__(self, limit: int):
        self.limit, self.held, self.high_water = limit, 0, 0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            self.held += n
            self.high_water = max(self.high_water, self.held)

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n


class _Lease:
    """The bytes one batch took from the budget, all given back when the batch is done."""

    def __init__(self, budget: HostBudget):
        self.budget, self.taken = budget, 0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            self.taken += n
        self.budget.take(n)

    def give(self, n: int) -> None:
        with self._lock:
            self.taken -= n
        self.budget.give(n)

    def close(self) -> None:
        """Give back everything taken (its buffers are no longer referenced)."""
        with self._lock:
            n, self.taken = self.taken, 0
        self.budget.give(n)


@dataclass(frozen=True)
class _Piece:
    key: tuple  # the source read: ("z", array path, chunk), ("s", stack path, chunk), ("i", leaf)
    box: Box  # the part of the leaf it holds
    row: int | None = None  # a stack chunk: the leaf's row in it


@dataclass
class _Unit:
    k: int  # position in the wants
    box: Box  # what this unit assembles: its region, or a sub-box of it
    region: Box
    pieces: tuple[_Piece, ...]
    cost: int  # host bytes besides its sources': assembly and dtype conversion


# Off only in a test, so that the accelerators' way (pieces updated on the device) runs on CPU.
FILL_CPU_SHARDS_IN_PLACE = True


@functools.lru_cache(maxsize=64)
def _zeros_on(shape: tuple[int, ...], dtype: np.dtype, sharding) -> Callable[[], jax.Array]:
    """Zeros made on the device itself (``jnp.zeros(..., device=)`` measured twice the array's
    size of host memory for a CPU device other than the default: made there, then copied)."""
    return jax.jit(functools.partial(jax.numpy.zeros, shape, dtype), out_shardings=sharding)


@functools.partial(jax.jit, donate_argnums=0)
def _update(buf, piece, *start):
    return jax.lax.dynamic_update_slice(buf, piece, start)


class _Build:
    """One leaf being built: the numpy result, or each local device's array, unit by unit."""

    def __init__(self, rec: LeafRecord, want: _Want, units: int):
        self.rec, self.want, self.left = rec, want, units
        self.result: np.ndarray | None = None
        self.sharding = want.sharding
        if want.sharding is not None:
            if rec.kind == PRNG_KEY:
                self.sharding = _key_data_sharding(want.sharding, rec)
            idx = self.sharding.addressable_devices_indices_map(rec.shape)
            self.devices = list(idx)
            self.by_box: dict[Box, list] = {}
            for d, i in idx.items():
                self.by_box.setdefault(index_to_box(i, rec.shape), []).append(d)
            self.parts: dict = {}
            self.host_parts: dict[Box, np.ndarray] = {}  # CPU devices: shards filled piece by piece

    def put(self, unit: _Unit, data: np.ndarray, own: bool, lease) -> list:
        """Place `data` (unit.box, in the wanted dtype; `own`: a buffer of this unit alone);
        the device arrays made (to wait on). Host copies made here are counted in `lease`."""
        self.left -= 1
        if self.sharding is None:
            if own and data.flags.writeable and unit.box == full_box(self.rec.shape):
                self.result = data  # read or converted for this leaf alone: it becomes the result
            else:
                if self.result is None:
                    self.result = np.empty(self.rec.shape, self.want.dtype)
                self.result[relative(unit.box, full_box(self.rec.shape)) + (...,)] = data
            return []
        made = []
        memory_kind = getattr(self.sharding, "memory_kind", None)
        devices = self.by_box[unit.region]
        if unit.box != unit.region and devices[0].platform == "cpu" and FILL_CPU_SHARDS_IN_PLACE:
            # A CPU device's memory is host memory: its shard is filled in place, in a buffer
            # the device adopts once complete (value()), with no compiled update per piece.
            buf = self.host_parts.get(unit.region)
            if buf is None:
                dtype = np.dtype(self.want.dtype)
                shape = box_shape(unit.region)
                buf = aligned_empty(math.prod(shape) * dtype.itemsize).view(dtype).reshape(shape)
                self.host_parts[unit.region] = buf
            buf[relative(unit.box, unit.region) + (...,)] = data
            return []
        host = _adoptable(data, devices[0], lease)
        for d in devices:
            placed = jax.device_put(host, SingleDeviceSharding(d, memory_kind=memory_kind))
            if host is not data and d is devices[0] and unit.box == unit.region and _aliases(placed, host):
                lease.give(host.nbytes)  # the device buffer itself now: device memory
            if unit.box != unit.region:  # streamed: a piece of the device's shard
                buf = self.parts.get(d)
                if buf is None:
                    buf = _zeros_on(box_shape(unit.region), np.dtype(self.want.dtype),
                                    SingleDeviceSharding(d, memory_kind=memory_kind))()
                start = tuple(a - o for (a, _), (o, _) in zip(unit.box, unit.region))
                # Waited for now: the next piece donates this buffer, and the host piece must
                # outlive its copy.
                placed = _update(buf, placed, *start).block_until_ready()
                self.parts[d] = placed
                continue
            self.parts[d] = placed
            made.append(placed)
        return made

    def value(self) -> Any:
        rec = self.rec
        if self.sharding is None:
            value = self.result
            if value is None:  # an array with no elements
                value = np.empty(rec.shape, self.want.dtype)
            if rec.kind == PRNG_KEY:  # typed keys have no numpy form: a key array on the default device
                return jax.random.wrap_key_data(value, impl=rec.prng_impl)
            return value[()] if rec.kind == NUMPY_SCALAR else value
        memory_kind = getattr(self.sharding, "memory_kind", None)
        for region, buf in self.host_parts.items():
            for d in self.by_box[region]:
                self.parts[d] = jax.device_put(buf, SingleDeviceSharding(d, memory_kind=memory_kind))
        self.host_parts = {}
        arrays = [self.parts.get(d) for d in self.devices]
        if any(a is None for a in arrays):  # an array with no elements: nothing was read
            arrays = [jax.device_put(np.empty(box_shape(b), self.want.dtype), d)
                      for b, ds in self.by_box.items() for d in ds]
            arrays.sort(key=lambda a: self.devices.index(next(iter(a.devices()))))
        arr = jax.make_array_from_single_device_arrays(rec.shape, self.sharding, arrays)
        return jax.random.wrap_key_data(arr, impl=rec.prng_impl) if rec.kind == PRNG_KEY else arr


# XLA's CPU client adopts a host buffer as a device buffer when it is aligned to this (and
# writable); anything else it copies. Large unaligned data (views into chunks, an engine's own
# buffers) is copied into an aligned buffer here instead: the same one copy, made on the
# reading thread while other reads arrive (measured: docs/benchmarks.md, "Object stores"), and
# the buffer becomes the device's. Every built-in engine already reads chunks into aligned buffers.
_CPU_ALIGNMENT = 64
_ADOPT_MIN_BYTES = 1 << 20


def _adoptable(data: np.ndarray, device, lease) -> np.ndarray:
    if (device.platform != "cpu" or data.nbytes < _ADOPT_MIN_BYTES
            or (data.ctypes.data % _CPU_ALIGNMENT == 0 and data.flags.writeable and data.flags.c_contiguous)):
        return data
    lease.take(data.nbytes)
    buf = aligned_empty(data.nbytes).view(data.dtype).reshape(data.shape)
    np.copyto(buf, data)
    return buf


def _aliases(placed: jax.Array, host: np.ndarray) -> bool:
    try:
        return placed.unsafe_buffer_pointer() == host.ctypes.data
    except Exception:  # noqa: BLE001 (a backend without raw pointers: then it was copied)
        return False


def _split(box: Box, chunk_shape, fits: Callable[[Box], bool]) -> list[Box]:
    """`box` cut along chunk boundaries into sub-boxes that fit (or lie in one chunk each)."""
    cells = [len(range(a // c, -(-b // c))) for (a, b), c in zip(box, chunk_shape)]
    if fits(box) or all(n <= 1 for n in cells):
        return [box]
    axis = max(range(len(box)), key=lambda i: cells[i])
    (a, b), c = box[axis], chunk_shape[axis]
    cut = (a // c + cells[axis] // 2) * c
    lo = box[:axis] + ((a, cut),) + box[axis + 1:]
    hi = box[:axis] + ((cut, b),) + box[axis + 1:]
    return _split(lo, chunk_shape, fits) + _split(hi, chunk_shape, fits)
