"""The seams of issue 33, checked statically on the source of ``ckpt/``:

- the save's steps (``ckpt/_save/``) never probe an object for what it can do (no ``getattr`` /
  ``hasattr``): a store declares its capabilities (``caps``), a layout's writer has one interface;
- no module of ``ckpt/_save/`` branches on the chunk layout: the layout is a value chosen once
  (``ckpt._layout.layout_name``) and used through ``SaveLayout`` / ``ChunkWriter``;
- ``ckpt/storage/`` holds bytes and engines only: no commit, lease, owner record or chunk layout
  writer in it (those are ``ckpt/_commit/`` and ``ckpt/_layout/``);
- the storage interface declares its capabilities in one value.
"""

from __future__ import annotations

import ast
import inspect
import pathlib

import ckpt
from ckpt.storage import Storage, StoreCaps

PACKAGE = pathlib.Path(ckpt.__file__).resolve().parent
LAYOUT_NAMES = {"FILES", "PACKED", "FilesSave", "PackedSave", "PackWriter", "FilesWriter", "commit_packed"}


def _code(part: str):
    for path in sorted((PACKAGE / part).glob("*.py")):
        yield path.relative_to(PACKAGE.parent), ast.parse(path.read_text(), str(path))


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings (not code)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def test_the_save_never_probes_an_object_for_what_it_can_do():
    found = [f"{path}:{node.lineno}" for path, tree in _code("_save") for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")]
    found += [f"{path}:{node.lineno} (__getattr__)" for path, tree in _code("_save") for node in ast.walk(tree)
              if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"]
    assert not found, f"getattr/hasattr probes in ckpt/_save/: {found}"


def test_the_restore_never_probes_a_storage_or_reader_for_what_it_can_do():
    """A store declares what it can do (``caps``); a chunk source that reads runs of chunks is a
    ``ChunkRuns`` (``isinstance``, once). The getattr left in ckpt/_restore/ look at JAX objects
    whose attributes differ between JAX versions (a sharding's memory kind, a target's format, a
    mesh's axis types), never at a storage, a reader or a writer."""
    found = []
    for path, tree in _code("_restore"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
                what = ast.unparse(node.args[0]) if node.args else ""
                if any(w in what.lower() for w in ("storage", "store", "inner", "reader", "writer", "source", "options")):
                    found.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


def test_no_module_of_the_save_branches_on_the_layout():
    found = []
    for path, tree in _code("_save"):
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in LAYOUT_NAMES:
                found.append(f"{path}:{node.lineno} names {node.id}")
            elif isinstance(node, ast.alias) and node.name in LAYOUT_NAMES:
                found.append(f"{path} imports {node.name}")
            elif isinstance(node, ast.Constant) and id(node) not in docs and node.value in ("files", "packed"):
                found.append(f"{path}:{node.lineno} compares with {node.value!r}")
            elif isinstance(node, ast.Compare):
                names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
                    n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
                if any("layout" in n or "packing" in n for n in names):
                    found.append(f"{path}:{node.lineno} branches on {sorted(names)}")
    assert not found, "\n".join(found)


def test_storage_holds_bytes_and_engines_only():
    words = ("lease", "owner", "leftover", "stage(", "retire", "PackWriter", "PackedSave", "commit_")
    found = []
    for path in sorted((PACKAGE / "storage").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and any(w.rstrip("(") in node.name.lower() for w in words):
                found.append(f"{path.name}:{node.lineno} defines {node.name}")
    assert not found, found


def test_the_store_declares_its_capabilities_in_one_value():
    flags = {name for name, value in inspect.getmembers(Storage) if isinstance(value, bool)}
    assert not flags, f"capability flags on Storage besides caps: {sorted(flags)}"
    assert isinstance(Storage.caps, StoreCaps)


def test_every_source_restores_through_the_one_skeleton(tmp_path, monkeypatch):
    """Native checkpoints, Orbax checkpoints and safetensors all run ``restore_tree`` (the target
    or mesh matched, wants made, the tree rebuilt once, in ckpt/_restore/plan.py)."""
    import numpy as np
    import safetensors.numpy

    from ckpt._restore import plan as skeleton

    seen: list[str] = []
    plain = skeleton.restore_tree

    def spy(tree, records, asked, build, **kwargs):
        seen.append(type(records[0]).__name__ if records else "?")
        return plain(tree, records, asked, build, **kwargs)

    monkeypatch.setattr(skeleton, "restore_tree", spy)
    for module in ("ckpt._restore", "ckpt._restore.orbax_source"):
        monkeypatch.setattr(f"{module}.restore_tree", spy)
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    ckpt.save(str(tmp_path / "native"), {"w": value})
    safetensors.numpy.save_file({"w": value}, str(tmp_path / "model.safetensors"))
    ocp = __import__("pytest").importorskip("orbax.checkpoint")
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(str(tmp_path / "orbax"), {"w": value})
    for where in ("native", "model.safetensors", "orbax"):
        before = len(seen)
        out = ckpt.restore(str(tmp_path / where))
        assert np.array_equal(np.asarray(out["w"]), value), where
        assert len(seen) == before + 1, f"{where} did not restore through restore_tree"


def test_the_shared_restore_uses_only_public_members_of_the_reader():
    tree = ast.parse((PACKAGE / "_restore" / "shared_source.py").read_text())
    private = [f"line {n.lineno}: .{n.attr}" for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
               and isinstance(n.value, (ast.Name, ast.Attribute))
               and (getattr(n.value, "id", None) or getattr(n.value, "attr", "")) in ("planner", "reader")]
    assert not private, private
