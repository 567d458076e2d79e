"""The `verify`, `du` and `export` commands: their arguments and what they print."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from ckpt._host import Options
from ckpt.cli._foreign import refuse_foreign
from ckpt.cli._style import console, progress_bar


def _print(doc_or_text, *, as_json: bool = False, rich=None) -> None:
    if as_json:
        print(json.dumps(doc_or_text, indent=2))
        return
    con = console()
    if con is not None and rich is not None:
        con.print(rich(doc_or_text))
    else:
        print(doc_or_text)


# ---- verify -----------------------------------------------------------------------------------

def add_verify_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("--all", action="store_true",
                   help="in a manager directory, verify every committed step (one progress bar)")
    c.add_argument("--json", action="store_true", help="print one JSON document (problems included)")


def _verify_text(report, root: str) -> str:
    from ckpt.cli._render import human_bytes, plural

    rate = report.bytes / report.seconds if report.seconds > 0 else 0.0
    lines = [f"verified {root}",
             f"read {plural(report.chunks, 'chunk')} of {plural(report.arrays, 'array')} ({human_bytes(report.bytes)}) "
             f"and checked {plural(report.inline_arrays, 'inline array')} in {report.seconds:.2f} s ({human_bytes(rate)}/s)"]
    lines += [f"BAD {p}" for p in report.problems]
    lines.append("result: intact, every chunk matches its checksum" if report.intact else f"result: {_damage(report)}")
    return "\n".join(lines)


def _damage(report) -> str:
    bad_chunks = sum(p.chunk is not None for p in report.problems)
    bad_arrays = len({p.leaf for p in report.problems})
    return (f"DAMAGED, {bad_chunks} bad chunk(s) and {len(report.problems) - bad_chunks} bad array "
            f"metadata file(s) in {bad_arrays} array(s)")


def cmd_verify(args, options: Options, open_checkpoint) -> int:
    from ckpt.cli._locate import list_steps
    from ckpt.cli._render import human_bytes, plural
    from ckpt.cli._verify import verify_checkpoints, verify_document
    from ckpt.cli._views import colour_lines

    if args.all and args.step is not None:
        raise ValueError("--all verifies every step: drop --step")
    if args.all:
        from ckpt.storage import location_text

        where = location_text(args.path)
        rows = list_steps(args.path, options)
        targets = [(r.step, open_checkpoint(r.path, None)) for r in rows if r.state == "committed"]
        skipped = [dataclasses.replace(r, problem="Orbax stores no checksums") if r.state == "orbax" else r
                   for r in rows if r.state != "committed"]
    else:
        targets, skipped = [(None, open_checkpoint(args.path, args.step))], []
        refuse_foreign(targets[0][1], "verify")
    bar = progress_bar(not args.no_progress, "verify")
    start = time.perf_counter()
    try:
        reports = verify_checkpoints([(o.storage, o.manifest) for _, o in targets], bar)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - start
    corrupt = [r for r in skipped if r.state == "corrupt"]
    intact = all(r.intact for r in reports) and not corrupt
    if not args.all:
        report, root = reports[0], targets[0][1].root
        _print(verify_document(report, root) if args.json else _verify_text(report, root),
               as_json=args.json, rich=colour_lines)
        return 0 if intact else 1
    if args.json:
        _print({"path": where, "intact": intact, "seconds": seconds,
                "steps": [{"step": step, **verify_document(r, o.root)} for (step, o), r in zip(targets, reports)],
                "not_verified": [{"step": r.step, "path": r.path, "state": r.state, "problem": r.problem}
                                 for r in skipped]}, as_json=True)
        return 0 if intact else 1
    total = sum(r.bytes for r in reports)
    lines = [f"verified {len(targets)} committed step(s) of {where}: "
             f"{plural(sum(r.chunks for r in reports), 'chunk')} ({human_bytes(total)}) in {seconds:.2f} s"]
    for (step, o), r in zip(targets, reports):
        state = "intact" if r.intact else _damage(r)
        lines.append(f"step {step}: {plural(r.chunks, 'chunk')} of {plural(r.arrays, 'array')}, "
                     f"{r.inline_arrays} inline: {state}")
        lines += [f"BAD {p}" for p in r.problems]
    for r in skipped:
        lines.append(f"step {r.step}: not verified, {r.state}" + (f" ({r.problem})" if r.problem else "")
                     + f": {r.path}")
    if intact:
        lines.append(f"result: intact, every chunk of {len(targets)} step(s) matches its checksum")
    else:
        bad = [step for (step, _), r in zip(targets, reports) if not r.intact] + [r.step for r in corrupt]
        lines.append(f"result: DAMAGED, step(s) {sorted(bad)}")
    _print("\n".join(lines), rich=colour_lines)
    return 0 if intact else 1


# ---- du ---------------------------------------------------------------------------------------

def _depth(text: str) -> int:
    try:
        depth = int(text)
    except ValueError:
        depth = 0
    if depth < 1:
        raise argparse.ArgumentTypeError(f"--depth must be at least 1, got {text!r}")
    return depth


def add_du_arguments(c: argparse.ArgumentParser, step_type, step_help: str) -> None:
    c.add_argument("--depth", type=_depth, default=1, metavar="N",
                   help="group by the first N key-path components (default 1: top-level subtrees)")
    c.add_argument("--step", type=step_type, metavar="N", help=step_help)
    c.add_argument("--json", action="store_true", help="print one JSON document")


def cmd_du(args, opened) -> int:
    from ckpt.cli._du import du_document, render_du, rich_du, usage

    refuse_foreign(opened, "du")

    doc = du_document(usage(opened.manifest, args.depth), opened.root, args.depth)
    _print(doc if args.json else render_du(doc), as_json=args.json, rich=lambda _: rich_du(doc))
    return 0


# ---- export -----------------------------------------------------------------------------------

def add_export_arguments(c: argparse.ArgumentParser, step_type, step_help: str, size_type) -> None:
    c.add_argument("out", metavar="OUT", help="local directory to write the files to (created if missing; "
                                              "with --format zarr, new or empty)")
    c.add_argument("--format", choices=["safetensors", "zarr"], default="safetensors",
                   help="output format: safetensors (default), or zarr: plain Zarr v3, one file per chunk, "
                        "that stock zarr-python and TensorStore read")
    c.add_argument("--shard-size", metavar="SIZE",
                   help="most tensor bytes per file, as transformers reads max_shard_size: 5GB = 5*10^9, "
                        "2GiB = 2*2^30 (default 5GB); larger exports get an index (safetensors only)")
    c.add_argument("--rename", action="append", default=[], metavar="PATTERN=REPLACEMENT",
                   help="rename tensors with a regular expression (Python re.sub), applied in order after "
                        "--rename-file; a name that becomes empty is dropped. Repeatable")
    c.add_argument("--rename-file", metavar="FILE",
                   help="JSON object from default names (key paths joined with '.') to names; null drops")
    c.add_argument("--host-budget", type=size_type, metavar="SIZE",
                   help="host memory for chunks in flight (default: Options.host_budget_bytes, a quarter of RAM)")
    c.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT (of the same format)")
    c.add_argument("--step", type=step_type, metavar="N", help=step_help)
    c.add_argument("--no-progress", action="store_true", help="no progress bar, even on a terminal")
    c.add_argument("--json", action="store_true", help="print one JSON document (files, tensor -> file; for zarr, "
                                                         "leaf path -> Zarr path)")


def cmd_export(args, open_checkpoint, options: Options) -> int:
    from ckpt.cli._export import export_document, parse_shard_size, rename_from, render_export
    from ckpt.safetensors import export

    if args.format == "zarr":
        return _cmd_export_zarr(args, open_checkpoint, options)
    shard_size = parse_shard_size(args.shard_size or "5GB")
    rename = rename_from(args.rename, args.rename_file)
    opened, result = _exporting(args, open_checkpoint, options, lambda root, options, bar: export(
        root, args.out, shard_size=shard_size, rename=rename, overwrite=args.overwrite, options=options, progress=bar))
    doc = export_document(result, os.path.abspath(args.out), opened.root)
    _print(doc if args.json else render_export(doc), as_json=args.json)
    return 0


def _exporting(args, open_checkpoint, options: Options, run):
    """(the checkpoint opened, what `run(root, options, progress bar)` returned): the steps both
    export formats share (--host-budget, a jax-ckpt checkpoint only, the progress bar)."""
    if args.host_budget is not None:
        options = dataclasses.replace(options, host_budget_bytes=args.host_budget)
    opened = open_checkpoint()
    refuse_foreign(opened, "export")
    bar = progress_bar(not args.no_progress, "export")
    try:
        return opened, run(opened.root, options, bar)
    finally:
        if bar is not None:
            bar.close()


def _cmd_export_zarr(args, open_checkpoint, options: Options) -> int:
    from ckpt.cli._export_zarr import export_zarr, render_zarr_export, zarr_export_document

    for flag, given in (("--shard-size", args.shard_size is not None), ("--rename", bool(args.rename)),
                        ("--rename-file", args.rename_file is not None)):
        if given:
            raise ValueError(f"{flag} applies to --format safetensors only (a Zarr export keeps the tree's paths)")
    opened, result = _exporting(args, open_checkpoint, options, lambda root, options, bar: export_zarr(
        root, args.out, overwrite=args.overwrite, options=options, progress=bar))
    doc = zarr_export_document(result, opened.root)
    _print(doc if args.json else render_zarr_export(doc), as_json=args.json)
    return 0
