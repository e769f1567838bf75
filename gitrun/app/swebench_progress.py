"""Progress of a SWE-bench batch: a rich progress bar on a terminal, else plain lines.

Counts shown: done of total, resolved, errors, and the instances in flight; an error is
never shown as a success (the harness's bar once counted failures as done-and-fine).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol


class Display(Protocol):
    def start(self, total: int) -> None: ...
    def running(self, iid: str, counts: dict[str, int]) -> None: ...
    def update(self, out: dict[str, Any], counts: dict[str, int]) -> None: ...
    def stop(self) -> None: ...


class Lines:
    """One line per instance started and per instance finished, through ``say`` (stderr
    with a timestamp)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say, self.total = say, 0

    def start(self, total: int) -> None:
        self.total = total

    def running(self, iid: str, counts: dict[str, int]) -> None:
        self.say(
            f"[{counts['done']}/{self.total}] running {iid} "
            f"(resolved {counts['resolved']}, errors {counts['errors']})"
        )

    def update(self, out: dict[str, Any], counts: dict[str, int]) -> None:
        why = f" - {out['reason']}" if out.get("reason") else ""
        self.say(
            f"[{counts['done']}/{self.total}] {out['instance_id']}: {out['result']} "
            f"(resolved {counts['resolved']}, errors {counts['errors']}){why}"
        )

    def stop(self) -> None:
        return None


class Bar:
    """A rich progress bar on stderr, with the counts, the instances in flight and the last
    one finished."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.progress = Progress(
            TextColumn("swebench"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[counts]}"), console=Console(stderr=True),
        )  # fmt: skip
        self.task = self.progress.add_task("swebench", total=None, counts="")
        self.in_flight: list[str] = []
        self.last = ""

    def start(self, total: int) -> None:
        self.progress.update(self.task, total=total)
        self.progress.start()

    def running(self, iid: str, counts: dict[str, int]) -> None:
        if iid not in self.in_flight:
            self.in_flight.append(iid)
        self._show(counts)

    def update(self, out: dict[str, Any], counts: dict[str, int]) -> None:
        if out["instance_id"] in self.in_flight:
            self.in_flight.remove(out["instance_id"])
        self.last = f"  last {out['instance_id']}: {out['result']}"
        self._show(counts)

    def _show(self, counts: dict[str, int]) -> None:
        now = f"  running {', '.join(self.in_flight)}" if self.in_flight else ""
        text = f"resolved {counts['resolved']}  errors {counts['errors']}{now}{self.last}"
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
