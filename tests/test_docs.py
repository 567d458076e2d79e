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
def test_every_code_block_runs(page, tmp_path, monkeypatch, capsys):
    """... and then the page's `$ ckpt ...` sessions that show output (docs/cli.md has its own
    test), in the same directory, on what the blocks wrote: the output must be the one shown, the
    directory shown as /home/me (see test_the_cli_page_shows_what_the_commands_print)."""
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
    if page.name == "cli.md":
        return
    import shlex

    from ckpt.cli._main import main as cli_main

    for line, command, documented in cli_sessions(page):
        if not documented:
            continue  # a command shown without its output
        capsys.readouterr()
        cli_main(shlex.split(command, comments=True)[1:])
        out = capsys.readouterr()
        actual = (out.err + out.out).replace(str(tmp_path), "/home/me").rstrip("\n").splitlines()
        assert _matches(documented, actual), (f"{page.relative_to(ROOT)}:{line}: $ {command}\n--- documented\n"
                                              + "\n".join(documented) + "\n--- printed\n" + "\n".join(actual))


def test_few_blocks_are_marked_no_test():
    skipped = [(p.name, line, why) for p in PAGES for line, _, why in python_blocks(p) if why is not None]
    total = sum(len(python_blocks(p)) for p in PAGES)
    assert total >= 20 and len(skipped) <= total // 4, skipped


def _public_names():
    import ckpt
    import ckpt.safetensors
    import ckpt.surgery

    names = [(f"ckpt.{n}", getattr(ckpt, n)) for n in ckpt.__all__]
    names += [(f"ckpt.safetensors.{n}", getattr(ckpt.safetensors, n)) for n in ckpt.safetensors.__all__]
    names += [(f"ckpt.surgery.{n}", getattr(ckpt.surgery, n)) for n in ckpt.surgery.__all__]
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


# ---- the pages agree with each other and with the code (issue 26) ------------------------------

OBJECT_STORE_PAGES = ["README.md", "docs/index.md", "docs/design.md", "docs/storage.md"]
OBJECT_STORE_STATEMENT = ("Object stores are tested against server software running on loopback: SeaweedFS for S3 and "
                          "fake-gcs-server (an emulator) for GCS in every test run, and Ceph RGW for S3 on request "
                          "(`CKPT_TEST_CEPH=1`); not against AWS S3 or Google Cloud Storage themselves")


def _prose(path: Path) -> str:
    """A page's text with its line breaks (and a list item's indentation) folded into spaces."""
    return re.sub(r"\s*\n\s*", " ", path.read_text())


def test_object_stores_are_described_the_same_everywhere():
    """One statement of how object stores are tested, on every page that says anything about it,
    and none of the older, contradicting ones (README: "not yet tested against real servers",
    design.md: "in-memory stores and local disk only")."""
    contradicting = ["not yet tested against real servers", "in-memory stores and local disk only",
                     "not tested against real servers", "untested against real servers"]
    found = [f"{p.relative_to(ROOT)}: {phrase!r}" for p in PAGES + [ROOT / "formats" / "SPEC.md", ROOT / "CHANGELOG.md"]
             for phrase in contradicting if phrase in _prose(p).lower()]
    assert not found, found
    missing = [p for p in OBJECT_STORE_PAGES if OBJECT_STORE_STATEMENT not in _prose(ROOT / p)]
    assert not missing, f"pages without the object-store statement: {missing}"
    # ... and what it says is what the suite does.
    servers = (ROOT / "tests" / "servers.py").read_text()
    assert all(f"class {c}" in servers for c in ("SeaweedFS", "FakeGcs", "CephRgw"))
    assert 'os.environ.get("CKPT_TEST_CEPH") == "1"' in (ROOT / "tests" / "test_s3.py").read_text()


def _documented_calls(text: str) -> dict[str, set[str]]:
    """`name(...)` code spans of a page: name -> the parameter names its spans show (a method as
    `mgr.name`; `a=1` and bare `a` both count)."""
    calls: dict[str, set[str]] = {}
    for span in re.findall(r"`([^`\n]+)`", text):
        m = re.match(r"^((?:ckpt\.safetensors\.|mgr\.)?\w+)\(([^()]*)\)(?:\s*->.*)?$", span)
        if m:
            params = {p.split("=")[0].strip() for p in m.group(2).split(",")}
            calls.setdefault(m.group(1), set()).update(p for p in params if p.isidentifier())
    return calls


def test_the_api_overview_lists_every_parameter_and_option():
    """docs/api.md gives every public function (ckpt.__all__, ckpt.safetensors.export), the
    CheckpointManager and each of its public methods with all their parameters, and has a row for
    every ckpt.Options field: a parameter or field added without its line fails here."""
    import dataclasses

    import ckpt
    import ckpt.safetensors

    text = (ROOT / "docs" / "api.md").read_text()
    calls = _documented_calls(text)
    wanted = {n: getattr(ckpt, n) for n in ckpt.__all__ if inspect.isfunction(getattr(ckpt, n))}
    wanted["ckpt.safetensors.export"] = ckpt.safetensors.export
    wanted["CheckpointManager"] = ckpt.CheckpointManager
    wanted |= {f"mgr.{a}": m for a, m in vars(ckpt.CheckpointManager).items()
               if not a.startswith("_") and inspect.isfunction(m)}
    problems = []
    for name, fn in sorted(wanted.items()):
        if name not in calls:
            problems.append(f"{name}: no `{name}(...)` in docs/api.md")
            continue
        documented = calls[name]
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        problems += [f"{name}: parameter {p!r} missing" for p in params if p not in documented]
    fields = [f.name for f in dataclasses.fields(ckpt.Options)]
    problems += [f"Options.{f}: no row" for f in fields if not re.search(rf"^\| `{f}` \|", text, re.M)]
    assert not problems, "\n".join(problems)


def test_the_readme_names_every_public_function_and_command():
    import ckpt
    from ckpt.cli._main import _parser

    readme = (ROOT / "README.md").read_text()
    functions = [n for n in ckpt.__all__ if inspect.isfunction(getattr(ckpt, n))]
    assert not [f for f in functions if f"`{f}`" not in readme], "README's list of functions is stale"
    assert not re.search(r"\b(one|two|three|four|five|seven|eight) functions\b", _prose(ROOT / "README.md"))
    commands = [a for a in _parser()._subparsers._group_actions[0].choices]
    cli_page = (ROOT / "docs" / "cli.md").read_text()
    synopsis = cli_page.split("```\n", 2)[1]
    problems = [f"README lacks `ckpt {c}`" for c in commands if f"`ckpt {c}" not in readme]
    problems += [f"docs/cli.md's synopsis lacks ckpt {c}" for c in commands
                 if not re.search(rf"^ckpt {c}\b", synopsis, re.M)]
    problems += [f"docs/cli.md has no section for {c}" for c in commands if f"\n## {c}\n" not in cli_page]
    assert not problems, problems


def test_the_cli_synopsis_has_every_option():
    """The synopsis at the top of docs/cli.md shows every option of every command (the parser's)."""
    from ckpt.cli._main import _parser

    synopsis = (ROOT / "docs" / "cli.md").read_text().split("```\n", 2)[1]
    usage: dict[str, str] = {}
    for line in synopsis.splitlines():
        m = re.match(r"^ckpt (\w+)\b", line)
        if m:
            command = m.group(1)
        usage[command] = usage.get(command, "") + " " + line
    problems = []
    for command, sub in _parser()._subparsers._group_actions[0].choices.items():
        options = [o for a in sub._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
        problems += [f"ckpt {command} {o}" for o in options if not re.search(rf"{re.escape(o)}\b", usage.get(command, ""))]
    assert not problems, f"docs/cli.md's synopsis lacks: {problems}"


def test_every_recipe_is_fenced_as_python():
    """A Python recipe in a bare ``` fence is never run (test_every_code_block_runs runs ```python
    blocks only): the Optax and Equinox recipes were, and the Optax one did not work with sharded
    parameters. A bare block that reads as Python (an import, a call assigned to a name, a
    `ckpt.`/`jax.` call) is refused; shell sessions (`$ ...`), command synopses and output are not."""
    python_like = re.compile(r"^(import \w|from \w[\w.]* import |\w[\w, ]* = \w[\w.]*\(|(ckpt|jax|nnx|eqx|optax)\.\w+\()")
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip().startswith("```"):
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                body = [line for line in lines[i + 1:end] if line.strip()]
                if lines[i].strip() == "```" and body and not body[0].startswith("$") \
                        and any(python_like.match(line) for line in body):
                    found.append(f"{page.relative_to(ROOT)}:{i + 1}")
                i = end
            i += 1
    assert not found, f"Python in a bare ``` fence (fence it as ```python, or mark it no-test): {found}"


# ---- docs/cli.md shows what the commands print ------------------------------------------------

CLI_NOT_RUN = re.compile(r"^<!--\s*output not run:\s*(\S.*?)\s*-->$")
# What differs from run to run: times, rates, durations, process ids, host names, the version.
_CLI_VOLATILE = [
    (re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"), "<TIME>"),
    (re.compile(r"\bin \d+(\.\d+)? s\b"), "in <T> s"),
    (re.compile(r"\(\d+(\.\d+)? [KMGT]?i?B/s\)"), "(<RATE>)"),
    (re.compile(r"\bfor \d+ s\b"), "for <N> s"),
    (re.compile(r"\bpid \d+ on host \S+?\)"), "pid <PID> on host <HOST>)"),
    (re.compile(r"jax-ckpt \d+\.\d+\.\d+\S*"), "jax-ckpt <VERSION>"),
    (re.compile(r"^(\s*\d+\s+uncommitted\s+)\d+ B\b"), r"\1<N> B"),  # an owner record's size: the pid's digits
    (re.compile(r"\s+"), " "),  # column widths follow the values
]


def _cli_normal(line: str) -> str:
    for pattern, replacement in _CLI_VOLATILE:
        line = pattern.sub(replacement, line)
    return line.strip()


def cli_sessions(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line number, command, documented output lines) of every bare ``` block of a page that
    starts with `$ ckpt `, unless the line before it is `<!-- output not run: why -->`."""
    lines, sessions, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip().startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            if lines[i].strip() == "```" and lines[i + 1].startswith("$ ckpt ") and not CLI_NOT_RUN.match(before):
                sessions.append((i + 2, lines[i + 1][2:], lines[i + 2:end]))
            i = end
        i += 1
    return sessions


def _matches(documented: list[str], actual: list[str]) -> bool:
    """Line by line after normalizing; a documented `...` line stands for any number of lines."""
    if not documented:
        return not actual
    if documented[0].strip() == "...":
        return any(_matches(documented[1:], actual[k:]) for k in range(len(actual) + 1))
    return bool(actual) and _cli_normal(documented[0]) == _cli_normal(actual[0]) and _matches(documented[1:], actual[1:])


@pytest.fixture(scope="module")
def cli_sample(tmp_path_factory) -> Path:
    """The checkpoints docs/cli.md shows, made as it says: a CheckpointManager directory
    /ckpts/run1 with steps 1 and 2 (default options), a leftover of a save that died (step 3) and
    a save just begun (step 4); /ckpts/damaged, step 2 with one chunk flipped, one truncated and
    one deleted."""
    import shutil

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from support import plant_dead_save, storage_of

    import ckpt

    root = tmp_path_factory.mktemp("cli-docs")
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    spec = NamedSharding(mesh, P("data", "model"))
    embed = np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512) / 1024
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 8
    mu = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32)
    run = root / "ckpts" / "run1"
    with ckpt.CheckpointManager(run, async_save=False) as manager:
        for step in (1, 2):
            manager.save(step, {
                "params": {"embed": jax.device_put(embed, spec), "w": jax.device_put(w - 0.125 * step, spec),
                           "b": jax.device_put(np.full(32, 0.5, np.float32), NamedSharding(mesh, P("model")))},
                "opt": {"mu": jax.device_put(mu, spec), "count": np.int32(step)},
                "step": step, "tag": "run-1"}, metadata={"loss": 1.0 / step})
    plant_dead_save(storage_of(str(run)), "step_00000003.tmp-0123456789ab")
    (run / "step_00000004.tmp-9f8e7d6c5b4a").mkdir()  # a save in its first second: no owner record yet
    damaged = root / "ckpts" / "damaged"
    shutil.copytree(run / "step_00000002", damaged)
    chunks = sorted((damaged / "params" / "embed" / "c").glob("*/*"))
    data = bytearray(chunks[0].read_bytes())
    data[100] ^= 1
    chunks[0].write_bytes(bytes(data))
    os.truncate(chunks[3], 300)
    chunks[5].unlink()
    return root


def test_the_cli_page_shows_what_the_commands_print(cli_sample, capsys):
    """Every `$ ckpt ...` session of docs/cli.md, run on the checkpoints it names (cli_sample):
    the output is the documented one, except for times, rates and process ids; `...` elides
    lines. A session that cannot run here is marked `<!-- output not run: why -->`."""
    import shlex

    from ckpt.cli._main import main as cli_main

    sessions = cli_sessions(ROOT / "docs" / "cli.md")
    assert len(sessions) >= 8, sessions
    places = {"/ckpts/": f"{cli_sample}/ckpts/", "/tmp/hf": f"{cli_sample}/hf"}
    failures = []
    for line, command, documented in sessions:
        argv = shlex.split(command)[1:]
        for doc_path, real in places.items():
            argv = [a.replace(doc_path, real) if a.startswith(doc_path) else a for a in argv]
        capsys.readouterr()
        cli_main(argv)
        out = capsys.readouterr()
        actual = (out.err + out.out).replace(places["/ckpts/"], "/ckpts/").replace(places["/tmp/hf"], "/tmp/hf")
        if not _matches(documented, actual.rstrip("\n").splitlines()):
            failures.append(f"docs/cli.md:{line}: $ {command}\n--- documented\n" + "\n".join(documented)
                            + "\n--- printed\n" + actual)
    assert not failures, "\n\n".join(failures)


def test_the_platforms_section_names_both_ci_environments():
    """README's "Platforms" (and docs/index.md's) name the two environments CI runs the suite in,
    as .ci/run and the Makefile define them: Python 3.11 with jax 0.10.2 (`make test`), and Python
    3.12 with the newest jax, jaxlib, flax, optax and orbax-checkpoint (`make test-newest`)."""
    ci, makefile = (ROOT / ".ci" / "run").read_text(), (ROOT / "Makefile").read_text()
    assert re.search(r"^targets=\(test test-newest\)$", ci, re.M), ".ci/run no longer runs both environments"
    newest = re.search(r"^NEWEST := (.*)$", makefile, re.M).group(1).split()
    assert newest == ["jax", "jaxlib", "flax", "optax", "orbax-checkpoint"], newest
    readme = _prose(ROOT / "README.md").split("## Platforms", 1)[1].split("## ", 1)[0]
    index = _prose(ROOT / "docs" / "index.md").split("## Platforms", 1)[1].split("## ", 1)[0]
    for name, text in (("README.md", readme), ("docs/index.md", index)):
        assert "Python 3.11 with jax 0.10.2" in text, name
        assert "Python 3.12 with the newest jax, jaxlib, flax, optax and orbax-checkpoint" in text, name
    assert "`make test`" in readme and "`make test-newest`" in readme and "`.ci/run`" in readme
