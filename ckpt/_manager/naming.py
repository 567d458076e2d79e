"""Layout of a manager directory: one checkpoint per step in ``step_<8+ digits>`` (by default;
``StepNaming`` describes other names, such as Orbax's bare ``<step>``).

Step directories sort by step as text (zero-padded to 8 digits; longer numbers stay correct
because every longer name is a larger step). ``step_00000100.tmp-<token>`` is a save of step
100 that has not committed (or never will).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckpt._format import MANIFEST_NAME, is_temp_name
from ckpt._orbax import STEP_METADATA, TMP_MARK, step_of
from ckpt.storage import Storage

_STEP = re.compile(r"^step_(\d{8,})$")
_STEP_ANY = re.compile(r"^step_(\d{8,})(\.tmp-.*)?$")
_OTHER_NAMING = re.compile(r"^(?:step_)?\d+$")


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


@dataclass(frozen=True)
class StepNaming:
    """How a manager names its step directories: ``<prefix>_<step>`` with the step zero-padded
    to `digits` (``step_00000100``: the default), or the bare step (prefix None: ``100``, what
    Orbax writes by default). Names with more digits than `digits` still parse (step >= 10**8)."""

    prefix: str | None = "step"
    digits: int | None = 8

    def __post_init__(self) -> None:
        if self.prefix is not None and (not isinstance(self.prefix, str) or not self.prefix
                                        or "/" in self.prefix or is_temp_name(self.prefix)):
            raise ValueError(f"step_prefix must be a non-empty name without '/', or None; got {self.prefix!r}")
        if self.digits is not None and (isinstance(self.digits, bool) or not isinstance(self.digits, int)
                                        or not 1 <= self.digits <= 20):
            raise ValueError(f"step_format_fixed_length must be an integer from 1 to 20, or None; got {self.digits!r}")

    def name(self, step: int) -> str:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        number = f"{step:0{self.digits}d}" if self.digits else str(step)
        return f"{self.prefix}_{number}" if self.prefix is not None else number

    def parse(self, name: str) -> int | None:
        """The step of a name this naming gives (temporary ones included: ``<name>.tmp-...``)."""
        base = name.split(".tmp-", 1)[0]
        if self.prefix is not None:
            head = self.prefix + "_"
            if not base.startswith(head):
                return None
            base = base[len(head):]
        if not base.isdigit() or not base.isascii() or len(base) < (self.digits or 1):
            return None
        if not self.digits and len(base) > 1 and base[0] == "0":
            return None  # not a name this naming gives
        return int(base)


DEFAULT_NAMING = StepNaming()


@dataclass(frozen=True)
class ManagedStep:
    """A committed step of a manager directory."""

    step: int
    name: str
    orbax: bool  # an Orbax step (``_CHECKPOINT_METADATA``), not a jax-ckpt checkpoint


def scan_named_steps(directory: Storage, naming: StepNaming) -> list[StepEntry]:
    """As ``scan_steps``, for steps named by `naming`."""
    if naming == DEFAULT_NAMING:
        return scan_steps(directory)
    out = []
    files, dirs = directory.list_dir("")
    for name in dirs + files:
        step = naming.parse(name)
        if step is None:
            continue
        committed = not is_temp_name(name) and name in dirs and directory.exists(f"{name}/{MANIFEST_NAME}")
        out.append(StepEntry(step, name, directory.where(name), committed))
    out.sort(key=lambda e: (e.step, e.name))
    return out


def committed_steps(directory: Storage, naming: StepNaming) -> dict[int, ManagedStep]:
    """Every committed step: the jax-ckpt checkpoints named by `naming`, finished Orbax steps
    (any name Orbax gives: ``<n>``, ``<prefix>_<n>``, zero-padded), and jax-ckpt checkpoints
    named ``<n>`` or ``step_<n>`` (the two usual namings; other directories holding a checkpoint,
    such as ``best_model_3``, are not steps). Where several claim a step, the one named by
    `naming` wins, then Orbax's."""
    _, dirs = directory.list_dir("")
    ours: dict[int, ManagedStep] = {}
    orbax: dict[int, ManagedStep] = {}
    others: dict[int, ManagedStep] = {}
    for name in sorted(dirs):
        if is_temp_name(name) or TMP_MARK in name:
            continue
        step = naming.parse(name)
        if step is not None and step not in ours and directory.exists(f"{name}/{MANIFEST_NAME}"):
            ours[step] = ManagedStep(step, name, False)
            continue
        other = step_of(name)
        if other is None or other in orbax or other in ours:
            continue
        if directory.exists(f"{name}/{STEP_METADATA}"):
            orbax[other] = ManagedStep(other, name, True)
        elif _OTHER_NAMING.match(name) and directory.exists(f"{name}/{MANIFEST_NAME}"):
            others[other] = ManagedStep(other, name, False)  # a jax-ckpt step under another naming
    return {**others, **orbax, **ours}
