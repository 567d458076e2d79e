"""convert(src, dest): write a jax-ckpt checkpoint from an Orbax checkpoint, streaming.

Why one public function, named ``convert`` and not ``convert_orbax``: it is the library's only
way in from another format, it mirrors the ``ckpt convert SRC DEST`` command, and it decides
from what it finds at `src` how to read it (today: Orbax 0.11 / 0.12 PyTree checkpoints and
CheckpointManager steps); a format added later needs no new name. ``save(dest, restore(src))``
would do the same with every array in host memory at once; ``convert`` holds at most one leaf,
and within a leaf at most ``Options.max_inflight_bytes`` of chunks (or one chunk, if larger).

The result is an ordinary jax-ckpt checkpoint: the same tree (Orbax's sequences are lists, its
scalars Python numbers, as ``restore`` of the Orbax checkpoint returns them), every jax.Array
with the mesh and PartitionSpec Orbax recorded (so ``restore(dest, mesh=...)`` places it the same
way), chunked by the saved shard shape, with a CRC-32C per chunk. It runs in one process, needs no
devices, and commits atomically like ``save``: a failed convert leaves nothing at `dest`.

It commits through the save's own last step (``ckpt._layout.commit_written``): the written
files are checked, every zarr.json's CRC-32C is recorded and the manifest gets the format version
a save would give it, so ``ckpt verify`` checks a converted checkpoint as it checks a saved one.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from ckpt._errors import CheckpointError
from ckpt._format import (
    ALGORITHM,
    ARRAY_KINDS,
    INLINE_LIMIT,
    NUMPY_SCALAR,
    PY_BOOL,
    PY_COMPLEX,
    PY_FLOAT,
    PY_INT,
    ArraySpec,
    InlineStorage,
    LeafRecord,
    ZarrStorage,
    chunk_checksum,
    storage_paths,
)
from ckpt._format import dtype_from_name, storage_of, to_storage
from ckpt._geometry import ShardingInfo, chunk_box, chunk_grid, full_box, spec_axes
from ckpt._host import Options, resolve
from ckpt._orbax import OrbaxLeaf, step_user_metadata
from ckpt._restore import OrbaxArrays, batch_by_budget, is_orbax, open_layout
from ckpt._commit import Staged, after_failed_commit, commit_for
from ckpt._layout import ManifestParts, commit_written, group_paths
from ckpt.storage import open_storage


def convert(src: Any, dest: Any, *, overwrite: bool = False, options: Options | None = None) -> None:
    """Write a jax-ckpt checkpoint at `dest` holding what the Orbax checkpoint at `src` holds.

    Streams leaf by leaf (at most one leaf in host memory, and within a leaf at most
    ``Options.max_inflight_bytes`` of chunks), needs no devices, and commits atomically like
    ``save``: a failed convert leaves nothing at `dest`. The result has the same tree (as
    ``restore(src)`` gives it: sequences as lists, scalars as Python numbers), every array with
    the mesh and PartitionSpec Orbax recorded, chunked by the saved shard shape, with a CRC-32C
    per chunk. See docs/migrating-from-orbax.md.

    Args:
        src: an Orbax checkpoint (orbax-checkpoint 0.11 / 0.12): a PyTree item written by
            ``StandardSave`` / ``PyTreeSave`` in the OCDBT or per-array Zarr v2 / v3 layout, or a
            CheckpointManager step directory (all its items; a single ``default`` item is the
            whole tree). A local path or a ``gs://`` / ``s3://`` URL.
        dest: where to write, any location ``save`` accepts.
        overwrite: replace a checkpoint already at `dest`.
        options: engine, concurrency and memory settings (``ckpt.Options``).

    Raises:
        FileExistsError: `dest` holds a checkpoint and `overwrite` is False.
        CheckpointError: `src` is not an Orbax checkpoint, or cannot be read (damaged or
            incomplete metadata or arrays, leaves of custom Orbax TypeHandlers); the message
            names the leaf and file.
        OSError: the storage failed, naming the object.
    """
    opts = resolve(options)
    if not is_orbax(src, opts):
        raise CheckpointError(f"{open_storage(src, opts).url} is not a checkpoint convert reads "
                              "(an Orbax checkpoint or CheckpointManager step)")
    layout = open_layout(src, opts)
    arrays = OrbaxArrays(layout, opts)
    arrays.open(range(len(layout.leaves)))
    storage = open_storage(dest, opts)
    paths = storage_paths([leaf.components for leaf in layout.leaves])
    staged = commit_for(storage).stage(overwrite=overwrite)
    try:
        try:
            specs: dict[int, tuple[str, ArraySpec]] = {}  # as a save's array_specs: what commit checks
            records = [_convert_leaf(arrays, i, leaf, staged, paths[i], specs, opts)
                       for i, leaf in enumerate(layout.leaves)]
            groups = group_paths((path for path, _ in specs.values()), staged.prefix)
            for fut in [staged.storage.put_group(g) for g in sorted(groups)]:
                fut.result()
        except BaseException:
            try:
                commit_for(storage).abort(staged)  # nothing committed: all staged is this convert's, unreferenced
            except OSError:
                pass
            raise
        try:
            parts = ManifestParts(layout.tree, records, user_metadata=_user_metadata(layout, opts))
            commit_written(storage, staged, parts, specs, overwrite=overwrite, action="convert")
        except BaseException as e:
            after_failed_commit(storage, staged, e)
            raise
    finally:
        staged.release()  # (commit and abort release it; this covers any other exit)


def _user_metadata(layout: Any, options: Options) -> dict | None:
    """A step's custom metadata and metrics, kept as a CheckpointManager step of ours keeps
    them (``metadata(step)``, ``metrics(step)``), so that `ckpt diff` finds no difference with
    the step jax-ckpt would have saved; None for a PyTree item (it has none)."""
    return step_user_metadata(open_storage(layout.url, options)) if layout.what == "step" else None


def _chunk_shape(rec: LeafRecord) -> tuple[int, ...]:
    """The saved shard shape (from the recorded mesh and PartitionSpec), else the whole array."""
    info = ShardingInfo.from_record(rec.sharding)
    if info is None or info.kind != "named":
        return tuple(max(1, n) for n in rec.shape)
    sizes = dict(zip(info.axis_names, info.axis_sizes))
    spec = list(info.spec) + [None] * (len(rec.shape) - len(info.spec))
    out = []
    for n, entry in zip(rec.shape, spec):
        parts = math.prod(sizes[a] for a in spec_axes(entry))
        out.append(n // parts if n % parts == 0 and n >= parts else max(1, n))
    return tuple(out)


def _python_scalar(rec: LeafRecord, value: Any) -> LeafRecord:
    if isinstance(value, bool):
        return LeafRecord(rec.path, PY_BOOL, value=value)
    if isinstance(value, int):
        return LeafRecord(rec.path, PY_INT, value=value if -(2**63) <= value < 2**64 else str(value))
    if isinstance(value, float):
        return LeafRecord(rec.path, PY_FLOAT, value=value)
    return LeafRecord(rec.path, PY_COMPLEX, value=[value.real, value.imag])


def _convert_leaf(arrays: OrbaxArrays, i: int, leaf: OrbaxLeaf, staged: Staged, path: str,
                  specs: dict[int, tuple[str, ArraySpec]], options: Options) -> LeafRecord:
    """The leaf's record; a leaf stored as a Zarr array is written to `staged` and its
    (path, spec) added to `specs` under its index `i`."""
    rec = leaf.record
    if rec.kind not in ARRAY_KINDS:
        return LeafRecord(rec.path, rec.kind, value=rec.value)
    arrays.check_readable(i)
    shape, logical = rec.shape, dtype_from_name(rec.dtype)
    if rec.kind == NUMPY_SCALAR:  # restore of the Orbax checkpoint gives a Python number
        whole = arrays.result(i, arrays.read(i, [()]))[()]
        return _python_scalar(rec, whole.item())
    out = LeafRecord(rec.path, rec.kind, shape, rec.dtype, rec.sharding, prng_impl=rec.prng_impl)
    if math.prod(shape) * logical.itemsize <= INLINE_LIMIT:
        box = full_box(shape)
        out.storage = InlineStorage(to_storage(arrays.result(i, arrays.read(i, [box]))[box]).tobytes())
        return out
    chunk = _chunk_shape(rec)
    storage_dtype, encoding = storage_of(logical)
    spec = ArraySpec(shape, chunk, storage_dtype, {"jax_ckpt": {"path": rec.path, "dtype": rec.dtype, "encoding": encoding}})
    handle = staged.storage.open_arrays({0: (path, spec)})[0]
    grid = chunk_grid(shape, chunk)
    boxes = [chunk_box(index, chunk, shape) for index in itertools.product(*(range(n) for n in grid))]
    chunk_bytes = math.prod(chunk) * storage_dtype.itemsize
    sums: list[int] = []
    for batch in batch_by_budget([chunk_bytes] * len(boxes), options.max_inflight_bytes):
        regions = arrays.result(i, arrays.read(i, [boxes[k] for k in batch]))
        writes = []  # (future, the buffer it writes: kept until the write is durable)
        for k in batch:  # row-major, as the checksums are recorded
            data = to_storage(regions.pop(boxes[k]))
            writes.append((staged.storage.write_chunk(handle, boxes[k], data), data))
            sums.append(chunk_checksum(data))
        for fut, _ in writes:
            fut.result()
    staged.storage.create_array(path, spec).result()
    specs[i] = (path, spec)
    out.storage = ZarrStorage(staged.prefix + path, chunk, storage_dtype.name, encoding, ALGORITHM, tuple(sums))
    return out
