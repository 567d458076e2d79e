"""Checkpoints of other formats on the command line: what ``ckpt.metadata`` and ``ckpt.restore``
read besides jax-ckpt's own (an Orbax item or step; safetensors: a file, an index, a directory of
shards, an export directory) opened as ``Opened`` with a manifest of their tree, so that `inspect`
and `diff` show and compare them as they do jax-ckpt checkpoints; ``leaf_reader`` reads their
arrays region by region for `diff`."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import ARRAY_KINDS, DICT, LEAF, MANIFEST_NAME, LeafRecord, Manifest, ZarrStorage
from ckpt._format import dtype_from_name
from ckpt._geometry import Box
from ckpt._host import Options, resolve
from ckpt._orbax import kind_of, read_layout, step_user_metadata
from ckpt.cli._opened import Opened
from ckpt.storage import Storage

WHAT_SAFETENSORS = "safetensors"


def _orbax(storage: Storage, note: str | None, options: Options) -> Opened:
    from ckpt._restore import OrbaxArrays

    layout = read_layout(storage)
    arrays = OrbaxArrays(layout, options)
    arrays.open(range(len(layout.leaves)))  # fills in shapes, dtypes and chunk shapes
    records = []
    for leaf in layout.leaves:
        rec = leaf.record
        if rec.kind in ARRAY_KINDS:
            data_type = np.dtype(np.uint32 if rec.prng_impl else np.dtype(rec.dtype)).name
            rec = LeafRecord(rec.path, rec.kind, rec.shape, rec.dtype, rec.sharding,
                             ZarrStorage(leaf.param, leaf.chunk_shape, data_type, "orbax", "none"), None, rec.prng_impl)
        records.append(rec)
    created = (layout.step_metadata or {}).get("commit_timestamp_nsecs")
    # A step's custom metadata and metrics (Orbax's best_fn), kept where a CheckpointManager step
    # of ours keeps them (what `convert` writes), so that `inspect` shows them and `diff`
    # compares them with a jax-ckpt step's.
    manifest = Manifest(layout.tree, records, step_user_metadata(storage) if kind_of(storage) == "step" else None)
    return Opened(storage, manifest, note, format="orbax", what=layout.describe(),
                  created=created / 1e9 if isinstance(created, int) else None, source=(layout, arrays))


def _safetensors(storage: Storage, note: str | None, options: Options) -> Opened | None:
    from ckpt._restore import ArrayMetadata, metadata

    if storage.exists(MANIFEST_NAME):
        return None
    try:
        meta = metadata(storage.url, options=options)
    except (CheckpointError, OSError):
        return None  # not safetensors either: the caller reports why it is no checkpoint
    records: list[LeafRecord] = []
    files: list[str] = []

    def encode(node: Any, path: tuple[str, ...]) -> dict:
        if isinstance(node, dict):
            return {"kind": DICT, "keys": list(node), "children": [encode(v, path + (str(k),)) for k, v in node.items()]}
        if not isinstance(node, ArrayMetadata):
            raise CheckpointError(f"{storage.url}: {'/'.join(path)} is not a tensor")
        named = node.mesh_axis_names is not None
        # As a manifest records a NamedSharding (formats/SPEC.md), so that `inspect` reads it alike.
        sharding = ({"kind": "named",
                     "mesh": {"axis_names": list(node.mesh_axis_names), "axis_sizes": list(node.mesh_axis_sizes)},
                     "spec": [e if e is None or isinstance(e, str) else list(e) for e in node.partition_spec]}
                    if named else None)
        records.append(LeafRecord("/".join(path), node.kind if named else "numpy.ndarray", tuple(node.shape),
                                  np.dtype(node.dtype).name, sharding, None))
        files.append(node.storage_path)
        return {"kind": LEAF, "index": len(records) - 1}

    tree = encode(meta, ())
    return Opened(storage, Manifest(tree, records), note, format="safetensors", what=WHAT_SAFETENSORS,
                  source={"files": files})


def open_foreign(storage: Storage, note: str | None, options: Options | None) -> Opened | None:
    """The Orbax checkpoint or safetensors at `storage` (where it holds no jax-ckpt manifest),
    or None when it is neither."""
    opts = resolve(options)
    if kind_of(storage) is not None:
        return _orbax(storage, note, opts)
    return _safetensors(storage, note, opts)


def refuse_foreign(opened: Opened, command: str) -> None:
    """For the commands that read jax-ckpt's chunks and checksums (verify, du, plan, export):
    an Orbax step or safetensors gets an error saying what it is and what reads it."""
    if opened.format == "jax-ckpt":
        return
    where = opened.root
    if opened.format == "orbax":
        why = {"verify": "Orbax stores no checksums to verify"}.get(command, f"'ckpt {command}' reads jax-ckpt checkpoints")
        raise CheckpointError(f"{where} is an Orbax checkpoint ({opened.what}): {why}; 'ckpt inspect' and 'ckpt diff' "
                              f"read it, and 'ckpt convert {where} DEST' makes a jax-ckpt checkpoint of it")
    why = {"verify": "safetensors stores no checksums to verify"}.get(command, f"'ckpt {command}' reads jax-ckpt checkpoints")
    raise CheckpointError(f"{where} is safetensors: {why}; 'ckpt inspect' and 'ckpt diff' read it, and ckpt.restore "
                          "reads it (ckpt.save then writes a jax-ckpt checkpoint of it)")


def leaf_reader(opened: Opened, index: int, options: Options) -> tuple[tuple[int, ...], Callable[[Box], np.ndarray]]:
    """(the chunk shape to compare in, read(box) -> the region in the logical dtype) of array
    leaf `index` of an Orbax checkpoint or safetensors."""
    rec = opened.manifest.leaves[index]
    if opened.format == "orbax":
        layout, arrays = opened.source
        arrays.check_readable(index)

        def read_orbax(box: Box) -> np.ndarray:
            got = arrays.result(index, arrays.read(index, [box]))[box]
            if rec.kind == "prng_key":
                return got
            return got.astype(dtype_from_name(rec.dtype), copy=False)

        return tuple(layout.leaves[index].chunk_shape or rec.shape), read_orbax
    # safetensors: a whole tensor at a time (ckpt.restore of that tensor alone), kept while its
    # regions are asked for.
    from ckpt._restore import restore

    held: dict[str, np.ndarray] = {}

    def read_safetensors(box: Box) -> np.ndarray:
        if "data" not in held:
            target: Any = np.empty(rec.shape, dtype_from_name(rec.dtype))
            for part in reversed(rec.path.split("/")):
                target = {part: target}
            out: Any = restore(opened.root, target, partial=True, options=options)
            for part in rec.path.split("/"):
                out = out[part]
            held["data"] = np.asarray(out)
        return held["data"][tuple(slice(a, b) for a, b in box)]

    return tuple(rec.shape), read_safetensors

