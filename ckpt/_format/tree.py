"""Pytree flattening with key paths, the manifest's encoding of tree structure, and matching a
restore target against the saved tree.

A leaf's *path* is its key path written with '/' (``params/layers/0/wq``): dict keys and
attribute names as text, sequence positions as numbers. Its *storage path* is the same with
each component escaped so that it is a safe, portable directory name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.tree_util as jtu
import numpy as np

from ckpt._errors import CheckpointError, TreeMismatchError

# Node kinds in the manifest's tree encoding (formats/SPEC.md, "tree").
DICT, LIST, TUPLE, NONE, CUSTOM, LEAF = "dict", "list", "tuple", "none", "custom", "leaf"

# Deepest tree a checkpoint may hold: saves refuse deeper trees and readers refuse deeper
# encodings, so the recursive walks below stay far from Python's recursion limit.
MAX_TREE_DEPTH = 256


@dataclass(frozen=True)
class FlatLeaf:
    """One leaf of a flattened tree: its key path components and value."""

    components: tuple[str, ...]
    value: Any

    @property
    def path(self) -> str:
        return join_path(self.components)


def join_path(components: Sequence[str]) -> str:
    return "/".join(components)


def display_path(path: str) -> str:
    return path if path else "<root>"


def _entry_text(entry: Any) -> str:
    if isinstance(entry, jtu.DictKey):
        return str(entry.key)
    if isinstance(entry, jtu.GetAttrKey):
        return entry.name
    if isinstance(entry, jtu.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, jtu.FlattenedIndexKey):
        return str(entry.key)
    return str(entry)


def _entry_record(entry: Any, components: tuple[str, ...]) -> list:
    if isinstance(entry, jtu.DictKey):
        return ["key", _plain_key(entry.key, components)]
    if isinstance(entry, jtu.GetAttrKey):
        return ["attr", entry.name]
    if isinstance(entry, jtu.SequenceKey):
        return ["index", entry.idx]
    if isinstance(entry, jtu.FlattenedIndexKey):
        return ["index", entry.key]
    return ["key", str(entry)]


def _plain_key(key: Any, components: tuple[str, ...]) -> Any:
    """`key`, a dict key of the node at `components`, as the manifest keeps it: strings and
    integers only (msgpack keeps them as themselves). Any other key (a tuple, a bool, an enum)
    would come back as its text, a different tree: refused, naming it."""
    if isinstance(key, (str, int)) and not isinstance(key, bool):
        return key
    raise CheckpointError(
        f"the dict at {display_path(join_path(components))!r} has the key {key!r} ({type(key).__name__}): "
        f"checkpoints keep dict keys that are strings or integers, and it would come back as the string "
        f"{str(key)!r}; use a string key")


# Types that are never pytree nodes (pytree registrations are by exact type): leaves without asking
# jax, which costs a tree_flatten per leaf.
_LEAF_TYPES = frozenset({np.ndarray, int, float, complex, bool, str, bytes})


def _children(node: Any) -> list[tuple[Any, Any]] | None:
    """The (key entry, child) pairs one level down, or None when `node` is a leaf."""
    if type(node) in _LEAF_TYPES or isinstance(node, (jax.Array, np.generic)):
        return None
    pairs, treedef = jtu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # not a registered node
        return None
    return [(path[0], child) for path, child in pairs]


def flatten(tree: Any) -> tuple[dict, list[FlatLeaf]]:
    """Flatten `tree` into (tree encoding for the manifest, leaves in key-path order)."""
    leaves: list[FlatLeaf] = []

    def encode(node: Any, components: tuple[str, ...]) -> dict:
        if len(components) > MAX_TREE_DEPTH:
            raise CheckpointError(f"the tree is nested more than {MAX_TREE_DEPTH} levels deep; "
                                  "checkpoints hold trees of at most that depth")
        if node is None:
            return {"kind": NONE}
        children = _children(node)
        if children is None:
            leaves.append(FlatLeaf(components, node))
            return {"kind": LEAF, "index": len(leaves) - 1}
        encoded = [encode(child, components + (_entry_text(e),)) for e, child in children]
        t = type(node)
        if t is dict:
            return {"kind": DICT, "keys": [_plain_key(e.key, components) for e, _ in children], "children": encoded}
        if t is list:
            return {"kind": LIST, "children": encoded}
        if t is tuple:
            return {"kind": TUPLE, "children": encoded}
        return {
            "kind": CUSTOM,
            "type": f"{t.__module__}.{t.__qualname__}",
            "keys": [_entry_record(e, components) for e, _ in children],
            "children": encoded,
        }

    encoding = encode(tree, ())
    seen: dict[str, int] = {}
    for leaf in leaves:
        if leaf.path in seen:
            raise CheckpointError(f"two leaves share the key path {display_path(leaf.path)!r}")
        seen[leaf.path] = 1
    return encoding, leaves


def unflatten(encoding: dict, values: Sequence[Any]) -> Any:
    """Rebuild a tree from its manifest encoding (validated: ``_manifest_check.check_tree``)
    using plain containers.

    dict/list/tuple/None come back as themselves. Custom nodes (NamedTuples, dataclasses,
    registered classes) come back as a dict keyed by field name, or as a tuple when their
    children are only numbered.
    """

    def build(node: dict) -> Any:
        kind = node["kind"]
        if kind == LEAF:
            return values[node["index"]]
        if kind == NONE:
            return None
        children = [build(c) for c in node.get("children", [])]
        if kind == DICT:
            return dict(zip(node["keys"], children))
        if kind == LIST:
            return children
        if kind == TUPLE:
            return tuple(children)
        if kind == CUSTOM:
            keys = node["keys"]
            if keys == [["attr", "value"]]:  # a box around one value (flax nnx Variable, linen Partitioned)
                return children[0]
            if keys and all(k[0] != "index" for k in keys):
                return {k[1]: c for k, c in zip(keys, children)}
            return tuple(children)
        raise CheckpointError(f"manifest has an unknown tree node kind {kind!r}")

    return build(encoding)


def child_names(node: dict) -> list[str]:
    """Path components of an encoded node's children (as in leaf paths)."""
    kind, children = node["kind"], node.get("children", [])
    if kind == DICT:
        return [str(k) for k in node["keys"]]
    if kind == CUSTOM:
        return [str(k[1]) for k in node["keys"]]
    return [str(i) for i in range(len(children))]


def leaf_components(encoding: dict) -> list[tuple[str, ...]]:
    """Key path components of every leaf of a tree encoding, by leaf index."""
    out: dict[int, tuple[str, ...]] = {}

    def walk(node: dict, comps: tuple[str, ...]) -> None:
        kind = node["kind"]
        if kind == LEAF:
            out[node["index"]] = comps
            return
        for name, child in zip(child_names(node), node.get("children", [])):
            walk(child, comps + (name,))

    walk(encoding, ())
    return [out[i] for i in range(len(out))]


def match_target(
    target: Any, saved_paths: Sequence[str], *, partial: bool
) -> tuple[Any, list[tuple[int, Any]]]:
    """Pair each leaf of `target` with the saved leaf at the same key path.

    Returns (target treedef, [(saved leaf index, target leaf)] in target leaf order). Raises
    TreeMismatchError listing every missing and unexpected key path.
    """
    pairs, treedef = jtu.tree_flatten_with_path(target)
    index = {p: i for i, p in enumerate(saved_paths)}
    target_paths = [join_path([_entry_text(e) for e in path]) for path, _ in pairs]
    unexpected = [display_path(p) for p in target_paths if p not in index]
    wanted = set(target_paths)
    missing = [] if partial else [display_path(p) for p in saved_paths if p not in wanted]
    if unexpected or missing:
        error = TreeMismatchError(missing, unexpected)
        hint = subtree_hint(unexpected, saved_paths)
        if hint:
            error.args = (f"{error.args[0]}\n  {hint}",)
        raise error
    return treedef, [(index[p], leaf) for p, (_, leaf) in zip(target_paths, pairs)]


def subtree_hint(unexpected: list[str], saved_paths: Sequence[str]) -> str | None:
    """Where the key paths a target has and the checkpoint lacks all exist under one saved
    subtree (the model alone, against a checkpoint of model and optimizer state), which subtree
    and how to restore it; else None."""
    if not unexpected or display_path("") in unexpected:
        return None
    saved = set(saved_paths)
    first = unexpected[0]
    prefixes = dict.fromkeys(p[: -len(first) - 1] for p in saved_paths if p.endswith("/" + first))
    found = [p for p in prefixes if all(f"{p}/{u}" in saved for u in unexpected)]
    if not found:
        return None
    parts = found[0].split("/")
    wrapped = "target"
    for part in reversed(parts):
        wrapped = f"{{{part!r}: {wrapped}}}"
    index = "".join(f"[{part!r}]" for part in parts)
    item = f"; from a CheckpointManager step, manager.restore(step, target, item={parts[0]!r})" if len(parts) == 1 else ""
    return (f"the target matches the checkpoint's subtree {' or '.join(repr(p) for p in found[:3])}: restore it "
            f"alone with ckpt.restore(path, {wrapped}, partial=True){index}{item}")


_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.")
_RESERVED = frozenset({"zarr.json", "manifest.msgpack"})


def escape_component(text: str) -> str:
    """A directory name for one path component: [A-Za-z0-9_.-] kept, the rest %-encoded."""
    if text == "":
        return "%"
    out = []
    for i, ch in enumerate(text):
        if ch in _SAFE and not (i == 0 and ch == "."):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    name = "".join(out)
    if name in _RESERVED:
        name = f"%{ord(name[0]):02X}{name[1:]}"
    return name


def storage_paths(components: Sequence[tuple[str, ...]]) -> list[str]:
    """Unique storage paths for leaves, also on case-insensitive file systems.

    A path that would clash with another leaf, or sit inside another leaf's directory, moves to
    a top-level ``~N`` directory ('~' never appears in an escaped name).
    """
    out, leaves, groups = [], set(), set()
    escaped: dict[str, str] = {}  # trees repeat the same few names thousands of times
    for i, comps in enumerate(components):
        for c in comps:
            if c not in escaped:
                escaped[c] = escape_component(c)
        path = "/".join(escaped[c] for c in comps) or "_root"
        low = path.lower().split("/")
        prefixes = {"/".join(low[:k]) for k in range(1, len(low))}
        whole = "/".join(low)
        if whole in leaves or whole in groups or not prefixes.isdisjoint(leaves):
            path, whole, prefixes = f"~{i}", f"~{i}", set()
        leaves.add(whole)
        groups |= prefixes
        out.append(path)
    return out
