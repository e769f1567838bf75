"""Power cuts by an outside tool: real runs on LazyFS, cut at random moments.

LazyFS (a FUSE file system, github.com/dsrhaslab/lazyfs) keeps every written byte in its
own cache until it is fsynced; ``lazyfs::clear-cache`` drops whatever was not. A power
cut here is what docs/design.md §6 says one is: the gitrun process SIGKILLed at a random
moment, every unsynced byte dropped, LazyFS killed and the file system mounted again,
and the next process started under a new boot id. Unlike ``tests/test_journal.py``'s
emulation this decides nothing about which files a cut takes: the kernel and LazyFS do.

What LazyFS cannot model (see docs/design.md §6): it loses data, not names (a rename
that reached the backing directory stays), and it never sees ``syncfs`` (FUSE passes
only fsync and fdatasync). So the test writes through (``lazyfs::cache-checkpoint``)
exactly where gitrun relies on ``syncfs``: after the run's set-up (a new worktree is
made durable by one), after each recovery (which ends with one), and after the resume
that repairs the worktree files a cut took (one before the recovery's note goes); the
cuts fall in the steps between, where one ``fdatasync`` of the journal is all there is.

Every step acknowledged before a cut (``committed <commit> for <key>`` on stderr) must be
on the run's branch afterwards, as that very commit, exactly once; the run then ends as
an uninterrupted one does (same tree, each key once, ``git fsck --strict`` clean).

The test needs the ``lazyfs`` binary (``GITRUN_LAZYFS``: ``.ci/run`` builds it when
LazyFS's source is there), ``/dev/fuse`` and ``fusermount3``; it is skipped otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SANDBOXES
from test_crash import Cli

from gitrun.store import journal

LAZYFS = os.environ.get("GITRUN_LAZYFS", "")
CUTS = int(os.environ.get("GITRUN_LAZYFS_CUTS", "4"))
RUN_ID = "lazy"
SANDBOX = "slugify-unicode"
EXTRA_WRITES = 8  # written after the sandbox's own two steps: the cuts have steps to hit
ACK = re.compile(r"committed ([0-9a-f]{12}) for (k-[0-9a-f]{32})")

pytestmark = pytest.mark.skipif(
    not (
        LAZYFS
        and os.access(LAZYFS, os.X_OK)
        and os.path.exists("/dev/fuse")
        and shutil.which("fusermount3")
    ),
    reason="LazyFS is not built here (GITRUN_LAZYFS names its binary; .ci/run builds it)",
)


class LazyFS:
    """One LazyFS mount of ``root`` at ``mnt``, commanded through its fifo."""

    def __init__(self, base: Path) -> None:
        self.root, self.mnt = base / "backing", base / "mnt"
        self.fifo, self.done = base / "faults.fifo", base / "done.fifo"
        # LazyFS takes a config path holding "-o" (any case: pytest's "pytest-of-root")
        # for a mount option and falls back to its default: keep it in a plain directory.
        self.plain = Path(tempfile.mkdtemp(prefix="gitrunlazyfs"))
        self.config = self.plain / "lazyfs.toml"
        self.log = base / "lazyfs.log"
        for d in (self.root, self.mnt):
            d.mkdir()
        os.mkfifo(self.fifo)
        os.mkfifo(self.done)
        self.config.write_text(
            f'[faults]\nfifo_path="{self.fifo}"\nfifo_path_completed="{self.done}"\n'
            '[cache]\napply_eviction=false\n'
            '[cache.simple]\ncustom_size="256mb"\nblocks_per_page=1\n'
            '[filesystem]\nlog_all_operations=false\nlogfile=""\n'
        )  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.answers = -1

    def mount(self) -> None:
        # LazyFS's command worker opens the answer fifo for writing at start: with no
        # reader it would wait there for ever and read no command. One is kept open.
        self.answers = os.open(self.done, os.O_RDONLY | os.O_NONBLOCK)
        args = [LAZYFS, str(self.mnt), "--config-path", str(self.config), "-o", "allow_other"]
        args += ["-o", "modules=subdir", "-o", f"subdir={self.root}", "-f"]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while not os.path.ismount(self.mnt):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"LazyFS did not mount: {self.log.read_text()[-600:]}")
            time.sleep(0.05)

    def send(self, cmd: str) -> None:
        with self.fifo.open("w") as f:
            f.write(f"lazyfs::{cmd}\n")

    def clear_cache(self) -> None:
        """Drop every unsynced byte; LazyFS says when it is done."""
        self.send("clear-cache")
        said, deadline = b"", time.monotonic() + 60
        while b"finished::clear-cache" not in said:
            if time.monotonic() > deadline:
                raise RuntimeError(f"LazyFS answered {said!r} to clear-cache in 60 s")
            select.select([self.answers], [], [], 1.0)
            with contextlib.suppress(BlockingIOError):
                said += os.read(self.answers, 4096)
            time.sleep(0.01)  # no writer yet reads as an empty end of file

    def write_through(self) -> None:
        """Every cached byte written to the backing files (what a ``syncfs`` would do).
        LazyFS does not answer this command: done when every file reads the same
        through the mount and in the backing directory (nothing else writes then)."""
        self.send("cache-checkpoint")
        deadline = time.monotonic() + 60
        while not same_files(self.mnt, self.root):
            if time.monotonic() > deadline:
                raise RuntimeError("LazyFS did not write its cache through in 60 s")
            time.sleep(0.1)

    def cut(self) -> None:
        """Every unsynced byte dropped, LazyFS gone, the mount point free again."""
        self.clear_cache()
        self.unmount(kill=True)

    def unmount(self, *, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True, check=False)
        self.proc = None
        if self.answers >= 0:
            os.close(self.answers)
            self.answers = -1

    def close(self) -> None:
        self.unmount()
        shutil.rmtree(self.plain, ignore_errors=True)


@pytest.fixture
def lazyfs(tmp_path: Path) -> Iterator[LazyFS]:
    fs = LazyFS(tmp_path)
    fs.mount()
    yield fs
    fs.close()


def make_task(dest: Path) -> Path:
    """The slugify sandbox with ``EXTRA_WRITES`` more ``write_file`` steps."""
    shutil.copytree(SANDBOXES / SANDBOX, dest, symlinks=True)
    steps = "".join(
        f'\n[[step]]\nkind = "write_file"\npath = "textkit/notes/n{i}.py"\n'
        f'content = "NOTE = {i}  # {"x" * 2000}\\n"\ndescription = "note {i}"\n'
        for i in range(EXTRA_WRITES)
    )
    (dest / "plan.toml").write_text((dest / "plan.toml").read_text() + steps)
    task = dest / "task.toml"
    task.write_text(task.read_text().replace("max_steps = 10", "max_steps = 20"))
    return dest


def booted(cli: Cli, boot: str) -> Cli:
    return Cli(cli.home, {**cli.env, journal.TEST_BOOT_VAR: boot})


def branch(cli: Cli) -> list[tuple[str, str]]:
    """(commit, idempotency key) of every write on the run's branch, oldest first."""
    repo = cli.home / "repos" / SANDBOX
    fmt = "%H %(trailers:key=Gitrun-Idempotency-Key,valueonly,separator=)"
    out = subprocess.run(
        ["git", "-C", str(repo), "log", "--reverse", f"--format={fmt}", f"gitrun/{RUN_ID}"],
        capture_output=True, text=True, check=True, timeout=60, env=cli.env,
    ).stdout  # fmt: skip
    pairs = [tuple(line.split(" ", 1)) for line in out.splitlines() if " " in line]
    return [(c, k.strip()) for c, k in pairs if k.strip()]


def same_files(a: Path, b: Path) -> bool:
    """Every regular file under ``a`` has the same bytes at its place under ``b``."""
    for path in a.rglob("*"):
        if path.is_file() and not path.is_symlink():
            twin = b / path.relative_to(a)
            with contextlib.suppress(OSError):
                if path.read_bytes() == twin.read_bytes():
                    continue
            return False
    return True


def contents(root: Path) -> dict[str, bytes]:
    """Every regular file's bytes under ``root``, by its path inside it (a cut leaves a
    file's size and zeroes what was not synced: sizes alone would not show it)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


def tree_of(cli: Cli) -> str:
    repo = cli.home / "repos" / SANDBOX
    return subprocess.run(
        ["git", "-C", str(repo), "rev-parse", f"gitrun/{RUN_ID}^{{tree}}"],
        capture_output=True, text=True, check=True, timeout=60, env=cli.env,
    ).stdout.strip()  # fmt: skip


def run_until_cut(cli: Cli, rng: random.Random) -> tuple[str, bool]:
    """``gitrun resume`` SIGKILLed at a random moment inside its steps: a random number
    of its step lines (an intent, a commit) in, then a random 0-30 ms more. Its stderr,
    and whether it finished first (then it must have ended the run)."""
    proc = subprocess.Popen(
        cli.argv("resume", RUN_ID), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, env=cli.env, cwd=cli.home.parent,
    )  # fmt: skip
    if proc.stderr is None:
        raise RuntimeError("no pipe")
    lines, wanted = [], rng.randint(1, 4)
    try:
        while wanted:
            line = proc.stderr.readline()
            if not line:
                break  # it ended
            lines.append(line)
            wanted -= " intent " in line or " committed " in line
        if not wanted:
            time.sleep(rng.uniform(0.0, 0.03))
            proc.kill()
        lines.append(proc.stderr.read())
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
        proc.stderr.close()
    err = "".join(lines)
    if proc.returncode != -signal.SIGKILL:
        assert proc.returncode == 0, err[-800:]
        return err, True
    return err, False


def test_power_cuts_at_random_moments_on_lazyfs_lose_no_acknowledged_step_and_repeat_none(
    lazyfs: LazyFS, tmp_path: Path
) -> None:
    rng = random.Random(int(os.environ.get("GITRUN_LAZYFS_SEED", "2929")))
    plain = Cli.at(tmp_path / "plain" / "home")  # the same run, uninterrupted, off LazyFS
    task = make_task(tmp_path / "plain" / "task")
    ran = plain("run", str(task), "--run-id", RUN_ID, "-q")
    assert ran.returncode == 0, ran.stderr[-800:]
    task = make_task(lazyfs.mnt / "task")
    cli = booted(Cli.at(lazyfs.mnt / "home"), str(uuid.uuid4()))
    # The set-up and the first step, then written through (a new worktree is made
    # durable by a syncfs, which LazyFS does not see).
    first = cli("run", str(task), "--run-id", RUN_ID, crash_at="before_propose:2")
    assert first.returncode == -signal.SIGKILL, first.stderr[-800:]
    acked = ACK.findall(first.stderr)
    assert len(acked) == 1, first.stderr
    lazyfs.write_through()

    cuts, bites = 0, 0
    while cuts < CUTS:
        err, finished = run_until_cut(cli, rng)
        acked += ACK.findall(err)
        if finished:
            break
        cuts += 1
        before = contents(lazyfs.mnt / "home")
        lazyfs.cut()
        lazyfs.mount()
        bites += contents(lazyfs.mnt / "home") != before
        cli = booted(cli, str(uuid.uuid4()))
        # The first process after the reboot recovers (and ends with a syncfs, which
        # LazyFS does not see: written through here).
        shown = cli("status", RUN_ID, "--json")
        assert shown.returncode == 0, shown.stderr[-800:]
        lazyfs.write_through()
        # The next resume repairs the worktree files the cut took and makes the repair
        # durable with a syncfs before it drops the recovery's note: it runs to its first
        # proposal (past the repair), and what it wrote is written through likewise.
        repaired = cli("resume", RUN_ID, crash_at="before_propose:1")
        acked += ACK.findall(repaired.stderr)
        if repaired.returncode == 0:
            break  # nothing was left to propose: the run ended
        assert repaired.returncode == -signal.SIGKILL, repaired.stderr[-800:]
        lazyfs.write_through()
    else:
        done = cli("resume", RUN_ID)
        acked += ACK.findall(done.stderr)
        assert done.returncode == 0, done.stderr[-800:]

    writes = branch(cli)
    keys = Counter(k for _, k in writes)
    assert [k for k, n in keys.items() if n > 1] == [], "a write applied twice"
    assert len(writes) == 2 + EXTRA_WRITES, writes
    on_branch = {k: c[:12] for c, k in writes}
    lost = [(c, k) for c, k in acked if on_branch.get(k) != c]
    assert lost == [], f"acknowledged steps lost or changed by a cut: {lost}"
    info = json.loads(cli("status", RUN_ID, "--json").stdout)
    assert info["phase"] == "done", info
    assert tree_of(cli) == tree_of(plain)
    repo = cli.home / "repos" / SANDBOX
    fsck = subprocess.run(
        ["git", "-C", str(repo), "fsck", "--strict"], capture_output=True, text=True,
        timeout=120, env=cli.env, check=False,
    )  # fmt: skip
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    assert cuts == 0 or bites > 0, "no cut took anything: the test would not see a loss"
