"""The restore, read in order: ``source`` (what the location holds: the native manifest first),
``plan`` (what each leaf is built as, the regions and chunks each process needs), ``read``
(chunks within the host budget, verified) and ``place`` (host buffers onto devices). This door
holds ``restore`` and ``metadata``; docs/design.md walks the steps file by file.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import ARRAY_KINDS, Manifest, leaf_components, read_manifest, unflatten
from ckpt._format import dtype_from_name, from_storage
from ckpt._geometry import Box
from ckpt._host import gc_paused
from ckpt._host import Options, resolve

# The door: what the layers above use from the restore besides restore and metadata.
from ckpt._restore.orbax_source import OrbaxArrays, is_orbax, open_layout  # noqa: E402,F401
from ckpt._restore.plan import (  # noqa: E402,F401
    ArrayMetadata,
    _want_for_mesh,
    _want_from_target,
    array_metadata,
    batch_by_budget,
    check_axis_names,
    logical_shape,
    plan_leaf_read,
    wants_for_mesh,
)
from ckpt._restore.read import Reader, RestoreStats, rec_itemsize
from ckpt._restore.surgery_source import Part  # noqa: F401 (ckpt.surgery's)
from ckpt._restore.view_source import ViewIO
from ckpt._restore.shared_source import SharedRestore, plan_shared, share_mode
from ckpt._restore.plan import Asked, restore_tree
from ckpt._restore.safetensors_source import CODES, INDEX_NAME, META_KEY, SINGLE_NAME  # noqa: E402,F401
from ckpt._restore.source import chunk_source, foreign_source, open_native, require_manifest  # noqa: F401 (the door)
from ckpt.storage import Storage, open_storage, pinned


def read_regions(path, leaf_path: str, boxes: list[Box], *, verify: bool = True, options: Options | None = None
                 ) -> tuple[dict[Box, np.ndarray], RestoreStats]:
    """The given regions of one saved array as numpy (logical dtype), reading only the chunks
    that overlap them: the reader restore uses, for one leaf."""
    opts = resolve(options)
    with pinned(open_storage(path, opts)) as storage:
        return _read_regions_pinned(storage, leaf_path, boxes, verify=verify, options=opts)


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
    reader = Reader(chunk_source(storage, manifest), manifest.leaves, verify, stats, opts)
    plan = plan_leaf_read(i, rec.shape, rec.chunk_shape, dtype_from_name(rec.dtype).itemsize, boxes)
    logical = dtype_from_name(rec.dtype)
    regions = reader.read([plan])[i]
    return {b: from_storage(a, logical) for b, a in regions.items()}, stats


def with_budget(options: Options | None, host_budget_bytes: int | str | None) -> Options | None:
    """`options` with the ``host_budget_bytes=`` keyword (when given) in place of its field."""
    if host_budget_bytes is None:
        return options
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"options must be a ckpt.Options, got {type(options).__name__}")
    return dataclasses.replace(options or Options(), host_budget_bytes=host_budget_bytes)


@gc_paused()
def restore_with_stats(path, target=None, *, mesh=None, partial=False, verify=True,
                       options: Options | None = None, host_budget_bytes: int | str | None = None,
                       allow_lossy_cast: bool = False, axis_names: dict[str, str] | None = None,
                       rename: Any = None) -> tuple[Any, RestoreStats]:
    """``restore`` of a jax-ckpt checkpoint, with what the reader did (bytes, requests, budget)."""
    opts = resolve(with_budget(options, host_budget_bytes))
    with open_native(path, opts) as (storage, manifest):
        if manifest is None:
            manifest = require_manifest(storage)  # raises: says why there is no checkpoint here
        asked = Asked(target, mesh, partial, verify, allow_lossy_cast, axis_names, rename)
        return _restore_native(storage, manifest, asked, opts)


def _restore_native(storage: Storage, manifest: Manifest, asked: Asked, options: Options | None = None
                    ) -> tuple[Any, RestoreStats]:
    opts = resolve(options)
    storage = chunk_source(storage, manifest)
    leaves = manifest.leaves
    stats = RestoreStats()

    def build(wants: list) -> dict[int, Any]:
        # Leaves replicated on several processes: read once across them, exchanged over
        # collectives (shared_source.py); first, so that no process enters that agreement after
        # reading the rest.
        groups, rest = plan_shared(wants, leaves, share_mode(opts), opts.host_budget_bytes)
        shared = SharedRestore(groups, storage, leaves, asked.verify, stats, opts) if groups else None
        built = shared.run() if shared is not None else {}
        reader = Reader(storage, leaves, asked.verify, stats, opts)
        built.update(reader.run(rest))
        stats.host_high_water = max(reader.budget.high_water, shared.high_water if shared is not None else 0)
        return built

    view = _native_view(storage, leaves, asked, stats, opts) if asked.rename is not None else None
    return restore_tree(manifest.tree, leaves, asked, build, view=view), stats


def _native_view(storage: Storage, leaves: list, asked: Asked, stats: RestoreStats, opts: Options) -> ViewIO:
    """How ``rename=`` parts read saved regions: each through a reader of its own (chunks
    verified as ``asked``), the view itself through one that does not verify."""

    def regions(wanted: dict[int, list[Box]]) -> dict[tuple[int, Box], np.ndarray]:
        plans = [plan_leaf_read(i, leaves[i].shape, leaves[i].chunk_shape, rec_itemsize(leaves[i]), boxes)
                 for i, boxes in wanted.items()]
        got = Reader(storage, leaves, asked.verify, RestoreStats(), opts).read(plans)
        return {(i, b): from_storage(a, dtype_from_name(leaves[i].dtype)) for i, r in got.items() for b, a in r.items()}

    return ViewIO(regions, lambda view, every: Reader(view, every, False, stats, opts), opts.host_budget_bytes)


@gc_paused()
def restore(path, target: Any = None, *, mesh: jax.sharding.Mesh | None = None,
            partial: bool = False, verify: bool = True, options: Options | None = None,
            host_budget_bytes: int | str | None = None, allow_lossy_cast: bool = False,
            axis_names: dict[str, str] | None = None, rename: Any = None) -> Any:
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
            (with a sharding), ``jax.Array``, a bare ``jax.sharding.Sharding``, a
            ``jax.experimental.layout.Format`` (a layout and a sharding) or
            ``numpy.ndarray``. Each array comes back with that sharding (numpy for numpy
            leaves), in the device layout the target asks for (a ``Format``, a
            ``ShapeDtypeStruct`` whose sharding is a ``Format``, or an array's own layout;
            otherwise the default one); a different dtype casts, within the rule of
            `allow_lossy_cast`. The result has the target's structure and node types.
        mesh: instead of a target, every ``jax.Array`` comes back on this mesh with the
            PartitionSpec it was saved with, matched by axis name (safetensors tensors that
            ``ckpt export`` recorded no sharding for are replicated). A dimension the mesh's
            axes do not divide, or a saved axis the mesh lacks, is refused before anything is
            read (the second naming every leaf concerned and both meshes' axis names).
        axis_names: with `mesh`, rename the saved mesh axes: ``{saved name: mesh axis name}``,
            e.g. ``{"data": "batch"}`` when the checkpoint was saved on axes ``("data",
            "model")`` and `mesh` has ``("batch", "model")``; saved axes not named keep their
            name. The sizes need not match: only the mesh's axes must divide each dimension.
        partial: let `target` be any subset of the saved tree. ``"matching"``: also let it
            hold leaves the checkpoint lacks (a model grown since: more layers, a new head);
            those keep the target's own leaves (an array stays that array, a
            ``ShapeDtypeStruct`` stays one), and restore returns ``(tree, missing)``.
        rename: with a target, what its leaves (key paths joined with ``.``) are made of: a
            dict ``{target name: saved name, or a ckpt.surgery part}`` (names it does not list
            are their own), a function of each saved name returning the target's name (None:
            not used), or a list of ``(pattern, replacement)`` regular expressions applied to
            each saved name in order. A part (``ckpt.surgery.stack``, ``unstack``,
            ``transpose``, ``concat``, ``split``) is read region by region: each process reads
            only the regions of the saved leaves under its shards.
        verify: check every chunk read against its CRC-32C.
        options: engine, concurrency and memory settings (``ckpt.Options``).
        host_budget_bytes: the host budget of this restore in bytes, or ``"unlimited"``, in
            place of ``options.host_budget_bytes`` (default: ``CKPT_HOST_BUDGET_BYTES``, else
            the built-in default of ``ckpt.Options``). A chunk larger than the budget is still
            read whole (once): the smallest piece a restore reads is one chunk.
        allow_lossy_cast: cast to a target dtype even where values change beyond rounding
            (as numpy's ``astype``). Without it such a cast raises ``CheckpointError``
            naming the leaf: whatever the values, a float or complex to an integer or bool, a
            complex to a real, an integer to bool (refused before any data is read); and,
            checked on the values read, an integer that does not fit the target integer type
            (narrowing, or signed <-> unsigned), or a finite value that would become infinite
            or NaN in a float or complex type (float32 ``1e5`` to float16). Float widening and
            narrowing, integer to float and bool to a number round at most and always pass.
            A device array's dtype is what JAX holds: without ``jax_enable_x64``, a saved
            int64 is placed as int32, so a value that does not fit is refused there too.

    Returns:
        The restored tree: the target's structure with ``jax.Array`` leaves; with `mesh`, the
        saved structure with ``jax.Array`` leaves; with neither, the saved structure as dicts,
        lists and tuples with ``numpy.ndarray`` leaves (custom nodes become dicts keyed by field
        name, except a node whose only field is ``value``, such as a Flax NNX Variable, which
        becomes that value; typed PRNG keys are key arrays on the default device). Non-array
        leaves (numbers, strings) come back as saved. With ``partial="matching"``: ``(tree,
        missing)``, `missing` the key paths (``a/b/c``) of the target leaves the checkpoint
        lacks.

    Raises:
        FileNotFoundError: nothing exists at `path`.
        CheckpointError: `path` is not a committed checkpoint, its manifest (or safetensors
            header) is damaged or of a newer format version, a chunk is missing or truncated,
            a target shape differs from the saved one, a saved PartitionSpec does not fit
            `mesh`, a cast would change values (see `allow_lossy_cast`), or a target asks for
            a layout that cannot be restored into (``Layout.AUTO``, a ``Format`` without a
            sharding, a layout that is not a permutation of the dimensions, a custom layout
            for a PRNG key array), or a target sharding cannot divide a dimension (checked
            before anything is read); the message names the leaf, chunk and file at fault.
            `path` being a CheckpointManager directory is refused with its steps listed and
            the latest named. A `rename` part whose shapes or dtypes do not fit names the leaf.
        ChecksumError: a chunk's bytes do not match its saved checksum.
        TreeMismatchError: the target's key paths differ from the saved ones (``.missing``,
            ``.unexpected``); where they are those of a saved subtree (the model alone), the
            message names the subtree and how to restore it; where the target has leaves the
            checkpoint lacks, it suggests ``partial="matching"``. With `rename`: target leaves
            that match no saved leaf or several, and saved leaves no target leaf uses (unless
            `partial`), listed by name.
        ValueError: both `target` and `mesh` were given, `rename` or ``partial="matching"``
            without a target, `axis_names` is given without `mesh`
            or names an axis the mesh lacks (or one mesh axis twice), or an option is invalid.
        TypeError: `options` is not a ``ckpt.Options``, `axis_names` is not a dict of
            strings, or `rename` is not a dict, a function or a list of rules.
        OSError: the storage failed (``PermissionError``, ``EIO``...), naming the object.
    """
    options = with_budget(options, host_budget_bytes)
    opts = resolve(options)
    check_axis_names(axis_names, mesh)
    with open_native(path, opts) as (storage, manifest):
        if manifest is not None:
            asked = Asked(target, mesh, partial, verify, allow_lossy_cast, axis_names, rename)
            return _restore_native(storage, manifest, asked, opts)[0]
    source = foreign_source(path, options, opts)
    if source is not None:
        return source.restore(path, target, mesh=mesh, partial=partial, options=options,
                              allow_lossy_cast=allow_lossy_cast, axis_names=axis_names, rename=rename)
    return restore_with_stats(path, target, mesh=mesh, partial=partial, verify=verify, options=opts,
                              allow_lossy_cast=allow_lossy_cast, axis_names=axis_names, rename=rename)[0]


@gc_paused()
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
        CheckpointError: `path` is not a committed checkpoint (a CheckpointManager
            directory: the message lists its steps and names the latest), or its manifest is
            damaged or of a newer format version.
        OSError: the storage failed, naming the object.
    """
    opts = resolve(options)
    with open_native(path, opts) as (_, manifest):
        if manifest is None:
            source = foreign_source(path, options, opts)
            if source is not None:
                return source.metadata(path, options)
            manifest = read_manifest(open_storage(path, opts))
    values = [array_metadata(r) if r.kind in ARRAY_KINDS else r.py_value() for r in manifest.leaves]
    return unflatten(manifest.tree, values)
