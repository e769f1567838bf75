"""Durability at fewer syncs: every byte a ref names is on disk before the ref moves.

Traced for real with ``strace``: which files a process wrote, which of them an ``fsync``,
``fdatasync`` or ``syncfs`` made durable, and when a name (an object's, a ref's) appeared.
A power cut can strike between any two system calls, so the order of those calls is
what decides whether an acknowledged step survives one. An ``fdatasync`` of the
repository's journal covers what was written before it (the journal record holds the
staged objects' bytes and the ref's new value, :mod:`gitrun.store.journal`): those names
may then appear unsynced. That the record really holds them, and that recovery puts them
back, is what ``tests/test_journal.py`` shows by taking them away.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import SANDBOXES, Gitrun, git

from gitrun.core import faults
from gitrun.store import journal, journal_format

REC = journal_format.REC  # a record's header, as the journal writes it
REC_MAGIC = journal_format.REC_MAGIC

STRACE = shutil.which("strace")
needs_strace = pytest.mark.skipif(STRACE is None, reason="strace is not installed")
CALLS = "openat,write,pwrite64,fsync,fdatasync,syncfs,link,rename,unlink,close"
LINE = re.compile(r"^(\d+)\s+(\w+)\((.*)\)\s+=\s+(-?\d+)")
OBJECT = re.compile(r"objects/[0-9a-f]{2}/[0-9a-f]{38}")
QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')


def strace(
    argv: list[str], env: dict[str, str], log: Path, timeout: float = 120, strings: int = 0
) -> int:
    """Run ``argv`` under ``strace -f``, the calls that decide durability logged to ``log``
    (with ``strings``, that many bytes of what each write wrote, non-ASCII as ``\\x``)."""
    assert STRACE is not None
    shown = ["-s", str(strings), "-x"] if strings else ["-s", "0"]
    cmd = [STRACE, "-f", "-qq", *shown, "-e", f"trace={CALLS}", "-o", str(log), *argv]
    done = subprocess.run(
        cmd, env=env, capture_output=True, timeout=timeout, check=False, cwd=log.parent
    )
    return done.returncode


@dataclass
class Disk:
    """What a power cut at this point of the trace could lose, inside one git dir."""

    gitdir: str
    fds: dict[tuple[str, int], str] = field(default_factory=dict)
    unsynced_data: set[str] = field(default_factory=set)
    unsynced_names: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)
    covered: set[str] = field(default_factory=set)
    ref_moves: int = 0
    syncs: int = 0
    # With the written bytes traced: each ref's value in a journal record written (then
    # synced), and what each ``.lock`` holds. A lock renamed holding its ref's durable
    # journaled value needs no sync of its own (a step's intent riding with its write
    # journals the branch before its lock is taken).
    recorded: dict[str, str] = field(default_factory=dict)
    journaled: dict[str, str] = field(default_factory=dict)
    lock_values: dict[str, str] = field(default_factory=dict)

    def final(self, path: str) -> bool:
        """An object or ref under its real name (what a reader trusts)."""
        rel = path.removeprefix(self.gitdir + "/")
        if rel == path or rel.endswith(".lock"):
            return False
        return (
            rel.startswith("refs/")
            or re.fullmatch(r"objects/[0-9a-f]{2}/[0-9a-f]{38}", rel) is not None
        )

    def named(self, src: str, dst: str) -> None:
        value = self.lock_values.pop(src, None)
        if value is not None and self.journaled.get(dst) == value:
            self.covered.add(src)  # its value is in a durable record, as if synced with it
        if src in self.covered:  # in a durable journal record: recovery names it again
            self.covered.add(dst)
            self.unsynced_data.discard(dst)
            self.unsynced_names.discard(dst)
            if dst.startswith(self.gitdir + "/refs/") and self.final(dst):
                self.ref_moves += 1
            return
        if self.final(dst) and src in self.unsynced_data:
            self.problems.append(f"{dst} got its name before its bytes were durable")
        if dst.startswith(self.gitdir + "/refs/") and self.final(dst):
            self.ref_moves += 1
            objects = [n for n in self.unsynced_names if self.final(n) and "/objects/" in n]
            if objects:
                self.problems.append(
                    f"{dst} moved while {len(objects)} objects' names were not durable"
                )
        self.unsynced_data.discard(dst)
        if src in self.unsynced_data:
            self.unsynced_data.add(dst)
        self.unsynced_names.add(dst)

    def synced(self, path: str, call: str) -> None:
        self.syncs += 1
        if path == f"{self.gitdir}/gitrun/journal" and call == "fdatasync":
            self.journaled.update(self.recorded)
            self.recorded.clear()
            mine = {p for p in self.unsynced_data | self.unsynced_names if self._in_record(p)}
            self.covered |= mine
            self.unsynced_data -= mine
            self.unsynced_names -= mine
            return
        if call == "syncfs":
            self.covered.clear()
            self.unsynced_data.clear()
            self.unsynced_names.clear()
            return
        self.unsynced_data.discard(path)
        if call == "fsync":  # of a directory: the names in it are durable
            self.unsynced_names = {n for n in self.unsynced_names if os.path.dirname(n) != path}

    def _in_record(self, path: str) -> bool:
        """What a journal record holds: staged objects and ref locks (their new values)."""
        rel = path.removeprefix(self.gitdir + "/")
        return rel != path and (rel.startswith("gitrun/stage/") or rel.endswith(".lock"))

    def feed(self, line: str) -> None:
        m = LINE.match(line)
        if m is None:
            return
        pid, call, args, ret = m.group(1), m.group(2), m.group(3), int(m.group(4))
        paths = QUOTED.findall(args)
        fd = args.split(",", 1)[0]
        if call == "openat" and ret >= 0 and paths and paths[0].startswith("/"):
            self.fds[(pid, ret)] = paths[0]
            if "O_CREAT" in args:
                self.unsynced_data.add(paths[0])
                self.unsynced_names.add(paths[0])
        elif call == "close" and fd.isdigit():
            self.fds.pop((pid, int(fd)), None)
        elif call in ("write", "pwrite64") and fd.isdigit() and (pid, int(fd)) in self.fds:
            path = self.fds[(pid, int(fd))]
            self.unsynced_data.add(path)
            if paths:
                self._written(path, _unescape(paths[0]))
        elif call in ("fsync", "fdatasync", "syncfs") and ret == 0 and fd.isdigit():
            self.synced(self.fds.get((pid, int(fd)), ""), call)
        elif call in ("link", "rename") and ret == 0 and len(paths) == 2:
            self.named(paths[0], paths[1])
        elif call == "unlink" and ret == 0 and paths:
            self.unsynced_names.discard(paths[0])
            self.unsynced_data.discard(paths[0])

    def _written(self, path: str, data: bytes) -> None:
        if path.endswith(".lock"):
            self.lock_values[path] = data.decode("ascii", "replace")
        elif path == f"{self.gitdir}/gitrun/journal" and len(data) > REC.size:
            magic, _, _, length, _ = REC.unpack(data[: REC.size])
            if magic != REC_MAGIC:
                return
            replay = journal.Replay()
            journal.decode(data[REC.size : REC.size + length], replay)
            for name, entry in replay.refs.items():
                if entry.new is not None:
                    self.recorded[f"{self.gitdir}/{name}"] = entry.new.hex() + "\n"

    def unsynced_refs(self) -> list[str]:
        return sorted(n for n in self.unsynced_names if self.final(n) and "/refs/" in n)


def _unescape(shown: str) -> bytes:
    """The bytes strace printed with ``-x`` (escapes as in C strings)."""
    return shown.encode("latin-1", "backslashreplace").decode("unicode_escape").encode("latin-1")


def _disk_at(gitdir: str, before: list[str]) -> Disk:
    """The disk model after ``before`` (its open files known), its counts from zero."""
    disk = Disk(gitdir)
    for line in before:
        disk.feed(line)
    disk.syncs, disk.ref_moves, disk.problems = 0, 0, []
    return disk


def replay(log: Path, gitdir: Path) -> Disk:
    disk = Disk(str(gitdir.resolve()))
    for line in log.read_text().splitlines():
        disk.feed(line)
    return disk


@needs_strace
def test_a_whole_run_names_nothing_before_it_is_durable_and_ends_with_every_ref_synced(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    log = tmp_path / "trace"
    code = strace(
        gitrun.argv("run", str(SANDBOXES / "fix-median"), "--run-id", "r1", "-q"),
        gitrun.env(),
        log,
        strings=1 << 16,
    )
    assert code == 0
    disk = replay(log, gitrun.repo("fix-median") / ".git")
    assert disk.ref_moves >= 6  # checkpoints, the run branch, the receipt index: all seen
    assert disk.problems == []
    assert disk.unsynced_refs() == []


# What both store scripts start with: the repository opened as gitrun opens it, and
# mark(name), an open of a path that cannot exist, which strace shows between the syncs.
SCRIPT_PROLOGUE = textwrap.dedent(
    """
    import os, sys
    from gitrun.store import gitstore
    repo = gitstore.open_repo(sys.argv[1])
    parent = repo.head.target
    # A first move creates the repository's journal (once per repository, not measured).
    gitstore.transaction(repo).move("refs/gitrun/warm", None, parent, message="warm").commit()
    def mark(name):
        try:
            os.close(os.open("/nonexistent-durable-mark/" + name, os.O_RDONLY))
        except OSError:
            pass
    """
)

STORE_SCRIPT = SCRIPT_PROLOGUE + textwrap.dedent(
    """
    import pygit2
    mark("begin")
    # Five new objects (a blob, three trees, a commit), then the one ref move naming them.
    blob = repo.create_blob(b"deep " + os.urandom(8))
    inner = repo.TreeBuilder(); inner.insert("f.txt", blob, pygit2.GIT_FILEMODE_BLOB)
    mid = repo.TreeBuilder(); mid.insert("c", inner.write(), pygit2.GIT_FILEMODE_TREE)
    top = repo.TreeBuilder(); top.insert("b", mid.write(), pygit2.GIT_FILEMODE_TREE)
    sig = pygit2.Signature("t", "t@invalid", 1, 0)
    commit = repo.create_commit(None, sig, sig, "deep\\n", top.write(), [parent])
    gitstore.transaction(repo).move("refs/heads/main", parent, commit, message="test").commit()
    mark("end")
    if sys.argv[2:] == ["hang"]:
        repo.create_blob(b"staged, never named " + os.urandom(8))
        print("staged", flush=True)
        sys.stdin.read()
    """
)


def _store_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "a.txt").write_text("a\n")
    git(repo, "add", "a.txt")
    git(repo, "commit", "-q", "-m", "base")
    return repo


@needs_strace
def test_one_ref_move_makes_five_new_objects_durable_with_one_sync(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    """libgit2's own fsync costs two per object and two per ref: 12 for this move; the
    barrier alone, three ``syncfs``; the journal, one ``fdatasync``."""
    repo, log = _store_repo(tmp_path), tmp_path / "trace"
    assert strace([sys.executable, "-c", STORE_SCRIPT, str(repo)], gitrun.env(), log) == 0
    lines = log.read_text().splitlines()
    begin = next(i for i, x in enumerate(lines) if "durable-mark/begin" in x)
    end = next(i for i, x in enumerate(lines) if "durable-mark/end" in x)
    disk = _disk_at(str((repo / ".git").resolve()), lines[:begin])
    for line in lines[begin:end]:
        disk.feed(line)
    assert disk.problems == []
    assert disk.unsynced_refs() == []
    assert disk.ref_moves == 1
    assert disk.syncs == 1
    assert "deep\n" in git(repo, "log", "-1", "--format=%B", "main")
    git(repo, "fsck", "--strict", "--no-dangling")


def test_a_killed_writer_leaves_its_unnamed_objects_staged_never_under_their_names(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    repo = _store_repo(tmp_path)
    with subprocess.Popen(
        [sys.executable, "-c", STORE_SCRIPT, str(repo), "hang"],
        env=gitrun.env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        try:
            assert proc.stdout.readline() == "staged\n"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
    stage = repo / ".git" / "gitrun" / "stage"
    left = [p for p in stage.rglob("*") if p.is_file()]
    assert len(left) == 1  # the blob no ref names; the published five moved out
    oid = left[0].parent.name + left[0].name
    assert not (repo / ".git" / "objects" / oid[:2] / oid[2:]).exists()
    assert git(repo, "cat-file", "-t", "main^{tree}").strip() == "tree"
    git(repo, "fsck", "--strict", "--no-dangling")  # the repository itself is whole


FOLLOW_SCRIPT = SCRIPT_PROLOGUE + textwrap.dedent(
    """
    sig = __import__("pygit2").Signature("t", "t@invalid", 1, 0)
    blob = repo.create_blob(b"write " + os.urandom(8))
    tb = repo.TreeBuilder(repo[parent].tree); tb.insert("w.txt", blob, 0o100644)
    commit = repo.create_commit(None, sig, sig, "write\\n", tb.write(), [parent])
    mark("begin")
    # The branch move with its receipt index entry riding its final sync.
    txn = gitstore.transaction(repo).move("refs/heads/main", parent, commit, message="test")
    txn.index("refs/gitrun/runs/r/receipts/k-1", commit).commit()
    mark("end")
    """
)


@needs_strace
def test_a_receipt_index_entry_rides_the_branch_moves_journal_record_and_is_renamed_after_it(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    """The index entry costs no sync of its own (issue #15) yet keeps both promises: its
    value is durable (in the branch move's journal record) before its name appears, and
    it is renamed only after the branch, so no reader sees an entry ahead of the branch."""
    repo, log = _store_repo(tmp_path), tmp_path / "trace"
    assert strace([sys.executable, "-c", FOLLOW_SCRIPT, str(repo)], gitrun.env(), log) == 0
    lines = log.read_text().splitlines()
    begin = next(i for i, x in enumerate(lines) if "durable-mark/begin" in x)
    end = next(i for i, x in enumerate(lines) if "durable-mark/end" in x)
    gitdir = str((repo / ".git").resolve())
    disk = _disk_at(gitdir, lines[:begin])
    order: list[str] = []
    for line in lines[begin:end]:
        disk.feed(line)
        m = LINE.match(line)
        if m is None or int(m.group(4)) < 0:
            continue
        paths = QUOTED.findall(m.group(3))
        if m.group(2) in ("syncfs", "fdatasync"):
            order.append("sync")
        elif m.group(2) == "rename" and len(paths) == 2 and paths[1].startswith(gitdir + "/refs/"):
            order.append(paths[1].removeprefix(gitdir + "/"))
    assert disk.problems == []
    assert disk.ref_moves == 2
    assert disk.syncs == 1  # the journal record's; the index entry adds none
    branch = order.index("refs/heads/main")
    entry = order.index("refs/gitrun/runs/r/receipts/k-1")
    assert order.index("sync") < branch < entry, order
    assert git(repo, "rev-parse", "refs/gitrun/runs/r/receipts/k-1") == git(
        repo, "rev-parse", "main"
    )


def test_killed_with_the_index_entry_locked_the_write_stands_and_resume_rebuilds_the_entry(
    gitrun: Gitrun,
) -> None:
    """The new window (receipt_index_locked): the branch move is durable, the entry's lock
    is written but not renamed. The write is there; the entry is not, and a leftover
    lock is all that shows; resume finds the receipt in the history, rebuilds the entry
    (clearing the stale lock) and ends as an uninterrupted run does."""
    res = gitrun("run", str(SANDBOXES / "fix-median"), "--run-id", "r1", "-q",
                 GITRUN_CRASH_AT="receipt_index_locked")  # fmt: skip
    assert res.code == -signal.SIGKILL, res.err
    gitdir = gitrun.repo("fix-median") / ".git"
    receipts = gitdir / "refs" / "gitrun" / "runs" / "r1" / "receipts"
    locks = sorted(p.name for p in receipts.iterdir())
    assert len(locks) == 1, locks
    assert locks[0].endswith(".lock"), locks
    tip = git(gitdir, "rev-parse", "refs/heads/gitrun/r1").strip()
    assert "Gitrun-Idempotency-Key" in git(gitdir, "log", "-1", "--format=%B", tip)
    res = gitrun("resume", "r1", "-q")
    assert res.code == 0, res.out + res.err
    entries = sorted(p.name for p in receipts.iterdir())
    assert entries == [locks[0].removesuffix(".lock")]
    assert git(gitdir, "rev-parse", f"refs/gitrun/runs/r1/receipts/{entries[0]}").strip() == tip


WITNESS_CALLS = re.compile(r'^\d+\s+(pwrite64|fdatasync)\((\d+)<([^>]*)>(?:, "((?:[^"\\]|\\.)*)")?')


@needs_strace
def test_the_witness_is_synced_before_any_later_checkpoint_can_be_durable(
    gitrun: Gitrun, tmp_path: Path
) -> None:
    """An advance leaves its witness slot's ``fdatasync`` to a background thread (the
    checkpoint is durable; a witness one generation behind is the crash window readers
    admit), so the run's next checkpoint must not be written before that sync is done:
    a power cut could otherwise leave the witness two generations behind its ref, which
    a load refuses as a rollback. Traced: every journal record naming a checkpoint ref
    is written after the witness's last slot write was synced."""
    log = tmp_path / "trace"
    # Two writes back to back (a file, a patch), then the verdict.
    argv = gitrun.argv("run", str(SANDBOXES / "slugify-unicode"), "--run-id", "r1", "-q")
    assert STRACE is not None
    cmd = [STRACE, "-f", "-qq", "-y", "-s", str(1 << 16), "-x", "-e", "trace=pwrite64,fdatasync"]
    # Each deferred sync waits 300 ms first: a checkpoint written without waiting for it
    # would show, where the thread's sync otherwise runs before anything else could.
    env = {**gitrun.env(), faults.DELAY_VAR: "witness_sync_deferred:300"}
    done = subprocess.run(
        [*cmd, "-o", str(log), *argv], env=env, capture_output=True, timeout=120,
        check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-800:]
    witness = f"{gitrun.home}/witness/r1"
    unsynced, checkpoints, problems = False, 0, []
    for line in log.read_text().splitlines():
        m = WITNESS_CALLS.match(line)
        if m is None:
            continue
        call, path, shown = m.group(1), os.path.realpath(m.group(3)), m.group(4)
        if path == os.path.realpath(witness):
            unsynced = call == "pwrite64"
        elif call == "pwrite64" and path.endswith("/gitrun/journal") and shown:
            data = _unescape(shown)
            if len(data) <= REC.size or REC.unpack(data[: REC.size])[0] != REC_MAGIC:
                continue
            replay = journal.Replay()
            journal.decode(data[REC.size : REC.size + REC.unpack(data[: REC.size])[3]], replay)
            if any("/checkpoints/" in name for name in replay.refs):
                checkpoints += 1
                if unsynced:
                    problems.append(f"checkpoint record #{checkpoints} before the witness sync")
    assert checkpoints >= 4  # the first, each intent riding with its write, the verdict
    assert problems == []
