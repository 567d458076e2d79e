"""`ckpt bench` (ckpt/cli/_bench.py) run for real at a tiny size: its figures are all there, and
every shard of every restore was compared with what was saved. No timing assertions: those are
the benchmark's figures, not test outcomes."""

import contextlib
import io
import json
import math

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ckpt import CheckpointError
from ckpt.cli import main
from ckpt.cli._bench import check_values, print_table

TIMED = ("raw_write", "bare_d2h_copy", "save", "save_blocking_s", "raw_read", "restore_same",
         "restore_same_noverify", "restore_mesh24", "restore_one_device")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("bench")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["bench", "--gib", "0.01", "--runs", "1", "--dir", str(scratch), "--json"])
    assert status == 0
    assert list(scratch.iterdir()) == [], "the benchmark left files behind"
    return json.loads(out.getvalue())


def test_json_has_the_save_restore_and_raw_figures(result):
    assert result["runs"] == 1 and 0 < result["unique_gib"] < 0.05
    assert set(result["seconds"]) == set(TIMED)
    assert all(math.isfinite(v) and v > 0 for v in result["seconds"].values())
    assert set(result["gib_per_s"]) == set(TIMED) - {"save_blocking_s"}
    assert result["gib_per_s"]["save"] == pytest.approx(result["unique_gib"] / result["seconds"]["save"])
    assert result["ratios"]["save / raw_write"] == pytest.approx(
        result["seconds"]["raw_write"] / result["seconds"]["save"])
    assert result["ratios"]["restore_same / raw_read"] == pytest.approx(
        result["seconds"]["raw_read"] / result["seconds"]["restore_same"])
    assert len(result["ratios"]) == 7 and all(math.isfinite(v) for v in result["ratios"].values())


def test_every_shard_of_every_restore_was_compared(result):
    assert result["values_match"] is True
    assert result["devices"] == 8 and result["mesh"] == [4, 2]  # conftest's 8 CPU devices
    # Four restores a run: same sharding twice (verify on and off) and the (2,4) mesh, 8 shards
    # a leaf each (replicated leaves too: every device's copy is compared), and one device, 1.
    assert result["restores_checked"] == 4
    assert result["leaves"] > 3 and result["shards_checked"] == result["leaves"] * (3 * 8 + 1)


def test_the_table_says_the_values_were_checked(result, capsys):
    print_table(result)
    out = capsys.readouterr().out
    assert "restore_mesh24" in out and "save / raw_write" in out
    assert f"every restored shard equal to what was saved ({result['shards_checked']} shards in 4 restores)" in out


def test_a_restored_shard_that_differs_is_an_error_naming_it():
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    saved = np.arange(64, dtype=np.float32).reshape(8, 8)
    restored = {"w": jax.device_put(saved, NamedSharding(mesh, P("x", "y"))),
                "b": jax.device_put(saved[0], NamedSharding(mesh, P()))}
    refs = [saved[0], saved]  # in the tree's leaf order: "b" before "w"
    assert check_values(restored, refs) == 8 + 8
    wrong = saved.copy()
    wrong[7, 7] += 1  # in the last shard only
    with pytest.raises(CheckpointError, match=r"differ.*leaf \['w'\], shard \(slice\(6, 8"):
        check_values(restored, [saved[0], wrong])
    with pytest.raises(CheckpointError, match="1 were saved"):
        check_values(restored, [saved])
