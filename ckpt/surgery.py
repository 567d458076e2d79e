"""Building blocks of ``ckpt.restore(path, target, rename={...})``: a target leaf made of parts of
saved leaves, read region by region (each process reads only what its shards need).

Each takes saved names (key paths joined with ``.``, as ``ckpt export`` names tensors) or other
parts, so they compose: ``stack([concat([transpose(f"layers.{i}.{x}.weight") for x in "qkv"],
axis=1) for i in range(n)])`` is a scanned, fused q/k/v kernel made of PyTorch-layout weights.

- ``stack(sources, axis=0)``: per-layer leaves into one scanned leaf.
- ``unstack(source, index, axis=0)``: one layer of a scanned leaf.
- ``transpose(source, axes=None)``: axes permuted (reversed by default: (out, in) -> (in, out)).
- ``concat(sources, axis=0)``: leaves side by side (a fused q/k/v kernel).
- ``split(source, sections, part, axis=0)``: one piece of a leaf cut into equal ``sections`` (an
  int) or pieces of the given sizes (a list).
- ``reshape(source, shape)``: axes split or merged, in C order (a ``(hidden, heads * head_dim)``
  kernel as ``(hidden, heads, head_dim)``, as MaxText keeps attention weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckpt._restore import Part

__all__ = ["concat", "reshape", "split", "stack", "transpose", "unstack"]


def _source(s: Any, what: str) -> Any:
    if isinstance(s, (str, Part)):
        return s
    raise TypeError(f"{what}: a source is a saved name (str) or a ckpt.surgery part, got {s!r}")


def stack(sources: Sequence[Any], axis: int = 0) -> Part:
    """Saved leaves of one shape stacked along a new axis: per-layer leaves into one scanned leaf.

    Args:
        sources: saved names (key paths joined with ``.``) or other parts, one per layer.
        axis: where the new axis goes in the result.

    Returns:
        A part, for a value of ``restore(rename={target name: part})``.

    Raises:
        TypeError: a source is neither a name nor a part.
        ValueError: `sources` is empty (the restore raises ``CheckpointError`` naming the leaf
            where the sources' shapes or dtypes differ).
    """
    sources = tuple(_source(s, "stack") for s in sources)
    if not sources:
        raise ValueError("stack needs at least one source")
    return Part("stack", sources, axis)


def unstack(source: Any, index: int, axis: int = 0) -> Part:
    """Entry `index` along `axis` of a saved leaf, without that axis: one layer of a scanned leaf.

    Args:
        source: a saved name or a part.
        index: the entry (the layer) to take.
        axis: the axis it is taken along (the scanned axis).

    Returns:
        A part, for a value of ``restore(rename={target name: part})``.

    Raises:
        TypeError: `source` is neither a name nor a part (an index outside the axis is a
            ``CheckpointError`` of the restore, naming the leaf).
    """
    return Part("unstack", (_source(source, "unstack"),), axis, int(index))


def transpose(source: Any, axes: Sequence[int] | None = None) -> Part:
    """A saved leaf with its axes permuted: PyTorch's ``(out, in)`` weight as Flax's ``(in, out)``.

    Args:
        source: a saved name or a part.
        axes: the permutation, as ``numpy.transpose``'s; None reverses the axes.

    Returns:
        A part, for a value of ``restore(rename={target name: part})``.

    Raises:
        TypeError: `source` is neither a name nor a part (axes that are not a permutation are a
            ``CheckpointError`` of the restore, naming the leaf).
    """
    return Part("transpose", (_source(source, "transpose"),), 0, None if axes is None else tuple(int(a) for a in axes))


def concat(sources: Sequence[Any], axis: int = 0) -> Part:
    """Saved leaves concatenated along an axis: q, k and v into one fused kernel.

    Args:
        sources: saved names or parts, in order.
        axis: the axis they are joined along (the others must match).

    Returns:
        A part, for a value of ``restore(rename={target name: part})``.

    Raises:
        TypeError: a source is neither a name nor a part.
        ValueError: `sources` is empty (shapes that do not fit are a ``CheckpointError`` of the
            restore, naming the leaf).
    """
    sources = tuple(_source(s, "concat") for s in sources)
    if not sources:
        raise ValueError("concat needs at least one source")
    return Part("concat", sources, axis)


def split(source: Any, sections: int | Sequence[int], part: int, axis: int = 0) -> Part:
    """One piece of a saved leaf cut along an axis: q, k or v out of a fused kernel.

    Args:
        source: a saved name or a part.
        sections: the number of equal pieces (an int), or the sizes of the pieces (a list).
        part: which piece, from 0.
        axis: the axis that is cut.

    Returns:
        A part, for a value of ``restore(rename={target name: part})``.

    Raises:
        TypeError: `source` is neither a name nor a part (pieces that do not fit the axis are a
            ``CheckpointError`` of the restore, naming the leaf).
    """
    sections = int(sections) if isinstance(sections, int) else tuple(int(n) for n in sections)
    return Part("slice", (_source(source, "split"),), axis, (sections, int(part)))


def reshape(source: Any, shape: Sequence[int]) -> Part:
    """A saved leaf with its axes split or merged (C order, as ``numpy.reshape``; one entry may be
    -1): a ``(hidden, heads * head_dim)`` kernel as ``(hidden, heads, head_dim)``. A process reads
    the saved bytes of its shards' regions only (a region whole along the split or merged axes
    but the first is one read; one cutting across them, several).

    Args:
        source: a saved name or a part.
        shape: the new shape, of the same size.

    Returns:
        A part, for a value of ``restore(rename={target name: part})``.

    Raises:
        TypeError: `source` is neither a name nor a part (a shape of another size is a
            ``CheckpointError`` of the restore, naming the leaf).
    """
    return Part("reshape", (_source(source, "reshape"),), 0, tuple(int(n) for n in shape))
