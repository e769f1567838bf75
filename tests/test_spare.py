"""A ref move reuses the file its last move replaced as the ref's next ``.lock``
(``<common dir>/gitrun/spare/``, :func:`gitrun.store.refmove._take_lock`): no inode
allocated, no block freed. An agent that can write the repository's git dir (an
unconfined command) can plant anything there; each test plants it into a real run
killed mid-way, resumes it with the real CLI, and checks the run ends like the
uninterrupted one — and that nothing outside the repository was written through it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import SANDBOXES
from test_crash import RUN_ID, Baseline, Cli, make_baseline, run_invariants

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
