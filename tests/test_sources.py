"""The source step of a restore (ckpt/_restore/source.py): a jax-ckpt checkpoint's manifest is
read first, with one GET and nothing before it; other formats are sniffed only where there is no
manifest, and the error for a location that holds nothing readable is the native one.
(Request counts on a real S3 server: tests/test_s3.py::test_requests_per_save_and_restore.)"""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest

import ckpt
from support import Faults

LOOKS = ("list_dir", "exists_any", "exists", "du", "leftovers")  # what a sniff would ask


@pytest.fixture(params=["memory", "local"])
def where(request, tmp_path):
    return f"memory://sources-{uuid.uuid4().hex[:8]}/c" if request.param == "memory" else str(tmp_path / "c")


def _tree():
    return {"w": np.arange(24, dtype=np.float32).reshape(4, 6), "b": np.ones(3, np.int16), "step": 7}


def test_a_native_restore_reads_the_manifest_first_and_lists_nothing(where):
    tree = _tree()
    ckpt.save(where, tree)
    for call in (lambda o: ckpt.restore(where, options=o), lambda o: ckpt.metadata(where, options=o)):
        faults = Faults()
        out = call(faults.options())
        ops = [op for op, _ in faults.log]
        reads = [(op, w) for op, w in faults.log if op in ("get", "read_exact", "read_chunk", "read_chunk_async")]
        assert reads and reads[0][0] == "get" and reads[0][1].endswith("manifest.msgpack"), faults.log
        assert not [op for op in ops if op in LOOKS], faults.log
        if isinstance(out["w"], np.ndarray):
            assert np.array_equal(out["w"], tree["w"]) and np.array_equal(out["b"], tree["b"]) and out["step"] == 7
        else:
            assert out["w"].shape == (4, 6) and out["step"] == 7


def test_foreign_formats_are_sniffed_only_where_there_is_no_manifest(tmp_path):
    """A directory holding both a jax-ckpt manifest and a stray safetensors file is read as the
    jax-ckpt checkpoint; the same directory without the manifest is read as safetensors."""
    safetensors = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "both"
    ckpt.save(str(path), {"w": np.full((2, 2), 5.0, np.float32)})
    safetensors.save_file({"v": np.full((3,), 9.0, np.float32)}, str(path / "extra.safetensors"))
    assert set(ckpt.restore(str(path))) == {"w"}
    other = tmp_path / "st"
    other.mkdir()
    safetensors.save_file({"v": np.full((3,), 9.0, np.float32)}, str(other / "model.safetensors"))
    out = ckpt.restore(str(other))
    assert np.array_equal(out["v"], np.full((3,), 9.0, np.float32))


def test_nothing_readable_gets_the_native_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        ckpt.restore(str(tmp_path / "nothing"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ckpt.CheckpointError, match="is not a checkpoint directory"):
        ckpt.restore(str(tmp_path / "file"))
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(ckpt.CheckpointError, match="is neither a checkpoint .* nor a manager directory"):
        ckpt.metadata(str(tmp_path / "dir"))
    assert os.listdir(tmp_path / "dir") == ["notes.json"]  # nothing written or removed
