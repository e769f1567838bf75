"""Issue 9 item 4: a rolled-back checkpoint ref is refused, because a witness outside the
repository remembers the high-water mark.

A checkpoint's HMAC proves who wrote it, not that it is the newest. Every test here
does what a hostile agent with git in its worktree can do (``git update-ref`` on the
checkpoint ref, ``git reset --hard`` of the branch, dropping receipt index refs, putting
consumed evidence back in the inbox) or what a broken disk does to the witness, through
real git and the real CLI, and checks the refusal and that the repository is unchanged.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import SANDBOXES, Gitrun, Result, git, relocate_workspace, snapshot
from helpers import CLI_ENV, Keys, Templates, hermetic, make_run

from gitrun.core.errors import Exit
from gitrun.store.witness import SLOT_SIZE

pytestmark = pytest.mark.timeout(120)

RUN = "w"
TASK = "fix-median"
RISKY = "retire-legacy"
KILLED = -9


@dataclass(frozen=True)
class Ws:
    """A private, relocated copy of a workspace holding one run."""

    home: Path
    task: str

    @property
    def repo(self) -> Path:
        return self.home / "repos" / self.task

    @property
    def worktree(self) -> Path:
        return self.home / "worktrees" / RUN

    @property
    def witness(self) -> Path:
        return self.home / "witness" / RUN

    def cli(self, *args: str, **extra: str) -> Result:
        return Gitrun(self.home)(*args, **CLI_ENV, **extra)

    def ref(self) -> str:
        out = git(self.repo, "for-each-ref", "--format=%(refname)", f"refs/gitrun/runs/{RUN}/")
        (ref,) = [r for r in out.split() if "/checkpoints/" in r]
        return ref

    def generation(self, rev: str) -> int:
        out = git(
            self.repo, "log", "-1", "--format=%(trailers:key=Gitrun-Checkpoint,valueonly)", rev
        )
        return int(out.strip())

    def slots(self) -> list[dict[str, object]]:
        raw = self.witness.read_bytes()
        out = []
        for i in (0, 1):
            body = raw[i * SLOT_SIZE : (i + 1) * SLOT_SIZE].rstrip(b"\0")
            out.append(json.loads(body.partition(b"\n")[0]) if body else {})
        return out


@pytest.fixture(scope="module")
def done_home(templates: Templates) -> Path:
    return templates.run(SANDBOXES / TASK, RUN, Exit.DONE).home


@pytest.fixture
def ws(done_home: Path, tmp_path: Path) -> Ws:
    relocate_workspace(done_home, tmp_path / "ws")
    return Ws(tmp_path / "ws", TASK)


def _refused(res: Result, reason: str, *named: str) -> str:
    """Exit 5, one line naming the reason and every given fact, no traceback."""
    assert res.code == Exit.REFUSED, (res.code, res.out, res.err)
    lines = res.err.strip().splitlines()
    assert len(lines) == 1, res.err
    assert lines[0].startswith(f"gitrun: checkpoint rejected ({reason}): "), res.err
    for fact in named:
        assert fact in lines[0], (fact, lines[0])
    return lines[0]


def _both_refuse(ws: Ws, reason: str, *named: str) -> None:
    """`checkpoint verify` and `resume` refuse alike, and nothing in the repository moves."""
    before = snapshot(ws.repo)
    witness = ws.witness.read_bytes() if ws.witness.exists() else None
    _refused(ws.cli("checkpoint", "verify", RUN), reason, *named)
    _refused(ws.cli("resume", RUN), reason, *named)
    assert snapshot(ws.repo) == before
    assert (ws.witness.read_bytes() if ws.witness.exists() else None) == witness


# -- rollback ----------------------------------------------------------------------------


def test_rolling_the_checkpoint_ref_back_to_its_parent_is_refused_by_verify_and_resume(
    ws: Ws,
) -> None:
    ref = ws.ref()
    newest = git(ws.repo, "rev-parse", ref).strip()
    top = ws.generation(ref)
    git(ws.repo, "update-ref", ref, f"{ref}^")  # an older, validly signed generation
    _both_refuse(ws, "rolled-back", f"generation {top - 1} ", f"generation {top} ", newest)
    line = _refused(ws.cli("checkpoint", "verify", RUN), "rolled-back")
    assert f"git update-ref {ref} {newest}" in line  # what to do
    # Doing what it says restores the run.
    git(ws.repo, "update-ref", ref, newest)
    ok = ws.cli("checkpoint", "verify", RUN)
    assert ok.code == 0, ok.err
    assert f"generation {top} (done)" in ok.out


def test_rolling_back_further_is_refused_too_and_status_names_it(ws: Ws) -> None:
    ref = ws.ref()
    git(ws.repo, "update-ref", ref, f"{ref}~2")
    _both_refuse(ws, "rolled-back")
    status = ws.cli("status", RUN, "--json")
    assert status.code == 0, status.err
    assert "rolled-back" in json.loads(status.out)["checkpoint_error"]


def test_deleting_the_checkpoint_ref_and_resetting_the_branch_never_restarts_the_run(
    ws: Ws,
) -> None:
    """Without a witness, a run with no checkpoint ref and its branch at the base looks
    like one killed before its first checkpoint, and resume would start it afresh."""
    ref = ws.ref()
    newest = git(ws.repo, "rev-parse", ref).strip()
    record = json.loads((ws.home / "runs" / f"{RUN}.json").read_text())
    git(ws.worktree, "reset", "-q", "--hard", record["base_commit"])
    git(ws.repo, "update-ref", "-d", ref)
    before = snapshot(ws.repo)
    res = ws.cli("resume", RUN)
    _refused(res, "high-water-mark-missing", newest)
    assert snapshot(ws.repo) == before


# -- the attack: a consumed approval nonce comes back through a rollback ----------


@pytest.fixture(scope="module")
def approved_home(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> tuple[Path, Path]:
    """retire-legacy frozen at its risky delete, approved by alice, resumed to done."""
    base = tmp_path_factory.mktemp("approved")
    home = make_run(base, SANDBOXES / RISKY, RUN, Exit.FROZEN).home
    with hermetic(base / "user"):
        cli = Gitrun(home)
        approve = cli("approve", RUN, "--key", str(keys["alice"]), **CLI_ENV)
        assert approve.code == 0, approve.err
        inbox = home / "inbox-evidence"
        repo = home / "repos" / RISKY
        inbox.write_text(git(repo, "rev-parse", f"refs/gitrun/runs/{RUN}/inbox/approval"))
        done = cli("resume", RUN, "--trust-roots", str(keys.roots), **CLI_ENV)
        assert done.code == Exit.DONE, done.err
    return home, keys.roots


def _delete_commits(repo: Path) -> list[str]:
    """Every commit object of the risky delete, reachable or not (gitrun's stage, which
    holds what no ref names yet, included)."""
    stage = {"GIT_ALTERNATE_OBJECT_DIRECTORIES": str(repo / ".git" / "gitrun" / "stage")}

    def run(*args: str) -> str:
        env = {**os.environ, **stage}
        cmd = ["git", "-C", str(repo), *args]
        return subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout

    out = run("cat-file", "--batch-all-objects", "--batch-check=%(objectname) %(objecttype)")
    commits = [line.split()[0] for line in out.splitlines() if line.endswith(" commit")]
    subject = "gitrun: delete_file units/legacy.py"
    return [c for c in commits if run("log", "-1", "--format=%s", c).strip() == subject]


def test_replaying_a_consumed_approval_through_a_rollback_is_refused_and_writes_nothing(
    approved_home: tuple[Path, Path], tmp_path: Path
) -> None:
    home, roots = approved_home
    relocate_workspace(home, tmp_path / "ws")
    ws = Ws(tmp_path / "ws", RISKY)
    ref = ws.ref()
    (delete,) = _delete_commits(ws.repo)
    # The generation frozen at the approval: its pending delete has no evidence yet.
    frozen = next(
        f"{ref}~{n}"
        for n in range(ws.generation(ref))
        if '"phase":"awaiting_approval"' in git(ws.repo, "log", "-1", "--format=%B", f"{ref}~{n}")
    )
    frozen_gen = ws.generation(frozen)
    # The agent's rollback: branch and files back before the delete, the receipt index
    # of the delete dropped, the checkpoint ref on the frozen generation, the consumed
    # approval put back in the inbox.
    git(ws.worktree, "reset", "-q", "--hard", "HEAD^")
    for name in git(ws.repo, "for-each-ref", "--format=%(refname)", "refs/gitrun/").split():
        if f"{RUN}/receipts/" in name and git(ws.repo, "rev-parse", name).strip() == delete:
            git(ws.repo, "update-ref", "-d", name)
    git(ws.repo, "update-ref", ref, frozen)
    evidence = (ws.home / "inbox-evidence").read_text().strip()
    git(ws.repo, "update-ref", f"refs/gitrun/runs/{RUN}/inbox/approval", evidence)
    before = snapshot(ws.repo)

    res = ws.cli("resume", RUN, "--trust-roots", str(roots))
    # the witness is at the verdict: frozen, approval, then the verdict (the delete's
    # receipt rode in it: a step has no receipt checkpoint of its own)
    _refused(res, "rolled-back", f"generation {frozen_gen} ", f"generation {frozen_gen + 2} ")
    assert snapshot(ws.repo) == before  # no second write commit, no checkpoint, nothing
    assert _delete_commits(ws.repo) == [delete]
    assert (ws.worktree / "units" / "legacy.py").is_file()  # the rolled-back file stays


# -- the witness itself: tampered, torn, deleted ----------------------------------------


def _rewrite_slot(ws: Ws, index: int, doc: dict[str, object]) -> None:
    """Replace one slot with ``doc`` and a correct checksum: what someone without the
    key, who has read this module, would write."""
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    slot = (body + b"\n" + hashlib.sha256(body).hexdigest().encode() + b"\n").ljust(
        SLOT_SIZE, b"\0"
    )
    raw = bytearray(ws.witness.read_bytes())
    raw[index * SLOT_SIZE : (index + 1) * SLOT_SIZE] = slot
    ws.witness.write_bytes(bytes(raw))


def test_a_witness_slot_rewritten_without_the_key_is_refused_as_forged(ws: Ws) -> None:
    ref = ws.ref()
    top = ws.generation(ref)
    older = ws.slots()[(top - 1) % 2]
    assert older["generation"] == top - 1
    # Lower the newest slot to the parent's commit so that a rollback would match it.
    forged = {**ws.slots()[top % 2], "commit": older["commit"]}
    _rewrite_slot(ws, top % 2, forged)
    git(ws.repo, "update-ref", ref, f"{ref}^")
    _both_refuse(ws, "witness-forged", str(ws.witness))


def test_a_damaged_older_slot_is_refused_as_no_crash_leaves_one_behind(ws: Ws) -> None:
    top = ws.generation(ws.ref())
    raw = bytearray(ws.witness.read_bytes())
    raw[((top - 1) % 2) * SLOT_SIZE + 20] ^= 0x01  # one flipped bit, checksum now fails
    ws.witness.write_bytes(bytes(raw))
    _both_refuse(ws, "witness-corrupt", str(ws.witness))


def test_a_damaged_newest_slot_reads_as_a_torn_write_it_is_repaired_but_admits_no_rollback(
    ws: Ws,
) -> None:
    ref = ws.ref()
    top = ws.generation(ref)
    pristine = ws.witness.read_bytes()
    raw = bytearray(pristine)
    raw[(top % 2) * SLOT_SIZE + 20] ^= 0x01
    ws.witness.write_bytes(bytes(raw))
    # With the ref rolled back onto the slot that survived: refused.
    newest = git(ws.repo, "rev-parse", ref).strip()
    git(ws.repo, "update-ref", ref, f"{ref}^")
    _both_refuse(ws, "witness-corrupt", str(ws.witness))
    # With the ref where it was, this is the torn write of a crash: rolled forward.
    git(ws.repo, "update-ref", ref, newest)
    ok = ws.cli("checkpoint", "verify", RUN)
    assert ok.code == 0, ok.err
    assert ws.witness.read_bytes() == pristine


def test_a_deleted_witness_is_refused_and_never_recreated(ws: Ws) -> None:
    top = ws.generation(ws.ref())
    ws.witness.unlink()
    _both_refuse(ws, "witness-missing", f"generation {top} ", str(ws.witness))
    assert not ws.witness.exists()


def test_a_truncated_witness_is_refused(ws: Ws) -> None:
    ws.witness.write_bytes(ws.witness.read_bytes()[:SLOT_SIZE])
    _both_refuse(ws, "witness-corrupt", str(ws.witness))


def test_the_witness_never_holds_the_key(ws: Ws) -> None:
    ring = json.loads((ws.home / "keys" / "checkpoint.keyring").read_text())
    raw = ws.witness.read_bytes()
    for secret_hex in ring["keys"].values():
        secret = bytes.fromhex(secret_hex)
        for form in (
            secret,
            secret_hex.encode(),
            secret_hex.upper().encode(),
            base64.b64encode(secret),
            base64.urlsafe_b64encode(secret),
            base64.b64encode(secret).rstrip(b"="),
        ):
            assert form not in raw
    assert ws.slots()[0]["key_id"] in ring["keys"]


# -- a human's recovery ------------------------------------------------------------------


def test_rewitness_accepts_a_restored_backup_only_when_told_its_generation(ws: Ws) -> None:
    ref = ws.ref()
    top = ws.generation(ref)
    git(ws.repo, "update-ref", ref, f"{ref}^")  # e.g. the user restored last night's copy
    wrong = ws.cli("checkpoint", "rewitness", RUN, "--generation", str(top))
    assert wrong.code == Exit.BAD_INPUT, wrong.err
    assert f"is at generation {top - 1}, not {top}" in wrong.err
    ok = ws.cli("checkpoint", "rewitness", RUN, "--generation", str(top - 1))
    assert ok.code == 0, ok.err
    assert [s.get("generation") for s in ws.slots()] == sorted(
        [top - 1, top - 2], key=lambda g: g % 2
    )
    resumed = ws.cli("resume", RUN)
    assert resumed.code == Exit.DONE, resumed.err  # the verifier runs again from there
    assert ws.cli("checkpoint", "verify", RUN).code == 0


# -- crash windows of an advance ---------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(done_home: Path) -> tuple[str, int]:
    """The done run's final tree and generation."""
    ws = Ws(done_home, TASK)
    return git(ws.repo, "rev-parse", f"refs/heads/gitrun/{RUN}^{{tree}}").strip(), ws.generation(
        ws.ref()
    )


def _points() -> Iterator[str]:
    for point in ("checkpoint_ref_moved", "checkpoint_witness_torn", "checkpoint_witness_written"):
        for nth in (1, 3):
            yield f"{point}:{nth}"


@pytest.mark.parametrize("spec", list(_points()))
def test_a_run_killed_around_the_witness_write_resumes_like_an_uninterrupted_run(
    spec: str, uninterrupted: tuple[str, int], tmp_path: Path
) -> None:
    ws = Ws(tmp_path / "gitrun-home", TASK)
    ws.home.mkdir()
    crashed = ws.cli("run", str(SANDBOXES / TASK), "--run-id", RUN, GITRUN_CRASH_AT=spec)
    assert crashed.code == KILLED, crashed.err
    if spec == "checkpoint_witness_torn:3":  # the slot of generation 3 really is torn
        body = ws.witness.read_bytes()[SLOT_SIZE:].rstrip(b"\0")
        record, _, checksum = body.partition(b"\n")
        assert checksum.strip() != hashlib.sha256(record).hexdigest().encode()
    resumed = ws.cli("resume", RUN, "-q")
    assert resumed.code == Exit.DONE, resumed.err
    tree, generations = uninterrupted
    assert git(ws.repo, "rev-parse", f"refs/heads/gitrun/{RUN}^{{tree}}").strip() == tree
    keys = git(
        ws.repo, "log", "--format=%(trailers:key=Gitrun-Idempotency-Key,valueonly)",
        f"refs/heads/gitrun/{RUN}",
    ).split()  # fmt: skip
    assert len(keys) == len(set(keys)) == 1
    assert ws.generation(ws.ref()) == generations
    top = ws.slots()[generations % 2]
    assert (top["generation"], top["commit"]) == (
        generations,
        git(ws.repo, "rev-parse", ws.ref()).strip(),
    )
    assert not list(ws.witness.parent.glob(".*.tmp-*"))  # no scratch file left behind


def test_after_a_key_rotation_the_old_witness_still_verifies_and_still_refuses_a_rollback(
    ws: Ws,
) -> None:
    old = {s["key_id"] for s in ws.slots()}
    rotated = ws.cli("keys", "rotate")
    assert rotated.code == 0, rotated.err
    ok = ws.cli("checkpoint", "verify", RUN)
    assert ok.code == 0, ok.err
    ref = ws.ref()
    top = ws.generation(ref)
    git(ws.repo, "update-ref", ref, f"{ref}^")
    _both_refuse(ws, "rolled-back", f"generation {top - 1} ", f"generation {top} ")
    anchored = ws.cli("checkpoint", "rewitness", RUN, "--generation", str(top - 1))
    assert anchored.code == 0, anchored.err
    new = {s["key_id"] for s in ws.slots()}
    assert new.isdisjoint(old)  # re-signed with the active key, whose id is recorded


def test_a_witness_a_process_already_read_is_judged_again_whenever_its_bytes_change(
    tmp_path: Path,
) -> None:
    """One process reads the witness before each advance and skips re-checking slots
    whose exact bytes it wrote or verified: a forged slot put in place afterwards (its
    checksum right, its MAC not) is still refused, and a rolled-back copy reads as the
    older mark it is, exactly as a fresh reader sees them."""
    from gitrun.core.errors import CheckpointRejected
    from gitrun.store.keys import load_keyring
    from gitrun.store.witness import Mark, Witness

    keyring = load_keyring(tmp_path / "keys" / "checkpoint.keyring")
    witness = Witness(tmp_path / "witness", keyring)
    marks = [Mark(RUN, "refs/gitrun/x", g, f"{g:040x}") for g in (1, 2, 3)]
    with witness.locked(RUN):
        witness.write(marks[0])
        witness.write(marks[1])
        older = witness.path(RUN).read_bytes()
        witness.write(marks[2])
        assert _best(witness) == 3
        assert _best(witness) == 3  # from what this process wrote and read
        current = witness.path(RUN).read_bytes()
        slot = current[SLOT_SIZE:]  # generation 3 lives in slot B
        body = slot.rstrip(b"\0").partition(b"\n")[0]
        doc = json.loads(body)
        doc["generation"] = 5  # a forged slot B, its checksum recomputed: the MAC no longer fits
        forged = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        forged += b"\n" + hashlib.sha256(forged).hexdigest().encode() + b"\n"
        witness.path(RUN).write_bytes(current[:SLOT_SIZE] + forged.ljust(SLOT_SIZE, b"\0"))
        with pytest.raises(CheckpointRejected, match="does not verify"):
            witness.read(RUN)
        witness.path(RUN).write_bytes(older)  # an older, valid copy put back
        assert _best(witness) == 2
        assert _best(Witness(tmp_path / "witness", keyring)) == 2  # a fresh reader agrees


def _best(witness: object) -> int:
    from gitrun.store.witness import Witness

    if not isinstance(witness, Witness):
        raise TypeError("not a witness")
    reading = witness.read(RUN)
    if reading is None or reading.mark is None:
        raise AssertionError("no mark")
    return reading.mark.generation
