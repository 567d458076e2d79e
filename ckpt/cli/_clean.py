"""`ckpt clean`, and what `ckpt ls` says about uncommitted entries: the staged data saves leave.

A save stages its data before committing it: a ``<path>.tmp-<hex>`` directory beside the
checkpoint on local disk, a ``gen-<hex>/`` prefix inside it elsewhere. A save that crashed
leaves that data behind. ``Storage.leftovers`` judges each such entry by its owner record (and,
on local disk, by the lock the saving process holds): dead when its save provably ended, alive
otherwise. Only dead ones are ever removed, so cleaning a directory another process is saving
to is safe.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any

from ckpt._errors import CheckpointError
from ckpt._format import GENERATION_MARK, MANIFEST_NAME, is_temp_name, read_manifest
from ckpt._host import Options
from ckpt._commit import Leftover, commit_for
from ckpt.storage import Storage, name_of


@dataclass(frozen=True)
class Found:
    """A leftover and the location it is directly below."""

    area: Storage
    leftover: Leftover

    @property
    def path(self) -> str:
        return self.area.where(self.leftover.name)


def _referenced(storage: Storage) -> set[str] | None:
    """The generation prefixes the checkpoint at `storage` points into ({} without a manifest),
    or None when its manifest cannot be read (its data is then left alone)."""
    if not storage.exists(MANIFEST_NAME):
        return set()
    try:
        manifest = read_manifest(storage)
    except (CheckpointError, OSError):
        return None
    paths = [l.zarr.path for l in manifest.leaves if l.zarr is not None]
    paths += [s.zarr.path for s in getattr(manifest, "stacks", ())]
    if manifest.layout is not None:  # (format version 3: its index objects, even with no arrays)
        paths += [ref.name for ref in manifest.layout.indexes]
    return {p.split("/", 1)[0] for p in paths if p.startswith(GENERATION_MARK)}


def _below(storage: Storage) -> list[Found]:
    referenced = _referenced(storage)
    found = commit_for(storage).leftovers(referenced or ())
    if referenced is None:  # an unreadable manifest: its generations may be its data
        found = [l for l in found if not l.name.startswith(GENERATION_MARK)]
    return [Found(storage, l) for l in found]


def find_leftovers(storage: Storage) -> list[Found]:
    """Every leftover of a save in or beside the directory at `storage`: directly below it, in
    the checkpoints and steps directly below it (storage without renames keeps them there), and,
    when `storage` is itself a checkpoint on local disk, its own ``<name>.tmp-*`` siblings."""
    found = _below(storage)
    if not storage.caps.renames:
        for name in storage.list_dir("")[1]:
            if not (is_temp_name(name) or name.startswith(GENERATION_MARK)):
                found += _below(storage.child(name))
    elif storage.exists(MANIFEST_NAME):
        parent = storage.parent()
        found += [Found(parent, l) for l in commit_for(parent).leftovers() if l.name.startswith(name_of(storage) + ".tmp-")]
    return found


_RETIRED = re.compile(r".+\.tmp-(?:deleted|old)-[0-9a-f]{12}")


def is_retired(name: str) -> bool:
    """Whether `name` is a checkpoint being deleted (``<name>.tmp-deleted-<hex>``, retention's
    or ``delete``'s) or one replaced by an overwrite (``.tmp-old-<hex>``): no longer a
    checkpoint, and never a save that did not commit."""
    return bool(_RETIRED.fullmatch(name))


def describe(leftover: Leftover) -> str:
    """The words `ckpt ls` shows beside an uncommitted entry (or a deleted one)."""
    if is_retired(leftover.name):
        if leftover.dead:
            return f"deleted, not yet removed: {leftover.why}; 'ckpt clean' removes it"
        return "being deleted"
    if leftover.dead:
        return f"leftover of a dead save: {leftover.why}; 'ckpt clean' removes it"
    return f"in use: {leftover.why}"


def notes(storage: Storage) -> dict[str, str]:
    """For `ckpt ls`: entry name (directly below `storage`) -> what it is, for every uncommitted
    entry that holds staged data (a temporary directory; a step prefix without a manifest)."""
    out = {f.leftover.name: describe(f.leftover) for f in _below(storage)}
    if not storage.caps.renames:
        for name in storage.list_dir("")[1]:
            if is_temp_name(name) or name.startswith(GENERATION_MARK) or storage.child(name).exists(MANIFEST_NAME):
                continue
            inside = _below(storage.child(name))
            if inside:
                live = [f.leftover for f in inside if not f.leftover.dead]
                out[name] = describe(live[0] if live else inside[0].leftover)
    return out


def clean(storage: Storage, *, dry_run: bool) -> list[dict[str, Any]]:
    """Remove every dead leftover (or, with `dry_run`, say what would be removed); the report
    has one entry per leftover found, live ones included."""
    report = []
    for f in find_leftovers(storage):
        removed = False
        if f.leftover.dead and not dry_run:
            removed = commit_for(f.area).remove_leftover(f.leftover)
        report.append({"path": f.path, "dead": f.leftover.dead, "removed": removed, "why": f.leftover.why})
    return report


def add_clean_command(command, options_of) -> None:
    c = command("clean", "remove what crashed saves left behind (never a save in progress)",
                "Find the staged data of saves that never committed, in and beside DIR: '<name>.tmp-<hex>' "
                "directories (local disk) and generation prefixes no manifest points to (object stores), in DIR "
                "and in the checkpoints and steps directly inside it. Each carries an owner record (and on local "
                "disk a lock its saving process holds): only those whose save provably ended are removed; a save "
                "in progress, on this machine or another, is listed and left alone. Saves and managers also do "
                "this on their own after each commit.")
    c.add_argument("path", metavar="DIR", help="manager directory, directory of checkpoints, or a checkpoint")
    c.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    c.add_argument("--json", action="store_true", help="print one JSON document")
    c.set_defaults(run=lambda args: _cmd_clean(args, options_of(args)))


def _cmd_clean(args: argparse.Namespace, options: Options) -> int:
    import json

    from ckpt.cli._opened import open_location

    report = clean(open_location(args.path, options), dry_run=args.dry_run)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for r in report:
        verb = ("would remove" if args.dry_run else "removed" if r["removed"] else "kept") if r["dead"] else "in use"
        print(f"{verb:12}  {r['path']}  ({r['why']})")
    dead = sum(r["dead"] for r in report)
    done = sum(r["removed"] for r in report)
    print(f"{'would remove' if args.dry_run else 'removed'} {dead if args.dry_run else done} leftover(s); "
          f"{len(report) - dead} in use left alone")
    return 0
