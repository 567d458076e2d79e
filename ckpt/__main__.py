"""`python -m ckpt ...` is the `ckpt` command."""

import sys

from ckpt.cli import main

sys.exit(main())
