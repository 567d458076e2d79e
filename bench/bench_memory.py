"""Memory benchmark (issue 10): peak host RSS and throughput of save and restore under a host budget.

    python -m bench --memory [--gib 2] [--runs 3] [--dir /tmp/ckpt-bench] [--json]
                             [--only save,restore,first,big]

Every measurement runs in a fresh process (``python -m bench.bench_memory --child SPEC``, started
from the repository root, 8 CPU devices) that prints one JSON line. Around each timed region the child collects garbage, touches
and frees 1.25x the data (the VM's fresh-memory cost, docs/benchmarks.md), returns free malloc
memory to the kernel (``malloc_trim``, so that the region cannot reuse pages already counted as
resident), reads VmRSS, resets the high-water mark (``5`` > /proc/self/clear_refs) and after the
region reads VmHWM. On CPU the devices' memory is host memory, so the resident baseline includes
the tree on the devices. Sections (docs/benchmarks.md, "Host memory"):

- save: the benchmark tree (bench.common.make_tree, 4x2 mesh) saved with a host budget (256 MiB)
  beside the raw-disk write of the same unique shards in the same child (order alternating);
  peak RSS over the resident tree.
- restore: that checkpoint restored with the same budget onto the same sharding, onto (2,4) and
  onto one device, each in its own child, interleaved with raw reads of the same bytes (children
  of their own); peak RSS over the resident baseline plus the restored tree's own buffers; every
  restored shard is compared with the regenerated tree afterwards.
- first: the first save of a fresh process with the default budget, for ckpt, Orbax
  (StandardCheckpointer, defaults), jax's serializer (GlobalAsyncCheckpointManager), a raw-disk
  write of the same unique bytes and a bare device-to-host copy of them, a child each, rotated.
- big: one array (1 GiB) sharded over 2 devices saved and restored with a 128 MiB budget.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

MIB = 2**20
SECTIONS = ("save", "restore", "first", "big")
TARGETS = ("same", "mesh24", "one")
FIRST_SYSTEMS = ("raw", "bare", "ckpt", "orbax", "jax")
SLACK = 1.10  # the bound: budget + 10%
CHILD_TIMEOUT = 1800  # seconds; a 2 GiB child takes well under a minute
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the directory holding bench/


# ---- the parent: children, aggregation, table ------------------------------------------------------


def _run_child(spec: dict) -> dict:
    """Run one measurement in a fresh process; its JSON line. RuntimeError when it fails or runs
    past spec["timeout"] seconds (then with every thread's stack, from the child's faulthandler)."""
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
    # bench/ is not installed: the child finds it from the repository root, whatever the parent's
    # working directory (run() makes the scratch paths in the spec absolute for that reason).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "bench.bench_memory", "--child", json.dumps(spec)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    timeout = spec.get("timeout", CHILD_TIMEOUT)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # the child dumps every thread's stack to stderr
        time.sleep(2)
        proc.kill()
        stdout, stderr = proc.communicate()
        sys.stderr.write(stderr[-12000:])
        raise RuntimeError(f"benchmark child {spec['kind']} ran past {timeout} s: hung? (its stacks above)") from None
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(stderr[-4000:])
        last = (stderr.strip().splitlines() or [""])[-1][:300]
        raise RuntimeError(f"benchmark child {spec['kind']} failed (exit {proc.returncode}): {last}")
    out = json.loads(lines[-1])
    print(f"  {spec['kind']} {spec.get('target') or spec.get('system') or ''}: "
          + ", ".join(f"{k} {v:.3f}" for k, v in out.items() if isinstance(v, float) and k.endswith(("_s", "seconds"))),
          file=sys.stderr)
    return out


def _med(values) -> float:
    return statistics.median(values)


def _bound(over_mib: float, budget: int) -> dict:
    limit = SLACK * budget / MIB
    return {"over_mib": over_mib, "limit_mib": limit, "ok": over_mib <= limit}


def run(gib: float = 2.0, runs: int = 3, root: str = "/tmp/ckpt-bench", only=SECTIONS,
        budget_mib: int = 256, big_mib: int = 1024, big_budget_mib: int = 128, tiny: bool = False,
        child_timeout: float = CHILD_TIMEOUT) -> dict:
    """Run the sections in `only`, each measurement in a fresh child; figures are medians over
    `runs` (times) and the largest value seen (memory). A section whose child fails is reported
    as ``{"error": ...}`` and the others still run. `tiny`: a 21 MiB tree instead of the
    benchmark tree (the tests' run of the harness; `gib` is then ignored). `child_timeout`: seconds
    one measurement may take before it is killed and reported as an error."""
    root = os.path.join(os.path.abspath(root), "memory")  # absolute: the children run in REPO
    os.makedirs(root, exist_ok=True)
    res: dict = {"gib": gib, "runs": runs, "budget_mib": budget_mib,
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    base = {"gib": gib, "root": root, "budget": budget_mib * MIB, "tiny": tiny, "timeout": child_timeout}
    sections = {"save": lambda: _section_save(base, runs, res, "save" in only),
                "restore": lambda: _section_restore(base, runs),
                "first": lambda: _section_first(base, runs),
                "big": lambda: _section_big(root, big_mib, big_budget_mib, child_timeout)}
    if "restore" in only and "save" not in only:
        only = ("save-setup", *only)  # restore needs the checkpoint and raw files a save child leaves
    for name in only:
        key = "save" if name == "save-setup" else name
        try:
            out = sections[key]()
        except RuntimeError as e:
            out = {"error": str(e)}
        if out is not None:
            res[key] = out
    if "unique_gib" not in res and "unique_bytes" in res.get("first", {}):
        res["unique_gib"] = res["first"]["unique_bytes"] / 2**30
    shutil.rmtree(os.path.join(root, "raw"), ignore_errors=True)
    shutil.rmtree(os.path.join(root, "ckpt"), ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(root, "raw-shapes.json"))
    return res


def _section_save(base: dict, runs: int, res: dict, report: bool) -> dict | None:
    saves = [_run_child({**base, "kind": "save", "order": r}) for r in range(runs if report else 1)]
    s = saves[-1]
    res["unique_gib"] = s["unique_bytes"] / 2**30
    if not report:
        return None
    raw, save = _med(x["raw_write_s"] for x in saves), _med(x["save_s"] for x in saves)
    over = max(x["save_mem"]["over_resident_mib"] for x in saves)
    return {"raw_write_s": raw, "save_s": save, "ratio": raw / save, "ratio_goal": 0.85,
            "blocking_s": _med(x["save_blocking_s"] for x in saves),
            "retained_mib": max(x["save_mem"]["retained_mib"] for x in saves),
            "released_mib": s.get("released_mib"), "budget_via": s["budget_via"],
            "memory": _bound(over, base["budget"]), "runs": saves}


def _section_restore(base: dict, runs: int) -> dict:
    got: dict[str, list] = {k: [] for k in ("raw_read", *TARGETS)}
    for r in range(runs):
        order = ["raw_read", *TARGETS]
        order = order[r % len(order):] + order[:r % len(order)]  # rotated: drift hits each alike
        for name in order:
            kind = "raw_read" if name == "raw_read" else "restore"
            try:
                got[name].append(_run_child({**base, "kind": kind, "target": name}))
            except RuntimeError as e:  # one target failing: report it, measure the others
                if kind == "raw_read":
                    raise
                got[name].append({"error": str(e)})
    raw = _med(x["raw_read_s"] for x in got["raw_read"])
    out: dict = {"raw_read_s": raw, "ratio_goal": 0.8}
    for t in TARGETS:
        failed = [x["error"] for x in got[t] if "error" in x]
        if failed:
            out[t] = {"error": failed[0]}
            continue
        sec = _med(x["restore_s"] for x in got[t])
        over = max(x["restore_mem"]["over_restored_mib"] for x in got[t])
        out[t] = {"restore_s": sec, "ratio": raw / sec, "memory": _bound(over, base["budget"]),
                  "transient_mib": max(x["restore_mem"]["transient_mib"] for x in got[t]),
                  "shards_checked": got[t][-1]["shards_checked"], "budget_via": got[t][-1]["budget_via"],
                  "runs": got[t]}
    return out


def _section_first(base: dict, runs: int) -> dict:
    first: dict[str, list] = {k: [] for k in FIRST_SYSTEMS}
    for r in range(runs):
        for system in FIRST_SYSTEMS[r % 5:] + FIRST_SYSTEMS[:r % 5]:  # rotated
            try:
                first[system].append(_run_child({**base, "kind": "first", "system": system}))
            except RuntimeError as e:  # Orbax or jax's serializer missing or failing: report, go on
                first[system].append({"error": str(e)})
    return _first_summary(first)


def _section_big(root: str, big_mib: int, big_budget_mib: int, timeout: float) -> dict:
    budget = big_budget_mib * MIB
    spec = {"root": root, "budget": budget, "big_mib": big_mib, "timeout": timeout}
    try:
        save = _run_child({**spec, "kind": "big_save"})
        restore = _run_child({**spec, "kind": "restore", "target": "same", "name": "big"})
    finally:
        shutil.rmtree(os.path.join(root, "big"), ignore_errors=True)
    return {"array_mib": save["array_bytes"] / MIB, "budget_mib": big_budget_mib,
            "shard_shape": save["shard_shape"], "chunks": save["chunks"], "save_s": save["save_s"],
            "restore_s": restore["restore_s"], "shards_checked": restore["shards_checked"],
            "save_memory": _bound(save["save_mem"]["over_resident_mib"], budget),
            "restore_memory": _bound(restore["restore_mem"]["over_restored_mib"], budget),
            "restore_transient_mib": restore["restore_mem"]["transient_mib"], "budget_via": save["budget_via"]}


def _first_summary(first: dict[str, list]) -> dict:
    ok = {k: [x for x in v if "error" not in x] for k, v in first.items()}
    out: dict = {"systems": {}}
    for k, v in ok.items():
        if not v:
            out["systems"][k] = {"error": first[k][-1]["error"]}
            continue
        out["unique_bytes"] = v[0]["unique_bytes"]
        out["systems"][k] = {"seconds": _med(x["seconds"] for x in v), "n": len(v),
                             "peak_over_resident_mib": max(x["mem"]["over_resident_mib"] for x in v),
                             "disk_mib": v[-1]["disk_bytes"] / MIB, "files": v[-1]["files"]}
        if "blocking_s" in v[0]:
            out["systems"][k]["blocking_s"] = _med(x["blocking_s"] for x in v)
        if "default_budget_bytes" in v[0]:
            b = v[0]["default_budget_bytes"]
            out["default_budget"] = f"{b / MIB:.0f} MiB" if isinstance(b, int) else str(b)
    sy = out["systems"]
    if "seconds" in sy.get("raw", {}):
        raw = sy["raw"]["seconds"]
        out["ratios"] = {f"{k} / raw": sy[k]["seconds"] / raw for k in ("ckpt", "orbax", "jax") if "seconds" in sy[k]}
        if "seconds" in sy.get("bare", {}):
            for k in ("ckpt", "orbax", "jax"):
                if "blocking_s" in sy[k]:
                    out["ratios"][f"{k} blocking / bare copy"] = sy[k]["blocking_s"] / sy["bare"]["seconds"]
        out["goals"] = {"ckpt / raw": 1.1, "ckpt blocking / bare copy": 1.25}
    out["runs"] = first
    return out


def _fmt_bound(b: dict) -> str:
    return f"{b['over_mib']:.0f} MiB (<= {b['limit_mib']:.0f}: {'pass' if b['ok'] else 'FAIL'})"


def print_table(res: dict) -> None:
    """The result as plain-text tables (what docs/benchmarks.md, "Host memory", shows)."""
    size = f"{res['unique_gib']:.2f} GiB unique" if "unique_gib" in res else f"--gib {res['gib']}"
    print(f"\njax-ckpt host-memory benchmark, {res['date']}: tree {size}, "
          f"4x2 mesh, budget {res['budget_mib']} MiB, {res['runs']} run(s), every measurement in a fresh process")
    for name in SECTIONS:
        if "error" in res.get(name, {}):
            print(f"\n{name}: FAILED: {res[name]['error']}")
    s, r = res.get("save", {}), res.get("restore", {})
    if "save_s" in s or "raw_read_s" in r:
        print(f"\n{'measure':<26}{'seconds':>9}{'x raw':>8}   peak RSS over resident (+ restored tree)")
    if "save_s" in s:
        print(f"{'raw write':<26}{s['raw_write_s']:>9.3f}")
        print(f"{'save':<26}{s['save_s']:>9.3f}{s['ratio']:>8.2f}   {_fmt_bound(s['memory'])}   goal >= 0.85x")
        print(f"  blocking {s['blocking_s']:.3f} s; retained after the save {s['retained_mib']:.0f} MiB"
              + (f"; release_host_memory() freed {s['released_mib']:.0f} MiB" if s.get("released_mib") is not None
                 else "") + f"; budget passed as {s['budget_via']}")
    if "raw_read_s" in r:
        print(f"{'raw read':<26}{r['raw_read_s']:>9.3f}")
        for t in TARGETS:
            x = r[t]
            if "error" in x:
                print(f"{'restore ' + t:<26} FAILED: {x['error']}")
                continue
            print(f"{'restore ' + t:<26}{x['restore_s']:>9.3f}{x['ratio']:>8.2f}   {_fmt_bound(x['memory'])}"
                  "   goal >= 0.8x")
    f = res.get("first", {})
    if "systems" in f:
        default = f" ({f['default_budget']})" if "default_budget" in f else ""
        print(f"\nfirst save of a fresh process, default budget{default} (median; peak RSS over resident: max)")
        print(f"  {'system':<8}{'total s':>9}{'blocking s':>12}{'peak MiB':>10}{'disk MiB':>10}")
        for k, v in f["systems"].items():
            if "error" in v:
                print(f"  {k:<8} failed: {v['error']}")
                continue
            b = f"{v['blocking_s']:.3f}" if "blocking_s" in v else ""
            print(f"  {k:<8}{v['seconds']:>9.3f}{b:>12}{v['peak_over_resident_mib']:>10.0f}{v['disk_mib']:>10.0f}")
        for k, v in f.get("ratios", {}).items():
            print(f"  {k:<28}{v:>6.2f}x")
        print("  goals (ckpt): total <= 1.1x raw, blocking <= 1.25x bare copy")
    b = res.get("big", {})
    if "save_s" in b:
        print(f"\none {b['array_mib']:.0f} MiB array over 2 devices (shards {b['shard_shape']}, chunks {b['chunks']}), "
              f"budget {b['budget_mib']} MiB: save {b['save_s']:.2f} s, restore {b['restore_s']:.2f} s, "
              f"{b['shards_checked']} shards equal")
        print(f"  save peak over resident {_fmt_bound(b['save_memory'])}; "
              f"restore peak over restored {_fmt_bound(b['restore_memory'])}")


def main(argv: list[str] | None = None, *, parsed=None) -> int:
    """`python -m bench --memory ...` (parsed: its argparse namespace) or this module."""
    if parsed is None:
        p = argparse.ArgumentParser(prog="python -m bench --memory", description=__doc__.split("\n\n")[0])
        p.add_argument("--child", help=argparse.SUPPRESS)
        p.add_argument("--gib", type=float, default=2.0, help="approximate size of the tree (default 2)")
        p.add_argument("--runs", type=int, default=3, help="runs to take the median of (default 3)")
        p.add_argument("--dir", default="/tmp/ckpt-bench", help="scratch directory on the disk to measure")
        p.add_argument("--json", action="store_true", help="print the result as JSON")
        p.add_argument("--only", default=",".join(SECTIONS), help="sections to run (default: all)")
        add_memory_arguments(p)
        parsed = p.parse_args(argv)
        if parsed.child:
            from bench.bench_memory_child import child_main

            return child_main(json.loads(parsed.child))
    only = tuple(s for s in (parsed.only or ",".join(SECTIONS)).split(",") if s)
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        raise SystemExit(f"--only: unknown section(s) {bad}; choose from {','.join(SECTIONS)}")
    res = run(parsed.gib, parsed.runs, parsed.dir, only, parsed.budget_mib, parsed.big_mib, parsed.big_budget_mib)
    if parsed.json:
        print(json.dumps(res, indent=2))
    else:
        print_table(res)
    failed = [name for name in SECTIONS if "error" in res.get(name, {})]
    failed += [t for t in TARGETS if "error" in res.get("restore", {}).get(t, {})]
    return 1 if failed else 0


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget-mib", type=int, default=256, help="with --memory: host budget of save/restore (256)")
    p.add_argument("--big-mib", type=int, default=1024, help="with --memory: size of the one big array (1024)")
    p.add_argument("--big-budget-mib", type=int, default=128, help="with --memory: its host budget (128)")


if __name__ == "__main__":
    sys.exit(main())
