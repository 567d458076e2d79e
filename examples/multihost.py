"""Save a sharded pytree from 2 processes, restore it on 4 processes and on 1: all on this machine.

    python examples/multihost.py [DIR]

The script launches copies of itself as local processes joined by ``jax.distributed`` (each
with a few CPU devices), the way a real job runs one process per host:

1. 2 processes x 4 devices save a training state sharded over a ('data', 'model') mesh. Each
   process writes only shards of its own devices; replicated arrays are split between them.
   Process 0 commits once both have finished.
2. 4 processes x 2 devices restore it onto a 4x2 mesh; each reads only what its devices hold,
   and checks every shard it got.
3. This process (no jax.distributed) restores it as numpy arrays.

On a cluster, run the worker part on every host with your launcher's process id and count
(``jax.distributed.initialize()`` detects them on TPU, SLURM and Open MPI); nothing in the
ckpt calls changes with the number of processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile


def expected(name: str, shape):
    """The values of leaf `name` (a numpy array), the same in every process."""
    import numpy as np

    seed = sum(map(ord, name))
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# leaf -> (shape, PartitionSpec entries over ('data', 'model'))
LEAVES = {
    "embed": ((512, 64), (None, "model")),
    "w1": ((64, 256), ("data", "model")),
    "w2": ((256, 64), ("model", "data")),
    "norm": ((64,), ()),  # replicated on every device of both processes
}


def worker(spec: dict) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import ckpt

    jax.config.update("jax_num_cpu_devices", spec["devices"])  # before jax uses a device
    jax.distributed.initialize(coordinator_address=spec["coordinator"], num_processes=spec["processes"],
                               process_id=spec["index"], heartbeat_timeout_seconds=30)
    me = f"[process {jax.process_index()}/{jax.process_count()}]"
    mesh = Mesh(np.array(jax.devices()).reshape(spec["processes"], spec["devices"]), ("data", "model"))
    path = spec["path"]
    if spec["role"] == "save":
        state = {
            "params": {
                name: jax.make_array_from_callback(
                    shape, NamedSharding(mesh, P(*entries)), lambda idx, full=expected(name, shape): full[idx]
                )
                for name, (shape, entries) in LEAVES.items()
            },
            "step": 1000,
        }
        ckpt.save(path, state)  # returns on every process once process 0 has committed
        print(f"{me} saved {path} from mesh {dict(mesh.shape)}", flush=True)
    else:
        restored = ckpt.restore(path, mesh=mesh)  # saved PartitionSpecs, this job's mesh
        shards = 0
        for name, (shape, _) in LEAVES.items():
            full = expected(name, shape)
            for shard in restored["params"][name].addressable_shards:
                assert np.array_equal(np.asarray(shard.data), full[shard.index]), (name, shard.index)
                shards += 1
        print(f"{me} restored onto mesh {dict(mesh.shape)}: {shards} local shards checked, "
              f"step {restored['step']}", flush=True)
    jax.distributed.shutdown()


def run_job(role: str, processes: int, devices: int, path: str) -> None:
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    children = []
    for i in range(processes):
        spec = {"role": role, "path": path, "coordinator": f"127.0.0.1:{port}", "processes": processes,
                "index": i, "devices": devices}
        children.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], env=env))
    codes = [c.wait(timeout=300) for c in children]
    if any(codes):
        sys.exit(f"{role} job failed: exit codes {codes}")


def main(root: str) -> None:
    path = os.path.join(root, "state")
    run_job("save", processes=2, devices=4, path=path)
    run_job("restore", processes=4, devices=2, path=path)

    import numpy as np

    import ckpt

    restored = ckpt.restore(path)  # no mesh, no target: numpy arrays on this host
    for name, (shape, _) in LEAVES.items():
        assert np.array_equal(restored["params"][name], expected(name, shape)), name
    print(f"[this process] restored {path} as numpy: {len(LEAVES)} arrays equal to what was saved")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
    elif len(sys.argv) > 2:
        sys.exit(__doc__)
    else:
        main(sys.argv[1] if len(sys.argv) == 2 else tempfile.mkdtemp(prefix="ckpt-multihost-"))
