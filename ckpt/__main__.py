"""`python -m ckpt ...` is the `ckpt` command."""

import sys

from ckpt._cli import main

sys.exit(main())
