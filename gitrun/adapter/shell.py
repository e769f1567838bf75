"""An exec step's command: run it confined in the worktree, see what it changed, undo it.

:func:`run` starts the command (``bash -c COMMAND`` or an argv) under the verifier's
isolation (:mod:`gitrun.adapter.sandbox`: bubblewrap with the worktree bound read-write and the
workspace, the repository's common git dir and the keyring hidden, ``/tmp`` private; a
supervisor that kills the command's whole process tree on timeout and when gitrun dies).
The worktree's ``.git`` file points into the hidden common dir, so ``git`` inside the
command fails: an exec step edits files, gitrun makes the commit.

:func:`scan` compares the whole worktree with a tree — every file, link and mode, nothing
skipped but the top-level ``.git`` — reading nothing through a symlink; :func:`restore`
puts the worktree back to that tree (created files removed, changed and deleted ones
written back from git, modes too).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pygit2

from gitrun.adapter import safefs, sandbox
from gitrun.adapter.sandbox import Confinement, Layout, SandboxFailed
from gitrun.adapter.scancache import ScanCache
from gitrun.core import faults
from gitrun.core.errors import BadInput, EnvironmentDrift
from gitrun.core.records import Action
from gitrun.store import trees

OUTPUT_LIMIT = 64 * 1024  # bytes kept of stdout, and of stderr (head and tail), cut said
BASE_PATH = "/usr/local/bin:/usr/bin:/bin"
_POLL_SECONDS = 0.02
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OTHER = safefs.OTHER  # a fifo, socket or device: never committed
_CUT = re.compile(rb"\n\[gitrun: output truncated: [0-9]+ bytes, first and last [0-9]+ kept\]\n")


@dataclass(frozen=True)
class Ran:
    """What the command did, apart from its files."""

    exit_code: int | None  # None: killed at the timeout
    stdout: bytes  # bounded (see :func:`_bounded`)
    stderr: bytes  # bounded apart from stdout; gitrun's timeout note is appended here
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.exit_code is None


@dataclass(frozen=True)
class Hidden:
    """What the command must not see: directories and files (as the verifier's Secrets)."""

    dirs: tuple[Path, ...] = ()
    files: tuple[Path, ...] = ()


def argv_of(action: Action) -> list[str]:
    """The argv an exec action runs: ``bash -c COMMAND``, or its own argv."""
    if action.argv is not None:
        return list(action.argv)
    if action.command is None:
        raise BadInput("an exec step needs a command or an argv")
    return ["bash", "-c", action.command]


def child_env(action: Action, home: Path, *, confined: bool) -> dict[str, str]:
    """A small fixed environment plus the policy's allowlisted names; never ``GITRUN_*``."""
    env = {
        "PATH": os.environ.get("PATH", BASE_PATH),
        "LANG": "C.UTF-8",
        "HOME": str(home),
        "TMPDIR": "/tmp" if confined else str(home),  # noqa: S108 - the sandbox's own tmpfs
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    for name in action.env or ():
        if name in os.environ and not name.startswith("GITRUN_"):
            env[name] = os.environ[name]
    return env


def run(
    action: Action,
    worktree: Path,
    *,
    confinement: Confinement,
    hidden: Hidden,
    heartbeat: Callable[[], None] | None = None,
    heartbeat_interval: float = 1.0,
    hold: int | None = None,
) -> Ran:
    """Run ``action``'s command in ``worktree``/``cwd``, killed after its timeout; its
    stdout and stderr captured apart (two files), each bounded. ``hold``: a descriptor
    its supervisor keeps until the command's tree is dead (see :func:`sandbox.spawn`)."""
    worktree = worktree.resolve()
    cwd = worktree / action.cwd if action.cwd else worktree
    timeout = action.timeout_seconds or 60.0
    with tempfile.TemporaryDirectory(prefix="gitrun-exec-", ignore_cleanup_errors=True) as tmp:
        out = Path(tmp).resolve()
        home = out / "home"
        home.mkdir()
        blank = out / "blank"
        blank.touch(0o444)
        layout = Layout.of([worktree, home], hidden.dirs, hidden.files, cwd, blank)
        with (out / "stdout").open("w+b") as log, (out / "stderr").open("w+b") as err:
            env = child_env(action, home, confined=confinement.confined)
            child = sandbox.spawn(
                argv_of(action), cwd=cwd, env=env, log=log, err=err,
                confinement=confinement, layout=layout, hold=hold,
            )  # fmt: skip
            start = time.monotonic()
            try:
                timed_out = _wait(child, start, timeout, heartbeat, heartbeat_interval)
            finally:
                child.stop()
            seconds = time.monotonic() - start
            stdout, stderr = _bounded(log), _bounded(err)
    if timed_out:
        stderr += f"\n[gitrun: killed after the {timeout:g}s timeout]\n".encode()
    started, code, why = child.outcome()
    if why:
        raise BadInput(f"exec: {argv_of(action)[0]!r} cannot start: {why}")
    if not started and not timed_out:
        said = stderr.decode("utf-8", "replace").strip().splitlines()
        raise SandboxFailed(f"exec: the sandbox could not start: {said[-1] if said else '?'}")
    return Ran(None if timed_out else code, stdout, stderr, seconds)


def _wait(
    child: sandbox.Supervised,
    start: float,
    timeout: float,
    heartbeat: Callable[[], None] | None,
    interval: float,
) -> bool:
    """Poll until the command exits (False) or its timeout passes (True)."""
    beat = start + interval
    faults.point("exec_running")  # then once per poll: <point>:<n> kills ~n*20 ms in
    while not child.exited():
        faults.point("exec_running")
        now = time.monotonic()
        if now - start >= timeout:
            return True
        if heartbeat is not None and now >= beat:
            beat = now + interval
            heartbeat()
        time.sleep(_POLL_SECONDS)
    return False


def _bounded(log: IO[bytes]) -> bytes:
    """One stream, its head and tail kept when it is longer than :data:`OUTPUT_LIMIT`, the
    cut said by a note line between them (see :func:`truncated`)."""
    size = os.fstat(log.fileno()).st_size
    half = OUTPUT_LIMIT // 2
    log.seek(0)
    if size <= OUTPUT_LIMIT:
        return log.read()
    head = log.read(half)
    log.seek(size - half)
    note = f"\n[gitrun: output truncated: {size} bytes, first and last {half} kept]\n"
    return head + note.encode() + log.read()


def truncated(data: bytes) -> bool:
    """Whether a bounded stream was cut: the note sits right after the kept head (a
    command that merely prints the note elsewhere does not count)."""
    return _CUT.match(data, OUTPUT_LIMIT // 2) is not None


# -- what the command changed ----------------------------------------------------------

Entry = tuple[int, pygit2.Oid | None]  # (git mode, blob id); OTHER entries have no blob


def tree_entries(tree: pygit2.Tree, prefix: str = "") -> dict[str, Entry]:
    """Every blob and link of ``tree`` by path (submodules left out: not files)."""
    out: dict[str, Entry] = {}
    for item in tree:
        path = prefix + (item.name or "")
        if item.filemode == trees.TREE and isinstance(item, pygit2.Tree):
            out |= tree_entries(item, path + "/")
        elif item.filemode in (trees.BLOB, trees.EXEC, trees.LINK):
            out[path] = (item.filemode, item.id)
    return out


def disk_entries(
    worktree: Path,
    store: Callable[[bytes], pygit2.Oid] = pygit2.hash,
    cache: ScanCache | None = None,
) -> dict[str, Entry]:
    """Every file, link and special file under ``worktree`` but ``.git``, links unfollowed
    (a file ``cache`` knows unchanged since it was hashed is not read again)."""
    out: dict[str, Entry] = {}
    fd = os.open(worktree, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _walk(fd, "", out, store, cache)
    finally:
        os.close(fd)
    return out


def _walk(
    dfd: int,
    prefix: str,
    out: dict[str, Entry],
    store: Callable[[bytes], pygit2.Oid],
    cache: ScanCache | None = None,
) -> None:
    for name in sorted(os.listdir(dfd)):
        if not prefix and name == ".git":
            continue
        path = prefix + name
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            with _opened_dir(dfd, name) as sub:
                _walk(sub, path + "/", out, store, cache)
        elif stat.S_ISLNK(st.st_mode):
            out[path] = (trees.LINK, store(os.fsencode(os.readlink(name, dir_fd=dfd))))
        elif stat.S_ISREG(st.st_mode):
            known = cache.lookup(path, st) if cache is not None else None
            if known is not None:
                out[path] = known
                continue
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            with os.fdopen(os.open(name, flags, dir_fd=dfd), "rb") as fh:
                data = fh.read()
            out[path] = (trees.EXEC if st.st_mode & stat.S_IXUSR else trees.BLOB, store(data))
            if cache is not None:
                cache.remember(path, st, out[path])
        else:
            out[path] = (OTHER, None)


@contextlib.contextmanager
def _opened_dir(dfd: int, name: str) -> Iterator[int]:
    fd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
    try:
        yield fd
    finally:
        os.close(fd)


def scan(
    repo: pygit2.Repository,
    worktree: Path,
    tree: pygit2.Tree,
    *,
    write: bool = False,
    cache: ScanCache | None = None,
) -> dict[str, Entry | None]:
    """path → what the disk holds instead of ``tree``'s entry (None: deleted).

    With ``write`` the blobs of new and changed files are stored in ``repo``; ``cache``
    spares reading files unchanged since they were hashed (:mod:`gitrun.adapter.scancache`).
    """
    before = tree_entries(tree) if cache is None else cache.entries_of(tree, tree_entries)
    store = repo.create_blob if write else pygit2.hash
    now = disk_entries(worktree, cache=cache)
    changes: dict[str, Entry | None] = {}
    for path in sorted(set(before) | set(now)):
        if before.get(path) != now.get(path):
            changes[path] = now.get(path)
    if write:
        for path, found in changes.items():  # store only what changed (the command is over)
            if found is not None and found[0] != OTHER:
                state = safefs.inspect(worktree, path)
                if state is None:
                    raise EnvironmentDrift("exec-racing", f"{path} vanished while gitrun read it")
                changes[path] = (found[0], store(state[1]))
    return changes


def restore(repo: pygit2.Repository, worktree: Path, tree: pygit2.Tree) -> list[str]:
    """Put the worktree back to ``tree`` exactly; the paths that were discarded, sorted."""
    changes = scan(repo, worktree, tree)
    for path in sorted(changes, key=lambda p: (-p.count("/"), p)):
        if trees.entry_mode(tree, path) not in (trees.BLOB, trees.EXEC, trees.LINK):
            _remove(worktree, path)
    for path in sorted(changes):
        obj = trees.entry(tree, path)
        mode = trees.entry_mode(tree, path)
        if not isinstance(obj, pygit2.Blob):
            continue
        _remove(worktree, path)  # a file of another type, or a directory, in the way
        if mode == trees.LINK:
            safefs.write_link(worktree, path, obj.data)
        else:
            safefs.write_file(worktree, path, obj.data, executable=mode == trees.EXEC)
    _prune_dirs(worktree, tree)
    left = scan(repo, worktree, tree)
    if left:
        raise EnvironmentDrift(
            "exec-restore", f"the worktree could not be put back: {sorted(left)[:5]} still differ"
        )
    return sorted(changes)


def _remove(worktree: Path, path: str) -> None:
    """Remove whatever is at ``path`` (a directory with everything below it), no link followed."""
    parent, _, name = path.rpartition("/")
    probe = f"{parent}/x" if parent else "x"
    try:
        state = safefs.inspect(worktree, path)
    except EnvironmentDrift:
        return  # a parent is a link or file: removing that parent removes this too
    if state is None:
        return
    if state[0] == trees.TREE:
        with safefs_dir(worktree, probe) as dfd:
            shutil.rmtree(name, dir_fd=dfd)
        return
    safefs.remove(worktree, path)


@contextlib.contextmanager
def safefs_dir(worktree: Path, probe: str) -> Iterator[int]:
    """A descriptor of ``probe``'s parent directory, walked without following links."""
    parts = probe.split("/")[:-1]
    fds = [os.open(worktree, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    try:
        for name in parts:
            fds.append(os.open(name, _DIR_FLAGS, dir_fd=fds[-1]))
        yield fds[-1]
    finally:
        for fd in fds:
            os.close(fd)


def _prune_dirs(worktree: Path, tree: pygit2.Tree) -> None:
    """Remove directories the tree does not have (empty ones a command left behind)."""
    for dirpath, dirnames, _ in os.walk(worktree, topdown=False):
        rel = Path(dirpath).relative_to(worktree).as_posix()
        if rel in {".", ".git"} or rel.startswith(".git/"):
            continue
        if trees.entry_mode(tree, rel) != trees.TREE:
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)
        del dirnames
