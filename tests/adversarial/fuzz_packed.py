"""The seeded fuzz of version-3 checkpoints (issue 36): random edits of index objects (records
and object sizes, re-sealed), of a data object's bytes (flips, appended bytes, cuts; not
re-sealed) and of the manifest's v3 fields (``packed``, and the leaves' writer, places and
mesh_processes; re-sealed). A case is (target, seed): the same seed makes the same edits."""

from __future__ import annotations

import copy
import os
import random
from typing import Callable

import numpy as np

from ckpt._format import INDEX_DTYPE
from hostile import _write, pack_sealed

_FIELDS = ("array", "chunk", "object", "offset", "length", "crc32c")
_HOSTILE_INTS = [0, 1, -1, 7, 8, 63, 64, 4095, 4096, 2**31 - 1, -(2**31), 2**32, 2**62, 2**63, 2**64 - 1]


def fuzz_cases(n: int, seed: int) -> list:
    """`n` seeded edits, a third each of index objects, data objects and the manifest's v3 fields."""
    from hostile_packed import Case

    rng = random.Random(seed)
    out = []
    for k in range(n):
        target = ("index", "data", "manifest")[k % 3]
        out.append(Case("fuzz", f"{target}#{seed}.{k}", (target, rng.getrandbits(64))))
    return out


def _fit(field: str, value: int) -> int:
    """`value` as the record field's type holds it (wrapped)."""
    bits = {"array": 32, "chunk": 64, "object": 32, "offset": 64, "length": 64, "crc32c": 32}[field]
    signed = field in ("array", "chunk", "object")
    value %= 2**bits
    return value - 2**bits if signed and value >= 2 ** (bits - 1) else value


def fuzz(case, root: str, pk, write_index: Callable) -> None:
    """Apply fuzz case `case` to the checkpoint at `root` (decoded as `pk`, hostile_packed.Packed)."""
    target, seed = case.args
    rng = random.Random(seed)
    doc = copy.deepcopy(pk.doc)
    if target == "index":
        p = rng.randrange(len(pk.indexes))
        index = copy.deepcopy(pk.indexes[p])
        r = np.frombuffer(index["chunks"], INDEX_DTYPE).copy()
        for _ in range(rng.randint(1, 3)):
            if len(r) and rng.random() < 0.8:
                i, field = rng.randrange(len(r)), rng.choice(_FIELDS)
                old = int(r[field][i])
                r[field][i] = _fit(field, rng.choice(_HOSTILE_INTS + [old + rng.randint(-2, 2), old * 2]))
            elif index["objects"]:
                o = rng.randrange(len(index["objects"]))
                index["objects"][o]["size"] = max(0, index["objects"][o]["size"] + rng.choice([-1, 1, 4096, -64]))
        index["chunks"] = r.tobytes()
        write_index(root, doc, p, index)
    elif target == "data":
        _, name = pk.data_object()
        path = os.path.join(root, name)
        data = bytearray(open(path, "rb").read())
        for _ in range(rng.randint(1, 3)):
            how = rng.random()
            if how < 0.6:
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            elif how < 0.8:
                data += bytes(rng.randint(1, 4096))
            else:
                del data[rng.randrange(len(data)):]
        _write(path, bytes(data))
    else:
        _fuzz_manifest(rng, doc)
        _write(os.path.join(root, "manifest.msgpack"), pack_sealed(doc))


def _fuzz_manifest(rng: random.Random, doc: dict) -> None:
    """One to three edits of the v3 fields: packed.* and the leaves' writer, places, mesh_processes."""
    for _ in range(rng.randint(1, 3)):
        section = doc["packed"]
        choice = rng.randrange(5)
        value = rng.choice(_HOSTILE_INTS + [None, "x", [], b"\0"])
        if choice == 0 and section["indexes"]:
            ref = rng.choice(section["indexes"])
            ref[rng.choice(["process", "size", "crc32c", "name"])] = value
        elif choice == 1 and section["meshes"]:
            mesh = rng.choice(section["meshes"])
            if rng.random() < 0.5:
                mesh["processes"] = bytes(rng.getrandbits(8) for _ in range(len(mesh["processes"])))
            else:
                mesh["axis_sizes"] = [rng.choice([1, 2, 4, 8, 2**20]) for _ in mesh["axis_sizes"]]
        elif choice == 2:
            section["align"] = value
        else:
            leaves = [l for l in doc["leaves"] if l.get("storage", {}).get("type") == "zarr"]
            leaf = rng.choice(leaves)
            if choice == 3 and leaf["storage"].get("places"):
                place = rng.choice(leaf["storage"]["places"])
                place[rng.randrange(4)] = value
            elif choice == 3:
                leaf["storage"]["writer"] = value
            elif leaf.get("sharding") and leaf["sharding"].get("kind") == "named":
                leaf["sharding"]["mesh_processes"] = value
