"""The commit protocol: how a save becomes a checkpoint, atomically, in one or many processes.

1. Every process computes the save plan and a fingerprint of it; the fingerprints are compared.
2. The primary process (index 0) checks the destination and stages the save
   (``ckpt._commit``'s strategy ``stage``: a temporary sibling directory ``<path>.tmp-<token>`` on local disk, a fresh
   generation prefix ``<path>/gen-<token>/`` elsewhere); where it is is broadcast.
3. Every process writes its chunks there (each durable before it reports) and reports its status
   and chunk checksums to the primary.
4. When all succeeded, the primary writes the manifest last (the strategy's ``commit``: inside the
   temporary directory, which is then renamed into place; or write-if-absent of
   ``<path>/manifest.msgpack``). Otherwise it removes what was staged (``abort``).
5. The outcome is broadcast; every process returns or raises.

A crash at any point leaves the previous checkpoint (or nothing) at ``<path>``, plus at most
staged data that no manifest points to, which readers never read. Processes talk through a
``ckpt._commit.Coordinator``: a local one, or the jax.distributed key-value store in
ckpt._distributed. This module builds what the commit writes (the manifest, the packed layout's
index objects); ``ckpt._commit`` makes it visible.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import crc32c
import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import (
    ALIGN,
    GROUP_METADATA,
    INDEX_DTYPE,
    PACKED_VERSION,
    STACKS_VERSION,
    TEMP_MARK,
    ArraySpec,
    LeafRecord,
    Manifest,
    Stack,
    StackedStorage,
    array_metadata_bytes,
    encode_index,
    packed_section,
    is_temp_name,
)
from ckpt._geometry import chunk_grid, chunk_index_of, chunk_key, flat_chunk_index
from ckpt._commit import Staged, commit_checkpoint
from ckpt.storage import Storage

__all__ = ["TEMP_MARK", "is_temp_name"]

# Where each process but the primary puts its index object in the staged place: the checksums
# of the chunks it wrote, read once by the primary at the commit (so statuses stay O(1) bytes
# in the coordination service). '~' never begins a leaf's escaped storage path (except the
# '~<leaf index>' of a clash, which is never '~index'); the manifest does not reference it.
INDEX_DIR = "~index"


def commit_written(storage: Storage, staged: Staged, tree: dict, records: list[LeafRecord],
                   specs: dict[int, tuple[str, ArraySpec]], *, overwrite: bool, stacks: list[Stack] = (),
                   user_metadata: dict | None = None, action: str = "save", check_files: bool = True) -> None:
    """Step 4 of the protocol, the one way anything becomes a checkpoint (``save`` and
    ``convert``): check that every file written is in the staged place, whole; record the
    CRC-32C of every zarr.json; build the manifest at the lowest format version that describes
    it; commit it (``commit_checkpoint``).

    `records`: every leaf as the manifest records it (storage paths with ``staged.prefix``,
    chunk checksums filled in); `specs`: (storage path without the prefix, spec) of every Zarr
    array written, as ``array_specs`` gives them; `stacks` likewise complete. `action` names
    the operation in messages. On failure see ``after_failed_commit``. `check_files` False:
    the files are not listed (a multi-process save checks what its processes reported instead);
    the zarr.json checksums are computed all the same.
    """
    from ckpt._version import __version__

    zarr_json = _check_written(staged, specs, storage.url, action, check_files)
    # A manifest without stacks is version 1, which every reader reads (_format.records).
    manifest = Manifest(tree, list(records), user_metadata=user_metadata, library_version=__version__,
                        stacks=list(stacks), format_version=STACKS_VERSION if stacks else 1, zarr_json=zarr_json)
    commit_checkpoint(storage, staged, manifest, overwrite=overwrite)


def group_paths(array_paths: Iterable[str], prefix: str) -> set[str]:
    """The Zarr groups a save writes a zarr.json for, so stock zarr can browse the tree: the root
    and every group above an array. None in a generation prefix without arrays: no manifest path
    would reference it, so no overwrite could ever find and delete it."""
    array_paths = list(array_paths)
    groups = {""} if array_paths or not prefix else set()
    for path in array_paths:
        parts = path.split("/")
        groups.update("/".join(parts[:k]) for k in range(1, len(parts)))
    return groups


def _check_written(staged: Staged, specs: dict[int, tuple[str, ArraySpec]], final: str,
                   action: str = "save", check_files: bool = True) -> dict[str, int]:
    """Check that every file the save wrote is still in the staged place, whole (a save never
    commits what someone removed or truncated meanwhile); return the CRC-32C of every zarr.json,
    keyed as the manifest records them."""
    expected: dict[str, int] = {}
    zarr_json: dict[str, int] = {}
    for path, spec in specs.values():
        meta = array_metadata_bytes(spec)
        expected[f"{path}/zarr.json"] = len(meta)
        zarr_json[f"{staged.prefix}{path}/zarr.json"] = crc32c.crc32c(meta)
        chunk_bytes = math.prod(spec.chunk_shape) * spec.dtype.itemsize
        if check_files:
            for index in np.ndindex(*chunk_grid(spec.shape, spec.chunk_shape)):
                expected[f"{path}/{chunk_key(index)}"] = chunk_bytes
    for group in group_paths((path for path, _ in specs.values()), staged.prefix):
        key = f"{group}/zarr.json" if group else "zarr.json"
        expected[key] = len(GROUP_METADATA)
        zarr_json[staged.prefix + key] = crc32c.crc32c(GROUP_METADATA)
    if not check_files:
        return zarr_json
    _check_sizes(staged, expected, f"{action} to {final}", action)
    return zarr_json


def _check_sizes(staged: Staged, expected: dict[str, int], what: str, action: str = "save") -> None:
    """Raise unless every key of `expected` is in the staged place with its size (one stat each)."""
    found = staged.storage.stat_many(expected)
    bad = [f"{staged.storage.where(k)} ({'missing' if found[k] is None else f'{found[k]} of {n} bytes'})"
           for k, n in expected.items() if found[k] is None or (found[k] >= 0 and found[k] != n)]
    if bad:
        raise CheckpointError(
            f"{what}: {len(bad)} file(s) it wrote are gone or changed before the commit, e.g. {bad[0]} "
            f"(did another process remove the {action}'s temporary data?); nothing was committed")


# ---- the packed layout (format version 3, formats/SPEC.md section 13) -------------------------


class PackedSave:
    """The packed layout's part of one save: this process's index object, and (the primary's)
    the manifest's records and ``packed`` section, from the statuses alone: no index object
    or data object is read or listed at the commit (issue 23).

    `plan`: this process's SavePlan (pointers, stacks' and whole arrays' writers); `shards`:
    array_shards of the save's leaves (which arrays one process wrote whole); `target_bytes`:
    the data objects' size (PackWriter)."""

    def __init__(self, plan, shards, target_bytes: int) -> None:
        self.plan, self.shards, self.target_bytes = plan, shards, target_bytes
        self.writer = None  # the PackWriter of the save's writes
        self.written = 0
        self.leases: list = []  # the assembly buffers' budget (object stores), while writing
        self.buffer_bytes = 0
        # Arrays written whole by one process (stacks, small arrays, and any array of one chunk):
        # their places go to the manifest through the statuses ([array, flat, object, offset,
        # length, crc] each), O(leaves) in all, so that no restoring process reads the index
        # object of each process that wrote a replicated array (bench/scale.py, the scanned tree:
        # 7 index objects read by every process without them).
        self.small = {-1 - s for s in range(len(plan.stacks))} | set(plan.whole)
        self.places: list[list] = []

    def index_object(self, process: int, prefix: str, sums: dict, specs: dict) -> bytes:
        w = self.writer
        rows = [(array, flat, obj, offset, length, sums[array][flat])
                for (array, flat), (obj, offset, length) in w.locations.items()]
        names = [prefix + key for key, _ in w.objects]
        grids = {a: chunk_grid(spec.shape, spec.chunk_shape) for a, (_, spec) in specs.items()}
        self.places = [[a, f, names[o], off, n, crc] for a, f, o, off, n, crc in rows
                       if a in self.small or math.prod(grids[a]) == 1]
        for leaf, box, writer in self.plan.pointers:
            spec = specs[leaf][1]
            flat = flat_chunk_index(chunk_index_of(box, spec.chunk_shape), grids[leaf])
            rows.append((leaf, flat, -1 - writer, 0, 0, 0))
        entries = np.sort(np.array(rows, dtype=INDEX_DTYPE), order=["array", "chunk"])
        self.written = len(w.locations)
        return encode_index(process, list(zip(names, (size for _, size in w.objects))), entries)

    def own_objects(self, statuses: list[dict], process: int) -> dict[str, int]:
        """(key, size) of every object this process wrote: what a one-process commit checks."""
        out = dict(self.writer.objects)
        out[statuses[process]["index"]["key"]] = statuses[process]["index"]["size"]
        return out

    def manifest_parts(self, leaves, stacks: list[Stack], statuses: list[dict], prefix: str,
                       specs: dict) -> tuple[list[LeafRecord], list[Stack], dict]:
        """(records, stacks, packed section) of the manifest, checked against the statuses: every
        process wrote an index object, and the chunks they wrote add up to every chunk."""
        indexes = []
        for p, s in enumerate(statuses):
            index = s.get("index")
            if not index:
                raise CheckpointError(f"process {p} reported no index object")
            indexes.append((p, prefix + index["key"], index["size"], index["crc"]))
        want = sum(_chunks(spec) for _, spec in specs.values())
        got = sum(s["index"]["chunks"] for s in statuses)
        if got != want:
            raise CheckpointError(f"the processes wrote {got} chunks, the save has {want}")
        placed: dict[int, dict[int, tuple]] = {}
        for s in statuses:
            for array, flat, name, offset, length, crc in s["index"].get("places", ()):
                placed.setdefault(array, {})[flat] = (name, offset, length, crc)

        def places(array: int, spec) -> tuple:
            got = placed.get(array, {})
            n = _chunks(spec)
            if len(got) != n:
                raise CheckpointError(f"array {array}: {len(got)} of its {n} chunks were reported written")
            return tuple(got[k] for k in range(n))

        new_stacks = [dataclasses.replace(st, zarr=dataclasses.replace(
            st.zarr, path=prefix + st.zarr.path, chunk_checksums=(), writer=self.plan.stacks[s].process,
            places=places(-1 - s, specs[-1 - s][1])))
            for s, st in enumerate(stacks)]
        writers = dict(self.plan.whole_writers)
        for a in self.shards:  # arrays one process holds whole (numpy leaves, one device)
            if a.leaf not in writers:
                procs = _holder_processes(a.holders)
                if len(procs) == 1:
                    writers[a.leaf] = next(iter(procs))
        meshes: list[tuple] = []
        mesh_ids: dict = {}
        records = []
        for i, leaf in enumerate(leaves):
            rec = leaf.record
            if rec.stacked is not None:
                member = StackedStorage(rec.stacked.stack, rec.stacked.index, new_stacks[rec.stacked.stack])
                rec = LeafRecord(rec.path, rec.kind, rec.shape, rec.dtype, rec.sharding, member, rec.value, rec.prng_impl)
            elif rec.zarr is not None:
                st = dataclasses.replace(rec.zarr, path=prefix + rec.zarr.path, chunk_checksums=(),
                                         writer=writers.get(i), places=places(i, specs[i][1])
                                         if i in self.small or _chunks(specs[i][1]) == 1 else ())
                sharding = rec.sharding
                if st.writer is None and sharding and sharding.get("kind") == "named":
                    mesh = leaf.source.sharding.mesh
                    k = mesh_ids.get(mesh)
                    if k is None:
                        k = mesh_ids[mesh] = len(meshes)
                        meshes.append((mesh.devices.shape, [d.process_index for d in mesh.devices.flat]))
                    sharding = {**sharding, "mesh_processes": k}
                rec = LeafRecord(rec.path, rec.kind, rec.shape, rec.dtype, sharding, st, rec.value, rec.prng_impl)
            records.append(rec)
        return records, new_stacks, packed_section(ALIGN, indexes, meshes)


def _chunks(spec: ArraySpec) -> int:
    return math.prod(chunk_grid(spec.shape, spec.chunk_shape))


def _holder_processes(holders, _cache: dict = {}) -> frozenset:  # noqa: B006 (per holders map)
    key = id(holders)
    hit = _cache.get(key)
    if hit is None or hit[0] is not holders:
        hit = _cache[key] = (holders, frozenset(p for h in holders.values() for p, _ in h))
        if len(_cache) > 256:
            _cache.clear()
            _cache[key] = hit
    return hit[1]


def commit_packed(storage: Storage, staged: Staged, tree: dict, records: list[LeafRecord], stacks: list[Stack],
                  section: dict, *, overwrite: bool, user_metadata: dict | None = None,
                  objects: dict[str, int] | None = None) -> None:
    """Step 4 for the packed layout: check `objects` (one process: what it wrote; several: None,
    the primary trusts the statuses it checked), build the version-3 manifest, commit it."""
    from ckpt._version import __version__

    if objects:
        _check_sizes(staged, objects, f"save to {storage.url}")
    manifest = Manifest(tree, list(records), user_metadata=user_metadata, library_version=__version__,
                        stacks=list(stacks), format_version=PACKED_VERSION, packed=section)
    commit_checkpoint(storage, staged, manifest, overwrite=overwrite)
