"""Benchmark: restoring replicated state in a multi-process job (docs/benchmarks.md,
"Replicated state"; issue 24).

    python -m bench.bench_replicas [--processes 2,4,8] [--mib 64] [--chunk-mib 1] [--devices 2]
                                   [--budget-mib N] [--runs N] [--fresh] [--systems 'A;B']
                                   [--compiled-before]
                                   [--seaweedfs | --url s3://bucket/prefix] [--dir /tmp/x] [--json]

For each process count N: N real processes under jax.distributed on 127.0.0.1 (tests/multiproc.py),
each with --devices CPU devices, on a (replica=N, fsdp=devices) mesh: FSDP inside a process,
replicas across processes (the layout Orbax's single-replica restore needs: it refuses a 1-D
mesh). A float32 tree of about --mib MiB is saved once by ckpt and once by Orbax, then restored,
side by side in the same run:
- ckpt today: every process reads its whole replica (``share_replicas=False``);
- ckpt shared: each unique byte read once, split among the replicas, exchanged by a psum over
  the replica axis (``share_replicas=True``);
- Orbax's ``SingleReplicaArrayHandler``: replica 0 reads, the others receive a broadcast.
Reported per system: bytes the job read from storage (on SeaweedFS the server's own counter of
bytes sent; for ckpt also a counting storage wrapper's, in total and for the busiest process;
Orbax's reads on disk go through TensorStore's file driver, which no per-process counter here
sees: n/a), requests (the server's GET count), the time of the slowest process, the largest peak
RSS growth of any process during the restore (sampled every 5 ms; with --fresh in processes that
did nothing else), and ckpt's own count of the host memory it held at most (``held``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


class _Peak:
    """The peak RSS growth over a block, sampled every 5 ms from /proc/self/statm."""

    def __enter__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.peak = self._rss()
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self):
        while self.running:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self._rss())
        self.growth = self.peak - self.start


def _server_counts(metrics_url: str | None) -> tuple[int, int]:
    """(GET requests, bytes sent) the SeaweedFS server counted so far."""
    if not metrics_url:
        return 0, 0
    import re
    import urllib.request

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    gets = sum(int(float(v)) for labels, v in re.findall(r"^SeaweedFS_s3_request_total\{(.*)\} (\S+)$", text, re.M)
               if 'type="GET"' in labels)
    sent = sum(int(float(v)) for v in re.findall(r"^SeaweedFS_s3_bucket_traffic_sent_bytes_total\{.*\} (\S+)$", text, re.M))
    return gets, sent


def job(w) -> None:
    """Run in each process (multiproc.launch)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import ckpt
    from ckpt.storage import WrapperStorage, open_storage

    a = w.args
    mesh = Mesh(np.array(jax.devices()).reshape(w.count, -1), ("replica", "fsdp"))
    leaves = 8
    rows = max(mesh.shape["fsdp"], int(a["mib"] * (1 << 20) / leaves / 4 / 1024) // mesh.shape["fsdp"] * mesh.shape["fsdp"])
    sharding = NamedSharding(mesh, P("fsdp", None))
    target = {f"layer{i}": jax.ShapeDtypeStruct((rows, 1024), np.float32, sharding=sharding) for i in range(leaves)}
    unique = leaves * rows * 1024 * 4
    where, disk = a["where"], a["disk"]
    chunking = ckpt.Options(max_chunk_bytes=int(a["chunk_mib"] * (1 << 20)))
    places = [where] if where == disk else [where, disk]
    # Orbax takes no s3:// path (epath makes it "s3:/..."; orbax#359): on local disk, beside
    # ckpt on the same disk.
    orbax_where = f"{disk}/orbax"
    if a["save"]:  # (a job that restores builds nothing: what it holds before is what it started with)
        tree = {k: jax.make_array_from_callback(
            t.shape, sharding, lambda idx, i=i: np.full(t.shape, i + 0.5, np.float32)[idx])
            for i, (k, t) in enumerate(target.items())}
        for place in places:
            ckpt.save(f"{place}/ckpt", tree, options=chunking, overwrite=True)
        ocp.PyTreeCheckpointer().save(orbax_where, tree, force=True)
        del tree

    counts = {"bytes": 0, "reads": 0}

    class Counting(WrapperStorage):
        def read_chunk(self, path, index, nbytes, into=None):
            counts["bytes"] += nbytes
            counts["reads"] += 1
            return super().read_chunk(path, index, nbytes, into)

        def read_chunk_async(self, path, index, nbytes, executor, into=None):
            counts["bytes"] += nbytes
            counts["reads"] += 1
            return super().read_chunk_async(path, index, nbytes, executor, into)

    def engine(location, options):
        return Counting(open_storage(location, dataclasses.replace(options, engine=None)))

    budget = int(a["budget_mib"] * (1 << 20)) if a["budget_mib"] else None

    held = {"high_water": 0}

    def ckpt_restore(place, share):
        def run():
            from ckpt._restore import restore_with_stats

            out, stats = restore_with_stats(f"{place}/ckpt", target, options=ckpt.Options(
                engine=engine, share_replicas=share, host_budget_bytes=budget))
            held["high_water"] = stats.host_high_water
            return out
        return run

    def orbax_single_replica():
        handler = ocp.type_handlers.SingleReplicaArrayHandler(replica_axis_index=0, broadcast_memory_limit_bytes=1 << 30)
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
        args = {k: ocp.type_handlers.SingleReplicaArrayRestoreArgs(sharding=sharding, global_shape=t.shape, dtype=t.dtype)
                for k, t in target.items()}
        return ocp.PyTreeCheckpointer().restore(orbax_where, args=ocp.args.PyTreeRestore(item=target, restore_args=args))

    if a.get("compiled_before"):  # as in a job that has compiled its step already (XLA's compiler loaded)
        jax.block_until_ready(jax.jit(lambda x: x * 2 + 1)(np.ones(4, np.float32)))
    systems = {}
    for place in places:
        tag = "s3" if place.startswith("s3://") else "disk"
        systems[f"ckpt today, {tag}"] = ckpt_restore(place, False)
        systems[f"ckpt shared, {tag}"] = ckpt_restore(place, True)
    systems["orbax 1-replica, disk"] = orbax_single_replica
    if a["systems"] is not None:
        systems = {k: v for k, v in systems.items() if k in a["systems"]}
    for run in range(a["runs"]):
        for name, fn in systems.items():
            held["high_water"] = 0
            w.barrier(f"{name}-{run}-before")
            before = _server_counts(a["metrics"]) if w.index == 0 else (0, 0)
            counts.update(bytes=0, reads=0)
            with _Peak() as peak:
                start = time.monotonic()
                out = fn()
                jax.block_until_ready(out)
                seconds = time.monotonic() - start
            ok = all(np.all(np.asarray(s.data) == i + 0.5) for i, k in enumerate(sorted(out, key=lambda k: int(k[5:])))
                     for s in out[k].addressable_shards)
            del out
            w.barrier(f"{name}-{run}-after")
            after = _server_counts(a["metrics"]) if w.index == 0 else (0, 0)
            w.report(system=name, run=run, seconds=seconds, rss=peak.growth, ok=bool(ok), unique=unique,
                     bytes=counts["bytes"] if name.startswith("ckpt") else None, reads=counts["reads"], server_gets=after[0] - before[0],
                     server_bytes=after[1] - before[1], high_water=held["high_water"])


def _mib(x) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", default="2,4,8")
    p.add_argument("--mib", type=float, default=64)
    p.add_argument("--chunk-mib", type=float, default=1)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--budget-mib", type=float, default=0, help="ckpt's host budget (default: its own default)")
    p.add_argument("--seaweedfs", action="store_true", help="start a local SeaweedFS (tests/servers.py)")
    p.add_argument("--url", help="an s3:// prefix (AWS_* variables set)")
    p.add_argument("--dir", help="a local directory (Orbax and the disk runs; default a temporary one)")
    p.add_argument("--fresh", action="store_true", help="each system's restore in fresh processes (clean RSS)")
    p.add_argument("--systems", help="only these systems, ';'-separated (e.g. 'ckpt today, s3;ckpt shared, s3')")
    p.add_argument("--compiled-before", action="store_true",
                   help="compile a small function before the restores (as a training job has), so that "
                        "RSS+ leaves out loading XLA's compiler")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from multiproc import assert_all_succeeded, launch

    server, env, metrics = None, {}, None
    if args.seaweedfs:
        from servers import SeaweedFS

        server = SeaweedFS().start()
        server.make_bucket("bench")
        where, env, metrics = "s3://bench/replicas", server.env(), server.metrics_url
    else:
        where = args.url or args.dir or tempfile.mkdtemp(prefix="ckpt-bench-replicas-")
    disk = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-replicas-disk-")
    rows = []
    names = ["ckpt today, s3", "ckpt shared, s3", "ckpt today, disk", "ckpt shared, disk", "orbax 1-replica, disk"]
    chosen = None if args.systems is None else [x.strip() for x in args.systems.split(";")]
    if chosen is not None and not set(chosen) <= set(names):
        p.error(f"--systems: unknown {sorted(set(chosen) - set(names))}; systems are {names}")
    names = chosen or names
    try:
        for n in [int(x) for x in args.processes.split(",")]:
            # --fresh: one job saves, then each system restores in a job of its own (fresh
            # processes, so that the RSS sampled is that restore's alone).
            jobs = [(True, chosen)] if not args.fresh else [(True, [])] + [(False, [s]) for s in names]
            by = {}
            for save, systems in jobs:
                results = launch(f"{os.path.abspath(__file__)}:job", processes=n, devices_per_process=args.devices,
                                 args={"where": f"{where}/p{n}", "disk": f"{disk}/p{n}", "mib": args.mib,
                                       "chunk_mib": args.chunk_mib, "runs": args.runs, "metrics": metrics,
                                       "budget_mib": args.budget_mib, "save": save, "systems": systems,
                                       "compiled_before": args.compiled_before},
                                 env={"CKPT_TIMEOUT_S": "60", **env}, timeout_s=1800, heartbeat_timeout_s=100)
                assert_all_succeeded(results)
                for r in results:
                    for rec in r.records:
                        by.setdefault((rec["system"], rec["run"]), []).append(rec)
            for (system, run), recs in sorted(by.items(), key=lambda kv: kv[0][1]):
                rows.append({
                    "processes": n, "system": system, "run": run, "ok": all(x["ok"] for x in recs),
                    "unique_mib": recs[0]["unique"] / 2**20,
                    "server_mib": sum(x["server_bytes"] for x in recs) / 2**20,
                    "counted_mib": None if recs[0]["bytes"] is None else sum(x["bytes"] for x in recs) / 2**20,
                    "max_process_mib": None if recs[0]["bytes"] is None else max(x["bytes"] for x in recs) / 2**20,
                    "server_gets": sum(x["server_gets"] for x in recs),
                    "seconds": max(x["seconds"] for x in recs),
                    "peak_rss_growth_mib": max(x["rss"] for x in recs) / 2**20,
                    "ckpt_high_water_mib": max(x["high_water"] for x in recs) / 2**20,
                })
    finally:
        if server is not None:
            server.stop()
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'N':>2} {'system':<22} {'unique':>7} {'server':>8} {'counted':>8} {'max/proc':>8} {'GETs':>5} "
              f"{'time s':>7} {'RSS+':>6} {'held':>5}  (MiB; budget {args.budget_mib or 'default'})")
        for r in rows:
            print(f"{r['processes']:>2} {r['system']:<22} {r['unique_mib']:>7.1f} {r['server_mib']:>8.1f} "
                  f"{_mib(r['counted_mib']):>8} {_mib(r['max_process_mib']):>8} {r['server_gets']:>5} {r['seconds']:>7.2f} "
                  f"{r['peak_rss_growth_mib']:>6.0f} {r['ckpt_high_water_mib']:>5.0f}{'' if r['ok'] else '  VALUES WRONG'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
