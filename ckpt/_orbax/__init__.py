"""Orbax checkpoints as they lie on disk: step directories and the layout of a PyTree checkpoint
(which leaves, which arrays, where). Reading their data is a source of ``ckpt._restore``."""

from __future__ import annotations

# The door: what other layers of ckpt use from here.
from ckpt._orbax.layout import Item, Layout, OrbaxLeaf, read_json, read_layout
from ckpt._orbax.steps import STEP_METADATA, TMP_MARK, kind_of, scan_orbax_steps, step_of, step_record  # noqa: F401
