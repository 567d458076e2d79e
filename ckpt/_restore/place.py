"""Placing restored data: what each leaf is built as (``_Want``), the units the reader cuts it
into, the host memory a batch holds (``_Lease``, of the restore's ``HostBudget``), and the building of a leaf's
numpy result or its devices' arrays unit by unit.

A leaf whose device shards are all small (under ``BATCH_PUT_MAX_BYTES``) is placed in one
batched transfer for all its devices once its last shard is read (``_put_together``: JAX's
batched put, the one ``jax.make_array_from_callback`` ends in), instead of a ``device_put`` per
device (~110 us each on CPU: 4,000 small leaves on 8 devices were 32,000 calls). A larger shard is its own ``jax.device_put`` of a host buffer, made
as soon as it is read (so the device adopts aligned buffers and the budget gets them back at
once); a shard larger than the host budget arrives in pieces, each put on the device and written into a device buffer there
(``dynamic_update_slice`` with the buffer donated, so the device holds one copy of the shard
plus one piece; a CPU device's shard is instead filled in place in a host buffer the device
then adopts, which compiles nothing); ``jax.make_array_from_single_device_arrays`` makes the
array. Host buffers handed to ``device_put`` are never written afterwards (on CPU the device may
adopt them).

A target that asks for a device layout other than the default (``_Want.layout``) has every
shard placed with ``Format(layout, device)``: JAX then copies the host data into that layout on
the device (no adoption); a shard streamed in pieces is built in the default layout and copied
into the asked one once complete (two device copies of that shard for a moment).
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
from jax.experimental.layout import Format
from jax.sharding import SingleDeviceSharding

from ckpt._format import NUMPY_SCALAR, PRNG_KEY, LeafRecord
from ckpt._geometry import Box, box_shape, full_box, index_to_box, relative
from ckpt._host import HostBudget, aligned_empty
from ckpt._restore.plan import _key_data_sharding, _Want


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
# Shards below this many bytes wait for the rest of their leaf and are placed together (one
# batched transfer per leaf, _put_together). The same bound as _ADOPT_MIN_BYTES: larger shards are
# adopted or copied by their own device_put as soon as they are read, smaller ones never are
# adopted, so waiting costs them nothing but the (small) host memory they already hold.
# Measured: docs/benchmarks.md, "Many small leaves".
BATCH_PUT_MAX_BYTES = 1 << 20


@functools.lru_cache(maxsize=64)
def _zeros_on(shape: tuple[int, ...], dtype: np.dtype, sharding) -> Callable[[], jax.Array]:
    """Zeros made on the device itself (``jnp.zeros(..., device=)`` measured twice the array's
    size of host memory for a CPU device other than the default: made there, then copied)."""
    return jax.jit(functools.partial(jax.numpy.zeros, shape, dtype), out_shardings=sharding)


@functools.partial(jax.jit, donate_argnums=0)
def _update(buf, piece, *start):
    return jax.lax.dynamic_update_slice(buf, piece, start)


@functools.lru_cache(maxsize=256)
def _device_boxes(sharding, shape: tuple[int, ...]) -> tuple[list, dict[Box, list]]:
    """(this process's devices, the devices holding each box) of `sharding` over `shape`. Many
    leaves share both (layer stacks, optimizer states): computed once. Callers do not mutate."""
    idx = sharding.addressable_devices_indices_map(shape)
    by_box: dict[Box, list] = {}
    for d, i in idx.items():
        by_box.setdefault(index_to_box(i, shape), []).append(d)
    return list(idx), by_box


try:  # the batched transfer jax.make_array_from_callback ends in (same signature in jax 0.10 and 0.12)
    from jax._src import core as _jax_core
    from jax._src.interpreters.pxla import batched_device_put as _batched_device_put
except ImportError:  # another JAX: make_array_from_callback itself
    _batched_device_put = None


@functools.lru_cache(maxsize=256)
def _batch_plan(sharding, shape: tuple[int, ...], dtype: np.dtype):
    """(abstract value, devices, their indices, their boxes, shard shape) for putting a leaf's
    shards on this process's devices in one transfer, or None where only
    make_array_from_callback knows how (a dtype JAX would canonicalize, an extended dtype).
    Shared by the many leaves of one shape, dtype and sharding: computed once."""
    if _batched_device_put is None or jax.dtypes.canonicalize_dtype(dtype) != dtype:
        return None
    try:
        aval = _jax_core.update_aval_with_sharding(_jax_core.ShapedArray(shape, dtype), sharding)
    except Exception:  # noqa: BLE001 (a JAX whose internals moved: make_array_from_callback)
        return None
    idx = sharding.addressable_devices_indices_map(shape)
    return (aval, list(idx), list(idx.values()), [index_to_box(i, shape) for i in idx.values()],
            sharding.shard_shape(shape))


def _put_together(shape: tuple[int, ...], sharding, layout, dtype: np.dtype, shard_of: Callable) -> jax.Array:
    """One array from host shards, every local device's in one batched transfer;
    `shard_of(index, box)` is a device's shard (a numpy array of `dtype`).

    What ``jax.make_array_from_callback`` does, less its per-call bookkeeping (an abstract value,
    the device map and a per-device wrapper, rebuilt for each leaf): 4,000 small leaves on 8
    devices measured 0.15-0.27 s here against 0.23-0.34 s through make_array_from_callback,
    interleaved in one process (docs/benchmarks.md, "Many small leaves"). Anything the fast way
    does not cover (a layout, a dtype JAX would canonicalize, a shard of another dtype or
    shape) goes through make_array_from_callback."""
    if layout is None and _batched_device_put is not None:
        plan = _batch_plan(sharding, shape, dtype)
        if plan is not None:
            aval, devices, indices, boxes, shard_shape = plan
            values = [shard_of(i, b) for i, b in zip(indices, boxes)]
            if all(type(v) is np.ndarray and v.dtype == aval.dtype and v.shape == shard_shape for v in values):
                return _batched_device_put(aval, sharding, values, devices)
    return jax.make_array_from_callback(shape, sharding if layout is None else Format(layout, sharding),
                                        lambda index: shard_of(index, index_to_box(index, shape)))


class _Build:
    """One leaf being built: the numpy result, or each local device's array, unit by unit."""

    def __init__(self, rec: LeafRecord, want: _Want, units: int, together: bool = False):
        """`together`: the leaf is small and read in one batch (Reader.run), so its shards may
        wait for each other and be placed in one batched transfer."""
        self.rec, self.want, self.left, self.together = rec, want, units, together
        self.result: np.ndarray | None = None
        self.sharding = want.sharding
        self.waiting: dict[Box, np.ndarray] = {}  # small shards placed together by value()
        self.leases: list = []  # the host bytes of those shards, given back once placed
        self.whole: tuple[Box, np.ndarray] | None = None  # (box, data): a small leaf read as one unit
        self.layout = want.layout  # None: the default layout (plan._custom_layout)
        self.streamed: set = set()  # devices whose shard was built piece by piece on the device
        if want.sharding is not None:
            if rec.kind == PRNG_KEY:
                self.sharding = _key_data_sharding(want.sharding, rec)
            self.devices, self.by_box = _device_boxes(self.sharding, rec.shape)
            self.parts: dict = {}
            self.host_parts: dict[Box, np.ndarray] = {}  # CPU devices: shards filled piece by piece

    def put(self, unit: _Unit, data: np.ndarray, own: bool, lease) -> list | None:
        """Place `data` (unit.box, in the wanted dtype; `own`: a buffer of this unit alone);
        the device arrays made (to wait on), or None when `data` waits to be placed with the
        rest of the leaf (``value()``: `lease` is then kept until it is). Host copies made here
        are counted in `lease`."""
        self.left -= 1
        if self.sharding is not None and unit.region not in self.by_box:
            # The whole (small) leaf as one unit (Reader._groups): every device's shard is cut
            # from it by value().
            self.whole = (unit.region, data)
            if lease.taken:  # copies made for this leaf: kept until it is placed
                self.leases.append(lease)
            return None
        if (self.together and self.sharding is not None and unit.box == unit.region
                and data.nbytes < BATCH_PUT_MAX_BYTES and not self.parts and not self.host_parts):
            self.waiting[unit.region] = data
            if lease.taken:  # copies made for this leaf: kept until it is placed
                self.leases.append(lease)
            return None
        if self.sharding is None:
            if own and data.flags.writeable and unit.box == full_box(self.rec.shape):
                self.result = data  # read or converted for this leaf alone: it becomes the result
            else:
                if self.result is None:
                    self.result = np.empty(self.rec.shape, self.want.dtype)
                self.result[relative(unit.box, full_box(self.rec.shape)) + (...,)] = data
            return []
        made = self._place_waiting()
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
            streamed = unit.box != unit.region
            # A piece goes into a buffer made in the default layout: relaid once whole (value()).
            placed = jax.device_put(host, self._single(d, layout=not streamed))
            if host is not data and d is devices[0] and unit.box == unit.region and _aliases(placed, host):
                lease.give(host.nbytes)  # the device buffer itself now: device memory
            if unit.box != unit.region:  # streamed: a piece of the device's shard
                buf = self.parts.get(d)
                if buf is None:
                    buf = _zeros_on(box_shape(unit.region), np.dtype(self.want.dtype), self._single(d, layout=False))()
                    self.streamed.add(d)
                start = tuple(a - o for (a, _), (o, _) in zip(unit.box, unit.region))
                # Waited for now: the next piece donates this buffer, and the host piece must
                # outlive its copy.
                placed = _update(buf, placed, *start).block_until_ready()
                self.parts[d] = placed
                continue
            self.parts[d] = placed
            made.append(placed)
        return made

    def _single(self, d, layout: bool = True):
        """Where one device's shard goes: that device (the target's memory kind), in the
        layout asked for unless `layout` is False."""
        one = SingleDeviceSharding(d, memory_kind=getattr(self.sharding, "memory_kind", None))
        return one if self.layout is None or not layout else Format(self.layout, one)

    def _place_waiting(self) -> list:
        """Put the shards that waited on their devices one by one (a leaf that turned out to
        have a larger shard too); the arrays made."""
        made = []
        for region, data in self.waiting.items():
            for d in self.by_box[region]:
                self.parts[d] = jax.device_put(data, self._single(d))
                made.append(self.parts[d])
        self.waiting = {}
        return made

    def value(self) -> Any:
        """The leaf, once every unit is put. Host buffers given to the devices here are alive
        until the result is ready: the caller waits on it before closing ``self.leases``."""
        rec = self.rec
        if self.sharding is None:
            value = self.result
            if value is None:  # an array with no elements
                value = np.empty(rec.shape, self.want.dtype)
            if rec.kind == PRNG_KEY:  # typed keys have no numpy form: a key array on the default device
                return jax.random.wrap_key_data(value, impl=rec.prng_impl)
            return value[()] if rec.kind == NUMPY_SCALAR else value
        if self.whole is not None:
            (bound, data), self.whole = self.whole, None
            if all(a == 0 for a, _ in bound):  # (the usual case: the whole leaf, cut by the device indices)
                def shard_of(index, box):
                    return data[index]
            else:
                def shard_of(index, box):
                    return data[relative(box, bound)]
            arr = _put_together(rec.shape, self.sharding, self.layout, data.dtype, shard_of)
            return jax.random.wrap_key_data(arr, impl=rec.prng_impl) if rec.kind == PRNG_KEY else arr
        if self.waiting and len(self.waiting) == len(self.by_box):
            # Every shard small and read: all devices at once (one batched transfer).
            waiting, self.waiting = self.waiting, {}
            def shard_of(index, box):
                return waiting[box]
            arr = _put_together(rec.shape, self.sharding, self.layout, next(iter(waiting.values())).dtype, shard_of)
            return jax.random.wrap_key_data(arr, impl=rec.prng_impl) if rec.kind == PRNG_KEY else arr
        self._place_waiting()
        for region, buf in self.host_parts.items():
            for d in self.by_box[region]:
                self.parts[d] = jax.device_put(buf, self._single(d))
        self.host_parts = {}
        for d in self.streamed:  # built in the default layout, piece by piece: now in the one asked for
            if self.layout is not None and d in self.parts:
                self.parts[d] = jax.device_put(self.parts[d], self._single(d))
        self.streamed = set()
        arrays = [self.parts.get(d) for d in self.devices]
        if any(a is None for a in arrays):  # an array with no elements: nothing was read
            arrays = [jax.device_put(np.empty(box_shape(b), self.want.dtype), self._single(d))
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
