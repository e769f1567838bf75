"""The trailers of a commit message exactly as libgit2's ``git_message_trailers`` finds
them (what pygit2's ``Commit.message_trailers`` returns), in pure Python.

A line-for-line port of libgit2's ``trailer.c`` (git's own rules: the last paragraph,
the 25% rule when a Git-generated trailer is present, continuation lines, comment and
``Conflicts:`` lines, a patch after ``---``). It lets ``gitrun status`` read write
commits without pygit2 (issue #15); ``tests/test_gitread.py`` holds it to pygit2's
answer on generated messages. C strings end at NUL: :func:`message_trailers` takes a
message without one.
"""

from __future__ import annotations

_SPACE = frozenset(b" \t\n\f\r\v")
_GENERATED = (b"Signed-off-by: ", b"(cherry picked from commit ")
_COMMENT = ord("#")
_NL = ord("\n")
_BLANK = (ord(" "), ord("\t"))


def _isalnum(c: int) -> bool:
    return 48 <= c <= 57 or 65 <= c <= 90 or 97 <= c <= 122


class _Buf:
    """A NUL-terminated C string: reading at or past the end gives 0."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.n = len(data)

    def at(self, i: int) -> int:
        return self.data[i] if i < self.n else 0

    def next_line(self, i: int) -> int:
        nl = self.data.find(b"\n", i)
        return self.n if nl < 0 else nl + 1

    def is_blank_line(self, i: int) -> bool:
        while (c := self.at(i)) and c != _NL and c in _SPACE:
            i += 1
        return self.at(i) in (0, _NL)

    def has_separator(self, i: int) -> bool:
        """``find_separator`` found ':' at a position >= 1 (libgit2's test of a trailer)."""
        start, whitespace = i, False
        while c := self.at(i):
            if c == ord(":"):
                return i - start >= 1
            if not whitespace and (_isalnum(c) or c == ord("-")):
                i += 1
                continue
            if i != start and c in (ord(" "), ord("\t")):
                whitespace = True
                i += 1
                continue
            break
        return False


def _last_line(buf: _Buf, length: int) -> int | None:
    """The start of the last line of ``buf[:length]`` (None when empty)."""
    if length == 0:
        return None
    nl = buf.data.rfind(b"\n", 1, length - 1)  # the last byte is not looked at
    return 0 if nl < 0 else nl + 1


def _ignore_non_trailer(buf: _Buf, length: int) -> int:
    boc = bol = 0
    in_conflicts = False
    while bol < length:
        nl = buf.data.find(b"\n", bol, length)
        nxt = length if nl < 0 else nl + 1
        c = buf.at(bol)
        if c in (_COMMENT, _NL):
            if not boc:
                boc = bol
        elif buf.data.startswith(b"Conflicts:\n", bol):
            in_conflicts = True
            if not boc:
                boc = bol
        elif in_conflicts and c == ord("\t"):
            pass
        elif boc:
            boc, in_conflicts = 0, False
        bol = nxt
    return length - boc if boc else 0


def _patch_start(buf: _Buf) -> int:
    s = 0
    while buf.at(s):
        if buf.data.startswith(b"---", s) and buf.at(s + 3) in _SPACE:
            return s
        s = buf.next_line(s)
    return s


def _trailer_start(buf: _Buf, length: int) -> int:
    s = 0
    while s < length:
        if buf.at(s) != _COMMENT and buf.is_blank_line(s):
            break
        s = buf.next_line(s)
    end_of_title = s
    only_spaces, recognized = True, False
    trailer_lines = non_trailer_lines = continuation = 0
    line = _last_line(buf, length)
    while line is not None and line >= end_of_title:
        here, line = line, _last_line(buf, line)
        if buf.at(here) == _COMMENT:
            non_trailer_lines += continuation
            continuation = 0
            continue
        if buf.is_blank_line(here):
            if only_spaces:
                continue
            non_trailer_lines += continuation
            if (recognized and trailer_lines * 3 >= non_trailer_lines) or (
                trailer_lines and not non_trailer_lines
            ):
                return buf.next_line(here)
            return length
        only_spaces = False
        if any(buf.data.startswith(p, here) for p in _GENERATED):
            trailer_lines += 1
            continuation = 0
            recognized = True
            continue
        if buf.has_separator(here) and buf.at(here) not in _SPACE:
            trailer_lines += 1
            continuation = 0
        elif buf.at(here) in _SPACE:
            continuation += 1
        else:
            non_trailer_lines += 1 + continuation
            continuation = 0
    return length


def trailer_block(message: bytes) -> bytes:
    """The trailer block libgit2 extracts from ``message`` (``extract_trailer_block``)."""
    buf = _Buf(message)
    patch = _patch_start(buf)
    end = patch - _ignore_non_trailer(buf, patch)
    start = _trailer_start(buf, end)
    return message[start:end]


def parse_trailers(message: bytes) -> list[tuple[bytes, bytes]]:
    """Every (key, value) libgit2 parses from ``message``'s trailer block, in order
    (its state machine: a key of letters, digits and '-', blanks, ':', blanks, then a
    value running on over lines that start with a space)."""
    b = _Buf(trailer_block(message))
    out: list[tuple[bytes, bytes]] = []
    p = 0
    while b.at(p):
        key = p
        key_end, p = _separator(b, p)
        if key_end is None:  # not a trailer line: skip past its newline
            if not b.at(p):
                break
            nl = b.data.find(b"\n", p)
            if nl < 0:
                break
            p = nl + 1
            continue
        while b.at(p) in _BLANK:
            p += 1
        if not b.at(p):
            break
        value = p
        p, end = _value_end(b, p + 1)  # the value's first byte is taken as it is
        out.append((b.data[key:key_end], b.data[value:end]))
    return out


def _separator(b: _Buf, p: int) -> tuple[int | None, int]:
    """(end of the key, position after its ':') for a key at ``p``; (None, where the
    line stopped being a trailer) otherwise."""
    while _isalnum(c := b.at(p)) or c == ord("-"):
        p += 1
    if c == ord(":"):
        return p, p + 1
    if c in _BLANK:
        key_end = p
        while b.at(p) in _BLANK:
            p += 1
        if b.at(p) == ord(":"):
            return key_end, p + 1
    return None, p


def _value_end(b: _Buf, p: int) -> tuple[int, int]:
    """(where the next trailer starts, where this value ends) for a value read on at ``p``."""
    while True:
        c = b.at(p)
        if not c:
            return p, p
        p += 1
        if c == _NL:
            if b.at(p) == ord(" "):
                p += 1
                continue
            return p, p - 1


def message_trailers(message: bytes) -> dict[str, str]:
    """pygit2's ``message_trailers`` of a commit without an encoding header: keys as
    text, values decoded as UTF-8 with replacement, a repeated key's last value kept."""
    return {k.decode(): v.decode("utf-8", "replace") for k, v in parse_trailers(message)}


__all__ = ["message_trailers", "parse_trailers", "trailer_block"]
