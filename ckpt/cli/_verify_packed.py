"""`ckpt verify` on format version 3 (formats/SPEC.md section 13): the structure every process's
restore relies on, checked before any chunk is read.

A restoring process reads only the index objects its lookup rule (13.5) names, so a restore on
process 0 says nothing about process 3's. Verify reads them all and applies every rule of 13.8
("What a checking reader verifies"): every index object present with the size and CRC-32C the
manifest records; every data object of its recorded size, ending where its last chunk ends, a
regular file reached through no link, named by one index; every record for a chunk of an array
of the manifest, of that chunk's length; every chunk placed exactly once, places not overlapping;
every pointer resolving; the places in the manifest those of the index; and every process's
route to every chunk finding it. The chunks' CRC-32Cs are checked after (``_verify``).

Memory: what is held is proportional to the index objects' real bytes (each at most
``MAX_INDEX_BYTES``, read only when the manifest's size for it is what the object holds), and
the manifest's chunk counts are checked against the records before any chunk is listed.
"""

from __future__ import annotations


import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import Manifest, chunk_holders
from ckpt._geometry import chunk_grid


# One broken rule, as ``ckpt verify`` reports it (``cli._verify.Problem``'s fields): the array
# (leaf path, or '<...>' for an object), the chunk (or None), the object, what is wrong.
Found = tuple[str, "tuple[int, ...] | None", str, str]


class _Arrays:
    """The manifest's chunked arrays by their index-record number (leaf i, or -1 - s for stack s)."""

    def __init__(self, manifest: Manifest):
        self.by_id: dict[int, tuple[str, tuple, object, dict | None]] = {}
        for i, rec in enumerate(manifest.leaves):
            if rec.zarr is not None:
                self.by_id[i] = (rec.path, tuple(rec.shape), rec.zarr, rec.sharding)
        for s, stack in enumerate(manifest.stacks):
            self.by_id[-1 - s] = (f"<stack {s}>", tuple(stack.shape), stack.zarr, None)

    def chunk_bytes(self, array: int) -> int:
        _, _, st, _ = self.by_id[array]
        return int(np.prod(st.chunk_shape, dtype=object)) * np.dtype(st.data_type).itemsize

    def chunks(self, array: int) -> int:
        _, shape, st, _ = self.by_id[array]
        return int(np.prod(chunk_grid(shape, st.chunk_shape), dtype=object))

    def index(self, array: int, flat: int) -> tuple[int, ...]:
        """The chunk's position in its grid (for messages) from its row-major number."""
        _, shape, st, _ = self.by_id[array]
        out = []
        for n in reversed(chunk_grid(shape, st.chunk_shape)):
            flat, i = divmod(flat, n)
            out.append(i)
        return tuple(reversed(out))


def _local_root(storage) -> str | None:
    """The directory of a local checkpoint (links are possible only there), else None."""
    while getattr(storage, "inner", None) is not None:
        storage = storage.inner
    root = getattr(storage, "root", None)
    return root if isinstance(root, str) else None


def _load_indexes(storage, out: list) -> dict[int, object]:
    """Every index object the manifest names, decoded and checked (13.3); a problem for each
    that is missing, of another size or CRC-32C, or breaks a rule."""
    indexes = {}
    for ref in storage.layout.indexes:
        try:
            indexes[ref.process] = storage.index_of(ref.process)
        except FileNotFoundError:
            out.append((f"<index of process {ref.process}>", None, storage.where(ref.name),
                                     "the index object is missing"))
        except (OSError, CheckpointError) as e:
            out.append((f"<index of process {ref.process}>", None, storage.where(ref.name), str(e)))
    return indexes


def _check_objects(storage, indexes: dict, out: list) -> None:
    """Each data object: named by one index, of its recorded size (a regular file reached through
    no link), holding at least one chunk and ending where its last chunk ends (13.2)."""
    from ckpt.storage import check_local_key

    root, owner = _local_root(storage), {}
    index_names = {r.name for r in storage.layout.indexes}
    for p, index in sorted(indexes.items()):
        e = index.entries
        direct = e["object"] >= 0
        for k, (name, size) in enumerate(index.objects):
            where = storage.where(name)
            bad = lambda what: out.append((f"<data object of process {p}>", None, where, what))  # noqa: E731
            if name in owner or name in index_names:
                bad(f"named by the index of process {p} and by {owner.get(name, 'the manifest as an index')}")
                continue
            owner[name] = f"the index of process {p}"
            mine = direct & (e["object"] == k)
            end = int((e["offset"][mine] + e["length"][mine]).max()) if mine.any() else 0
            if end != size or not mine.any():
                bad(f"the index records {size} bytes, its last chunk ends at byte {end}"
                    + ("" if mine.any() else " (it holds no chunk)"))
            try:
                if root is not None:
                    check_local_key(root, name)
                got = storage.inner.size(name)
            except FileNotFoundError:
                bad("the data object is missing")
                continue
            except (OSError, CheckpointError) as exc:
                bad(str(exc))
                continue
            if got is not None and got != size:
                bad(f"holds {got} bytes, the index records {size}")


def _check_records(storage, indexes: dict, arrays: _Arrays, out: list) -> dict:
    """Every record names a chunk of an array of the manifest, of its length; every chunk is
    placed (a non-pointer record) at most once and places do not overlap; every pointer leads to
    a place. Returns {(array, chunk): (process, name, offset, length, crc32c)}."""
    placed: dict[tuple[int, int], tuple] = {}
    extents: list[tuple[str, int, int, int, int]] = []
    for p, index in sorted(indexes.items()):
        where = storage.where(storage.layout.indexes[p].name)
        for rec in index.entries.tolist():
            a, c, obj, off, length, crc = rec
            known = a in arrays.by_id
            name = arrays.by_id[a][0] if known else f"<array {a}>"
            if not known or c >= arrays.chunks(a):
                out.append((name, None, where, f"records chunk {c} of array {a}, which the manifest "
                                         "does not have"))
                continue
            if obj < 0:
                continue
            if length != arrays.chunk_bytes(a):
                out.append((name, arrays.index(a, c), where, f"records {length} bytes for a chunk of "
                                         f"{arrays.chunk_bytes(a)}"))
            if (a, c) in placed:
                out.append((name, arrays.index(a, c), where, f"the chunk is placed twice (also by process "
                                         f"{placed[(a, c)][0]})"))
                continue
            placed[(a, c)] = (p, index.objects[obj][0], off, length, crc)
            extents.append((index.objects[obj][0], off, length, a, c))
    extents.sort()
    for (n0, o0, l0, a0, c0), (n1, o1, _, a1, c1) in zip(extents, extents[1:]):
        if n0 == n1 and o1 < o0 + l0:
            out.append((arrays.by_id[a1][0], arrays.index(a1, c1), storage.where(n1),
                                     f"its bytes {o1}.. overlap those of chunk {c0} of {arrays.by_id[a0][0]}"))
    for p, index in sorted(indexes.items()):
        e = index.entries
        for a, c, obj in zip(e["array"][e["object"] < 0].tolist(), e["chunk"][e["object"] < 0].tolist(),
                             e["object"][e["object"] < 0].tolist()):
            q = -1 - obj
            if a in arrays.by_id and placed.get((a, c), (None,))[0] != q:
                out.append((arrays.by_id[a][0], arrays.index(a, c), storage.where(storage.layout.indexes[p].name),
                                         f"a pointer to process {q}, whose index does not place the chunk"))
    return placed


def _routes(storage, manifest: Manifest, array: int, index: tuple[int, ...]) -> list[int]:
    """Every process whose index some process's lookup (13.5 rules 1-2) reads first for the
    chunk; [] when rule 3 (every index in turn) applies."""
    if array < 0:
        w = manifest.stacks[-1 - array].zarr.writer
        return [w] if w is not None else []
    rec = manifest.leaves[array]
    if rec.zarr.writer is not None:
        return [rec.zarr.writer]
    sh = rec.sharding or {}
    if sh.get("kind") == "named" and sh.get("mesh_processes") is not None:
        sizes, table = storage.layout.meshes[sh["mesh_processes"]]
        return list(chunk_holders(sizes, table, sh["spec"], rec.shape, rec.zarr.chunk_shape, index,
                                  axis_names=sh["mesh"]["axis_names"]))
    return []


def _check_chunks(storage, manifest: Manifest, indexes: dict, arrays: _Arrays, placed: dict, out: list) -> None:
    """Every chunk of every array: placed once, found on every process's route, and where the
    manifest's `places` say when it has them."""
    for a, (name, shape, st, _) in sorted(arrays.by_id.items()):
        for c, index in enumerate(np.ndindex(*chunk_grid(shape, st.chunk_shape))):
            place = placed.get((a, c))
            if place is None:
                out.append((name, index, storage.where(st.path), "no index object places the chunk"))
                continue
            if st.places and tuple(st.places[c]) != place[1:]:
                out.append((name, index, storage.where(place[1]), f"the manifest's place "
                                         f"{list(st.places[c])} is not the index's {list(place[1:])}"))
            try:
                routes = _routes(storage, manifest, a, index)
            except CheckpointError as e:
                out.append((name, index, storage.where(st.path), str(e)))
                continue
            for p in routes:
                if p in indexes and indexes[p].find(a, c) is None:
                    out.append((name, index, storage.where(storage.layout.indexes[p].name),
                                             f"process {p}'s index, where a restore looks for the chunk, lacks it"))


def packed_problems(storage, manifest: Manifest) -> tuple[list[Found], bool]:
    """(every broken rule of SPEC 13 in the checkpoint at `storage`, a PackedChunks; whether its
    chunks can be listed and read: False when the manifest claims more chunks than the index
    objects place)."""
    out: list[Found] = []
    arrays = _Arrays(manifest)
    indexes = _load_indexes(storage, out)
    _check_objects(storage, indexes, out)
    records = sum(int((i.entries["object"] >= 0).sum()) for i in indexes.values())
    claimed = sum(arrays.chunks(a) for a in arrays.by_id)
    if claimed > records:
        out.append(("<manifest>", None, storage.where("manifest.msgpack"),
                                 f"its arrays have {claimed} chunks, the index objects place {records}"))
        return out, False
    placed = _check_records(storage, indexes, arrays, out)
    _check_chunks(storage, manifest, indexes, arrays, placed, out)
    return out, True


__all__ = ["Found", "packed_problems"]
