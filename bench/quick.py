"""The quick regression check (``make bench-quick``, docs/benchmarks.md, "Quick regression check"):
every headline figure at a small size, as ratios against a baseline measured in the same run,
compared with the committed bench/baseline.json.

    python -m bench.quick [--json] [--dir /tmp/ckpt-bench-quick] [--only disk,leaves,memory,objectstore]
    python -m bench.quick --update-baseline             # bench/results/latest.json -> bench/baseline.json
    python -m bench.quick --calibrate RUN.json ...      # baseline = median of runs, band from their spread

Parts, all through the harness of bench/bench.py and bench/bench_memory.py:

- disk: the ~0.5 GiB tree (``--gib 0.5``): save and restores (same sharding, 2x4 mesh, one device)
  against the raw write/read of the same run, medians of DISK_RUNS runs;
- leaves: 4,000 small leaves (``--leaves 4000``): save, and restores onto ShapeDtypeStructs and onto
  bare shardings, against Orbax's StandardCheckpointer in the same process (speedups);
- memory: peak RSS over resident of a save with a 256 MiB host budget (the memory benchmark's save
  section at 0.5 GiB, in a fresh child process), as a fraction of the budget;
- objectstore: save/restore against raw PUT/GET on a SeaweedFS started for the run.

It writes bench/results/latest.json (every figure and the absolute seconds) and prints each
figure beside its baseline; a figure worse than the baseline by more than its noise band says
REGRESSED, and the exit status is then 1 (also when a figure is missing: a part failed).
A baseline is updated only by the commit that improves a figure, with the run quoted in its message.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BASELINE = os.path.join(HERE, "baseline.json")
LATEST = os.path.join(HERE, "results", "latest.json")

# Every figure the suite produces and which way is better. Ratios only: each is against a
# baseline measured in the same run (raw I/O, Orbax, the budget), so it moves with the code,
# not with the machine's speed of the hour.
FIGURES = {
    "disk save / raw write": "higher",
    "disk restore same / raw read": "higher",
    "disk restore 2x4 / raw read": "higher",
    "disk restore one device / raw read": "higher",
    "leaves save speedup vs orbax": "higher",
    "leaves restore sds speedup vs orbax": "higher",
    "leaves restore shardings speedup vs orbax": "higher",
    "memory save peak over resident / budget": "lower",
    "objectstore save / raw put": "higher",
    "objectstore restore / raw get": "higher",
}
PARTS = ("disk", "leaves", "memory", "objectstore")

# Sizes and runs, chosen so the whole suite takes <= 4 minutes on the 2-core VM (docs/benchmarks.md,
# "Quick regression check", has the measured run time).
DISK_GIB, DISK_RUNS = 0.5, 3          # 528 MiB unique; one run ~12 s here
LEAVES, LEAVES_RUNS = 4000, 2         # one Orbax round of 4,000 leaves is ~35 s here: 2 rounds
MEMORY_GIB, MEMORY_BUDGET_MIB, MEMORY_RUNS = 0.5, 256, 1  # one fresh child
OBJECT_GIB, OBJECT_RUNS = 0.25, 3     # the smallest benchmark tree: 272 MiB unique in 42 shards
NOISE_FLOOR = 0.05  # no band below 5%, however quiet the calibration runs were


# ---- the parts --------------------------------------------------------------------------------


def _disk(root: str) -> tuple[dict, dict]:
    from bench import bench

    res = bench.run(DISK_GIB, DISK_RUNS, os.path.join(root, "disk"), train=False, noverify=False)
    r = res["ratios"]
    figures = {"disk save / raw write": r["save / raw_write"],
               "disk restore same / raw read": r["restore_same / raw_read"],
               "disk restore 2x4 / raw read": r["restore_mesh24 / raw_read"],
               "disk restore one device / raw read": r["restore_one_device / raw_read"]}
    return figures, {f"disk {k}": v for k, v in res["seconds"].items()}


def _leaves(root: str) -> tuple[dict, dict]:
    from bench import bench

    res = bench.run_leaves(LEAVES, LEAVES_RUNS, os.path.join(root, "leaves"), orbax=True, orbax_first_round=False)
    if "speedup_vs_orbax" not in res:
        raise RuntimeError("orbax-checkpoint is not installed: the leaves part needs it (pip install -e '.[test]')")
    s = res["speedup_vs_orbax"]
    figures = {"leaves save speedup vs orbax": s["save"],
               "leaves restore sds speedup vs orbax": s["restore_sds"],
               "leaves restore shardings speedup vs orbax": s["restore"]}
    return figures, {f"leaves {k}": v for k, v in res["median"].items()}


def _memory(root: str) -> tuple[dict, dict]:
    from bench import bench_memory

    res = bench_memory.run(MEMORY_GIB, MEMORY_RUNS, os.path.join(root, "memory-part"), only=("save",),
                           budget_mib=MEMORY_BUDGET_MIB)
    save = res["save"]
    if "error" in save:
        raise RuntimeError(save["error"])
    over = save["memory"]["over_mib"]  # the largest of the runs
    return ({"memory save peak over resident / budget": over / MEMORY_BUDGET_MIB},
            {"memory save_s": save["save_s"], "memory raw_write_s": save["raw_write_s"],
             "memory save peak over resident MiB": over})


def _objectstore(root: str) -> tuple[dict, dict]:
    from bench import bench

    res = bench.objectstore_run("s3://ckpt-quick/run", OBJECT_GIB, OBJECT_RUNS, None, seaweedfs=True, extras=False)
    # The median of the run-by-run ratios: each run against the raw baseline measured beside it.
    r = res["paired_ratios"]
    return ({"objectstore save / raw put": r["save / raw_put"],
             "objectstore restore / raw get": r["restore_same / raw_get"]},
            {f"objectstore {k}": v for k, v in res["seconds"].items()})


RUNNERS = {"disk": _disk, "leaves": _leaves, "memory": _memory, "objectstore": _objectstore}


def machine() -> str:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return ", ".join(x for x in (platform.node(), f"{os.cpu_count()} cores", model, mem) if x)


def run_suite(root: str, parts=PARTS) -> dict:
    """Run the parts (a failing part is recorded as an error; the others still run)."""
    out: dict = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                 "machine": machine(), "load_before": list(os.getloadavg()), "parts": list(parts),
                 "figures": {}, "seconds": {}, "part_seconds": {}, "errors": {}}
    start = time.perf_counter()
    os.makedirs(root, exist_ok=True)
    for part in parts:
        t = time.perf_counter()
        print(f"bench-quick: {part} ...", file=sys.stderr)
        try:
            figures, seconds = RUNNERS[part](root)
        except Exception as e:  # noqa: BLE001 -- reported as the part's missing figures
            out["errors"][part] = f"{type(e).__name__}: {e}"
            print(f"bench-quick: {part} FAILED: {out['errors'][part]}", file=sys.stderr)
        else:
            out["figures"].update({k: {"value": v, "better": FIGURES[k]} for k, v in figures.items()})
            out["seconds"].update(seconds)
        out["part_seconds"][part] = time.perf_counter() - t
    out["total_seconds"] = time.perf_counter() - start
    out["load_after"] = list(os.getloadavg())
    shutil.rmtree(root, ignore_errors=True)
    return out


# ---- the comparison -----------------------------------------------------------------------------


def band(baseline: dict, name: str) -> float:
    noise = baseline.get("noise", {})
    return float(noise.get(name, noise.get("default", NOISE_FLOOR)))


def compare(latest: dict, baseline: dict, figures=None) -> list[dict]:
    """One row per figure of `figures` (default: the baseline's and the latest's): its baseline,
    latest value, relative change, band and status: "ok", "REGRESSED" (worse than the baseline by
    more than the band, in the figure's direction), "improved" (better by more than the band),
    "MISSING" (in the baseline, not produced by this run) or "new" (no baseline yet)."""
    base, got = baseline.get("figures", {}), latest.get("figures", {})
    names = list(figures) if figures is not None else list(dict.fromkeys([*base, *got]))
    rows = []
    for name in names:
        b, g = base.get(name), got.get(name)
        better = (b or g or {}).get("better") or FIGURES.get(name, "higher")
        row = {"figure": name, "better": better, "baseline": b["value"] if b else None,
               "latest": g["value"] if g else None, "band": band(baseline, name), "change": None}
        if g is None:
            row["status"] = "MISSING"
        elif b is None:
            row["status"] = "new"
        else:
            row["change"] = g["value"] / b["value"] - 1
            worse = -row["change"] if better == "higher" else row["change"]  # > 0: worse
            row["status"] = "REGRESSED" if worse > row["band"] else "improved" if -worse > row["band"] else "ok"
        rows.append(row)
    return rows


def failed(rows: list[dict]) -> bool:
    return any(r["status"] in ("REGRESSED", "MISSING") for r in rows)


def format_table(rows: list[dict]) -> str:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    w = max([len(r["figure"]) for r in rows] + [6])
    lines = [f"{'figure':<{w}}  {'better':<6}{'baseline':>10}{'latest':>10}{'change':>9}{'band':>7}  status"]
    for r in rows:
        lines.append(f"{r['figure']:<{w}}  {r['better']:<6}{num(r['baseline'], '.3f'):>10}{num(r['latest'], '.3f'):>10}"
                     f"{num(r['change'], '+.1%'):>9}{r['band']:>7.0%}  {r['status']}")
    return "\n".join(lines)


# ---- the baseline ---------------------------------------------------------------------------------


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _write(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(path + ".tmp", path)


def update_baseline(latest: dict, baseline: dict) -> dict:
    """`baseline` with every figure of `latest` in place of its own (bands kept)."""
    out = dict(baseline)
    out["figures"] = {**baseline.get("figures", {}), **latest["figures"]}
    out["date"], out["machine"] = latest["date"], latest["machine"]
    out["source"] = "one run (python -m bench.quick --update-baseline)"
    out.pop("calibration", None)
    return out


def calibrate(runs: list[dict], floor: float = NOISE_FLOOR) -> dict:
    """A baseline from several runs on an unchanged tree: each figure's median, and its band
    max(spread, floor) with spread = (max - min) / median, rounded up to the next percent."""
    import math

    names = [n for n in FIGURES if all(n in r["figures"] for r in runs)]
    figures, noise, spread = {}, {}, {}
    for n in names:
        values = [r["figures"][n]["value"] for r in runs]
        med = statistics.median(values)
        spread[n] = (max(values) - min(values)) / med
        figures[n] = {"value": med, "better": FIGURES[n]}
        noise[n] = max(floor, math.ceil(spread[n] * 100) / 100)
    return {"date": runs[-1]["date"], "machine": runs[-1]["machine"],
            "source": f"median of {len(runs)} runs on an unchanged tree (python -m bench.quick --calibrate)",
            "rule": "Update only in the commit that improves a figure, quoting the run in the commit message "
                    "(python -m bench.quick --update-baseline).",
            "noise": {"default": floor, **noise}, "figures": figures,
            "calibration": {"spread": spread, "values": {n: [r["figures"][n]["value"] for r in runs] for n in names},
                            "loads_before": [r.get("load_before") for r in runs],
                            "total_seconds": [r.get("total_seconds") for r in runs]}}


# ---- the command line -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quick", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/ckpt-bench-quick", help="scratch directory (removed after)")
    p.add_argument("--only", help="parts to run, of " + ",".join(PARTS) + " (the others are not compared)")
    p.add_argument("--json", action="store_true", help="print the run's result as JSON (the table goes to stderr)")
    p.add_argument("--baseline", default=BASELINE, help="the baseline to compare with (bench/baseline.json)")
    p.add_argument("--out", default=LATEST, help="where the run's result goes (bench/results/latest.json)")
    p.add_argument("--update-baseline", action="store_true",
                   help="run nothing: write --out's figures into --baseline (only in the commit that improves one)")
    p.add_argument("--calibrate", nargs="+", metavar="RUN.json",
                   help="run nothing: write --baseline as the median of these runs, each band from their spread")
    args = p.parse_args(argv)

    if args.update_baseline or args.calibrate:
        old = _load(args.baseline) if os.path.exists(args.baseline) else {}
        new = update_baseline(_load(args.out), old) if args.update_baseline else calibrate(
            [_load(f) for f in args.calibrate])
        _write(args.baseline, new)
        print(format_table(compare({"figures": new["figures"]}, old)))
        print(f"wrote {args.baseline}")
        return 0

    parts = tuple(s for s in (args.only or ",".join(PARTS)).split(",") if s)
    if bad := [s for s in parts if s not in PARTS]:
        raise SystemExit(f"--only: unknown part(s) {bad}; choose from {','.join(PARTS)}")
    latest = run_suite(args.dir, parts)
    _write(args.out, latest)

    baseline = _load(args.baseline) if os.path.exists(args.baseline) else {}
    names = [n for n in FIGURES if n.split()[0] in parts]
    rows = compare(latest, baseline, names)
    report = sys.stderr if args.json else sys.stdout
    if args.json:
        print(json.dumps(latest, indent=2))
    print(f"\nbench-quick, {latest['date']}, {latest['total_seconds']:.0f} s, load average before "
          f"{latest['load_before'][0]:.2f}; baseline {baseline.get('date', 'none')} ({args.baseline})", file=report)
    print(format_table(rows), file=report)
    print("absolute seconds (for information, not compared): "
          + ", ".join(f"{k} {v:.3f}" for k, v in latest["seconds"].items()), file=report)
    for part, err in latest["errors"].items():
        print(f"{part}: FAILED: {err}", file=report)
    print(f"wrote {args.out}", file=report)
    if failed(rows):
        print("bench-quick: REGRESSED or MISSING figures above (a band is the noise measured on an unchanged "
              "tree; docs/benchmarks.md, \"Quick regression check\")", file=report)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
