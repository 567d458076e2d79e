"""restore: what to build for each leaf (a target, a mesh, or as saved), read by ckpt._read
within the host memory budget, and the restored tree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from ckpt import _dtypes, _gc
from ckpt._commit import read_manifest
from ckpt._errors import CheckpointError
from ckpt._layout import Box, ShardingInfo, mesh_fit_problem
from ckpt._manifest import ARRAY_KINDS, PRNG_KEY, LeafRecord
from ckpt._options import Options, resolve
from ckpt._plan import plan_leaf_read

# _Reader, RestoreStats and the _Want helpers are imported from here by other readers.
from ckpt._read import RestoreStats, _key_data_sharding, _key_trailing, _Reader, _Want  # noqa: F401
from ckpt._tree import display_path, leaf_components, match_target, unflatten
from ckpt.storage import Storage, open_storage


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


def read_regions(path, leaf_path: str, boxes: list[Box], *, verify: bool = True, options: Options | None = None
                 ) -> tuple[dict[Box, np.ndarray], RestoreStats]:
    """The given regions of one saved array as numpy (logical dtype), reading only the chunks
    that overlap them: the reader restore uses, for one leaf."""
    opts = resolve(options)
    with open_storage(path, opts).pin() as pinned:
        return _read_regions_pinned(pinned, leaf_path, boxes, verify=verify, options=opts)


def _read_regions_pinned(storage: Storage, leaf_path: str, boxes: list[Box], *, verify: bool, options: Options
                         ) -> tuple[dict[Box, np.ndarray], RestoreStats]:
    opts = options
    root = storage.url
    manifest = read_manifest(storage)
    paths = ["/".join(c) for c in leaf_components(manifest.tree)]
    if leaf_path not in paths:
        raise CheckpointError(f"{root} has no leaf {leaf_path!r}")
    i = paths.index(leaf_path)
    rec = manifest.leaves[i]
    if rec.kind not in ARRAY_KINDS:
        raise CheckpointError(f"leaf {leaf_path!r} is not an array")
    stats = RestoreStats()
    reader = _Reader(storage, manifest.leaves, verify, stats, opts)
    plan = plan_leaf_read(i, rec.shape, rec.chunk_shape, _dtypes.dtype_from_name(rec.dtype).itemsize, boxes)
    logical = _dtypes.dtype_from_name(rec.dtype)
    regions = reader.read([plan])[i]
    return {b: _dtypes.from_storage(a, logical) for b, a in regions.items()}, stats


def with_budget(options: Options | None, host_budget_bytes: int | str | None) -> Options | None:
    """`options` with the ``host_budget_bytes=`` keyword (when given) in place of its field."""
    if host_budget_bytes is None:
        return options
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"options must be a ckpt.Options, got {type(options).__name__}")
    return dataclasses.replace(options or Options(), host_budget_bytes=host_budget_bytes)


@_gc.paused()
def restore_with_stats(path, target=None, *, mesh=None, partial=False, verify=True,
                       options: Options | None = None, host_budget_bytes: int | str | None = None
                       ) -> tuple[Any, RestoreStats]:
    opts = resolve(with_budget(options, host_budget_bytes))
    # Pinned: the manifest and every chunk come from the checkpoint that was at `path` when it
    # was opened, even if an overwrite replaces it meanwhile (Storage.pin): never a mix of two.
    with open_storage(path, opts).pin() as pinned:
        return _restore_pinned(pinned, target, mesh=mesh, partial=partial, verify=verify, options=opts)


def _restore_pinned(storage: Storage, target=None, *, mesh=None, partial=False, verify=True,
                    options: Options | None = None) -> tuple[Any, RestoreStats]:
    opts = resolve(options)
    manifest = read_manifest(storage)
    if target is not None and mesh is not None:
        raise ValueError("pass either target or mesh, not both")
    leaves = manifest.leaves
    paths = ["/".join(c) for c in leaf_components(manifest.tree)]
    if target is None:
        pairs = [(i, None) for i in range(len(leaves))]
        wants = [_want_for_mesh(i, leaves[i], mesh) if mesh is not None else _want_from_target(i, leaves[i], None)
                 for i in range(len(leaves))]
    else:
        treedef, pairs = match_target(target, paths, partial=partial)
        wants = [_want_from_target(i, leaves[i], t) for i, t in pairs]
    stats = RestoreStats()
    reader = _Reader(storage, leaves, verify, stats, opts)
    built = reader.run([w for w in wants if w is not None])
    stats.host_high_water = reader.budget.high_water
    values = [built[i] if i in built else leaves[i].py_value() for i, _ in pairs]
    if target is None:
        return unflatten(manifest.tree, values), stats
    return jtu.tree_unflatten(treedef, values), stats


def restore(path, target: Any = None, *, mesh: jax.sharding.Mesh | None = None,
            partial: bool = False, verify: bool = True, options: Options | None = None,
            host_budget_bytes: int | str | None = None) -> Any:
    """Restore the checkpoint at `path`, under any sharding or mesh.

    Only the chunks that overlap the regions this process's devices need are read, and each is
    checked against its saved CRC-32C unless ``verify=False``. The library's host memory (chunks
    read, regions assembled, dtype conversions, not yet placed) stays within the host budget,
    however large an array is: each device's shard is built and placed on its own, and a shard
    larger than the budget is read and placed piece by piece (docs/memory.md). The result is not
    counted: numpy leaves the caller asked for, and device memory (which on CPU is host memory).

    `path` may also name an Orbax checkpoint (orbax-checkpoint 0.11 / 0.12: a PyTree item or a
    CheckpointManager step), read through TensorStore without Orbax; `verify` does not apply
    (docs/migrating-from-orbax.md).

    `path` may also name safetensors: a ``.safetensors`` file, a
    ``model.safetensors.index.json``, or a local directory of shards. Tensors named ``a.b.c``
    then form the tree ``{"a": {"b": {"c": ...}}}``, only the byte ranges this process needs are
    read, and `verify` does not apply (safetensors has no checksums).

    Args:
        path (str | os.PathLike): a local path (``str``, ``pathlib.Path``), or a URL:
            ``file://``, ``memory://``, ``s3://``, ``gs://`` or any fsspec URL.
        target: a pytree like the saved one whose array leaves are ``jax.ShapeDtypeStruct``
            (with a sharding), ``jax.Array``, a bare ``jax.sharding.Sharding`` or
            ``numpy.ndarray``. Each array comes back with that sharding (numpy for numpy
            leaves); a different dtype casts. The result has the target's structure and node
            types.
        mesh: instead of a target, every ``jax.Array`` comes back on this mesh with the
            PartitionSpec it was saved with, matched by axis name (safetensors tensors that
            ``ckpt export`` recorded no sharding for are replicated).
        partial: let `target` be any subset of the saved tree.
        verify: check every chunk read against its CRC-32C.
        options: engine, concurrency and memory settings (``ckpt.Options``).
        host_budget_bytes: the host budget of this restore in bytes, or ``"unlimited"``, in
            place of ``options.host_budget_bytes`` (default: ``CKPT_HOST_BUDGET_BYTES``, else
            the built-in default of ``ckpt.Options``). A chunk larger than the budget is still
            read whole (once): the smallest piece a restore reads is one chunk.

    Returns:
        The restored tree: the target's structure with ``jax.Array`` leaves; with `mesh`, the
        saved structure with ``jax.Array`` leaves; with neither, the saved structure as dicts,
        lists and tuples with ``numpy.ndarray`` leaves (custom nodes become dicts keyed by field
        name, except a node whose only field is ``value``, such as a Flax NNX Variable, which
        becomes that value; typed PRNG keys are key arrays on the default device). Non-array
        leaves (numbers, strings) come back as saved.

    Raises:
        FileNotFoundError: nothing exists at `path`.
        CheckpointError: `path` is not a committed checkpoint, its manifest (or safetensors
            header) is damaged or of a newer format version, a chunk is missing or truncated,
            a target shape differs from the saved one, or a saved PartitionSpec does not fit
            `mesh`; the message names the leaf, chunk and file at fault.
        ChecksumError: a chunk's bytes do not match its saved checksum.
        TreeMismatchError: the target's key paths differ from the saved ones (``.missing``,
            ``.unexpected``).
        ValueError: both `target` and `mesh` were given, or an option is invalid.
        TypeError: `options` is not a ``ckpt.Options``.
        OSError: the storage failed (``PermissionError``, ``EIO``...), naming the object.
    """
    from ckpt import (
        _safetensors,  # safetensors files and directories, read as checkpoints
    )

    options = with_budget(options, host_budget_bytes)
    if _safetensors.is_safetensors(path, options):
        return _safetensors.restore(path, target, mesh=mesh, partial=partial, options=options)
    from ckpt import (
        _orbax_read,  # Orbax checkpoints, read through TensorStore (docs/migrating-from-orbax.md)
    )

    if _orbax_read.is_orbax(path, options):
        return _orbax_read.restore(path, target, mesh=mesh, partial=partial, options=options)
    return restore_with_stats(path, target, mesh=mesh, partial=partial, verify=verify, options=options)[0]
