"""Odd shardings JAX accepts save and restore exactly, or the save refuses before it writes.

Issue 25 items 3 and 4, and its property test:
  - a 0-d array under ``P(None)`` (a spec longer than the rank, with None entries: JAX accepts it
    for arrays made with make_array_from_callback) used to commit a manifest that every reader
    refused, for every leaf of the checkpoint;
  - a zero-size array that is not fully replicated crashed the save of a 2-process job
    (ZeroDivisionError: a chunk dimension of 0);
  - property: for random shapes (0-d and zero-size included) and the PartitionSpecs JAX accepts
    for them on 1-D and 2-D meshes (None entries, tuples of axes, unused axes, trailing Nones,
    ``P.UNCONSTRAINED``), ``save`` then ``restore`` (the same sharding as target, numpy, and the
    saved mesh) gives back every shard exactly and the recorded spec lays the array out as it
    was, or ``save`` raises a CheckpointError and the location holds nothing. One process here
    (hypothesis); a 2-process job (4 CPU devices each) runs a fixed enumeration of cases.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt

HERE = os.path.abspath(__file__)


# ---- shared by this process and the processes of the 2-process job --------------------------


def _value(key: str, shape, dtype) -> np.ndarray:
    """The global value of a leaf: distinct elements (a misplaced shard shows), per leaf."""
    base = sum(map(ord, key))
    n = int(np.prod(shape, dtype=np.int64))
    return ((np.arange(n, dtype=np.int64) * 7 + base) % 251 - 125).reshape(shape).astype(dtype)


def _make(key: str, shape, dtype, sharding) -> tuple[jax.Array, np.ndarray] | None:
    """The array `key` under `sharding`, or None when JAX refuses that sharding for it."""
    full = _value(key, shape, dtype)
    try:
        arr = jax.make_array_from_callback(tuple(shape), sharding, lambda idx: full[idx])
    except Exception:  # IndexError, IndivisibleError, DuplicateSpecError, ValueError: not accepted
        return None
    assert arr.dtype == full.dtype, (arr.dtype, full.dtype)
    return arr, full


def _meshes() -> dict[str, Mesh]:
    """1-D and 2-D meshes over all devices: jax.make_mesh's (Explicit axes), plain Mesh (Auto
    axes, where P.UNCONSTRAINED is allowed), and one whose device order interleaves processes."""
    devs = jax.devices()
    by_process = sorted(devs, key=lambda d: (d.id % 2, d.id))  # another order of the same devices
    return {
        "8": jax.make_mesh((8,), ("x",)),
        "4x2": jax.make_mesh((4, 2), ("x", "y")),
        "2x4": jax.make_mesh((2, 4), ("x", "y")),
        "auto-8": Mesh(np.array(devs), ("x",)),
        "auto-4x2-shuffled": Mesh(np.array(by_process).reshape(4, 2), ("x", "y")),
    }


def _entries(axes: tuple[str, ...], unconstrained: bool, spellings: bool = True) -> list:
    """Every spec entry over `axes`: None, one axis, ordered pairs; with `spellings` also the
    other ways of writing them, () and 1-tuples."""
    out = [None, ()] if spellings else [None]
    for a in axes:
        out += [a, (a,)] if spellings else [a]
    out += list(itertools.permutations(axes, 2))
    if unconstrained:
        out.append(P.UNCONSTRAINED)
    return out


def _check_case(path: str, tree: dict, mesh: Mesh, save_kwargs: dict) -> str:
    """Save `tree` ({key: (array, full value)}) at `path`; then every way of restoring it gives
    the values back exactly. Returns "saved", or "refused" when the save raised a
    CheckpointError (then nothing is at `path` or next to it)."""
    parent = os.path.dirname(path)
    assert os.listdir(parent) == []
    arrays = {k: a for k, (a, _) in tree.items()}
    try:
        ckpt.save(path, arrays, **save_kwargs)
    except ckpt.CheckpointError as e:
        assert os.listdir(parent) == [], f"the refused save ({e}) left {os.listdir(parent)}"
        return "refused:" + str(e)
    where = f"{path} {[(k, a.shape, a.dtype.name, a.sharding.spec) for k, a in arrays.items()]}"

    # The same sharding as target: every addressable shard, exactly.
    restored = ckpt.restore(path, {k: a.sharding for k, a in arrays.items()})
    for k, (a, full) in tree.items():
        r = restored[k]
        assert r.shape == a.shape and r.dtype == a.dtype and r.sharding == a.sharding, (where, k, r.sharding)
        assert len(r.addressable_shards) == len(a.addressable_shards), (where, k)
        for s in r.addressable_shards:
            assert np.array_equal(np.asarray(s.data), full[s.index]), (where, k, s.device, s.index)
            assert np.asarray(s.data).shape == full[s.index].shape, (where, k, s.index)

    # As numpy: the whole value.
    as_numpy = ckpt.restore(path)
    for k, (a, full) in tree.items():
        assert isinstance(as_numpy[k], np.ndarray), (where, k, type(as_numpy[k]))
        assert as_numpy[k].dtype == full.dtype and np.array_equal(as_numpy[k], full), (where, k)

    # The recorded spec lays the array out exactly as it was, and restore(mesh=) uses it.
    meta = ckpt.metadata(path)
    on_mesh = ckpt.restore(path, mesh=mesh)
    for k, (a, full) in tree.items():
        spec = meta[k].partition_spec
        assert len(spec) <= a.ndim, (where, k, spec)
        recorded = NamedSharding(mesh, spec)
        assert recorded.devices_indices_map(a.shape) == a.sharding.devices_indices_map(a.shape), (where, k, spec)
        r = on_mesh[k]
        assert r.sharding.devices_indices_map(a.shape) == a.sharding.devices_indices_map(a.shape), (where, k)
        for s in r.addressable_shards:
            assert np.array_equal(np.asarray(s.data), full[s.index]), (where, k, s.device, s.index)
    return "saved"


# ---- item 3: a spec longer than the rank ------------------------------------------------------


def test_scalar_with_trailing_none_spec_restores(tmp_path):
    """P(None) on a 0-d array and P('x', None, None) on a 1-d one: the manifest records the spec
    cut to the rank, and every leaf (the others too) restores. A plain Mesh (Auto axes): jax 0.12
    refuses a spec longer than the rank on jax.make_mesh's Explicit axes, not on Auto ones."""
    mesh = Mesh(np.array(jax.devices()), ("x",))
    tree = {
        "scalar": _make("scalar", (), np.float32, NamedSharding(mesh, P(None))),
        "long": _make("long", (16,), np.float32, NamedSharding(mesh, P("x", None, None))),
        "zeros": _make("zeros", (0, 8), np.int32, NamedSharding(mesh, P(None, "x", None))),
        "big": _make("big", (64, 32), np.float32, NamedSharding(mesh, P(None, ("x",), None))),
    }
    assert all(v is not None for v in tree.values())  # JAX accepts all four
    assert tree["scalar"][0].sharding.spec == P(None)
    (tmp_path / "case").mkdir()
    path = str(tmp_path / "case" / "c")
    assert _check_case(path, tree, mesh, {}) == "saved"
    meta = ckpt.metadata(path)
    assert meta["scalar"].partition_spec == P() and meta["long"].partition_spec == P("x")
    assert meta["zeros"].partition_spec == P(None, "x") and meta["big"].partition_spec == P(None, "x")


def test_checkpoint_written_with_trailing_none_specs_still_restores(tmp_path):
    """A checkpoint committed before the fix (its manifest records P(None) for a 0-d leaf and
    P('x', None, None) for a 1-d one) restores; an entry past the rank that names an axis is
    still refused as corrupt."""
    import msgpack

    from ckpt._format.records import CHECKSUM_KEY, seal

    mesh = jax.make_mesh((8,), ("x",))
    tree = {
        "scalar": _make("scalar", (), np.float32, NamedSharding(mesh, P())),
        "long": _make("long", (16,), np.float32, NamedSharding(mesh, P("x"))),
        "other": _make("other", (64, 32), np.float32, NamedSharding(mesh, P(None, "x"))),
    }
    (tmp_path / "case").mkdir()
    path = tmp_path / "case" / "c"
    ckpt.save(str(path), {k: a for k, (a, _) in tree.items()})

    def rewrite(specs):
        # The manifest as the old save wrote it: specs as JAX held them, resealed.
        doc = msgpack.unpackb((path / "manifest.msgpack").read_bytes(), raw=False, strict_map_key=False)
        doc.pop(CHECKSUM_KEY)
        for leaf in doc["leaves"]:
            if leaf["path"] in specs:
                leaf["sharding"]["spec"] = specs[leaf["path"]]
        (path / "manifest.msgpack").write_bytes(seal(doc))

    rewrite({"scalar": [None], "long": ["x", None, None]})
    restored = ckpt.restore(str(path), {k: a.sharding for k, (a, _) in tree.items()})
    for k, (a, full) in tree.items():
        for sh in restored[k].addressable_shards:
            assert np.array_equal(np.asarray(sh.data), full[sh.index]), (k, sh.index)
    meta = ckpt.metadata(str(path))
    assert meta["scalar"].partition_spec == P() and meta["long"].partition_spec == P("x")
    on_mesh = ckpt.restore(str(path), mesh=mesh)
    assert np.array_equal(np.asarray(on_mesh["long"]), tree["long"][1])
    assert on_mesh["long"].sharding.spec == P("x")

    rewrite({"scalar": ["x"]})
    with pytest.raises(ckpt.CheckpointError, match=r"leaf \d+ \('scalar'\): PartitionSpec has 1 entries for 0"):
        ckpt.restore(str(path))


def test_unconstrained_spec_saves_as_unsplit(tmp_path):
    """P.UNCONSTRAINED (allowed on Auto axes) lays a concrete array out unsplit: recorded as None."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    tree = {
        "u": _make("u", (8, 6), np.float32, NamedSharding(mesh, P("x", P.UNCONSTRAINED))),
        "s": _make("s", (), np.float32, NamedSharding(mesh, P(P.UNCONSTRAINED))),
    }
    (tmp_path / "case").mkdir()
    path = str(tmp_path / "case" / "c")
    assert _check_case(path, tree, mesh, {}) == "saved"
    assert ckpt.metadata(path)["u"].partition_spec == P("x", None)


# ---- property test, one process ------------------------------------------------------------

try:
    from hypothesis import HealthCheck, event, given, settings, strategies as st
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    st = None


def _leaf_strategy(draw, mesh: Mesh, auto: bool):
    """(shape, spec, dtype): mostly specs JAX accepts for the shape (dims divisible by their
    axes), sometimes not (a non-None entry past the rank, an indivisible dimension)."""
    axes = tuple(mesh.axis_names)
    ndim = draw(st.integers(0, 3))
    length = draw(st.integers(0, ndim + 2))
    used: set[str] = set()
    spec = []
    for i in range(length):
        options = [e for e in _entries(axes, auto) if not set(_axes_of(e)) & used]
        if i >= ndim:  # past the rank JAX accepts only None-like entries: mostly those
            options = options if draw(st.integers(0, 9)) == 0 else [None, ()]
        e = draw(st.sampled_from(options))
        used |= set(_axes_of(e))
        spec.append(e)
    shape = []
    for d in range(ndim):
        parts = int(np.prod([mesh.shape[a] for a in _axes_of(spec[d] if d < len(spec) else None)]))
        if draw(st.integers(0, 9)) == 0:
            shape.append(draw(st.integers(0, 9)))  # maybe not divisible
        else:
            shape.append(parts * draw(st.sampled_from([0, 1, 1, 2, 3, 8, 16])))
    dtype = draw(st.sampled_from([np.float32, np.int8, jnp.bfloat16]))
    return tuple(shape), P(*spec), dtype


def _axes_of(entry) -> tuple[str, ...]:
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


if st is not None:
    _MESHES = None

    @st.composite
    def _case(draw):
        global _MESHES
        if _MESHES is None:
            _MESHES = _meshes()
        name = draw(st.sampled_from(sorted(_MESHES)))
        mesh = _MESHES[name]
        specs = [_leaf_strategy(draw, mesh, name.startswith("auto")) for _ in range(draw(st.integers(1, 3)))]
        kwargs = draw(st.sampled_from([{}, {"options": ckpt.Options(pack_limit_bytes=0)},
                                       {"options": ckpt.Options(pack_limit_bytes=0), "max_chunk_bytes": 4096}]))
        return name, specs, kwargs

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(_case())
    def test_property_one_process(case):
        name, specs, kwargs = case
        mesh = _meshes()[name]
        tree = {}
        for i, (shape, spec, dtype) in enumerate(specs):
            made = _make(f"leaf{i}", shape, dtype, NamedSharding(mesh, spec))
            if made is not None:
                tree[f"leaf{i}"] = made
        event(f"{len(tree)} of {len(specs)} leaves accepted by JAX")
        if not tree:
            return
        root = tempfile.mkdtemp(prefix="ckpt-odd-")
        try:
            os.mkdir(os.path.join(root, "case"))
            outcome = _check_case(os.path.join(root, "case", "c"), tree, mesh, kwargs)
            event(outcome.split(":")[0])
        finally:
            shutil.rmtree(root, ignore_errors=True)


# ---- the 2-process job: item 4 and the enumerated property cases ------------------------------

# Shapes enumerated in the job: 0-d, zero-size dimensions (first, last, both), small ones that
# stay small, and ones whose shards are bigger than the inline limit (written as Zarr arrays).
JOB_SHAPES = [(), (0,), (8,), (3,), (0, 8), (8, 0), (16, 8), (4, 6), (64, 32), (8, 0, 4)]
JOB_SAVE_KWARGS = [{}, {"options": ckpt.Options(pack_limit_bytes=0)},
                   {"options": ckpt.Options(pack_limit_bytes=0), "max_chunk_bytes": 4096}]


def _job_specs(axes: tuple[str, ...], ndim: int, auto: bool) -> list[P]:
    """Every spec over `axes` up to one entry past the rank, no axis twice (the other
    spellings of entries, and P.UNCONSTRAINED, up to rank 1 only: the count grows fast)."""
    out = []
    options = _entries(axes, auto and ndim <= 1, spellings=ndim <= 1)
    for length in range(ndim + 2):
        for entries in itertools.product(options, repeat=length):
            used = [a for e in entries for a in _axes_of(e)]
            if len(used) == len(set(used)):
                out.append(P(*entries))
    return out


def run_odd_shardings_job(w) -> None:
    root = w.args["dir"]

    # Item 4 first, on its own: a zero-size array that is not fully replicated.
    mesh = jax.make_mesh((8,), ("x",))
    zero = {"z": _make("z", (0, 8), np.float32, NamedSharding(mesh, P(None, "x"))),
            "z2": _make("z2", (8, 0), np.float32, NamedSharding(mesh, P("x", None)))}
    assert not zero["z"][0].sharding.is_fully_replicated
    path = os.path.join(root, "zero-size", "c")
    if w.index == 0:
        os.makedirs(os.path.dirname(path))
    w.barrier("zero-size-dir")
    try:
        outcome = _check_case(path, zero, mesh, {})
    except Exception as e:  # reported, so the test shows the error of each process
        w.report(check="zero-size", outcome=f"{type(e).__name__}: {e}")
    else:
        w.report(check="zero-size", outcome=outcome)
    w.barrier("zero-size-done")

    # The enumeration: per mesh and shape, one tree of every accepted spec (one save, so the
    # leaves also share stacks and plans); a refused tree is retried leaf by leaf.
    counts = {"saved": 0, "refused": 0, "not accepted": 0}
    refused = []
    n = 0
    for name, mesh in _meshes().items():
        auto = name.startswith("auto")
        for shape in JOB_SHAPES:
            tree = {}
            for k, spec in enumerate(_job_specs(tuple(mesh.axis_names), len(shape), auto)):
                made = _make(f"{name}-{shape}-{k}", shape, np.float32, NamedSharding(mesh, spec))
                if made is None:
                    counts["not accepted"] += 1
                else:
                    tree[f"s{k}"] = made
            if not tree:
                continue
            kwargs = JOB_SAVE_KWARGS[n % len(JOB_SAVE_KWARGS)]
            batches = [tree]
            while batches:
                batch = batches.pop()
                n += 1
                path = os.path.join(root, f"case{n}", "c")
                if w.index == 0:
                    os.makedirs(os.path.dirname(path))
                w.barrier(f"case{n}")
                outcome = _check_case(path, batch, mesh, kwargs)
                w.barrier(f"case{n}-done")
                if outcome == "saved":
                    counts["saved"] += len(batch)
                elif len(batch) > 1:
                    batches += [{k: v} for k, v in batch.items()]
                else:
                    counts["refused"] += 1
                    refused.append((name, shape, str(next(iter(batch.values()))[0].sharding.spec), outcome))
    w.report(check="enumeration", counts=counts, refused=refused, saves=n)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from multiproc import launch

    root = tmp_path_factory.mktemp("odd-job")
    return launch(f"{HERE}:run_odd_shardings_job", processes=2, devices_per_process=4,
                  args={"dir": str(root)}, timeout_s=300)


def test_zero_size_not_fully_replicated_in_two_processes(job):
    for r in job:
        assert r.one("zero-size")["outcome"] == "saved", r.describe()


def test_property_two_processes(job):
    from multiproc import assert_all_succeeded

    assert_all_succeeded(job)
    reports = [r.one("enumeration") for r in job]
    assert reports[0] == reports[1]
    counts = reports[0]["counts"]
    # Every spec JAX accepts here saves: a refusal is allowed by the property, but none of these
    # needs one, so one would be a regression to look at.
    assert counts["refused"] == 0, reports[0]["refused"]
    # (saved: more than 800 under jax 0.10.2; 695 under 0.12, which refuses specs longer than the
    # rank on Explicit axes)
    assert counts["saved"] > 600 and counts["not accepted"] > 0, counts
