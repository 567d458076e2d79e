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
from ckpt._options import Options
from ckpt.storage import ENGINES

COMMANDS = ("ls", "inspect", "verify", "diff", "plan", "bench")


class _UsageError(Exception):
    """A bad argument value: reported like any other error, in one line."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors (usage text plus message) turned into the one-line error every
    other failure gets, so that scripts can rely on one line and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def _step(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad step {text!r} (a whole number >= 0)") from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"bad step {text!r}: steps are >= 0")
    return step


def _size(text: str) -> int:
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1:] if t[-1:] in units else ""
    number = t[: len(t) - len(unit)]
    if not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 65536, 64k, 64MiB)")
    return int(number) * units[unit]


def _print_json(doc) -> None:
    print(json.dumps(doc, indent=2))


def _note(opened) -> None:
    if opened.note:
        print(f"using {opened.note}", file=sys.stderr)


def _options(args) -> Options:
    return Options(engine=args.engine).resolved()


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
    else:
        print(render_ls(rows))
    return 0


def _cmd_inspect(args) -> int:
    from ckpt.cli._render import inspect_document, render_inspect

    opened = _open(args, args.path, args.step)
    doc = inspect_document(opened)
    if args.json:
        _print_json(doc)
    else:
        print(render_inspect(doc, opened.manifest))
    return 0


def _cmd_verify(args) -> int:
    from ckpt.cli._render import human_bytes
    from ckpt.cli._verify import ProgressBar, verify_checkpoint

    opened = _open(args, args.path, args.step)
    show = sys.stderr.isatty() and not args.no_progress
    bar = ProgressBar(sys.stderr) if show else None
    try:
        report = verify_checkpoint(opened.storage, opened.manifest, bar)
    finally:
        if bar is not None:
            bar.close()
    rate = report.bytes / report.seconds if report.seconds > 0 else 0.0
    print(f"verified {opened.root}")
    print(
        f"read {report.chunks} chunks of {report.arrays} arrays ({human_bytes(report.bytes)}) and checked "
        f"{report.inline_arrays} inline arrays in {report.seconds:.2f} s ({human_bytes(rate)}/s)"
    )
    for problem in report.problems:
        print(f"BAD {problem}")
    if report.intact:
        print("result: intact, every chunk matches its checksum")
        return 0
    bad_chunks = sum(p.chunk is not None for p in report.problems)
    bad_arrays = len({p.leaf for p in report.problems})
    print(f"result: DAMAGED, {bad_chunks} bad chunk(s) and {len(report.problems) - bad_chunks} bad array "
          f"metadata file(s) in {bad_arrays} array(s)")
    return 1


def _cmd_diff(args) -> int:
    from ckpt.cli._diff import diff_checkpoints, diff_document, render_diff

    a, b = _open(args, args.a), _open(args, args.b)
    report = diff_checkpoints(a, b, args.block_bytes, _options(args))
    if args.json:
        _print_json(diff_document(report))
    else:
        print(render_diff(report))
    return 0 if report.identical else 1


def _cmd_plan(args) -> int:
    from ckpt.cli._plan import dry_run_document, dry_run_restore, parse_mesh, render_dry_run

    try:
        names, sizes = parse_mesh(args.mesh)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    opened = _open(args, args.path, args.step)
    try:
        run = dry_run_restore(opened.manifest, names, sizes, args.processes)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    if args.json:
        _print_json(dry_run_document(run, opened.root))
    else:
        print(render_dry_run(run, opened.root, args.per_leaf))
    return 1 if run.unplaceable else 0


def _cmd_bench(argv: Sequence[str]) -> int:
    try:
        from ckpt import bench
    except ModuleNotFoundError as e:
        if e.name != "ckpt.bench":
            raise
        raise CheckpointError("the benchmark module ckpt.bench is not part of this installation") from None
    return int(bench.main(list(argv)) or 0)


def _parser() -> argparse.ArgumentParser:
    from ckpt import __version__

    p = _Parser(
        prog="ckpt",
        description="Look inside jax-ckpt checkpoints: list steps, show what is saved, check integrity, "
        "compare two checkpoints, and plan a restore on another mesh. Run 'ckpt CMD --help' for one command.",
        epilog="Exit status: 0 success; 1 verify found damage, diff found differences, or plan found leaves "
        "it cannot place; 2 an error (printed as one line on stderr).",
    )
    p.add_argument("--version", action="version", version=f"ckpt (jax-ckpt) {__version__}")
    sub = p.add_subparsers(dest="command", metavar="CMD")
    engine_help = ("storage engine to read with (default: local for paths and file://, tensorstore for "
                   "memory://, s3://, gs://, fsspec for other URLs)")

    def command(name: str, summary: str, description: str, *, location: bool = True) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=summary, description=description,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if location:
            c.add_argument("--engine", choices=ENGINES, help=engine_help)
        return c

    where = "a local path or URL: file://, memory://, s3://, gs://, any fsspec URL"
    step_help = "in a manager directory, use this step (default: the latest committed step)"
    c = command("ls", "list the steps of a manager directory (or one checkpoint)",
                "List every step directory of a manager directory: step, committed or not, size, number of "
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
                "then the totals.")
    c.add_argument("path", metavar="PATH", help=f"checkpoint or manager directory ({where})")
    c.add_argument("--step", type=_step, metavar="N", help=step_help)
    c.add_argument("--json", action="store_true", help="print the same as one JSON document")
    c.set_defaults(run=_cmd_inspect)

    c = command("verify", "read every chunk and check its CRC-32C",
                "Read every chunk file of every array and check its size and CRC-32C against the manifest, "
                "and each array's zarr.json against the manifest. Continues past a bad chunk so that every "
                "bad chunk is named. Exit status 0 only when everything is intact, 1 when anything is "
                "damaged. On a terminal, shows a progress bar with bytes per second on stderr.")
    c.add_argument("path", metavar="PATH", help=f"checkpoint or manager directory ({where})")
    c.add_argument("--step", type=_step, metavar="N", help=step_help)
    c.add_argument("--no-progress", action="store_true", help="no progress bar, even on a terminal")
    c.set_defaults(run=_cmd_verify)

    c = command("diff", "compare two checkpoints, values included",
                "Compare two checkpoints: key paths only in A or only in B, changes of kind, shape or dtype, "
                "and for every array present in both with the same shape whether the values are equal (with "
                "the number of differing elements and the largest absolute difference; NaN equals NaN). "
                "Arrays are streamed block by block, so memory stays bounded, and read as restore reads them: "
                "every chunk is checked against its CRC-32C, and a missing, short or corrupted chunk is an "
                "error naming leaf, chunk and file. Exit status 0 when identical, 1 when anything differs.")
    c.add_argument("a", metavar="A", help=f"first checkpoint (or manager directory: latest step; {where})")
    c.add_argument("b", metavar="B", help="second checkpoint (or manager directory: latest step)")
    c.add_argument("--json", action="store_true", help="print one JSON document")
    c.add_argument("--block-bytes", type=_size, default=64 << 20, metavar="SIZE",
                   help="largest block compared at once, per checkpoint (default 64MiB)")
    c.set_defaults(run=_cmd_diff)

    c = command("plan", "dry-run a restore onto a mesh that need not exist here",
                "Compute what restore(PATH, mesh=...) would read on a mesh given by axis sizes, without any "
                "devices: bytes and chunks each process reads, the bytes its devices need, and the read "
                "amplification (bytes read / bytes needed). Saved PartitionSpecs are matched to the mesh by "
                "axis name, as restore(mesh=) does; leaves that cannot be placed are listed with the reason "
                "(exit status 1). Devices are assumed to fill the mesh in row-major order, each process "
                "holding a contiguous block of devices/processes of them.\n\n"
                "example: ckpt plan /ckpts/step_00001000 --mesh data=2,model=4 --processes 2")
    c.add_argument("path", metavar="PATH", help=f"checkpoint or manager directory ({where})")
    c.add_argument("--mesh", required=True, metavar="AXIS=SIZE,...", help="target mesh, e.g. data=2,model=4")
    c.add_argument("--processes", type=int, default=1, metavar="N", help="number of processes (default 1)")
    c.add_argument("--step", type=_step, metavar="N", help=step_help)
    c.add_argument("--per-leaf", action="store_true", help="also print the numbers of every leaf")
    c.add_argument("--json", action="store_true", help="print one JSON document (per process and per leaf)")
    c.set_defaults(run=_cmd_plan)

    command("bench", "run the benchmark (python -m ckpt.bench); arguments are passed on",
            "Run the save/restore benchmark, exactly as 'python -m ckpt.bench ARGS'. "
            "'ckpt bench --help' shows its options.", location=False)
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
        if command == "bench":
            return _cmd_bench(argv[1:])
        parser = _parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        return args.run(args)
    except (CheckpointError, OSError, _UsageError, ValueError, TypeError) as e:
        # ValueError / TypeError: bad input found past argument parsing (e.g. an engine option
        # the storage refuses); still the user's to fix, so one line rather than a traceback.
        if isinstance(e, BrokenPipeError):
            return _broken_pipe()
        print(f"{_label(command)}: error: {_one_line(e)}", file=sys.stderr)
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
