"""Train a small MLP with checkpoints through ckpt.CheckpointManager, and resume it.

Plain JAX: SGD with momentum on synthetic regression data, on a mesh of 8 CPU devices
('data' x 'model', 4x2 by default). The training state is donated to each step, so the arrays
a save was given are overwritten right after ``manager.save`` returns: the save has its own
host copy by then. Each step's batch is a pure function of the step number, so a resumed run
computes exactly what an uninterrupted one would.

    python examples/train.py --dir /tmp/run --steps 20                       # train, save every 5
    python examples/train.py --dir /tmp/run --steps 40 --resume --mesh 2x4   # continue elsewhere
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "jax" not in sys.modules:  # 8 CPU devices, set before jax starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt

IN, HIDDEN, OUT, BATCH = 32, 128, 8, 64
LEARNING_RATE, MOMENTUM = 0.05, 0.9
DATA_SEED, INIT_SEED = 1234, 0

# Hidden units are split over 'model', examples over 'data'.
PARAM_SPECS = {
    "layer1": {"w": P(None, "model"), "b": P("model")},
    "layer2": {"w": P("model", None), "b": P()},
    "out": {"w": P(None, None), "b": P()},
}


def make_mesh(shape: tuple[int, int]) -> Mesh:
    data, model = shape
    devices = np.array(jax.devices()[: data * model]).reshape(data, model)
    return Mesh(devices, ("data", "model"))


def parse_mesh(text: str) -> tuple[int, int]:
    try:
        data, model = (int(n) for n in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh must look like 4x2, got {text!r}") from None
    return data, model


def state_shardings(mesh: Mesh) -> dict:
    params = jax.tree.map(lambda spec: NamedSharding(mesh, spec), PARAM_SPECS,
                          is_leaf=lambda x: isinstance(x, P))
    return {"params": params, "momentum": params, "step": NamedSharding(mesh, P())}


def init_state(mesh: Mesh) -> dict:
    """Fresh parameters, zero momentum and step 0, laid out on `mesh`."""
    k1, k2, k3 = jax.random.split(jax.random.key(INIT_SEED), 3)
    params = {
        "layer1": {"w": jax.random.normal(k1, (IN, HIDDEN)) / np.sqrt(IN), "b": jnp.zeros(HIDDEN)},
        "layer2": {"w": jax.random.normal(k2, (HIDDEN, HIDDEN)) / np.sqrt(HIDDEN), "b": jnp.zeros(HIDDEN)},
        "out": {"w": jax.random.normal(k3, (HIDDEN, OUT)) / np.sqrt(HIDDEN), "b": jnp.zeros(OUT)},
    }
    state = {"params": params, "momentum": jax.tree.map(jnp.zeros_like, params), "step": jnp.int32(0)}
    return jax.device_put(state, state_shardings(mesh))


def batch(step, mesh: Mesh):
    """The batch of `step`: a pure function of the step number."""
    key = jax.random.fold_in(jax.random.key(DATA_SEED), step)
    kx, kn = jax.random.split(key)
    x = jax.random.normal(kx, (BATCH, IN))
    y = jnp.sin(x[:, :OUT]) + 0.5 * x[:, OUT:2 * OUT] + 0.01 * jax.random.normal(kn, (BATCH, OUT))
    data = NamedSharding(mesh, P("data", None))
    return jax.lax.with_sharding_constraint(x, data), jax.lax.with_sharding_constraint(y, data)


def loss_fn(params, x, y):
    h = jax.nn.relu(x @ params["layer1"]["w"] + params["layer1"]["b"])
    h = jax.nn.relu(h @ params["layer2"]["w"] + params["layer2"]["b"])
    pred = h @ params["out"]["w"] + params["out"]["b"]
    return jnp.mean((pred - y) ** 2)


def make_train_step(mesh: Mesh):
    """A jitted step(state) -> (state, loss) on `mesh` that donates `state`."""
    shardings = state_shardings(mesh)

    def step_fn(state):
        x, y = batch(state["step"], mesh)
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
        momentum = jax.tree.map(lambda m, g: MOMENTUM * m + g, state["momentum"], grads)
        params = jax.tree.map(lambda p, m: p - LEARNING_RATE * m, state["params"], momentum)
        return {"params": params, "momentum": momentum, "step": state["step"] + 1}, loss

    return jax.jit(step_fn, donate_argnums=0, out_shardings=(shardings, NamedSharding(mesh, P())))


def restore_state(manager: ckpt.CheckpointManager, mesh: Mesh, step: int | None = None) -> dict:
    """The saved state of `step` (default: latest), resharded onto `mesh`."""
    return manager.restore(step, state_shardings(mesh))


def train(manager: ckpt.CheckpointManager | None, state: dict, step_fn, stop: int, log=None) -> dict:
    """Run steps until state['step'] == stop, offering the state to `manager` before each
    step and at the end. Returns the final state."""
    step = int(state["step"])
    loss = None
    while True:
        if manager is not None:
            preempted = manager.reached_preemption(step)
            force = preempted or step == stop
            # float(loss) waits for the step: only when saving, so steps otherwise run ahead.
            if force or manager.should_save(step):
                metadata = {"loss": None if loss is None else float(loss), "next_batch": step}
                if manager.save(step, state, force=force, metadata=metadata) and log:
                    log(f"step {step:4d}  saved (loss {metadata['loss']})")
            if preempted:
                if log:
                    log(f"step {step:4d}  preemption: saved, stopping")
                break
        if step == stop:
            break
        state, loss = step_fn(state)  # donates the previous state
        step += 1
    return state


def param_digest(state: dict) -> str:
    """A short fingerprint of every parameter and momentum bit, to compare runs by eye."""
    import hashlib

    h = hashlib.sha256()
    for leaf in jax.tree.leaves({"params": state["params"], "momentum": state["momentum"]}):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="checkpoint directory of the run")
    parser.add_argument("--steps", type=int, default=20, help="train until this step")
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--max-to-keep", type=int, default=3)
    parser.add_argument("--mesh", type=parse_mesh, default=(4, 2), help="data x model devices, e.g. 4x2 or 2x4")
    parser.add_argument("--resume", action="store_true", help="continue from the latest saved step")
    args = parser.parse_args(argv)

    mesh = make_mesh(args.mesh)
    say = lambda text: print(text, flush=True)  # noqa: E731
    with ckpt.CheckpointManager(args.dir, max_to_keep=args.max_to_keep,
                                save_interval_steps=args.save_every) as manager:
        if args.resume:
            latest = manager.latest_step()
            if latest is None:
                say(f"nothing to resume in {args.dir}")
                return 1
            t0 = time.perf_counter()
            state = restore_state(manager, mesh, latest)
            saved_mesh = ckpt.metadata(manager.step_path(latest))["params"]["layer1"]["w"].mesh
            say(f"restored step {latest} from {manager.step_path(latest)} in {time.perf_counter() - t0:.2f} s")
            say(f"  saved on mesh {saved_mesh}, now on mesh {dict(mesh.shape)}")
            say(f"  metadata {manager.metadata(latest)}")
            say(f"  state step {int(state['step'])}, params+momentum digest {param_digest(state)}")
        else:
            if manager.latest_step() is not None:
                say(f"{args.dir} already holds steps {manager.all_steps()}: pass --resume or use a new --dir")
                return 1
            state = init_state(mesh)
        start = int(state["step"])
        t0 = time.perf_counter()
        state = train(manager, state, make_train_step(mesh), args.steps, log=say)
        manager.wait()
        elapsed = time.perf_counter() - t0
        say(f"trained steps {start}..{int(state['step'])} on mesh {dict(mesh.shape)} in {elapsed:.2f} s; "
            f"kept steps {manager.all_steps()}; params+momentum digest {param_digest(state)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
