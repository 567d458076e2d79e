"""The documentation cannot rot: every ```python block of docs/*.md and README.md runs, and every
public name has a docstring that says its parameters, return value and errors, and a page in
the API reference. (The site itself is built with `mkdocs build --strict` by `make test`.)

How blocks run: the blocks of one page run in order in one fresh namespace (a later block may
use what an earlier one defined), in a fresh temporary working directory, so examples write to
relative paths such as ``ckpts/run1``. JAX has 8 CPU devices (conftest.py).

A block that cannot run here (it needs S3 credentials, several hosts, a preempted job...) is
marked on the line before its opening fence with

    <!-- no-test: why -->

and a reason is required. Blocks in other languages (```` ``` ```` shell sessions, output) are
not run.
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```python\s*$")
NO_TEST = re.compile(r"^<!--\s*no-test:\s*(\S.*?)\s*-->$")


def python_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """(line number, code, no-test reason or None) of every ```python block."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            start = i + 1
            end = next((j for j in range(start, len(lines)) if lines[j].strip() == "```"), None)
            assert end is not None, f"{path.name}:{i + 1}: unclosed ```python block"
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            m = NO_TEST.match(before)
            if before.startswith("<!--") and "no-test" in before and m is None:
                raise AssertionError(f"{path.name}:{i + 1}: a no-test marker needs a reason: {before}")
            blocks.append((start + 1, "\n".join(lines[start:end]), m.group(1) if m else None))
            i = end
        i += 1
    return blocks


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_block_runs(page, tmp_path, monkeypatch):
    blocks = python_blocks(page)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for line, code, skip in blocks:
        if skip is not None:
            continue
        try:
            exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{page.relative_to(ROOT)}, block at line {line} failed: "
                                 f"{type(e).__name__}: {e}") from e


def test_few_blocks_are_marked_no_test():
    skipped = [(p.name, line, why) for p in PAGES for line, _, why in python_blocks(p) if why is not None]
    total = sum(len(python_blocks(p)) for p in PAGES)
    assert total >= 20 and len(skipped) <= total // 4, skipped


def _public_names():
    import ckpt
    import ckpt.safetensors

    names = [(f"ckpt.{n}", getattr(ckpt, n)) for n in ckpt.__all__]
    names += [(f"ckpt.safetensors.{n}", getattr(ckpt.safetensors, n)) for n in ckpt.safetensors.__all__]
    return names


def _sections(doc: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^\s*(Args|Returns|Raises|Attributes):\s*$", doc, re.M)}


def _check_function(name: str, fn, *, is_method: bool = False) -> list[str]:
    doc = inspect.getdoc(fn) or ""
    problems = []
    if not doc:
        return [f"{name}: no docstring"]
    sections = _sections(doc)
    params = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]
    if params:
        if "Args" not in sections:
            problems.append(f"{name}: no Args section for {params}")
        else:
            for p in params:
                if not re.search(rf"^\s+{re.escape(p)}( \(.*\))?:", doc, re.M):
                    problems.append(f"{name}: parameter {p!r} is not described")
    annotation = inspect.signature(fn).return_annotation
    returns_something = annotation not in (None, "None", inspect.Signature.empty)
    if returns_something and "Returns" not in sections:
        problems.append(f"{name}: no Returns section")
    if "Raises" not in sections and not is_method:
        problems.append(f"{name}: no Raises section")
    return problems


def test_every_public_name_documents_parameters_returns_and_errors():
    problems = []
    for name, obj in _public_names():
        if inspect.isclass(obj):
            doc = inspect.getdoc(obj) or ""
            if not doc:
                problems.append(f"{name}: no docstring")
                continue
            sections = _sections(doc)
            if issubclass(obj, Exception):
                continue  # what it means, and (where it has them) its Args and Attributes
            init_params = [p for p in inspect.signature(obj).parameters]
            if init_params and not ({"Args", "Attributes"} & sections):
                problems.append(f"{name}: parameters {init_params} are not described")
            for attr, member in vars(obj).items():
                if attr.startswith("_") or not callable(member):
                    continue
                problems += [p for p in _check_function(f"{name}.{attr}", member, is_method=True)
                             if "Raises" not in p]
        else:
            problems += _check_function(name, obj)
    assert not problems, "\n".join(problems)


def test_every_public_name_has_a_reference_entry():
    text = (ROOT / "docs" / "reference.md").read_text()
    missing = [name for name, _ in _public_names() if f"::: {name}\n" not in text]
    assert not missing, f"docs/reference.md has no '::: NAME' entry for {missing}"


def test_every_guide_is_in_the_site_navigation():
    config = (ROOT / "mkdocs.yml").read_text()
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    missing = [p for p in sorted(pages) if not re.search(rf":\s+{re.escape(p)}\s*$", config, re.M)]
    assert not missing, f"mkdocs.yml nav lacks {missing}"
    assert '--8<-- "formats/SPEC.md"' in (ROOT / "docs" / "format.md").read_text()
    assert os.path.exists(ROOT / "formats" / "SPEC.md")


def test_the_design_page_names_every_module_of_the_package():
    """docs/design.md walks a save and a restore file by file; its table names every module of
    ckpt/ (a module added without a line there fails here), and nothing that no longer exists."""
    text = (ROOT / "docs" / "design.md").read_text()
    named = set(re.findall(r"`(ckpt/[\w/]+\.py)`", text))
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "ckpt").rglob("*.py")}
    assert not modules - named, f"modules missing from docs/design.md: {sorted(modules - named)}"
    assert not named - modules, f"docs/design.md names modules that do not exist: {sorted(named - modules)}"
    for part in ("_save", "_restore"):
        walk = text.split(f"## A {'save' if part == '_save' else 'restore'}, file by file", 1)[1].split("\n## ", 1)[0]
        steps = sorted(p.stem for p in (ROOT / "ckpt" / part).glob("*.py") if p.stem != "__init__")
        assert all(f"{part}/{s}.py" in walk for s in steps), f"the {part} walk skips a module of ckpt/{part}/"
