"""A generator of hostile checkpoints: one pristine checkpoint, and every way to damage it.

Cases are plain data (``Case``), enumerated deterministically, so a run can be counted and
repeated; ``apply`` turns one into a directory on disk. Three families:

* ``field``: every field of the manifest (every map entry and list item, at every depth)
  replaced by values of the wrong type, out of range, huge or hostile (paths out of the
  checkpoint, unhashable or duplicate keys, dtypes the library never writes, depth bombs), or
  deleted. The manifest is re-sealed with a valid checksum, so the case reaches validation
  instead of stopping at the checksum.
* ``file``: every kind of file of a checkpoint (manifest, group and array zarr.json, chunk file,
  array and chunk directories, the checkpoint itself) replaced by a symbolic link to a file or a
  copy outside the checkpoint (same size, other bytes), a link inside it, a link to /dev/zero, a
  FIFO, a socket, a directory, an empty file, a sparse 8 GiB file; plus a ``.tmp-`` directory
  holding a whole committed checkpoint, and a manifest claiming an 8 GiB chunk that a sparse
  file really holds.
* ``flip``: one byte of the manifest, of a zarr.json or of a chunk flipped, not re-sealed: the
  result must be an error or the pristine values, never different data.
"""

from __future__ import annotations

import copy
import os
import shutil
import socket
import stat
from dataclasses import dataclass
from typing import Any

import msgpack

try:
    from ckpt._format.records import seal
except ImportError:  # a jax-ckpt from before manifests carried a checksum (to measure it)
    def seal(doc: dict) -> bytes:
        return msgpack.packb(doc, use_bin_type=True)

# Replacement values for any field: wrong types, boundaries, huge and hostile values.
HUGE_TEXT = "x" * (1 << 20)
_BASE_VALUES: list[tuple[str, Any]] = [
    ("nil", None), ("true", True), ("zero", 0), ("minus1", -1), ("int64min", -(2**63)), ("uint64max", 2**64 - 1),
    ("float", 1.5), ("nan", float("nan")), ("inf", float("inf")), ("empty_str", ""), ("str", "params"),
    ("bytes", b"\x00\xff"), ("empty_list", []), ("list", [1, "a", None]), ("empty_map", {}),
    ("map", {"kind": "leaf", "index": 0}), ("huge_str", HUGE_TEXT), ("unhashable_key_list", [[1], [2]]),
]

# Per-field hostile values, by the field's name (in addition to the generic ones).
_FIELD_VALUES: dict[str, list[tuple[str, Any]]] = {
    "path": [("dotdot", "../outside"), ("abs", "/etc"), ("dot", "."), ("double_slash", "a//b"),
             ("backslash", "a\\b"), ("dot_component", "a/./b"), ("nul", "a\x00b"), ("long", "x" * 300),
             ("reserved", "manifest.msgpack"), ("hidden", ".owner"), ("trailing", "w/"), ("escaped_dots", "%2E%2E")],
    "shape": [("huge", [10**12]), ("huge2", [2**62, 2**62]), ("negative", [-1]), ("many_dims", [1] * 100),
              ("zero", [0, 10**18]), ("floats", [1.5]), ("nested", [[1]])],
    "chunk_shape": [("zero", [0]), ("huge", [10**12]), ("negative", [-4]), ("wrong_ndim", [1, 1, 1])],
    "dtype": [("object", "object"), ("O", "O"), ("void", "|V8"), ("unicode", "<U4"), ("datetime", "datetime64[ns]"),
              ("structured", "[('a', '<f4')]"), ("float128", "float128"), ("int4", "int4"), ("bfloat16", "bfloat16")],
    "data_type": [("object", "object"), ("other", "float64")],
    "encoding": [("other", "bits"), ("unknown", "zstd")],
    "checksum": [("other", "sha256")],
    "chunk_checksums": [("negative", [-1]), ("too_big", [2**32]), ("strs", ["a"]), ("many", [0] * 100)],
    "prng_impl": [("unknown", "philox4x32"), ("empty", "")],
    "kind": [("pickle", "pickle"), ("custom", "custom"), ("leaf", "leaf"), ("numpy_scalar", "numpy.scalar"),
             ("prng", "prng_key"), ("int", "int")],
    "index": [("out_of_range", 10**6), ("negative", -1)],
    "keys": [("duplicates", ["a", "a"]), ("bool", [True]), ("float", [1.5]), ("int_and_str", [1, "1"])],
    "format_version": [("newer", 99), ("text", "1"), ("bool", True)],
    "created": [("huge", 1e300), ("negative", -1.0)],
    "data": [("short", b"\x00"), ("text", "abc")],
    "value": [("huge_int_text", "9" * 5000), ("int_text", "-123"), ("list3", [1.0, 2.0, 3.0])],
    "axis_sizes": [("huge", [2**40, 2**40]), ("zero", [0])],
    "axis_names": [("duplicate", ["data", "data"]), ("ints", [1, 2])],
    "spec": [("unknown_axis", ["nope"]), ("repeated", ["data", "data"]), ("too_long", [None] * 40)],
    "tree": [("depth_bomb", "DEPTH_BOMB"), ("cycle_like", "SELF_COPY")],
}


@dataclass(frozen=True)
class Case:
    family: str  # 'field', 'file', 'flip'
    name: str
    # field: (key path into the manifest, value name); file: (file role, replacement);
    # flip: (file role, byte offset)
    args: tuple


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a decoded manifest (maps by key, lists by position)."""
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


def _depth_bomb(depth: int = 400) -> dict:
    node: dict = {"kind": "leaf", "index": 0}
    for _ in range(depth):
        node = {"kind": "list", "children": [node]}
    return node


def _values_for(key: Any) -> list[tuple[str, Any]]:
    named = _FIELD_VALUES.get(key if isinstance(key, str) else "", [])
    return [("delete", "DELETE")] + named + _BASE_VALUES


def _signature(doc: dict, path: tuple) -> tuple:
    """What kind of field `path` is: list positions dropped, a leaf named by its kind and storage
    (the same field of two leaves of one kind takes the same code path)."""
    out = []
    node = doc
    for k in path:
        if isinstance(node, list):
            item = node[k]
            if out and out[-1] == "leaves" and isinstance(item, dict):
                out.append(f"{item.get('kind')}:{(item.get('storage') or {}).get('type')}")
            else:
                out.append("*")
        else:
            out.append(k)
        node = node[k]
    return tuple(out)


def field_cases(doc: dict, *, short: bool) -> list[Case]:
    """(field, hostile value) cases: every field with every value, or (`short`) one field of each
    kind (``_signature``) with its own hostile values, a deletion and one generic value (in
    turn)."""
    cases, seen = [], set()
    for n, path in enumerate(_paths(doc)):
        if path[-1] == "manifest_crc32c":
            continue
        values = [name for name, _ in _values_for(path[-1])]
        if short:
            sig = _signature(doc, path)
            if sig in seen:
                continue
            seen.add(sig)
            named = 1 + len(_FIELD_VALUES.get(path[-1] if isinstance(path[-1], str) else "", []))
            base = values[named:]
            values = values[:named] + [base[n % len(base)]]
        cases += [Case("field", f"{'/'.join(map(str, path))}={v}", (path, v)) for v in dict.fromkeys(values)]
    return cases


def mutate(doc: dict, path: tuple, value_name: str) -> dict:
    doc = copy.deepcopy(doc)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    value = dict(_values_for(key))[value_name]
    if value == "DELETE":
        del parent[key]
    elif value == "DEPTH_BOMB":
        parent[key] = _depth_bomb()
    elif value == "SELF_COPY":
        parent[key] = {"kind": "list", "children": [copy.deepcopy(parent[key])] * 2}
    else:
        parent[key] = copy.deepcopy(value)
    return doc


def pack_sealed(doc: dict) -> bytes:
    """The manifest `doc` as a writer would seal it (a valid checksum over hostile content)."""
    doc = {k: v for k, v in doc.items() if k != "manifest_crc32c"}
    try:
        return seal(doc)
    except (ValueError, TypeError, OverflowError):  # not packable with a checksum: the raw bytes
        return msgpack.packb(doc, use_bin_type=True)


# ---- file kinds -------------------------------------------------------------------------------

FILE_ROLES = ("manifest", "group_json", "array_json", "chunk", "array_dir", "chunk_dir", "checkpoint")
REPLACEMENTS = ("link_outside", "link_inside", "link_dev_zero", "fifo", "socket", "directory", "empty", "sparse_huge")


def file_cases() -> list[Case]:
    cases = [Case("file", f"{role}->{how}", (role, how)) for role in FILE_ROLES for how in REPLACEMENTS
             if not (role == "checkpoint" and how in ("empty", "directory"))]
    cases.append(Case("file", "tmp_dir_with_manifest", ("checkpoint", "tmp_with_manifest")))
    cases.append(Case("file", "link_to_tmp_dir", ("checkpoint", "link_to_tmp")))
    cases.append(Case("file", "claimed_8GiB_chunk_in_sparse_file", ("chunk", "claimed_huge")))
    return cases


def roles(ckpt_dir: str, doc: dict) -> dict[str, str]:
    """The path of one file (or directory) of each role in the checkpoint."""
    zarr = next(l["storage"] for l in doc["leaves"] if l.get("storage", {}).get("type") == "zarr"
                and len(l["storage"]["chunk_checksums"]) > 1)
    array = os.path.join(ckpt_dir, zarr["path"])
    return {
        "manifest": os.path.join(ckpt_dir, "manifest.msgpack"),
        "group_json": os.path.join(ckpt_dir, "zarr.json"),
        "array_json": os.path.join(array, "zarr.json"),
        "chunk": os.path.join(array, "c", *(["0"] * len(zarr["chunk_shape"]))),
        "array_dir": array,
        "chunk_dir": os.path.join(array, "c"),
        "checkpoint": ckpt_dir,
        "_zarr_leaf": zarr["path"],
    }


def _replace(path: str, how: str, outside: str, ckpt_dir: str) -> None:
    is_dir = os.path.isdir(path) and not os.path.islink(path)
    if how == "link_outside" and path == ckpt_dir:
        # The location a user names may itself be a link (``latest -> step_100``): what it
        # points to is then the checkpoint (here a damaged copy, elsewhere but not "outside").
        elsewhere = os.path.join(os.path.dirname(os.path.dirname(ckpt_dir)), "elsewhere")
        outside = elsewhere
        os.makedirs(outside, exist_ok=True)
    if how == "link_outside":
        # A copy outside with other bytes but the same size: a reader that follows the link
        # would find nothing wrong with the sizes.
        target = os.path.join(outside, "copy-" + os.path.basename(path) + "-" + str(abs(hash(path)) % 10**6))
        if is_dir:
            shutil.copytree(path, target, symlinks=True)  # real copies: changed in place below
            for d, _, files in os.walk(target):
                for f in files:
                    p = os.path.join(d, f)
                    with open(p, "r+b") as fh:
                        data = fh.read()
                        fh.seek(0)
                        fh.write(bytes(b ^ 0x5A for b in data))
        else:
            with open(path, "rb") as f:
                size = len(f.read())
            with open(target, "wb") as f:
                f.write(b"SECRET" * (size // 6 + 1))
                f.truncate(size)
        _remove(path)
        os.symlink(target, path)
    elif how == "link_inside":  # the same bytes, inside the checkpoint, but through a link
        moved = path + "-moved"
        os.rename(path, moved)
        os.symlink(os.path.basename(moved), path)
    elif how == "link_dev_zero":
        _remove(path)
        os.symlink("/dev/zero", path)
    elif how == "fifo":
        _remove(path)
        os.mkfifo(path)
    elif how == "socket":
        _remove(path)
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.close()
    elif how == "directory":
        _remove(path)
        os.mkdir(path)
    elif how == "empty":
        _remove(path)
        open(path, "wb").close()
    elif how == "sparse_huge":
        _remove(path)
        with open(path, "wb") as f:
            f.truncate(8 << 30)
    else:
        raise ValueError(how)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


# ---- applying a case --------------------------------------------------------------------------


def apply(case: Case, pristine: str, case_dir: str, outside: str, doc: dict) -> str:
    """Write the case's checkpoint as ``<case_dir>/run/step_00000001`` (a manager directory
    with one step); return the checkpoint's path."""
    run = os.path.join(case_dir, "run")
    ckpt_dir = os.path.join(run, "step_00000001")
    # Hard links: cheap, and every change below replaces a file rather than writing into it.
    shutil.copytree(pristine, ckpt_dir, copy_function=os.link)
    manifest = os.path.join(ckpt_dir, "manifest.msgpack")
    if case.family == "field":
        path, value_name = case.args
        _write(manifest, pack_sealed(mutate(doc, path, value_name)))
    elif case.family == "flip":
        role, offset = case.args
        target = roles(ckpt_dir, doc)[role]
        with open(target, "rb") as f:
            data = bytearray(f.read())
        data[offset % len(data)] ^= 0x20
        _write(target, bytes(data))
    elif case.family == "file":
        role, how = case.args
        where = roles(ckpt_dir, doc)
        if how == "tmp_with_manifest":
            os.rename(ckpt_dir, os.path.join(run, "step_00000001.tmp-0123456789ab"))
            return os.path.join(run, "step_00000001.tmp-0123456789ab")
        if how == "link_to_tmp":
            tmp = os.path.join(run, "step_00000002.tmp-0123456789ab")
            os.rename(ckpt_dir, tmp)
            os.symlink(os.path.basename(tmp), ckpt_dir)
            return ckpt_dir
        if how == "claimed_huge":
            huge = copy.deepcopy(doc)
            leaf = next(l for l in huge["leaves"] if l.get("storage", {}).get("path") == where["_zarr_leaf"])
            n = (8 << 30) // 4
            leaf.update(shape=[n], dtype="float32", sharding=None)
            leaf["storage"].update(chunk_shape=[n], data_type="float32", encoding="native", chunk_checksums=[0])
            _write(manifest, pack_sealed(huge))
            chunk = os.path.join(ckpt_dir, where["_zarr_leaf"], "c", "0")
            shutil.rmtree(os.path.join(ckpt_dir, where["_zarr_leaf"], "c"))
            os.makedirs(os.path.dirname(chunk))
            with open(chunk, "wb") as f:
                f.truncate(8 << 30)
            return ckpt_dir
        _replace(where[role], how, outside, ckpt_dir)
    else:
        raise ValueError(case.family)
    return ckpt_dir


def _write(path: str, data: bytes) -> None:
    """Replace the file at `path` (never write into it: it may be a hard link to the pristine)."""
    with open(path + ".new", "wb") as f:
        f.write(data)
    os.replace(path + ".new", path)


def flip_cases(sizes: dict[str, int], *, short: bool) -> list[Case]:
    """One byte flipped: at every offset of the manifest and the zarr.json files (`short`: every
    97th of the manifest, 6 of each other file) and at 64 (`short`: 6) offsets of a chunk.
    (Every bit of every manifest byte is also flipped in memory: worker.manifest_flips.)"""
    cases = []
    for role in ("manifest", "array_json", "group_json", "chunk"):
        n = sizes[role]
        if role == "manifest":
            step = 97 if short else 1
        elif role == "chunk" or short:
            step = max(1, n // (6 if short else 64))
        else:
            step = 1
        cases += [Case("flip", f"{role}@{i}", (role, i)) for i in range(0, n, step)]
    return cases


def file_size(path: str) -> int:
    return os.stat(path).st_size if stat.S_ISREG(os.lstat(path).st_mode) else 0


__all__ = ["Case", "apply", "field_cases", "file_cases", "flip_cases", "mutate", "pack_sealed", "roles"]
