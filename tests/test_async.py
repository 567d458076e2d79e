"""save_async: host copies owned before it returns (donation safety), SaveHandle.wait/done,
background failures with their traceback, and the bound on bytes in flight to storage. On local
disk and on memory://; writes are held or failed through support.FaultyStorage."""

import threading
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt._format.records import MANIFEST_NAME
from support import Faults, io_error


def _mesh():
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


def _tree(mesh):
    rng = np.random.default_rng(0)
    host = {
        "w": rng.standard_normal((64, 32)).astype(np.float32),
        "b": rng.standard_normal((2048,)).astype(np.float32),
        "m": rng.integers(0, 1000, (16, 128)).astype(np.int32),
    }
    specs = {"w": P("data", "model"), "b": P("model"), "m": P()}
    # Fresh device buffers (device_put of host arrays may alias them on CPU).
    arrays = {k: jax.device_put(jnp.array(v, copy=True), NamedSharding(mesh, specs[k])) for k, v in host.items()}
    return host, arrays


def _buffer_pointers(tree):
    return {k: sorted(s.data.unsafe_buffer_pointer() for s in v.addressable_shards) for k, v in tree.items()}


def test_donation_after_save_async_keeps_saved_values(location):
    mesh = _mesh()
    expected, arrays = _tree(mesh)
    faults = Faults()
    gate = faults.hold("write_chunk")
    before = _buffer_pointers(arrays)

    handle = ckpt.save_async(location("ck"), arrays, options=faults.options())
    assert gate.entered.wait(30)
    assert not handle.done()  # nothing is written yet: the gate holds the first chunk

    step = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 - 7, t), donate_argnums=0)
    updated = step(arrays)
    jax.block_until_ready(updated)
    assert all(v.is_deleted() for v in arrays.values())
    # The step wrote into the very buffers the save was given.
    assert _buffer_pointers(updated) == before
    assert all(np.all(np.asarray(v) == -7) for v in updated.values())
    for v in updated.values():
        v.delete()

    gate.release.set()
    handle.wait(timeout=60)
    assert handle.done()
    restored = ckpt.restore(location("ck"))
    assert restored.keys() == expected.keys()
    for k in expected:
        assert restored[k].dtype == expected[k].dtype
        assert np.array_equal(restored[k], expected[k]), k


def test_wait_timeout_and_done(location):
    mesh = _mesh()
    expected, arrays = _tree(mesh)
    faults = Faults()
    gate = faults.hold("write_chunk")
    handle = ckpt.save_async(location("ck"), arrays, options=faults.options())
    assert gate.entered.wait(30)
    with pytest.raises(TimeoutError, match="still running"):
        handle.wait(timeout=0.05)
    assert not handle.done()
    # Not committed while writes are held.
    assert not location.storage("ck").exists(MANIFEST_NAME)
    with pytest.raises((FileNotFoundError, ckpt.CheckpointError)):
        ckpt.restore(location("ck"))
    gate.release.set()
    handle.wait()
    assert handle.done()
    restored = ckpt.restore(location("ck"))
    for k in expected:
        assert np.array_equal(restored[k], expected[k]), k


def test_background_failure_reraised_with_traceback(location):
    _, arrays = _tree(_mesh())
    faults = Faults()
    faults.fail("write_chunk")
    handle = ckpt.save_async(location("ck"), arrays, options=faults.options())  # fails in the background
    with pytest.raises(OSError, match="injected") as info:
        handle.wait(timeout=60)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    # The traceback reaches from the save's writer down to the storage call that failed.
    assert "write_chunks" in frames and "write_chunk" in frames
    assert handle.done()
    assert location.names() == []  # no checkpoint, no temporary directory


def test_save_blocks_until_committed_and_raises(location):
    mesh = _mesh()
    expected, arrays = _tree(mesh)
    ckpt.save(location("ok"), arrays)
    restored = ckpt.restore(location("ok"))
    for k in expected:
        assert np.array_equal(restored[k], expected[k]), k

    faults = Faults()
    faults.fail("write_chunk", io_error)
    with pytest.raises(OSError, match="injected"):
        ckpt.save(location("bad"), arrays, options=faults.options())
    assert location.names() == ["ok"]


@pytest.mark.parametrize("limit_chunks", [2, None])
def test_bytes_in_flight_are_bounded(location, limit_chunks):
    mesh = Mesh(np.array(jax.devices()), ("x",))
    host = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
    array = jax.device_put(host, NamedSharding(mesh, P("x", None)))
    chunk_bytes = host.nbytes // 8
    limit = chunk_bytes * limit_chunks if limit_chunks else 1 << 40

    lock = threading.Lock()
    in_flight = {"bytes": 0, "peak": 0, "late": 0, "late_peak": 0, "late_handed": 0, "handed": 0}
    copied = threading.Event()  # save_async returned: every host copy exists
    all_handed = threading.Event()  # all 8 chunk writes handed to storage

    class CountedFuture:
        """In flight from write_chunk() until the save asks for its result (its done() included:
        the writer looks at finished writes for failures). No write completes before the caller's
        copies are done (as on a disk slower than the copies; memory:// would otherwise finish a
        write before the next copy, depending on the machine's load). Unbounded, a write handed
        over once the copies exist does not complete before every chunk has been handed over: a
        writer that waited for one first would be holding chunks back."""

        def __init__(self, future, nbytes):
            self.future, self.nbytes, self.counted = future, nbytes, True
            with lock:
                self.late = copied.is_set()
                in_flight["handed"] += 1
                in_flight["bytes"] += nbytes
                in_flight["peak"] = max(in_flight["peak"], in_flight["bytes"])
                if self.late:
                    in_flight["late"] += nbytes
                    in_flight["late_handed"] += nbytes
                    in_flight["late_peak"] = max(in_flight["late_peak"], in_flight["late"])
                if in_flight["handed"] == 8:
                    all_handed.set()
            self.gate = all_handed if self.late and not limit_chunks else copied

        def done(self):
            return self.gate.is_set() and self.future.done()

        def cancel(self):
            return False

        def result(self, timeout=None):
            assert copied.wait(60), "the caller's copies never finished"
            assert self.gate.wait(60), f"a write was waited for before every chunk was handed over: {in_flight}"
            out = self.future.result()
            with lock:
                if self.counted:
                    in_flight["bytes"] -= self.nbytes
                    in_flight["late"] -= self.nbytes if self.late else 0
                    self.counted = False
            return out

    faults = Faults()
    faults.after("write_chunk", lambda future, handle, box, data: CountedFuture(future, data.nbytes))
    # (shard by shard: 8 chunk files, not one packed chunk)
    handle = ckpt.save_async(location("ck"), {"a": array},
                             options=faults.options(max_inflight_bytes=limit, pack_limit_bytes=0))
    copied.set()
    handle.wait()
    assert faults.calls["write_chunk"] == 8
    assert in_flight["bytes"] == 0
    if limit_chunks:
        # At most the limit, plus the chunk just handed over.
        assert in_flight["peak"] <= limit + chunk_bytes
    else:
        # Unbounded: once the host copies exist, every remaining chunk goes out before any of them
        # is waited for (while the caller is still copying, the writer sends few at a time, and
        # how many remain then depends on the machine's load: on a loaded one, most).
        assert in_flight["late_peak"] == in_flight["late_handed"], in_flight
        assert in_flight["late_handed"] or in_flight["peak"] == 8 * chunk_bytes, in_flight  # (none late: all at once)
    assert np.array_equal(ckpt.restore(location("ck"))["a"], host)
