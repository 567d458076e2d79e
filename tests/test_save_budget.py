"""Saves within a host budget (issue 10): sub-shard chunks, and a budget the save never exceeds.

The budget is checked through the save's own accounting (SaveHandle._budget: every staging
buffer, every chunk in flight and the pool's free buffers are counted before they exist; its
high-water mark is the most it ever held), on trees many times the budget; every value is read
back and compared."""

import os
import threading

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ckpt
from ckpt._save.plan import chunk_shape_for
from ckpt._geometry import box_size
from ckpt._save.plan import ArrayShards, ShardWrite, plan_save
from ckpt._save.host_copy import POOL
from support import Faults

BUDGET = 64 << 10  # chunks are then capped at 16 KiB


def _mesh():
    return jax.make_mesh((4, 2), ("x", "y"))


def _put(value, spec):
    return jax.device_put(value, NamedSharding(_mesh(), spec))


def _values(n: int, shape=(256, 128), seed=0):
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal(shape).astype(np.float32) for i in range(n)}


def _save(path, tree, budget=BUDGET, **kwargs):
    handle = ckpt.save_async(path, tree, host_budget_bytes=budget, **kwargs)
    handle.wait(timeout=120)
    limit = handle._budget.limit
    assert limit == budget or (budget == "unlimited" and limit >= 1 << 60)
    assert 0 < handle._budget.high_water <= limit
    assert handle._budget.held == 0  # every lease came back
    return handle


def _check(path, expected: dict):
    restored = ckpt.restore(path)
    for k, v in expected.items():
        got = restored[k]
        if isinstance(got, jax.Array):
            for s in got.addressable_shards:
                assert np.array_equal(np.asarray(s.data), v[s.index]), k
        assert np.array_equal(np.asarray(got), v), k


# ---- chunk shapes ------------------------------------------------------------------------------


@pytest.mark.parametrize("shard, itemsize, cap, expected", [
    ((1024, 256), 4, 64 << 10, (64, 256)),  # leading dim split, rows whole
    ((128, 256), 4, 64 << 10, (64, 256)),
    ((8, 8), 4, 64 << 10, (8, 8)),  # within the cap: the shard itself
    ((), 4, 1, ()),  # 0-d
    ((0, 5), 4, 1, (0, 5)),  # empty
    ((1, 4096), 4, 4096, (1, 1024)),  # size-1 dim, then the next one split
    ((6, 10), 8, 100, (1, 10)),  # uneven: 6 has no divisor giving more than one row of 80 B
    ((12, 7), 4, 100, (3, 7)),  # largest divisor of 12 with c * 28 B <= 100 B
    ((7, 3, 5), 1, 16, (1, 3, 5)),  # prime leading dim: one row per chunk
    ((4, 1_000_003), 4, 1 << 20, (1, 1_000_003)),  # a prime row over the cap: a whole row
    ((1009,), 4, 1024, (1009,)),  # a 1-d prime shard: only 4-byte chunks fit, so kept whole
])
def test_chunk_shape_divides_the_shard_and_respects_the_cap(shard, itemsize, cap, expected):
    chunk = chunk_shape_for(shard, itemsize, cap)
    assert chunk == expected
    assert all(s == c == 0 or (c and s % c == 0) for s, c in zip(shard, chunk))


def test_chunk_shape_is_within_the_cap_whenever_divisibility_allows():
    rng = np.random.default_rng(1)
    for _ in range(300):
        shard = tuple(int(n) for n in rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 60, 64, 128], size=rng.integers(1, 4)))
        itemsize = int(rng.choice([1, 2, 4, 8]))
        cap = int(rng.integers(64, 1 << 16))
        chunk = chunk_shape_for(shard, itemsize, cap)
        assert all(s % c == 0 for s, c in zip(shard, chunk)), (shard, chunk)
        # These shards always have a division of at most the cap holding at least 1/16 of it
        # (or the cap exceeds the shard), and leading dims split first.
        if np.prod(shard) * itemsize > cap and shard[-1] * itemsize <= cap:
            assert np.prod(chunk) * itemsize <= cap, (shard, itemsize, cap, chunk)


def test_plan_writes_each_chunk_once_inside_one_shard_and_spreads_replicas():
    # A (16, 8) array of 4-byte items in 4 shards of (4, 8), each held by processes 0 and 1.
    holders = {((4 * i, 4 * i + 4), (0, 8)): [(0, 10 + i), (1, 20 + i)] for i in range(4)}
    plan = plan_save([ArrayShards(0, 4, holders, (16, 8), "float32", (1, 8))], pack_limit=0)
    writes = [w for w in plan.writes if isinstance(w, ShardWrite)]
    assert len(writes) == 16 and sorted(w.box for w in writes) == [((r, r + 1), (0, 8)) for r in range(16)]
    for w in writes:
        (shard,) = [b for b in holders if b[0][0] <= w.box[0][0] < b[0][1]]
        assert (w.process, w.device) in holders[shard] and w.nbytes == box_size(w.box) * 4 == 32
    assert plan.bytes_by_process() == {0: 256, 1: 256}  # replicated chunks spread evenly


# ---- saves within the budget -------------------------------------------------------------------


def test_tree_many_times_the_budget(location):
    values = _values(8)  # 1 MiB: 16x the budget
    tree = {k: _put(v, P("x")) for k, v in values.items()}
    handle = _save(location("ck"), tree)
    assert handle._budget.waited  # the copies had to wait for writes
    meta = ckpt.metadata(location("ck"))
    assert tuple(meta["w0"].chunk_shape) == (32, 128)  # 16 KiB chunks of (64, 128) shards
    _check(location("ck"), values)


def test_one_shard_many_times_the_budget(location):
    big = np.random.default_rng(2).standard_normal((512, 512)).astype(np.float32)  # 1 MiB on the host
    one_device = jax.device_put(big, jax.devices()[0])
    values = {"host": big, "device": big + 1}
    _save(location("ck"), {"host": big, "device": one_device + 1})
    assert tuple(ckpt.metadata(location("ck"))["host"].chunk_shape) == (8, 512)
    _check(location("ck"), values)


def test_replicated_arrays_and_packed_small_leaves(location):
    values = _values(4, (128, 128), seed=3)  # replicated: 64 KiB each
    small = {f"s{i}": np.full((16, 16), i, np.float32) for i in range(100)}  # packed, 1 KiB each
    tree = {**{k: _put(v, P()) for k, v in values.items()}, **{k: _put(v, P()) for k, v in small.items()}}
    _save(location("ck"), tree)
    _check(location("ck"), {**values, **small})


def test_arrays_deleted_after_save_async_returns(location):
    values = _values(6, seed=4)
    tree = {k: _put(v, P("x")) for k, v in values.items()}
    handle = ckpt.save_async(location("ck"), tree, host_budget_bytes=BUDGET)
    for a in tree.values():
        a.delete()  # (as donation would)
    handle.wait(timeout=120)
    assert handle._budget.high_water <= BUDGET
    _check(location("ck"), values)


def test_pool_stays_within_the_budget_across_saves_and_is_released(location):
    values = _values(4, seed=5)
    tree = {k: _put(v, P("x", "y")) for k, v in values.items()}
    # (memory:// keeps the very buffers it is given as the stored chunks: none comes back)
    reused = location.kind == "local"
    _save(location("a"), tree, budget=4 * BUDGET)
    assert (0 < POOL.free_bytes if reused else 0 <= POOL.free_bytes) and POOL.free_bytes <= 4 * BUDGET
    # A smaller budget next: the pooled buffers count against it, and it holds.
    _save(location("b"), tree, budget=BUDGET)
    assert (0 < POOL.free_bytes if reused else 0 <= POOL.free_bytes) and POOL.free_bytes <= BUDGET
    assert (ckpt.release_host_memory() > 0) == reused and POOL.free_bytes == 0
    _save(location("c"), tree, budget=BUDGET)
    for name in "abc":
        _check(location(name), values)
    ckpt.release_host_memory()


def test_unlimited_budget_and_max_chunk_bytes(location):
    values = _values(2, seed=6)
    _save(location("ck"), {k: _put(v, P("x")) for k, v in values.items()}, budget="unlimited",
          max_chunk_bytes=8 << 10)
    # (64, 128) shards of 32 KiB in chunks of at most 8 KiB
    assert tuple(ckpt.metadata(location("ck"))["w0"].chunk_shape) == (16, 128)
    _check(location("ck"), values)


def test_budget_and_chunk_cap_from_options_and_environment(monkeypatch):
    monkeypatch.setenv("CKPT_HOST_BUDGET_BYTES", "unlimited")
    assert ckpt.Options().resolved().host_budget_bytes >= 1 << 60
    monkeypatch.setenv("CKPT_HOST_BUDGET_BYTES", "123456")
    assert ckpt.Options().resolved().host_budget_bytes == 123456
    monkeypatch.delenv("CKPT_HOST_BUDGET_BYTES")
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert ckpt.Options().resolved().host_budget_bytes == ram // 4
    for bad in (0, -1, "lots", True, 1.5):
        with pytest.raises(ValueError, match="host_budget_bytes"):
            ckpt.Options(host_budget_bytes=bad).resolved()


def test_failing_write_with_a_small_budget_raises_and_commits_nothing(location):
    values = _values(8, seed=7)
    tree = {k: _put(v, P("x", "y")) for k, v in values.items()}
    faults = Faults()
    faults.fail("write_chunk", after=3)
    outcome: list = []

    def run():
        try:
            ckpt.save(location("ck"), tree, options=faults.options(), host_budget_bytes=BUDGET)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001  (the assertion below names it)
            outcome.append(e)

    saver = threading.Thread(target=run)
    saver.start()
    saver.join(120)  # a deadlock guard, not a timing: the save normally fails within a second
    assert not saver.is_alive(), "the save hung after a failed write"
    assert isinstance(outcome[0], OSError) and "injected" in str(outcome[0])
    assert location.names() == []  # no checkpoint, no temporary directory
    # The next save in this process is unaffected.
    _save(location("ok"), tree)
    _check(location("ok"), values)


def test_chunks_tile_every_array(location):
    """Every chunk file of an array exists and no other: the grid is regular."""
    values = {"a": np.arange(48 * 40, dtype=np.int32).reshape(48, 40)}
    _save(location("ck"), {"a": _put(values["a"], P("x", "y"))}, budget=4 * 4096)  # cap 4 KiB
    chunk = tuple(ckpt.metadata(location("ck"))["a"].chunk_shape)
    assert chunk == (12, 20)  # the (12, 20) shards are 960 B: within the cap, kept whole
    _save(location("ck2"), {"a": _put(values["a"], P("x"))}, budget=4 * 4096)
    chunk = tuple(ckpt.metadata(location("ck2"))["a"].chunk_shape)
    assert chunk == (12, 40) and 12 % chunk[0] == 0
    values["b"] = np.arange(96 * 128, dtype=np.int32).reshape(96, 128)  # (24, 128) shards of 12 KiB
    _save(location("ck3"), {"b": _put(values["b"], P("x"))}, budget=4 * 4096)
    chunk = tuple(ckpt.metadata(location("ck3"))["b"].chunk_shape)
    assert chunk == (8, 128) and 24 % chunk[0] == 0 and np.prod(chunk) * 4 <= 4096
    _check(location("ck3"), {"b": values["b"]})
