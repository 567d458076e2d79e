"""Save and restore plans: which process writes or reads which region. Pure functions of
shapes, shardings and process indices; no I/O, no devices needed, deterministic, so every
process of a job computes the same plan on its own.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from ckpt._errors import CheckpointError
from ckpt._format import ARRAY_KINDS, PRNG_KEY, LeafRecord, display_path
from ckpt._format import dtypes as _dtypes
from ckpt._geometry import Box, ShardingInfo, box_size, chunk_box, chunks_overlapping, mesh_fit_problem, normalize_spec


@dataclass(frozen=True)
class ChunkRead:
    index: tuple[int, ...]
    box: Box
    nbytes: int


@dataclass(frozen=True)
class RegionRead:
    """A region some local devices need, and the chunks (by index) that cover it."""

    box: Box
    chunks: tuple[tuple[int, ...], ...]
    nbytes: int


@dataclass(frozen=True)
class LeafReadPlan:
    leaf: int
    regions: tuple[RegionRead, ...]
    chunks: tuple[ChunkRead, ...]  # unique: each chunk is read once for all regions

    @functools.cached_property
    def bytes_read(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @functools.cached_property
    def bytes_needed(self) -> int:
        return sum(r.nbytes for r in self.regions)


def plan_leaf_read(
    leaf: int,
    shape: Sequence[int],
    chunk_shape: Sequence[int],
    itemsize: int,
    boxes: Iterable[Box],
) -> LeafReadPlan:
    """Unique regions out of `boxes` and the unique chunks to read for them."""
    regions, chunks = [], {}
    for box in sorted(set(boxes)):
        idx = tuple(chunks_overlapping(box, chunk_shape))
        regions.append(RegionRead(box, idx, box_size(box) * itemsize))
        for i in idx:
            if i not in chunks:
                cbox = chunk_box(i, chunk_shape, shape)
                chunks[i] = ChunkRead(i, cbox, box_size(cbox) * itemsize)
    return LeafReadPlan(leaf, tuple(regions), tuple(chunks[i] for i in sorted(chunks)))


def batch_by_budget(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Split positions 0..n-1 into consecutive batches whose sizes sum to at most `budget`
    (a single item over budget forms a batch of its own)."""
    batches: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if current and total + n > budget:
            batches.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        batches.append(current)
    return batches


@dataclass
class _Want:
    """What to build for one saved array leaf."""

    index: int
    sharding: jax.sharding.Sharding | None  # None: a numpy array on the host
    dtype: np.dtype  # logical dtype to return (of the key data for PRNG keys)


def _key_trailing(impl: str) -> int:
    return len(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape)


def _key_data_sharding(sharding, rec: LeafRecord):
    trailing = _key_trailing(rec.prng_impl)
    if isinstance(sharding, NamedSharding):
        spec = normalize_spec(sharding.spec, len(rec.shape) - trailing)
        return NamedSharding(sharding.mesh, PartitionSpec(*spec, *([None] * trailing)),
                             memory_kind=sharding.memory_kind)
    if isinstance(sharding, SingleDeviceSharding):
        return sharding
    raise CheckpointError(f"leaf {display_path(rec.path)!r}: PRNG keys restore onto NamedSharding or a single device")


def logical_shape(rec: LeafRecord) -> tuple[int, ...]:
    """Shape as the user sees it (for PRNG keys, without the key data's trailing dims)."""
    if rec.kind == PRNG_KEY:
        return rec.shape[: len(rec.shape) - _key_trailing(rec.prng_impl)]
    return rec.shape


def _want_from_target(i: int, rec: LeafRecord, t: Any) -> _Want | None:
    if rec.kind not in ARRAY_KINDS:
        return None
    shape, name = logical_shape(rec), display_path(rec.path)
    saved_dtype = _dtypes.dtype_from_name(rec.dtype)
    if isinstance(t, jax.sharding.Sharding):
        return _Want(i, _concrete(t, name), saved_dtype)
    if isinstance(t, (jax.ShapeDtypeStruct, jax.Array, np.ndarray)):
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"leaf {name!r}: target shape {tuple(t.shape)} does not match saved shape {tuple(shape)}")
        is_key = jax.dtypes.issubdtype(t.dtype, jax.dtypes.prng_key)
        if is_key != (rec.kind == PRNG_KEY):
            raise CheckpointError(f"leaf {name!r}: target dtype {t.dtype} but the checkpoint holds {rec.kind} {rec.dtype}")
        dtype = saved_dtype if is_key else np.dtype(t.dtype)
        if isinstance(t, np.ndarray):
            return _Want(i, None, dtype)
        sharding = t.sharding or SingleDeviceSharding(jax.local_devices()[0])
        return _Want(i, _concrete(sharding, name), dtype)
    return _Want(i, None, saved_dtype)  # any other target leaf: as saved, on the host


def _concrete(sharding: jax.sharding.Sharding, name: str) -> jax.sharding.Sharding:
    """A target sharding on an AbstractMesh (jax.eval_shape / nnx.eval_shape under
    ``jax.set_mesh``) on the concrete mesh in context."""
    if not (isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, jax.sharding.AbstractMesh)):
        return sharding
    mesh = jax.sharding.get_mesh()
    if mesh.empty or mesh.abstract_mesh != sharding.mesh:
        raise CheckpointError(f"leaf {name!r}: the target's sharding is on an abstract mesh; restore inside "
                              "`with jax.set_mesh(mesh)` with that mesh, or give shardings on a concrete mesh")
    return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def _want_for_mesh(i: int, rec: LeafRecord, mesh: jax.sharding.Mesh) -> _Want | None:
    if rec.kind not in ARRAY_KINDS:
        return None
    dtype = _dtypes.dtype_from_name(rec.dtype)
    if rec.kind not in ("jax.Array", PRNG_KEY):
        return _Want(i, None, dtype)
    info, name = ShardingInfo.from_record(rec.sharding), display_path(rec.path)
    shape = logical_shape(rec)
    if info.kind == "single_device":
        spec = ()
    elif info.kind == "named":
        spec = info.spec
    else:
        raise CheckpointError(f"leaf {name!r} was saved with a sharding that has no PartitionSpec; pass a target")
    names = tuple(mesh.axis_names)
    why = mesh_fit_problem(shape, spec, names, tuple(mesh.shape[a] for a in names))
    if why is not None:
        raise CheckpointError(f"leaf {name!r}: {why}")
    return _Want(i, NamedSharding(mesh, PartitionSpec(*spec)), dtype)


@dataclass(frozen=True)
class ArrayMetadata:
    """One saved array, as ``ckpt.metadata`` describes it (no data is read).

    Attributes:
        shape: the shape, as restored.
        dtype: the dtype, as restored (a PRNG key array has its key dtype, e.g. ``key<fry>``).
        mesh_axis_names: axis names of the mesh it was saved on; None for numpy arrays and
            shardings without a mesh (a single device gives an empty mesh).
        mesh_axis_sizes: the sizes of those axes.
        partition_spec: the PartitionSpec it was saved with (``PartitionSpec()`` for a single
            device); None where there is none.
        chunk_shape: the Zarr chunk shape (the saved shard shape, divided evenly where it exceeds
            ``max_chunk_bytes``; or the whole shape for a small
            array written as one chunk or in a stack); None when stored inline (or for
            safetensors).
        nbytes: bytes of the stored data.
        kind: ``'jax.Array'``, ``'numpy.ndarray'``, ``'numpy.scalar'`` or ``'prng_key'``.
        storage_path: where its data is inside the checkpoint: the Zarr array's path (None when
            inline; for a small array stored in a stack, the stack's path and the index along
            its first dimension, ``~stacks/0[17]``), or for safetensors the file holding it.
    """

    shape: tuple[int, ...]
    dtype: Any
    mesh_axis_names: tuple[str, ...] | None
    mesh_axis_sizes: tuple[int, ...] | None
    partition_spec: PartitionSpec | None
    chunk_shape: tuple[int, ...] | None
    nbytes: int
    kind: str
    storage_path: str | None = None

    @property
    def mesh(self) -> dict[str, int] | None:
        """The saved mesh as ``{axis name: size}``; None when it was saved without one."""
        if self.mesh_axis_names is None:
            return None
        return dict(zip(self.mesh_axis_names, self.mesh_axis_sizes))


def array_metadata(rec: LeafRecord) -> ArrayMetadata:
    data_dtype = _dtypes.dtype_from_name(rec.dtype)
    dtype: Any = data_dtype
    if rec.kind == PRNG_KEY:
        dtype = jax.eval_shape(lambda: jax.random.key(0, impl=rec.prng_impl)).dtype
    info = ShardingInfo.from_record(rec.sharding)
    names = sizes = spec = None
    if info is not None and info.kind == "named":
        names, sizes, spec = info.axis_names, info.axis_sizes, PartitionSpec(*info.spec)
    elif info is not None and info.kind == "single_device":
        names, sizes, spec = (), (), PartitionSpec()
    zarr = rec.zarr
    stacked = rec.stacked
    return ArrayMetadata(
        shape=tuple(logical_shape(rec)),
        dtype=dtype,
        mesh_axis_names=names,
        mesh_axis_sizes=sizes,
        partition_spec=spec,
        chunk_shape=zarr.chunk_shape if zarr else tuple(rec.shape) if stacked else None,
        nbytes=math.prod(rec.shape) * data_dtype.itemsize,
        kind=rec.kind,
        storage_path=zarr.path if zarr else f"{stacked.array.zarr.path}[{stacked.index}]" if stacked else None,
    )
