"""Restoring replicated state across processes (issue 24): each unique byte read once in total,
split among the processes that hold it, the pieces exchanged over collectives.

Real processes under jax.distributed on 127.0.0.1 (multiproc.py), 2, 4 and 8 of them; each job
saves a small tree (a few MiB, many chunks) on local disk and on SeaweedFS, then restores it with
sharing on, auto or off, counting the bytes every process reads from storage through a counting
wrapper around the engine, and compares every shard of every process with the saved values.
Layouts: pure data parallel (a 1-D mesh, every leaf replicated on every device), FSDP inside a
process x replicas across processes (a (replica, fsdp) mesh), and a 3-D mesh with replicas along
two axes, one of them inside a process. The 2-process job also fails one process's reads: every
process raises, naming it. The last jobs kill or stop one of 4 processes in the middle of a
shared restore: the others must name it within CKPT_TIMEOUT_S + 5 s.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt.storage import open_storage
from support import ReadCounter
from multihost_data import bad_shards, build
from multiproc import Worker, assert_all_succeeded, launch

HERE = os.path.abspath(__file__)
CHUNK = 64 << 10  # many chunks per leaf, so that eight processes each get a fair share

# (shape, dtype, spec on a (replica, fsdp) mesh); on the 1-D mesh every leaf is replicated.
ARRAYS = {
    "w": ((512, 512), np.float32, P("fsdp", None)),
    "v": ((256, 1024), jax.numpy.bfloat16, P(None, "fsdp")),
    "i": ((64, 1024), np.int32, P("fsdp")),
    "b": ((3000,), np.float32, P()),  # replicated on every device in both layouts
}
UNIQUE = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d, _ in ARRAYS.values())


# ---- code run inside the processes -----------------------------------------------------------


class Counting(ReadCounter):
    """Counts the bytes and requests this process reads from storage (chunks and manifest)."""

    counts = {"bytes": 0, "reads": 0}
    lock = threading.Lock()

    def count(self, nbytes: int) -> None:
        with self.lock:
            self.counts["bytes"] += nbytes
            self.counts["reads"] += 1

    def get(self, key, *, max_bytes):  # the manifest: counted too
        data = super().get(key, max_bytes=max_bytes)
        self.count(len(data))
        return data

    def read_exact(self, key, nbytes, into=None):
        self.count(nbytes)
        return super().read_exact(key, nbytes, into)

    @classmethod
    def take(cls) -> dict:
        with cls.lock:
            out = dict(cls.counts)
            cls.counts.update(bytes=0, reads=0)
        return out


def counting(location: str, options: ckpt.Options):
    return Counting(open_storage(location, dataclasses.replace(options, engine=None)))


def _layout(w: Worker, kind: str):
    devices = np.array(jax.devices())
    if kind == "dp":
        mesh = Mesh(devices, ("data",))
        return mesh, {k: (s, d, P()) for k, (s, d, _) in ARRAYS.items()}
    if kind == "3d":  # 4 processes x 2 devices: replicas along two axes, some inside a process
        mesh = Mesh(devices.reshape(2, 2, 2), ("a", "x", "y"))  # a, x: across processes; y: inside one
        specs = [P("y"), P(None, "x"), P(("x", "y")), P()]
        return mesh, {k: (s, d, spec) for (k, (s, d, _)), spec in zip(ARRAYS.items(), specs)}
    mesh = Mesh(devices.reshape(w.count, -1), ("replica", "fsdp"))
    return mesh, ARRAYS


def _fair_share(w: Worker, arrays: dict, shardings: dict) -> float:
    """The bytes this process would read if every region were split evenly among the
    processes holding it."""
    share = 0.0
    for k, (shape, dtype, _) in arrays.items():
        holders: dict = {}
        for d, index in shardings[k].devices_indices_map(shape).items():
            holders.setdefault(tuple(s.indices(n)[:2] for s, n in zip(index, shape)), set()).add(d.process_index)
        for box, processes in holders.items():
            if w.index in processes:
                share += np.prod([b - a for a, b in box]) * np.dtype(dtype).itemsize / len(processes)
    return share


def run_shared_job(w: Worker) -> None:
    for where in w.args["where"]:  # a local directory, an s3:// prefix on SeaweedFS
        store = "s3" if where.startswith("s3://") else "disk"
        for kind in w.args["layouts"]:
            mesh, arrays = _layout(w, kind)
            path = f"{where}/{kind}"
            ckpt.save(path, build(arrays, mesh, seed=3), options=ckpt.Options(max_chunk_bytes=CHUNK, pack_limit_bytes=0))
            shardings = {k: NamedSharding(mesh, spec) for k, (_, _, spec) in arrays.items()}
            targets = {  # a target of each kind: shardings, ShapeDtypeStructs, mesh=
                "sharding": dict(target=shardings),
                "struct": dict(target={k: jax.ShapeDtypeStruct(s, d, sharding=shardings[k])
                                       for k, (s, d, _) in arrays.items()}),
                "mesh": dict(mesh=mesh),
            }
            for mode in w.args["modes"] if kind != "3d" else ["on"]:
                given = targets[{"dp": "struct", "fsdp": "mesh", "3d": "sharding"}[kind] if mode == "on" else "sharding"]
                Counting.take()
                start = time.monotonic()
                tree = ckpt.restore(path, options=ckpt.Options(engine=counting, share_replicas=mode), **given)
                seconds = time.monotonic() - start
                bad, n = bad_shards(tree, arrays, shardings, seed=3)
                w.report(check=f"{store}-{kind}-{mode}", bad=bad, shards=n, share=_fair_share(w, arrays, shardings),
                         seconds=seconds, **Counting.take())
    if w.args.get("read_error"):  # a read fails on process 1 only: raised on every process, naming it
        mesh, arrays = _layout(w, "dp")
        path = f"{w.args['where'][0]}/dp"

        def failing(location, options):
            class Failing(Counting):
                def read_chunk_async(self, path, index, nbytes, executor, into=None):
                    raise OSError(5, "Input/output error (injected)")

                read_chunk = read_chunk_async

                def read_range(self, key, start, length, into=None):  # (packed layout: data objects)
                    raise OSError(5, "Input/output error (injected)")

            return Failing(open_storage(location, dataclasses.replace(options, engine=None)))

        try:
            ckpt.restore(path, mesh=mesh, options=ckpt.Options(engine=failing if w.index == 1 else counting,
                                                               share_replicas=True))
            w.report(check="read-error", raised=None)
        except ckpt.CheckpointError as e:
            w.report(check="read-error", raised=str(e))


def run_fault_job(w: Worker) -> None:
    """Process `victim` is killed (or stopped) once it has read its part of the second slab."""
    mesh, arrays = _layout(w, "dp")
    path = f"{w.args['dir']}/x"
    ckpt.save(path, build(arrays, mesh), options=ckpt.Options(max_chunk_bytes=CHUNK, pack_limit_bytes=0))
    from jax._src.distributed import global_state

    global_state.client.key_value_set(f"test/pid/{w.index}", str(os.getpid()))
    victim, how = w.args["victim"], w.args["how"]
    w.survivors = [p for p in range(w.count) if p != victim]
    reads = {"n": 0}

    def engine(location, options):
        class Fault(Counting):
            def read_chunk(self, path, index, nbytes, into=None):
                reads["n"] += 1
                if w.index == victim and reads["n"] == w.args["at_read"]:
                    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
                return super().read_chunk(path, index, nbytes, into)

            def read_range(self, key, start, length, into=None):  # (packed layout: data objects)
                reads["n"] += 1
                if w.index == victim and reads["n"] == w.args["at_read"]:
                    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
                return super().read_range(key, start, length, into)

            read_chunk_async = None  # every read through read_chunk

        return Fault(open_storage(location, dataclasses.replace(options, engine="local")))

    # Slabs of 1 MiB (5 MiB over 2 x 1 slot + 3 x 1 device: slab_memory): the fault lands in the
    # middle of the restore, with exchanges before and after.
    options = ckpt.Options(engine=engine, share_replicas=True, host_budget_bytes=5 << 20)
    start = time.monotonic()
    try:
        ckpt.restore(path, mesh=mesh, options=options)
        w.report(check="fault", raised=None)
        return
    except ckpt.CheckpointError as e:
        elapsed, message = time.monotonic() - start, str(e)
    w.report(check="fault", raised=message, seconds=elapsed)
    if how == "stop" and w.index == w.survivors[0]:  # the stopped process is this job's to end
        pid = int(global_state.client.blocking_key_value_get(f"test/pid/{victim}", 5000))
        os.kill(pid, signal.SIGKILL)


# ---- the tests -------------------------------------------------------------------------------


def _check(results, processes: int, tag: str, modes) -> None:
    assert_all_succeeded(results)
    for mode in modes:
        recs = [r.one(f"{tag}-{mode}") for r in results]
        for rec in recs:
            assert rec["bad"] == [] and rec["shards"] > 0, rec
        total = sum(rec["bytes"] for rec in recs)
        if mode == "on" or (mode == "auto" and processes >= 4):
            assert total <= 1.05 * UNIQUE, (tag, mode, total, UNIQUE, recs)
            for rec in recs:  # byte-balanced: no process reads much more than its share
                assert rec["bytes"] <= 1.5 * rec["share"], (tag, mode, rec, processes)
        else:  # not shared: every process reads its own replica (and the manifest)
            assert processes * UNIQUE <= total <= 1.05 * processes * UNIQUE, (tag, mode, total, recs)


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    from servers import SeaweedFS

    with SeaweedFS(str(tmp_path_factory.mktemp("seaweedfs"))) as server:
        server.make_bucket("shared")
        yield server


@pytest.mark.parametrize("processes, devices, layouts, modes", [
    (2, 2, ["dp", "fsdp"], ["on", "auto"]),  # auto at 2 replicas: not shared (the default threshold is 4)
    (4, 2, ["dp", "fsdp", "3d"], ["auto", "off"]),  # 3d: sharing forced on (2 replicas across processes)
    (8, 2, ["dp", "fsdp"], ["auto"]),
])
def test_replicated_restore_reads_each_byte_once(tmp_path, seaweed, processes, devices, layouts, modes):
    """On local disk and on SeaweedFS, in one job per process count (start-up is most of it)."""
    gets = seaweed.request_counts().get("GET", 0)
    results = launch(f"{HERE}:run_shared_job", processes=processes, devices_per_process=devices,
                     args={"where": [str(tmp_path), f"s3://shared/{processes}"], "layouts": layouts, "modes": modes,
                           "read_error": processes == 2},
                     env={"CKPT_TIMEOUT_S": "20", **seaweed.env()}, timeout_s=150, heartbeat_timeout_s=30)
    for store in ("disk", "s3"):
        for kind in layouts:
            _check(results, processes, f"{store}-{kind}", modes if kind != "3d" else ["on"])
    assert seaweed.request_counts().get("GET", 0) > gets  # the s3:// restores went to the server
    if processes == 2:
        mine, peer = results[1].one("read-error")["raised"], results[0].one("read-error")["raised"]
        assert mine and "injected" in mine, mine
        assert peer and "process 1 failed reading" in peer and "injected" in peer, peer


# Killed at its 2nd read: inside the first slab's reads, while the others wait at the agreement
# before the first exchange. Stopped at its 5th: in the second slab's reads, while the others are
# inside the first exchange (a stopped process keeps its connections open; the others watch it).
# (A process SIGKILLed while an exchange is in flight closes its gloo connections; once, under a
# load average of ~20, a second process went down with it: docs/multihost.md.)
@pytest.mark.parametrize("how, at_read", [("kill", 2), ("stop", 5)])
def test_a_process_killed_or_stopped_mid_restore_is_named(tmp_path, how, at_read):
    timeout_s = 4
    results = launch(f"{HERE}:run_fault_job", processes=4, devices_per_process=1,
                     args={"dir": str(tmp_path), "victim": 2, "how": how, "at_read": at_read},
                     env={"CKPT_TIMEOUT_S": str(timeout_s)}, timeout_s=90, heartbeat_timeout_s=30)
    assert results[2].returncode == -signal.SIGKILL, results[2].describe()
    for r in results[:2] + results[3:]:
        assert r.returncode == 0, r.describe()
        rec = r.one("fault")
        assert rec["raised"] and re.search(r"process\(es\) \[(\d+, )*2[],]", rec["raised"]), rec
        assert rec["seconds"] < timeout_s + 5, rec


# ---- in this process ---------------------------------------------------------------------------


def test_share_replicas_setting(monkeypatch):
    monkeypatch.delenv("CKPT_SHARE_REPLICAS", raising=False)
    assert ckpt.Options().resolved().share_replicas == "auto"
    assert ckpt.Options(share_replicas=True).resolved().share_replicas == "on"
    assert ckpt.Options(share_replicas=False).resolved().share_replicas == "off"
    for text, mode in [("1", "on"), ("off", "off"), ("AUTO", "auto"), ("0", "off")]:
        monkeypatch.setenv("CKPT_SHARE_REPLICAS", text)
        assert ckpt.Options().resolved().share_replicas == mode
    monkeypatch.setenv("CKPT_SHARE_REPLICAS", "sometimes")
    with pytest.raises(ValueError, match="CKPT_SHARE_REPLICAS"):
        ckpt.Options().resolved()
    with pytest.raises(ValueError, match="share_replicas"):
        ckpt.Options(share_replicas="yes").resolved()


def test_one_process_restores_as_before_with_sharing_forced_on(tmp_path):
    """No replicas across processes: the same restore, the same bytes read."""
    from ckpt._restore import restore_with_stats

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("replica", "fsdp"))
    ckpt.save(tmp_path / "x", build(ARRAYS, mesh), options=ckpt.Options(max_chunk_bytes=CHUNK, pack_limit_bytes=0))
    shardings = {k: NamedSharding(mesh, spec) for k, (_, _, spec) in ARRAYS.items()}
    got = {}
    for mode in (True, False):
        tree, stats = restore_with_stats(tmp_path / "x", shardings, options=ckpt.Options(share_replicas=mode))
        bad, n = bad_shards(tree, ARRAYS, shardings)
        assert bad == [] and n == 8 * len(ARRAYS)
        got[mode] = (stats.bytes_read, stats.chunks_read)
    assert got[True] == got[False] and got[True][0] == UNIQUE


def _unpacked_groups(tmp_path, pack_limit):
    """(the groups of a (replica=4, fsdp=2) mesh's leaves, not yet packed, each replica as if it
    were a process; the leaf records) of ARRAYS saved with CHUNK-sized chunks."""
    from ckpt._format import display_path, read_manifest
    from ckpt._restore.plan import _want_from_target
    from ckpt._restore.shared_source import _make_group
    from ckpt.storage import open_storage

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("replica", "fsdp"))
    ckpt.save(tmp_path / "x", build(ARRAYS, mesh), options=ckpt.Options(max_chunk_bytes=CHUNK, pack_limit_bytes=pack_limit))
    leaves = read_manifest(open_storage(str(tmp_path / "x"), ckpt.Options().resolved())).leaves
    shardings = {k: NamedSharding(mesh, spec) for k, (_, _, spec) in ARRAYS.items()}
    groups = {}
    for i, rec in enumerate(leaves):
        w = _want_from_target(i, rec, shardings[display_path(rec.path)])
        g = groups.setdefault(tuple(a for a in ("fsdp",) if a in str(w.sharding.spec)), _make_group(
            mesh, tuple(a for a in ("fsdp",) if a in str(w.sharding.spec))))
        g.wants.append(w)
        g.leaves.append(len(g.wants) - 1)
    for g in groups.values():
        g.holders = {slot: [0, 1, 2, 3] for slot in g.holders}
    return list(groups.values()), leaves


@pytest.mark.parametrize("pack_limit", [0, 1 << 20])  # chunked arrays; small ones in stacks
def test_every_byte_is_read_by_exactly_one_holder(tmp_path, pack_limit):
    """The assignment alone, for 4 simulated processes holding every slot of a (replica, fsdp)
    mesh: the parts the processes read cover each slot's pieces exactly once, each source (a
    chunk, a stack chunk) is one process's, and each process gets about a quarter of the bytes."""
    from ckpt._geometry import box_size, intersect
    from ckpt._restore import Reader, RestoreStats
    from ckpt._restore.shared_source import _my_reads, _pack

    groups, leaves = _unpacked_groups(tmp_path, pack_limit)
    for g in groups:
        _pack(g, leaves, 1 << 20, len(g.holders), 2)  # a 1 MiB budget: several slabs
        planner = Reader(None, leaves, False, RestoreStats(), ckpt.Options().resolved())
        planner.wants, planner._sources = [], {}
        total, per_process, owner = 0, [0] * 4, {}
        for j, slab in enumerate(g.slabs):
            got = {me: _my_reads(g, j, leaves, me, planner) for me in range(4)}
            for slot in g.holders:
                for p in slab:
                    parts = [(me, part) for me in range(4) for s, q, _, part in got[me] if s == slot and q == p]
                    box = next(b for me in range(4) for s, q, b, _ in got[me] if s == slot and q == p)
                    assert sum(box_size(part) for _, part in parts) == box_size(box)  # covered...
                    for a, (_, x) in enumerate(parts):  # ...exactly once
                        assert all(intersect(x, y) is None for _, y in parts[a + 1:])
            for me in range(4):
                for slot, p, _, part in got[me]:
                    n = box_size(part) * np.dtype(g.wants[p.k].dtype).itemsize
                    total += n
                    per_process[me] += n
                    rec = leaves[g.wants[p.k].index]
                    for src in planner._pieces(p.k, rec, part):
                        assert owner.setdefault((j, src.key), me) == me  # one reader per source and slab
        assert max(per_process) <= 1.5 * total / 4 + CHUNK, per_process  # (whole chunks: one of slack)
        assert total == sum(math.prod(leaves[w.index].shape) * np.dtype(w.dtype).itemsize for w in g.wants)


@pytest.mark.parametrize("budget", [1 << 20, 4 << 20, 32 << 20, 1 << 62])
@pytest.mark.parametrize("slots, devices", [(2, 2), (1, 2), (2, 8), (8, 8)])
def test_a_slab_with_its_exchange_fits_the_budget(tmp_path, budget, slots, devices):
    """The planned memory of one slab (the reads in flight and the exchange's input, output and
    collective buffers: slab_memory) fits the host budget, for any count of local slots and
    devices, unless one chunk alone is larger than its share (then a slab is that chunk, as a
    chunk larger than the budget is read whole by the reader); every piece lies inside its slab,
    and the slabs cover every leaf's shard."""
    from ckpt._geometry import box_size
    from ckpt._restore.shared_source import _MAX_SLAB, _MIN_SLAB, _pack, slab_memory

    groups, leaves = _unpacked_groups(tmp_path, 0)
    for g in groups:
        _pack(g, leaves, budget, slots, devices)
        chunk = max(math.prod(leaves[g.wants[k].index].chunk_shape) * np.dtype(g.wants[k].dtype).itemsize
                    for k in g.leaves)
        floor = -(-max(_MIN_SLAB, chunk) // 64) * 64
        assert slab_memory(g.slab_bytes, slots, devices) <= budget or g.slab_bytes <= floor, (g.slab_bytes, budget)
        assert g.slab_bytes <= _MAX_SLAB
        for slab in g.slabs:
            assert all(p.offset + p.nbytes <= g.slab_bytes for p in slab)
        for k in g.leaves:
            w, rec = g.wants[k], leaves[g.wants[k].index]
            shard = math.prod(w.sharding.shard_shape(rec.shape))
            assert sum(box_size(p.rel) for slab in g.slabs for p in slab if p.k == k) == shard
    # (the bound is not vacuous: at 4 MiB every layout here fits without the floor)
    if budget == 4 << 20:
        assert all(slab_memory(g.slab_bytes, slots, devices) <= budget for g in groups)
