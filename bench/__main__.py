"""``python -m bench ARGS``: the benchmarks' command line (bench/bench.py; ``--help`` lists it)."""

import sys

from bench.bench import main

sys.exit(main())
