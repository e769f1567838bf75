"""The reflog line of a ref gitrun moves, written as libgit2 and git would write it.

gitrun writes its loose refs itself (so the new value's bytes are durable before the
rename that makes them the ref: :class:`gitrun.store.refmove.Transaction`), and with
them the reflog line git keeps for branches: ``git reflog gitrun/<run>`` still lists every move of
a run branch. The line is appended after the barrier (so it names only published
objects) and before the rename; the move's final sync makes it durable, at no sync of
its own. Which refs get one follows git: ``core.logAllRefUpdates`` (true
by default in a repository with a worktree: branches, remote-tracking refs and notes;
``always``: every ref), or a reflog file that already exists.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pygit2

_LOGGED = ("refs/heads/", "refs/remotes/", "refs/notes/")
_ZERO = "0" * 40
_modes: dict[Path, tuple[str, str, str]] = {}  # common dir -> (logAllRefUpdates, name, email)


def _settings(repo: pygit2.Repository, cdir: Path) -> tuple[str, str, str]:
    """(core.logAllRefUpdates as git reads it, reflog name, email), read once per repository."""
    found = _modes.get(cdir)
    if found is None:
        default = "false" if repo.is_bare else "true"
        try:
            mode = str(repo.config["core.logAllRefUpdates"]).lower()
        except (KeyError, pygit2.GitError):
            mode = default
        try:
            who = repo.default_signature
            name, email = who.name, who.email
        except (KeyError, pygit2.GitError):
            name, email = "unknown", "unknown"  # what libgit2 logs without an identity
        found = (mode, name, email)
        _modes[cdir] = found
    return found


def append(
    repo: pygit2.Repository,
    cdir: Path,
    ref: str,
    old: pygit2.Oid | None,
    new: pygit2.Oid,
    message: str,
) -> None:
    """Append ``old -> new`` to ``ref``'s reflog when git would keep one (unsynced: the
    move's final sync makes it durable)."""
    mode, name, email = _settings(repo, cdir)
    path = f"{cdir}/logs/{ref}"  # a string: two Path joins cost more than the append
    logged = mode == "always" or (mode in ("true", "yes", "on", "1") and ref.startswith(_LOGGED))
    if not logged and not os.path.exists(path):
        return
    offset = time.localtime().tm_gmtoff // 60
    sign = "-" if offset < 0 else "+"
    zone = f"{sign}{abs(offset) // 60:02d}{abs(offset) % 60:02d}"
    text = " ".join(message.split())
    before = _ZERO if old is None else str(old)
    line = f"{before} {new} {name} <{email}> {int(time.time())} {zone}\t{text}\n"
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except FileNotFoundError:  # the ref's first reflog line in a new directory
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, flags, 0o666)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


__all__ = ["append"]
