"""What a save and a restore cost as processes grow (issue 23), through the simulator
bench/scale.py: the library's planner, packed writer, index objects, commit (over a counting
in-memory object store), coordinator (over a counting key-value client) and restore lookups for
N simulated processes x 8 devices, in the packed layout. Bounds are on counts (objects,
requests, bytes, memory), never on time. Also a real save by 4 processes, counting its files."""

from __future__ import annotations

import math
import os
import threading

import msgpack
import pytest

import ckpt
from bench import scale
from ckpt._save.plan import plan_save

N = 64


@pytest.fixture(scope="module")
def figures():
    # The acceptance tree with every process simulated; the others with processes 0 and 1 (and
    # those their indexes point to) in full and the rest by symmetry, whose figures equal a full
    # run (bench/scale.py): 8 s less per run of the suite.
    return {tree: scale.simulate(tree, N, straggler_s=3.0 if tree == "per-layer" else 0.0,
                                 full_up_to=N if tree == "per-layer" else 16)
            for tree in ("per-layer", "scanned", "dp4")}


@pytest.fixture(scope="module")
def half():
    return scale.simulate("per-layer", N // 2, reshard=False)


def _job_bytes(tree: str) -> int:
    return sum(math.prod(shape) * (2 if dtype == "bfloat16" else 4) for _, shape, dtype, _ in scale.llama70b(tree == "scanned"))


@pytest.mark.parametrize("tree", ["per-layer", "scanned", "dp4"])
def test_objects_grow_with_processes_and_bytes_not_chunks(figures, tree):
    f = figures[tree]
    assert f.objects <= 8 * N + 16
    if tree == "per-layer":
        assert f.simulated == N  # every process ran the packed writer
    assert f.objects == f.data_objects + N + 1  # data, one index object per process, the manifest
    # Each process's bytes in data objects of pack_object_bytes (2 GiB), the last one smaller:
    # 705 GB over 64 processes is 11 GB each, 6 objects a process, where the files layout made
    # 13,500 (one per chunk); within the acceptance bound of 8 x processes + 16 from ~10 GB a
    # process down (1,024 processes: 690 MB each, one data object and one index object each).
    target = f.target_bytes
    assert target == ckpt.Options().resolved().pack_object_bytes
    per_process = math.ceil(_job_bytes(tree) / N / target) + 1
    assert f.data_objects <= N * per_process, (f.data_objects, per_process)
    assert f.data_objects < f.chunks / 10
    assert f.data_object_mib[1] <= target / 2**20  # (a chunk that would cross it starts the next)


@pytest.mark.parametrize("tree", ["per-layer", "scanned", "dp4"])
def test_commit_lists_nothing_and_reads_nothing(figures, tree):
    f = figures[tree]
    # The only listing of the save is the staging's look at the (empty) destination: 0 keys.
    assert f.primary_listed_keys == 0 and f.primary_requests.get("LIST", 0) <= 1
    assert f.commit_requests <= 2 * N + 16
    assert "LIST" not in f.commit_request_kinds and "GET" not in f.commit_request_kinds
    assert f.primary_requests.get("GET", 0) == 0  # no index object read back at the commit


@pytest.mark.parametrize("tree", ["per-layer", "scanned", "dp4"])
def test_coordination_bytes_grow_with_processes_not_their_square(figures, half, tree):
    f = figures[tree]
    assert f.coord_bytes <= 64 * 1024 * N, f.coord_bytes
    assert f.status_bytes_max <= 4096  # O(1) in the process's chunks (places: small arrays only)
    if tree == "per-layer":
        assert f.coord_bytes <= 2.2 * half.coord_bytes, (f.coord_bytes, half.coord_bytes)
        assert f.coord_calls <= 2.2 * half.coord_calls


def test_a_straggler_adds_little_coordination(figures):
    f = figures["per-layer"]
    assert f.coord_bytes_straggler <= 1.10 * f.coord_bytes, (f.coord_bytes_straggler, f.coord_bytes)


@pytest.mark.parametrize("tree", ["per-layer", "scanned", "dp4"])
def test_a_restoring_process_reads_a_small_manifest_and_few_index_objects(figures, tree):
    f = figures[tree]
    assert f.manifest_bytes <= 4 << 20
    assert f.restore_chunks > 0 and f.restore_gets == 1 + f.indexes_read  # the manifest, then indexes
    # Chunks that follow each other in a data object are read as one range (read_chunks), of at
    # most 64 MiB: the per-layer and dp4 trees' 40-190 KB chunks in far fewer requests (the
    # scanned tree's chunks are near 64 MiB already: one request each).
    assert f.restore_runs <= (f.restore_chunks / 10 if tree != "scanned" else f.restore_chunks), \
        (f.restore_runs, f.restore_chunks)
    # Its own index object; with dp4 those of the 3 other replicas, whose index holds what its own
    # points to. (The scanned tree's replicated layer-norm stacks, 1.3 MB each, above the packing
    # limit, are single chunks written by one process each: their places are in the manifest.)
    most = {"per-layer": 1, "dp4": 4, "scanned": 1}[tree]
    assert f.indexes_read <= most and f.index_bytes <= most * f.index_object_bytes
    # Resharded onto N/2 processes: what processes 0 and 1 held.
    assert f.reshard_indexes_read <= 2 * most and f.reshard_index_bytes <= 2 * most * f.index_object_bytes


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


# ---- a real save by 4 processes: objects per save, metadata included (issue 23) ----------------

HERE = os.path.abspath(__file__)


def _small_leaves_arrays() -> dict:
    """300 leaves on a (4, 2) mesh of 4 processes x 2 devices: 100 sharded over both axes, 100
    over the processes only, 100 replicated (packed into stacks by the save)."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    arrays = {}
    for i in range(100):
        arrays[f"both/{i}"] = ((32, 16), np.float32, P("data", "model"))
        arrays[f"rows/{i}"] = ((64, 24), jnp.bfloat16, P("data", None))
        arrays[f"replicated/{i}"] = ((2048,), np.float32, P())
    return arrays


def run_small_leaves_job(w) -> None:
    import jax
    from multihost_data import as_target, bad_shards, build, mesh_of, shardings_for

    arrays = _small_leaves_arrays()
    mesh = mesh_of((4, 2))
    path = os.path.join(w.args["dir"], "c")
    ckpt.save(path, build(arrays, mesh))
    files = sum(len(names) for _, _, names in os.walk(path)) if w.index == 0 else None
    w.barrier("counted")
    restored = ckpt.restore(path, as_target(arrays, shardings_for(arrays, mesh)))
    bad, shards = bad_shards(restored, arrays, shardings_for(arrays, mesh))
    w.report(check="small-leaves", files=files, bad=bad[:5], shards=shards, devices=len(jax.local_devices()))


def test_a_300_leaf_tree_saved_by_4_processes_is_at_most_48_objects(tmp_path):
    from multiproc import assert_all_succeeded, launch

    results = launch(f"{HERE}:run_small_leaves_job", processes=4, devices_per_process=2,
                     args={"dir": str(tmp_path)},
                     # (the workers import this file, which imports bench/ from the tree's root)
                     env={"CKPT_TIMEOUT_S": "30", "PYTHONPATH": os.pathsep.join(
                         [os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")])})
    assert_all_succeeded(results)
    records = [r.one("small-leaves") for r in results]
    # Per process a data object and an index object, and the manifest: no zarr.json, no chunk file.
    files = records[0]["files"]
    assert files <= 48, sorted(os.listdir(tmp_path / "c"))
    assert files == len([f for _, _, names in os.walk(tmp_path / "c") for f in names])
    for r in records:  # every shard of every leaf on every process, compared
        assert r["bad"] == [] and r["devices"] == 2 and r["shards"] == 300 * 2, r
