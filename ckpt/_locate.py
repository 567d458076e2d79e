"""From a command-line path to a checkpoint: a checkpoint directory itself, or a manager
directory (``step_<n>`` subdirectories, formats/SPEC.md) and optionally a step in it."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from ckpt._commit import TEMP_MARK, is_temp_name, read_manifest
from ckpt._errors import CheckpointError
from ckpt._fs import local_path
from ckpt._manifest import MANIFEST_NAME, Manifest
from ckpt._manifest_check import check_manifest
from ckpt._steps import parse_step, scan_steps, step_dir_name


@dataclass(frozen=True)
class Opened:
    root: str
    manifest: Manifest
    note: str | None = None  # set when a step was picked out of a manager directory


def _has_manifest(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_NAME))


def open_checkpoint(path: str, step: int | None = None) -> Opened:
    """The committed checkpoint at `path`, or the given (default: latest committed) step of
    the manager directory at `path`, with its manifest read and checked."""
    root = local_path(path)
    if not os.path.lexists(root):
        raise FileNotFoundError(errno.ENOENT, "no such file or directory", root)
    note = None
    if step is not None:
        if _has_manifest(root) and not scan_steps(root):
            raise CheckpointError(f"{root} is a single checkpoint, not a manager directory: drop --step")
        root = os.path.join(root, step_dir_name(step))
        if not os.path.lexists(root):
            steps = [e.step for e in scan_steps(os.path.dirname(root)) if e.committed]
            raise CheckpointError(f"no step {step} in {os.path.dirname(root)} (committed steps: {steps or 'none'})")
    elif os.path.isdir(root) and not _has_manifest(root) and not is_temp_name(os.path.basename(root)):
        entries = scan_steps(root)
        if entries:
            committed = [e for e in entries if e.committed]
            if not committed:
                raise CheckpointError(f"{root} is a manager directory without a committed step")
            root, note = committed[-1].path, f"step {committed[-1].step} (latest committed) of {root}"
    return Opened(root, check_manifest(read_manifest(root), root), note)


@dataclass(frozen=True)
class StepRow:
    """One line of `ckpt ls`."""

    step: int | None
    path: str
    state: str  # 'committed', 'uncommitted' or 'corrupt'
    size: int
    files: int
    written: float  # seconds since the epoch: the manifest's 'created', else the directory's mtime
    problem: str | None = None


def tree_size(path: str) -> tuple[int, int]:
    """(bytes, regular files) under `path`, symlinks not followed."""
    total = count = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:  # removed while we walk (a manager deleting an old step)
                continue
            total += st.st_size
            count += 1
    return total, count


def _row(step: int | None, path: str) -> StepRow:
    size, files = tree_size(path)
    written, problem = os.stat(path).st_mtime, None
    if is_temp_name(os.path.basename(path)) or not _has_manifest(path):
        state = "uncommitted"
    else:
        try:
            written, state = read_manifest(path).created, "committed"
        except CheckpointError as e:
            state, problem = "corrupt", str(e).splitlines()[0]
    return StepRow(step, path, state, size, files, written, problem)


def list_steps(path: str) -> list[StepRow]:
    """Every step directory of a manager directory, or the one checkpoint at `path`."""
    root = local_path(path)
    if not os.path.lexists(root):
        raise FileNotFoundError(errno.ENOENT, "no such file or directory", root)
    if not os.path.isdir(root):
        raise CheckpointError(f"{root} is not a directory")
    entries = [] if _has_manifest(root) else scan_steps(root)
    if entries:
        return [_row(e.step, e.path) for e in entries]
    if _has_manifest(root) or is_temp_name(os.path.basename(root)):
        return [_row(parse_step(os.path.basename(root).split(TEMP_MARK)[0]), root)]
    raise CheckpointError(
        f"{root} is neither a checkpoint (no {MANIFEST_NAME}) nor a manager directory (no step_* directories)"
    )
