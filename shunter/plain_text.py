"""Tables and bars drawn by rich, as plain text: what the bench report and the REPL's `status`
print, the same on a terminal, in a pipe and in a test."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table


def plain_table(columns: tuple[str, ...]) -> Table:
    """A table without a box or colour: the first column left, the others right-aligned, two
    spaces between columns."""
    grid = Table(box=None, padding=(0, 2, 0, 0), pad_edge=False)
    for i, name in enumerate(columns):
        grid.add_column(name, justify="left" if i == 0 else "right", no_wrap=True)
    return grid


def plain_text(renderable: object) -> str:
    """What rich draws for `renderable`, as text without colour or trailing spaces."""
    console = Console(file=io.StringIO(), width=400, color_system=None, highlight=False)
    with console.capture() as captured:
        console.print(renderable)
    return "\n".join(line.rstrip() for line in captured.get().splitlines())
