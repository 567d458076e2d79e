"""The packed layout (format version 3, formats/SPEC.md section 13): each process writes its
chunks into a few data objects and one index object (``pack_writer.PackWriter``); the primary
builds the manifest's records and ``packed`` section from the processes' statuses alone: no index
object or data object is read or listed at the commit (issue 23)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import crc32c
import numpy as np

from ckpt._commit import Staged, commit_checkpoint
from ckpt._errors import CheckpointError
from ckpt._format import (
    ALIGN,
    INDEX_DIR,
    INDEX_DTYPE,
    PACKED_VERSION,
    ArraySpec,
    LeafRecord,
    Manifest,
    Stack,
    StackedStorage,
    encode_index,
    packed_section,
)
from ckpt._geometry import chunk_grid, chunk_index_of, flat_chunk_index
from ckpt._layout.base import PACKED, ChunkWriter, ManifestParts, SaveFacts, SaveLayout
from ckpt._layout.files import check_sizes
from ckpt._layout.pack_writer import PackWriter
from ckpt.storage import Storage, StoreCaps

# Object stores: a data object is one PUT, two of a process in flight. Its bytes in about six
# objects of at least 64 MiB keep its uploads parallel: one process saving 1 GiB to SeaweedFS
# (python -m bench --gib 1 --url s3://... --seaweedfs, CKPT_LAYOUT=packed), save / raw PUT was
# 1.04 with 64 MiB objects, 0.78 with 256 MiB and 0.50 with 1 GiB. Six data objects and the
# index object stay within the 8 objects a process of issue 23's bound.
PUT_OBJECTS, MIN_PUT_OBJECT_BYTES = 6, 64 << 20


class PackedSave(SaveLayout):
    """The packed layout's part of one save: this process's data objects and index object, and
    (the primary's) the manifest's records and ``packed`` section, from the statuses alone.

    `plan`: this process's SavePlan (pointers, stacks' and whole arrays' writers); `shards`:
    array_shards of the save's leaves (which arrays one process wrote whole); `target_bytes`:
    the data objects' size (PackWriter)."""

    name = PACKED

    def __init__(self, plan, shards, target_bytes: int) -> None:
        self.plan, self.shards, self.target_bytes = plan, shards, target_bytes
        self.writer: PackWriter | None = None  # the writer of the save's chunks
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

    @classmethod
    def prepare(cls, plan, shards, target_bytes: int, budget: Any, caps: StoreCaps, writes: list) -> "PackedSave":
        """The layout of a save of `writes` (this process's): data objects of `target_bytes`
        (``Options.pack_object_bytes``); where the engine writes whole objects (object stores),
        also at most a quarter of the budget and about a sixth of this process's bytes (at least
        64 MiB), with two assembly buffers of that size (or of this process's bytes, when fewer)
        from the budget, taken now, before any chunk is staged: the writer never waits for budget
        the copies hold."""
        # (each chunk at most ALIGN bytes of padding before it)
        mine = sum(w.nbytes for w in writes) + ALIGN * len(writes)
        if not caps.writes_in_place:
            target_bytes = min(target_bytes, max(budget.limit // 4, 1 << 20),
                               max(MIN_PUT_OBJECT_BYTES, -(-mine // PUT_OBJECTS)))
        layout = cls(plan, shards, target_bytes)
        if not caps.writes_in_place and writes:
            layout.buffer_bytes = min(target_bytes, mine)
            layout.leases = [budget.acquire(layout.buffer_bytes, buffer=True) for _ in range(1 if mine <= target_bytes else 2)]
        return layout

    def open(self, facts: SaveFacts) -> ChunkWriter:
        self.writer = PackWriter(facts.staged.storage, facts.process, self.target_bytes, facts.specs,
                                 [lease.buffer[:self.buffer_bytes] for lease in self.leases])
        return self.writer

    def close(self) -> None:
        self.writer.close()  # every data object durable (or the first failure)

    def abandon(self) -> None:
        if self.writer is not None:
            self.writer.abandon()  # (every write started has ended: the abort may remove them)

    def release(self, budget: Any) -> None:
        for lease in self.leases:
            budget.release(lease)
        self.leases = []

    def report(self, facts: SaveFacts, sums: dict) -> dict | None:
        """Write this process's index object (its chunks' places and CRC-32Cs, and pointers to
        the writers of the chunks it holds and others wrote); return what the status says of it
        (O(1) bytes: the primary never reads it)."""
        data = self.index_object(facts.process, facts.staged.prefix, sums, facts.specs)
        key = f"{INDEX_DIR}/{facts.process}"
        facts.staged.storage.put(key, data).result()
        return {"key": key, "size": len(data), "crc": crc32c.crc32c(data), "chunks": self.written,
                "places": self.places}

    def commit(self, facts: SaveFacts, statuses: list[dict]) -> None:
        records, stacks, section = self.manifest_parts(facts.leaves, facts.stacks, statuses, facts.staged.prefix,
                                                       facts.specs)
        commit_packed(facts.storage, facts.staged, ManifestParts(facts.tree, records, stacks, facts.user_metadata),
                      section, overwrite=facts.overwrite,
                      objects=self.own_objects(statuses, facts.process) if facts.processes == 1 else None)

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


def commit_packed(storage: Storage, staged: Staged, parts: ManifestParts, section: dict, *, overwrite: bool,
                  objects: dict[str, int] | None = None) -> None:
    """Step 4 for the packed layout: check `objects` (one process: what it wrote; several: None,
    the primary trusts the statuses it checked), build the version-3 manifest (`parts` and the
    ``packed`` `section`), commit it."""
    from ckpt._version import __version__

    if objects:
        check_sizes(staged, objects, f"save to {storage.url}")
    manifest = Manifest(parts.tree, list(parts.records), user_metadata=parts.user_metadata,
                        library_version=__version__, stacks=list(parts.stacks), format_version=PACKED_VERSION,
                        packed=section)
    commit_checkpoint(storage, staged, manifest, overwrite=overwrite)
