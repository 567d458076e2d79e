"""What a save costs as processes grow (issue 23), through the simulator bench/scale.py: the
library's planner, coordinator (over a counting key-value client) and commit bookkeeping for N
simulated processes x 8 devices. Bounds are on counts (requests, bytes, memory), never on time.
"""

from __future__ import annotations

import threading

import msgpack
import pytest

import ckpt
from bench import scale
from ckpt._save.plan import plan_save

N = 64


@pytest.fixture(scope="module")
def figures():
    return {tree: scale.simulate(tree, N, straggler_s=3.0 if tree == "per-layer" else 0.0)
            for tree in ("per-layer", "scanned", "dp4")}


@pytest.fixture(scope="module")
def half():
    return scale.simulate("per-layer", N // 2)


@pytest.mark.parametrize("tree", ["per-layer", "scanned", "dp4"])
def test_commit_lists_nothing_and_reads_each_index_object_once(figures, tree):
    f = figures[tree]
    assert f.primary_listed_keys == 0 and f.primary_requests.get("LIST", 0) == 0
    assert f.commit_requests <= 2 * N + 16
    assert f.primary_requests["GET"] == N - 1  # one index object per other process


@pytest.mark.parametrize("tree", ["per-layer", "scanned", "dp4"])
def test_coordination_bytes_grow_with_processes_not_their_square(figures, half, tree):
    f = figures[tree]
    assert f.coord_bytes <= 64 * 1024 * N, f.coord_bytes
    # Statuses are O(1): the same bytes per process whatever the tree's chunk count.
    assert abs(f.coord_bytes - figures["scanned"].coord_bytes) <= 0.05 * f.coord_bytes
    if tree == "per-layer":
        assert f.coord_bytes <= 2.2 * half.coord_bytes, (f.coord_bytes, half.coord_bytes)
        assert f.coord_calls <= 2.2 * half.coord_calls


def test_a_straggler_adds_little_coordination(figures):
    f = figures["per-layer"]
    assert f.coord_bytes_straggler <= 1.10 * f.coord_bytes, (f.coord_bytes_straggler, f.coord_bytes)


@pytest.mark.parametrize("tree", ["per-layer", "scanned", "dp4"])
def test_each_process_plans_its_own_part_in_bounded_memory(figures, half, tree):
    assert figures[tree].plan_peak_mib <= 256
    if tree == "per-layer":  # its own part: not growing with the job's chunks (2x here)
        assert figures[tree].plan_peak_mib <= 1.5 * half.plan_peak_mib + 1


@pytest.mark.parametrize("tree,processes", [("per-layer", 16), ("dp4", 16)])
def test_the_processes_own_plans_make_the_job_plan(tree, processes):
    leaves, arrays = scale.arrays_of(tree, processes)
    job = plan_save(arrays)
    parts = [plan_save(arrays, process=p) for p in range(processes)]
    assert all(p.stacks == job.stacks and p.whole == job.whole for p in parts)
    mine = sorted((w for p, part in enumerate(parts) for w in part.writes), key=repr)
    assert mine == sorted(job.writes, key=repr)
    assert all(w.process == p for p, part in enumerate(parts) for w in part.writes)
    # Replicated regions (dp4: 4 holders each) spread evenly over their holders.
    loads = job.bytes_by_process()
    assert max(loads.values()) <= 1.05 * min(loads.values()), loads


def test_a_missing_process_is_named_by_the_primary(monkeypatch):
    from ckpt._distributed import DistributedCoordinator

    monkeypatch.setenv("CKPT_TIMEOUT_S", "0.5")
    kv = scale.CountingKV(4)
    errors: dict[int, BaseException] = {}

    def run(p: int) -> None:
        try:
            coord = DistributedCoordinator(kv.client(p), p, 4)
            coord.new_save_id()
            coord.gather("1/written", msgpack.packb({"p": p}))
        except BaseException as e:  # noqa: BLE001
            errors[p] = e

    threads = [threading.Thread(target=run, args=(p,)) for p in range(3)]  # process 3 never comes
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(errors) == {0}  # the others posted and went on; the primary waited, then named it
    assert isinstance(errors[0], ckpt.CheckpointError) and "process(es) [3]" in str(errors[0])
    # The statuses were fetched once (one listing, then one read per missing process); waiting
    # cost a read of process 3's key and of its life counter per 0.1 s slice (and this process's
    # own life counter every 0.08 s): a few dozen calls, whatever the statuses hold.
    assert kv.calls[0] <= 40, kv.calls[0]


def test_single_process_save_reports_its_figures(tmp_path, caplog):
    import jax
    import numpy as np

    tree = {"w": jax.numpy.arange(4096.0).reshape(64, 64), "b": np.ones(3), "step": 3}
    with caplog.at_level("INFO", logger="ckpt"):
        handle = ckpt.save_async(tmp_path / "c", tree)
        assert handle.wait() is None
    stats = handle.stats
    assert stats["process"]["process"] == 0 and stats["process"]["bytes"] == 4096 * 4
    assert stats["job"]["slowest"] == 0 and [r["process"] for r in stats["job"]["processes"]] == [0]
    assert stats["job"]["bytes"] == 4096 * 4 and stats["job"]["requests"] >= 1
    assert any("slowest process 0" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("spec", [("x", "y"), ("x",), (None, "y"), (("x", "y"),), ()])
def test_regions_worked_out_per_grid_are_those_jax_gives(spec):
    """array_shards works out every device's region once per sharding and grid of shards, then
    scales it to each shape: the same regions and holders as devices_indices_map per shape."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from ckpt._format import LeafRecord
    from ckpt._geometry import index_to_box
    from ckpt._save.plan import Leaf, array_shards

    sharding = NamedSharding(jax.make_mesh((4, 2), ("x", "y")), P(*spec))
    leaves = []
    for shape in [(16, 8), (32, 24), (8, 2), (40, 6)]:
        a = jax.device_put(np.zeros(shape, np.float32), sharding)
        leaves.append(Leaf(LeafRecord(f"a{len(leaves)}", "jax.Array", shape, "float32"), a, shape))
    for leaf, got in zip(leaves, array_shards(leaves)):
        want: dict = {}
        for d, idx in sharding.devices_indices_map(leaf.record.shape).items():
            want.setdefault(index_to_box(idx, leaf.record.shape), []).append((d.process_index, d.id))
        assert {box: sorted(h) for box, h in got.holders.items()} == {box: sorted(h) for box, h in want.items()}
