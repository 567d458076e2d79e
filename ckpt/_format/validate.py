"""A manifest's bytes, decoded (``decode_manifest``), read from a location (``read_manifest``:
the commit point of a checkpoint, with the errors readers expect), and the one validation step
between the decoded document and everything that uses it.

``manifest_from_doc`` turns the msgpack document of a manifest into a typed ``Manifest`` or
raises CheckpointError naming the field at fault; nothing is allocated from, and no file is
opened for, a manifest that has not passed it. The rules are those of formats/SPEC.md (sections
3-8 and 12) plus bounds that keep every later step finite: dtypes from an allow-list, shapes and
chunk counts that the manifest and its files can hold, storage paths that stay inside the
checkpoint, trees of bounded depth with unique keys and leaf paths.

Size: the one path untrusted manifest bytes take, its checks the SPEC's rules in their order.
"""

from __future__ import annotations

import errno
import math
import re
from typing import Any, Protocol

import msgpack

from ckpt._errors import CheckpointError
from ckpt._format.records import (
    STORABLE,
    dtype_from_name,
    storage_of,
    ARRAY_KINDS,
    FORMAT_NAME,
    FORMAT_VERSION,
    GENERATION_MARK,
    MANIFEST_NAME,
    JAX_ARRAY,
    NUMPY_SCALAR,
    PRNG_KEY,
    PACKED_VERSION,
    STACKS_VERSION,
    InlineStorage,
    LeafRecord,
    Manifest,
    Stack,
    StackedStorage,
    ZarrStorage,
    check_seal,
    is_temp_name,
)
from ckpt._format.tree import CUSTOM, DICT, LEAF, LIST, MAX_TREE_DEPTH, NONE, TUPLE, display_path
from ckpt._geometry import chunk_grid

VALUE_KINDS = ("int", "float", "bool", "complex", "str", "bytes")

# Key data of each PRNG implementation: its trailing dimensions (SPEC section 5.1), uint32.
PRNG_IMPLS = {"threefry2x32": (2,), "rbg": (4,), "unsafe_rbg": (4,)}
MAX_NDIM = 32
MAX_ARRAY_BYTES = 1 << 50  # 1 PiB: no array the library writes comes near, and numpy's limit is 2**63
MAX_MESH_DEVICES = 1 << 32
MAX_INT_DIGITS = 4300  # Python's int <-> str conversion limit
LATEST_CREATED = 253402300799.0  # 9999-12-31: the last time datetime can show
MAX_PATH_CHARS = 4096
# A storage path component as writers escape it (SPEC section 2): no leading '.', no '/', no
# backslash, no control or non-ASCII characters; at most 255 bytes (NAME_MAX).
_COMPONENT = re.compile(r"[A-Za-z0-9_%~-][A-Za-z0-9_.%~-]{0,254}")
_RESERVED = frozenset({"zarr.json", "manifest.msgpack"})
_DECIMAL = re.compile(r"-?[0-9]{1,%d}" % MAX_INT_DIGITS)


class _Bad(Exception):
    """A rule broken; the message says which (caught and re-raised as CheckpointError)."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _sizes(x: Any, what: str, *, positive: bool, max_len: int = MAX_NDIM) -> tuple[int, ...]:
    if not isinstance(x, list) or len(x) > max_len:
        raise _Bad(f"{what} {_show(x)} is not a list of at most {max_len} sizes")
    for n in x:
        if not _is_int(n) or n < (1 if positive else 0):
            raise _Bad(f"{what} {_show(x)} holds {_show(n)}, not a {'positive' if positive else 'non-negative'} integer")
    return tuple(x)


def _show(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def check_storage_path(path: Any, what: str = "storage path") -> str:
    """A path relative to the checkpoint that cannot leave it: '/'-separated components as
    writers escape them; no empty, '.', '..', hidden or reserved component, no backslash."""
    if not isinstance(path, str) or not path or len(path) > MAX_PATH_CHARS:
        raise _Bad(f"{what} {_show(path)} is not a relative path inside the checkpoint")
    for part in path.split("/"):
        if not _COMPONENT.fullmatch(part) or part in _RESERVED:
            raise _Bad(f"{what} {_show(path)} is not a relative path inside the checkpoint "
                       f"(component {_show(part)})")
    return path


def check_key(key: str) -> str:
    """`key` if it names an object strictly inside a location: '/'-separated, non-empty
    components, none of them '.', '..' or containing a backslash or NUL. CheckpointError
    otherwise (keys come from validated manifests; this is the engines' last line)."""
    parts = key.split("/") if isinstance(key, str) else [""]
    if not key or any(p in ("", ".", "..") or "\\" in p or "\x00" in p for p in parts):
        raise CheckpointError(f"refusing to read {key!r}: not a relative path inside the checkpoint")
    return key


# ---- tree ------------------------------------------------------------------------------------


def _key_text(key: Any, where: str) -> str:
    if isinstance(key, str) or _is_int(key):
        return str(key)
    raise _Bad(f"tree node at {display_path(where)} has key {_show(key)}, not a string or integer")


def _child_names(node: dict, where: str) -> list[str]:
    kind, children = node["kind"], node.get("children")
    if not isinstance(children, list):
        raise _Bad(f"tree node at {display_path(where)} has no 'children' list")
    if kind in (LIST, TUPLE):
        return [str(i) for i in range(len(children))]
    keys = node.get("keys")
    if not isinstance(keys, list) or len(keys) != len(children):
        raise _Bad(f"tree node at {display_path(where)}: 'keys' and 'children' differ in length")
    if kind == DICT:
        names = [_key_text(k, where) for k in keys]
    else:
        if not isinstance(node.get("type"), str):
            raise _Bad(f"custom tree node at {display_path(where)} has no 'type' name")
        names = []
        for k in keys:
            if not (isinstance(k, list) and len(k) == 2 and k[0] in ("key", "attr", "index")):
                raise _Bad(f"custom tree node at {display_path(where)} has key {_show(k)}, not [entry, name]")
            names.append(_key_text(k[1], where))
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise _Bad(f"tree node at {display_path(where)} has the key {dup!r} twice")
    return names


def check_tree(tree: Any, leaf_count: int) -> list[str]:
    """The leaf path of every leaf index, after checking the tree encoding (SPEC section 4):
    known node kinds, at most MAX_TREE_DEPTH levels, keys that are strings or integers and
    unique, and every leaf index in range exactly once. Iterative: any depth is refused, never
    a RecursionError."""
    paths: list[str | None] = [None] * leaf_count
    stack: list[tuple[Any, tuple[str, ...]]] = [(tree, ())]
    while stack:
        node, comps = stack.pop()
        where = "/".join(comps)
        if len(comps) > MAX_TREE_DEPTH:
            raise _Bad(f"tree is nested more than {MAX_TREE_DEPTH} levels deep (at {where[:200]}...)")
        if not isinstance(node, dict) or not isinstance(node.get("kind"), str):
            raise _Bad(f"tree node at {display_path(where)} is not a map with a 'kind'")
        kind = node["kind"]
        if kind == LEAF:
            index = node.get("index")
            if not _is_int(index) or not 0 <= index < leaf_count:
                raise _Bad(f"tree leaf at {display_path(where)} has index {_show(index)}, not one of 0..{leaf_count - 1}")
            if paths[index] is not None:
                raise _Bad(f"tree leaf index {index} occurs twice ({display_path(paths[index])} and {display_path(where)})")
            paths[index] = where
        elif kind == NONE:
            continue
        elif kind in (DICT, LIST, TUPLE, CUSTOM):
            names = _child_names(node, where)
            for name, child in zip(reversed(names), reversed(node["children"])):
                stack.append((child, comps + (name,)))
        else:
            raise _Bad(f"tree node at {display_path(where)} has an unknown kind {_show(kind)}")
    missing = [i for i, p in enumerate(paths) if p is None]
    if missing:
        raise _Bad(f"leaves {missing[:10]} are not in the tree (every leaf index must occur exactly once)")
    seen: dict[str, int] = {}
    for i, p in enumerate(paths):
        if p in seen:
            raise _Bad(f"leaves {seen[p]} and {i} have the same key path {display_path(p)!r}")
        seen[p] = i
    return paths  # type: ignore[return-value]


# ---- leaves ----------------------------------------------------------------------------------


def _check_value(kind: str, value: Any) -> Any:
    ok = {
        "int": lambda v: _is_int(v) or (isinstance(v, str) and _DECIMAL.fullmatch(v) is not None),
        "float": lambda v: isinstance(v, float),
        "bool": lambda v: isinstance(v, bool),
        "complex": lambda v: isinstance(v, list) and len(v) == 2 and all(isinstance(x, float) for x in v),
        "str": lambda v: isinstance(v, str),
        "bytes": lambda v: isinstance(v, bytes),
    }[kind]
    if not ok(value):
        raise _Bad(f"value {_show(value)} is not a valid {kind!r} value")
    return value


def check_sharding(sharding: Any, ndim: int) -> dict | None:
    if sharding is None:
        return None
    if not isinstance(sharding, dict) or sharding.get("kind") not in ("named", "single_device", "other"):
        raise _Bad(f"sharding {_show(sharding)} is not one of the recorded kinds")
    if sharding["kind"] != "named":
        return sharding
    mesh, spec = sharding.get("mesh"), sharding.get("spec")
    if not isinstance(mesh, dict) or not isinstance(spec, list):
        raise _Bad("named sharding needs 'mesh' and 'spec'")
    names, sizes = mesh.get("axis_names"), mesh.get("axis_sizes")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise _Bad(f"sharding mesh axis_names {_show(names)} are not distinct strings")
    sizes = _sizes(sizes, "sharding mesh axis_sizes", positive=True, max_len=MAX_NDIM)
    if len(sizes) != len(names) or math.prod(sizes) > MAX_MESH_DEVICES:
        raise _Bad(f"sharding mesh {_show(mesh)} needs one size per axis name, at most {MAX_MESH_DEVICES} devices")
    if len(spec) > ndim:
        raise _Bad(f"PartitionSpec has {len(spec)} entries for {ndim} dimensions")
    used: list[str] = []
    for entry in spec:
        axes = [] if entry is None else [entry] if isinstance(entry, str) else entry
        if not isinstance(axes, list) or any(not isinstance(a, str) or a not in names for a in axes):
            raise _Bad(f"PartitionSpec entry {_show(entry)} names an axis the mesh {names} does not have")
        used += axes
    if len(set(used)) != len(used):
        raise _Bad(f"PartitionSpec {_show(spec)} uses a mesh axis twice")
    return sharding


def _past_rank_nones_dropped(sharding: Any, ndim: int) -> Any:
    """A leaf's recorded sharding without None entries past the array's rank.

    Saves before issue 25 recorded the spec as JAX held it, trailing None entries past the rank
    included (P(None) on a 0-d array, which JAX accepts): they split nothing and the data of such
    a checkpoint is whole, so they are dropped rather than refusing every leaf of it. Saves now
    never write them. An entry past the rank that names axes is left for check_sharding to refuse."""
    if not isinstance(sharding, dict) or sharding.get("kind") != "named":
        return sharding
    spec = sharding.get("spec")
    if not isinstance(spec, list) or len(spec) <= ndim or any(e is not None for e in spec[ndim:]):
        return sharding
    return {**sharding, "spec": spec[:ndim]}


def _check_stacked(storage: dict, shape: tuple[int, ...], logical: str, stacks: list[Stack]) -> StackedStorage:
    s, k = storage.get("stack"), storage.get("index")
    if not _is_int(s) or not 0 <= s < len(stacks):
        raise _Bad(f"stack {_show(s)} is not one of the manifest's {len(stacks)} stacks")
    stack = stacks[s]
    if not _is_int(k) or not 0 <= k < stack.shape[0]:
        raise _Bad(f"index {_show(k)} is not one of the {stack.shape[0]} members of stack {s}")
    if stack.shape[1:] != shape or stack.dtype != logical:
        raise _Bad(f"stack {s} holds {stack.dtype}{list(stack.shape[1:])}, not {logical}{list(shape)}")
    return StackedStorage(s, k, stack)


def _check_stacks(stacks: Any, version: int, packed: bool = False) -> list[Stack]:
    """The manifest's stacks (format version 2, SPEC section 7.1): Zarr arrays whose first
    dimension indexes same-shaped members and whose chunks split only that dimension."""
    if stacks is None or version < STACKS_VERSION:
        return []  # an unknown key of an older version: ignored (SPEC section 11)
    if not isinstance(stacks, list):
        raise _Bad("'stacks' is not a list")
    out = []
    for i, st in enumerate(stacks):
        try:
            if not isinstance(st, dict):
                raise _Bad("is not a map")
            shape, dtype = _sizes(st.get("shape"), "shape", positive=True), st.get("dtype")
            if not shape:
                raise _Bad("shape [] has no member dimension")
            if not isinstance(dtype, str) or dtype not in STORABLE:
                raise _Bad(f"dtype {_show(dtype)} is not one of the dtypes jax-ckpt writes")
            if math.prod(shape) * dtype_from_name(dtype).itemsize > MAX_ARRAY_BYTES:
                raise _Bad(f"shape {list(shape)} of {dtype} is larger than {MAX_ARRAY_BYTES} bytes")
            zarr = _check_storage({**st, "type": "zarr"}, shape, dtype, packed=packed)
            if zarr.chunk_shape[1:] != shape[1:]:
                raise _Bad(f"chunk_shape {list(zarr.chunk_shape)} splits a member (shape {list(shape[1:])})")
        except _Bad as e:
            raise _Bad(f"stack {i}: {e}") from None
        out.append(Stack(shape, dtype, zarr))
    return out


def _check_storage(storage: Any, shape: tuple[int, ...], logical: str,
                   stacks: list[Stack] = (), packed: bool = False) -> InlineStorage | ZarrStorage | StackedStorage:
    storage_dtype, encoding = storage_of(dtype_from_name(logical))
    if isinstance(storage, dict) and storage.get("type") == "stacked" and stacks:
        return _check_stacked(storage, shape, logical, stacks)
    if not isinstance(storage, dict) or storage.get("type") not in ("inline", "zarr"):
        raise _Bad("storage is neither 'inline' nor 'zarr'" + (" nor 'stacked'" if stacks else ""))
    if storage["type"] == "inline":
        data, want = storage.get("data"), math.prod(shape) * storage_dtype.itemsize
        if not isinstance(data, bytes) or len(data) != want:
            got = len(data) if isinstance(data, bytes) else type(data).__name__
            raise _Bad(f"inline data has {got} bytes, expected {want}")
        return InlineStorage(data)
    path = check_storage_path(storage.get("path"))
    chunk_shape = _sizes(storage.get("chunk_shape"), "chunk_shape", positive=True)
    if len(chunk_shape) != len(shape) or any(c > max(n, 1) for c, n in zip(chunk_shape, shape)):
        raise _Bad(f"chunk_shape {_show(storage.get('chunk_shape'))} does not fit shape {list(shape)}")
    if storage.get("data_type") != storage_dtype.name or storage.get("encoding") != encoding:
        raise _Bad(
            f"data_type {_show(storage.get('data_type'))} / encoding {_show(storage.get('encoding'))} do not match "
            f"dtype {logical} (expected {storage_dtype.name} / {encoding})"
        )
    if storage.get("checksum") != "crc32c":
        raise _Bad(f"unknown checksum algorithm {_show(storage.get('checksum'))}")
    sums, want = storage.get("chunk_checksums"), math.prod(chunk_grid(shape, chunk_shape))
    if packed:  # (version 3: the checksums are in the index objects, SPEC section 13)
        want = 0
    if not isinstance(sums, list) or len(sums) != want or not all(_is_int(s) and 0 <= s < 2**32 for s in sums):
        got = len(sums) if isinstance(sums, list) else type(sums).__name__
        raise _Bad(f"chunk_checksums has {got} entries, expected {want} 32-bit values")
    writer = storage.get("writer") if packed else None
    if writer is not None and not (_is_int(writer) and writer >= 0):
        raise _Bad(f"writer {_show(writer)} is not a process index")
    places = _check_places(storage.get("places"), math.prod(chunk_grid(shape, chunk_shape)),
                           math.prod(chunk_shape) * storage_dtype.itemsize) if packed else ()
    return ZarrStorage(path, chunk_shape, storage_dtype.name, encoding, "crc32c", tuple(sums), writer, places)


# Version 3 (SPEC 13.2): chunk offsets in data objects, and how large a data object may be (an
# offset and length are unsigned 64-bit in an index; a reader's seek takes a signed 64-bit one).
PLACE_ALIGN, PLACE_SMALL_ALIGN = 4096, 64
MAX_OBJECT_BYTES = 1 << 62


def _check_places(places: Any, chunks: int, chunk_bytes: int) -> tuple:
    """Version 3: the places of an array's chunks recorded in the manifest, or ()."""
    if places is None:
        return ()
    if not isinstance(places, list) or len(places) != chunks:
        raise _Bad(f"places has {len(places) if isinstance(places, list) else _show(places)} entries, "
                   f"expected one per chunk ({chunks})")
    out = []
    # (SPEC 13.2: a chunk of at least ALIGN bytes at a multiple of ALIGN, a smaller one of 64)
    step = PLACE_ALIGN if chunk_bytes >= PLACE_ALIGN else PLACE_SMALL_ALIGN
    for p in places:
        if not (isinstance(p, list) and len(p) == 4 and isinstance(p[0], str) and all(_is_int(x) for x in p[1:])
                and 0 <= p[1] < MAX_OBJECT_BYTES - chunk_bytes and p[1] % step == 0 and p[2] == chunk_bytes
                and 0 <= p[3] < 2**32):
            raise _Bad(f"place {_show(p)} is not [data object, offset (a multiple of {step} that the chunk "
                       f"ends within {MAX_OBJECT_BYTES} bytes), {chunk_bytes}, CRC-32C]")
        check_storage_path(p[0], "data object")
        out.append((p[0], p[1], p[2], p[3]))
    return tuple(out)


def _check_leaf(rec: Any, tree_path: str, stacks: list[Stack] = (), seen: list | None = None,
                packed: bool = False) -> LeafRecord:
    """`rec` checked and typed; `seen`: [(sharding as recorded, rank), checked sharding] of the
    leaf checked before, updated here (a whole manifest is checked with one)."""
    if not isinstance(rec, dict):
        raise _Bad("is not a map")
    path, kind = rec.get("path"), rec.get("kind")
    if not isinstance(path, str):
        raise _Bad("'path' is not a string")
    if path != tree_path:
        raise _Bad(f"'path' is {path!r} but the tree puts this leaf at {tree_path!r}")
    if kind in VALUE_KINDS:
        if "value" not in rec:
            raise _Bad("has no 'value'")
        return LeafRecord(path, kind, value=_check_value(kind, rec["value"]))
    if kind not in ARRAY_KINDS:
        raise _Bad(f"unknown kind {_show(kind)}")
    shape = _sizes(rec.get("shape"), "shape", positive=False)
    dtype = rec.get("dtype")
    if not isinstance(dtype, str) or dtype not in STORABLE:
        raise _Bad(f"dtype {_show(dtype)} is not one of the dtypes jax-ckpt writes")
    itemsize = dtype_from_name(dtype).itemsize
    if math.prod(max(n, 1) for n in shape) * itemsize > MAX_ARRAY_BYTES:
        raise _Bad(f"shape {list(shape)} of {dtype} is larger than {MAX_ARRAY_BYTES} bytes")
    logical_ndim, impl = len(shape), rec.get("prng_impl")
    if kind == PRNG_KEY:
        trailing = PRNG_IMPLS.get(impl) if isinstance(impl, str) else None
        if trailing is None:
            raise _Bad(f"prng_impl {_show(impl)} is not one of {sorted(PRNG_IMPLS)}")
        if dtype != "uint32" or shape[len(shape) - len(trailing):] != trailing or len(shape) < len(trailing):
            raise _Bad(f"key data {dtype}{list(shape)} does not fit prng_impl {impl!r} (uint32, trailing {list(trailing)})")
        logical_ndim -= len(trailing)
    else:
        impl = None
    if kind == NUMPY_SCALAR and shape != ():
        raise _Bad(f"a numpy.scalar has shape {list(shape)}, not []")
    raw = rec.get("sharding")
    if seen is not None and seen[0] == (raw, logical_ndim):
        sharding = seen[1]  # (most leaves repeat the sharding of the one before: checked once)
    else:
        sharding = check_sharding(_past_rank_nones_dropped(raw, logical_ndim), logical_ndim)
        if seen is not None:
            seen[:] = [(raw, logical_ndim), sharding]
    if sharding is None and kind in (JAX_ARRAY, PRNG_KEY):
        raise _Bad(f"a {kind} leaf has no sharding")
    storage = _check_storage(rec.get("storage"), shape, dtype, stacks, packed)
    return LeafRecord(path, kind, shape, dtype, sharding, storage, None, impl)


def _check_chunk_claims(leaves: list[LeafRecord], stacks: list[Stack], layout: Any) -> None:
    """Version 3: the chunks of arrays without `places` have records in the index objects (36
    bytes each), so there are at most as many as the index sizes the manifest records can hold;
    a claim of more (an array of 2**40 chunks) is refused before anything is planned from it."""
    records = sum(ref.size for ref in layout.indexes) // 36
    arrays = [(f"leaf {l.path!r}", l.shape, l.zarr) for l in leaves if l.zarr is not None]
    arrays += [(f"stack {i}", s.shape, s.zarr) for i, s in enumerate(stacks)]
    total = 0
    for where, shape, st in arrays:
        if not st.places:
            total += math.prod(chunk_grid(shape, st.chunk_shape))
            if total > records:
                raise _Bad(f"{where}: the arrays up to this one have {total} chunks without places in the "
                           f"manifest, more than the {records} records the index objects it names can hold")


def _check_packed_refs(leaves: list[LeafRecord], stacks: list[Stack], layout: Any) -> None:
    """Version 3: every `writer` is one of the save's processes, every `mesh_processes` one of the
    manifest's meshes, of the sharding's axis sizes."""
    processes = len(layout.indexes)
    _check_chunk_claims(leaves, stacks, layout)
    for where, st in [(f"leaf {l.path!r}", l.zarr) for l in leaves if l.zarr is not None] + \
                     [(f"stack {i}", s.zarr) for i, s in enumerate(stacks)]:
        if st.writer is not None and st.writer >= processes:
            raise _Bad(f"{where}: writer {st.writer} is not one of the save's {processes} processes")
    for l in leaves:
        sh = l.sharding
        if not sh or sh.get("kind") != "named" or "mesh_processes" not in sh:
            continue
        m = sh["mesh_processes"]
        if not _is_int(m) or not 0 <= m < len(layout.meshes):
            raise _Bad(f"leaf {l.path!r}: mesh_processes {_show(m)} is not one of the manifest's "
                       f"{len(layout.meshes)} meshes")
        if tuple(layout.meshes[m][0]) != tuple(sh["mesh"]["axis_sizes"]):
            raise _Bad(f"leaf {l.path!r}: mesh {m} has axis sizes {list(layout.meshes[m][0])}, "
                       f"its sharding {list(sh['mesh']['axis_sizes'])}")


def _check_layout(leaves: list[LeafRecord], zarr_json: Any, stacks: list[Stack] = ()) -> dict[str, int] | None:
    """No array's directory is another's or inside another's; no stack member is two leaves;
    the recorded zarr.json checksums (when the manifest has them) name valid files and cover
    every array."""
    arrays = [(l.zarr.path, l.path) for l in leaves if l.zarr is not None]
    arrays += [(st.zarr.path, f"<stack {i}>") for i, st in enumerate(stacks)]
    members: dict[tuple[int, int], str] = {}
    for l in leaves:
        if l.stacked is not None:
            key = (l.stacked.stack, l.stacked.index)
            if key in members:
                raise _Bad(f"leaves {members[key]!r} and {l.path!r} are both member {key[1]} of stack {key[0]}")
            members[key] = l.path
    owner: dict[str, str] = {}
    for path, leaf in arrays:
        if path in owner:
            raise _Bad(f"leaves {owner[path]!r} and {leaf!r} share the storage directory {path!r}")
        owner[path] = leaf
    for path, leaf in arrays:
        parts = path.split("/")
        for k in range(1, len(parts)):
            above = "/".join(parts[:k])
            if above in owner:
                raise _Bad(f"leaf {leaf!r} is stored inside the directory of leaf {owner[above]!r} ({above!r})")
    if zarr_json is None:
        return None
    if not isinstance(zarr_json, dict):
        raise _Bad("zarr_json_crc32c is not a map")
    for key, crc in zarr_json.items():
        if not isinstance(key, str) or not (key == "zarr.json" or key.endswith("/zarr.json")) \
                or not _is_int(crc) or not 0 <= crc < 2**32:
            raise _Bad(f"zarr_json_crc32c entry {_show(key)}: {_show(crc)} is not a zarr.json file's 32-bit CRC")
        if key != "zarr.json":
            check_storage_path(key[: -len("/zarr.json")], "zarr_json_crc32c key")
    for path, leaf in arrays:
        if f"{path}/zarr.json" not in zarr_json:
            raise _Bad(f"zarr_json_crc32c has no checksum for {path}/zarr.json (leaf {leaf!r})")
    return dict(zarr_json)


def manifest_from_doc(doc: Any, where: str) -> Manifest:
    """The typed Manifest of a decoded manifest document, or CheckpointError naming the field
    that breaks the format (`where`: the manifest file, for messages)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{where}: not a {FORMAT_NAME} manifest")
    version = doc.get("format_version")
    if not _is_int(version) or version < 1:
        raise CheckpointError(f"{where}: manifest has an invalid format_version {_show(version)}")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: checkpoint format_version {version} is newer than this jax-ckpt reads "
            f"(up to {FORMAT_VERSION}); upgrade jax-ckpt to a release that reads format version {version}"
        )
    try:
        leaves_doc = doc.get("leaves")
        if not isinstance(leaves_doc, list):
            raise _Bad("'leaves' is not a list")
        if "tree" not in doc:
            raise _Bad("'tree' is missing")
        user_metadata, created = doc.get("user_metadata"), doc.get("created", 0.0)
        if user_metadata is not None and not isinstance(user_metadata, dict):
            raise _Bad("user_metadata is neither nil nor a map")
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not 0 <= created <= LATEST_CREATED:
            raise _Bad(f"created {_show(created)} is not a time in seconds since the epoch")
        library_version = doc.get("library_version", "")
        if not isinstance(library_version, str):
            raise _Bad(f"library_version {_show(library_version)} is not a string")
        paths = check_tree(doc["tree"], len(leaves_doc))
        packed = version >= PACKED_VERSION and doc.get("packed") is not None
        stacks = _check_stacks(doc.get("stacks"), version, packed)
    except _Bad as e:
        raise CheckpointError(f"{where}: manifest is corrupted: {e}") from None
    layout = None
    if packed:
        from ckpt._format.packed import packed_section_check

        layout = packed_section_check(doc["packed"], where)
    leaves, seen = [], [None, None]
    for i, rec in enumerate(leaves_doc):
        try:
            leaves.append(_check_leaf(rec, paths[i], stacks, seen, packed))
        except _Bad as e:
            raise CheckpointError(f"{where}: manifest is corrupted: leaf {i} ({display_path(paths[i])!r}): {e}") from None
    try:
        zarr_json = _check_layout(leaves, None if packed else doc.get("zarr_json_crc32c"), stacks)
        if packed:
            _check_packed_refs(leaves, stacks, layout)
    except _Bad as e:
        raise CheckpointError(f"{where}: manifest is corrupted: {e}") from None
    return Manifest(doc["tree"], leaves, user_metadata=user_metadata, created=float(created),
                    format_version=version, library_version=library_version, zarr_json=zarr_json,
                    stacks=stacks, packed=doc["packed"] if packed else None, layout=layout)


# ---- reading a manifest ---------------------------------------------------------------

# A manifest holds one record per leaf plus arrays of at most INLINE_LIMIT bytes; nothing a
# real tree produces comes near this, and nothing larger is ever read.
MANIFEST_LIMIT_BYTES = 1 << 30


def unpack_map_keys(data: bytes) -> object:
    """msgpack `data` as Python values, maps in their stored order; a map key stored as an
    array (a tuple key of the user metadata) comes back as a tuple, where msgpack's default
    would make it an unhashable list and fail. The default decoder runs first: only data that
    holds such a key pays for the Python hook."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except TypeError:  # unhashable type: 'list' (an array as a map key)
        return msgpack.unpackb(data, raw=False, strict_map_key=False,
                               object_pairs_hook=lambda pairs: {_hashable(k): v for k, v in pairs})


def _hashable(key: object) -> object:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def decode_manifest(data: bytes, where: str) -> Manifest:
    """The validated manifest in `data` (the bytes of `where`, a manifest file); raises
    CheckpointError naming the file when it is damaged or breaks the format."""
    try:
        doc = unpack_map_keys(data)
    except Exception as e:  # any malformed input: msgpack raises several kinds
        raise CheckpointError(f"{where}: manifest is corrupted ({type(e).__name__}: {e})") from None
    # Format and version first: a newer version may protect itself differently.
    if isinstance(doc, dict) and doc.get("format") == FORMAT_NAME and isinstance(doc.get("format_version"), int) \
            and not isinstance(doc.get("format_version"), bool) and 1 <= doc["format_version"] <= FORMAT_VERSION:
        check_seal(data, doc, where)
    return manifest_from_doc(doc, where)


def check_manifest(manifest: Manifest, where: str) -> Manifest:
    """The manifest as a reader would get it back from its encoding (validated and typed)."""
    return decode_manifest(manifest.encode(), where)


class Location(Protocol):
    """What reading a manifest needs of a location (``ckpt.storage.Storage`` is one): this layer
    does no I/O of its own."""

    url: str
    resolved_name: str

    def get(self, key: str, *, max_bytes: int) -> bytes: ...
    def where(self, key: str) -> str: ...
    def exists(self, key: str) -> bool: ...


def find_manifest(storage: Location) -> Manifest | None:
    """The manifest of the committed checkpoint at `storage` (checked against its own checksum and
    validated), or None where there is no manifest object (nothing there, a plain file, a
    directory without one): one GET, the first request of every restore. A ``.tmp-`` directory
    is refused whatever it holds (also when reached through a link)."""
    if is_temp_name(storage.url.rstrip("/").rsplit("/", 1)[-1]) or is_temp_name(storage.resolved_name):
        raise CheckpointError(
            f"{storage.url} is not a committed checkpoint: it is the temporary directory of a save that never committed"
        )
    try:
        data = storage.get(MANIFEST_NAME, max_bytes=MANIFEST_LIMIT_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except IsADirectoryError:
        raise CheckpointError(f"{storage.where(MANIFEST_NAME)} is not a file") from None
    return decode_manifest(data, storage.where(MANIFEST_NAME))


def read_manifest(storage: Location) -> Manifest:
    """``find_manifest``, with the error readers expect where there is no manifest: nothing at
    the location (FileNotFoundError), a file, or a directory a save never committed."""
    manifest = find_manifest(storage)
    if manifest is not None:
        return manifest
    try:
        storage.get(MANIFEST_NAME, max_bytes=MANIFEST_LIMIT_BYTES)
    except NotADirectoryError:
        raise CheckpointError(f"{storage.url} is not a checkpoint directory") from None
    except FileNotFoundError:
        pass
    if not storage.exists(""):
        raise FileNotFoundError(errno.ENOENT, "no checkpoint at this path", storage.url)
    if not _holds_save_files(storage):
        # A folder of other files (the wording of `ckpt ls`): nothing suggests a save was here.
        raise CheckpointError(f"{storage.url} is neither a checkpoint (no {MANIFEST_NAME}) nor a manager directory "
                              "(no step entries: step_<n>, <n>, <prefix>_<n>)")
    raise CheckpointError(
        f"{storage.url} is not a committed checkpoint: it has no {MANIFEST_NAME}; a save may not have committed"
    )


def _holds_save_files(storage: Location) -> bool:
    """Whether `storage` may hold a save that did not commit: generation prefixes (object
    stores), the root group's zarr.json, the library's '~' directories (~data, ~index, ~stacks),
    hidden records (owner, lease), entries named as steps, or nothing at all. True where it
    cannot be listed (the message then stays the cautious one)."""
    list_dir = getattr(storage, "list_dir", None)
    if list_dir is None:
        return True
    try:
        files, dirs = list_dir("")
    except Exception:  # noqa: BLE001 (any failure: keep the cautious message)
        return True
    return (not (files or dirs) or any(d.startswith((GENERATION_MARK, ".", "~")) or _STEP_LIKE.match(d) for d in dirs)
            or any(f == "zarr.json" or f.startswith(".") for f in files))


# Names of step entries (jax-ckpt's and Orbax's, committed or being written): step_00000100, 100,
# checkpoint_100, with a temporary suffix.
_STEP_LIKE = re.compile(r"^(?:.+_)?\d+(?:\..*)?$")
