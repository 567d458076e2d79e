"""Orbax checkpoints as they lie on disk: step directories and the layout of a PyTree checkpoint
(which leaves, which arrays, where). Reading their data is a source of ``ckpt._restore``."""

from __future__ import annotations

from ckpt._orbax.layout import Item, Layout, OrbaxLeaf, read_json, read_layout
from ckpt._orbax.steps import (
    PYTREE_METADATA,
    STEP_METADATA,
    TMP_MARK,
    kind_of,
    scan_orbax_steps,
    step_custom_metadata,
    step_of,
    step_record,
    step_user_metadata,
)

# What the layers above use from here.
__all__ = [
    "Item",
    "Layout",
    "OrbaxLeaf",
    "PYTREE_METADATA",
    "STEP_METADATA",
    "TMP_MARK",
    "kind_of",
    "read_json",
    "read_layout",
    "scan_orbax_steps",
    "step_custom_metadata",
    "step_of",
    "step_record",
    "step_user_metadata",
]
