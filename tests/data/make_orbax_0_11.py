"""How tests/data/orbax-0.11.0 was written: orbax-checkpoint 0.11.0 with jax 0.5.0 and optax 0.2.4
(a separate virtual environment; orbax 0.11.0 does not import with newer jax), 8 CPU devices:

    python -m venv /tmp/v011 && /tmp/v011/bin/pip install orbax-checkpoint==0.11.0 jax==0.5.0 \\
        jaxlib==0.5.0 optax==0.2.4
    /tmp/v011/bin/python tests/data/make_orbax_0_11.py tests/data/orbax-0.11.0

Not run by the tests (they read what it wrote). Orbax 0.11.0 cannot save typed PRNG keys, so
the state holds a raw uint32 key only.
"""

import os
import shutil
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

out = os.path.abspath(sys.argv[1])
shutil.rmtree(out, ignore_errors=True)
mesh = jax.make_mesh((4, 2), ("data", "model"))


def put(a, *spec):
    return jax.device_put(a, NamedSharding(mesh, P(*spec)))


params = {
    "w": put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 7, "data", "model"),
    "emb": put((np.arange(128 * 16, dtype=np.float32).reshape(128, 16) % 97).astype(ml_dtypes.bfloat16), None, "model"),
    "q": put((np.arange(16 * 64) % 251 - 125).astype(np.int8).reshape(16, 64), "data", None),
}
state = {"params": params, "opt": optax.adam(1e-3).init(params), "step": 3, "raw_key": jax.random.PRNGKey(5)}
with ocp.CheckpointManager(os.path.join(out, "manager")) as m:
    m.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({"step": 3})))
    m.wait_until_finished()
ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(os.path.join(out, "zarr2"),
                                                                      args=ocp.args.PyTreeSave(state))
