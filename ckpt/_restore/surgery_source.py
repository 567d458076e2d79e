"""Model surgery at load time (``restore(rename=...)``): a target's leaves in the user's own
names paired with saved ones (a dict, a function of the saved name, or ordered regex rules), and
the *part* that ``ckpt.surgery``'s building blocks return; errors list the names nothing matches
and those matched twice. A leaf made of parts is a view (view_source.py)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any

import jax.tree_util as jtu

from ckpt._errors import CheckpointError, TreeMismatchError
from ckpt._format import LeafRecord
from ckpt._restore.view_source import Node, bind, view_record

_SHOWN = 8  # names listed in an error; the rest counted


# ---- a part: what ckpt.surgery's building blocks return ---------------------------------------

@dataclass(frozen=True)
class Part:
    """A leaf made of saved leaves: ``op`` over ``sources`` (saved names or other parts)."""

    op: str  # "stack", "unstack", "transpose", "concat", "slice", "reshape"
    sources: tuple[Any, ...]
    axis: int = 0
    arg: Any = None  # unstack: the index; transpose: the axes; slice: (sections, part); reshape: the shape


# ---- names: the target's leaves and what each is made of ----------------------------------

def _entry_text(entry: Any) -> str:
    for kind, attr in ((jtu.DictKey, "key"), (jtu.GetAttrKey, "name"), (jtu.SequenceKey, "idx"),
                       (jtu.FlattenedIndexKey, "key")):
        if isinstance(entry, kind):
            return str(getattr(entry, attr))
    return str(entry)


def target_names(target: Any) -> tuple[Any, list[tuple[str, str, Any]]]:
    """(treedef, [(key path as restore matches it, dot name, leaf)])."""
    pairs, treedef = jtu.tree_flatten_with_path(target)
    out = []
    for path, leaf in pairs:
        comps = [_entry_text(e) for e in path]
        out.append(("/".join(comps), ".".join(comps), leaf))
    return treedef, out


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(map(repr, names[:_SHOWN])) + more


def check_rename(rename: Any) -> None:
    """TypeError unless `rename` is a mapping, a function or a list of (pattern, replacement)."""
    if rename is None or callable(rename) or isinstance(rename, Mapping):
        return
    if isinstance(rename, (list, tuple)) and all(isinstance(r, (list, tuple)) and len(r) == 2 for r in rename):
        for pattern, replacement in rename:
            if not isinstance(replacement, str):
                raise TypeError(f"rename rule {pattern!r}: the replacement must be a str, got {replacement!r}")
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"rename rule {pattern!r}: {e}") from None
        return
    raise TypeError("rename must be a dict {target name: saved name or ckpt.surgery part}, a function of the "
                    f"saved name, or a list of (pattern, replacement) rules; got {type(rename).__name__}")


def _saved_to_target(rename: Any, saved: list[str]) -> dict[str, list[str]]:
    """target name -> the saved names a function or regex rules give it."""
    out: dict[str, list[str]] = {}
    for name in saved:
        if callable(rename):
            new = rename(name)
        else:
            new = name
            for pattern, replacement in rename:
                new = re.sub(pattern, replacement, new)
        if new is not None and new != "":
            if not isinstance(new, str):
                raise CheckpointError(f"saved leaf {name!r}: rename gave {new!r}, which is not a name")
            out.setdefault(new, []).append(name)
    return out


def sources_of(rename: Any, names: list[str], saved: list[str]) -> list[Any]:
    """What each target leaf (dot `names`) is made of: a saved name or a Part. TreeMismatchError
    listing the target names nothing matches, those matched twice, and the saved names a part
    asks for that the checkpoint lacks."""
    have = set(saved)
    if isinstance(rename, Mapping):
        out = [rename.get(n, n) for n in names]
        twice: list[str] = []
    else:
        inverse = _saved_to_target(rename, saved)
        out = [inverse.get(n, [None])[0] for n in names]
        twice = [f"{n} (from {', '.join(inverse[n])})" for n in names if len(inverse.get(n, ())) > 1]
    lacking = []
    for n, src in zip(names, out):
        absent = [s for s in saved_names(src) if s not in have] if src is not None else [n]
        if absent:
            lacking.append(n if src is None or src == n else f"{n} (from {_listed(absent)})")
    if lacking or twice:
        error = TreeMismatchError([], lacking)
        lines = [f"rename: {len(lacking)} target leaves match no saved leaf: {_listed(lacking)}"] if lacking else []
        if twice:
            lines.append(f"rename: {len(twice)} target leaves match several saved leaves: {_listed(twice)}")
        error.args = ("\n".join(["target tree does not match the saved tree"] + ["  " + s for s in lines]
                                + [f"  (saved names: {_listed(saved)})"]),)
        raise error
    return out


def saved_names(src: Any) -> list[str]:
    if isinstance(src, str):
        return [src]
    return [n for s in src.sources for n in saved_names(s)]


# ---- pairing the target's leaves with saved (and view) leaves -------------------------------

def pair_leaves(target: Any, paths: list[str], records: Sequence[LeafRecord], rename: Any, partial: Any,
                chosen: Callable[[list[int]], None] | None = None
                ) -> tuple[Any, list[tuple[int, Any]], list[LeafRecord], dict[int, Node], list[tuple[int, Any, str]]]:
    """(treedef, [(leaf index, target leaf)], view records, {index: Node}, missing) for a target
    matched through `rename` (or, with ``partial="matching"``, as it is): an index at or past
    ``len(records)`` is a view leaf; `missing`: (position, target leaf, key path) of target leaves
    the checkpoint lacks (``partial="matching"``; otherwise TreeMismatchError). `chosen`: told
    every saved leaf used, before any is looked at (an Orbax array is opened then)."""
    treedef, named = target_names(target)
    saved = [p.replace("/", ".") for p in paths]
    index = {n: i for i, n in enumerate(saved)}
    matching = partial == "matching"
    if rename is None:
        have = set(paths)
        sources = [p.replace("/", ".") if p in have else None for p, _, _ in named]
    elif matching:
        sources = []
        for _, dot, _ in named:
            try:
                sources.append(sources_of(rename, [dot], saved)[0])
            except TreeMismatchError:
                sources.append(None)
    else:
        sources = sources_of(rename, [dot for _, dot, _ in named], saved)
    used = {index[n] for src in sources if src is not None for n in saved_names(src)}
    if chosen is not None:
        chosen(sorted(used))
    pairs, views, nodes, missing = [], [], {}, []
    for pos, ((path, dot, leaf), src) in enumerate(zip(named, sources)):
        if src is None:
            missing.append((pos, leaf, path or "<root>"))
        elif isinstance(src, str):
            pairs.append((index[src], leaf))
        else:
            k = len(records) + len(views)
            nodes[k] = node = bind(src, dot, index, records)
            views.append(view_record(dot, node))
            pairs.append((k, leaf))
    if not partial:
        unused = [p.replace("/", ".") for i, p in enumerate(paths) if i not in used]
        if unused:
            raise TreeMismatchError(unused, [])
    return treedef, pairs, views, nodes, missing


