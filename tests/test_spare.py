"""A ref move reuses the file its last move replaced as the ref's next ``.lock``
(``<common dir>/gitrun/spare/``, :func:`gitrun.store.refmove.take_lock`): no inode
allocated, no block freed. An agent that can write the repository's git dir (an
unconfined command) can plant anything there; each test plants it into a real run
killed mid-way, resumes it with the real CLI, and checks the run ends like the
uninterrupted one — and that nothing outside the repository was written through it.
"""

from __future__ import annotations

import itertools
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pygit2
import pytest
from conftest import SANDBOXES
from test_crash import RUN_ID, Baseline, Cli, make_baseline, run_invariants

from gitrun.store import gitstore
from gitrun.store.reflocks import spare_file

SANDBOX = "slugify-unicode"  # two writes (a file, a patch), verified, done
VICTIM = b"0123456789012345678901234567890123456789\n"  # a ref's size: 41 bytes


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    return make_baseline(SANDBOX, tmp_path_factory.mktemp("spare-baseline"))


def killed_after_first_write(tmp_path: Path) -> tuple[Cli, Path]:
    """A run SIGKILLed right after its first write; its common dir."""
    cli = Cli.at(tmp_path / "home")
    ran = cli("run", str(SANDBOXES / SANDBOX), "--run-id", RUN_ID, crash_at="after_file_sync")
    assert ran.returncode == -9, ran.stderr[-600:]
    return cli, (cli.repo(SANDBOX) / ".git").resolve()


def spares(gitdir: Path) -> list[Path]:
    return sorted((gitdir / "gitrun" / "spare").iterdir())


def plant_symlink(spare: Path, victim: Path) -> None:
    spare.unlink()
    spare.symlink_to(victim)


def plant_hard_link(spare: Path, victim: Path) -> None:
    spare.unlink()
    os.link(victim, spare)


@pytest.mark.parametrize("plant", [plant_symlink, plant_hard_link], ids=["symlink", "hard-link"])
def test_a_link_planted_as_a_spare_is_never_written_through(
    baseline: Baseline, tmp_path: Path, plant: Callable[[Path, Path], None]
) -> None:
    cli, gitdir = killed_after_first_write(tmp_path)
    planted = spares(gitdir)
    assert planted, "the first write's moves kept no spare"
    victims = []
    for i, spare in enumerate(planted):
        victim = tmp_path / f"victim-{i}"
        victim.write_bytes(VICTIM)  # the spare's size: only the link check stops a write
        plant(spare, victim)
        victims.append(victim)
    resumed = cli("resume", RUN_ID, "-q")
    assert resumed.returncode == baseline.code, resumed.stderr[-800:]
    assert [v.read_bytes() for v in victims] == [VICTIM] * len(victims)
    assert run_invariants(baseline, RUN_ID, cli) == []


def test_a_spare_still_linked_as_its_ref_is_not_overwritten_in_place(
    baseline: Baseline, tmp_path: Path
) -> None:
    """A kill between keeping the ref's file and the rename leaves the spare linked to
    the live ref: writing the lock in place would change the ref before its commit point."""
    cli, gitdir = killed_after_first_write(tmp_path)
    branch = gitdir / "refs" / "heads" / "gitrun" / RUN_ID
    before = branch.read_bytes()
    for spare in spares(gitdir):
        spare.unlink()
    spare = Path(spare_file(gitdir, f"refs/heads/gitrun/{RUN_ID}"))
    os.link(branch, spare)
    inode = branch.stat().st_ino
    resumed = cli("resume", RUN_ID, "-q")
    assert resumed.returncode == baseline.code, resumed.stderr[-800:]
    assert run_invariants(baseline, RUN_ID, cli) == []
    # The old branch file (its inode) still holds the old value: nothing wrote into it.
    kept = [p for p in (gitdir / "gitrun" / "spare").iterdir() if p.stat().st_ino == inode]
    assert [p.read_bytes() for p in kept] in ([], [before])


def commits(tmp_path: Path, n: int) -> tuple[pygit2.Repository, list[pygit2.Oid]]:
    """A real repository (git init, one commit) opened as gitrun opens it, and ``n``
    commits on top of its HEAD, none of them named by a ref yet."""
    work = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    (work / "f.txt").write_text("x\n")
    subprocess.run(["git", "-C", str(work), "add", "f.txt"], check=True)
    subprocess.run(["git", "-C", str(work), "commit", "-qm", "base"], check=True)
    repo = gitstore.open_repo(work)
    sig = pygit2.Signature("t", "t@invalid", 1, 0)
    head = repo.head.peel(pygit2.Commit)
    out, tree = [head.id], head.tree_id
    for i in range(n):
        out.append(repo.create_commit(None, sig, sig, f"c{i}\n", tree, [out[-1]]))
    return repo, out


def test_a_ref_move_reuses_the_file_the_move_before_it_replaced(tmp_path: Path) -> None:
    repo, ids = commits(tmp_path, 3)
    ref = Path(repo.path) / "refs" / "heads" / "work"
    gitstore.transaction(repo).move("refs/heads/work", None, ids[0]).commit()
    first = ref.stat().st_ino
    gitstore.transaction(repo).move(
        "refs/heads/work", ids[0], ids[1]
    ).commit()  # keeps `first` as spare
    gitstore.transaction(repo).move(
        "refs/heads/work", ids[1], ids[2]
    ).commit()  # and writes into it
    assert ref.stat().st_ino == first
    assert ref.read_text() == f"{ids[2]}\n"
    assert subprocess.run(
        ["git", "-C", str(tmp_path / "repo"), "rev-parse", "work"],
        capture_output=True, text=True, check=True,
    ).stdout.strip() == str(ids[2])  # fmt: skip


def test_a_reader_holding_the_refs_old_file_open_never_sees_a_later_value(
    tmp_path: Path,
) -> None:
    """A reader that opened the ref's file before a move replaced it (and has not read it
    yet) reads the value it opened: that file is not reused while anyone has it open."""
    repo, ids = commits(tmp_path, 5)
    ref = Path(repo.path) / "refs" / "heads" / "work"
    gitstore.transaction(repo).move("refs/heads/work", None, ids[0]).commit()
    gitstore.transaction(repo).move("refs/heads/work", ids[0], ids[1]).commit()
    held = os.open(ref, os.O_RDONLY)  # the file holding ids[1], opened, not yet read
    try:
        for old, new in itertools.pairwise(ids[1:]):
            gitstore.transaction(repo).move("refs/heads/work", old, new).commit()
        assert ref.read_text() == f"{ids[5]}\n"
        assert os.pread(held, 100, 0) == f"{ids[1]}\n".encode()
    finally:
        os.close(held)
