"""Orbax checkpoints (orbax-checkpoint 0.11 and 0.12), read without Orbax: the layout, parsed as
untrusted input into the records restore and metadata work with (docs/migrating-from-orbax.md).

What Orbax writes (all JSON but the arrays):

* a PyTree item (``StandardSave`` / ``PyTreeSave``), ``<item>/``:
  ``_METADATA``: ``tree_metadata``: ``{"('a', '0')": {"key_metadata": [{"key": "a", "key_type": 2},
  {"key": "0", "key_type": 1}], "value_metadata": {"value_type": "jax.Array" | "np.ndarray" |
  "scalar" | "string" | "None" | "Dict" | "List" | "Tuple" | "NamedTuple", "skip_deserialize": ...,
  "write_shape": [...]}}}`` (key_type 1: a sequence position, 2: a dict key or attribute), plus
  ``use_ocdbt`` (absent before 0.11.x: then ``manifest.ocdbt`` tells), ``use_zarr3``,
  ``store_array_data_equal_to_fill_value``;
  ``_sharding``: ``{base64(param name): JSON text of the sharding}`` (``NamedSharding`` with mesh
  ``shape``, ``axis_names`` and ``partition_spec``; ``SingleDeviceSharding``);
  ``array_metadatas/process_<i>``: per-array ``ext_metadata``; ``random_key_impl`` marks a typed
  PRNG key array, stored as its key data;
  the arrays, each named by its key path joined with '.' (``opt.0.mu.w``): Zarr v2 (``.zarray``) or
  Zarr v3 (``zarr.json``, sharded) arrays, inside the OCDBT key-value store of the item
  (``manifest.ocdbt``, ``d/``, ``ocdbt.process_<i>/``) or as plain directories;
  ``_strings.json``: string leaves, by param name.
* a step of a CheckpointManager, ``<step>/``: ``_CHECKPOINT_METADATA`` (``item_handlers``: one
  handler class name or ``{item: class name}``; commit timestamp; metrics) and one directory per
  item; a ``JsonSave`` item is ``<item>/metadata``.
* a CheckpointManager directory: steps named ``<n>``, ``<prefix>_<n>`` or zero-padded; a step
  being written is ``<name>.orbax-checkpoint-tmp-<k>``.

Everything here reads small files through ``ckpt.storage`` (``get`` with a size limit); array data
is read by ``ckpt._orbax_read`` through TensorStore.

Size: every version of Orbax's on-disk layout this library reads, in one reader.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

from ckpt._errors import CheckpointError
from ckpt._format import (
    DICT,
    JAX_ARRAY,
    LEAF,
    LIST,
    NONE,
    NUMPY,
    NUMPY_SCALAR,
    PY_BOOL,
    PY_FLOAT,
    PY_INT,
    PY_STR,
    TUPLE,
    LeafRecord,
    display_path,
    join_path,
)
from ckpt._orbax.steps import PYTREE_METADATA, STEP_METADATA, TMP_MARK, _exists, kind_of, scan_orbax_steps
from ckpt.storage import Storage

SHARDING_FILE = "_sharding"
STRINGS_FILE = "_strings.json"
JSON_ITEM_FILE = "metadata"
# Orbax's CheckpointManager keeps a step's metrics as a JSON item of this name, in a file of this
# name: metadata of the step (CheckpointManager.metrics reads it), not part of the saved state.
METRICS_ITEM = "metrics"
OCDBT_MANIFEST = "manifest.ocdbt"

JSON_LIMIT = 256 << 20  # no metadata file of a real checkpoint comes near this; nothing larger is read
_MAX_DEPTH = 200
_ARRAY_TYPES = {"jax.Array": JAX_ARRAY, "np.ndarray": NUMPY, "scalar": NUMPY_SCALAR}
_EMPTY = {"None": NONE, "NamedTuple": NONE, "Dict": DICT, "List": LIST, "Tuple": TUPLE}
_PYTREE_HANDLERS = ("StandardCheckpointHandler", "PyTreeCheckpointHandler")


@dataclass
class Item:
    """One PyTree or JSON item of an Orbax checkpoint."""

    name: str | None  # inside a step; None for a bare item
    storage: Storage
    kind: str  # 'pytree' or 'json'
    use_ocdbt: bool = False
    use_zarr3: bool = False
    fill_value_stored: bool = True  # every chunk was written (store_array_data_equal_to_fill_value)
    key_impls: dict[str, str] = field(default_factory=dict)  # param name -> PRNG impl
    json_file: str = JSON_ITEM_FILE  # the file of a JSON item

    @property
    def layout(self) -> str:
        if self.kind == "json":
            return "JSON"
        return f"{'OCDBT' if self.use_ocdbt else 'per-array directories'}, Zarr v{3 if self.use_zarr3 else 2}"


@dataclass
class OrbaxLeaf:
    """A leaf of an Orbax checkpoint: its record (as a jax-ckpt manifest would hold it, shape and
    dtype filled in once the array is opened) and where its data is."""

    record: LeafRecord
    item: Item | None = None
    components: tuple[str, ...] = ()  # key path, one name per level
    param: str | None = None  # the Orbax param name of an array leaf
    chunk_shape: tuple[int, ...] | None = None  # the stored (write) chunk shape, once opened


@dataclass
class Layout:
    """An Orbax checkpoint: its tree (the manifest's tree encoding) and leaves, not yet opened."""

    url: str
    what: str  # 'item' or 'step'
    items: list[Item]
    tree: dict
    leaves: list[OrbaxLeaf]
    step_metadata: dict | None = None

    def describe(self) -> str:
        names = ", ".join(f"{i.name} ({i.layout})" for i in self.items if i.name) or self.items[0].layout
        kind = "CheckpointManager step" if self.what == "step" else "PyTree checkpoint"
        return f"Orbax {kind} ({names})"


# ---- small files ---------------------------------------------------------------------------


def read_json(storage: Storage, key: str, *, missing_ok: bool = False) -> Any:
    """A JSON file of the checkpoint, size-limited; CheckpointError naming it when it is not JSON."""
    try:
        data = storage.get(key, max_bytes=JSON_LIMIT)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise CheckpointError(f"{storage.where(key)} is missing") from None
    except IsADirectoryError:
        raise CheckpointError(f"{storage.where(key)} is not a file") from None
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{storage.where(key)} is not valid JSON ({str(e)[:200]})") from None


# ---- parsing -------------------------------------------------------------------------------


def _bad(where: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: not a readable Orbax checkpoint: {what}")


def _check_param(name: str, where: str) -> str:
    # Param names become keys (OCDBT) or directories (per-array layout) below the item: no
    # component may leave it.
    parts = name.split("/")
    if not name or any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        raise _bad(where, f"array name {name!r} is not a path inside the checkpoint")
    return name


def _key_impls(item: Item) -> dict[str, str]:
    """param name -> PRNG impl, from array_metadatas/process_* (absent before 0.11.x)."""
    try:
        files, _ = item.storage.list_dir("array_metadatas")
    except (FileNotFoundError, NotADirectoryError):
        return {}
    out: dict[str, str] = {}
    for f in files:
        if not f.startswith("process_"):
            continue
        key = f"array_metadatas/{f}"
        doc = read_json(item.storage, key)
        entries = doc.get("array_metadatas") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            raise _bad(item.storage.where(key), "no 'array_metadatas' list")
        for e in entries:
            meta = e.get("array_metadata") if isinstance(e, dict) else None
            if not isinstance(meta, dict) or not isinstance(meta.get("param_name"), str):
                raise _bad(item.storage.where(key), "an entry has no 'param_name'")
            ext = meta.get("ext_metadata")
            impl = ext.get("random_key_impl") if isinstance(ext, dict) else None
            if impl is not None:
                if not isinstance(impl, str):
                    raise _bad(item.storage.where(key), f"random_key_impl {impl!r} is not a name")
                out[meta["param_name"]] = impl
    return out


def _sharding_record(text: Any, where: str) -> dict:
    """A manifest sharding record from Orbax's sharding JSON text (kind 'other' when it has no
    mesh and PartitionSpec this library understands)."""
    try:
        doc = json.loads(text) if isinstance(text, str) and len(text) < (1 << 20) else None
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        raise _bad(where, "a _sharding entry is not a JSON object")
    kind = doc.get("sharding_type")
    if kind == "SingleDeviceSharding":
        return {"kind": "single_device"}
    if kind != "NamedSharding":
        return {"kind": "other"}
    names, sizes, spec = doc.get("axis_names"), doc.get("shape"), doc.get("partition_spec")
    ok = (isinstance(names, list) and all(isinstance(n, str) for n in names) and len(set(names)) == len(names)
          and isinstance(sizes, list) and len(sizes) == len(names)
          and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)
          and isinstance(spec, list))
    entries = []
    for e in spec if ok else []:
        axes = [] if e is None else [e] if isinstance(e, str) else e
        if not isinstance(axes, list) or not all(isinstance(a, str) and a in names for a in axes):
            ok = False
            break
        entries.append(None if not axes else axes[0] if len(axes) == 1 else list(axes))
    used = [a for e in entries if e is not None for a in ([e] if isinstance(e, str) else e)]
    if not ok or len(used) != len(set(used)):
        return {"kind": "other"}
    return {"kind": "named", "mesh": {"axis_names": names, "axis_sizes": sizes}, "spec": entries}


class _Node:
    """A tree node while building: children by key, in first-seen order."""

    def __init__(self) -> None:
        self.children: dict[str, Any] = {}
        self.key_type: int | None = None


def _insert(root: _Node, keys: list, value: Any, where: str) -> None:
    node = root
    for depth, entry in enumerate(keys):
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str) or entry.get("key_type") not in (1, 2):
            raise _bad(where, f"a key_metadata entry {str(entry)[:80]} is not {{'key': str, 'key_type': 1 or 2}}")
        if node.key_type not in (None, entry["key_type"]):
            raise _bad(where, f"keys of one node are both sequence positions and names (at {entry['key']!r})")
        node.key_type = entry["key_type"]
        name = entry["key"]
        last = depth == len(keys) - 1
        child = node.children.get(name)
        if last:
            if child is not None:
                raise _bad(where, f"two leaves share the key path {'/'.join(k['key'] for k in keys)!r}")
            node.children[name] = value
        else:
            if child is None or not isinstance(child, _Node):
                child = node.children[name] = _Node()  # (an empty-container placeholder is replaced)
            node = child


def _encode(node: Any, leaves: list, components: tuple[str, ...], where: str) -> dict:
    """The manifest tree encoding of a built node; leaves appended in tree order."""
    if isinstance(node, OrbaxLeaf):
        node.record.path, node.components = join_path(components), components
        leaves.append(node)
        return {"kind": LEAF, "index": len(leaves) - 1}
    if isinstance(node, str):  # an empty value's type
        kind = _EMPTY[node]
        return {"kind": NONE} if kind == NONE else {"kind": kind, "children": [], **({"keys": []} if kind == DICT else {})}
    if len(components) > _MAX_DEPTH:
        raise _bad(where, f"the tree is deeper than {_MAX_DEPTH} levels")
    names = list(node.children)
    if node.key_type == 1:
        try:
            order = sorted(names, key=int)
        except ValueError:
            raise _bad(where, f"sequence positions {names[:5]} are not numbers") from None
        if [int(n) for n in order] != list(range(len(order))):
            raise _bad(where, f"sequence positions {sorted(map(int, names))[:8]} are not 0..{len(order) - 1}")
        return {"kind": LIST, "children": [_encode(node.children[n], leaves, components + (n,), where) for n in order]}
    return {"kind": DICT, "keys": names,
            "children": [_encode(node.children[n], leaves, components + (n,), where) for n in names]}


def _pytree_item(item: Item) -> _Node | OrbaxLeaf | str:
    where = item.storage.where(PYTREE_METADATA)
    doc = read_json(item.storage, PYTREE_METADATA)
    entries = doc.get("tree_metadata") if isinstance(doc, dict) else None
    if not isinstance(entries, dict):
        raise _bad(where, "no 'tree_metadata' object (a checkpoint older than orbax-checkpoint 0.5 is not read)")
    use_ocdbt = doc.get("use_ocdbt")
    item.use_ocdbt = use_ocdbt if isinstance(use_ocdbt, bool) else _exists(item.storage, OCDBT_MANIFEST)
    item.use_zarr3 = doc.get("use_zarr3") is True
    item.fill_value_stored = doc.get("store_array_data_equal_to_fill_value") is not False
    flat = []
    for text, entry in entries.items():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        value = entry.get("value_metadata") if isinstance(entry, dict) else None
        if not isinstance(keys, list) or not isinstance(value, dict) or not isinstance(value.get("value_type"), str):
            raise _bad(where, f"entry {text[:80]!r} needs 'key_metadata' and 'value_metadata'")
        if len(keys) > _MAX_DEPTH:
            raise _bad(where, f"entry {text[:80]!r} is deeper than {_MAX_DEPTH} levels")
        flat.append((keys, value["value_type"]))
    # As Orbax does: an entry whose key path is a prefix of another's is a placeholder of a
    # container that was filled in later; it is dropped.
    paths = {tuple(k.get("key") if isinstance(k, dict) else None for k in keys) for keys, _ in flat}
    prefixes = {p[:n] for p in paths for n in range(len(p))}
    item.key_impls = _key_impls(item)
    root = _Node()
    sharding = None
    for keys, vtype in flat:
        comps = tuple(k.get("key") if isinstance(k, dict) else None for k in keys)
        if comps in prefixes:
            continue
        if vtype in _EMPTY:
            value: Any = vtype
        elif vtype in _ARRAY_TYPES or vtype == "string":
            if not all(isinstance(c, str) for c in comps):
                raise _bad(where, "a key is not a string")
            param = _check_param(".".join(comps), where)
            rec = LeafRecord(path="", kind=_ARRAY_TYPES.get(vtype, PY_STR))
            if vtype == "jax.Array":
                if sharding is None:
                    sharding = read_json(item.storage, SHARDING_FILE, missing_ok=True) or {}
                    if not isinstance(sharding, dict):
                        raise _bad(item.storage.where(SHARDING_FILE), "not a JSON object")
                text = sharding.get(base64.urlsafe_b64encode(param.encode()).decode())
                rec.sharding = {"kind": "other"} if text is None else _sharding_record(text, item.storage.where(SHARDING_FILE))
                rec.prng_impl = item.key_impls.get(param)
            value = OrbaxLeaf(rec, item, param=param)
        else:
            raise CheckpointError(
                f"{where}: leaf {display_path('/'.join(map(str, comps)))!r} has Orbax value type {vtype!r}, which "
                "only a custom Orbax TypeHandler can read")
        if not comps:
            return value  # the whole item is one leaf
        _insert(root, keys, value, where)
    if any(isinstance(v, OrbaxLeaf) and v.record.kind == PY_STR for v in _walk(root)):
        _fill_strings(item, root)
    return root


def _walk(node: Any):
    if isinstance(node, _Node):
        for child in node.children.values():
            yield from _walk(child)
    else:
        yield node


def _fill_strings(item: Item, root: _Node) -> None:
    doc = read_json(item.storage, STRINGS_FILE)
    for leaf in _walk(root):
        if isinstance(leaf, OrbaxLeaf) and leaf.record.kind == PY_STR:
            value: Any = doc
            for part in leaf.param.split("/"):  # the JSON pointer Orbax wrote it at
                value = value.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(value, dict) else None
            if not isinstance(value, str):
                raise _bad(item.storage.where(STRINGS_FILE), f"no string for {leaf.param!r}")
            leaf.record.value = value


def _json_value(value: Any, where: str, depth: int = 0) -> Any:
    """A JSON item as a tree: dicts and lists as nodes, the rest as value leaves."""
    if depth > _MAX_DEPTH:
        raise _bad(where, f"deeper than {_MAX_DEPTH} levels")
    if isinstance(value, dict):
        node = _Node()
        node.key_type = 2
        for k, v in value.items():
            node.children[k] = _json_value(v, where, depth + 1)
        return node
    if isinstance(value, list):
        node = _Node()
        node.key_type = 1
        for i, v in enumerate(value):
            node.children[str(i)] = _json_value(v, where, depth + 1)
        return node
    if value is None:
        return "None"
    kind = PY_BOOL if isinstance(value, bool) else PY_INT if isinstance(value, int) else \
        PY_FLOAT if isinstance(value, float) else PY_STR
    return OrbaxLeaf(LeafRecord(path="", kind=kind, value=value if kind != PY_INT or -(2**63) <= value < 2**64
                                else str(value)))


def _step_items(storage: Storage, doc: Any) -> list[Item]:
    handlers = doc.get("item_handlers") if isinstance(doc, dict) else None
    _, dirs = storage.list_dir("")
    names = sorted(handlers) if isinstance(handlers, dict) else [d for d in dirs if TMP_MARK not in d]
    items = []
    for name in names:
        handler = handlers.get(name) if isinstance(handlers, dict) else None
        child = storage.child(name)
        if name not in dirs:
            raise CheckpointError(f"{storage.url}: item {name!r} of this Orbax step is missing")
        if _exists(child, PYTREE_METADATA):
            items.append(Item(name, child, "pytree"))
        elif handler is None or "JsonCheckpointHandler" in str(handler):
            file = next((f for f in (JSON_ITEM_FILE, name) if _exists(child, f)), None)
            if file is not None:
                if name != METRICS_ITEM:
                    items.append(Item(name, child, "json", json_file=file))
                continue
            if handler is not None:
                raise CheckpointError(f"{child.url}: JSON item {name!r} of this Orbax step has no "
                                      f"{JSON_ITEM_FILE!r} or {name!r} file")
        elif handler is not None:
            raise CheckpointError(
                f"{child.url}: Orbax item {name!r} was written by {str(handler).rsplit('.', 1)[-1]}, which this "
                f"library does not read (it reads {', '.join(_PYTREE_HANDLERS)} and JsonCheckpointHandler items)")
    if not items:
        raise CheckpointError(f"{storage.url}: this Orbax step holds no item this library reads")
    return items


def read_layout(storage: Storage) -> Layout:
    """The Orbax checkpoint at `storage` (a PyTree item or a CheckpointManager step)."""
    kind = kind_of(storage)
    if kind == "manager":
        steps = [s for s in scan_orbax_steps(storage) if s.finished]
        raise CheckpointError(
            f"{storage.url} is an Orbax CheckpointManager directory (steps {[s.step for s in steps][-8:]}); "
            f"restore one step, e.g. {storage.where(steps[-1].name)}")
    if kind is None:
        raise CheckpointError(f"{storage.url} is not an Orbax checkpoint (no {PYTREE_METADATA} or {STEP_METADATA})")
    step_doc = read_json(storage, STEP_METADATA, missing_ok=True)
    if kind == "item":
        items = [Item(None, storage, "pytree")]
    else:
        items = _step_items(storage, step_doc)
    built = {}
    for item in items:
        where = item.storage.where(item.json_file)
        built[item.name] = _pytree_item(item) if item.kind == "pytree" else \
            _json_value(read_json(item.storage, item.json_file), where)
    if kind == "step" and len(items) == 1 and items[0].name == "default":
        top = built["default"]  # a single-item manager's step: the item itself, as Orbax returns it
    elif kind == "item":
        top = built[None]
    else:
        top = _Node()
        top.key_type = 2
        top.children.update(built)
    leaves: list[OrbaxLeaf] = []
    tree = _encode(top, leaves, (), storage.url)
    seen: set[str] = set()
    for leaf in leaves:  # ('a/b',) and ('a', 'b') would be one path: restore could not tell them apart
        if leaf.record.path in seen:
            raise _bad(storage.url, f"two leaves share the key path {display_path(leaf.record.path)!r}")
        seen.add(leaf.record.path)
    return Layout(storage.url, kind, items, tree, leaves, step_doc if isinstance(step_doc, dict) else None)
