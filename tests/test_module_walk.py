"""One save and one restore, module by module (issue 33): a single-process save and a resharding
restore on local disk each run code in at most 14 modules of ``ckpt/``, counted by tracing which
modules' functions are called (helpers included, on every thread), and docs/design.md walks them
in the order they are first entered."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
MOST = 14

# A fresh process: the profiler is set before jax and ckpt are imported, so that every thread the
# library starts (its I/O pools included) carries it; only calls made while a save or restore
# runs are recorded, after one of each has run (imports and first-call paths out of the way).
_TRACE = textwrap.dedent("""
    import os, sys, tempfile, threading
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    seen, current = {"save": [], "restore": []}, [None]

    def profile(frame, event, arg):
        if event == "call" and current[0] is not None:
            module = frame.f_globals.get("__name__", "")
            if module.startswith("ckpt") and frame.f_code.co_name != "<module>" and module not in seen[current[0]]:
                seen[current[0]].append(module)

    sys.setprofile(profile)
    threading.setprofile(profile)
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import ckpt

    mesh, other = jax.make_mesh((4, 2), ("data", "model")), jax.make_mesh((2, 4), ("data", "model"))
    w = np.arange(256 * 128, dtype=np.float32).reshape(256, 128)
    tree = {"w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(np.ones(128, np.float32), NamedSharding(mesh, P())), "step": 3}
    d = tempfile.mkdtemp()
    ckpt.save(os.path.join(d, "warm"), tree)
    ckpt.restore(os.path.join(d, "warm"), mesh=other)
    current[0] = "save"
    ckpt.save(os.path.join(d, "c"), tree)
    current[0] = "restore"
    out = ckpt.restore(os.path.join(d, "c"), mesh=other)
    current[0] = None
    assert out["w"].sharding.mesh.devices.shape == (2, 4)
    for shard in out["w"].addressable_shards:
        assert (np.asarray(shard.data) == w[shard.index]).all()
    for name, modules in seen.items():
        print(name, " ".join(modules))
""")


def _traced() -> dict[str, list[str]]:
    out = subprocess.run([sys.executable, "-c", _TRACE], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines() if line.startswith(("save ", "restore "))}


def _walk(section: str) -> list[str]:
    """The modules docs/design.md's `section` names in its "Modules, in the order" paragraph."""
    text = (ROOT / "docs" / "design.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    paragraph = body.split("Modules, in the order", 1)[1].split("\n\n", 1)[0]
    return ["ckpt." + m.replace("/", ".").removesuffix(".py").removesuffix(".__init__")
            for m in re.findall(r"`ckpt/([\w/]+\.py)`", paragraph)]


def test_a_save_and_a_resharding_restore_each_run_at_most_14_modules_as_the_design_walks_them():
    traced = _traced()
    for name, section in (("save", "A save, file by file"), ("restore", "A restore, file by file")):
        modules = traced[name]
        assert len(modules) <= MOST, f"a {name} ran {len(modules)} modules of ckpt/: {modules}"
        assert _walk(section) == modules, (
            f"docs/design.md's walk of a {name} ({section!r}) is not the traced order: {modules}")
