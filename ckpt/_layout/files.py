"""The files layout (format versions 1 and 2, formats/SPEC.md sections 2-12): every chunk is an
object of its own, ``<array path>/c/<i>/<j>``, beside a ``zarr.json`` per array and group, so
that stock zarr-python and TensorStore read a checkpoint as it is. Each process but the primary
writes its chunks' CRC-32Cs into an index object in the staged place; the primary reads each
once at the commit and records them in the manifest."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from typing import Any

import crc32c
import msgpack
import numpy as np

from ckpt._commit import Staged, commit_checkpoint
from ckpt._errors import CheckpointError
from ckpt._format import (
    GROUP_METADATA,
    INDEX_DIR,
    STACKS_VERSION,
    ArraySpec,
    LeafRecord,
    Manifest,
    StackedStorage,
    array_metadata_bytes,
)
from ckpt._geometry import Box, chunk_grid, chunk_key
from ckpt._layout.base import FILES, ChunkWriter, ManifestParts, SaveFacts, SaveLayout, group_paths, metadata_share
from ckpt.storage import Storage, StoreCaps


class FilesWriter(ChunkWriter):
    """Chunks as objects of their own through the store's chunk writes (the engine's: direct
    I/O on local disk, TensorStore's zarr driver, zarr-python); then this process's share of the
    arrays' zarr.json files (``metadata_share``) and, on the primary, the groups'."""

    def __init__(self, facts: SaveFacts):
        self.store, self.facts = facts.staged.storage, facts
        self.handles = self.store.open_arrays(facts.specs)
        self.requests = 0

    def write_chunk(self, array: int, box: Box, data: Any) -> Any:
        self.requests += 1
        return self.store.write_chunk(self.handles[array], box, data)

    def write_metadata(self) -> list:
        f = self.facts
        created: list = []
        try:
            for path, spec in metadata_share(f.specs, f.process, f.processes):
                created.append(self.store.create_array(path, spec))
            if f.process == 0:
                # zarr.json of the root and every intermediate group, so stock zarr can browse
                # the tree: the groups the commit checks for (group_paths).
                for g in sorted(group_paths((path for path, _ in f.specs.values()), f.staged.prefix)):
                    created.append(self.store.put_group(g))
        except BaseException:
            # Every write started ends before the caller removes the staged place: one still
            # running would create its file there again.
            for fut in created:
                try:
                    fut.result()
                except Exception:  # noqa: BLE001 (the first failure is the one raised)
                    pass
            raise
        finally:
            self.requests += len(created)
        return created


class FilesSave(SaveLayout):
    name = FILES

    def __init__(self) -> None:
        self._own_sums: dict = {}

    def open(self, facts: SaveFacts) -> ChunkWriter:
        return FilesWriter(facts)

    def max_inflight_writes(self, caps: StoreCaps, io_concurrency: int) -> int | None:
        # Object stores: at most two requests per I/O slot in flight (the engine runs
        # io_concurrency at once; one more each keeps them busy), so a failing chunk stops the
        # save within one round (issue 28: a SlowDown on every PUT).
        return None if caps.renames else 2 * io_concurrency

    def report(self, facts: SaveFacts, sums: dict) -> dict | None:
        """The primary keeps its own checksums; every other process writes its chunk checksums
        into its index object, which the primary reads once at the commit."""
        self._own_sums = sums
        if facts.process == 0:
            return None
        data = msgpack.packb([[array, flat, crc] for array, m in sums.items() for flat, crc in m.items()],
                             use_bin_type=True)
        key = f"{INDEX_DIR}/{facts.process}"
        facts.staged.storage.put(key, data).result()
        return {"key": key, "size": len(data), "crc": crc32c.crc32c(data)}

    def _collect_sums(self, facts: SaveFacts, statuses: list[dict]) -> dict[int, dict[int, int]]:
        """Every chunk's checksum: the primary's own, and each other process's index object,
        read once each (io_concurrency at a time) and checked against its status."""
        collected: dict[int, dict[int, int]] = {}
        for array, m in self._own_sums.items():
            collected.setdefault(array, {}).update(m)
        wanted = [(p, s["index"]) for p, s in enumerate(statuses) if p != facts.process]
        storage = facts.staged.storage

        def fetch(item):
            p, index = item
            if not index:
                raise CheckpointError(f"process {p} reported no index object")
            data = storage.get(index["key"], max_bytes=index["size"])
            if len(data) != index["size"] or crc32c.crc32c(data) != index["crc"]:
                raise CheckpointError(
                    f"{storage.where(index['key'])}: the index object of process {p} holds {len(data)} bytes "
                    f"with CRC-32C {crc32c.crc32c(data):#010x}, not the {index['size']} bytes with "
                    f"{index['crc']:#010x} it reported (removed or changed before the commit?)")
            return msgpack.unpackb(data)

        if wanted:
            with concurrent.futures.ThreadPoolExecutor(min(len(wanted), facts.io_concurrency)) as pool:
                for entries in pool.map(fetch, wanted):
                    for array, flat, crc in entries:
                        collected.setdefault(array, {})[flat] = crc
        return collected

    def commit(self, facts: SaveFacts, statuses: list[dict]) -> None:
        """Gather every process's chunk checksums into the records, then commit_written."""
        collected = self._collect_sums(facts, statuses)
        prefix = facts.staged.prefix
        stacks = []
        for s, stack in enumerate(facts.stacks):
            got = collected.get(-1 - s, {})
            stacks.append(dataclasses.replace(stack, zarr=dataclasses.replace(
                stack.zarr, path=prefix + stack.zarr.path,
                chunk_checksums=_all_chunks(got, stack.shape, stack.zarr.chunk_shape, f"stack {s} ({stack.zarr.path})"))))
        records = []
        for i, leaf in enumerate(facts.leaves):
            rec = leaf.record
            st = rec.zarr
            if rec.stacked is not None:
                member = StackedStorage(rec.stacked.stack, rec.stacked.index, stacks[rec.stacked.stack])
                rec = LeafRecord(rec.path, rec.kind, rec.shape, rec.dtype, rec.sharding, member, rec.value, rec.prng_impl)
            elif st is not None:
                sums = _all_chunks(collected.get(i, {}), rec.shape, leaf.chunk_shape, f"leaf {rec.path!r}")
                st = dataclasses.replace(st, path=prefix + st.path, chunk_checksums=sums)
                rec = LeafRecord(rec.path, rec.kind, rec.shape, rec.dtype, rec.sharding, st, rec.value, rec.prng_impl)
            records.append(rec)
        # One process: every file it wrote is checked (one listing per directory). Several: the
        # primary checks what the processes reported (their index objects, read above, and every
        # chunk of every array accounted for) and lists nothing: a listing of the generation
        # grows with its objects (13,816 LIST pages at 1,024 hosts, issue 23).
        commit_written(facts.storage, facts.staged, ManifestParts(facts.tree, records, stacks, facts.user_metadata),
                       facts.specs, overwrite=facts.overwrite, check_files=facts.processes == 1)


def _all_chunks(got: dict[int, int], shape, chunk_shape, what: str) -> tuple[int, ...]:
    """The checksums of every chunk of an array, in flat order; CheckpointError naming `what`
    when some chunk was not written."""
    n = int(np.prod(chunk_grid(shape, chunk_shape)))
    if len(got) != n:
        raise CheckpointError(f"{what}: {len(got)} of {n} chunks were written")
    return tuple(got[k] for k in range(n))


def commit_written(storage: Storage, staged: Staged, parts: ManifestParts, specs: dict[int, tuple[str, ArraySpec]],
                   *, overwrite: bool, action: str = "save", check_files: bool = True) -> None:
    """Step 4 of the protocol, the one way anything becomes a checkpoint (``save`` and
    ``convert``): check that every file written is in the staged place, whole; record the
    CRC-32C of every zarr.json; build the manifest at the lowest format version that describes
    it; commit it (``commit_checkpoint``).

    `parts`: the tree, every leaf as the manifest records it (storage paths with
    ``staged.prefix``, chunk checksums filled in), the stacks likewise complete, the user's
    metadata; `specs`: (storage path without the prefix, spec) of every Zarr array written, as
    ``array_specs`` gives them. `action` names the operation in messages. On failure see
    ``after_failed_commit``. `check_files` False: the files are not listed (a multi-process
    save checks what its processes reported instead); the zarr.json checksums are computed all
    the same.
    """
    from ckpt._version import __version__

    zarr_json = _check_written(staged, specs, storage.url, action, check_files)
    # A manifest without stacks is version 1, which every reader reads (_format.records).
    manifest = Manifest(parts.tree, list(parts.records), user_metadata=parts.user_metadata,
                        library_version=__version__, stacks=list(parts.stacks),
                        format_version=STACKS_VERSION if parts.stacks else 1, zarr_json=zarr_json)
    commit_checkpoint(storage, staged, manifest, overwrite=overwrite)


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
    check_sizes(staged, expected, f"{action} to {final}", action)
    return zarr_json


def check_sizes(staged: Staged, expected: dict[str, int], what: str, action: str = "save") -> None:
    """Raise unless every key of `expected` is in the staged place with its size (one stat each)."""
    found = staged.storage.stat_many(expected)
    bad = [f"{staged.storage.where(k)} ({'missing' if found[k] is None else f'{found[k]} of {n} bytes'})"
           for k, n in expected.items() if found[k] is None or (found[k] >= 0 and found[k] != n)]
    if bad:
        raise CheckpointError(
            f"{what}: {len(bad)} file(s) it wrote are gone or changed before the commit, e.g. {bad[0]} "
            f"(did another process remove the {action}'s temporary data?); nothing was committed")
