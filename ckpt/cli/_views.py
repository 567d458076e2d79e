"""The terminal views of the commands: the same rows and documents as the plain renderers
(ckpt.cli._render, _diff, _plan, _du), drawn as rich tables with colours."""

from __future__ import annotations

import re

from rich.console import Group
from rich.text import Text

from ckpt._format import Manifest
from ckpt.cli._opened import StepRow
from ckpt.cli._style import styled, table


def rich_ls(rows: list[StepRow]):
    from ckpt.cli._render import LS_HEADER, ls_rows

    body = []
    for r, cells in zip(rows, ls_rows(rows)):
        body.append([cells[0], styled(cells[1], r.state), cells[2], cells[3], cells[4],
                     Text(r.path, style="cyan") + (Text(f"  ({r.problem})", style="red") if r.problem else Text())])
    return table(LS_HEADER, body, right={0, 2, 3})


def rich_inspect(doc: dict, manifest: Manifest, width: int):
    """The same lines as the plain text, fitted to the terminal's width, in colour."""
    from ckpt.cli._render import inspect_lines

    out = []
    for line in inspect_lines(doc, manifest, width):
        t = Text(no_wrap=False)
        for text, meaning in line:
            t.append_text(styled(text, meaning))
        out.append(t)
    return Group(*out)


_MARKS = [(re.compile(r"\bdiffer\b.*$|-> .*$"), "red"), (re.compile(r"\bequal\b"), "green"),
          (re.compile(r"^summary: identical.*"), "bold green"), (re.compile(r"^summary: different.*"), "bold red"),
          (re.compile(r"^(only in [AB]|kind changed|shape changed|dtype changed|arrays|values) \(\d+\):"), "bold")]


def colour_lines(text: str):
    """Plain output with the words that carry the answer coloured (diff, verify)."""
    out = []
    for line in text.splitlines():
        t = Text(line)
        if line.startswith("BAD "):
            t.stylize("red")
        elif line.startswith("result: intact"):
            t.stylize("bold green")
        elif line.startswith("result: DAMAGED"):
            t.stylize("bold red")
        else:
            for pattern, style in _MARKS:
                for m in pattern.finditer(line):
                    t.stylize(style, m.start(), m.end())
        out.append(t)
    return Group(*out)


def rich_plan(doc: dict, per_leaf: bool):
    from ckpt.cli._render import human_bytes, plural

    def cells(label: str, t: dict) -> list:
        amp = t["read_amplification"]
        amp_text = "-" if amp is None else f"{amp:.2f}x"
        return [label, human_bytes(t["bytes_read"]), str(t["chunks_read"]), human_bytes(t["bytes_needed"]),
                human_bytes(t["inline_bytes"]), Text(amp_text, style="yellow" if amp and amp > 1.0 else "green")]

    header = ["PROCESS", "READ", "CHUNKS", "NEEDED", "OF IT INLINE", "AMPLIFICATION"]
    mesh = ",".join(f"{a}={n}" for a, n in zip(doc["mesh"]["axis_names"], doc["mesh"]["axis_sizes"]))
    parts = [Text(f"restore of {doc['path']}", style="bold"),
             Text(f"onto mesh {mesh} in {doc['processes']} process(es) of {plural(doc['devices_per_process'], 'device')}",
                  style="dim"), Text()]
    rows = [cells(str(p["process"]), p) for p in doc["per_process"]] + [cells("total", doc["total"])]
    parts.append(table(header, rows, right=range(1, 6)))
    if per_leaf:
        parts.append(table(["LEAF", *header[1:]], [cells(x["path"], x) for x in doc["per_leaf"]], right=range(1, 6)))
    if doc["unplaceable"]:
        from ckpt.cli._plan import unplaceable_lines

        parts.append(Text(f"cannot be placed ({len(doc['unplaceable'])}):", style="bold red"))
        pairs = [(u["path"], u["why"]) for u in doc["unplaceable"]]
        parts += [Text(line, style="red") for line in unplaceable_lines(pairs, per_leaf)]
        if doc.get("hint"):
            parts.append(Text(f"hint: {doc['hint']}", style="yellow"))
    return Group(*parts)
