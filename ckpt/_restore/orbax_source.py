"""restore / metadata of Orbax checkpoints through TensorStore, without importing Orbax.

The layout is parsed by ``ckpt._orbax`` into the same leaf records a jax-ckpt manifest holds, so
targets, ``mesh=`` and partial restores behave exactly as for jax-ckpt checkpoints. Arrays are
opened with TensorStore's ``zarr`` / ``zarr3`` driver over the item's ``ocdbt`` key-value store
or its plain directories, and only the regions this process's devices need are read (TensorStore
reads the chunks that overlap them), batch by batch within ``Options.host_budget_bytes``.

Orbax stores no checksums of array data: ``verify`` does not apply. Before reading an array, its
chunks are counted (one listing per item): an array whose metadata claims more chunks than are
stored is refused as incomplete instead of being read.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import types
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from jax.experimental.layout import Format

from ckpt._errors import CheckpointError
from ckpt._format import ARRAY_KINDS, NUMPY_SCALAR, PRNG_KEY, PY_STR, display_path, unflatten
from ckpt._format import dtype_from_name, storage_of
from ckpt._geometry import Box, box_shape, box_to_index, chunk_grid, full_box, index_to_box
from ckpt._host import Options, resolve
from ckpt._orbax import Item, Layout, OrbaxLeaf, kind_of, read_layout
from ckpt._restore.plan import (
    _key_data_sharding,
    _key_trailing,
    _Want,
    array_metadata,
    batch_by_budget,
    cast_values,
    held_note,
    logical_shape,
)
from ckpt._restore.plan import Asked, restore_tree
from ckpt._restore.view_source import ViewIO
from ckpt.storage import location_text, open_storage

_METADATA_KEYS = (".zarray", ".zattrs", ".zgroup", "zarr.json")
_contexts: dict[int, ts.Context] = {}
_lock = threading.Lock()


def _context(concurrency: int) -> ts.Context:
    with _lock:
        if concurrency not in _contexts:
            _contexts[concurrency] = ts.Context({
                "cache_pool": {"total_bytes_limit": 0},  # each chunk is read once: no data cache
                "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000},  # B-tree nodes, as Orbax
                "file_io_concurrency": {"limit": concurrency},
                "s3_request_concurrency": {"limit": concurrency},
                "gcs_request_concurrency": {"limit": concurrency},
            })
        return _contexts[concurrency]


def is_orbax(path: Any, options: Options | None = None) -> bool:
    """Whether `path` is an Orbax checkpoint, step or CheckpointManager directory (and not a
    jax-ckpt checkpoint: one exists() call decides that)."""
    return kind_of(open_storage(path, resolve(options))) is not None


def _base_kvstore(url: str, options: Options) -> dict:
    from ckpt.storage import scheme_of, tensorstore_spec

    text = location_text(url)
    extra = {} if scheme_of(text) == "file" else dict(options.storage_options or {})
    try:
        spec, _ = tensorstore_spec(text, extra)
    except CheckpointError:
        raise CheckpointError(f"{url}: Orbax checkpoints are read through TensorStore, from local paths, "
                              "file://, gs:// or s3:// locations") from None
    return spec


class OrbaxArrays:
    """The TensorStores of an Orbax checkpoint's arrays, opened on demand."""

    def __init__(self, layout: Layout, options: Options):
        self.layout, self.options = layout, options
        self.context = _context(options.io_concurrency)
        self.stores: dict[int, Any] = {}
        self._bases: dict[int, dict] = {}
        self._counts: dict[int, dict[str, int]] = {}

    def kvstore(self, item: Item) -> dict:
        key = id(item)
        if key not in self._bases:
            base = _base_kvstore(item.storage.url, self.options)
            self._bases[key] = {"driver": "ocdbt", "base": base, "cache_pool": "cache_pool#ocdbt"} if item.use_ocdbt else base
        return self._bases[key]

    def _array_kvstore(self, leaf: OrbaxLeaf) -> dict:
        kv = self.kvstore(leaf.item)
        return {**kv, "path": kv.get("path", "") + leaf.param + "/"}

    def open(self, indices) -> None:
        """Open the arrays of these leaves (reads each .zarray / zarr.json) and fill in their
        shape, dtype and chunk shape."""
        leaves = self.layout.leaves
        todo = [i for i in indices if i not in self.stores and leaves[i].param is not None
                and leaves[i].record.kind != PY_STR]
        futures = []
        for i in todo:
            leaf = leaves[i]
            spec = {"driver": "zarr3" if leaf.item.use_zarr3 else "zarr", "kvstore": self._array_kvstore(leaf),
                    "recheck_cached_data": False, "recheck_cached_metadata": False,
                    "fill_missing_data_reads": not leaf.item.fill_value_stored}
            futures.append((i, ts.open(spec, read=True, open=True, context=self.context)))
        for i, fut in futures:
            leaf = leaves[i]
            try:
                store = fut.result()
            except Exception as e:
                raise CheckpointError(f"leaf {display_path(leaf.record.path)!r}: cannot open Orbax array "
                                      f"{leaf.param!r} in {leaf.item.storage.url}: {_short(e)}") from None
            _fill_record(leaf, store)
            self.stores[i] = store

    def check_readable(self, i: int) -> None:
        """Before reading an array: refuse it when it has fewer stored chunks than its metadata
        implies, or chunks larger than this machine's memory (TensorStore decodes whole chunks;
        asking for one that cannot be allocated would abort the process instead of raising)."""
        leaf = self.layout.leaves[i]
        layout, dtype = self.stores[i].chunk_layout, dtype_from_name(leaf.record.dtype)
        for shape in (leaf.chunk_shape, layout.read_chunk.shape):
            if shape is not None and _nbytes(shape, dtype) > _memory_bytes():
                raise CheckpointError(
                    f"leaf {display_path(leaf.record.path)!r}: Orbax array {leaf.param!r} claims chunks of "
                    f"{list(shape)} {dtype.name} ({_nbytes(shape, dtype)} bytes), more than this machine's memory")
        if not leaf.item.fill_value_stored:
            return  # chunks equal to the fill value were legitimately not written
        counts = self._chunk_counts(leaf.item)
        want = int(np.prod(chunk_grid(leaf.record.shape, leaf.chunk_shape))) if leaf.record.shape else 1
        got = counts.get(leaf.param, 0)
        if got < want:
            raise CheckpointError(f"leaf {display_path(leaf.record.path)!r}: Orbax array {leaf.param!r} in "
                                  f"{leaf.item.storage.url} has {got} of its {want} chunks: the checkpoint is incomplete")

    def _chunk_counts(self, item: Item) -> dict[str, int]:
        key = id(item)
        if key not in self._counts:
            params = {l.param for l in self.layout.leaves if l.item is item and l.param is not None}
            counts: dict[str, int] = {}
            try:
                kv = ts.KvStore.open(self.kvstore(item), context=self.context).result()
                keys = kv.list().result()
            except Exception as e:
                raise CheckpointError(f"{item.storage.url}: cannot list the Orbax checkpoint: {_short(e)}") from None
            for raw in keys:
                k = raw.decode("utf-8", "replace")
                head, _, name = k.rpartition("/")
                if name in _METADATA_KEYS:
                    continue
                while head and head not in params:  # the array a chunk key belongs to
                    head = head.rpartition("/")[0]
                if head:
                    counts[head] = counts.get(head, 0) + 1
            self._counts[key] = counts
        return self._counts[key]

    def read(self, i: int, boxes: list[Box]) -> dict[Box, Any]:
        """Futures of the given regions of leaf `i`'s stored array."""
        store = self.stores[i]
        return {b: store[box_to_index(b)].read() for b in boxes}

    def result(self, i: int, futures: dict[Box, Any]) -> dict[Box, np.ndarray]:
        leaf = self.layout.leaves[i]
        out = {}
        for b, f in futures.items():
            try:
                out[b] = np.asarray(f.result())
            except Exception as e:
                raise CheckpointError(f"leaf {display_path(leaf.record.path)!r}: cannot read Orbax array "
                                      f"{leaf.param!r} in {leaf.item.storage.url}: {_short(e)}") from None
        return out


def _nbytes(shape, dtype: np.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= int(d)
    return n


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 50


def _short(e: BaseException) -> str:
    return str(e).split(" [source locations=", 1)[0][:300]


def _fill_record(leaf: OrbaxLeaf, store: Any) -> None:
    rec, name = leaf.record, display_path(leaf.record.path)
    if any(int(m) != 0 for m in store.domain.inclusive_min):
        raise CheckpointError(f"leaf {name!r}: Orbax array {leaf.param!r} does not start at index 0")
    try:
        dtype = np.dtype(store.dtype.numpy_dtype)
        storage_of(dtype)
    except TypeError:
        raise CheckpointError(f"leaf {name!r}: Orbax array {leaf.param!r} has dtype {store.dtype}, "
                              "which this library does not read") from None
    rec.shape, rec.dtype = tuple(int(n) for n in store.shape), dtype.name
    layout = store.chunk_layout
    chunk = layout.write_chunk.shape or layout.read_chunk.shape
    leaf.chunk_shape = tuple(int(n) for n in chunk) if chunk is not None else rec.shape
    if rec.prng_impl is not None:
        try:
            trailing = _key_trailing(rec.prng_impl)
        except Exception:
            raise CheckpointError(f"leaf {name!r}: unknown PRNG implementation {rec.prng_impl!r}") from None
        if dtype != np.uint32 or len(rec.shape) < trailing:
            raise CheckpointError(f"leaf {name!r}: {rec.prng_impl} key data {dtype.name}{list(rec.shape)} "
                                  "is not uint32 with the key's trailing dimensions")
        rec.kind = PRNG_KEY
    if rec.kind == NUMPY_SCALAR and rec.shape != ():
        raise CheckpointError(f"leaf {name!r}: an Orbax scalar stored with shape {list(rec.shape)}")
    if rec.sharding is not None and rec.sharding["kind"] == "named":
        # Orbax records a key array's sharding for its key data: drop what the key dims add.
        spec, ndim = list(rec.sharding["spec"]), len(logical_shape(rec))
        while len(spec) > ndim and spec[-1] is None:
            spec.pop()
        rec.sharding = {**rec.sharding, "spec": spec} if len(spec) <= ndim else {"kind": "other"}


def _place(rec, want: _Want, regions: dict[Box, np.ndarray]) -> Any:
    for box, a in regions.items():
        # The cast rule of every restore (plan.py, "casts"), on every region read.
        regions[box] = a if a.dtype == want.dtype else cast_values(
            a, want.dtype, display_path(rec.path), want.lossy_ok, held_note(want, a.dtype))
    if want.sharding is None:
        value = regions[full_box(rec.shape)]
        if rec.kind == PRNG_KEY:
            return jax.random.wrap_key_data(value, impl=rec.prng_impl)
        return value.item() if rec.kind == NUMPY_SCALAR else value  # Orbax restores scalars as numbers
    sharding = _key_data_sharding(want.sharding, rec) if rec.kind == PRNG_KEY else want.sharding
    # A layout the target asks for (plan._custom_layout; never for PRNG keys): placed in it.
    where = sharding if want.layout is None else Format(want.layout, sharding)
    arr = jax.make_array_from_callback(rec.shape, where, lambda idx: regions[index_to_box(idx, rec.shape)],
                                       dtype=want.dtype)
    return jax.random.wrap_key_data(arr, impl=rec.prng_impl) if rec.kind == PRNG_KEY else arr


def _boxes(rec, want: _Want) -> list[Box]:
    if want.sharding is None:
        return [full_box(rec.shape)]
    sharding = _key_data_sharding(want.sharding, rec) if rec.kind == PRNG_KEY else want.sharding
    return list(dict.fromkeys(index_to_box(idx, rec.shape)
                              for idx in sharding.addressable_devices_indices_map(rec.shape).values()))


def _build(arrays: OrbaxArrays, wants: list[_Want]) -> dict[int, Any]:
    leaves = arrays.layout.leaves
    boxes = [_boxes(leaves[w.index].record, w) for w in wants]
    sizes = [sum(_nbytes(box_shape(b), dtype_from_name(leaves[w.index].record.dtype)) for b in bs)
             for w, bs in zip(wants, boxes)]
    for w, n in zip(wants, sizes):
        if n > _memory_bytes():  # (whatever the shapes claim, never an allocation that cannot succeed)
            raise CheckpointError(f"leaf {display_path(leaves[w.index].record.path)!r}: the regions this process "
                                  f"needs hold {n} bytes, more than this machine's memory")
    out: dict[int, Any] = {}
    for batch in batch_by_budget(sizes, arrays.options.host_budget_bytes):
        for k in batch:
            arrays.check_readable(wants[k].index)
        pending = {k: arrays.read(wants[k].index, boxes[k]) for k in batch}  # all reads in flight
        for k in batch:
            i = wants[k].index
            out[i] = _place(leaves[i].record, wants[k], arrays.result(i, pending.pop(k)))
    return out


def open_layout(path: Any, options: Options) -> Layout:
    return read_layout(open_storage(path, options))


def restore(path: Any, target: Any = None, *, mesh: jax.sharding.Mesh | None = None, partial: bool = False,
            options: Options | None = None, allow_lossy_cast: bool = False,
            axis_names: dict[str, str] | None = None, rename: Any = None) -> Any:
    """``ckpt.restore`` of an Orbax checkpoint (see there; `verify` does not apply)."""
    asked = Asked(target, mesh, partial, False, allow_lossy_cast, axis_names, rename)
    opts = resolve(options)
    layout = open_layout(path, opts)
    arrays = OrbaxArrays(layout, opts)
    recs = [l.record for l in layout.leaves]
    # (only the arrays the target chose are opened)
    return restore_tree(layout.tree, recs, asked, lambda wants: _build(arrays, wants),
                        paths=[r.path for r in recs], chosen=arrays.open,
                        view=_view(arrays, opts) if asked.rename is not None else None)


def _view(arrays: OrbaxArrays, opts: Options) -> ViewIO:
    """How ``rename=`` parts read the regions of Orbax arrays: all of one chunk's in flight at once."""
    from ckpt._restore.read import Reader, RestoreStats

    def regions(wanted: dict[int, list[Box]]) -> dict[tuple[int, Box], np.ndarray]:
        for i in wanted:
            arrays.check_readable(i)
        pending = {i: arrays.read(i, boxes) for i, boxes in wanted.items()}
        return {(i, b): a for i, f in pending.items() for b, a in arrays.result(i, f).items()}

    return ViewIO(regions, lambda v, every: Reader(v, every, False, RestoreStats(), opts), opts.host_budget_bytes)


def metadata(path: Any, options: Options | None = None) -> Any:
    """``ckpt.metadata`` of an Orbax checkpoint: opens each array's metadata, reads no data."""
    opts = resolve(options)
    layout = open_layout(path, opts)
    arrays = OrbaxArrays(layout, opts)
    arrays.open(range(len(layout.leaves)))
    values = []
    for leaf in layout.leaves:
        rec = leaf.record
        if rec.kind in ARRAY_KINDS:
            values.append(dataclasses.replace(array_metadata(rec), chunk_shape=leaf.chunk_shape,
                                              storage_path=leaf.param))
        else:
            values.append(rec.py_value())
    return unflatten(layout.tree, values)


# This format as a source of ckpt.restore and ckpt.metadata (``ckpt._restore.source``).
SOURCE = types.SimpleNamespace(detect=is_orbax, restore=restore, metadata=metadata)
