"""Describing leaves for a save: what kind each is, how it is stored (inline in the manifest or
as a Zarr array with which chunk shape), and where its unique shards live. No I/O."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ckpt import _dtypes
from ckpt._checksum import ALGORITHM
from ckpt._errors import CheckpointError
from ckpt._layout import describe_sharding, full_box, index_to_box
from ckpt._manifest import (
    INLINE_LIMIT, JAX_ARRAY, NUMPY, NUMPY_SCALAR, PRNG_KEY, PY_BOOL, PY_BYTES, PY_COMPLEX, PY_FLOAT,
    PY_INT, PY_STR, InlineStorage, LeafRecord, Stack, StackedStorage, ZarrStorage,
)
from ckpt._plan import HOST, ArrayShards, SavePlan
from ckpt._tree import FlatLeaf, display_path


@dataclass
class Leaf:
    record: LeafRecord
    source: Any = None  # jax.Array / np.ndarray to write chunks from (None when inline)
    chunk_shape: tuple[int, ...] | None = None
    logical_dtype: np.dtype | None = None


# Where stacks of packed small arrays live, below the data root ('~' never begins a leaf's
# escaped storage path, except the '~<leaf index>' of a clash, which is never '~stacks').
STACKS_DIR = "~stacks"


# Per dtype, not per leaf (numpy computes dtype names in Python; thousands of leaves share a few).
@functools.lru_cache(maxsize=256)
def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@functools.lru_cache(maxsize=256)
def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


@functools.lru_cache(maxsize=64)
def _sharding_record(sharding) -> dict:
    # Trees share a handful of shardings among thousands of leaves. The record is shared by
    # every leaf with this sharding and never modified.
    return describe_sharding(sharding).to_record()


def _inline_record(rec: LeafRecord, host: np.ndarray) -> None:
    rec.storage = InlineStorage(_dtypes.to_storage(host).tobytes())


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@functools.lru_cache(maxsize=1024)
def chunk_shape_for(shard_shape: tuple[int, ...], itemsize: int, cap: int) -> tuple[int, ...]:
    """The chunk shape of an array whose shards have `shard_shape`: the shard itself when it
    holds at most `cap` bytes, else an even division of it into chunks of at most `cap` bytes.

    Every chunk dimension divides the shard's, so each chunk lies inside one shard (one writer)
    and all chunks of the array have one shape (a regular Zarr grid). Leading dimensions are split
    first: a chunk is ``(1, ..., 1, c, shard[d+1], ..., shard[-1])`` with ``c`` a divisor of
    ``shard[d]``, the largest such chunk of at most `cap` bytes (rows of the shard stay whole,
    so a chunk is one contiguous run of the shard's memory when it is C-ordered). When
    divisibility leaves only chunks far smaller than the cap (below cap/16, e.g. a 1-d shard of
    prime length), the smallest even division larger than the cap (possibly the whole shard) is
    taken instead: a chunk may then exceed `cap` (and such a chunk is staged alone when it
    exceeds the host budget).
    """
    shape = tuple(int(n) for n in shard_shape)
    total = math.prod(shape) * itemsize
    if total <= cap or total == 0:
        return shape
    best_under: tuple[int, tuple] | None = None
    best_over: tuple[int, tuple] | None = None
    for d in range(len(shape)):
        rest = math.prod(shape[d + 1:]) * itemsize  # bytes of one index along d, later dims whole
        for c in _divisors(shape[d]):
            nbytes = c * rest
            candidate = (*(1,) * d, c, *shape[d + 1:])
            if nbytes <= cap:
                if best_under is None or nbytes > best_under[0]:
                    best_under = (nbytes, candidate)
            elif best_over is None or nbytes < best_over[0]:
                best_over = (nbytes, candidate)
    if best_under is not None and (best_under[0] * 16 >= cap or best_over is None):
        return best_under[1]
    return best_over[1] if best_over is not None else shape  # (a 0-d array)


def describe(leaf: FlatLeaf, process_count: int, max_chunk_bytes: int | None = None) -> Leaf:
    """What `leaf` is and how it is stored; array leaves get their chunk shape
    (``chunk_shape_for`` the shard shape and `max_chunk_bytes`; None: the shard shape)."""
    v, path = leaf.value, leaf.path
    rec = LeafRecord(path=path, kind="")
    if isinstance(v, jax.core.Tracer):
        raise CheckpointError(f"leaf {display_path(path)!r} is a tracer: save outside jit/vmap")
    if isinstance(v, jax.Array):
        if v.is_deleted():
            raise CheckpointError(f"leaf {display_path(path)!r}: the array was deleted (donated?) before the save")
        data = v
        rec.kind = JAX_ARRAY
        if _is_key(v.dtype):
            rec.kind, rec.prng_impl = PRNG_KEY, str(jax.random.key_impl(v))
            data = jax.random.key_data(v)
        rec.shape, rec.dtype = tuple(data.shape), _dtype_name(data.dtype)
        rec.sharding = _sharding_record(v.sharding)
        nbytes = data.size * data.dtype.itemsize
        if nbytes <= INLINE_LIMIT and (process_count == 1 or (data.sharding.is_fully_replicated and any(
                d.process_index == 0 for d in data.sharding.device_set))):
            full = data.addressable_shards[0].data if process_count > 1 else data
            _inline_record(rec, np.asarray(full))
            return Leaf(rec)
        chunk = tuple(data.sharding.shard_shape(data.shape))
        if max_chunk_bytes is not None:
            chunk = chunk_shape_for(chunk, data.dtype.itemsize, max_chunk_bytes)
        return Leaf(rec, data, chunk, np.dtype(data.dtype))
    if isinstance(v, (np.ndarray, np.generic)):
        a = np.asarray(v)
        rec.kind = NUMPY if isinstance(v, np.ndarray) else NUMPY_SCALAR
        if a.dtype.kind in "OUSMm" or a.dtype.names is not None or a.dtype.subdtype is not None:
            raise CheckpointError(f"leaf {display_path(path)!r}: cannot save numpy dtype {a.dtype}")
        try:
            _dtypes.storage_of(a.dtype)
        except TypeError:
            raise CheckpointError(f"leaf {display_path(path)!r}: cannot save numpy dtype {a.dtype}") from None
        rec.shape, rec.dtype = a.shape, a.dtype.name
        if a.nbytes <= INLINE_LIMIT:
            _inline_record(rec, a)
            return Leaf(rec)
        chunk = tuple(a.shape)
        if max_chunk_bytes is not None:
            chunk = chunk_shape_for(chunk, a.dtype.itemsize, max_chunk_bytes)
        return Leaf(rec, a, chunk, a.dtype)
    if isinstance(v, bool):
        rec.kind, rec.value = PY_BOOL, v
    elif isinstance(v, int):
        rec.kind, rec.value = PY_INT, v if -(2**63) <= v < 2**64 else str(v)
    elif isinstance(v, float):
        rec.kind, rec.value = PY_FLOAT, v
    elif isinstance(v, complex):
        rec.kind, rec.value = PY_COMPLEX, [v.real, v.imag]
    elif isinstance(v, str):
        rec.kind, rec.value = PY_STR, v
    elif isinstance(v, bytes):
        rec.kind, rec.value = PY_BYTES, v
    else:
        raise CheckpointError(
            f"leaf {display_path(path)!r}: cannot save a value of type {type(v).__module__}.{type(v).__qualname__}"
            + _not_data_hint(v)
        )
    return Leaf(rec)


def _not_data_hint(v: Any) -> str:
    import sys

    if not callable(v):
        return ""
    if "equinox" in sys.modules:  # a whole equinox Module holds its functions (activations...) as leaves
        return ("; a function is not data: save only the arrays of an equinox Module, "
                "eqx.filter(model, eqx.is_array) or the first half of eqx.partition(model, eqx.is_array), and "
                "eqx.combine the restored arrays with the rest (docs/frameworks/equinox.md)")
    return "; a function is not data: save only the arrays (and numbers, strings) of the tree"


def finish_array_records(leaves: list[Leaf], paths: list[str]) -> None:
    for leaf, spath in zip(leaves, paths):
        if leaf.source is None:
            continue
        storage_dtype, encoding = _dtypes.storage_of(leaf.logical_dtype)
        # chunk_checksums are filled in at commit.
        leaf.record.storage = ZarrStorage(spath, tuple(leaf.chunk_shape), storage_dtype.name, encoding, ALGORITHM)


def pack_records(leaves: list[Leaf], plan: SavePlan) -> list[Stack]:
    """Give the leaves the plan packs their storage: one whole-array chunk, or a member of a
    stack (at STACKS_DIR/<stack>). Returns the stacks (their checksums are filled in at commit)."""
    for i in plan.whole:
        leaf = leaves[i]
        leaf.chunk_shape = tuple(leaf.record.shape)
        leaf.record.storage = dataclasses.replace(leaf.record.storage, chunk_shape=leaf.chunk_shape)
    stacks = []
    for s, planned in enumerate(plan.stacks):
        storage_dtype, encoding = _dtypes.storage_of(_dtypes.dtype_from_name(planned.dtype))
        zarr = ZarrStorage(f"{STACKS_DIR}/{s}", (planned.chunk_members, *planned.shape), storage_dtype.name,
                           encoding, ALGORITHM)
        stack = Stack((len(planned.members), *planned.shape), planned.dtype, zarr)
        stacks.append(stack)
        for k, i in enumerate(planned.members):
            leaves[i].record.storage = StackedStorage(s, k, stack)
            leaves[i].chunk_shape = None
    return stacks


def array_shards(leaves: list[Leaf]) -> list[ArrayShards]:
    """The unique regions of every array leaf written as Zarr, with their holders, shapes and
    dtypes (for packing)."""
    out, cache = [], {}
    for i, leaf in enumerate(leaves):
        src = leaf.source
        if src is None:
            continue
        if isinstance(src, np.ndarray):
            holders = {full_box(src.shape): [(0, HOST)]}
        else:
            key = (src.sharding, src.shape)
            if key not in cache:
                holders = {}
                for d, idx in src.sharding.devices_indices_map(src.shape).items():
                    holders.setdefault(index_to_box(idx, src.shape), []).append((d.process_index, d.id))
                cache[key] = holders
            holders = cache[key]
        out.append(ArrayShards(i, src.dtype.itemsize, holders, tuple(leaf.record.shape), leaf.record.dtype,
                               tuple(leaf.chunk_shape)))
    return out
