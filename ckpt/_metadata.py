"""metadata(path): what a checkpoint holds, without reading any array data or needing devices."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import PartitionSpec

from ckpt import _dtypes
from ckpt._commit import read_manifest
from ckpt._layout import ShardingInfo
from ckpt._manifest import ARRAY_KINDS, PRNG_KEY, LeafRecord
from ckpt._restore import logical_shape
from ckpt._options import Options, resolve
from ckpt._tree import unflatten
from ckpt.storage import open_storage


@dataclass(frozen=True)
class ArrayMetadata:
    """One saved array.

    shape, dtype: as restored (a PRNG key array has its key dtype, e.g. key<fry>).
    mesh_axis_names, mesh_axis_sizes, partition_spec: the NamedSharding it was saved with;
    None for numpy arrays and shardings without a mesh (a single device gives an empty mesh
    and PartitionSpec()).
    chunk_shape: the Zarr chunk shape (the saved shard shape); None when stored inline.
    nbytes: bytes of the stored data. kind: 'jax.Array', 'numpy.ndarray', 'numpy.scalar' or
    'prng_key'. storage_path: the Zarr array's path inside the checkpoint (None when inline).
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
        """Saved mesh as {axis name: size}."""
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
    return ArrayMetadata(
        shape=tuple(logical_shape(rec)),
        dtype=dtype,
        mesh_axis_names=names,
        mesh_axis_sizes=sizes,
        partition_spec=spec,
        chunk_shape=zarr.chunk_shape if zarr else None,
        nbytes=math.prod(rec.shape) * data_dtype.itemsize,
        kind=rec.kind,
        storage_path=zarr.path if zarr else None,
    )


def metadata(path, *, options: Options | None = None) -> Any:
    """The saved tree (dicts, lists, tuples) with ArrayMetadata for arrays and the values of
    small non-array leaves (numbers, strings). Reads only the manifest."""
    opts = resolve(options)
    manifest = read_manifest(open_storage(path, opts))
    values = [array_metadata(r) if r.kind in ARRAY_KINDS else r.py_value() for r in manifest.leaves]
    return unflatten(manifest.tree, values)


