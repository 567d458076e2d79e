"""Hostile version-3 (packed, formats/SPEC.md section 13) checkpoints: every class of damage of
issue 36, as plain data (``Case``) applied to a copy of a pristine packed checkpoint.

Families (``Case.family``):

* ``claim``: the manifest's v3 fields re-sealed with hostile values (chunk counts of 2**24 and
  2**40, with and without index sizes inflated to match; a large mesh table shared by leaves of
  many shapes; places at offsets 2**63 and 2**64-1; alignments; writers; extra processes).
* ``index``: an index object rewritten (records, objects) with the manifest's size and CRC-32C
  of it updated to match, so the case reaches the rules of 13.3 instead of the checksum.
* ``damage``: bytes changed and not re-sealed: index objects missing, cut, extended or flipped;
  data objects longer, shorter, sparse 1 TiB, missing, behind links, flipped in a chunk or in
  the padding (harmless: not covered by any CRC-32C, SPEC 13.8).
* ``fuzz``: seeded random edits of index records and objects, data object bytes and the
  manifest's v3 fields (``fuzz_packed.py``).

A case is applied by ``apply``; ``sealed`` tells whether the values restored must equal the
pristine ones (damage that was not re-sealed: yes; a re-sealed rewrite may be a consistent lie).
"""

from __future__ import annotations

import copy
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable

import crc32c
import msgpack
import numpy as np

from ckpt._format import INDEX_DTYPE
from hostile import _write, pack_sealed


@dataclass(frozen=True)
class Case:
    family: str
    name: str
    args: tuple

    @property
    def sealed(self) -> bool:
        """Whether the case rewrites what the manifest seals (then restored values may differ)."""
        return self.family in ("claim", "index") or (self.family == "fuzz" and self.args[0] != "data")


class Packed:
    """A packed checkpoint on disk, decoded: its manifest and index objects, to edit."""

    def __init__(self, root: str):
        self.root = root
        with open(os.path.join(root, "manifest.msgpack"), "rb") as f:
            self.doc = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
        self.indexes = []
        for ref in self.doc["packed"]["indexes"]:
            with open(os.path.join(root, ref["name"]), "rb") as f:
                self.indexes.append(msgpack.unpackb(f.read(), raw=False))

    def records(self, p: int) -> np.ndarray:
        return np.frombuffer(self.indexes[p]["chunks"], INDEX_DTYPE).copy()

    def data_object(self) -> tuple[int, str]:
        """(process, name) of the first data object holding at least two chunks."""
        for p, index in enumerate(self.indexes):
            r = self.records(p)
            for k, o in enumerate(index["objects"]):
                if int((r["object"] == k).sum()) >= 2:
                    return p, o["name"]
        raise AssertionError("no data object holds two chunks")

    def padded_gap(self) -> tuple[str, int] | None:
        """(data object, offset) of a padding byte between two chunks, or None."""
        for p, index in enumerate(self.indexes):
            r = self.records(p)
            for k, o in enumerate(index["objects"]):
                mine = sorted((int(x["offset"]), int(x["length"])) for x in r[r["object"] == k])
                for (o0, l0), (o1, _) in zip(mine, mine[1:]):
                    if o1 > o0 + l0:
                        return o["name"], o0 + l0
        return None


def _write_index(root: str, doc: dict, p: int, index: dict) -> None:
    """Index `p` replaced by `index`, the manifest's size and CRC-32C of it updated, re-sealed."""
    data = msgpack.packb(index, use_bin_type=True)
    ref = doc["packed"]["indexes"][p]
    _write(os.path.join(root, ref["name"]), data)
    ref.update(size=len(data), crc32c=crc32c.crc32c(data))
    _write(os.path.join(root, "manifest.msgpack"), pack_sealed(doc))


def _leaf(doc: dict, want: Callable[[dict], bool]) -> dict:
    return next(l for l in doc["leaves"] if l.get("storage", {}).get("type") == "zarr" and want(l))


# ---- claim: the manifest's v3 fields ------------------------------------------------------------


def _claim_chunks(n: int, inflate: bool) -> Callable:
    def edit(doc: dict, pk: Packed) -> None:
        leaf = _leaf(doc, lambda l: not l["storage"].get("places"))
        leaf.update(shape=[n], dtype="float32", sharding=None if leaf["kind"] == "numpy.ndarray" else leaf["sharding"])
        if leaf["sharding"] is not None:
            leaf["sharding"] = {"kind": "single_device"}
        leaf["storage"].update(chunk_shape=[1], data_type="float32", encoding="native")
        if inflate:  # the index sizes claimed large enough to hold the records (a lie found late)
            for ref in doc["packed"]["indexes"]:
                ref["size"] = min(1 << 30, 36 * n // len(doc["packed"]["indexes"]) + 36)
    return edit


def _big_mesh(sizes: tuple[int, int], leaves: int) -> Callable:
    """One mesh table of `sizes` devices, used by `leaves` leaves of distinct shapes."""
    def edit(doc: dict, pk: Packed) -> None:
        n = len(doc["packed"]["indexes"])
        table = (np.arange(sizes[0] * sizes[1]) % n).astype("<u4").tobytes()
        doc["packed"]["meshes"].append({"axis_sizes": list(sizes), "processes": table})
        m = len(doc["packed"]["meshes"]) - 1
        base = _leaf(doc, lambda l: (l.get("sharding") or {}).get("kind") == "named")
        names = base["sharding"]["mesh"]["axis_names"]
        for k in range(leaves):
            leaf = copy.deepcopy(base)
            shape = [sizes[0] * (k + 1), sizes[1]]
            leaf.update(path=f"hostile_{k}", shape=shape, dtype="float32")
            leaf["sharding"] = {"kind": "named", "mesh": {"axis_names": names, "axis_sizes": list(sizes)},
                                "spec": [names[0], names[1]], "mesh_processes": m}
            leaf["storage"].update(path=f"hostile_{k}", chunk_shape=[k + 1, 1], data_type="float32",
                                   encoding="native", chunk_checksums=[])
            doc["tree"]["keys"].append(f"hostile_{k}")
            doc["tree"]["children"].append({"kind": "leaf", "index": len(doc["leaves"])})
            doc["leaves"].append(leaf)
    return edit


def _place(field: int, value: Any) -> Callable:
    def edit(doc: dict, pk: Packed) -> None:
        leaf = _leaf(doc, lambda l: bool(l["storage"].get("places")))
        leaf["storage"]["places"][0][field] = value
    return edit


def _packed(change: Callable[[dict], None]) -> Callable:
    def edit(doc: dict, pk: Packed) -> None:
        change(doc["packed"])
    return edit


def _storage(want: Callable[[dict], bool], **fields) -> Callable:
    def edit(doc: dict, pk: Packed) -> None:
        _leaf(doc, want)["storage"].update(fields)
    return edit


def _extra_index(doc: dict, pk: Packed) -> None:
    n = len(doc["packed"]["indexes"])
    ref = dict(doc["packed"]["indexes"][-1], process=n, name=doc["packed"]["indexes"][-1]["name"][:-1] + "x9")
    doc["packed"]["indexes"].append(ref)


def _no_writer_route(doc: dict, pk: Packed) -> None:
    """A mesh table naming, for every position, the last process: every restore but its own is
    sent to an index that lacks the chunks (or points on)."""
    if not doc["packed"]["meshes"]:
        raise LookupError("no mesh table")
    for mesh in doc["packed"]["meshes"]:
        n = len(mesh["processes"]) // 4
        mesh["processes"] = np.full(n, len(doc["packed"]["indexes"]) - 1, "<u4").tobytes()


CLAIMS: dict[str, Callable] = {
    "chunks_2**24": _claim_chunks(1 << 24, False),
    "chunks_2**24_index_sizes_inflated": _claim_chunks(1 << 24, True),
    "chunks_2**40_index_sizes_inflated": _claim_chunks(1 << 40, True),
    "mesh_4096x4096": _big_mesh((4096, 4096), 2),
    "mesh_1024x1024_shared_by_40_shapes": _big_mesh((1024, 1024), 40),
    "place_offset_2**63": _place(1, 2**63),
    "place_offset_2**64-1": _place(1, 2**64 - 1),
    "place_offset_2**62": _place(1, 2**62),
    "place_offset_unaligned": _place(1, 8),
    "place_length": _place(2, 4),
    "place_object_outside": _place(0, "../outside"),
    "place_object_missing": _place(0, "~data/none.0"),
    "place_crc": _place(3, 12345),
    "align_64": _packed(lambda p: p.update(align=64)),
    "align_1": _packed(lambda p: p.update(align=1)),
    "align_2**30": _packed(lambda p: p.update(align=2**30)),
    "index_size_2**31": _packed(lambda p: p["indexes"][0].update(size=2**31)),
    "index_crc": _packed(lambda p: p["indexes"][-1].update(crc32c=(p["indexes"][-1]["crc32c"] + 1) % 2**32)),
    "index_name_other": _packed(lambda p: p["indexes"][0].update(name=p["indexes"][-1]["name"] + "x")),
    "extra_process_missing_index": _extra_index,
    "writer_other_process": _storage(lambda l: l["storage"].get("writer") is not None,
                                     writer=None),
    "writer_out_of_range": _storage(lambda l: l["storage"].get("writer") is not None, writer=99),
    "mesh_routes_to_last_process": _no_writer_route,
}


def _writer_shift(doc: dict, pk: Packed) -> None:
    n = len(doc["packed"]["indexes"])
    leaf = _leaf(doc, lambda l: l["storage"].get("writer") is not None)
    leaf["storage"]["writer"] = (leaf["storage"]["writer"] + 1) % n


CLAIMS["writer_shifted"] = _writer_shift


# ---- index: rewritten and re-sealed -------------------------------------------------------------


def _rows(change: Callable[[np.ndarray, Packed, int], np.ndarray | None], which: str = "data") -> Callable:
    """An edit of one index's records: `which` picks the index (the one with a data object of
    two chunks, or the one with a pointer)."""
    def edit(doc: dict, pk: Packed) -> tuple[int, dict]:
        p = pk.data_object()[0] if which == "data" else next(
            q for q in range(len(pk.indexes)) if (pk.records(q)["object"] < 0).any())
        r = pk.records(p)
        out = change(r, pk, p)
        index = copy.deepcopy(pk.indexes[p])
        index["chunks"] = (r if out is None else out).tobytes()
        return p, index
    return edit


def _objects(change: Callable[[list, Packed, int], None]) -> Callable:
    def edit(doc: dict, pk: Packed) -> tuple[int, dict]:
        p = pk.data_object()[0]
        index = copy.deepcopy(pk.indexes[p])
        change(index["objects"], pk, p)
        return p, index
    return edit


def _first_direct(r: np.ndarray) -> int:
    return int(np.argmax(r["object"] >= 0))


def _set(field: str, value: Any) -> Callable:
    def change(r, pk, p):
        r[field][_first_direct(r)] = value
    return change


def _second_at_first(r, pk, p):
    """The second chunk of a data object placed at the first's bytes (same length), CRC copied:
    a restore reads the first chunk's bytes for it, and they match."""
    d = np.where(r["object"] >= 0)[0]
    same = [(i, j) for i in d for j in d if i < j and r["length"][i] == r["length"][j] and r["object"][i] == r["object"][j]]
    i, j = same[0]
    r["offset"][j], r["crc32c"][j] = r["offset"][i], r["crc32c"][i]


def _pointer_target(r, pk, p):
    i = int(np.argmax(r["object"] < 0))
    q = -1 - int(r["object"][i])
    others = [x for x in range(len(pk.indexes)) if x not in (p, q)]
    r["object"][i] = -1 - (others[0] if others else q)


def _drop_record(pointer: bool) -> Callable:
    def change(r, pk, p):
        i = int(np.argmax(r["object"] < 0)) if pointer else _first_direct(r)
        return np.delete(r, i)
    return change


def _drop_places_record(r, pk, p):
    """The record of an array whose places the manifest holds (the index lacks it)."""
    doc = pk.doc
    placed = [i for i, l in enumerate(doc["leaves"]) if l.get("storage", {}).get("places")]
    hit = np.isin(r["array"], placed) & (r["object"] >= 0)
    return np.delete(r, int(np.argmax(hit))) if hit.any() else np.delete(r, _first_direct(r))


def _duplicate(r, pk, p):
    return np.sort(np.concatenate([r, r[:1]]), order=["array", "chunk"])


INDEXES: dict[str, Callable] = {
    "offset_2**63": _rows(_set("offset", 2**63)),
    "offset_2**64-1": _rows(_set("offset", 2**64 - 1)),
    "offset_unaligned": _rows(_set("offset", 8)),
    "length_zero": _rows(_set("length", 0)),
    "length_2**64-1": _rows(_set("length", 2**64 - 1)),
    "object_out_of_range": _rows(_set("object", 7)),
    "crc_wrong": _rows(_set("crc32c", 1)),
    "chunk_beyond_grid": _rows(_set("chunk", 10**6)),
    "array_unknown": _rows(lambda r, pk, p: np.sort(np.concatenate(
        [r, np.array([(999, 0, 0, 0, r["length"][_first_direct(r)], 0)], INDEX_DTYPE)]), order=["array", "chunk"])),
    "second_chunk_at_first_chunks_bytes": _rows(_second_at_first),
    "pointer_to_a_process_without_it": _rows(_pointer_target, "pointer"),
    "pointer_to_itself": _rows(lambda r, pk, p: r["object"].__setitem__(int(np.argmax(r["object"] < 0)), -1 - p),
                               "pointer"),
    "pointer_dropped": _rows(_drop_record(True), "pointer"),
    "record_dropped": _rows(_drop_record(False)),
    "record_of_places_array_dropped": _rows(_drop_places_record),
    "record_twice": _rows(_duplicate),
    "unsorted": _rows(lambda r, pk, p: r[::-1].copy()),
    "truncated_record": _rows(lambda r, pk, p: np.frombuffer(r.tobytes()[:-5] + b"\0" * 0, np.uint8)),
    "object_size_larger": _objects(lambda o, pk, p: o[0].update(size=o[0]["size"] + 4096)),
    "object_size_smaller": _objects(lambda o, pk, p: o[0].update(size=o[0]["size"] - 1)),
    "object_size_2**63": _objects(lambda o, pk, p: o[0].update(size=2**63)),
    "object_name_outside": _objects(lambda o, pk, p: o[0].update(name="../x")),
    "object_name_manifest": _objects(lambda o, pk, p: o[0].update(name="manifest.msgpack")),
    "object_name_index": _objects(lambda o, pk, p: o[0].update(name=pk.doc["packed"]["indexes"][0]["name"])),
    "object_of_another_process": _objects(lambda o, pk, p: o[0].update(
        name=next(x["objects"][0]["name"] for q, x in enumerate(pk.indexes) if q != p and x["objects"]))),
    "objects_dropped": _objects(lambda o, pk, p: o.clear()),
}


# ---- damage: bytes, not re-sealed ---------------------------------------------------------------


def _damage_cases(pk: Packed) -> list[Case]:
    cases = [Case("damage", f"index_{how}", ("index", how)) for how in
             ("missing", "cut", "appended", "flipped", "empty", "link_inside")]
    cases += [Case("damage", f"data_{how}", ("data", how)) for how in
              ("append_1", "append_4096", "cut_1", "sparse_1TiB", "missing", "link_inside", "link_outside",
               "flip_chunk", "fifo", "directory", "dir_link_inside")]
    if pk.padded_gap() is not None:
        cases.append(Case("damage", "data_flip_padding", ("data", "flip_padding")))
    return cases


def _damage(case: Case, root: str, pk: Packed, outside: str) -> None:
    what, how = case.args
    if what == "index":
        path = os.path.join(root, pk.doc["packed"]["indexes"][-1]["name"])
    else:
        path = os.path.join(root, pk.data_object()[1])
    data = bytearray(open(path, "rb").read()) if os.path.isfile(path) else bytearray()
    if how == "missing":
        os.remove(path)
    elif how in ("cut", "cut_1"):
        _write(path, bytes(data[:-1] if how == "cut_1" else data[: len(data) // 2]))
    elif how in ("appended", "append_1", "append_4096"):
        _write(path, bytes(data) + b"\0" * (4096 if how == "append_4096" else 1))
    elif how in ("flipped", "flip_chunk"):
        data[len(data) // 2 if how == "flipped" else 0] ^= 0x10
        _write(path, bytes(data))
    elif how == "flip_padding":
        name, offset = pk.padded_gap()
        path = os.path.join(root, name)
        data = bytearray(open(path, "rb").read())
        data[offset] ^= 0x10
        _write(path, bytes(data))
    elif how == "empty":
        _write(path, b"")
    elif how == "sparse_1TiB":
        os.remove(path)
        with open(path, "wb") as f:
            f.write(data)
            f.truncate(1 << 40)
    elif how == "link_inside":
        os.rename(path, path + "-moved")
        os.symlink(os.path.basename(path) + "-moved", path)
    elif how == "dir_link_inside":
        d = os.path.dirname(path)
        os.rename(d, d + "-moved")
        os.symlink(os.path.basename(d) + "-moved", d)
    elif how == "link_outside":
        target = os.path.join(outside, "copy-" + os.path.basename(path) + "-" + str(abs(hash(root)) % 10**6))
        with open(target, "wb") as f:
            f.write(bytes(data))
        os.remove(path)
        os.symlink(target, path)
    elif how == "fifo":
        os.remove(path)
        os.mkfifo(path)
    elif how == "directory":
        os.remove(path)
        os.mkdir(path)
    else:
        raise ValueError(how)


# ---- every case ---------------------------------------------------------------------------------


def _applies(case: Case, pk: Packed) -> bool:
    """Whether the checkpoint has what the case changes (a 1-process save has no pointers and
    no mesh tables): the edit is tried on a copy of the decoded checkpoint."""
    doc = copy.deepcopy(pk.doc)
    try:
        if case.family == "claim":
            CLAIMS[case.args[0]](doc, pk)
        elif case.family == "index":
            INDEXES[case.args[0]](doc, pk)
    except (StopIteration, LookupError, ValueError):
        return False
    return True


def all_cases(pk: Packed) -> list[Case]:
    """Every case that applies to the checkpoint of `pk`."""
    cases = [Case("claim", name, (name,)) for name in CLAIMS] + [Case("index", name, (name,)) for name in INDEXES]
    return [c for c in cases if _applies(c, pk)] + _damage_cases(pk)


def apply(case: Case, pristine: str, target: str, outside: str) -> str:
    """The case's checkpoint at `target` (hard links to `pristine`, every change a replacement)."""
    shutil.copytree(pristine, target, copy_function=os.link)
    pk = Packed(target)
    doc = copy.deepcopy(pk.doc)
    if case.family == "claim":
        CLAIMS[case.args[0]](doc, pk)
        _write(os.path.join(target, "manifest.msgpack"), pack_sealed(doc))
    elif case.family == "index":
        p, index = INDEXES[case.args[0]](doc, pk)
        _write_index(target, doc, p, index)
    elif case.family == "damage":
        _damage(case, target, pk, outside)
    elif case.family == "fuzz":
        from fuzz_packed import fuzz

        fuzz(case, target, pk, _write_index)
    else:
        raise ValueError(case.family)
    return target
