"""The quick regression check's comparison (bench/quick.py) on made-up figures, and the committed
bench/baseline.json. The benchmark itself is not run here: its figures are measurements, never
test outcomes."""

import json
import os

import pytest

from bench import quick

SHORT = {"save": "disk save / raw write", "leaves": "leaves restore sds speedup vs orbax",
         "rss": "memory save peak over resident / budget"}


def _figs(**values):
    """{"figures": ...} of `values` (keyed by SHORT's names), each direction from quick.FIGURES."""
    return {"figures": {SHORT[k]: {"value": v, "better": quick.FIGURES[SHORT[k]]} for k, v in values.items()}}


def _status(rows):
    return {r["figure"]: r["status"] for r in rows}


BASE = {**_figs(save=1.0, leaves=10.0, rss=0.8), "noise": {"default": 0.05, SHORT["leaves"]: 0.20}}


def test_higher_is_better_worse_than_the_band_regresses():
    rows = quick.compare(_figs(save=0.94, leaves=10.0, rss=0.8), BASE)
    assert _status(rows)[SHORT["save"]] == "REGRESSED"  # 6% slower, band 5% (the default)
    assert quick.failed(rows)
    row = next(r for r in rows if r["figure"] == SHORT["save"])
    assert row["change"] == pytest.approx(-0.06) and row["band"] == 0.05 and row["baseline"] == 1.0


def test_within_the_band_is_ok_and_beyond_it_improved():
    rows = quick.compare(_figs(save=0.96, leaves=8.5, rss=0.78), BASE)
    assert set(_status(rows).values()) == {"ok"}  # leaves: -15% inside its own 20% band
    assert not quick.failed(rows)
    rows = quick.compare(_figs(save=1.2, leaves=10.0, rss=0.8), BASE)
    assert _status(rows)[SHORT["save"]] == "improved" and not quick.failed(rows)


def test_per_figure_band_overrides_the_default():
    assert _status(quick.compare(_figs(save=1.0, leaves=7.9, rss=0.8), BASE))[SHORT["leaves"]] == "REGRESSED"
    assert _status(quick.compare(_figs(save=1.0, leaves=8.1, rss=0.8), BASE))[SHORT["leaves"]] == "ok"


def test_lower_is_better_compares_the_other_way():
    # Peak RSS over the budget: a rise is the regression, a fall the improvement.
    rows = quick.compare(_figs(save=1.0, leaves=10.0, rss=0.9), BASE)
    assert _status(rows)[SHORT["rss"]] == "REGRESSED" and quick.failed(rows)
    rows = quick.compare(_figs(save=1.0, leaves=10.0, rss=0.6), BASE)
    assert _status(rows)[SHORT["rss"]] == "improved" and not quick.failed(rows)


def test_a_missing_figure_is_reported_and_fails_a_new_one_does_not():
    latest = _figs(save=1.0, rss=0.8)  # the leaves part failed
    latest["figures"]["something new"] = {"value": 3.0, "better": "higher"}
    rows = quick.compare(latest, BASE)
    assert _status(rows) == {SHORT["save"]: "ok", SHORT["leaves"]: "MISSING", SHORT["rss"]: "ok",
                             "something new": "new"}
    assert quick.failed(rows)
    assert not quick.failed(quick.compare(_figs(save=1.0, leaves=10.0, rss=0.8), {}))  # no baseline: all new
    table = quick.format_table(rows)
    assert "MISSING" in table and "REGRESSED" not in table


def test_the_table_names_every_figure_and_flags_the_regression():
    table = quick.format_table(quick.compare(_figs(save=0.5, leaves=10.0, rss=0.8), BASE))
    lines = table.splitlines()
    assert len(lines) == 4
    save_line = next(line for line in lines if line.startswith(SHORT["save"]))
    assert save_line.split()[-1] == "REGRESSED" and "-50.0%" in save_line


def test_calibrate_takes_medians_and_bands_from_the_spread():
    def run(save, rss):
        return {"date": "d", "machine": "m", **_figs(save=save, rss=rss)}

    b = quick.calibrate([run(1.0, 0.8), run(1.2, 0.8), run(1.1, 0.81)])
    assert b["figures"][SHORT["save"]]["value"] == pytest.approx(1.1)
    assert b["noise"][SHORT["save"]] == pytest.approx(0.19)  # (1.2 - 1.0) / 1.1 = 18.2%, rounded up
    assert b["noise"][SHORT["rss"]] == quick.NOISE_FLOOR  # spread 1.2%: the floor
    # and a run at the edge of the calibration is not flagged against it
    assert not quick.failed(quick.compare(run(1.0, 0.81), b, [SHORT["save"], SHORT["rss"]]))


def test_update_baseline_takes_the_figures_and_keeps_the_bands():
    latest = {"date": "later", "machine": "m", **_figs(save=1.3, leaves=10.0, rss=0.8)}
    new = quick.update_baseline(latest, BASE)
    assert new["figures"][SHORT["save"]]["value"] == 1.3 and new["noise"] == BASE["noise"]
    assert new["date"] == "later"


def test_the_committed_baseline_has_every_figure_with_a_band():
    with open(quick.BASELINE) as f:
        baseline = json.load(f)
    assert set(baseline["figures"]) == set(quick.FIGURES)
    for name, fig in baseline["figures"].items():
        assert fig["better"] == quick.FIGURES[name]
        assert isinstance(fig["value"], (int, float)) and fig["value"] > 0
        assert name in baseline["noise"] and 0 < baseline["noise"][name] < 1
    assert baseline["date"] and baseline["machine"]
    assert os.path.dirname(quick.LATEST).endswith(os.path.join("bench", "results"))
