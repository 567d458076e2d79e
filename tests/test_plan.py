"""The pure parts: layout geometry, save and restore plans, batching, storage names."""

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt import _restore
from ckpt._geometry import index_to_box, named_boxes
from ckpt._save.plan import ArrayShards, plan_save
from ckpt._restore.plan import batch_by_budget, plan_leaf_read
from ckpt._format.tree import escape_component, storage_paths

MESHES = [((8,), ("a",)), ((4, 2), ("a", "b")), ((2, 4), ("a", "b")), ((2, 2, 2), ("a", "b", "c"))]
SPECS = [P(), P("a"), P(None, "a"), P("a", "b"), P("b", "a"), P(("a", "b")), P(None, ("b", "a")), P(("a", "c"), "b")]


@pytest.mark.parametrize("mesh_shape,names", MESHES)
def test_named_boxes_agree_with_jax(mesh_shape, names):
    shape = (16, 32)
    mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), names)
    checked = 0
    for spec in SPECS:
        if not set(a for e in spec if e for a in ((e,) if isinstance(e, str) else e)) <= set(names):
            continue
        want = {d.id: index_to_box(i, shape) for d, i in NamedSharding(mesh, spec).devices_indices_map(shape).items()}
        got = named_boxes(shape, names, mesh_shape, tuple(spec))
        for coord, box in got.items():
            assert box == want[mesh.devices[coord].id], (spec, coord)
        checked += 1
    assert checked >= 3


def test_named_boxes_names_the_axis_that_does_not_divide():
    with pytest.raises(ValueError, match=r"dimension 0 of size 10 is not divisible by mesh axes \['a'\]"):
        named_boxes((10,), ("a",), (4,), ("a",))


def _holders_for(processes, devices_per_process, n_arrays, nbytes_each):
    """Fully replicated arrays: every device of every process holds a copy."""
    holders = [(p, p * 100 + d) for p in range(processes) for d in range(devices_per_process)]
    return [ArrayShards(i, 4, {((0, nbytes_each // 4),): holders}) for i in range(n_arrays)]


def test_save_plan_spreads_replicated_arrays_over_processes():
    plan = plan_save(_holders_for(4, 2, 16, 1 << 20))
    per_proc = plan.bytes_by_process()
    assert sorted(per_proc) == [0, 1, 2, 3]
    assert all(v == 4 << 20 for v in per_proc.values())
    devices = {w.device for w in plan.writes}
    assert len(devices) == 8  # spread over devices too, not only processes


def test_save_plan_with_uneven_sizes_stays_within_bounds():
    rng = np.random.default_rng(0)
    arrays = [ArrayShards(i, 1, {((0, int(n)),): [(p, p) for p in range(4)]})
              for i, n in enumerate(rng.integers(1 << 10, 1 << 20, 40))]
    plan = plan_save(arrays)
    total = sum(plan.bytes_by_process().values())
    for p, v in plan.bytes_by_process().items():
        assert 0.2 <= v / total <= 0.3, (p, v / total)


def test_save_plan_writes_each_unique_shard_once_from_a_holder():
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    shape = (16, 8)
    arrays = []
    for i, spec in enumerate([P("x", "y"), P("x"), P(None, "y"), P()]):
        holders = {}
        for d, idx in NamedSharding(mesh, spec).devices_indices_map(shape).items():
            holders.setdefault(index_to_box(idx, shape), []).append((d.process_index, d.id))
        arrays.append(ArrayShards(i, 4, holders))
    plan = plan_save(arrays)
    for a in arrays:
        writes = [w for w in plan.writes if w.leaf == a.leaf]
        assert sorted(w.box for w in writes) == sorted(a.holders)  # each box exactly once
        for w in writes:
            assert (w.process, w.device) in a.holders[w.box]
    assert plan == plan_save(list(reversed(arrays)))  # deterministic, order-independent


def test_restore_plan_reads_each_overlapping_chunk_once():
    # 24 rows saved in 8 chunks of 3; restored on 3 devices of 8 rows: boundaries cut chunks.
    boxes = [((0, 8), (0, 4)), ((8, 16), (0, 4)), ((16, 24), (0, 4))]
    plan = plan_leaf_read(0, (24, 4), (3, 4), 4, boxes)
    assert [r.chunks for r in plan.regions] == [((0, 0), (1, 0), (2, 0)), ((2, 0), (3, 0), (4, 0), (5, 0)),
                                                 ((5, 0), (6, 0), (7, 0))]
    assert len(plan.chunks) == 8 and plan.bytes_read == plan.bytes_needed == 24 * 4 * 4
    one = plan_leaf_read(0, (24, 4), (3, 4), 4, [((4, 5), (1, 3))])
    assert [c.index for c in one.chunks] == [(1, 0)] and one.bytes_read == 48 and one.bytes_needed == 8


def test_batch_by_budget():
    assert batch_by_budget([5, 5, 5, 20, 1], 10) == [[0, 1], [2], [3], [4]]
    assert batch_by_budget([], 10) == []


@pytest.mark.parametrize("given_by", ["options", "environment"])
def test_restore_respects_the_host_budget(tmp_path, monkeypatch, given_by):
    """Leaves are read in batches whose host bytes stay under the budget (a leaf larger than it
    is read region by region), and the result is still exact. The budget comes from
    Options.host_budget_bytes, or from CKPT_HOST_BUDGET_BYTES when the option is left unset."""
    sharding = NamedSharding(jax.make_mesh((4, 2), ("x", "y")), P("x", "y"))
    values = {f"w{i}": np.random.default_rng(i).standard_normal((64, 64)).astype(np.float32) for i in range(6)}
    values["big"] = np.ones((256, 256), np.float32)
    # Shard by shard (no packing): every chunk (2 or 32 KiB) is smaller than the budget.
    ckpt.save(tmp_path / "c", {k: jax.device_put(v, sharding) for k, v in values.items()},
              options=ckpt.Options(pack_limit_bytes=0))
    budget = 40_000  # "big" (256 KiB) is read region by region
    if given_by == "options":
        options = ckpt.Options(host_budget_bytes=budget)
    else:
        monkeypatch.setenv("CKPT_HOST_BUDGET_BYTES", str(budget))
        options = None
    out, stats = _restore.restore_with_stats(tmp_path / "c", {k: sharding for k in values}, options=options)
    # Measured where each host buffer is allocated: within the budget, and it was needed.
    assert stats.host_budget == budget and budget // 2 < stats.host_high_water <= budget
    for k, v in values.items():
        for s in out[k].addressable_shards:
            assert np.array_equal(np.asarray(s.data), v[s.index])


def test_storage_names_are_safe_and_unique():
    assert escape_component("wq") == "wq"
    assert escape_component("a/b") == "a%2Fb"
    assert escape_component("..") == "%2E."
    assert escape_component("") == "%"
    assert escape_component("zarr.json") == "%7Aarr.json"
    assert escape_component("é") == "%C3%A9"
    paths = storage_paths([("A",), ("a",), ("a", "b"), ("B", "c"), ("b",)])
    assert len({p.lower() for p in paths}) == 5
    for p, q in itertools.combinations(paths, 2):
        assert not q.lower().startswith(p.lower() + "/") and not p.lower().startswith(q.lower() + "/")


def test_tiles_of_a_region_over_the_budget_are_chunk_aligned_and_hold_each_chunk_once():
    """A restore cuts a region whose chunks do not fit the host budget into tiles along chunk
    boundaries (ckpt._place._split): every needed chunk lies in exactly one tile, and each tile
    fits, or is one chunk."""
    from ckpt._geometry import box_size, chunks_overlapping, intersect
    from ckpt._restore.place import _split

    chunk = (16, 64)
    region = ((8, 200), (32, 256))  # not aligned to the chunk grid at its edges
    limit = 4 * 16 * 64  # four chunks' elements

    def fits(tile):
        return len(chunks_overlapping(tile, chunk)) * 16 * 64 <= limit

    tiles = _split(region, chunk, fits)
    assert sum(box_size(t) for t in tiles) == box_size(region)
    for t in tiles:
        assert fits(t) or len(chunks_overlapping(t, chunk)) == 1
        for u in tiles:
            assert u is t or intersect(t, u) is None
    owners = [c for t in tiles for c in chunks_overlapping(t, chunk)]
    assert sorted(owners) == sorted(chunks_overlapping(region, chunk))  # each chunk in one tile
    assert _split(region, chunk, lambda t: True) == [region]
