"""The host-memory benchmark harness (bench/bench_memory.py) at a tiny size: its peak-RSS reading,
its output, and that what it saves restores equal (every shard is compared in the child). No
timing or memory-bound assertions: those are the benchmark's figures, not test outcomes."""

import json
import math

import numpy as np
import pytest

from bench import bench, bench_memory
from bench.bench_memory_child import measure

MIB = 2**20


def test_measure_sees_a_region_allocation_and_resets_the_high_water_mark():
    big = np.ones(256 * MIB // 8)  # raises VmHWM well above what the regions below touch
    del big
    _, _, idle = measure(lambda: None)
    held, seconds, mem = measure(lambda: np.ones(64 * MIB // 8))
    assert held.sum() == 64 * MIB // 8
    assert idle["over_resident_mib"] < 32  # the earlier 256 MiB no longer counts: the mark was reset
    assert 60 <= mem["over_resident_mib"] and 60 <= mem["retained_mib"]
    assert mem["peak_mib"] >= mem["after_mib"] >= mem["before_mib"] and seconds > 0


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def test_tiny_run_round_trips(tmp_path, capsys):
    res = bench_memory.run(runs=1, root=str(tmp_path), only=("save", "restore", "big"), budget_mib=2,
                           big_mib=16, big_budget_mib=4, tiny=True, child_timeout=120)
    assert json.loads(json.dumps(res)) == res
    for section in ("save", "restore", "big"):
        assert "error" not in res[section], f"{section}: {res[section]['error']}"
    assert res["budget_mib"] == 2 and res["runs"] == 1 and res["unique_gib"] > 0
    assert "first" not in res

    save = res["save"]
    assert save["budget_via"] in ("keyword", "options")
    assert all(_finite(save[k]) and save[k] > 0 for k in ("raw_write_s", "save_s", "blocking_s", "ratio"))
    assert save["memory"]["limit_mib"] == pytest.approx(2 * 1.1)
    assert isinstance(save["memory"]["ok"], bool) and math.isfinite(save["memory"]["over_mib"])

    restore = res["restore"]
    assert restore["raw_read_s"] > 0
    for target in ("same", "mesh24", "one"):
        r = restore[target]
        assert "error" not in r, f"restore onto {target}: {r['error']}"
        # The child compared every restored shard with the regenerated tree (it fails otherwise).
        assert r["shards_checked"] >= len(r["runs"]) and r["runs"][0]["restored_bytes"] > 0
        assert _finite(r["restore_s"]) and _finite(r["ratio"]) and isinstance(r["memory"]["ok"], bool)
    # onto one device, each leaf is one shard; on the 4x2 mesh, each leaf has 8
    assert restore["same"]["shards_checked"] == 8 * restore["one"]["shards_checked"]

    big = res["big"]
    assert big["shards_checked"] == 2 and big["array_mib"] == pytest.approx(16)
    assert big["save_memory"]["limit_mib"] == pytest.approx(4 * 1.1)
    assert isinstance(big["save_memory"]["ok"], bool) and isinstance(big["restore_memory"]["ok"], bool)
    assert list(tmp_path.joinpath("memory").iterdir()) == [], "scratch files left behind"

    bench_memory.print_table(res)
    table = capsys.readouterr().out
    assert "save" in table and "mesh24" in table and "one 16 MiB array" in table


def test_first_save_summary_ratios():
    def child(seconds, blocking=None, over=10.0):
        out = {"seconds": seconds, "mem": {"over_resident_mib": over}, "disk_bytes": MIB, "files": 1,
               "unique_bytes": MIB}
        return out if blocking is None else {**out, "blocking_s": blocking}

    first = {"raw": [child(2.0), child(1.0), child(3.0)], "bare": [child(0.5)],
             "ckpt": [child(2.2, 0.6, over=300.0), child(2.4, 0.7)],
             "orbax": [{"error": "not installed"}], "jax": [child(4.0, 1.0)]}
    s = bench_memory._first_summary(first)
    assert s["systems"]["raw"]["seconds"] == 2.0 and s["systems"]["ckpt"]["peak_over_resident_mib"] == 300.0
    assert s["ratios"]["ckpt / raw"] == pytest.approx(1.15) and s["ratios"]["jax / raw"] == pytest.approx(2.0)
    assert s["ratios"]["ckpt blocking / bare copy"] == pytest.approx(1.3)
    assert s["systems"]["orbax"] == {"error": "not installed"} and "orbax / raw" not in s["ratios"]


def test_bench_cli_dispatches_memory_and_refuses_an_unknown_section(tmp_path):
    with pytest.raises(SystemExit, match="unknown section"):
        bench.main(["--memory", "--only", "save,bogus", "--dir", str(tmp_path)])


def test_a_failing_child_is_an_error_naming_it():
    with pytest.raises(RuntimeError, match="benchmark child bogus failed"):
        bench_memory._run_child({"kind": "bogus"})
