"""Git's own name rules, pure: which paths git refuses to track and which names it
refuses in a ref. The gate refuses these before anything is checkpointed, so no name
gitrun accepted can make git (or libgit2) fail later, at the commit or in ``git gc``.

Paths: a port of ``verify_path()`` (git's ``read-cache.c``) with ``core.protectNTFS``
and ``core.protectHFS`` both on, as git's defaults are: ``verify_dotfile()`` there,
``is_ntfs_dotgit()`` and ``is_ntfs_dotgitmodules()`` from ``path.c``,
``is_hfs_dotgit()`` and ``is_hfs_dotgitmodules()`` from ``utf8.c``. Each step keeps
git's shape so the two can be read side by side; ``tests/test_git_names.py`` checks
the port against the real ``git`` on random names.

Hidden characters: control, zero-width and bidi code points, which the gate refuses in
paths by default (a reader sees another name than the one written).

Refs: the rules of ``git check-ref-format`` (``refs.c``, ``check_refname_component``)
for one component of a ref name gitrun builds from a user's name (a run id, a key).
"""

from __future__ import annotations

import unicodedata

MODE_FILE = 0o100644
MODE_LINK = 0o120000
MODE_DIR = 0o040000

# HFS+ drops these code points when it compares names (utf8.c, next_hfs_char).
HFS_IGNORED = frozenset(
    (0x200C, 0x200D, 0x200E, 0x200F, 0x202A, 0x202B, 0x202C, 0x202D, 0x202E,
     *range(0x206A, 0x2070), 0xFEFF)
)  # fmt: skip


def _at(name: bytes, i: int) -> int:
    """The byte at ``i``, 0 past the end (git reads NUL-terminated strings)."""
    return name[i] if i < len(name) else 0


def _lower(c: int) -> int:
    return c + 32 if 0x41 <= c <= 0x5A else c


def _pick_utf8(s: bytes, i: int) -> tuple[int, int | None]:  # noqa: PLR0911 - git's C, case by case
    """``pick_one_utf8_char``: (code point, next index), or (0, None) for malformed UTF-8."""
    c0 = _at(s, i)
    c1, c2, c3 = _at(s, i + 1), _at(s, i + 2), _at(s, i + 3)
    if c0 < 0x80:
        return c0, i + 1
    if c0 & 0xE0 == 0xC0:
        if c1 & 0xC0 != 0x80 or c0 & 0xFE == 0xC0:
            return 0, None
        return ((c0 & 0x1F) << 6) | (c1 & 0x3F), i + 2
    if c0 & 0xF0 == 0xE0:
        if (
            c1 & 0xC0 != 0x80
            or c2 & 0xC0 != 0x80
            or (c0 == 0xE0 and c1 & 0xE0 == 0x80)  # overlong
            or (c0 == 0xED and c1 & 0xE0 == 0xA0)  # a surrogate
            or (c0 == 0xEF and c1 == 0xBF and c2 & 0xFE == 0xBE)  # U+FFFE, U+FFFF
        ):
            return 0, None
        return ((c0 & 0x0F) << 12) | ((c1 & 0x3F) << 6) | (c2 & 0x3F), i + 3
    if c0 & 0xF8 == 0xF0:
        if (
            c1 & 0xC0 != 0x80
            or c2 & 0xC0 != 0x80
            or c3 & 0xC0 != 0x80
            or (c0 == 0xF0 and c1 & 0xF0 == 0x80)  # overlong
            or (c0 == 0xF4 and c1 > 0x8F)
            or c0 > 0xF4
        ):
            return 0, None
        return ((c0 & 0x07) << 18) | ((c1 & 0x3F) << 12) | ((c2 & 0x3F) << 6) | (c3 & 0x3F), i + 4
    return 0, None


def _next_hfs_char(s: bytes, i: int | None) -> tuple[int, int | None]:
    while i is not None:
        out, i = _pick_utf8(s, i)
        if i is None:
            return 0, None
        if out not in HFS_IGNORED:
            return out, i
    return 0, None


def _is_hfs_dot(path: bytes, needle: bytes) -> bool:
    """``is_hfs_dot_generic``: the component at the start of ``path`` is ``.<needle>``
    once HFS+ has dropped its ignored code points and folded ASCII case."""
    c, i = _next_hfs_char(path, 0)
    if c != ord("."):
        return False
    for want in needle:
        c, i = _next_hfs_char(path, i)
        if c > 127 or _lower(c) != want:
            return False
    c, i = _next_hfs_char(path, i)
    return not c or c == ord("/")


def _is_ntfs_dotgit(name: bytes) -> bool:
    """``is_ntfs_dotgit``: ``.git`` or ``git~1``, then only spaces and dots to the end of
    the component (``/``, ``\\``) or an alternate data stream (``:``)."""
    if name[:1] == b".":
        if name[1:4].lower() != b"git":
            return False
        i = 4
    elif name[:1] in (b"g", b"G"):
        if name[1:3].lower() != b"it" or name[3:5] != b"~1":
            return False
        i = 5
    else:
        return False
    while True:
        c = _at(name, i)
        i += 1
        if not c or c in b"/\\:":
            return True
        if c not in b". ":
            return False


def _only_spaces_and_periods(name: bytes, i: int) -> bool:
    while True:
        c = _at(name, i)
        i += 1
        if not c or c == ord(":"):
            return True
        if c not in b" .":
            return False


def _is_ntfs_dotgitmodules(name: bytes) -> bool:  # noqa: PLR0911 - git's C, case by case
    """``is_ntfs_dot_generic(name, "gitmodules", 10, "gi7eba")``: ``.gitmodules`` or one
    of its NTFS short names (``GITMOD~1``, ``gi7eba~1`` ...)."""
    dotgit, short = b"gitmodules", b"gi7eba"
    if name[:1] == b"." and name[1 : 1 + len(dotgit)].lower() == dotgit:
        return _only_spaces_and_periods(name, len(dotgit) + 1)
    if name[:6].lower() == dotgit[:6] and _at(name, 6) == ord("~") and 0x31 <= _at(name, 7) <= 0x34:
        return _only_spaces_and_periods(name, 8)
    i, saw_tilde = 0, False
    while i < 8:
        c = _at(name, i)
        if c == 0:
            return False
        if saw_tilde:
            if not 0x30 <= c <= 0x39:
                return False
        elif c == ord("~"):
            i += 1
            if not 0x31 <= _at(name, i) <= 0x39:
                return False
            saw_tilde = True
        elif i >= 6 or c & 0x80 or _lower(c) != short[i]:
            return False
        i += 1
    return _only_spaces_and_periods(name, i)


def _verify_dotfile(rest: bytes, is_link: bool) -> bool:
    """``verify_dotfile``: the component began with ``.``; ``rest`` is what follows it."""
    c = _at(rest, 0)
    if c in (0, ord("/")):
        return False  # "."
    if c in b"gG" and rest[1:3].lower() == b"it":
        if _at(rest, 3) in (0, ord("/")):
            return False  # ".git", any case
        if is_link and rest[3:10].lower() == b"modules" and _at(rest, 10) in (0, ord("/")):
            return False  # a ".gitmodules" symlink
    elif c == ord(".") and _at(rest, 1) in (0, ord("/")):
        return False  # ".."
    return True


def _component_problem(rest: bytes, is_link: bool) -> str | None:
    """The protectHFS/protectNTFS checks git makes at the start of every component."""
    if _is_hfs_dot(rest, b"git"):
        return "HFS+ reads it as .git (core.protectHFS)"
    if is_link and _is_hfs_dot(rest, b"gitmodules"):
        return "a .gitmodules symlink, as HFS+ reads it (core.protectHFS)"
    if _is_ntfs_dotgit(rest):
        return "NTFS reads it as .git (core.protectNTFS)"
    if is_link and _is_ntfs_dotgitmodules(rest):
        return "a .gitmodules symlink, as NTFS reads it (core.protectNTFS)"
    return None


def is_dotgit(problem: str) -> bool:
    """Whether a :func:`verify_path_problem` answer is git protecting ``.git`` (or a
    ``.gitmodules`` symlink) rather than a malformed path."""
    return problem.startswith(DOTGIT_PREFIX)


DOTGIT_PREFIX = "a name git protects: "


def verify_path_problem(path: str | bytes, mode: int = MODE_FILE) -> str | None:  # noqa: PLR0911 - git's C, case by case
    """Why git's ``verify_path(path, mode)`` refuses ``path`` (protectNTFS and protectHFS
    on), or None when git accepts it. ``mode``: the git file mode of the entry. An
    answer about ``.git`` starts with :data:`DOTGIT_PREFIX` (:func:`is_dotgit`)."""
    data = path if isinstance(path, bytes) else path.encode("utf-8", "surrogateescape")
    if b"\x00" in data:
        return "it holds a NUL byte"
    is_link = mode & 0o170000 == MODE_LINK
    i = 0
    while True:
        # at the start of a component (git's `inside:` label)
        why = _component_problem(data[i:], is_link)
        if why is not None:
            return DOTGIT_PREFIX + why
        c = _at(data, i)
        i += 1
        if c == ord(".") and not _verify_dotfile(data[i:], is_link):
            return _dotfile_problem(data[i:])
        if c == ord("/"):
            return "it has an empty component ('//' or a leading '/')"
        if c == 0:
            return "it is empty or ends in '/'"
        # inside a component, up to its end
        while True:
            c = _at(data, i)
            i += 1
            if c == 0:
                return None
            if c == ord("/"):
                break
            if c == ord("\\"):
                why = _component_problem_after_backslash(data[i:], is_link)
                if why is not None:
                    return DOTGIT_PREFIX + why


def _dotfile_problem(rest: bytes) -> str:
    if rest[:1] in (b"", b"/"):
        return "it has a '.' component"
    if rest[:2] in (b".", b"./"):
        return "it has a '..' component"
    if rest[3:4] in (b"", b"/"):
        return DOTGIT_PREFIX + "a .git component (any case)"
    return DOTGIT_PREFIX + "a .gitmodules symlink"


def _component_problem_after_backslash(rest: bytes, is_link: bool) -> str | None:
    """protectNTFS reads a backslash as a directory separator too."""
    if _is_ntfs_dotgit(rest):
        return "after a backslash, NTFS reads it as .git (core.protectNTFS)"
    if is_link and _is_ntfs_dotgitmodules(rest):
        return "after a backslash, a .gitmodules symlink as NTFS reads it (core.protectNTFS)"
    return None


def ref_component_problem(name: str) -> str | None:
    """Why ``git check-ref-format`` would refuse ``name`` as one component of a ref name
    (``refs.c``, ``check_refname_component``), or None."""
    checks = (
        (not name, "is empty"),
        (name.startswith("."), "starts with '.'"),
        (name.endswith("."), "ends with '.'"),
        (name.endswith(".lock"), "ends with '.lock'"),
        (".." in name, "holds '..'"),
        ("@{" in name, "holds '@{'"),
        (name == "@", "is '@'"),
        (any(ord(c) < 0x20 or ord(c) == 0x7F for c in name), "holds a control character"),
        (any(c in name for c in " ~^:?*[\\/"), "holds one of space ~ ^ : ? * [ \\ /"),
    )
    return next((problem for bad, problem in checks if bad), None)


# Zero-width and bidi-control code points: invisible, or reordering what is shown, so a
# reviewer reads another path than the one written (Unicode's Default_Ignorable and
# Bidi_Control sets, the ones a path can plausibly hold).
HIDDEN_CODE_POINTS = frozenset(
    (0x00AD, 0x034F, 0x061C, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x180E, 0x3164, 0xFFA0,
     *range(0x180B, 0x1810), *range(0x200B, 0x2010), 0x2028, 0x2029, *range(0x202A, 0x202F),
     *range(0x2060, 0x2070), *range(0xFE00, 0xFE10), 0xFEFF, *range(0xFFF0, 0xFFF9),
     *range(0x1D173, 0x1D17B), *range(0xE0000, 0xE1000))
)  # fmt: skip


def hidden_character(path: str) -> str | None:
    """The first control, zero-width or bidi character of ``path``, named, or None."""
    for ch in path:
        code = ord(ch)
        if code < 0x20 or 0x7F <= code < 0xA0 or code in HIDDEN_CODE_POINTS:
            name = unicodedata.name(ch, "a control character")
            return f"U+{code:04X} ({name})"
    return None
