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
    "dtype": "magenta", "value": "yellow", "note": "yellow",
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


FLEX_MIN = 12  # the narrowest a folding column (names, paths) gets before the table gives up


class FitTable:
    """A borderless table with a bold header, as `ls`, `plan` and `du` draw them, that never
    cuts a cell: the first and last columns (names, paths) fold onto further lines when the
    terminal is narrow, every other column keeps its full width, and when even that does not fit,
    the rows are printed as plain lines (which the terminal wraps) instead of a table whose
    columns rich would crop without a mark (issue 26: 'bfloat1', '[32,')."""

    def __init__(self, header: Sequence[str], rows: list[Sequence[str | Text]], right: set[int], title: str | None):
        self.header, self.rows, self.right, self.title = list(header), rows, right, title
        n = len(self.header)
        self.widths = [max([len(self.header[i])] + [len(Text(r[i]).plain if isinstance(r[i], str) else r[i].plain)
                                                     for r in rows]) for i in range(n)]
        self.flex = {0, n - 1}

    def _table(self) -> Table:
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style=STYLES["header"],
                  title=self.title, title_justify="left", title_style="bold")
        for i, name in enumerate(self.header):
            justify = "right" if i in self.right else "left"
            if i in self.flex:
                t.add_column(name, justify=justify, overflow="fold", min_width=min(self.widths[i], FLEX_MIN))
            else:
                t.add_column(name, justify=justify, no_wrap=True, min_width=self.widths[i])
        for row in self.rows:
            t.add_row(*row)
        return t

    def __rich_console__(self, console, options):
        least = sum(min(w, FLEX_MIN) if i in self.flex else w for i, w in enumerate(self.widths))
        if least + 3 * (len(self.widths) - 1) <= options.max_width:
            yield self._table()
            return
        if self.title:
            yield Text(self.title, style="bold")
        yield Text("  ".join(self.header), style=STYLES["header"])
        for row in self.rows:
            line = Text()
            for i, cell in enumerate(row):
                line.append_text(Text(cell) if isinstance(cell, str) else cell)
                if i < len(row) - 1:
                    line.append("  ")
            yield line


def table(header: Sequence[str], rows: Iterable[Sequence[str | Text]], *, right: Iterable[int] = (),
          title: str | None = None) -> FitTable:
    """A table as `ls`, `plan` and `du` draw them (``FitTable``)."""
    return FitTable(header, list(rows), set(right), title)


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
