"""How the CLI looks on a terminal: tables, colours and progress through rich.

Each command builds its output once as rows; on a terminal (stdout, or stderr for progress)
they are drawn with rich, otherwise (piped, redirected, captured, ``TERM=dumb``) the plain text
renderers print the same rows with no escape codes, in the stable layout scripts parse.
``NO_COLOR`` keeps the tables and drops the colours; ``FORCE_COLOR`` draws them even when piped.
"""

from __future__ import annotations

import sys
from typing import Iterable, Sequence, TextIO

from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

# Colours by meaning, so every command says the same thing the same way.
STYLES = {
    "committed": "green", "intact": "bold green", "equal": "green", "uncommitted": "yellow", "corrupt": "bold red",
    "damaged": "bold red", "differ": "red", "bad": "red", "dim": "dim", "path": "cyan", "header": "bold",
}


def console(stream: TextIO | None = None) -> Console | None:
    """A rich console for `stream` (default stdout) when it is a terminal, else None (plain
    output)."""
    c = Console(file=stream or sys.stdout, highlight=False, soft_wrap=False)
    if not c.is_terminal or c.is_dumb_terminal:
        return None
    return c


def styled(text: str, meaning: str | None) -> Text:
    return Text(text, style=STYLES.get(meaning or "", ""))


def table(header: Sequence[str], rows: Iterable[Sequence[str | Text]], *, right: Iterable[int] = (),
          title: str | None = None) -> Table:
    """A borderless table with a bold header, as `ls`, `inspect`, `plan` and `du` draw them."""
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style=STYLES["header"],
              title=title, title_justify="left", title_style="bold")
    right = set(right)
    for i, name in enumerate(header):
        t.add_column(name, justify="right" if i in right else "left", no_wrap=i < len(header) - 1,
                     overflow="fold")
    for row in rows:
        t.add_row(*row)
    return t


def share_bar(fraction: float, width: int = 20) -> Text:
    """A horizontal bar for a share of a whole (du)."""
    full = max(0, min(width, round(fraction * width)))
    return Text("█" * full, style="cyan") + Text("·" * (width - full), style="dim")


class _Bytes(ProgressColumn):
    def render(self, task) -> Text:
        from ckpt.cli._render import human_bytes

        return Text(f"{human_bytes(task.completed)} / {human_bytes(task.total or 0)}", style="green")


class _Rate(ProgressColumn):
    def render(self, task) -> Text:
        from ckpt.cli._render import human_bytes

        speed = task.finished_speed or task.speed or 0.0
        return Text(f"{human_bytes(speed)}/s", style="red")


class ProgressBar:
    """A rich progress bar on a terminal (stderr by default): bar, percentage, bytes done of
    total, bytes per second, time left. Called as ``bar(done, total)``; ``close()`` ends it."""

    def __init__(self, stream: TextIO | None = None, label: str = "verify"):
        self._progress = Progress(
            TextColumn(f"[bold]{label}"), BarColumn(), TaskProgressColumn(), _Bytes(), _Rate(), TimeRemainingColumn(),
            console=Console(file=stream or sys.stderr, highlight=False), transient=False,
        )
        self._task = None

    def __call__(self, done: int, total: int) -> None:
        if self._task is None:
            self._progress.start()
            self._task = self._progress.add_task("", total=total)
        self._progress.update(self._task, completed=done, total=total)

    def close(self) -> None:
        if self._task is not None:
            self._progress.refresh()
            self._progress.stop()


def progress_bar(show: bool, label: str) -> ProgressBar | None:
    """A progress bar on stderr when `show` and stderr is a terminal, else None."""
    if not show or console(sys.stderr) is None:
        return None
    return ProgressBar(sys.stderr, label)
