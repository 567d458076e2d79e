"""I/O errors on every write and fsync of a save, injected through the storage interface
(support.FaultyStorage), and real ones from the kernel: the error a save reports is the truth.

* Before the commit point (every chunk, metadata and manifest write, the fsync of the staged
  directory, the rename): the save fails with OSError (the injected errno) or CheckpointError,
  the previous checkpoint is byte-identical, and nothing is left behind.
* After it (the fsync of the parent directory after the rename): the save raises
  NotDurableError, saying the checkpoint WAS committed; it is in place and restores; a manager
  treats the step as saved.

Every call site is found by tracing a clean save, so new writes are covered without editing this
file. Short run: the first and last call of each operation; CKPT_ADVERSARIAL=long: every call.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt.storage import NotDurableError
from support import Faults, Location, snapshot

LONG = os.environ.get("CKPT_ADVERSARIAL") == "long"
ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO, "EFBIG": errno.EFBIG}
# Storage operations that write or make durable: what a save must survive failing.
WRITE_OPS = ("write_chunk", "create_array", "put_group", "put", "put_if_absent", "sync", "publish")
FUTURE_OPS = ("write_chunk", "create_array", "put_group", "put")  # errors may also come from their futures


def _tree(version: float):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    return {
        # More than the 1 MiB under which small arrays are packed: written shard by shard.
        "w": jax.device_put(np.full((1024, 512), version, np.float32), NamedSharding(mesh, P("data", "model"))),
        "b": jax.device_put(np.full((1024, 384), version, np.float32), NamedSharding(mesh, P("data"))),
        "small": np.full((4,), version, np.float32),
        "version": version,
    }


def _assert_holds(path, version):
    out = ckpt.restore(path)
    assert out["version"] == version
    for name in ("w", "b", "small"):
        assert np.array_equal(out[name], np.full(out[name].shape, version, np.float32)), name


def _sites(kind: str, tmp_path) -> list[tuple[str, int, bool]]:
    """(op, call number, after the commit point) of the write and sync calls of a clean
    overwrite: all of them (long run), or the first and last call of each operation. On a rename
    backend the commit point is the rename (``publish``); elsewhere the manifest write."""
    loc = Location.make(kind, tmp_path / "trace")
    path = loc("c")
    ckpt.save(path, _tree(1.0))
    faults = Faults()
    ckpt.save(path, _tree(2.0), overwrite=True, options=faults.options())
    loc.cleanup()
    calls: dict[str, list[bool]] = {}
    committed = False
    for op, where in faults.log:
        if op in WRITE_OPS:
            calls.setdefault(op, []).append(committed)
        committed = committed or op == "publish" or (op == "put" and where.endswith("/manifest.msgpack"))
    sites = []
    for op, flags in calls.items():
        picks = range(len(flags)) if LONG else sorted({0, len(flags) - 1})
        sites += [(op, k, flags[k]) for k in picks]
    return sites


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_every_write_and_sync_failure_is_reported_truthfully(kind, tmp_path):
    sites = _sites(kind, tmp_path)
    ops = {op for op, _, _ in sites}
    assert {"write_chunk", "create_array", "put_group"} <= ops, ops
    if kind == "local":
        assert {"put_if_absent", "sync", "publish"} <= ops, ops  # manifest, fsyncs, rename
    loc = Location.make(kind, tmp_path / "runs")
    checked = 0
    for n, (op, k, after_commit) in enumerate(sites):
        for name, code in ERRNOS.items():
            for in_future in ([False, True] if op in FUTURE_OPS else [False]):
                path = loc(f"c{n}-{name}-{int(in_future)}")
                ckpt.save(path, _tree(1.0))
                parent = loc.storage(os.path.basename(path)).parent()
                before = snapshot(parent)
                faults = Faults()
                faults.fail(op, lambda w, c=code, nm=name: OSError(c, f"{nm} (injected)", w), after=k, times=1,
                            in_future=in_future)
                label = f"{op} #{k} {name}{' in future' if in_future else ''}"
                if after_commit:
                    with pytest.raises(NotDurableError, match="was committed") as e:
                        ckpt.save(path, _tree(2.0), overwrite=True, options=faults.options())
                    assert e.value.committed and name in str(e.value), label
                    _assert_holds(path, 2.0)  # in place and readable
                else:
                    with pytest.raises((OSError, ckpt.CheckpointError)) as e:
                        ckpt.save(path, _tree(2.0), overwrite=True, options=faults.options())
                    assert not isinstance(e.value, NotDurableError), label
                    err = e.value
                    assert (isinstance(err, OSError) and err.errno == code) or name in str(err), (label, err)
                    after = snapshot(parent)
                    assert {k: after.get(k) for k in before} == before, f"{label}: the previous checkpoint changed"
                    if not (kind == "memory" and op == "put"):
                        assert after == before, f"{label}: something was left behind: {set(after) - set(before)}"
                    # (A manifest write that failed may have landed, for all the save knows: its
                    # generation stays, without an owner record, for the next cleanup.)
                    _assert_holds(path, 1.0)
                checked += 1
    assert checked >= len(sites) * len(ERRNOS)
    loc.cleanup()


def test_manager_treats_a_commit_that_may_not_be_durable_as_saved(tmp_path):
    faults = Faults()
    directory = tmp_path / "run"
    manager = ckpt.CheckpointManager(directory, options=faults.options())
    manager.save(1, _tree(1.0))
    manager.wait()
    faults.fail("sync", lambda w: OSError(errno.EIO, "EIO (injected)", w), times=1,
                when=lambda where, args: where == str(directory))
    manager.save(2, _tree(2.0))
    with pytest.warns(RuntimeWarning, match="step 2: .*was committed"):
        manager.wait()
    assert manager.all_steps() == [1, 2]
    assert not manager.should_save(2) and not manager.save(2, _tree(3.0))  # never saved twice
    _assert_holds(manager.step_path(2), 2.0)
    manager.close()


EFBIG_CHILD = textwrap.dedent("""
    import os, resource, signal, sys
    import ckpt
    sys.path[:0] = [sys.argv[2], os.path.dirname(sys.argv[2])]
    from test_faults import _tree
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the kernel then fails the write with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
    try:
        ckpt.save(sys.argv[1], _tree(2.0), overwrite=True)
    except (OSError, ckpt.CheckpointError) as e:
        print(type(e).__name__, getattr(e, "errno", None), str(e)[:300])
    else:
        print("saved")
""")


def test_a_real_efbig_from_the_kernel_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path):
    """POSIX only: RLIMIT_FSIZE makes every chunk write past 256 KiB fail in the kernel (EFBIG),
    through TensorStore's direct-I/O writes: the save reports it as OSError(EFBIG)."""
    path = tmp_path / "c"
    ckpt.save(path, _tree(1.0))
    before = snapshot(Location.make("local", tmp_path).storage())
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", EFBIG_CHILD, str(path), os.path.dirname(os.path.abspath(__file__))],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(f"OSError {errno.EFBIG} "), out.stdout
    assert snapshot(Location.make("local", tmp_path).storage()) == before
    _assert_holds(path, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.save(path, _tree(3.0), overwrite=True)  # and the next save is not confused
    _assert_holds(path, 3.0)
