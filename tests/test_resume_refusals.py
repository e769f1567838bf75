"""Resume refuses, with one clear line and exit code 5, and changes nothing, when the
environment is not exactly the checkpointed state (or that state plus the one commit
its pending intent makes), or when the receipt cache and the commits disagree.

Each test crashes a real ``gitrun run`` with ``GITRUN_CRASH_AT``, tampers with the
repository or the worktree the way a user or another tool would, then resumes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import SANDBOXES, Gitrun, git, snapshot

from gitrun.core.errors import Exit

pytestmark = pytest.mark.timeout(120)

RUN = "r"
FAST = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the verifier's pytest: no unrelated plugins


@dataclass(frozen=True)
class Crashed:
    """A run killed at a crash point, and where its pieces live."""

    gitrun: Gitrun
    repo: Path
    worktree: Path
    branch: str
    record: Path

    def rev(self, spec: str) -> str:
        return git(self.repo, "rev-parse", spec).strip()

    def everything(self) -> tuple[object, ...]:
        """Refs, objects, worktree admin files, worktree files and registry: all of it."""
        admin = self.repo / ".git" / "worktrees"
        return (
            snapshot(self.repo),
            files(admin),
            files(self.worktree),
            self.record.read_bytes(),
        )

    def resume(self) -> tuple[int, str, str]:
        result = self.gitrun("resume", RUN, **FAST)
        return result.code, result.out, result.err


def files(root: Path) -> dict[str, bytes]:
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def crash(gitrun: Gitrun, sandbox: str, point: str) -> Crashed:
    result = gitrun("run", str(SANDBOXES / sandbox), "--run-id", RUN, GITRUN_CRASH_AT=point, **FAST)
    assert result.code == -9, f"not killed at {point}: {result.code} {result.err}"
    record_path = gitrun.home / "runs" / f"{RUN}.json"
    record = json.loads(record_path.read_text())
    return Crashed(
        gitrun, Path(record["repo"]), Path(record["worktree"]), record["branch"], record_path
    )


def assert_refused(run: Crashed, reasons: tuple[str, ...], before: tuple[object, ...]) -> str:
    """Exit 5, one line on stderr naming one of ``reasons``, and nothing changed."""
    code, out, err = run.resume()
    lines = err.strip().splitlines()
    assert code == Exit.REFUSED, f"exit {code}: {out} {err}"
    assert len(lines) == 1, f"not one line: {err!r}"
    assert any(f"({reason})" in lines[0] for reason in reasons), lines[0]
    assert "reconciled" not in err + out
    assert run.everything() == before, "a refused resume changed something"
    again = run.resume()  # still refused, for the same reason: nothing was half-repaired
    assert again[0] == Exit.REFUSED
    assert again[2] == err
    return lines[0]


# -- the environment ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sandbox", "point", "path"),
    [
        ("fix-median", "before_verify", "stats/median.py"),
        ("fix-median", "after_intent_checkpoint", "stats/median.py"),
        # the first write's receipt recorded in the second intent's checkpoint
        ("slugify-unicode", "checkpoint_ref_moved:3", "textkit/_unicode.py"),
    ],
)
def test_resume_refuses_the_same_head_with_an_uncommitted_edit(
    gitrun: Gitrun, sandbox: str, point: str, path: str
) -> None:
    run = crash(gitrun, sandbox, point)
    target = run.worktree / path
    target.write_text(target.read_text() + "\n# edited by hand\n")
    line = assert_refused(run, ("uncommitted-edits",), run.everything())
    assert path in line


def test_resume_refuses_an_untracked_new_file_in_the_worktree(gitrun: Gitrun) -> None:
    run = crash(gitrun, "fix-median", "before_verify")
    (run.worktree / "stats" / "notes.txt").write_text("scratch\n")
    line = assert_refused(run, ("uncommitted-edits",), run.everything())
    assert "stats/notes.txt" in line


def test_resume_refuses_a_copy_of_the_worktree_as_another_instance(gitrun: Gitrun) -> None:
    run = crash(gitrun, "fix-median", "before_verify")
    copy = gitrun.home / "elsewhere" / "copy"
    shutil.copytree(run.worktree, copy, symlinks=True)
    record = json.loads(run.record.read_text())
    run.record.write_text(json.dumps({**record, "worktree": str(copy)}, indent=1))
    moved = Crashed(gitrun, run.repo, copy, run.branch, run.record)
    before = (*moved.everything(), files(run.worktree))
    code, _, err = moved.resume()
    assert code == Exit.REFUSED, err
    assert len(err.strip().splitlines()) == 1, err
    assert "(other-instance)" in err
    assert (*moved.everything(), files(run.worktree)) == before


def test_resume_refuses_a_new_worktree_at_the_same_commit(gitrun: Gitrun) -> None:
    run = crash(gitrun, "fix-median", "before_verify")
    fresh = gitrun.home / "elsewhere" / "fresh"
    git(run.repo, "worktree", "add", "--detach", str(fresh), run.rev(run.branch))
    record = json.loads(run.record.read_text())
    run.record.write_text(json.dumps({**record, "worktree": str(fresh)}, indent=1))
    moved = Crashed(gitrun, run.repo, fresh, run.branch, run.record)
    before = (*moved.everything(), files(run.worktree))
    code, _, err = moved.resume()
    assert code == Exit.REFUSED, err
    assert len(err.strip().splitlines()) == 1, err
    assert "(other-instance)" in err
    assert (*moved.everything(), files(run.worktree)) == before


@pytest.mark.parametrize("point", ["before_verify", "after_intent_checkpoint"])
def test_resume_refuses_an_extra_commit_on_the_run_branch(gitrun: Gitrun, point: str) -> None:
    run = crash(gitrun, "fix-median", point)
    checkpointed = run.rev(run.branch)
    (run.worktree / "stats" / "extra.py").write_text("X = 1\n")
    git(run.worktree, "add", "stats/extra.py")
    git(run.worktree, "commit", "-q", "-m", "a commit no intent explains")
    line = assert_refused(run, ("extra-commits",), run.everything())
    assert checkpointed in line


def test_resume_refuses_a_foreign_history_on_the_run_branch(gitrun: Gitrun) -> None:
    run = crash(gitrun, "fix-median", "before_verify")
    base = json.loads(run.record.read_text())["base_commit"]
    tip = run.rev(run.branch)
    foreign = git(
        run.repo,
        "commit-tree",
        "-p",
        base,
        "-m",
        "somebody else's work",
        run.rev(f"{tip}^{{tree}}"),
    ).strip()
    git(run.repo, "update-ref", run.branch, foreign, tip)
    assert_refused(run, ("foreign-history",), run.everything())


def test_resume_refuses_a_branch_moved_backwards(gitrun: Gitrun) -> None:
    run = crash(gitrun, "fix-median", "before_verify")
    tip = run.rev(run.branch)
    git(run.repo, "update-ref", run.branch, run.rev(f"{tip}^"), tip)
    line = assert_refused(run, ("head-moved-backwards",), run.everything())
    assert tip in line


def test_resume_refuses_a_deleted_worktree(gitrun: Gitrun) -> None:
    run = crash(gitrun, "fix-median", "before_verify")
    shutil.rmtree(run.worktree)
    line = assert_refused(run, ("worktree-missing",), run.everything())
    assert str(run.worktree) in line


# -- the receipt cache against the commits ------------------------------------------------

# (sandbox, crash point): the write committed, its receipt not yet in the checkpoint
WINDOW_3 = ("fix-median", "after_file_sync")
# the receipt recorded in the checkpoint (the cache): a receipt rides in the run's next
# checkpoint, here the second intent's, so the sandbox needs two writes
WINDOW_4 = ("slugify-unicode", "checkpoint_ref_moved:3")


def rewrite_tip(run: Crashed, edit: dict[str, str]) -> tuple[str, str]:
    """Replace the branch tip by a copy whose message has ``old`` → ``new`` edits."""
    tip = run.rev(run.branch)
    raw = git(run.repo, "cat-file", "commit", tip)
    for old, new in edit.items():
        assert old in raw, f"{old!r} not in the commit"
        raw = raw.replace(old, new)
    rewritten = subprocess.run(
        ["git", "-C", str(run.repo), "hash-object", "-t", "commit", "-w", "--stdin"],
        input=raw,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    git(run.repo, "update-ref", run.branch, rewritten, tip)
    return tip, rewritten


def trailer(run: Crashed, name: str) -> str:
    return git(
        run.repo, "log", "-1", f"--format=%(trailers:key={name},valueonly)", run.branch
    ).strip()


def index_ref(key: str) -> str:
    return f"refs/gitrun/runs/{RUN}/receipts/{key}"


def assert_no_replay(run: Crashed) -> None:
    before = run.everything()
    code, out, err = run.resume()
    assert code == Exit.REFUSED, f"exit {code}: {out} {err}"
    line = err.strip()
    assert len(line.splitlines()) == 1, err
    assert "drift" in line or "environment refused" in line, line
    assert "reconciled" not in err
    assert "done" not in out
    assert run.everything() == before
    status = run.gitrun("status", RUN, "--json")
    assert json.loads(status.out)["phase"] != "done"


@pytest.mark.parametrize("window", [WINDOW_3, WINDOW_4])
def test_a_write_commit_replaced_by_a_history_rewrite_is_never_replayed(
    gitrun: Gitrun, window: tuple[str, str]
) -> None:
    run = crash(gitrun, *window)
    subject = git(run.repo, "log", "-1", "--format=%s", run.branch).strip()
    rewrite_tip(run, {subject: subject + " (amended)"})
    assert_no_replay(run)


@pytest.mark.parametrize("window", [WINDOW_3, WINDOW_4])
def test_a_write_commit_whose_intent_digest_trailer_was_edited_is_never_replayed(
    gitrun: Gitrun, window: tuple[str, str]
) -> None:
    run = crash(gitrun, *window)
    digest = trailer(run, "Gitrun-Intent-Digest")
    rewrite_tip(
        run, {f"Gitrun-Intent-Digest: {digest}": f"Gitrun-Intent-Digest: {digest[:-4]}beef"}
    )
    assert_no_replay(run)


def test_a_copy_of_the_receipt_with_an_edited_trailer_named_by_the_index_is_never_replayed(
    gitrun: Gitrun,
) -> None:
    """The branch gains a commit carrying the cached receipt's key with another intent
    digest, and the index names it: the cache and the commit differ, so no replay."""
    run = crash(gitrun, *WINDOW_4)
    key = trailer(run, "Gitrun-Idempotency-Key")
    digest = trailer(run, "Gitrun-Intent-Digest")
    tip = run.rev(run.branch)
    raw = git(run.repo, "cat-file", "commit", tip).replace(
        f"Gitrun-Intent-Digest: {digest}", f"Gitrun-Intent-Digest: {digest[:-4]}beef"
    )
    raw = raw.replace(f"parent {run.rev(f'{tip}^')}", f"parent {tip}")
    copy = subprocess.run(
        ["git", "-C", str(run.repo), "hash-object", "-t", "commit", "-w", "--stdin"],
        input=raw,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    git(run.repo, "update-ref", run.branch, copy, tip)
    git(run.repo, "update-ref", index_ref(key), copy, tip)
    assert_no_replay(run)
    assert "(receipt-fields)" in run.resume()[2]


@pytest.mark.parametrize("window", [WINDOW_3, WINDOW_4])
def test_a_receipt_index_pointing_at_another_commit_is_never_replayed(
    gitrun: Gitrun, window: tuple[str, str]
) -> None:
    run = crash(gitrun, *window)
    key = trailer(run, "Gitrun-Idempotency-Key")
    base = json.loads(run.record.read_text())["base_commit"]
    git(run.repo, "update-ref", index_ref(key), base, run.rev(run.branch))
    assert_no_replay(run)
    assert "(index-mismatch)" in run.resume()[2]


def test_a_receipt_index_pointing_at_another_write_of_the_run_is_never_replayed(
    gitrun: Gitrun,
) -> None:
    # the second receipt, riding to the verdict's checkpoint (it has none of its own)
    run = crash(gitrun, "slugify-unicode", "before_verify")
    key = trailer(run, "Gitrun-Idempotency-Key")
    tip = run.rev(run.branch)
    git(run.repo, "update-ref", index_ref(key), run.rev(f"{tip}^"), tip)
    assert_no_replay(run)
    assert "(index-mismatch)" in run.resume()[2]
