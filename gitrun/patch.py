"""Parse unified diffs as ``git diff`` writes them and apply them strictly, one file at a time.

Pure: no I/O and no git. The runtime builds a new tree from the parent tree by handing each
touched blob's bytes to :func:`apply_file_patch`. Application is strict on purpose: every
context and removed line must match the old bytes exactly at the stated line (no fuzz, no
offset search), so a patch written against some other tree is refused, never guessed at.

Hunk content is bytes: the patch text is encoded back with UTF-8 and ``surrogateescape``, so
a caller that decoded ``git diff`` output with ``surrogateescape`` gets non-UTF-8 lines back
byte-exactly. Lines split on ``\\n`` only, so CRLF content keeps its ``\\r``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gitrun import patch_noise as noise
from gitrun.errors import PatchError

__all__ = [
    "FilePatch",
    "Hunk",
    "apply_file_patch",
    "changed_line_count",
    "parse_patch",
    "touched_paths",
]

_ORIGINS = frozenset(" -+")
_MODES = frozenset({0o100644, 0o100755, 0o120000})
_GITLINK = 0o160000
_HUNK_HEADER = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(?: |$)")
_INDEX = re.compile(r"[0-9a-f]+\.\.[0-9a-f]+(?: ([0-7]+))?")
_OCTAL = re.compile(r"[0-3][0-7]{2}")
_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}
_EXTENDED = re.compile(
    r"(old mode|new mode|deleted file mode|new file mode|rename from|rename to|copy from"
    r"|copy to|similarity index|dissimilarity index|index) (.*)"
)
_NO_NEWLINE = "'\\ No newline at end of file'"


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


@dataclass(frozen=True)
class FilePatch:
    """Every change a patch makes to one path: create, delete, rename, mode and/or hunks."""

    old_path: str | None  # None when the file is created
    new_path: str | None  # None when the file is deleted
    hunks: tuple[Hunk, ...]
    new_mode: int | None = None  # from "new file mode" / "new mode"
    old_mode: int | None = None  # from "old mode" / "deleted file mode" / the index line
    patch_line: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.old_path is None and self.new_path is None:
            raise PatchError(f"patch line {self.patch_line}: a file patch needs a path")
        _check_hunk_positions(self.hunks, self.path)

    @property
    def path(self) -> str:
        """The path this patch writes: the new path, or the old one for a delete."""
        path = self.new_path if self.new_path is not None else self.old_path
        if path is None:  # unreachable: __post_init__ refuses it
            raise PatchError("a file patch needs a path")
        return path

    @property
    def is_rename(self) -> bool:
        return None not in (self.old_path, self.new_path) and self.old_path != self.new_path


def parse_patch(text: str | bytes) -> tuple[FilePatch, ...]:
    """Parse ``git diff`` output (or a plain ``---``/``+++`` diff, ``git format-patch``
    mail, ``diff -ruN`` output) into file patches. Bytes are taken exactly as they are."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    cur = _Cursor(text)
    patches: list[FilePatch] = []
    while (line := cur.peek()) is not None:
        if line.startswith("diff --git "):
            patches.append(_parse_git_patch(cur))
        elif _at_plain_header(cur):
            patches.append(_parse_plain_patch(cur))
        elif not line.strip() or noise.is_diff_command(line):
            cur.take()
        elif _opens_mail_text(cur, line, after_patch=bool(patches)):
            _skip_until_patch(cur)
        else:
            _reject_stray(line, cur.lineno)
    if not patches:
        raise PatchError("the patch is empty: it holds no file patches")
    _check_each_path_once(patches)
    return tuple(patches)


def _opens_mail_text(cur: _Cursor, line: str, *, after_patch: bool) -> bool:
    """A mail header (or, after a file patch, a signature) whose text git apply skips."""
    if after_patch:
        return noise.is_mail_start(line) or noise.is_signature(line, cur.peek(1))
    at_top = all(not (cur.peek(-back) or "").strip() for back in range(1, cur.lineno))
    return noise.starts_preamble(line, at_top=at_top)


def _skip_until_patch(cur: _Cursor) -> None:
    """Skip a mail's header and message (or a signature) up to the next file patch."""
    cur.take()
    while (line := cur.peek()) is not None:
        if line.startswith("diff --git ") or noise.is_mail_start(line):
            return
        if _at_plain_header(cur) and (cur.peek(2) or "").startswith("@@ -"):
            return  # git apply's rule: a ---/+++ pair starts a patch only before a hunk
        cur.take()


def _reject_stray(line: str, lineno: int) -> None:
    _reject_binary(line, lineno, None)
    if noise.is_combined_diff(line):
        raise _fail(lineno, None, "combined (merge) diffs are not supported")
    if noise.is_only_in(line):
        raise _fail(
            lineno,
            None,
            f"{line!r}: the diff was made without -N, so it leaves files out; "
            "make it with diff -ruN",
        )
    raise _fail(lineno, None, f"unexpected line outside a file patch: {line!r}")


def apply_file_patch(old: bytes | None, fp: FilePatch) -> bytes | None:
    """Apply ``fp`` to the old bytes (None: the file is absent); None means deleted."""
    _check_presence(old, fp)
    lines = _split_lines(old or b"")
    out: list[bytes] = []
    done = 0
    for number, hunk in enumerate(fp.hunks, 1):
        at = _offset(hunk.old_start, hunk.old_count)
        expected = hunk.old_side()
        _match(lines, at, expected, fp, number)
        out += lines[done:at]
        out += hunk.new_side()
        done = at + len(expected)
    out += lines[done:]
    _check_no_joined_lines(out, fp)
    if fp.new_path is not None:
        return b"".join(out)
    if out:
        raise PatchError(f"{fp.path}: the patch deletes the file but leaves {len(out)} line(s)")
    return None


def touched_paths(patches: Sequence[FilePatch]) -> tuple[str, ...]:
    """Every old and new path the patches touch, sorted and unique."""
    paths = {p for fp in patches for p in (fp.old_path, fp.new_path) if p is not None}
    return tuple(sorted(paths))


def changed_line_count(patches: Sequence[FilePatch]) -> int:
    """How many lines the patches add or remove."""
    return sum(o != " " for fp in patches for h in fp.hunks for o, _ in h.lines)


# --- hunks ------------------------------------------------------------------------------


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
        (h.old_missing_newline and not olds, f"{_NO_NEWLINE} on an empty old side"),
        (h.new_missing_newline and not news, f"{_NO_NEWLINE} on an empty new side"),
    )
    return next((message for bad, message in checks if bad), None)


def _offset(start: int, count: int) -> int:
    """0-based index of a hunk side: an empty side's start names the line before it."""
    return start - 1 if count else start


def _check_hunk_positions(hunks: Sequence[Hunk], path: str) -> None:
    old_end = 0
    delta = 0
    for number, h in enumerate(hunks, 1):
        old_at = _offset(h.old_start, h.old_count)
        where = f"patch line {h.patch_line} ({path}): hunk {h.header}"
        if old_at < old_end:
            raise PatchError(f"{where} overlaps or precedes the hunk before it")
        if _offset(h.new_start, h.new_count) != old_at + delta:
            raise PatchError(f"{where} has a new start that the hunks before it do not give")
        if number < len(hunks) and (h.old_missing_newline or h.new_missing_newline):
            raise PatchError(f"{where} has {_NO_NEWLINE} but is not the last hunk")
        old_end = old_at + h.old_count
        delta += h.new_count - h.old_count


@dataclass
class _Body:
    """A hunk body being read (private, mutable while parsing)."""

    old_left: int
    new_left: int
    lines: list[tuple[str, bytes]] = field(default_factory=list)
    ended: set[str] = field(default_factory=set)  # sides ("-", "+") closed by a marker


def _parse_hunk(cur: _Cursor, path: str) -> Hunk:
    start = cur.lineno
    header = cur.take()
    match = _HUNK_HEADER.match(header)
    if match is None:
        raise _fail(start, path, f"malformed hunk header {header!r}")
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
        and not _at_file_header(cur)
        and not noise.is_signature(line, cur.peek(1))
    ):
        raise _fail(
            cur.lineno, path, f"hunk {header!r} at line {start} has more lines than its header says"
        )
    ended = ("-" in body.ended, "+" in body.ended)
    return Hunk(old_start, old_count, new_start, new_count, tuple(body.lines), *ended, start)


def _take_body_line(cur: _Cursor, body: _Body, path: str, hunk: str) -> None:
    lineno = cur.lineno
    line = cur.peek()
    if line is None or line.startswith(("diff --git ", "@@")):
        missing = f"{body.old_left} old and {body.new_left} new line(s) missing"
        raise _fail(lineno, path, f"{hunk} ends early: {missing}")
    if line.startswith("\\"):
        _mark_no_newline(body, lineno, path)
        cur.take()
        return
    origin = line[:1] or " "  # an empty line is empty context whose space an editor stripped
    if origin not in _ORIGINS:
        raise _fail(lineno, path, f"unexpected line inside {hunk}: {line!r}")
    if (origin != "+" and not body.old_left) or (origin != "-" and not body.new_left):
        side = "old" if origin != "+" and not body.old_left else "new"
        raise _fail(lineno, path, f"{hunk} has more {side} lines than its header says")
    if ({origin} | ({"-", "+"} if origin == " " else set())) & body.ended:
        raise _fail(lineno, path, f"line after {_NO_NEWLINE} in {hunk}")
    body.lines.append((origin, line[1:].encode("utf-8", "surrogateescape")))
    body.old_left -= origin != "+"
    body.new_left -= origin != "-"
    cur.take()


def _mark_no_newline(body: _Body, lineno: int, path: str) -> None:
    if not body.lines:
        raise _fail(lineno, path, f"{_NO_NEWLINE} before any hunk line")
    origin = body.lines[-1][0]
    sides = {"-", "+"} if origin == " " else {origin}
    if sides & body.ended:
        raise _fail(lineno, path, f"repeated {_NO_NEWLINE}")
    body.ended |= sides


# --- file patches -----------------------------------------------------------------------


@dataclass
class _Header:
    """What a file patch's header lines said (private, mutable while parsing)."""

    line: int
    git_names: tuple[str, str] | None = None
    sides: bool = False  # saw a ---/+++ pair
    minus: str | None = None  # None: /dev/null (or no --- line)
    plus: str | None = None
    rename_from: str | None = None
    rename_to: str | None = None
    new_file: bool = False
    deleted: bool = False
    old_mode: int | None = None
    new_mode: int | None = None

    def display(self) -> str:
        names = (self.plus, self.minus, self.rename_to, *(self.git_names or ()))
        return next((n for n in names if n is not None), "?")


def _parse_git_patch(cur: _Cursor) -> FilePatch:
    h = _Header(cur.lineno)
    h.git_names = _split_git_names(cur.take()[len("diff --git ") :], h.line)
    while (line := cur.peek()) is not None and (extended := _EXTENDED.fullmatch(line)):
        _read_extended(h, extended.group(1), extended.group(2), cur.lineno)
        cur.take()
    line = cur.peek()
    if line is not None:
        _reject_binary(line, cur.lineno, h.display())
    if line is not None and line.startswith("--- "):
        _read_sides(cur, h)
    elif line is not None and line.startswith("@@"):
        raise _fail(cur.lineno, h.display(), "hunk without a '---'/'+++' header")
    return _build(h, _read_hunks(cur, h) if h.sides else ())


def _parse_plain_patch(cur: _Cursor) -> FilePatch:
    h = _Header(cur.lineno)
    _read_sides(cur, h, plain=True)
    return _build(h, _read_hunks(cur, h))


def _read_extended(h: _Header, key: str, value: str, lineno: int) -> None:
    match key:
        case "old mode":
            h.old_mode = _mode(value, lineno)
        case "new mode":
            h.new_mode = _mode(value, lineno)
        case "deleted file mode":
            h.deleted, h.old_mode = True, _mode(value, lineno)
        case "new file mode":
            h.new_file, h.new_mode = True, _mode(value, lineno)
        case "rename from":
            h.rename_from = _parse_name(value, "", lineno)
        case "rename to":
            h.rename_to = _parse_name(value, "", lineno)
        case "copy from" | "copy to":
            raise _fail(lineno, h.display(), "copies are not supported")
        case "index":
            index = _INDEX.fullmatch(value.strip())
            if index is None:
                raise _fail(lineno, h.display(), f"malformed index line {value!r}")
            if index.group(1) is not None and h.old_mode is None:
                h.old_mode = _mode(index.group(1), lineno)


def _read_sides(cur: _Cursor, h: _Header, *, plain: bool = False) -> None:
    """The ``---``/``+++`` pair. A plain diff's names lose their first directory, whatever
    it is (``git apply -p1``), and an epoch-dated side is an absent file (GNU ``diff -N``)."""
    lineno = cur.lineno
    minus = cur.take()
    plus = cur.peek()
    if plus is None or not plus.startswith("+++ "):
        raise _fail(lineno + 1, h.display(), "'---' line not followed by a '+++' line")
    cur.take()
    h.sides = True
    h.minus = _parse_side(minus[4:], None if plain else "a/", lineno)
    h.plus = _parse_side(plus[4:], None if plain else "b/", lineno + 1)
    if plain and h.minus is not None and h.plus is not None:
        if noise.side_is_epoch(minus[4:]):
            h.minus = None
        elif noise.side_is_epoch(plus[4:]):
            h.plus = None


def _read_hunks(cur: _Cursor, h: _Header) -> tuple[Hunk, ...]:
    hunks: list[Hunk] = []
    while (line := cur.peek()) is not None and line.startswith("@@"):
        hunks.append(_parse_hunk(cur, h.display()))
    return tuple(hunks)


def _build(h: _Header, hunks: tuple[Hunk, ...]) -> FilePatch:
    git_old, git_new = h.git_names or (None, None)
    old_name = _agree("old", (h.minus, h.rename_from, git_old), h)
    new_name = _agree("new", (h.plus, h.rename_to, git_new), h)
    create = h.new_file or (h.sides and h.minus is None)
    delete = h.deleted or (h.sides and h.plus is None)
    rename = h.rename_from is not None or h.rename_to is not None
    moded = h.new_mode is not None and h.new_mode != h.old_mode
    checks = (
        (create and delete, "the file patch both creates and deletes its file"),
        (h.new_file and h.minus is not None, "'new file mode' but '---' names a file"),
        (
            h.deleted and h.sides and h.plus is not None,
            "'deleted file mode' but '+++' names a file",
        ),
        ((h.rename_from is None) != (h.rename_to is None), "'rename from'/'rename to' unpaired"),
        (rename and (create or delete), "a rename cannot also create or delete"),
        (old_name is None and not create, "cannot tell the old path"),
        (new_name is None and not delete, "cannot tell the new path"),
        (rename and old_name == new_name, "renames a path to itself"),
        (
            not (rename or create or delete) and old_name != new_name,
            f"old path {old_name!r} and new path {new_name!r} differ without a rename",
        ),
        (h.sides and not hunks, "'---'/'+++' header without any hunk"),
        (not (hunks or create or delete or rename or moded), "the file patch changes nothing"),
    )
    problem = next((message for bad, message in checks if bad), None)
    if problem is not None:
        raise _fail(h.line, h.display(), problem)
    old_path = None if create else old_name
    new_path = None if delete else new_name
    return FilePatch(old_path, new_path, hunks, h.new_mode, h.old_mode, h.line)


def _agree(label: str, names: Iterable[str | None], h: _Header) -> str | None:
    distinct = sorted({n for n in names if n is not None})
    if len(distinct) > 1:
        raise _fail(h.line, h.display(), f"the headers disagree on the {label} path: {distinct}")
    return distinct[0] if distinct else None


def _check_each_path_once(patches: Sequence[FilePatch]) -> None:
    seen: dict[str, int] = {}
    for fp in patches:
        for path in sorted({p for p in (fp.old_path, fp.new_path) if p is not None}):
            if path in seen:
                first = f"first at patch line {seen[path]}"
                raise _fail(fp.patch_line, path, f"{path} is patched twice ({first})")
            seen[path] = fp.patch_line


def _mode(value: str, lineno: int) -> int:
    text = value.strip()
    mode = int(text, 8) if text and set(text) <= set("01234567") else None
    if mode == _GITLINK:
        raise _fail(lineno, None, "submodule (gitlink) changes are not supported")
    if mode not in _MODES:
        raise _fail(lineno, None, f"unsupported file mode {text!r}")
    return mode


def _reject_binary(line: str, lineno: int, path: str | None) -> None:
    if line.startswith(("GIT binary patch", "Binary files ")):
        raise _fail(lineno, path, "binary patches are not supported")


# --- paths ------------------------------------------------------------------------------


def _split_git_names(rest: str, lineno: int) -> tuple[str, str] | None:
    """The two names of a ``diff --git`` line; None when unquoted names with spaces are
    ambiguous (the ``---``/``+++`` or ``rename`` lines must then say)."""
    if rest.startswith('"'):
        first, tail = _unquote(rest, lineno)
        if not tail.startswith(" "):
            raise _fail(lineno, None, f"malformed 'diff --git' line: {rest!r}")
        return _strip(first, "a/", lineno), _parse_name(tail[1:], "b/", lineno)
    if ' "' in rest:
        first, second = rest.split(' "', 1)
        return _parse_name(first, "a/", lineno), _parse_name('"' + second, "b/", lineno)
    size = (len(rest) - 1) // 2
    if rest[size : size + 1] == " " and rest[2:size] == rest[size + 3 :]:
        return _parse_name(rest[:size], "a/", lineno), _parse_name(rest[size + 1 :], "b/", lineno)
    if rest.count(" b/") == 1:
        first, second = rest.split(" b/")
        return _parse_name(first, "a/", lineno), _parse_name("b/" + second, "b/", lineno)
    return None


def _parse_side(raw: str, prefix: str | None, lineno: int) -> str | None:
    """The path of a ``---``/``+++`` line; None for ``/dev/null``."""
    if raw.split("\t", 1)[0] == "/dev/null":
        return None
    return _parse_name(raw, prefix, lineno)


def _parse_name(raw: str, prefix: str | None, lineno: int) -> str:
    """A path as git writes it: C-quoted or bare, a trailing tab (and timestamp) ignored."""
    if raw.startswith('"'):
        name, rest = _unquote(raw, lineno)
        if rest and not rest.startswith("\t"):
            raise _fail(lineno, None, f"text after a quoted path: {raw!r}")
        return _strip(name, prefix, lineno)
    name = raw.split("\t", 1)[0]
    if name.endswith("\r"):
        raise _fail(lineno, None, f"path {name!r} ends in a carriage return (CRLF-mangled patch?)")
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in name):
        raise _fail(lineno, None, f"unquoted path {name!r} holds a control character")
    if any(0xD800 <= ord(char) <= 0xDFFF for char in name):
        raise _fail(lineno, None, f"path {name!r} is not UTF-8")
    return _strip(name, prefix, lineno)


def _strip(name: str, prefix: str | None, lineno: int) -> str:
    """``name`` without ``prefix`` (None: without its first directory, as ``-p1`` does)."""
    if prefix is None:
        if "/" not in name:
            raise _fail(lineno, None, f"path {name!r} has no leading directory to strip (-p1)")
        prefix = name[: name.index("/") + 1]
    if not name.startswith(prefix):
        raise _fail(lineno, None, f"path {name!r} lacks the {prefix!r} prefix")
    path = name[len(prefix) :]
    parts = path.split("/")
    if "\0" in path or any(p in ("", ".", "..") or p.casefold() == ".git" for p in parts):
        raise _fail(lineno, None, f"unsafe path {path!r}")
    return path


def _unquote(raw: str, lineno: int) -> tuple[str, str]:
    """Undo git's C-style quoting of ``raw`` (which starts with a quote); also return the
    text after the closing quote."""
    out = bytearray()
    i = 1
    while i < len(raw):
        char = raw[i]
        if char == '"':
            return _decode_path(bytes(out), lineno), raw[i + 1 :]
        if char != "\\":
            out += char.encode("utf-8", "surrogateescape")
            i += 1
        elif raw[i + 1 : i + 2] in _ESCAPES:
            out.append(_ESCAPES[raw[i + 1]])
            i += 2
        elif _OCTAL.fullmatch(raw[i + 1 : i + 4]):
            out.append(int(raw[i + 1 : i + 4], 8))
            i += 4
        else:
            raise _fail(lineno, None, f"bad escape in quoted path {raw!r}")
    raise _fail(lineno, None, f"unterminated quoted path {raw!r}")


def _decode_path(raw: bytes, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _fail(lineno, None, f"path {raw!r} is not UTF-8") from None


# --- reading and applying ---------------------------------------------------------------


class _Cursor:
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
            raise _fail(self.lineno, None, "unexpected end of patch")
        self._index += 1
        return line


def _at_plain_header(cur: _Cursor) -> bool:
    line, after = cur.peek(), cur.peek(1)
    return bool(line and after and line.startswith("--- ") and after.startswith("+++ "))


def _at_file_header(cur: _Cursor) -> bool:
    line = cur.peek()
    return bool(line and line.startswith("diff --git ")) or _at_plain_header(cur)


def _fail(lineno: int, path: str | None, what: str) -> PatchError:
    where = f"patch line {lineno}" + (f" ({path})" if path else "")
    return PatchError(f"{where}: {what}")


def _check_presence(old: bytes | None, fp: FilePatch) -> None:
    where = f"{fp.path} (patch line {fp.patch_line})"
    if old is None and fp.old_path is not None:
        raise PatchError(f"{where}: the patch changes {fp.old_path}, which does not exist")
    if old is not None and fp.old_path is None:
        raise PatchError(f"{where}: the patch creates a file that already exists")


def _split_lines(data: bytes) -> list[bytes]:
    """Lines with their newlines; split on b"\\n" only, so b"\\r" stays in the line."""
    parts = data.split(b"\n")
    lines = [part + b"\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _match(lines: list[bytes], at: int, expected: list[bytes], fp: FilePatch, number: int) -> None:
    hunk = fp.hunks[number - 1]
    where = f"{fp.path}: hunk {number} {hunk.header} (patch line {hunk.patch_line})"
    if at > len(lines):
        raise PatchError(f"{where} starts after the end of the file ({len(lines)} lines)")
    for i, want in enumerate(expected):
        got = lines[at + i] if at + i < len(lines) else None
        if got == want:
            continue
        found = "the end of the file" if got is None else _show(got)
        hint = (
            " (only the newline at end of file differs)"
            if got and got.rstrip(b"\n") == want.rstrip(b"\n")
            else ""
        )
        raise PatchError(
            f"{where} does not match line {at + i + 1}: "
            f"the patch expects {_show(want)}, the file has {found}{hint}"
        )


def _check_no_joined_lines(out: list[bytes], fp: FilePatch) -> None:
    for number, line in enumerate(out[:-1], 1):
        if not line.endswith(b"\n"):
            raise PatchError(
                f"{fp.path} (patch line {fp.patch_line}): line {number} would lose its newline "
                f"and join the next line ({_NO_NEWLINE} not at the end of the file)"
            )


def _show(line: bytes) -> str:
    text = repr(line)
    return text if len(text) <= 60 else text[:57] + "..."
