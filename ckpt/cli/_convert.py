"""`ckpt convert SRC DEST`: write a jax-ckpt checkpoint from an Orbax checkpoint (ckpt.convert)."""

from __future__ import annotations

import sys
import time

from ckpt._host import Options

DESCRIPTION = (
    "Write a jax-ckpt checkpoint at DEST holding what the Orbax checkpoint SRC holds (orbax-checkpoint 0.11 "
    "and 0.12: StandardSave / PyTreeSave items in the OCDBT or per-array Zarr layout, or a CheckpointManager "
    "step directory with all its items; a CheckpointManager directory converts its latest step, or --step N). "
    "Orbax is not needed. Arrays keep their dtypes and the mesh and PartitionSpec Orbax recorded, so "
    "'restore(DEST, mesh=...)' places them as before; typed PRNG keys stay keys. Leaves are streamed one at a "
    "time (at most one leaf in host memory) and DEST is committed atomically, with a CRC-32C per chunk.\n\n"
    "example: ckpt convert /ckpts/orbax_run/1000/state /ckpts/run/step_00001000"
)


def add_convert_command(command, step_type) -> None:
    """Register `convert` with the parser's command factory (``_main._parser``)."""
    c = command("convert", "write a jax-ckpt checkpoint from an Orbax checkpoint", DESCRIPTION)
    c.add_argument("src", metavar="SRC", help="Orbax checkpoint, step or CheckpointManager directory")
    c.add_argument("dest", metavar="DEST", help="where to write the jax-ckpt checkpoint (a path or URL)")
    c.add_argument("--step", type=step_type, metavar="N",
                   help="in an Orbax CheckpointManager directory, convert this step (default: the latest)")
    c.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at DEST")
    c.set_defaults(run=cmd_convert)


def cmd_convert(args) -> int:
    from ckpt._convert import convert
    from ckpt.cli._orbax import orbax_source
    from ckpt.cli._render import human_bytes, plural

    options = Options(engine=args.engine).resolved()
    src, what, note = orbax_source(args.src, args.step, options)
    if note:
        print(f"using {note}", file=sys.stderr)
    start = time.perf_counter()
    convert(src, args.dest, overwrite=args.overwrite, options=options)
    seconds = time.perf_counter() - start
    from ckpt._restore import metadata

    meta = metadata(args.dest, options=options)
    import jax

    arrays = [m for m in jax.tree.leaves(meta) if hasattr(m, "nbytes")]
    print(f"converted {what} {src.url}")
    print(f"wrote {args.dest}: {plural(len(arrays), 'array')}, {human_bytes(sum(m.nbytes for m in arrays))} in {seconds:.2f} s")
    return 0
