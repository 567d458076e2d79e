"""The local engine's own chunk-file writer (ckpt/storage/_local.py): exact bytes for
aligned, unaligned and odd-sized buffers, edge chunks padded with zeros to the chunk shape, the
page-cache fallback where O_DIRECT is refused, and errors naming the file."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ckpt._format import ArraySpec
from ckpt._host import aligned_empty
from ckpt.storage._local import ChunkFileWriter, write_file
from ckpt.storage._local import LocalStorage


def _aligned(values: np.ndarray) -> np.ndarray:
    out = aligned_empty(values.nbytes, 4096).view(values.dtype).reshape(values.shape)
    out[...] = values
    return out


@pytest.mark.parametrize("nbytes", [4096, 3 * 4096, 3 * 4096 + 5, 100, 1, 0])
@pytest.mark.parametrize("aligned", [True, False])
def test_write_file_writes_exactly_the_bytes(tmp_path, nbytes, aligned):
    values = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    data = _aligned(values) if aligned else np.concatenate([np.zeros(1, np.uint8), values])[1:]  # (off alignment)
    if nbytes and not aligned:
        assert data.ctypes.data % 4096 != 0
    path = tmp_path / "f"
    write_file(str(path), data)
    assert path.read_bytes() == values.tobytes()


def test_write_file_pads_with_zeros_to_size(tmp_path):
    values = np.arange(3000, dtype=np.uint16)
    write_file(str(tmp_path / "f"), _aligned(values), size=3 * 4096)
    got = (tmp_path / "f").read_bytes()
    assert len(got) == 3 * 4096 and got[:6000] == values.tobytes() and set(got[6000:]) == {0}


def test_write_file_without_direct_io(tmp_path, monkeypatch):
    # Where O_DIRECT is refused (tmpfs, for one) the page cache path writes the same bytes.
    from ckpt.storage import _local as _chunk_files

    monkeypatch.setattr(_chunk_files, "_direct_writes", False)
    values = np.arange(5 * 1024 + 3, dtype=np.float32)
    write_file(str(tmp_path / "f"), _aligned(values))
    assert np.array_equal(np.frombuffer((tmp_path / "f").read_bytes(), np.float32), values)


def test_writer_creates_directories_and_names_the_file_on_error(tmp_path):
    writer = ChunkFileWriter(str(tmp_path), 2)
    values = np.arange(4096, dtype=np.int32)
    writer.write("a/b/c/0/1", _aligned(values)).result()
    assert np.array_equal(np.frombuffer((tmp_path / "a/b/c/0/1").read_bytes(), np.int32), values)
    (tmp_path / "a/b/c/0/2").mkdir()  # a directory where the chunk file goes: the error names it
    with pytest.raises(OSError) as e:
        writer.write("a/b/c/0/2", _aligned(values)).result()
    assert e.value.filename == os.path.join(str(tmp_path), "a/b/c/0/2")


def test_a_resolved_chunk_has_every_new_directory_entry_fsynced(tmp_path, monkeypatch):
    # The durability a commit relies on: once a chunk's future resolves, the file is fsynced and
    # so is the entry of every directory created on its way (its parent fsynced after the
    # mkdir), whichever thread made the directory. Recorded through os.mkdir / os.fsync.
    import threading

    events, lock = [], threading.Lock()
    real_mkdir, real_fsync = os.mkdir, os.fsync

    def mkdir(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        with lock:
            events.append(("mkdir", os.path.abspath(path)))

    def fsync(fd):
        real_fsync(fd)
        with lock:
            events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "fsync", fsync)
    root = os.path.realpath(tmp_path)
    writer = ChunkFileWriter(root, 4)
    values = np.arange(4096, dtype=np.int32)
    keys = [f"g/{a}/c/{i}/{j}" for a in ("x", "y") for i in range(3) for j in range(2)]
    seen: dict[str, int] = {}

    def note(key):
        def done(_):
            with lock:
                seen[key] = len(events)
        return done

    futures = []
    for key in keys:
        f = writer.write(key, _aligned(values))
        f.add_done_callback(note(key))
        futures.append(f)
    for f in futures:
        f.result()
    made = {path: i for i, (kind, path) in enumerate(events) if kind == "mkdir"}
    assert set(made) >= {os.path.join(root, "g"), os.path.join(root, "g/x/c/2")}
    for key in keys:
        log = events[:seen[key]]
        path = os.path.join(root, key)
        synced = [i for i, (kind, p) in enumerate(log) if kind == "fsync" and p == path]
        assert synced, key
        d = os.path.dirname(path)
        needs = [(d, synced[0])]  # the file's entry, after its data
        while d in made:
            needs.append((os.path.dirname(d), made[d]))  # a new directory's entry, after its mkdir
            d = os.path.dirname(d)
        for parent, after in needs:
            assert any(kind == "fsync" and p == parent and i > after for i, (kind, p) in enumerate(log)), (key, parent)
        assert np.array_equal(np.frombuffer(open(path, "rb").read(), np.int32), values)


@pytest.mark.parametrize("box,data_shape", [(((4, 5), (0, 4)), (1, 4)), (((0, 4), (4, 7)), (4, 3)),
                                            (((4, 5), (4, 7)), (1, 3))])
def test_edge_chunk_file_holds_the_whole_chunk_shape(tmp_path, box, data_shape):
    # Zarr's rule, as TensorStore writes it: an edge chunk's file is the full chunk shape, the
    # part outside the array holding the fill value (zero).
    storage = LocalStorage(str(tmp_path), 2)
    spec = ArraySpec((5, 7), (4, 4), np.dtype(np.float32), {})
    (handle,) = storage.open_arrays({0: ("w", spec)}).values()
    data = np.arange(1, 1 + np.prod(data_shape), dtype=np.float32).reshape(data_shape)
    storage.write_chunk(handle, box, data).result()
    index = (box[0][0] // 4, box[1][0] // 4)
    got = np.frombuffer((tmp_path / f"w/c/{index[0]}/{index[1]}").read_bytes(), np.float32).reshape(4, 4)
    want = np.zeros((4, 4), np.float32)
    want[: data_shape[0], : data_shape[1]] = data
    assert np.array_equal(got, want)
