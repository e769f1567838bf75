"""Hunks of a unified diff: the record, its consistency checks, and reading one ``@@`` block.

Pure, like :mod:`gitrun.core.patch`, which re-exports :class:`Hunk`; the line cursor both parsers
read from lives here too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gitrun.core import patch_noise as noise
from gitrun.core.errors import PatchError
from gitrun.core.patch_names import fail

__all__ = [
    "NO_NEWLINE",
    "Cursor",
    "Hunk",
    "at_file_header",
    "at_plain_header",
    "check_hunk_positions",
    "offset",
    "parse_hunk",
]

_ORIGINS = frozenset(" -+")
_HUNK_HEADER = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(?: |$)")
NO_NEWLINE = "'\\ No newline at end of file'"


@dataclass(frozen=True)
class Hunk:
    """One ``@@`` block. ``lines`` hold (origin, content) with origin ' ', '-' or '+' and the
    content without its newline; the ``*_missing_newline`` flags record a ``\\ No newline at
    end of file`` marker on the last old-side / new-side line."""

    old_start: int
    old_count: int
    new_start: int
    new_count: int
    lines: tuple[tuple[str, bytes], ...]
    old_missing_newline: bool = False
    new_missing_newline: bool = False
    patch_line: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        problem = _hunk_problem(self)
        if problem is not None:
            raise PatchError(f"patch line {self.patch_line}: {problem}")

    @property
    def header(self) -> str:
        return f"@@ -{self.old_start},{self.old_count} +{self.new_start},{self.new_count} @@"

    def old_side(self) -> list[bytes]:
        """The old lines this hunk expects, each with the newline it must have in the file."""
        return _side(self.lines, "+", missing_newline=self.old_missing_newline)

    def new_side(self) -> list[bytes]:
        """The lines this hunk writes, each with its newline."""
        return _side(self.lines, "-", missing_newline=self.new_missing_newline)


def _side(lines: Iterable[tuple[str, bytes]], skip: str, *, missing_newline: bool) -> list[bytes]:
    out = [content + b"\n" for origin, content in lines if origin != skip]
    if missing_newline and out:
        out[-1] = out[-1][:-1]
    return out


def _hunk_problem(h: Hunk) -> str | None:
    olds = sum(origin != "+" for origin, _ in h.lines)
    news = sum(origin != "-" for origin, _ in h.lines)
    checks = (
        (any(o not in _ORIGINS for o, _ in h.lines), "hunk line origins must be ' ', '-', '+'"),
        (any(b"\n" in content for _, content in h.lines), "hunk line content holds a newline"),
        (min(h.old_start, h.old_count, h.new_start, h.new_count) < 0, "negative hunk range"),
        (
            (olds, news) != (h.old_count, h.new_count),
            f"hunk {h.header} holds {olds} old and {news} new lines",
        ),
        (not h.lines, f"hunk {h.header} is empty"),
        (
            (h.old_start == 0 < h.old_count) or (h.new_start == 0 < h.new_count),
            f"hunk {h.header} starts at line 0",
        ),
        (h.old_missing_newline and not olds, f"{NO_NEWLINE} on an empty old side"),
        (h.new_missing_newline and not news, f"{NO_NEWLINE} on an empty new side"),
    )
    return next((message for bad, message in checks if bad), None)


def offset(start: int, count: int) -> int:
    """0-based index of a hunk side: an empty side's start names the line before it."""
    return start - 1 if count else start


def check_hunk_positions(hunks: Sequence[Hunk], path: str) -> None:
    old_end = 0
    delta = 0
    for number, h in enumerate(hunks, 1):
        old_at = offset(h.old_start, h.old_count)
        where = f"patch line {h.patch_line} ({path}): hunk {h.header}"
        if old_at < old_end:
            raise PatchError(f"{where} overlaps or precedes the hunk before it")
        if offset(h.new_start, h.new_count) != old_at + delta:
            raise PatchError(f"{where} has a new start that the hunks before it do not give")
        if number < len(hunks) and (h.old_missing_newline or h.new_missing_newline):
            raise PatchError(f"{where} has {NO_NEWLINE} but is not the last hunk")
        old_end = old_at + h.old_count
        delta += h.new_count - h.old_count


@dataclass
class _Body:
    """A hunk body being read (private, mutable while parsing)."""

    old_left: int
    new_left: int
    lines: list[tuple[str, bytes]] = field(default_factory=list)
    ended: set[str] = field(default_factory=set)  # sides ("-", "+") closed by a marker


def parse_hunk(cur: Cursor, path: str) -> Hunk:
    start = cur.lineno
    header = cur.take()
    match = _HUNK_HEADER.match(header)
    if match is None:
        raise fail(start, path, f"malformed hunk header {header!r}")
    old_start, old_count, new_start, new_count = (int(g or 1) for g in match.groups())
    body = _Body(old_count, new_count)
    while body.old_left or body.new_left:
        _take_body_line(cur, body, path, f"hunk {header!r} at line {start}")
    while (line := cur.peek()) is not None and line.startswith("\\"):
        _mark_no_newline(body, cur.lineno, path)
        cur.take()
    line = cur.peek()
    if (
        line is not None
        and line[:1] in (" ", "-", "+")
        and not at_file_header(cur)
        and not noise.is_signature(line, cur.peek(1))
    ):
        raise fail(
            cur.lineno, path, f"hunk {header!r} at line {start} has more lines than its header says"
        )
    ended = ("-" in body.ended, "+" in body.ended)
    return Hunk(old_start, old_count, new_start, new_count, tuple(body.lines), *ended, start)


def _take_body_line(cur: Cursor, body: _Body, path: str, hunk: str) -> None:
    lineno = cur.lineno
    line = cur.peek()
    if line is None or line.startswith(("diff --git ", "@@")):
        missing = f"{body.old_left} old and {body.new_left} new line(s) missing"
        raise fail(lineno, path, f"{hunk} ends early: {missing}")
    if line.startswith("\\"):
        _mark_no_newline(body, lineno, path)
        cur.take()
        return
    origin = line[:1] or " "  # an empty line is empty context whose space an editor stripped
    if origin not in _ORIGINS:
        raise fail(lineno, path, f"unexpected line inside {hunk}: {line!r}")
    if (origin != "+" and not body.old_left) or (origin != "-" and not body.new_left):
        side = "old" if origin != "+" and not body.old_left else "new"
        raise fail(lineno, path, f"{hunk} has more {side} lines than its header says")
    if ({origin} | ({"-", "+"} if origin == " " else set())) & body.ended:
        raise fail(lineno, path, f"line after {NO_NEWLINE} in {hunk}")
    body.lines.append((origin, line[1:].encode("utf-8", "surrogateescape")))
    body.old_left -= origin != "+"
    body.new_left -= origin != "-"
    cur.take()


def _mark_no_newline(body: _Body, lineno: int, path: str) -> None:
    if not body.lines:
        raise fail(lineno, path, f"{NO_NEWLINE} before any hunk line")
    origin = body.lines[-1][0]
    sides = {"-", "+"} if origin == " " else {origin}
    if sides & body.ended:
        raise fail(lineno, path, f"repeated {NO_NEWLINE}")
    body.ended |= sides


class Cursor:
    """The patch's lines (split on \\n only) and a read position."""

    def __init__(self, text: str) -> None:
        self._lines = text.split("\n")
        if self._lines[-1] == "":
            self._lines.pop()
        self._index = 0

    @property
    def lineno(self) -> int:
        return self._index + 1

    def peek(self, ahead: int = 0) -> str | None:
        index = self._index + ahead
        return self._lines[index] if 0 <= index < len(self._lines) else None

    def take(self) -> str:
        line = self.peek()
        if line is None:
            raise fail(self.lineno, None, "unexpected end of patch")
        self._index += 1
        return line


def at_plain_header(cur: Cursor) -> bool:
    line, after = cur.peek(), cur.peek(1)
    return bool(line and after and line.startswith("--- ") and after.startswith("+++ "))


def at_file_header(cur: Cursor) -> bool:
    line = cur.peek()
    return bool(line and line.startswith("diff --git ")) or at_plain_header(cur)
