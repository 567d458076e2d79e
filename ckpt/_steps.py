"""Layout of a manager directory: one checkpoint per step in ``step_<8+ digits>``.

Step directories sort by step as text (zero-padded to 8 digits; longer numbers stay correct
because every longer name is a larger step). ``step_00000100.tmp-<token>`` is a save of step
100 that has not committed (or never will).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckpt.storage import MANIFEST_NAME, Storage, is_temp_name

_STEP = re.compile(r"^step_(\d{8,})$")
_STEP_ANY = re.compile(r"^step_(\d{8,})(\.tmp-.*)?$")


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a committed-looking step directory name, else None."""
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class StepEntry:
    step: int
    name: str  # the entry's name in the manager directory
    path: str  # its full location, for messages
    committed: bool  # has a manifest and is not a temporary directory


def scan_steps(directory: Storage) -> list[StepEntry]:
    """Every step entry (committed or not, temporary ones included), sorted by step."""
    out = []
    files, dirs = directory.list_dir("")
    for name in dirs + files:
        m = _STEP_ANY.match(name)
        if not m:
            continue
        committed = not is_temp_name(name) and name in dirs and directory.exists(f"{name}/{MANIFEST_NAME}")
        out.append(StepEntry(int(m.group(1)), name, directory.where(name), committed))
    out.sort(key=lambda e: (e.step, e.name))
    return out
