"""Many small leaves: small arrays one process holds whole are written as one chunk, and those of
one shape and dtype as slices of a stack (formats/SPEC.md section 7.1). Round trips and resharding
restores on every shard, stock readers, damage, crashes (through the storage wrapper and a real
SIGKILL), multi-process saves, and the pure packing plan."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import ml_dtypes
import msgpack
import numpy as np
import pytest
import tensorstore as ts
import zarr
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

import ckpt
from ckpt._format import records
from ckpt._save.plan import MAX_STACK_MEMBERS, ArrayShards, BundledWrite, plan_save
from ckpt._restore import restore_with_stats
from ckpt.cli._verify import verify_checkpoint
from multiproc import Worker, assert_all_succeeded, launch
from support import Faults, committed_generations, flip_byte, keys, manifest_of, storage_of, truncate

HERE = os.path.abspath(__file__)
REPO = Path(HERE).parent.parent
N = 40  # members of each stack


def _mesh(shape=(4, 2)):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), ("x", "y"))


def _kernel(i):  # (24, 96) float32, 9 KiB: above the inline limit; 24 and 96 divide by 3, 4 and 8
    return (np.arange(24 * 96, dtype=np.float32).reshape(24, 96) + 1000 * i) / 8


def _values():
    """The global value of every array leaf, by leaf path."""
    v = {f"w/{i}": _kernel(i) for i in range(N)}
    v.update({f"b/{i}": np.arange(1536, dtype=np.float32) - i for i in range(N)})  # 6 KiB
    v.update({f"h/{i}": ((np.arange(48 * 64) % 97 - 48) / 4 + i).astype(ml_dtypes.bfloat16).reshape(48, 64)
              for i in range(3)})
    v["odd"] = np.arange(48 * 40, dtype=np.int32).reshape(48, 40)  # a shape of its own: one chunk
    v.update({f"np/{i}": np.linspace(i, i + 1, 1100) for i in range(3)})  # numpy leaves
    v["big"] = np.arange(512 * 768, dtype=np.float32).reshape(512, 768)  # 1.5 MiB: shard by shard
    return v


SPECS = {"w": P("x", "y"), "b": P(), "h": P(None, "y"), "odd": P("x"), "big": P("x", "y")}


def _tree(mesh):
    v = _values()
    tree: dict = {"w": [], "b": [], "h": [], "np": [v[f"np/{i}"] for i in range(3)]}
    for path, value in v.items():
        head = path.split("/")[0]
        if head == "np":
            continue
        arr = jax.device_put(value, NamedSharding(mesh, SPECS[head]))
        if "/" in path:
            tree[head].append(arr)
        else:
            tree[head] = arr
    tree["tiny"] = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, P()))  # inline
    tree["step"] = 3
    return tree


def _leaf(tree, path):
    for part in path.split("/"):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return tree


def _check_every_shard(out, shardings=None):
    for path, want in _values().items():
        got = _leaf(out, path)
        if shardings is None:
            assert isinstance(got, np.ndarray) and got.dtype == want.dtype, path
            assert np.array_equal(got, want), path
            continue
        if path.startswith("np/"):
            assert np.array_equal(got, want), path
            continue
        assert got.sharding.is_equivalent_to(shardings(path), got.ndim), path
        for shard in got.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), want[shard.index]), (path, shard.index)


@pytest.fixture(scope="module")
def saved(module_location):
    path = module_location("c")
    ckpt.save(path, _tree(_mesh()))
    return module_location, path


def test_small_arrays_are_stacked_or_one_chunk_and_nothing_small_is_per_shard(saved):
    _, path = saved
    m = manifest_of(path)
    assert m.format_version == 2
    storage = {r.path: r.storage for r in m.leaves if r.kind in records.ARRAY_KINDS}
    stacks = {s.zarr.path.rsplit("/", 1)[-1]: s for s in m.stacks}
    assert sorted(s.shape for s in stacks.values()) == sorted([(N, 24, 96), (N, 1536), (3, 48, 64), (3, 1100)])
    for group, shape in [("w", (24, 96)), ("b", (1536,)), ("h", (48, 64)), ("np", (1100,))]:
        members = [storage[p] for p in storage if p.split("/")[0] == group]
        assert all(isinstance(st, records.StackedStorage) for st in members), group
        assert len({st.stack for st in members}) == 1 and sorted(st.index for st in members) == list(range(len(members)))
        assert m.stacks[members[0].stack].shape[1:] == shape
    assert storage["odd"].chunk_shape == (48, 40) and storage["big"].chunk_shape == (128, 384)
    assert isinstance(storage["tiny"], records.InlineStorage)
    files = [k for k in keys(storage_of(path)) if "/c/" in k or k.endswith("/c")]
    # One chunk file per stack (all are under 4 MiB), one for "odd", eight for "big".
    assert len(files) == 4 + 1 + 8, files


@pytest.mark.parametrize("target", ["same", "mesh2x4", "eight", "three", "one", "numpy"])
def test_round_trip_and_resharding_restore_compare_every_shard(saved, target):
    _, path = saved
    if target == "numpy":
        _check_every_shard(ckpt.restore(path))
        return
    if target in ("same", "mesh2x4"):
        mesh = _mesh((4, 2) if target == "same" else (2, 4))

        def sharding(p):
            return NamedSharding(mesh, SPECS[p.split("/")[0]])
        out = ckpt.restore(path, mesh=mesh)
    else:
        n = {"eight": 8, "three": 3, "one": 1}[target]
        mesh1 = Mesh(np.array(jax.devices()[:n]), ("d",))

        def sharding(p):
            if n == 1:
                return SingleDeviceSharding(jax.devices()[0])
            return NamedSharding(mesh1, P() if p.startswith("b/") else P(None, "d") if p == "big" else P("d"))
        values = _values()
        target_tree = {"w": [sharding(f"w/{i}") for i in range(N)], "b": [sharding(f"b/{i}") for i in range(N)],
                       "h": [sharding(f"h/{i}") for i in range(3)], "odd": sharding("odd"), "big": sharding("big"),
                       "np": [np.zeros_like(values[f"np/{i}"]) for i in range(3)]}
        out = ckpt.restore(path, target_tree, partial=True)
    _check_every_shard(out, sharding)


def test_a_partial_restore_reads_only_the_chunks_it_needs(saved):
    _, path = saved
    mesh = _mesh()
    target = {"odd": NamedSharding(mesh, P("x")), "b": [NamedSharding(mesh, P())] * N}
    out, stats = restore_with_stats(path, target, partial=True)
    for i in range(N):
        for shard in out["b"][i].addressable_shards:
            assert np.array_equal(np.asarray(shard.data), _values()[f"b/{i}"][shard.index])
    # The stack of vectors (one chunk) and the one chunk of "odd", each read once.
    assert stats.chunks_read == 2 and stats.bytes_read == N * 1536 * 4 + 48 * 40 * 4


@pytest.mark.parametrize("shape", [(4, 2), (2, 4)])
def test_ckpt_plan_counts_the_bytes_a_real_restore_reads(saved, shape):
    from ckpt.cli._plan import dry_run_restore

    _, path = saved
    _, stats = restore_with_stats(path, mesh=_mesh(shape))
    run = dry_run_restore(manifest_of(path), ("x", "y"), shape)
    total = run.total
    assert (total.bytes_read, total.bytes_needed, total.chunks_read) == (
        stats.bytes_read, stats.bytes_needed, stats.chunks_read)
    assert {k: (v.bytes_read, v.bytes_needed) for k, v in run.per_leaf.items()} == stats.per_leaf


def test_stock_zarr_python_and_tensorstore_open_every_stack_and_array(tmp_path):
    path = tmp_path / "c"
    ckpt.save(path, _tree(_mesh()))
    m = manifest_of(str(path))
    values = _values()
    group = zarr.open_group(str(path), mode="r")
    stacks = dict(group["~stacks"].arrays())
    assert len(stacks) == len(m.stacks)
    for name, z in stacks.items():
        info = dict(z.attrs)["jax_ckpt"]
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / "~stacks" / name)},
                "fill_missing_data_reads": False}
        from_ts = ts.open(spec).result().read().result()
        for k, leaf in enumerate(info["members"]):
            want = values[leaf]
            stored = z[k]
            logical = stored.view(ml_dtypes.bfloat16) if info["encoding"] == "bits" else stored
            assert info["dtype"] == want.dtype.name and np.array_equal(logical, want), leaf
            assert np.array_equal(from_ts[k], stored), leaf
    for leaf in ("odd", "big"):
        z = zarr.open_array(str(path / leaf), mode="r")
        assert np.array_equal(z[...], values[leaf])
        t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / leaf)}}).result()
        assert np.array_equal(t.read().result(), values[leaf])


def test_dtypes_and_prng_keys_in_stacks_round_trip(location):
    mesh = _mesh()
    dtypes = [ml_dtypes.bfloat16, ml_dtypes.int4, ml_dtypes.float8_e4m3fn, np.bool_, np.complex64, np.uint8, np.int16]
    values = {}
    for d in dtypes:
        for i in range(3):
            base = (np.arange(64 * 128) % 7 + i) % 2 if d is np.bool_ else (np.arange(64 * 128) % 7 - 3 + i)
            values[f"{np.dtype(d).name}/{i}"] = np.asarray(base).astype(d).reshape(64, 128)
    tree = {k.replace("/", "_"): jax.device_put(v, NamedSharding(mesh, P("x", "y"))) for k, v in values.items()}
    tree["keys"] = [jax.random.split(jax.random.key(i), 1024) for i in range(3)]  # key data (1024, 2) uint32
    ckpt.save(location("c"), tree)
    assert len(manifest_of(location("c")).stacks) == len(dtypes) + 1
    out = ckpt.restore(location("c"), mesh=mesh)
    for k, v in values.items():
        got = out[k.replace("/", "_")]
        assert got.dtype == v.dtype
        for s in got.addressable_shards:
            assert np.array_equal(np.asarray(s.data).view(np.uint8), np.ascontiguousarray(v[s.index]).view(np.uint8)), k
    for i in range(3):
        assert jax.dtypes.issubdtype(out["keys"][i].dtype, jax.dtypes.prng_key)
        assert np.array_equal(np.asarray(jax.random.key_data(out["keys"][i])),
                              np.asarray(jax.random.key_data(tree["keys"][i])))


def _big_stack(mesh):
    """Six 1 MiB arrays: a stack of two chunks (4 MiB, then 2 MiB)."""
    return {"m": [jax.device_put(np.full((512, 512), i, np.float32) + np.arange(512, dtype=np.float32),
                                 NamedSharding(mesh, P("x", "y"))) for i in range(6)]}


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_stack_chunk_is_an_error_naming_leaf_chunk_and_file(location, damage):
    mesh = _mesh()
    path = location("c")
    ckpt.save(path, _big_stack(mesh))
    (stack,) = manifest_of(path).stacks
    assert stack.shape == (6, 512, 512) and stack.zarr.chunk_shape == (4, 512, 512)
    storage = storage_of(path)
    key = f"{stack.zarr.path}/c/1/0/0"
    if damage == "flip":
        flip_byte(storage, key, byte=4 * 512 * 3 + 8)
    elif damage == "truncate":
        truncate(storage, key, 1000)
    else:
        storage.delete(key)
    error = ckpt.ChecksumError if damage == "flip" else ckpt.CheckpointError
    with pytest.raises(error) as e:
        ckpt.restore(path)
    msg = str(e.value)
    assert "m/4" in msg and "[1, 0, 0]" in msg and storage.where(key) in msg, msg
    assert {"flip": "crc32c", "truncate": "truncated", "delete": "missing"}[damage] in msg
    want = [np.asarray(a) for a in _big_stack(mesh)["m"]]
    if damage == "flip":  # verify=False returns the damaged bytes as they are
        out = ckpt.restore(path, verify=False)
        assert np.argwhere(out["m"][4] != want[4]).tolist() == [[3, 2]]
        assert np.array_equal(out["m"][5], want[5]) and np.array_equal(out["m"][3], want[3])
    # ckpt verify names the bad chunk of the stack, and the leaves that chunk holds (not all six).
    report = verify_checkpoint(storage, manifest_of(path))
    assert [p.chunk for p in report.problems] == [(1, 0, 0)]
    assert report.problems[0].leaf == "stack 0, members 4-5 (2 leaves: m/4, m/5)", report.problems[0].leaf


@pytest.mark.parametrize("how", ["raised", "in-future", "second-chunk", "commit"])
def test_failed_packed_save_keeps_the_previous_checkpoint(location, how):
    mesh = _mesh()
    path = location("c")
    first = _big_stack(mesh)
    ckpt.save(path, first)
    faults = Faults()
    if how == "commit":
        faults.fail("commit")
    else:
        faults.fail("write_chunk", after=1 if how == "second-chunk" else 0, in_future=how == "in-future")
    second = {"m": [a + 1 for a in first["m"]]}
    with pytest.raises((OSError, ckpt.CheckpointError)):
        ckpt.save(path, second, overwrite=True, options=faults.options())
    out = ckpt.restore(path)
    for i in range(6):
        assert np.array_equal(out["m"][i], np.asarray(first["m"][i]))
    if location.kind == "local":
        assert [n for n in os.listdir(Path(path).parent) if ".tmp-" in n] == []
    # The next save over it works and replaces the stacks; the previous ones are deleted (a
    # failed commit's generation on memory:// is a leftover the manager cleans up: SPEC 9).
    before = committed_generations(path)
    ckpt.save(path, second, overwrite=True)
    out = ckpt.restore(path)
    assert np.array_equal(out["m"][5], np.asarray(second["m"][5]))
    stored = keys(storage_of(path))
    (now,) = committed_generations(path)
    assert len([k for k in stored if "/c/" in k and k.startswith(now + "/")]) == 2, stored
    if location.kind == "memory":
        assert now != before[0] and not [k for k in stored if k.startswith(before[0] + "/")], stored


CRASH_CHILD = textwrap.dedent("""
    import sys, time
    directory, ready, tests = sys.argv[1:4]
    sys.path.insert(0, tests)
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from support import Faults
    from test_small_leaves import _big_stack, _mesh
    import ckpt

    faults = Faults()
    manager = ckpt.CheckpointManager(directory, options=faults.options())
    tree = _big_stack(_mesh())
    manager.save(1, tree)
    manager.wait()

    def write_then_hang(future, handle, box, data):
        future.result()  # the first chunk of the stack of step 2 is on disk
        open(ready, "w").close()
        time.sleep(600)

    faults.after("write_chunk", write_then_hang)
    manager.save(2, {"m": [a + 1 for a in tree["m"]]})
    time.sleep(600)
""")


def test_sigkill_during_a_packed_save_leaves_the_previous_step(tmp_path):
    child = tmp_path / "crash_child.py"
    child.write_text(CRASH_CHILD)
    directory, ready = tmp_path / "run", tmp_path / "ready"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, str(child), str(directory), str(ready), str(REPO / "tests")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[0].decode()
            assert time.monotonic() < deadline, "the child never started saving step 2"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()  # the child started above, by its own handle
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    (leftover,) = glob.glob(str(directory / "step_00000002.tmp-*"))
    assert glob.glob(f"{leftover}/~stacks/0/c/*/0/0")  # a stack chunk of step 2 was written
    with ckpt.CheckpointManager(directory) as manager:
        assert manager.all_steps() == [1]
        out = manager.restore(1)
    want = _big_stack(_mesh())
    for i in range(6):
        assert np.array_equal(np.asarray(out["m"][i]), np.asarray(want["m"][i]))


# ---- multi-process ---------------------------------------------------------------------------


def _mp_values(name: str, shape):
    return (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + sum(map(ord, name)))


MP_LEAVES = {  # path -> (shape, PartitionSpec over ('data', 'model') of a (2, 4) mesh, 2 x 4 devices)
    **{f"rep/{i}": ((2048,), P()) for i in range(12)},  # every process holds all: spread over both
    **{f"local/{i}": ((32, 64), P(None, "model")) for i in range(6)},  # each process holds all of it
    **{f"split/{i}": ((32, 64), P("data", "model")) for i in range(3)},  # split over processes
}


def _mp_tree(mesh):
    out: dict = {}
    for path, (shape, spec) in MP_LEAVES.items():
        head = path.split("/")[0]
        value = _mp_values(path, shape)
        out.setdefault(head, []).append(
            jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda idx, v=value: v[idx]))
    out["table"] = [_mp_values(f"table/{i}", (1100,)).astype(np.float64) for i in range(2)]  # numpy: process 0
    return out


def run_packed_save(w: Worker) -> None:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    faults = Faults()
    faults.before("write_chunk", lambda handle, box, data: None)
    faults.before("write_at", lambda offset, data: None)  # (the packed layout of multi-process saves)
    ckpt.save(w.args["path"], _mp_tree(mesh), options=faults.options())
    w.report(check="saved", chunk_writes=faults.calls["write_chunk"] + faults.calls["write_at"])
    out = ckpt.restore(w.args["path"], mesh=mesh)
    bad = []
    for path, (shape, _) in MP_LEAVES.items():
        got, want = _leaf(out, path), _mp_values(path, shape)
        bad += [path for s in got.addressable_shards if not np.array_equal(np.asarray(s.data), want[s.index])]
    w.report(check="restored", bad=bad)


def test_multi_process_save_packs_what_one_process_holds_whole(tmp_path):
    path = str(tmp_path / "mp")
    results = launch(f"{HERE}:run_packed_save", processes=2, devices_per_process=4, args={"path": path},
                     env={"CKPT_TIMEOUT_S": "20"})
    assert_all_succeeded(results)
    for r in results:
        assert r.one("restored")["bad"] == [], r.describe()
    # Both processes wrote stack chunks: the replicated leaves are spread over them.
    writes = [r.one("saved")["chunk_writes"] for r in results]
    m = manifest_of(path)
    kinds = {r.path: type(r.storage).__name__ for r in m.leaves}
    assert all(kinds[f"rep/{i}"] == "StackedStorage" for i in range(12))
    assert all(kinds[f"local/{i}"] == "StackedStorage" for i in range(6))
    assert all(kinds[f"split/{i}"] == "ZarrStorage" for i in range(3))
    assert [r.storage.chunk_shape for r in m.leaves if r.path.startswith("split/")] == [(16, 16)] * 3
    rep_stacks = {r.storage.stack for r in m.leaves if r.path.startswith("rep/")}
    assert len(rep_stacks) == 2, "replicated small arrays should be written by both processes"
    assert all(n > 0 for n in writes) and sum(writes) == sum(
        -(-s.shape[0] // s.zarr.chunk_shape[0]) for s in m.stacks) + 3 * 8
    # This process (8 devices) restores it all, every shard checked.
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    out = ckpt.restore(path, mesh=mesh)
    for p, (shape, _) in MP_LEAVES.items():
        want = _mp_values(p, shape)
        for s in _leaf(out, p).addressable_shards:
            assert np.array_equal(np.asarray(s.data), want[s.index]), p
    assert np.array_equal(out["table"][1], _mp_values("table/1", (1100,)).astype(np.float64))


# ---- the pure plan ---------------------------------------------------------------------------


def _shards(leaf, shape, boxes_holders, dtype="float32"):
    return ArrayShards(leaf, 4, dict(boxes_holders), shape, dtype)


def test_plan_packs_only_arrays_one_process_holds_whole_and_spreads_them():
    half = (((0, 8), (0, 8)), [(0, 0), (0, 1)]), (((8, 16), (0, 8)), [(1, 2), (1, 3)])
    everywhere = [(p, d) for p in range(2) for d in (2 * p, 2 * p + 1)]
    arrays = [_shards(0, (16, 8), half)]  # split over two processes: shard by shard
    arrays += [_shards(1 + i, (16, 8), [(((0, 16), (0, 8)), everywhere)]) for i in range(6)]  # replicated
    arrays += [_shards(7, (1 << 17,), [(((0, 1 << 17),), everywhere)])]  # 512 KiB: packed, alone
    arrays += [_shards(8, (1 << 18 + 1,), [(((0, 1 << 19),), everywhere)])]  # 2 MiB: not packed
    plan = plan_save(arrays)
    assert sorted(w.leaf for w in plan.writes if not isinstance(w, BundledWrite)) == [0, 0, 8]
    assert plan.whole == (7,)
    assert sorted(m for st in plan.stacks for m in st.members) == [1, 2, 3, 4, 5, 6]
    # Writers balance bytes: packed arrays first (every process plans them alike), the 512 KiB
    # one on process 0 and the small ones on process 1; then the 2 MiB array, which its holders
    # place on their least loaded member (process 1) from what they hold alone.
    assert {st.process for st in plan.stacks} == {1}
    assert [w.process for w in plan.writes if isinstance(w, BundledWrite) and w.array == 7] == [0]
    assert [w.process for w in plan.writes if not isinstance(w, BundledWrite) and w.leaf == 8] == [1]
    alone = plan_save(arrays[1:7])
    assert sorted(st.process for st in alone.stacks) == [0, 1]  # replicated arrays alone: spread
    for w in plan.writes:
        if isinstance(w, BundledWrite):
            for leaf, pieces in w.members:
                assert all((w.process, dev) in dict(arrays[leaf].holders)[box] for box, dev in pieces)
    assert plan_save(arrays) == plan  # deterministic
    assert plan_save(arrays, pack_limit=0).stacks == () and plan_save(arrays, pack_limit=0).whole == ()


def test_plan_splits_big_groups_into_stacks_of_bounded_size_and_chunks():
    n = MAX_STACK_MEMBERS + 10
    arrays = [_shards(i, (256,), [(((0, 256),), [(0, -1)])]) for i in range(n)]  # 1 KiB each
    plan = plan_save(arrays, stack_chunk_bytes=64 << 10)
    assert [len(st.members) for st in plan.stacks] == [MAX_STACK_MEMBERS, 10]
    assert plan.stacks[0].chunk_members == 64
    chunks = [w for w in plan.writes if w.array == -1]
    assert len(chunks) == MAX_STACK_MEMBERS // 64 and chunks[-1].box[0] == (MAX_STACK_MEMBERS - 64, MAX_STACK_MEMBERS)


def test_pack_limit_zero_writes_shard_by_shard_and_metadata_names_stack_members(tmp_path):
    mesh = _mesh()
    tree = {"w": [jax.device_put(_kernel(i), NamedSharding(mesh, P("x", "y"))) for i in range(3)]}
    ckpt.save(tmp_path / "a", tree, options=ckpt.Options(pack_limit_bytes=0))
    m = manifest_of(str(tmp_path / "a"))
    assert m.format_version == 1 and not m.stacks and m.leaves[0].storage.chunk_shape == (6, 48)
    ckpt.save(tmp_path / "b", tree)
    md = ckpt.metadata(tmp_path / "b")["w"][2]
    assert md.storage_path == "~stacks/0[2]" and md.chunk_shape == (24, 96) and md.partition_spec == P("x", "y")
    with open(tmp_path / "b" / "~stacks" / "0" / "zarr.json") as f:
        assert json.load(f)["attributes"]["jax_ckpt"]["members"] == ["w/0", "w/1", "w/2"]
    with open(tmp_path / "b" / "manifest.msgpack", "rb") as f:
        doc = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
    assert doc["leaves"][2]["storage"] == {"type": "stacked", "stack": 0, "index": 2}
