"""How the `ckpt` command reads its arguments: argparse made to report every mistake in one line
(with the closest command or option offered), help wrapped to the terminal, the library's keyword
arguments named as the flags that set them, and the argument types (steps, sizes, tolerances)."""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import sys
import textwrap
from typing import Sequence


class _UsageError(Exception):
    """A bad argument value: reported like any other error, in one line."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors (usage text plus message) turned into the one-line error every
    other failure gets, so that scripts can rely on one line and exit status 2."""

    def __init__(self, *args, **kwargs):
        # No abbreviations: '--overwrit' is a typo to point out (with the option it resembles),
        # not a silent '--overwrite'; and a new option never changes what an old prefix meant.
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(f"{_did_you_mean(message, self, getattr(self, 'argv', ()))} (see '{self.prog} --help')")


def _options_of(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """The option strings of the command `argv` runs (of `parser` itself without one)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            command = next((a for a in argv if a in action.choices), None)
            if command is not None:
                return _options_of(action.choices[command], [])
    return [o for action in parser._actions for o in action.option_strings]


def _did_you_mean(message: str, parser: argparse.ArgumentParser, argv: Sequence[str] = ()) -> str:
    """argparse's "invalid choice: 'verfy' (choose from ...)" with the closest choice offered;
    "unrecognized arguments: --overwrit" with the closest option of the command."""
    m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if m is not None:
        close = difflib.get_close_matches(m.group(1), re.findall(r"'([^']*)'", m.group(2)), n=1, cutoff=0.6)
        return f"{message}; did you mean {close[0]!r}?" if close else message
    m = re.search(r"unrecognized arguments: (.*)", message)
    if m is not None:
        options = _options_of(parser, argv or sys.argv[1:])
        for arg in m.group(1).split():
            if arg.startswith("-"):
                close = difflib.get_close_matches(arg.split("=", 1)[0], options, n=1, cutoff=0.6)
                if close:
                    return f"{message}; did you mean {close[0]}?"
    return message


# The library's messages name its keyword arguments; on the command line, the flags that set them.
_FLAG_NAMES = [(re.compile(r"overwrite=True \(ckpt \w+ --overwrite\)"), "--overwrite"),
               (re.compile(r"\boverwrite=True\b"), "--overwrite")]


def _in_flags(text: str) -> str:
    for pattern, flag in _FLAG_NAMES:
        text = pattern.sub(flag, text)
    return text


class _HelpFormatter(argparse.HelpFormatter):
    """Help wrapped to the terminal (at most 100 columns), paragraph by paragraph; a paragraph
    that starts with 'example' or holds indented lines is kept as written."""

    def __init__(self, prog: str):
        width = max(40, min(shutil.get_terminal_size((100, 24)).columns, 100))
        super().__init__(prog, width=width, max_help_position=28)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in text.split("\n\n"):
            if para.startswith("example") or "\n " in para:
                out.append(textwrap.indent(para, indent))
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent, subsequent_indent=indent))
        return "\n\n".join(out)


def _step(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad step {text!r} (a whole number >= 0)") from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"bad step {text!r}: steps are >= 0")
    return step


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"bad tolerance {text!r} (a number >= 0, e.g. 1e-6)")
    return value


def _size(text: str) -> int:
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1:] if t[-1:] in units else ""
    number = t[: len(t) - len(unit)]
    if not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 65536, 64k, 64MiB)")
    return int(number) * units[unit]
