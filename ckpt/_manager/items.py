"""Named items of a manager step (``state``, ``data_iterator``, ``config``...).

A step saved as ``save(step, {"state": ..., "data_iterator": ...})`` is one checkpoint whose
top-level keys are the items, committed by one manifest (so all items of a step commit together,
or none). Restoring one item is a partial restore of that subtree: only the chunks its arrays
need are read (small arrays packed in a stack share a chunk with their neighbours, which may
belong to another item). In an Orbax step the items are ``<step>/<item>/`` checkpoints of their
own, restored as such.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.tree_util as jtu

from ckpt._errors import CheckpointError
from ckpt._format import child_names, join_path, leaf_components, match_target, read_manifest, unflatten
from ckpt._orbax import kind_of
from ckpt._restore import check_axis_names, wants_for_mesh
from ckpt._restore import restore as _restore
from ckpt.storage import Storage


class _AsSaved:
    """A target leaf that restores a leaf as a restore without target would (a pytree leaf)."""

    __slots__ = ()


_AS_SAVED = _AsSaved()


def item_names(storage: Storage) -> list[str]:
    """The top-level keys of the checkpoint at `storage` (its items)."""
    tree = read_manifest(storage).tree
    return child_names(tree) if tree.get("children") else []


def _saved_keys(root: dict) -> list:
    """The top-level keys of a tree encoding as the restored tree has them (integers stay
    integers), for errors."""
    keys = root.get("keys")
    if keys is None:
        return list(range(len(root.get("children", []))))
    return [k[1] if isinstance(k, list) else k for k in keys]


def _placeholders(manifest, mine: list[int], mesh: jax.sharding.Mesh | None, allow_lossy_cast: bool,
                  axis_names: dict[str, str] | None) -> list[Any]:
    """What each leaf of the item is restored as: with `mesh`, the sharding restore(mesh=) gives
    it (checked as restore(mesh=) checks it, over the item's leaves); else as saved."""
    if mesh is None:
        return [_AS_SAVED] * len(mine)
    wants = wants_for_mesh([(i, manifest.leaves[i]) for i in mine], mesh, allow_lossy_cast, axis_names)
    return [w.sharding if w is not None and w.sharding is not None else _AS_SAVED for w in wants]


def restore_item(storage: Storage, item: str, target: Any, *, orbax: bool, mesh, partial: bool, verify: bool,
                 options, allow_lossy_cast: bool = False, axis_names: dict[str, str] | None = None) -> Any:
    """Restore item `item` of the step at `storage` alone (module docstring): a top-level key of
    the saved tree, a string or an integer (``nnx.state((model, optimizer))`` has keys 0 and 1;
    a list or tuple, indices), matched as leaf paths are, by its text."""
    if isinstance(item, bool) or not isinstance(item, (str, int)):
        raise TypeError(f"item must be a top-level key of the saved tree (a string or an integer), "
                        f"got {type(item).__name__}")
    if orbax:
        location = storage.child(str(item))
        if not location.exists(""):
            raise KeyError(f"{storage.url} has no item {item!r}")
        if kind_of(location) == "item":  # a PyTree item: read alone
            return _restore(location, target, mesh=mesh, partial=partial, verify=verify, options=options,
                            allow_lossy_cast=allow_lossy_cast, axis_names=axis_names)
        for name in ("metadata", item):  # a JsonSave item (Orbax's own metrics item names its file `metrics`)
            if location.exists(name):
                try:
                    return json.loads(location.get(name, max_bytes=16 << 20))
                except ValueError as e:
                    raise CheckpointError(f"{location.where(name)}: not a JSON item: {e}") from None
        wanted = None if target is None else {item: target}
        return _restore(storage, wanted, mesh=mesh, partial=target is not None, verify=verify, options=options,
                        allow_lossy_cast=allow_lossy_cast, axis_names=axis_names)[item]
    if target is not None and mesh is not None:
        raise ValueError("pass either target or mesh, not both")
    check_axis_names(axis_names, mesh)
    manifest = read_manifest(storage)
    root = manifest.tree
    names = child_names(root) if root.get("children") else []
    if str(item) not in names:
        raise KeyError(f"{storage.url} has no item {item!r}; its items: {_saved_keys(root)}")
    node = root["children"][names.index(str(item))]
    comps = leaf_components(root)
    mine = [i for i, c in enumerate(comps) if c[0] == str(item)]
    values: list[Any] = [None] * len(comps)
    if target is not None:
        if not partial:  # the item must match the target exactly, as a whole restore would
            match_target(target, [join_path(comps[i][1:]) for i in mine], partial=False)
        return _restore(storage, {item: target}, partial=True, verify=verify, options=options,
                        allow_lossy_cast=allow_lossy_cast)[item]
    if mine:
        wanted: dict = {}
        for i, placeholder in zip(mine, _placeholders(manifest, mine, mesh, allow_lossy_cast, axis_names)):
            *parents, last = comps[i]
            at = wanted
            for p in parents:
                at = at.setdefault(p, {})
            at[last] = placeholder
        got = _restore(storage, wanted, partial=True, verify=verify, options=options,
                        allow_lossy_cast=allow_lossy_cast)
        paths, treedef = jtu.tree_flatten_with_path(wanted)
        index = {join_path(c): i for i, c in enumerate(comps)}
        for (path, _), value in zip(paths, treedef.flatten_up_to(got)):
            values[index[join_path([str(e.key) for e in path])]] = value
    return unflatten(node, values)
