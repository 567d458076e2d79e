"""The import contracts of ``ckpt/`` (docs/design.md, "The layout"), checked on every import the
package makes, at module level or inside a function (an import inside a function is still a
dependency; hiding a circle in one is what these contracts forbid).

- Layers: each module imports only from its own layer or the layers below it::

      ckpt (the public names)  >  cli  >  _manager | _convert | safetensors | surgery
      >  _save | _restore  >  _layout  >  _commit | _orbax  >  storage  >  _format  >  the base modules

  Modules of one layer separated by ``|`` are independent of each other (``_save`` and
  ``_restore`` above all).
- No import cycles anywhere in ``ckpt/``.
- Doors: a module imports from another subpackage only through that subpackage's ``__init__``
  (``from ckpt._format import Manifest``, not ``from ckpt._format.records import Manifest``), and
  never a private (``_x``) name; the base modules (``ckpt/_errors.py``...) are importable anywhere.
"""

from __future__ import annotations

import ast
import collections
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "ckpt"
BASE = {"_errors", "_host", "_geometry", "_version", "_distributed", "_exit"}
# Bottom to top; a set is one layer of mutually independent parts.
LAYERS = [
    {"base"},
    {"_format"},
    {"storage"},
    {"_commit", "_orbax"},
    {"_layout"},
    {"_save", "_restore"},
    {"_manager", "_convert", "safetensors", "surgery"},
    {"cli"},
    {"ckpt", "__main__"},
]
SUBPACKAGES = {"_format", "storage", "_commit", "_layout", "_orbax", "_save", "_restore", "_manager", "cli"}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def part_of(module: str) -> str:
    """The part of the package a module belongs to: a subpackage, a top-level module, or base."""
    parts = module.split(".")
    if len(parts) == 1:
        return "ckpt"
    if parts[1] in BASE:
        return "base"
    return parts[1]


def layer_of(part: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


Import = collections.namedtuple("Import", "importer target names line")


def imports() -> list[Import]:
    """Every import of a ckpt module by a ckpt module: (importer, imported module, names, line).
    ``from package import submodule`` counts as an import of the submodule."""
    found = []
    for module, path in MODULES.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [Import(module, a.name, (), node.lineno) for a in node.names if a.name.split(".")[0] == "ckpt"]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != "ckpt":
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in MODULES:
                        found.append(Import(module, sub, (), node.lineno))
                    else:
                        found.append(Import(module, target, (alias.name,), node.lineno))
    return found


IMPORTS = imports()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def door_modules(part: str) -> set[str]:
    """Submodules a door hands out as namespaces (``from ckpt._format import dtypes`` in
    ``ckpt/_format/__init__.py``): part of the door, importable as ``from ckpt.X import sub``."""
    return {i.target for i in IMPORTS if i.importer == f"ckpt.{part}" and not i.names and part_of(i.target) == part}


def where(i: Import) -> str:
    return f"{MODULES[i.importer].relative_to(PACKAGE.parent)}:{i.line} imports {i.target}" + (
        f".{i.names[0]}" if i.names else "")


def test_every_module_belongs_to_a_layer():
    unknown = sorted(m for m in MODULES if not any(part_of(m) in layer for layer in LAYERS))
    assert not unknown, f"modules outside every layer (add them to docs/design.md and LAYERS): {unknown}"


def test_layers_import_only_downwards_and_siblings_are_independent():
    bad = []
    for i in IMPORTS:
        a, b = part_of(i.importer), part_of(i.target)
        if a == b:
            continue
        if layer_of(b) > layer_of(a):
            bad.append(f"{where(i)}: {a} is below {b}")
        elif layer_of(b) == layer_of(a):
            bad.append(f"{where(i)}: {a} and {b} are independent")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = collections.defaultdict(set)
    for i in IMPORTS:
        if i.target in MODULES and i.target != i.importer:
            graph[i.importer].add(i.target)
    cycles, state, stack = [], {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(MODULES):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


def test_other_subpackages_are_entered_through_their_door_and_never_by_a_private_name():
    bad = []
    for i in IMPORTS:
        a, b = part_of(i.importer), part_of(i.target)
        if a == b or b not in SUBPACKAGES:
            if b == "base" and any(_private(n) for n in i.names):
                bad.append(f"{where(i)}: a private name of a base module")
            continue
        if i.target != f"ckpt.{b}" and i.target not in door_modules(b):
            bad.append(f"{where(i)}: past the door of ckpt.{b}")
        elif any(_private(n) for n in i.names) or (i.target != f"ckpt.{b}" and _private(i.target.rsplit(".", 1)[1])):
            bad.append(f"{where(i)}: a private name")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("part", ["_save", "_restore"])
def test_pipelines_hold_at_most_five_steps(part):
    steps = [p.stem for p in (PACKAGE / part).glob("*.py") if not p.stem.endswith("_source")]
    assert len(steps) <= 5, f"ckpt/{part}/ has {len(steps)} pipeline modules: {sorted(steps)}"


def test_the_checker_sees_what_it_must():
    """The contracts above are only as good as the import scan: it must see function-level
    imports and ``from package import submodule``, and place every kind of module."""
    by_importer = collections.defaultdict(set)
    for i in IMPORTS:
        by_importer[i.importer].add(i.target)
    assert "ckpt._restore.orbax_source" in by_importer["ckpt._restore.source"]
    assert part_of("ckpt._errors") == "base" and part_of("ckpt.storage._base") == "storage"
    assert part_of("ckpt") == "ckpt" and part_of("ckpt.safetensors") == "safetensors"
    nested = [i for i in IMPORTS if i.importer == "ckpt.cli._main" and i.line > 60]
    assert nested, "imports inside cli._main's functions are not seen"
