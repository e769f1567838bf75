"""An exec step's command: run it confined in the worktree, see what it changed, undo it.

:func:`run` starts the command (``bash -c COMMAND`` or an argv) under the verifier's
isolation (:mod:`gitrun.adapter.sandbox`: bubblewrap with the worktree bound read-write and the
workspace, the repository's common git dir and the keyring hidden, ``/tmp`` private; a
supervisor that kills the command's whole process tree on timeout and when gitrun dies).
``git`` inside the command works on a private git dir made for the step
(:mod:`gitrun.adapter.gitview`): an exec step edits files, gitrun makes the commit.

:func:`scan` compares the whole worktree with a tree — every file, link and mode, nothing
skipped but the top-level ``.git`` (checked apart: :func:`gitrun.adapter.exec_step.check_dotgit`)
— reading nothing through a symlink and nothing over the policy's output limits; :func:`restore`
puts the worktree back to that tree (created files and directories removed unread, changed
and deleted ones written back from git, modes too).
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pygit2

from gitrun.adapter import gitview, safefs, sandbox, scratch
from gitrun.adapter.sandbox import Confinement, Layout, SandboxFailed
from gitrun.adapter.scancache import ScanCache
from gitrun.core import faults
from gitrun.core.errors import BadInput, EnvironmentDrift, GateRejected
from gitrun.core.exec_policy import OutputLimits
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
    for pair in action.set_env or ():  # the step's own values (checked by the gate)
        name, _, value = pair.partition("=")
        if not name.startswith("GITRUN_"):
            env[name] = value
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
    git: tuple[gitview.GitView, pygit2.Repository] | None = None,
) -> Ran:
    """Run ``action``'s command in ``worktree``/``cwd``, killed after its timeout; its
    stdout and stderr captured apart (two files), each bounded. ``hold``: a descriptor
    its supervisor keeps until the command's tree is dead (see :func:`sandbox.spawn`).
    ``git``: the step's git view (:mod:`gitrun.adapter.gitview`), made in its scratch."""
    worktree = worktree.resolve()
    cwd = worktree / action.cwd if action.cwd else worktree
    timeout = action.timeout_seconds or 60.0
    with scratch.private("gitrun-exec-") as out:
        home = out / "home"
        home.mkdir()
        blank = out / "blank"
        blank.touch(0o444)
        view = None
        if git is not None:
            view = gitview.make(*git, out / "git", worktree, confined=confinement.confined)
        binds = () if view is None else view.binds
        # The worktree's .git file read-only: a command cannot swap in a repository of its
        # own even while it runs (the user's shell prompt may run git status meanwhile);
        # unconfined, the check after the command (exec_step) is the only wall.
        dotgit = (worktree / ".git",)
        layout = Layout.of(
            [worktree, home], hidden.dirs, hidden.files, cwd, blank, binds=binds, frozen=dotgit
        )
        with (out / "stdout").open("w+b") as log, (out / "stderr").open("w+b") as err:
            env = child_env(action, home, confined=confinement.confined)
            env = gitview.child_env(env, view)
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

Entry = tuple[int, pygit2.Oid | None]  # (git mode, blob id); OTHER and TREE entries: no blob
_NO_FOLLOW_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class Seen:
    """One entry on disk, as ``lstat`` gave it: nothing of its content read yet."""

    mode: int  # git mode: BLOB, EXEC, LINK, TREE (a directory the tree lacks), OTHER
    size: int
    links: int  # st_nlink
    same: bool = False  # exactly the tree's entry at its path (mode and content)
    st: os.stat_result | None = field(default=None, compare=False)  # for a scan cache


def tree_entries(tree: pygit2.Tree, prefix: str = "") -> dict[str, tuple[int, pygit2.Oid]]:
    """Every blob and link of ``tree`` by path (submodules left out: not files)."""
    out: dict[str, tuple[int, pygit2.Oid]] = {}
    stack: list[tuple[pygit2.Tree, str]] = [(tree, prefix)]
    while stack:
        sub, at = stack.pop()
        for item in sub:
            path = at + (item.name or "")
            if item.filemode == trees.TREE and isinstance(item, pygit2.Tree):
                stack.append((item, path + "/"))
            elif item.filemode in (trees.BLOB, trees.EXEC, trees.LINK):
                out[path] = (item.filemode, item.id)
    return out


def _tree_dirs(files: Iterable[str]) -> set[str]:
    dirs: set[str] = set()
    for path in files:
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    return dirs


def walk(
    worktree: Path,
    tracked: Mapping[str, tuple[int, pygit2.Oid]],
    size_of: Callable[[pygit2.Oid], int],
    *,
    limits: OutputLimits | None = None,
    fix_modes: bool = False,
    cache: ScanCache | None = None,
    only: frozenset[str] | None = None,
) -> dict[str, Seen]:
    """Every entry under ``worktree`` but the top-level ``.git``, by ``lstat`` (no link
    followed), without recursion. Content is read only to compare an entry with the
    ``tracked`` one at its path, when their modes and sizes (``size_of`` a blob) agree:
    never more than the tree holds.

    A directory the tree lacks is one ``TREE`` entry, not entered — unless ``limits`` is
    given (an exec's output, to be committed): then every directory is entered and each
    rule of the limits is enforced as it is met (:class:`GateRejected` naming it), so
    nothing over them is ever read. ``fix_modes``: clear setuid, setgid and sticky bits,
    make unreadable files and odd directories (not ``rwx`` for their owner, or writable
    by others) ``0644``/``0755`` as a checkout would leave them (git keeps no other bits).
    ``only``: the directories a resident process's watch says may have changed; a tracked
    directory with none of them in or under it is taken as the tree's, not entered.
    """
    out: dict[str, Seen] = {}
    tracked_dirs = _tree_dirs(tracked)
    ordered = sorted(tracked) if only is not None else []
    count = 0
    root = os.open(worktree, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    stack: list[tuple[int, str, Iterator[str]]] = [(root, "", iter(sorted(os.listdir(root))))]
    try:
        while stack:
            dfd, prefix, names = stack[-1]
            name = next(names, None)
            if name is None:
                os.close(dfd)
                stack.pop()
                continue
            if not prefix and name == ".git":
                continue  # gitrun's own: checked apart (exec_step.check_dotgit)
            path = prefix + name
            count += 1
            if limits is not None:
                _check_name(path, name, count, len(stack) - 1, limits)
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if fix_modes:
                st = _fix_mode(dfd, name, st)
            if stat.S_ISDIR(st.st_mode):
                if limits is None and path not in tracked_dirs:
                    out[path] = Seen(trees.TREE, 0, st.st_nlink)
                    continue
                if only is not None and path in tracked_dirs and not _touched(path, only):
                    count += _as_tracked(path, ordered, tracked, out)
                    continue
                sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
                stack.append((sub, path + "/", iter(sorted(os.listdir(sub)))))
            elif stat.S_ISLNK(st.st_mode) or stat.S_ISREG(st.st_mode):
                kind = (
                    trees.LINK
                    if stat.S_ISLNK(st.st_mode)
                    else trees.EXEC
                    if st.st_mode & stat.S_IXUSR
                    else trees.BLOB
                )
                old = tracked.get(path)
                same = (
                    old is not None
                    and old[0] == kind
                    and _same_blob(dfd, name, path, kind, st, old, size_of, cache)
                )
                out[path] = Seen(kind, st.st_size, st.st_nlink, same, st)
            else:
                out[path] = Seen(OTHER, 0, st.st_nlink)
    finally:
        for dfd, _, _ in stack:
            os.close(dfd)
    return out


def _touched(path: str, only: frozenset[str]) -> bool:
    """Whether a directory in ``only`` is ``path`` or under it."""
    return any(d == path or d.startswith(path + "/") for d in only)


def _as_tracked(
    path: str, ordered: list[str], tracked: Mapping[str, tuple[int, pygit2.Oid]],
    out: dict[str, Seen],
) -> int:  # fmt: skip
    """Every tracked entry under the directory ``path``, as the tree has it (``ordered``:
    the tracked paths, sorted); how many."""
    low = bisect.bisect_left(ordered, path + "/")
    high = bisect.bisect_left(ordered, path + "0")  # "0" follows "/"
    for name in ordered[low:high]:
        out[name] = Seen(tracked[name][0], 0, 1, True)
    return high - low


def _check_name(path: str, name: str, count: int, depth: int, limits: OutputLimits) -> None:
    if count > limits.max_files:
        raise GateRejected(
            "exec-too-many-files",
            f"the worktree holds more than {limits.max_files} files and directories after "
            "the command (policy.exec.max_files)",
        )
    if depth > limits.max_depth:  # directories above the entry
        raise GateRejected(
            "exec-too-deep",
            f"{shown_path(path)[:80]}... is more than {limits.max_depth} directories deep "
            "(policy.exec.max_depth)",
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise GateRejected(
            "exec-path-encoding",
            f"the command made {shown_path(path)}, a name that is not UTF-8; gitrun keeps "
            "paths as UTF-8 text (receipts, policies, the protocol)",
        ) from None
    if name.lower() == ".git":
        raise GateRejected(
            "exec-dotgit",
            f"the command made {path}: a .git below the worktree root (git refuses to add one)",
        )


def shown_path(path: str) -> str:
    """``path`` printable: bytes that are not UTF-8 shown as ``\\xNN``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _fix_mode(dfd: int, name: str, st: os.stat_result) -> os.stat_result:
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISDIR(st.st_mode):
        odd = mode & 0o7000 or mode & 0o700 != 0o700 or mode & 0o002
        fixed = 0o755
    elif stat.S_ISREG(st.st_mode):
        odd = mode & 0o7000 or not mode & 0o400
        fixed = 0o755 if mode & stat.S_IXUSR else 0o644
    else:
        return st
    if not odd:
        return st
    os.chmod(name, fixed, dir_fd=dfd)  # lstat said not a link; no command of it lives
    return os.stat(name, dir_fd=dfd, follow_symlinks=False)


def _content(dfd: int, name: str, kind: int, size: int) -> bytes:
    """The link target, or the file's first ``size + 1`` bytes (one more than ``stat``
    said: then it is not the blob of that size it is compared with)."""
    if kind == trees.LINK:
        return os.fsencode(os.readlink(name, dir_fd=dfd))
    fd = os.open(name, _NO_FOLLOW_READ, dir_fd=dfd)
    try:
        chunks, left = [], size + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


_SIZES: dict[pygit2.Oid, int] = {}  # a blob's size never changes: asked of the odb once


def blob_size(repo: pygit2.Repository, oid: pygit2.Oid) -> int:
    """The size of the blob ``oid`` from its header (-1: not a blob)."""
    found = _SIZES.get(oid)
    if found is None:
        try:
            kind, found = repo.odb.read_header(oid)
        except (KeyError, ValueError, pygit2.GitError):
            return -1
        if kind != pygit2.enums.ObjectType.BLOB:
            return -1
        if len(_SIZES) > 500_000:
            _SIZES.clear()
        _SIZES[oid] = found
    return found


def _read_at(worktree: Path, path: str, seen: Seen) -> bytes:
    state = safefs.inspect(worktree, path)
    if state is None or state[0] != seen.mode:
        raise EnvironmentDrift("exec-racing", f"{shown_path(path)} changed while gitrun read it")
    return state[1]


def _same_blob(
    dfd: int,
    name: str,
    path: str,
    kind: int,
    st: os.stat_result,
    old: tuple[int, pygit2.Oid],
    size_of: Callable[[pygit2.Oid], int],
    cache: ScanCache | None,
) -> bool:
    """Whether the entry (of ``old``'s mode) still holds ``old``'s blob: the cache's word
    for a file whose stat is unchanged since it was hashed, else its bytes read and
    hashed when the sizes agree (the cache then told)."""
    if cache is not None:
        known = cache.lookup(path, st)
        if known is not None:
            return known == old
    if size_of(old[1]) != st.st_size:
        return False
    same = pygit2.hash(_content(dfd, name, kind, st.st_size)) == old[1]
    if same and cache is not None:
        cache.remember(path, st, old)
    return same


def scan(
    repo: pygit2.Repository,
    worktree: Path,
    tree: pygit2.Tree,
    *,
    write: bool = False,
    limits: OutputLimits | None = None,
    fix_modes: bool = False,
    cache: ScanCache | None = None,
) -> dict[str, Entry | None]:
    """path → what the disk holds instead of ``tree``'s entry (None: deleted).

    The content of a file is read only when its type and size match the tree's blob (so
    never more than the tree holds) or, with ``write``, when it is new or changed and
    within ``limits`` (its blob then stored in ``repo``). A directory the tree lacks is
    one ``(TREE, None)`` entry, unless ``write`` (it is entered: see :func:`walk`).
    ``cache`` spares reading a file whose stat is unchanged since it was hashed
    (:mod:`gitrun.adapter.scancache`); it is only ever told what was read here.
    """
    key = (str(tree.id), write, fix_modes)
    dirs = cache.since(key[0]) if cache is not None else None
    known = cache.answered(key, dirs) if cache is not None else None
    if known is not None:
        return known  # a resident process's watch saw nothing since it last knew
    before = tree_entries(tree) if cache is None else cache.entries_of(tree, tree_entries)
    now = walk(
        worktree, before, lambda oid: blob_size(repo, oid),
        limits=limits if write else None, fix_modes=fix_modes, cache=cache, only=dirs,
    )  # fmt: skip
    changes: dict[str, Entry | None] = {}
    new: dict[str, Seen] = {}
    for path in sorted(set(before) | set(now)):
        seen = now.get(path)
        if seen is None:
            changes[path] = None
        elif not seen.same:
            new[path] = seen
    if write:
        _check_written(new, limits or OutputLimits())
    for path, seen in new.items():
        if seen.mode in (OTHER, trees.TREE):
            changes[path] = (seen.mode, None)
        elif write:
            stored: Entry = (seen.mode, repo.create_blob(_read_at(worktree, path, seen)))
            changes[path] = stored
            if cache is not None and seen.st is not None:
                cache.remember(path, seen.st, stored)
        else:
            changes[path] = (seen.mode, None)
    if cache is not None:
        cache.found(key, changes)
    return changes


def _check_written(new: dict[str, Seen], limits: OutputLimits) -> None:
    """The rules on new and changed entries, before any of their content is read."""
    total = 0
    for path, seen in sorted(new.items()):
        if seen.mode == OTHER:
            raise GateRejected(
                "exec-special-file",
                f"the command made {shown_path(path)}, neither file nor symlink "
                "(a fifo, socket or device)",
            )
        if seen.mode in (trees.BLOB, trees.EXEC) and seen.links > 1:
            raise GateRejected(
                "exec-hard-link",
                f"the command made {shown_path(path)} a hard link ({seen.links} names for one "
                "file, maybe outside the worktree); copy the file instead",
            )
        if seen.size > limits.max_file_bytes:
            raise GateRejected(
                "exec-file-too-large",
                f"the command made {shown_path(path)} {seen.size} bytes; a file may be "
                f"{limits.max_file_bytes} (policy.exec.max_file_bytes)",
            )
        total += seen.size
        if total > limits.max_written_bytes:
            raise GateRejected(
                "exec-too-much-output",
                f"the command's new and changed files are over {limits.max_written_bytes} "
                "bytes (policy.exec.max_written_bytes)",
            )


def restore(repo: pygit2.Repository, worktree: Path, tree: pygit2.Tree) -> list[str]:
    """Put the worktree back to ``tree`` exactly; the paths that were discarded, sorted
    (a directory the tree lacks as ``dir/``, removed whole without being read)."""
    changes = scan(repo, worktree, tree, fix_modes=True)
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
    left = scan(repo, worktree, tree)
    if left:
        raise EnvironmentDrift(
            "exec-restore",
            f"the worktree could not be put back: {[shown_path(p) for p in sorted(left)[:5]]} "
            "still differ",
        )
    return sorted(
        shown_path(p) + ("/" if found is not None and found[0] == trees.TREE else "")
        for p, found in changes.items()
    )


def _remove(worktree: Path, path: str) -> None:
    """Remove whatever is at ``path`` (a directory with everything below it), no link
    followed and nothing read."""
    parent, _, name = path.rpartition("/")
    probe = f"{parent}/x" if parent else "x"
    try:
        with safefs_dir(worktree, probe) as dfd:
            remove_at(dfd, name)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return  # a parent is gone, a link or a file: removing it removes this too
        raise


def remove_at(dfd: int, name: str) -> None:
    """Unlink ``name`` in the directory ``dfd``, or remove it as a whole directory tree —
    iteratively, one descriptor at a time (climbing back through ``..``), so no depth
    exhausts the stack or the descriptor table; directories without rights are opened."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dfd)
        return
    names = [name]
    fd = _open_for_removal(dfd, name)
    while True:
        below = None
        for entry in os.listdir(fd):
            if stat.S_ISDIR(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
                below = entry
                break
            os.unlink(entry, dir_fd=fd)
        if below is not None:
            sub = _open_for_removal(fd, below)
            os.close(fd)
            fd = sub
            names.append(below)
            continue
        if len(names) == 1:
            os.close(fd)
            os.rmdir(name, dir_fd=dfd)
            return
        up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        os.close(fd)
        os.rmdir(names.pop(), dir_fd=up)
        fd = up


def _open_for_removal(dfd: int, name: str) -> int:
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
        os.chmod(name, 0o700, dir_fd=dfd)  # a directory without rights: its entries go too
    return os.open(name, _DIR_FLAGS, dir_fd=dfd)


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
