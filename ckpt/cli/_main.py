"""The `ckpt` command line: look inside checkpoints without writing code (docs/cli.md).

Every command that takes a location reads it through ``ckpt.storage`` (``--engine`` picks the
engine, as ``Options(engine=)`` does), so it works wherever the library saves.

Exit status: 0 success; 1 the answer is "no" (verify found damage, diff found differences, plan
found leaves it cannot place); 2 an error (bad usage, missing path, not a checkpoint, corrupted
manifest, a chunk that cannot be read), reported as one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from ckpt._errors import CheckpointError
from ckpt._host import Options
from ckpt.cli._parsing import _HelpFormatter, _Parser, _UsageError, _in_flags, _size, _step, _tolerance
from ckpt.storage import ENGINES

COMMANDS = ("ls", "inspect", "verify", "diff", "plan", "bench")
COMMANDS += ("convert",)
COMMANDS += ("du", "export")
COMMANDS += ("clean",)


def _print_json(doc) -> None:
    print(json.dumps(doc, indent=2))


def _note(opened) -> None:
    if opened.note:
        print(f"using {opened.note}", file=sys.stderr)


def _options(args) -> Options:
    from ckpt.cli._opened import cli_options

    locations = [getattr(args, name, None) for name in ("path", "a", "b", "src", "dest")]
    return cli_options(getattr(args, "engine", None), [loc for loc in locations if loc])


def _open(args, location: str, step: int | None = None):
    from ckpt.cli._locate import open_checkpoint

    opened = open_checkpoint(location, step, _options(args))
    _note(opened)
    return opened


def _cmd_ls(args) -> int:
    from ckpt.cli._locate import list_steps
    from ckpt.cli._render import ls_document, render_ls

    rows = list_steps(args.path, _options(args))
    if args.json:
        _print_json(ls_document(rows))
    elif (con := _terminal()) is not None:
        from ckpt.cli._views import rich_ls

        con.print(rich_ls(rows))
    else:
        print(render_ls(rows))
    return 0


def _cmd_inspect(args) -> int:
    from ckpt.cli._render import inspect_document, json_safe, render_inspect

    opened = _open(args, args.path, args.step)
    doc = inspect_document(opened)
    if args.json:
        _print_json(json_safe(doc))
    elif (con := _terminal()) is not None:
        from ckpt.cli._views import rich_inspect

        con.print(rich_inspect(doc, opened.manifest, con.width))
    else:
        print(render_inspect(doc, opened.manifest))
    return 0


def _cmd_verify(args) -> int:
    from ckpt.cli._commands import cmd_verify

    return cmd_verify(args, _options(args), lambda location, step: _open(args, location, step))


def _cmd_du(args) -> int:
    from ckpt.cli._commands import cmd_du

    return cmd_du(args, _open(args, args.path, args.step))


def _cmd_export(args) -> int:
    from ckpt.cli._commands import cmd_export
    from ckpt.cli._locate import open_checkpoint

    # No "using step N" note: the result names the step, and an error stays one line.
    return cmd_export(args, lambda: open_checkpoint(args.path, args.step, _options(args)), _options(args))


def _terminal():
    """A rich console when stdout is a terminal (tables and colours), else None (plain text)."""
    from ckpt.cli._style import console

    return console()


def _cmd_diff(args) -> int:
    from ckpt.cli._diff import diff_checkpoints, diff_document, render_diff

    a, b = _open(args, args.a), _open(args, args.b)
    report = diff_checkpoints(a, b, args.block_bytes, _options(args), atol=args.atol, rtol=args.rtol)
    if args.json:
        _print_json(diff_document(report))
    elif (con := _terminal()) is not None:
        from ckpt.cli._views import colour_lines

        con.print(colour_lines(render_diff(report)))
    else:
        print(render_diff(report))
    return 0 if report.identical else 1


def _cmd_plan(args) -> int:
    from ckpt.cli._plan import dry_run_document, dry_run_restore, parse_axis_names, parse_mesh, render_dry_run

    try:
        names, sizes = parse_mesh(args.mesh)
        renamed = parse_axis_names(args.axis_names, names) if args.axis_names else None
    except ValueError as e:
        raise _UsageError(str(e)) from None
    opened = _open(args, args.path, args.step)
    from ckpt.cli._foreign import refuse_foreign

    if opened.format != "orbax":  # an Orbax step is planned from its layout as restore reads it
        refuse_foreign(opened, "plan")
    try:
        run = dry_run_restore(opened.manifest, names, sizes, args.processes, renamed)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    orbax_note = ("an Orbax checkpoint: READ counts its chunks as decoded (Orbax may compress them on disk)"
                  if opened.format == "orbax" else None)
    if args.json:
        _print_json({**dry_run_document(run, opened.root), "format": "orbax-checkpoint" if orbax_note else "jax-ckpt"})
    elif (con := _terminal()) is not None:
        from ckpt.cli._views import rich_plan

        con.print(rich_plan(dry_run_document(run, opened.root), args.per_leaf))
        if orbax_note:
            con.print(orbax_note, style="dim")
    else:
        print(render_dry_run(run, opened.root, args.per_leaf) + (f"\n{orbax_note}" if orbax_note else ""))
    return 1 if run.unplaceable else 0


def _cmd_bench(args) -> int:
    from ckpt.cli import _bench

    res = _bench.run(args.gib, args.runs, args.dir)
    if args.json:
        _print_json(res)
    else:
        _bench.print_table(res)
    return 0


def _parser() -> argparse.ArgumentParser:
    from ckpt._version import __version__

    p = _Parser(
        prog="ckpt",
        description="Look inside jax-ckpt checkpoints: list steps, show what is saved and what takes the "
        "bytes, check integrity, compare two checkpoints, plan a restore on another mesh, and export to "
        "safetensors. Run 'ckpt CMD --help' for one command.",
        epilog="Exit status: 0 success; 1 verify found damage, diff found differences, or plan found leaves "
        "it cannot place; 2 an error (printed as one line on stderr).",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"ckpt (jax-ckpt) {__version__}")
    sub = p.add_subparsers(dest="command", metavar="CMD")
    engine_help = ("storage engine to read with (default: local for paths and file://, tensorstore for "
                   "memory://, s3://, gs://, fsspec for other URLs)")

    def command(name: str, summary: str, description: str, *, location: bool = True) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=summary, description=description, formatter_class=_HelpFormatter)
        if location:
            c.add_argument("--engine", choices=ENGINES, help=engine_help)
        return c

    where = "a local path or URL: file://, memory://, s3://, gs://, any fsspec URL"
    step_help = "in a manager directory, use this step (default: the latest committed step, jax-ckpt's or Orbax's)"
    c = command("ls", "list the steps of a manager directory (or one checkpoint)",
                "List every step directory of a manager directory (jax-ckpt's under any step naming: step_<n>, "
                "<n> with step_prefix=None, <prefix>_<n>; and Orbax's beside them, state 'orbax'): step, "
                "committed or not, size, number of "
                "files and the time it was written (the manifest's 'created'; for an uncommitted step, the "
                "newest file's modification time). Given one checkpoint, list just that. On storage that "
                "cannot report sizes cheaply (object stores, fsspec), a committed step's size is that of its "
                "chunk files and manifest, from the manifest (shown with '~'), and '-' is shown for what "
                "cannot be known.")
    c.add_argument("path", metavar="DIR", help=f"manager directory or checkpoint ({where})")
    c.add_argument("--json", action="store_true", help="print one JSON document (a list of steps)")
    c.set_defaults(run=_cmd_ls)

    c = command("inspect", "show the saved tree: shapes, dtypes, shardings, chunks, bytes",
                "Show the saved tree from the manifest alone (no array data is read): for each array its "
                "dtype, shape, the mesh and PartitionSpec it was saved with, the Zarr chunk shape and number "
                "of chunks, its bytes and where it is stored; small values (numbers, strings) as they are; "
                "then the totals. Also reads what ckpt.metadata reads: Orbax checkpoints and safetensors (a "
                "file, a model.safetensors.index.json, a directory of them). On a terminal the table is fitted "
                "to its width; nothing is cut without a mark (an ellipsis, or a note naming the columns left out).")
    c.add_argument("path", metavar="PATH", help=f"checkpoint or manager directory ({where})")
    c.add_argument("--step", type=_step, metavar="N", help=step_help)
    c.add_argument("--json", action="store_true", help="print the same as one JSON document")
    c.set_defaults(run=_cmd_inspect)

    c = command("verify", "read every chunk and check its CRC-32C",
                "Read every chunk file of every array and check its size and CRC-32C against the manifest, "
                "and each array's zarr.json against the manifest. Continues past a bad chunk so that every "
                "bad chunk is named. Exit status 0 only when everything is intact, 1 when anything is "
                "damaged. On a terminal, shows a progress bar with bytes per second on stderr. With --all, "
                "checks every committed step of a manager directory under one progress bar (a step whose "
                "manifest cannot be read counts as damaged; uncommitted steps are listed, not checked).")
    c.add_argument("path", metavar="PATH", help=f"checkpoint or manager directory ({where})")
    c.add_argument("--step", type=_step, metavar="N", help=step_help)
    c.add_argument("--no-progress", action="store_true", help="no progress bar, even on a terminal")
    from ckpt.cli._commands import add_du_arguments, add_export_arguments, add_verify_arguments

    add_verify_arguments(c)
    c.set_defaults(run=_cmd_verify)

    c = command("du", "bytes per subtree: what the checkpoint is made of",
                "Show how the checkpoint's bytes split over its top-level subtrees (or the first N key-path "
                "components with --depth N), largest first, from the manifest alone: bytes stored (chunk "
                "files, edge chunks padded, plus data inline in the manifest), number of arrays and the share "
                "of the whole.")
    c.add_argument("path", metavar="PATH", help=f"checkpoint or manager directory ({where})")
    add_du_arguments(c, _step, step_help)
    c.set_defaults(run=_cmd_du)

    c = command("export", "write the arrays as Hugging Face safetensors files (or plain Zarr v3)",
                "Write every array of the checkpoint as safetensors files in OUT: model.safetensors, or "
                "model-0000K-of-0000N.safetensors plus model.safetensors.index.json when the data is larger "
                "than --shard-size, as transformers' save_pretrained writes them. Tensor names are the key "
                "paths joined with '.' (params/dense/kernel -> params.dense.kernel), then renamed by "
                "--rename-file and --rename. Dtypes are kept (bfloat16 as BF16, float8_e4m3fn as F8_E4M3, "
                "float8_e5m2 as F8_E5M2); numbers, strings and PRNG keys are not tensors and are listed as "
                "not exported. Chunks are read (and checked against their CRC-32C) block by block within "
                "the host budget and written in place, so memory stays bounded whatever the size. "
                "ckpt.restore reads the result back, with or without a mesh.\n\n"
                "--format zarr writes plain Zarr v3 instead, into a new or empty OUT: an array per leaf at "
                "its tree path, one file per chunk (the checkpoint's chunks), uncompressed, the logical dtype "
                "in each array's attributes (jax_ckpt), values (numbers, strings) in the root group's "
                "attribute jax_ckpt_values; stock zarr-python and TensorStore's zarr3 driver read it, whatever "
                "the checkpoint's format version.\n\n"
                "example: ckpt export /ckpts/run1 hf --rename '^params\\.=model.'\n"
                "example: ckpt export --format zarr /ckpts/run1 run1.zarr")
    c.add_argument("path", metavar="PATH", help=f"checkpoint or manager directory ({where})")
    add_export_arguments(c, _step, step_help, _size)
    c.set_defaults(run=_cmd_export)

    from ckpt.cli._convert import add_convert_command

    add_convert_command(command, _step)

    from ckpt.cli._clean import add_clean_command

    add_clean_command(command, _options)

    c = command("diff", "compare two checkpoints, values included",
                "Compare two checkpoints: key paths only in A or only in B, changes of kind, shape or dtype, "
                "and for every array present in both with the same shape whether the values are equal (with "
                "the number of differing elements and the largest absolute difference; NaN equals NaN). "
                "Arrays are streamed block by block, so memory stays bounded, and read as restore reads them: "
                "every chunk is checked against its CRC-32C, and a missing, short or corrupted chunk is an "
                "error naming leaf, chunk and file. With --atol/--rtol, arrays whose elements are all within "
                "atol + rtol * |B| count as equal (numpy.isclose). Metrics and user metadata that differ are "
                "listed too. A and B may also be Orbax checkpoints or safetensors (a file, an index, a "
                "directory), read as ckpt.restore reads them (a safetensors tensor whole). Exit status 0 "
                "when identical, 1 when anything differs.")
    c.add_argument("a", metavar="A", help=f"first checkpoint (or manager directory: latest step; {where})")
    c.add_argument("b", metavar="B", help="second checkpoint (or manager directory: latest step)")
    c.add_argument("--json", action="store_true", help="print one JSON document")
    c.add_argument("--block-bytes", type=_size, default=64 << 20, metavar="SIZE",
                   help="largest block compared at once, per checkpoint (default 64MiB)")
    c.add_argument("--atol", type=_tolerance, default=0.0, metavar="X",
                   help="absolute tolerance: elements within atol + rtol * |B| are equal (default 0: exactly)")
    c.add_argument("--rtol", type=_tolerance, default=0.0, metavar="X",
                   help="relative tolerance, of B's value, as numpy.isclose (default 0)")
    c.set_defaults(run=_cmd_diff)

    c = command("plan", "dry-run a restore onto a mesh that need not exist here",
                "Compute what restore(PATH, mesh=...) would read on a mesh given by axis sizes, without any "
                "devices: bytes and chunks each process reads, the bytes its devices need, and the read "
                "amplification (bytes read / bytes needed). Saved PartitionSpecs are matched to the mesh by "
                "axis name, as restore(mesh=) does (--axis-names renames saved axes, as its axis_names=); "
                "leaves that cannot be placed are counted by reason, with a hint when the mesh lacks saved axes "
                "(exit status 1). Devices are assumed to fill the mesh in row-major order, each process "
                "holding a contiguous block of devices/processes of them.\n\n"
                "example: ckpt plan /ckpts/step_00001000 --mesh data=2,model=4 --processes 2")
    c.add_argument("path", metavar="PATH", help=f"checkpoint or manager directory ({where})")
    c.add_argument("--mesh", required=True, metavar="AXIS=SIZE,...", help="target mesh, e.g. data=2,model=4")
    c.add_argument("--axis-names", metavar="SAVED=AXIS,...",
                   help="saved mesh axis names to read as these axes of --mesh, as restore(axis_names=) does, "
                        "e.g. data=x,model=y")
    c.add_argument("--processes", type=int, default=1, metavar="N", help="number of processes (default 1)")
    c.add_argument("--step", type=_step, metavar="N", help=step_help)
    c.add_argument("--per-leaf", action="store_true", help="also print the numbers of every leaf")
    c.add_argument("--json", action="store_true", help="print one JSON document (per process and per leaf)")
    c.set_defaults(run=_cmd_plan)

    c = command("bench", "measure save and restore against the raw disk",
                "Measure ckpt save and restore against a raw-disk baseline in the same run: a "
                "transformer-like tree of about --gib GiB on a 4x2 mesh of 8 CPU devices; its unique "
                "shards written and read as plain files (fsynced, page cache emptied before each read) "
                "beside a ckpt save and restores onto the same sharding (with and without checksum "
                "verification), onto mesh (2,4) and onto one device. Prints medians over --runs, "
                "throughputs and ratios to the baseline. Every shard of every restore is compared with "
                "what was saved; a difference is an error. The other developer benchmarks (Orbax, object "
                "stores, many small leaves, host memory) are run from the repository: python -m bench.\n\n"
                "example: ckpt bench --gib 2 --runs 3 --dir /mnt/scratch", location=False)
    from ckpt.cli._bench import add_bench_arguments

    add_bench_arguments(c)
    c.set_defaults(run=_cmd_bench)
    return p


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None:
        text = f"{e.strerror or e}: {e.filename}"
    else:
        text = str(e) or type(e).__name__
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of `ckpt`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else None
    try:
        parser = _parser()
        parser.argv = argv  # type: ignore[attr-defined]  # for the suggestions of _did_you_mean
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        if args.command == "bench":
            return args.run(args)
        from ckpt.cli._opened import quiet_native_logs

        with quiet_native_logs():
            return args.run(args)
    except (CheckpointError, OSError, _UsageError, ValueError, TypeError) as e:
        # ValueError / TypeError: bad input found past argument parsing (e.g. an engine option
        # the storage refuses); still the user's to fix, so one line rather than a traceback.
        if isinstance(e, BrokenPipeError):
            return _broken_pipe()
        print(f"{_label(command)}: error: {_in_flags(_one_line(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{_label(command)}: interrupted", file=sys.stderr)
        return 130


def _label(command: str | None) -> str:
    return f"ckpt {command}" if command in COMMANDS else "ckpt"


def _broken_pipe() -> int:
    # The reader went away (ckpt inspect ... | head): no traceback, and no second error at exit.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141


if __name__ == "__main__":
    sys.exit(main())
