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

from gitrun.core import patch_noise as noise
from gitrun.core.errors import PatchError
from gitrun.core.patch_hunks import (
    NO_NEWLINE,
    Cursor,
    Hunk,
    at_plain_header,
    check_hunk_positions,
    offset,
    parse_hunk,
)
from gitrun.core.patch_names import fail, parse_name, parse_side, split_git_names

__all__ = [
    "FilePatch",
    "Hunk",
    "apply_file_patch",
    "changed_line_count",
    "parse_patch",
    "touched_paths",
]

_MODES = frozenset({0o100644, 0o100755, 0o120000})
_GITLINK = 0o160000
_INDEX = re.compile(r"[0-9a-f]+\.\.[0-9a-f]+(?: ([0-7]+))?")
_EXTENDED = re.compile(
    r"(old mode|new mode|deleted file mode|new file mode|rename from|rename to|copy from"
    r"|copy to|similarity index|dissimilarity index|index) (.*)"
)


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
        check_hunk_positions(self.hunks, self.path)

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
    cur = Cursor(text)
    patches: list[FilePatch] = []
    while (line := cur.peek()) is not None:
        if line.startswith("diff --git "):
            patches.append(_parse_git_patch(cur))
        elif at_plain_header(cur):
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


def _opens_mail_text(cur: Cursor, line: str, *, after_patch: bool) -> bool:
    """A mail header (or, after a file patch, a signature) whose text git apply skips."""
    if after_patch:
        return noise.is_mail_start(line) or noise.is_signature(line, cur.peek(1))
    at_top = all(not (cur.peek(-back) or "").strip() for back in range(1, cur.lineno))
    return noise.starts_preamble(line, at_top=at_top)


def _skip_until_patch(cur: Cursor) -> None:
    """Skip a mail's header and message (or a signature) up to the next file patch."""
    cur.take()
    while (line := cur.peek()) is not None:
        if line.startswith("diff --git ") or noise.is_mail_start(line):
            return
        if at_plain_header(cur) and (cur.peek(2) or "").startswith("@@ -"):
            return  # git apply's rule: a ---/+++ pair starts a patch only before a hunk
        cur.take()


def _reject_stray(line: str, lineno: int) -> None:
    _reject_binary(line, lineno, None)
    if noise.is_combined_diff(line):
        raise fail(lineno, None, "combined (merge) diffs are not supported")
    if noise.is_only_in(line):
        raise fail(
            lineno,
            None,
            f"{line!r}: the diff was made without -N, so it leaves files out; "
            "make it with diff -ruN",
        )
    raise fail(lineno, None, f"unexpected line outside a file patch: {line!r}")


def apply_file_patch(old: bytes | None, fp: FilePatch) -> bytes | None:
    """Apply ``fp`` to the old bytes (None: the file is absent); None means deleted."""
    _check_presence(old, fp)
    lines = _split_lines(old or b"")
    out: list[bytes] = []
    done = 0
    for number, hunk in enumerate(fp.hunks, 1):
        at = offset(hunk.old_start, hunk.old_count)
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


def _parse_git_patch(cur: Cursor) -> FilePatch:
    h = _Header(cur.lineno)
    h.git_names = split_git_names(cur.take()[len("diff --git ") :], h.line)
    while (line := cur.peek()) is not None and (extended := _EXTENDED.fullmatch(line)):
        _read_extended(h, extended.group(1), extended.group(2), cur.lineno)
        cur.take()
    line = cur.peek()
    if line is not None:
        _reject_binary(line, cur.lineno, h.display())
    if line is not None and line.startswith("--- "):
        _read_sides(cur, h)
    elif line is not None and line.startswith("@@"):
        raise fail(cur.lineno, h.display(), "hunk without a '---'/'+++' header")
    return _build(h, _read_hunks(cur, h) if h.sides else ())


def _parse_plain_patch(cur: Cursor) -> FilePatch:
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
            h.rename_from = parse_name(value, "", lineno)
        case "rename to":
            h.rename_to = parse_name(value, "", lineno)
        case "copy from" | "copy to":
            raise fail(lineno, h.display(), "copies are not supported")
        case "index":
            index = _INDEX.fullmatch(value.strip())
            if index is None:
                raise fail(lineno, h.display(), f"malformed index line {value!r}")
            if index.group(1) is not None and h.old_mode is None:
                h.old_mode = _mode(index.group(1), lineno)


def _read_sides(cur: Cursor, h: _Header, *, plain: bool = False) -> None:
    """The ``---``/``+++`` pair. A plain diff's names lose their first directory, whatever
    it is (``git apply -p1``), and an epoch-dated side is an absent file (GNU ``diff -N``)."""
    lineno = cur.lineno
    minus = cur.take()
    plus = cur.peek()
    if plus is None or not plus.startswith("+++ "):
        raise fail(lineno + 1, h.display(), "'---' line not followed by a '+++' line")
    cur.take()
    h.sides = True
    h.minus = parse_side(minus[4:], None if plain else "a/", lineno)
    h.plus = parse_side(plus[4:], None if plain else "b/", lineno + 1)
    if plain and h.minus is not None and h.plus is not None:
        if noise.side_is_epoch(minus[4:]):
            h.minus = None
        elif noise.side_is_epoch(plus[4:]):
            h.plus = None


def _read_hunks(cur: Cursor, h: _Header) -> tuple[Hunk, ...]:
    hunks: list[Hunk] = []
    while (line := cur.peek()) is not None and line.startswith("@@"):
        hunks.append(parse_hunk(cur, h.display()))
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
        raise fail(h.line, h.display(), problem)
    old_path = None if create else old_name
    new_path = None if delete else new_name
    return FilePatch(old_path, new_path, hunks, h.new_mode, h.old_mode, h.line)


def _agree(label: str, names: Iterable[str | None], h: _Header) -> str | None:
    distinct = sorted({n for n in names if n is not None})
    if len(distinct) > 1:
        raise fail(h.line, h.display(), f"the headers disagree on the {label} path: {distinct}")
    return distinct[0] if distinct else None


def _check_each_path_once(patches: Sequence[FilePatch]) -> None:
    seen: dict[str, int] = {}
    for fp in patches:
        for path in sorted({p for p in (fp.old_path, fp.new_path) if p is not None}):
            if path in seen:
                first = f"first at patch line {seen[path]}"
                raise fail(fp.patch_line, path, f"{path} is patched twice ({first})")
            seen[path] = fp.patch_line


def _mode(value: str, lineno: int) -> int:
    text = value.strip()
    mode = int(text, 8) if text and set(text) <= set("01234567") else None
    if mode == _GITLINK:
        raise fail(lineno, None, "submodule (gitlink) changes are not supported")
    if mode not in _MODES:
        raise fail(lineno, None, f"unsupported file mode {text!r}")
    return mode


def _reject_binary(line: str, lineno: int, path: str | None) -> None:
    if line.startswith(("GIT binary patch", "Binary files ")):
        raise fail(lineno, path, "binary patches are not supported")


# --- applying -------------------------------------------------------------------------


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
                f"and join the next line ({NO_NEWLINE} not at the end of the file)"
            )


def _show(line: bytes) -> str:
    text = repr(line)
    return text if len(text) <= 60 else text[:57] + "..."
