"""The `ckpt` command line (placeholder until the CLI issue lands)."""

import sys


def main(argv=None) -> int:
    print("usage: ckpt {ls,inspect,verify,diff,plan,bench} ...", file=sys.stderr)
    return 2
