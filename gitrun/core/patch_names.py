"""Path names in a unified diff's headers: git's C quoting, the ``a/``/``b/`` prefixes and
the two names of a ``diff --git`` line.

Pure, like :mod:`gitrun.core.patch`, its caller: a name that is unsafe (``..``, ``.git``, a
control character, not UTF-8) is refused here, before any hunk is read.
"""

from __future__ import annotations

import re

from gitrun.core.errors import PatchError

__all__ = ["fail", "parse_name", "parse_side", "split_git_names"]

_OCTAL = re.compile(r"[0-3][0-7]{2}")
_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}


def split_git_names(rest: str, lineno: int) -> tuple[str, str] | None:
    """The two names of a ``diff --git`` line; None when unquoted names with spaces are
    ambiguous (the ``---``/``+++`` or ``rename`` lines must then say)."""
    if rest.startswith('"'):
        first, tail = _unquote(rest, lineno)
        if not tail.startswith(" "):
            raise fail(lineno, None, f"malformed 'diff --git' line: {rest!r}")
        return _strip(first, "a/", lineno), parse_name(tail[1:], "b/", lineno)
    if ' "' in rest:
        first, second = rest.split(' "', 1)
        return parse_name(first, "a/", lineno), parse_name('"' + second, "b/", lineno)
    size = (len(rest) - 1) // 2
    if rest[size : size + 1] == " " and rest[2:size] == rest[size + 3 :]:
        return parse_name(rest[:size], "a/", lineno), parse_name(rest[size + 1 :], "b/", lineno)
    if rest.count(" b/") == 1:
        first, second = rest.split(" b/")
        return parse_name(first, "a/", lineno), parse_name("b/" + second, "b/", lineno)
    return None


def parse_side(raw: str, prefix: str | None, lineno: int) -> str | None:
    """The path of a ``---``/``+++`` line; None for ``/dev/null``."""
    if raw.split("\t", 1)[0] == "/dev/null":
        return None
    return parse_name(raw, prefix, lineno)


def parse_name(raw: str, prefix: str | None, lineno: int) -> str:
    """A path as git writes it: C-quoted or bare, a trailing tab (and timestamp) ignored."""
    if raw.startswith('"'):
        name, rest = _unquote(raw, lineno)
        if rest and not rest.startswith("\t"):
            raise fail(lineno, None, f"text after a quoted path: {raw!r}")
        return _strip(name, prefix, lineno)
    name = raw.split("\t", 1)[0]
    if name.endswith("\r"):
        raise fail(lineno, None, f"path {name!r} ends in a carriage return (CRLF-mangled patch?)")
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in name):
        raise fail(lineno, None, f"unquoted path {name!r} holds a control character")
    if any(0xD800 <= ord(char) <= 0xDFFF for char in name):
        raise fail(lineno, None, f"path {name!r} is not UTF-8")
    return _strip(name, prefix, lineno)


def _strip(name: str, prefix: str | None, lineno: int) -> str:
    """``name`` without ``prefix`` (None: without its first directory, as ``-p1`` does)."""
    if prefix is None:
        if "/" not in name:
            raise fail(lineno, None, f"path {name!r} has no leading directory to strip (-p1)")
        prefix = name[: name.index("/") + 1]
    if not name.startswith(prefix):
        raise fail(lineno, None, f"path {name!r} lacks the {prefix!r} prefix")
    path = name[len(prefix) :]
    parts = path.split("/")
    if "\0" in path or any(p in ("", ".", "..") or p.casefold() == ".git" for p in parts):
        raise fail(lineno, None, f"unsafe path {path!r}")
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
            raise fail(lineno, None, f"bad escape in quoted path {raw!r}")
    raise fail(lineno, None, f"unterminated quoted path {raw!r}")


def _decode_path(raw: bytes, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise fail(lineno, None, f"path {raw!r} is not UTF-8") from None


def fail(lineno: int, path: str | None, what: str) -> PatchError:
    """The error for ``what`` at patch line ``lineno`` (and ``path``, when known)."""
    where = f"patch line {lineno}" + (f" ({path})" if path else "")
    return PatchError(f"{where}: {what}")
