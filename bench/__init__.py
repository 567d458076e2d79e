"""The developer benchmarks of jax-ckpt (docs/benchmarks.md). Not installed with the package
(pyproject's package find takes only ckpt*): run them from the repository root, with jax-ckpt
installed (pip install -e .)::

    python -m bench --gib 2                     # the disk: save/restore against raw writes/reads
    python -m bench --leaves 400,4000           # many small leaves, beside Orbax when installed
    python -m bench --url s3://bucket/prefix    # object stores (--seaweedfs: a local one)
    python -m bench --memory                    # peak host memory, each measurement in a fresh process
    python -m bench --compression               # lossless codecs on a trained state, per leaf kind
    python -m bench.quick                       # the quick regression check against bench/baseline.json
    python -m bench.bench_replicas --seaweedfs  # replicated state restored on 2/4/8 processes, beside Orbax

Modules: bench.py (the modes and their command line), bench_memory.py (the memory benchmark's
parent) and bench_memory_child.py (its children), common.py (the tree, the raw baselines),
quick.py (``make bench-quick``: the headline ratios at a small size, compared with baseline.json),
bench_replicas.py (issue 24: restoring replicated state in a multi-process job).
`ckpt bench` (ckpt/cli/_bench.py) is the disk benchmark alone, for installed copies.
"""
