"""The `ckpt` command line (docs/cli.md): ls, inspect, verify, du, diff, plan, export, bench (and
the commands registered beside them in ``_main``).

Kept apart from the library: nothing in ``ckpt`` imports it, and it reads checkpoints only
through the public storage interface and the same readers restore uses.
"""

from ckpt.cli._main import main

__all__ = ["main"]
