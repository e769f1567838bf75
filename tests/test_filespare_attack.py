"""Hostile attacks on the worktree spares (:mod:`gitrun.adapter.filespare`): a process
racing gitrun swaps the spare (or the temp name it becomes) between gitrun's checks and
its open, so that the open itself is what the plant attacks: a FIFO makes an ``O_WRONLY``
open wait for a reader for ever, a lease taken on the file makes it wait for the lease
break (45 s by default). Neither may hang a step: the open never waits, and anything but
gitrun's own regular file is refused and replaced by a fresh temp file.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gitrun.adapter import filespare, safefs
from gitrun.store import oslock, refmove


def dirs(tmp_path: Path) -> tuple[Path, Path, str]:
    root, gitdir = tmp_path / "wt", tmp_path / "gitdir"
    root.mkdir()
    gitdir.mkdir()
    return root, gitdir, filespare.spare_of(str(gitdir), "m.py")


def write(root: Path, spare: str, data: bytes) -> float:
    start = time.monotonic()
    safefs.write_file(root, "m.py", data, executable=False, spare=spare)
    return time.monotonic() - start


def swapped_after_probe(
    monkeypatch: pytest.MonkeyPatch, spare: str, swap: Callable[[str], None]
) -> None:
    """The racer wins: right after gitrun's probe of the spare, ``swap`` replaces it."""
    real = oslock.unshared

    def probe(name: str, dir_fd: int | None = None) -> bool:
        found = real(name, dir_fd)
        swap(spare)
        return found

    monkeypatch.setattr(filespare, "unshared", probe)


def unblock_later(fifo_of: Callable[[], str | None], after: float) -> threading.Thread:
    """Open the FIFO's read end after ``after`` seconds (so a test that fails does not
    hang for ever: it only takes long)."""

    def run() -> None:
        time.sleep(after)
        name = fifo_of()
        if name is None:
            return
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return
        time.sleep(0.5)
        os.close(fd)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_spare_swapped_for_a_fifo_after_its_probe_does_not_hang_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _, spare = dirs(tmp_path)
    write(root, spare, b"v1\n")
    write(root, spare, b"v2\n")  # a spare kept: the next write reuses it
    assert os.path.lexists(spare)

    def to_fifo(name: str) -> None:
        os.unlink(name)
        os.mkfifo(name)

    swapped_after_probe(monkeypatch, spare, to_fifo)

    def temp_fifo() -> str | None:
        names = [n for n in os.listdir(root) if safefs.is_temp_of(n, "m.py")]
        return str(root / names[0]) if names else None

    unblock_later(temp_fifo, 3.0)
    took = write(root, spare, b"v3\n")
    assert took < 2.0, f"the write waited {took:.1f}s on a FIFO planted as its spare"
    assert (root / "m.py").read_bytes() == b"v3\n"
    assert sorted(os.listdir(root)) == ["m.py"]


def test_a_lease_taken_on_the_spare_after_its_probe_does_not_stall_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read lease (any process owning the file may take one) makes an ``O_WRONLY``
    open wait until the holder lets go or the kernel breaks it (lease-break-time)."""
    root, _, spare = dirs(tmp_path)
    write(root, spare, b"v1\n")
    write(root, spare, b"v2\n")
    held: list[int] = []

    def lease(name: str) -> None:
        fd = os.open(name, os.O_RDONLY)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)  # its break signal: SIGIO, ignored
        held.append(fd)

    swapped_after_probe(monkeypatch, spare, lease)
    old = signal.signal(signal.SIGIO, signal.SIG_IGN)  # the break is sent to this process
    try:
        took = write(root, spare, b"v3\n")
    finally:
        for fd in held:
            os.close(fd)
        signal.signal(signal.SIGIO, old)
    assert took < 2.0, f"the write waited {took:.1f}s for a lease on its spare"
    assert (root / "m.py").read_bytes() == b"v3\n"
    assert sorted(os.listdir(root)) == ["m.py"]


RACER = r"""
import os, sys
spare = sys.argv[1]
reg, fifo = spare + ".r", spare + ".f"
while True:
    try:
        with open(reg, "wb") as f:
            f.write(b"x")
        os.rename(reg, spare)
        os.mkfifo(fifo)
        os.rename(fifo, spare)
    except OSError:
        pass
"""

WRITER = r"""
import os, signal, sys
from pathlib import Path
from gitrun.adapter import safefs
root, spare, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
for i in range(n):
    safefs.write_file(root, "m.py", b"v%d\n" % i, executable=False, spare=spare)
print("done", flush=True)
"""


def test_a_process_racing_the_spare_with_a_fifo_never_hangs_a_write(tmp_path: Path) -> None:
    """Real processes: one alternates a regular file and a FIFO as a path's spare while
    another writes that path again and again (without the fix it hangs within a few
    hundred writes, in the FIFO's open)."""
    root, _, spare = dirs(tmp_path)
    Path(spare).parent.mkdir(parents=True)
    racer = subprocess.Popen([sys.executable, "-c", RACER, spare])
    try:
        time.sleep(0.2)
        writer = subprocess.run(
            [sys.executable, "-c", WRITER, str(root), spare, "3000"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a write hung on the FIFO the racing process swapped in as its spare")
    finally:
        racer.kill()
        racer.wait()
    assert writer.stdout == "done\n", writer.stderr[-800:]
    assert (root / "m.py").read_bytes() == b"v2999\n"
    assert sorted(os.listdir(root)) == ["m.py"]


def test_a_ref_spare_swapped_for_a_fifo_after_its_probe_does_not_hang_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same race against a ref's spare (``<common dir>/gitrun/spare/``), which becomes
    the ref's ``.lock`` the same way: the open waited for a reader with the ref's OS lock
    held, so every other writer of the ref waited 30 s and exited 4."""
    spare, lock = tmp_path / "spare", tmp_path / "ref.lock"
    spare.write_bytes(b"0" * 40 + b"\n")
    real = oslock.unshared

    def probe(name: str, dir_fd: int | None = None) -> bool:
        found = real(name, dir_fd)
        os.unlink(spare)
        os.mkfifo(spare)
        return found

    monkeypatch.setattr(refmove, "unshared", probe)
    unblock_later(lambda: str(lock) if lock.exists() else None, 3.0)
    start = time.monotonic()
    fd = refmove.take_lock(lock, str(spare), 41)
    took = time.monotonic() - start
    assert fd is not None
    try:
        assert os.fstat(fd).st_nlink == 1
        assert os.path.isfile(lock)
        assert not os.path.islink(lock)
    finally:
        os.close(fd)
    assert took < 2.0, f"the lock waited {took:.1f}s on a FIFO planted as the ref's spare"


def test_a_spare_directory_planted_as_a_link_gets_no_file_through_it(tmp_path: Path) -> None:
    """``<worktree git dir>/gitrun-spare`` made a link to a directory elsewhere: gitrun
    must not link the worktree's files into that directory (nor take files from it)."""
    root, gitdir, spare = dirs(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (gitdir / filespare.SPARE_DIR).symlink_to(elsewhere)
    theirs = elsewhere / os.path.basename(spare)
    for n in range(4):
        write(root, spare, f"v{n}\n".encode())
        assert os.listdir(elsewhere) == [], "a worktree file was linked outside the git dir"
    theirs.write_bytes(b"someone's file\n")
    write(root, spare, b"v4\n")
    assert theirs.read_bytes() == b"someone's file\n"
    assert (root / "m.py").read_bytes() == b"v4\n"
