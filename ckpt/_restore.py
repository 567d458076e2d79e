"""restore: plan the regions this process's devices need, read each chunk once, verify it,
and build every array with jax.make_array_from_callback from the regions already read.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from ckpt import _dtypes, _gc
from ckpt._checksum import chunk_checksum
from ckpt._commit import read_manifest
from ckpt._errors import CheckpointError, ChecksumError
from ckpt._layout import (
    Box, ShardingInfo, box_shape, chunk_box, chunk_grid, chunk_key, flat_chunk_index, full_box, index_to_box,
    intersect,
    mesh_fit_problem, normalize_spec, relative,
)
from ckpt._manifest import ARRAY_KINDS, NUMPY_SCALAR, PRNG_KEY, LeafRecord
from ckpt._options import Options, resolve
from ckpt._plan import LeafReadPlan, batch_by_budget, plan_leaf_read
from ckpt._tree import display_path, leaf_components, match_target, unflatten
from ckpt.storage import Storage, aligned_empty, open_storage


@dataclass
class _Want:
    """What to build for one saved array leaf."""

    index: int
    sharding: jax.sharding.Sharding | None  # None: a numpy array on the host
    dtype: np.dtype  # logical dtype to return (of the key data for PRNG keys)


@dataclass
class RestoreStats:
    bytes_read: int = 0
    bytes_needed: int = 0
    chunks_read: int = 0
    per_leaf: dict = field(default_factory=dict)


def _key_trailing(impl: str) -> int:
    return len(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape)


def logical_shape(rec: LeafRecord) -> tuple[int, ...]:
    """Shape as the user sees it (for PRNG keys, without the key data's trailing dims)."""
    if rec.kind == PRNG_KEY:
        return rec.shape[: len(rec.shape) - _key_trailing(rec.prng_impl)]
    return rec.shape


def _key_data_sharding(sharding, rec: LeafRecord):
    trailing = len(rec.shape) - len(logical_shape(rec))
    if isinstance(sharding, NamedSharding):
        spec = normalize_spec(sharding.spec, len(rec.shape) - trailing)
        return NamedSharding(sharding.mesh, PartitionSpec(*spec, *([None] * trailing)))
    if isinstance(sharding, SingleDeviceSharding):
        return sharding
    raise CheckpointError(f"leaf {display_path(rec.path)!r}: PRNG keys restore onto NamedSharding or a single device")


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


class _Reader:
    """Reads the chunks of planned regions through a Storage, each once, verified."""

    def __init__(self, storage: Storage, leaves: list[LeafRecord], verify: bool, stats: RestoreStats,
                 options: Options):
        self.storage, self.leaves, self.verify, self.stats = storage, leaves, verify, stats
        self.options = options
        self._plans: dict[tuple, LeafReadPlan] = {}

    def plan(self, want: _Want) -> LeafReadPlan:
        rec = self.leaves[want.index]
        sharding = want.sharding
        if sharding is not None and rec.kind == PRNG_KEY:
            sharding = _key_data_sharding(sharding, rec)
        itemsize = _dtypes.dtype_from_name(rec.dtype).itemsize
        # Many leaves share a shape, sharding and chunking (layer stacks, optimizer states):
        # their plans differ only in the leaf index.
        key = (sharding, rec.shape, rec.chunk_shape, itemsize)
        template = self._plans.get(key)
        if template is None:
            if sharding is None:
                boxes = [full_box(rec.shape)]
            else:
                boxes = [index_to_box(idx, rec.shape)
                         for idx in sharding.addressable_devices_indices_map(rec.shape).values()]
            template = self._plans[key] = plan_leaf_read(want.index, rec.shape, rec.chunk_shape, itemsize, boxes)
        return template if template.leaf == want.index else LeafReadPlan(want.index, template.regions, template.chunks)

    def run(self, wants: list[_Want]) -> dict[int, Any]:
        plans = [self.plan(w) for w in wants]
        out: dict[int, Any] = {}
        for batch in batch_by_budget([p.bytes_read + p.bytes_needed for p in plans], self.options.host_budget_bytes):
            regions = self.read([plans[i] for i in batch])
            for i in batch:
                rec = self.leaves[wants[i].index]
                out[wants[i].index] = self._place(rec, wants[i], regions.pop(wants[i].index))
        return out

    def read(self, plans: list[LeafReadPlan]) -> dict[int, dict[Box, np.ndarray]]:
        """The regions of each plan (storage dtype), every chunk read once and verified; the
        whole value too (under the full box) where it is at hand (stacked, inline, one chunk).

        All chunks of the batch are read concurrently on a pool as wide as the storage I/O
        (``io_concurrency``); each is checked against its CRC-32C on the thread that read it.
        A chunk of a stack is read once for all the members the batch needs from it.
        """
        futures: dict = {}
        counted: set = set()  # stack chunks already counted in the stats
        pool = ThreadPoolExecutor(self.options.io_concurrency, thread_name_prefix="ckpt-read")
        try:
            for p in plans:
                rec = self.leaves[p.leaf]
                if rec.zarr is not None:
                    for c in p.chunks:
                        futures[(rec.zarr.path, c.index)] = pool.submit(self._read_chunk, rec, c)
                elif rec.stacked is not None:
                    key = _stack_chunk(rec)
                    if key not in futures:
                        futures[key] = pool.submit(self._read_stack_chunk, rec, key[1])
            out = {}
            for p in plans:
                rec = self.leaves[p.leaf]
                self.stats.bytes_needed += p.bytes_needed
                whole = None
                if rec.zarr is not None:
                    # (popped: a chunk is freed once its regions are assembled)
                    chunks = {c.index: futures.pop((rec.zarr.path, c.index)).result() for c in p.chunks}
                    self.stats.bytes_read += p.bytes_read
                    self.stats.chunks_read += len(p.chunks)
                    self.stats.per_leaf[rec.path] = (p.bytes_read, p.bytes_needed)
                    if len(p.chunks) == 1 and p.chunks[0].box == full_box(rec.shape):
                        whole = chunks[p.chunks[0].index]
                    else:
                        out[p.leaf] = {r.box: _assemble(r.box, r.chunks, chunks, p) for r in p.regions}
                        continue
                elif rec.stacked is not None:
                    key = _stack_chunk(rec)
                    chunk = futures[key].result()
                    if key not in counted:  # read once for all its members
                        counted.add(key)
                        self.stats.bytes_read += chunk.nbytes
                        self.stats.chunks_read += 1
                    whole = chunk[rec.stacked.index - key[1][0] * rec.stacked.array.zarr.chunk_shape[0]]
                    self.stats.per_leaf[rec.path] = (whole.nbytes, p.bytes_needed)
                else:
                    self.stats.per_leaf[rec.path] = (0, p.bytes_needed)
                    whole = _dtypes.to_storage(rec.inline_array())
                out[p.leaf] = _WholeRegions(whole, full_box(rec.shape))
        finally:
            pool.shutdown(cancel_futures=True)  # after a failure, skip the reads not yet started
        return out

    def _read_chunk(self, rec: LeafRecord, c) -> np.ndarray:
        st = rec.zarr
        file = self.storage.where(f"{st.path}/{chunk_key(c.index)}")
        where = f"leaf {display_path(rec.path)!r}, chunk {list(c.index)} ({file})"
        grid = chunk_grid(rec.shape, st.chunk_shape)
        return self._read_verified(st, c.index, box_shape(c.box), st.chunk_checksums[flat_chunk_index(c.index, grid)],
                                   rec.path, file, where)

    def _read_stack_chunk(self, rec: LeafRecord, index: tuple[int, ...]) -> np.ndarray:
        """Chunk `index` of the stack that holds `rec` (the leaf that needs it, for messages)."""
        member, stack = rec.stacked, rec.stacked.array
        st = stack.zarr
        file = self.storage.where(f"{st.path}/{chunk_key(index)}")
        where = f"leaf {display_path(rec.path)!r} (member {member.index} of stack {member.stack}), chunk {list(index)} ({file})"
        box = chunk_box(index, st.chunk_shape, stack.shape)
        return self._read_verified(st, index, box_shape(box), st.chunk_checksums[index[0]], rec.path, file, where)

    def _read_verified(self, st, index: tuple[int, ...], shape: tuple[int, ...], want: int, leaf: str,
                       file: str, where: str) -> np.ndarray:
        dtype = np.dtype(st.data_type).newbyteorder("<")
        chunk_shape = st.chunk_shape
        try:
            # A chunk file always holds the whole chunk shape; an edge chunk's part outside the
            # array is padding, which the checksum does not cover.
            raw = self.storage.read_chunk(st.path, index, math.prod(chunk_shape) * dtype.itemsize)
            a = raw.view(dtype).reshape(chunk_shape)
            if shape != chunk_shape:
                a = np.ascontiguousarray(a[tuple(slice(0, n) for n in shape)])
        except FileNotFoundError:
            raise CheckpointError(f"{where}: chunk file is missing") from None
        except (OSError, CheckpointError) as e:
            raise CheckpointError(f"{where}: cannot read: {e}") from None
        if self.verify:
            got = chunk_checksum(a)
            if got != want:
                raise ChecksumError(display_path(leaf), index, file,
                                    f"{st.checksum} is {got:#010x}, expected {want:#010x}")
        return a

    def _place(self, rec: LeafRecord, want: _Want, regions: dict[Box, np.ndarray]) -> Any:
        logical = _dtypes.dtype_from_name(rec.dtype)
        full = full_box(rec.shape)
        whole = regions.get(full)
        if whole is not None:
            # The whole value is at hand (and every region a view of it): one conversion, and
            # each device's part sliced straight from it.
            whole = _dtypes.from_storage(whole, logical)
            regions = {full: whole if whole.dtype == want.dtype else whole.astype(want.dtype)}
        else:
            for box, a in regions.items():
                a = _dtypes.from_storage(a, logical)
                regions[box] = a if a.dtype == want.dtype else a.astype(want.dtype)
        if want.sharding is None:
            value = regions[full]
            if rec.kind == PRNG_KEY:  # typed keys have no numpy form: a key array on the default device
                return jax.random.wrap_key_data(value, impl=rec.prng_impl)
            return value[()] if rec.kind == NUMPY_SCALAR else value
        sharding = _key_data_sharding(want.sharding, rec) if rec.kind == PRNG_KEY else want.sharding
        whole = regions.get(full)

        def device_part(idx):
            return whole[idx] if whole is not None else regions[index_to_box(idx, rec.shape)]

        arr = jax.make_array_from_callback(rec.shape, sharding, device_part, dtype=want.dtype)
        if rec.kind == PRNG_KEY:
            arr = jax.random.wrap_key_data(arr, impl=rec.prng_impl)
        return arr


class _WholeRegions(dict):
    """The regions of a leaf whose whole value is at hand: the full box holds it; any other
    region is a view of it, made when first asked for (placement slices devices' parts itself)."""

    def __init__(self, whole: np.ndarray, full: Box):
        super().__init__({full: whole})
        self._whole, self._full = whole, full

    def __missing__(self, box: Box) -> np.ndarray:
        # `...` keeps a 0-d region an array (indexing it with () would give a scalar).
        view = self[box] = self._whole[relative(box, self._full) + (...,)]
        return view


def _stack_chunk(rec: LeafRecord) -> tuple[str, tuple[int, ...]]:
    """(stack path, chunk index) of the stack chunk that holds a stacked leaf."""
    st = rec.stacked.array.zarr
    return st.path, (rec.stacked.index // st.chunk_shape[0],) + (0,) * (len(st.chunk_shape) - 1)


def _assemble(box: Box, chunk_ids, chunks: dict, plan: LeafReadPlan) -> np.ndarray:
    boxes = {c.index: c.box for c in plan.chunks}
    if len(chunk_ids) == 1 and boxes[chunk_ids[0]] == box:
        return chunks[chunk_ids[0]]
    first = chunks[chunk_ids[0]]
    shape = box_shape(box)
    out = aligned_empty(math.prod(shape) * first.dtype.itemsize).view(first.dtype).reshape(shape)
    for cid in chunk_ids:
        inter = intersect(boxes[cid], box)
        out[relative(inter, box)] = chunks[cid][relative(inter, boxes[cid])]
    return out


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


@_gc.paused()
def restore_with_stats(path, target=None, *, mesh=None, partial=False, verify=True,
                       options: Options | None = None) -> tuple[Any, RestoreStats]:
    opts = resolve(options)
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
    built = _Reader(storage, leaves, verify, stats, opts).run([w for w in wants if w is not None])
    values = [built[i] if i in built else leaves[i].py_value() for i, _ in pairs]
    if target is None:
        return unflatten(manifest.tree, values), stats
    return jtu.tree_unflatten(treedef, values), stats


def restore(path, target: Any = None, *, mesh: jax.sharding.Mesh | None = None,
            partial: bool = False, verify: bool = True, options: Options | None = None) -> Any:
    """Restore the checkpoint at `path`, under any sharding or mesh.

    Only the chunks that overlap the regions this process's devices need are read, each once,
    and each is checked against its saved CRC-32C unless ``verify=False``. Host memory for chunks
    read and not yet placed stays within ``Options.host_budget_bytes``.

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
    from ckpt import _safetensors  # safetensors files and directories, read as checkpoints

    if _safetensors.is_safetensors(path, options):
        return _safetensors.restore(path, target, mesh=mesh, partial=partial, options=options)
    from ckpt import _orbax_read  # Orbax checkpoints, read through TensorStore (docs/migrating-from-orbax.md)

    if _orbax_read.is_orbax(path, options):
        return _orbax_read.restore(path, target, mesh=mesh, partial=partial, options=options)
    return restore_with_stats(path, target, mesh=mesh, partial=partial, verify=verify, options=options)[0]
