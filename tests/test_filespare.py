"""A worktree file's write reuses the file its last write replaced as its temp file
(``<worktree git dir>/gitrun-spare/``, :mod:`gitrun.adapter.filespare`): no inode
allocated, no block freed. The agent can write that directory; each attack plants
something there in a real run killed mid-way, resumes it with the real CLI, and checks
the run ends like the uninterrupted one and nothing was written through the plant.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import SANDBOXES
from test_crash import RUN_ID, Baseline, Cli, make_baseline, run_invariants

from gitrun.adapter import filespare, safefs

SANDBOX = "slugify-unicode"  # a new file, then a patch of existing files, verified, done
VICTIM = b"the user's own file\n"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    return make_baseline(SANDBOX, tmp_path_factory.mktemp("filespare-baseline"))


def killed_after_first_write(tmp_path: Path) -> tuple[Cli, Path, list[str]]:
    """A run SIGKILLed right after its first write: its worktree's git dir and the
    files the rest of the run may write."""
    cli = Cli.at(tmp_path / "home")
    ran = cli("run", str(SANDBOXES / SANDBOX), "--run-id", RUN_ID, crash_at="after_file_sync")
    assert ran.returncode == -9, ran.stderr[-600:]
    gitdirs = sorted((cli.repo(SANDBOX) / ".git" / "worktrees").iterdir())
    assert len(gitdirs) == 1, gitdirs
    files = cli.git(cli.repo(SANDBOX), "ls-files").stdout.split()
    assert files
    return cli, gitdirs[0], files


def plant_symlink(spare: Path, victim: Path) -> None:
    spare.symlink_to(victim)


def plant_hard_link(spare: Path, victim: Path) -> None:
    os.link(victim, spare)


def plant_fifo(spare: Path, victim: Path) -> None:
    del victim
    os.mkfifo(spare)  # opening it for reading would wait for a writer for ever


@pytest.mark.parametrize(
    "plant", [plant_symlink, plant_hard_link, plant_fifo], ids=["symlink", "hard-link", "fifo"]
)
def test_a_file_planted_as_a_worktree_spare_is_never_written_through(
    baseline: Baseline, tmp_path: Path, plant: Callable[[Path, Path], None]
) -> None:
    cli, gitdir, files = killed_after_first_write(tmp_path)
    victims = []
    for i, path in enumerate(files):
        spare = Path(filespare.spare_of(str(gitdir), path))
        spare.parent.mkdir(parents=True, exist_ok=True)
        spare.unlink(missing_ok=True)
        victim = tmp_path / f"victim-{i}"
        victim.write_bytes(VICTIM)
        plant(spare, victim)
        victims.append(victim)
    resumed = cli("resume", RUN_ID, "-q", timeout=60)
    assert resumed.returncode == baseline.code, resumed.stderr[-800:]
    assert [v.read_bytes() for v in victims] == [VICTIM] * len(victims)
    assert run_invariants(baseline, RUN_ID, cli) == []


def write(root: Path, gitdir: Path, path: str, data: bytes) -> None:
    spare = filespare.spare_of(str(gitdir), path)
    safefs.write_file(root, path, data, executable=False, spare=spare)


def test_a_path_rewritten_goes_back_and_forth_between_two_files(tmp_path: Path) -> None:
    root, gitdir = tmp_path / "wt", tmp_path / "gitdir"
    root.mkdir()
    gitdir.mkdir()
    write(root, gitdir, "pkg/m.py", b"one, and longer than what follows\n")
    first = (root / "pkg/m.py").stat().st_ino
    write(root, gitdir, "pkg/m.py", b"two\n")  # keeps `first` as the spare
    second = (root / "pkg/m.py").stat().st_ino
    write(root, gitdir, "pkg/m.py", b"three\n")  # and writes into it
    assert (root / "pkg/m.py").stat().st_ino == first != second
    assert (root / "pkg/m.py").read_bytes() == b"three\n"  # the longer old bytes cut off
    assert sorted(os.listdir(root / "pkg")) == ["m.py"]  # no temp file left, hidden or not


def test_a_reader_holding_the_old_file_open_keeps_what_it_opened(tmp_path: Path) -> None:
    """An agent's reader (or its mmap) of the path's old content is not overwritten: a
    spare some process has open is never reused."""
    root, gitdir = tmp_path / "wt", tmp_path / "gitdir"
    root.mkdir()
    gitdir.mkdir()
    write(root, gitdir, "m.py", b"v1\n")
    held = os.open(root / "m.py", os.O_RDONLY)  # v1's file, opened, not read yet
    try:
        for n in range(2, 6):
            write(root, gitdir, "m.py", f"v{n}\n".encode())
        assert (root / "m.py").read_bytes() == b"v5\n"
        assert os.pread(held, 100, 0) == b"v1\n"
    finally:
        os.close(held)


def test_a_spare_still_linked_as_the_worktree_file_is_not_written_in_place(
    tmp_path: Path,
) -> None:
    """A kill between keeping the file and the rename leaves the spare linked to the live
    file: writing it in place would change the worktree before the write's rename."""
    root, gitdir = tmp_path / "wt", tmp_path / "gitdir"
    root.mkdir()
    gitdir.mkdir()
    write(root, gitdir, "m.py", b"v1\n")
    spare = Path(filespare.spare_of(str(gitdir), "m.py"))
    spare.parent.mkdir(parents=True, exist_ok=True)
    spare.unlink(missing_ok=True)
    os.link(root / "m.py", spare)
    live = (root / "m.py").stat().st_ino
    write(root, gitdir, "m.py", b"v2\n")
    assert (root / "m.py").read_bytes() == b"v2\n"
    assert (root / "m.py").stat().st_ino != live  # a fresh file, not the linked one
    kept = [p for p in spare.parent.iterdir() if p.stat().st_ino == live]
    assert [p.read_bytes() for p in kept] in ([], [b"v1\n"])
