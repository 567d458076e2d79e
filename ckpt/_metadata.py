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


def metadata(path, *, options: Options | None = None) -> Any:
    """What a checkpoint holds, from its manifest alone: no array data is read, no device needed.

    Args:
        path (str | os.PathLike): a checkpoint location, as for ``restore`` (safetensors
            files, index files and directories of shards included: their headers are read).
        options: engine and concurrency settings (``ckpt.Options``).

    Returns:
        The saved tree (dicts, lists and tuples) with an ``ArrayMetadata`` for every array and
        the values of small non-array leaves (numbers, strings).

    Raises:
        FileNotFoundError: nothing exists at `path`.
        CheckpointError: `path` is not a committed checkpoint, or its manifest is damaged or
            of a newer format version.
        OSError: the storage failed, naming the object.
    """
    from ckpt import _safetensors  # safetensors files and directories, read as checkpoints

    if _safetensors.is_safetensors(path, options):
        return _safetensors.metadata(path, options)
    from ckpt import _orbax_read  # Orbax checkpoints (docs/migrating-from-orbax.md)

    if _orbax_read.is_orbax(path, options):
        return _orbax_read.metadata(path, options)
    opts = resolve(options)
    manifest = read_manifest(open_storage(path, opts))
    values = [array_metadata(r) if r.kind in ARRAY_KINDS else r.py_value() for r in manifest.leaves]
    return unflatten(manifest.tree, values)


