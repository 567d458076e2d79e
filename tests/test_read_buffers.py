"""Restore's read buffers (ckpt/_host.py: ReadBuffers): on an engine that reads into given
buffers (local disk, and TensorStore's kvstores: memory:// here, S3 and GCS alike), a restore larger than its budget reads batch after batch into the same
buffers, never keeps more than the budget, and never reuses a buffer a device adopted or a
result kept; the next batch's reads are in flight while one is placed. Observed through a
wrapping engine (tests/support.Faults), values checked shard by shard."""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import ckpt
from ckpt.storage._wrapper import WrapperStorage
from ckpt.storage._location import open_storage
from ckpt._host import POOLED_MIN_BYTES, ReadBuffers
from ckpt._host import HostBudget
from ckpt._restore import restore_with_stats
from support import Faults

CHUNK = 1 << 20  # the smallest pooled buffer: chunks of exactly that
BUDGET = 6 * CHUNK


@pytest.fixture(params=["disk", "memory"])
def base(request, tmp_path):
    """Where a test's checkpoints go: local disk (direct reads) or memory:// (TensorStore)."""
    if request.param == "disk":
        return tmp_path
    import uuid

    return _Memory(f"memory://read-buffers-{uuid.uuid4().hex[:8]}")


class _Memory(str):
    def __truediv__(self, name: str) -> str:
        return f"{self}/{name}"


def _value():
    return np.arange(2048 * 1024, dtype=np.float32).reshape(2048, 1024)  # 8 MiB: 8 chunks of 1 MiB


def _saved(base, sharding):
    path = str(base / "c")
    ckpt.save(path, {"w": jax.device_put(_value(), sharding)}, options=ckpt.Options(max_chunk_bytes=CHUNK))
    return path


def _watched_restore(path, target, budget=BUDGET):
    faults = Faults()
    given: list[int] = []  # address of the buffer each chunk read was given (0: none)

    def note(path_, index, nbytes, into=None):
        given.append(0 if into is None else into.ctypes.data)

    faults.before("read_chunk", note)
    out, stats = restore_with_stats(path, target, options=faults.options(host_budget_bytes=budget))
    return out, stats, given


def _check(arr, value):
    for s in arr.addressable_shards:
        assert np.array_equal(np.asarray(s.data), value[s.index]), s.device


def test_a_reshard_reads_every_batch_into_the_same_buffers(base):
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    path = _saved(base, NamedSharding(mesh, P("x", None)))
    # Rows split 8 ways onto (2,4)'s 'y': every device shard is a part of a chunk, copied out of it,
    # so no read buffer is adopted and every one can be read into again.
    target = {"w": NamedSharding(jax.make_mesh((2, 4), ("x", "y")), P("y", "x"))}
    out, stats, given = _watched_restore(path, target)
    _check(out["w"], _value())
    assert stats.bytes_read == _value().nbytes and len(given) == 8
    assert all(given), "the engine was given a buffer for every chunk"
    assert len(set(given)) < len(given), "buffers were reused across batches"
    assert 0 < stats.host_high_water <= BUDGET, stats.host_high_water


def test_a_buffer_a_device_adopted_is_never_read_into_again(base):
    # Restored onto the saved sharding, each chunk is a device's whole shard: on CPU the device
    # adopts the read buffer itself, so reusing one would overwrite a restored shard.
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    sharding = NamedSharding(mesh, P("x", None))
    path = _saved(base, sharding)
    out, stats, given = _watched_restore(path, {"w": sharding})
    _check(out["w"], _value())  # (a reused buffer would have overwritten an earlier shard)
    assert 0 < stats.host_high_water <= BUDGET


@pytest.mark.parametrize("target", ["one device", "numpy"])
def test_results_kept_on_the_host_are_never_overwritten(base, target):
    # Leaves of one chunk each (just over the packing limit, so not stacked), one leaf per
    # batch: a numpy result is the read buffer itself, and a CPU device adopts it; the next
    # batch must read into another buffer.
    values = {f"l{i}": np.full((257, 1024), i, np.float32) + np.arange(1024, dtype=np.float32) for i in range(6)}
    path = str(base / "c")
    ckpt.save(path, values)
    one = SingleDeviceSharding(jax.devices()[3])
    t = {k: one for k in values} if target == "one device" else None  # None: numpy arrays
    out, stats, given = _watched_restore(path, t, 3 * CHUNK)
    assert len(given) == 6 and all(given)
    for k, v in values.items():
        got = out[k] if target == "numpy" else np.asarray(out[k])
        assert np.array_equal(got, v), k
    assert len(set(given)) == 6  # every buffer stayed with its result
    assert 0 < stats.host_high_water <= 3 * CHUNK


def test_buffers_below_the_pooled_size_are_left_to_the_engine(tmp_path):
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    path = str(tmp_path / "c")
    value = _value()
    ckpt.save(path, {"w": jax.device_put(value, NamedSharding(mesh, P("x", "y")))},
              options=ckpt.Options(max_chunk_bytes=CHUNK // 4))
    target = {"w": NamedSharding(jax.make_mesh((2, 4), ("x", "y")), P("y", "x"))}
    out, stats, given = _watched_restore(path, target)
    _check(out["w"], value)
    assert given and not any(given)


def test_the_pool_keeps_no_more_than_the_budget_and_drops_what_the_next_batch_does_not_read():
    budget = HostBudget(3 * POOLED_MIN_BYTES)
    pool = ReadBuffers(budget)
    bufs = [pool.get(POOLED_MIN_BYTES) for _ in range(4)]
    assert all(b is not None and b.ctypes.data % 4096 == 0 and len(b) == POOLED_MIN_BYTES + 4096 for b in bufs)
    pool.put_back(bufs)
    assert budget.held == 3 * POOLED_MIN_BYTES  # the fourth did not fit the budget: dropped
    kept = {b.ctypes.data for b in bufs[:3]}
    again = pool.get(POOLED_MIN_BYTES)
    assert again.ctypes.data in kept and budget.held == 2 * POOLED_MIN_BYTES
    view = again[:10]  # still referenced: not kept
    pool.put_back([again])
    assert budget.held == 2 * POOLED_MIN_BYTES
    del view
    pool.prepare([2 * POOLED_MIN_BYTES])  # the next batch reads other sizes: free ones dropped
    assert budget.held == 0
    assert pool.get(POOLED_MIN_BYTES // 2) is None


class _Windowed(WrapperStorage):
    """An engine whose restores read at most two chunks per batch (one request in flight, whose
    responses of one chunk each the engine holds: StoreCaps.response_part_bytes)."""

    @property
    def caps(self):
        return replace(self.inner.caps, response_part_bytes=CHUNK)


def test_a_storage_read_window_bounds_each_batch_whatever_the_budget(base, monkeypatch):
    monkeypatch.setattr("ckpt._restore.read.MIN_READ_WINDOW", 0)  # (the window, not its floor)
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    sharding = NamedSharding(mesh, P("x", None))
    path = _saved(base, sharding)
    unbounded = ckpt.Options(host_budget_bytes=1 << 40, io_concurrency=1)
    out, whole = restore_with_stats(path, {"w": sharding}, options=unbounded)
    _check(out["w"], _value())
    windowed = replace(unbounded, engine=lambda where, o: _Windowed(open_storage(where, replace(o, engine=None))))
    out, stats = restore_with_stats(path, {"w": sharding}, options=windowed)
    _check(out["w"], _value())
    assert whole.host_high_water >= _value().nbytes  # one batch: every chunk at once
    # Batches of two chunks (a device's shard: 512 rows, two chunks, assembled in a copy of
    # 2 MiB), the next batch's reads issued while one is placed.
    assert 0 < stats.host_high_water <= 4 * CHUNK + 2 * CHUNK < whole.host_high_water, stats.host_high_water


def test_object_stores_bound_their_read_window_and_local_disk_does_not(tmp_path):
    from ckpt._restore.read import read_window
    from ckpt.storage._tensorstore import PART_BYTES

    assert read_window(open_storage(str(tmp_path / "c"), ckpt.Options().resolved()).caps, 8) is None
    memory = open_storage("memory://window/c", ckpt.Options().resolved())
    assert read_window(memory.caps, 8) == 128 << 20
    assert read_window(memory.caps, 64) == 2 * 64 * PART_BYTES
