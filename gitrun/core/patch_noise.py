"""The text around file patches that ``git apply`` skips, and GNU diff's epoch dates.

Pure: line tests only. ``git format-patch`` wraps its diff in a mail (an mbox ``From``
line, headers, the message, ``---`` and a diffstat) and ends it with a ``-- `` signature;
``diff -ruN`` writes a ``diff -ruN a/x b/x`` command line before each file. ``git apply``
skips all of that (apply.c ``find_header`` passes over every line that does not start a
file patch). gitrun skips exactly these forms and still refuses any other stray text, so
a prose answer with a diff inside, or a diff cut in the middle, is not guessed at.

GNU ``diff -N`` writes an absent file as an empty one dated the epoch; ``git apply``
(``has_epoch_timestamp``) reads such a side as ``/dev/null``: a creation or a deletion.
"""

from __future__ import annotations

import calendar
import re

__all__ = [
    "is_combined_diff",
    "is_diff_command",
    "is_mail_start",
    "is_only_in",
    "is_signature",
    "side_is_epoch",
    "starts_preamble",
]

# git format-patch's mbox separator: "From <commit> Mon Sep 17 00:00:00 2001".
_MBOX_FROM = re.compile(r"From [0-9a-f]{40} ")
# A mail or `git show` / `git log -p` header; a preamble only at the top of the patch.
_LEADING_HEADER = re.compile(r"(?:From|Subject|Date|Message-I[dD]): |commit [0-9a-f]{40}(?: |$)")
_EPOCH_STAMP = re.compile(
    r"(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d+))? ([-+])(\d\d):?(\d\d)\s*"
)


def is_mail_start(line: str) -> bool:
    """The mbox ``From <sha>`` line that opens each mail of ``git format-patch``."""
    return _MBOX_FROM.match(line) is not None


def starts_preamble(line: str, *, at_top: bool) -> bool:
    """Whether ``line`` opens a mail or commit header whose text precedes a diff."""
    return is_mail_start(line) or (at_top and _LEADING_HEADER.match(line) is not None)


def is_signature(line: str, after: str | None) -> bool:
    """``git format-patch``'s ``-- `` signature line (the git version follows it).

    A removal line ``-- `` can look the same; it is a signature only when what follows
    cannot continue a hunk.
    """
    return line == "-- " and (after is None or after[:1] not in (" ", "-", "+", "\\", "@"))


def is_diff_command(line: str) -> bool:
    """A ``diff -r`` / ``diff -u`` command line (GNU diff's header), not ``diff --git``."""
    return line.startswith("diff ") and not line.startswith(("diff --git ", "diff --cc "))


def is_combined_diff(line: str) -> bool:
    """A merge's combined diff (``diff --cc`` / ``diff --combined``): not a patch git applies."""
    return line.startswith(("diff --cc ", "diff --combined "))


def is_only_in(line: str) -> bool:
    """``diff -r`` without ``-N`` names files only one side has instead of diffing them."""
    return line.startswith("Only in ") and ": " in line


def side_is_epoch(raw: str) -> bool:
    """Whether a ``---``/``+++`` side carries GNU diff's epoch date (an absent file)."""
    _, tab, stamp = raw.partition("\t")
    match = _EPOCH_STAMP.fullmatch(stamp) if tab else None
    if match is None:
        return False
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    if match.group(7) and set(match.group(7)) != {"0"}:
        return False
    try:
        local = calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0))
    except (ValueError, OverflowError):
        return False
    offset = (int(match.group(9)) * 60 + int(match.group(10))) * 60
    return local - (offset if match.group(8) == "+" else -offset) == 0
