"""Progress of a SWE-bench batch: a rich progress bar on a terminal, else plain lines.

Counts shown: done of total, resolved, errors; an error is never shown as a success
(the harness's bar once counted failures as done-and-fine).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol


class Display(Protocol):
    def start(self, total: int) -> None: ...
    def update(self, out: dict[str, Any], counts: dict[str, int]) -> None: ...
    def stop(self) -> None: ...


class Lines:
    """One line per finished instance, through ``say`` (stderr with a timestamp)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say, self.total = say, 0

    def start(self, total: int) -> None:
        self.total = total

    def update(self, out: dict[str, Any], counts: dict[str, int]) -> None:
        why = f" - {out['reason']}" if out.get("reason") else ""
        self.say(
            f"[{counts['done']}/{self.total}] {out['instance_id']}: {out['result']} "
            f"(resolved {counts['resolved']}, errors {counts['errors']}){why}"
        )

    def stop(self) -> None:
        return None


class Bar:
    """A rich progress bar on stderr, with the counts and the last instance finished."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.progress = Progress(
            TextColumn("swebench"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[counts]}"), console=Console(stderr=True),
        )  # fmt: skip
        self.task = self.progress.add_task("swebench", total=None, counts="")

    def start(self, total: int) -> None:
        self.progress.update(self.task, total=total)
        self.progress.start()

    def update(self, out: dict[str, Any], counts: dict[str, int]) -> None:
        text = (
            f"resolved {counts['resolved']}  errors {counts['errors']}  "
            f"last {out['instance_id']}: {out['result']}"
        )
        self.progress.update(self.task, completed=counts["done"], counts=text)

    def stop(self) -> None:
        self.progress.stop()


def display(say: Callable[[str], None]) -> Display:
    """The bar when stderr is a terminal and rich is installed, else plain lines."""
    if sys.stderr.isatty():
        try:
            return Bar()
        except ImportError:
            pass
    return Lines(say)
