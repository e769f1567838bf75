"""Run ownership: leases with fencing, so two recovering workers can never both write.

Every race here is between real processes: ``gitrun`` CLI subprocesses, or small Python
subprocesses driving the library (never a fork with libgit2 loaded). Crashes are real
SIGKILLs (``GITRUN_CRASH_AT``); pauses are real SIGSTOP/SIGCONT. Each test ends by
auditing the run from git itself: the branch's write commits (each idempotency key
exactly once), the signed checkpoint chain (generations 1..n with no gap), and
``git fsck`` for the objects a refused worker left behind, unreachable from every ref.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import spawn
from conftest import SANDBOXES, Gitrun, git, snapshot
from helpers import PAUSING_WORKER, one_line

from gitrun.adapter.environment import Environment, index_ref
from gitrun.app import service
from gitrun.app.workspace import Workspace
from gitrun.core.codec import canonical_bytes, encode
from gitrun.core.errors import LeaseLost
from gitrun.core.records import Action, Precondition, new_key
from gitrun.store import gitstore
from gitrun.store.checkpoint import find_checkpoint_refs
from gitrun.store.lease import Fence, LeaseManager, lease_ref, read_lease

pytestmark = pytest.mark.timeout(120)

FIX_MEDIAN = SANDBOXES / "fix-median"
UNTIL = re.compile(r"until \d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
OWNED, LEASE_LOST = 4, 6


# A recovery process that loads the checkpoint at generation g, holds a lease (its
# own, taken over from whoever had it, or one shared fence), waits at a file barrier,
# then tries to advance the checkpoint to g + 1.
RACING_RECOVERER = """
import json, os, sys, time
from dataclasses import replace
from pathlib import Path
from gitrun.app import service
from gitrun.core.errors import CasFailed, LeaseHeld, LeaseLost
from gitrun.store.lease import Fence, LeaseManager
from gitrun.core.records import Event
from gitrun.app.workspace import Workspace

run_id, worker, mode, shared, ready, go, out = sys.argv[1:8]
opened = service.open_run(run_id, service.Options(Workspace(Path(os.environ["GITRUN_HOME"]))))
ref, stored = service.load_verified(opened)
if mode == "takeover":
    lease = LeaseManager(opened.repo, run_id, worker, 30)
    while True:
        try:
            lease.acquire(stored.state.generation, takeover_after=0)
            break
        except LeaseHeld:
            time.sleep(0.005)
    fence = lease.fence
else:
    fence = Fence(shared.split(":")[0], int(shared.split(":")[1]))
Path(ready).write_text(str(fence.version))
while not os.path.exists(go):
    time.sleep(0.001)
s = stored.state
now = time.time()
nxt = replace(s, generation=s.generation + 1, identity=worker, lease_version=fence.version,
              updated_at=now, events=()).with_events(Event("race", now, {"worker": worker}))
try:
    oid = opened.store.advance(ref, nxt, stored.oid, fence)
    result = {"won": True, "oid": str(oid), "generation": nxt.generation}
except (CasFailed, LeaseLost) as exc:
    result = {"won": False, "error": type(exc).__name__, "message": str(exc)}
Path(out).write_text(json.dumps(result))
"""


# -- helpers ---------------------------------------------------------------------------


def wait_until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def crash_run(
    gitrun: Gitrun, task: Path, run_id: str, point: str = "after_intent_checkpoint"
) -> None:
    """Start a run and SIGKILL it at ``point``: a crashed run whose owner is dead."""
    result = gitrun("run", str(task), "--run-id", run_id, "-q", GITRUN_CRASH_AT=point)
    assert result.code == -signal.SIGKILL, (result.code, result.err)


def status(gitrun: Gitrun, run_id: str) -> dict[str, Any]:
    result = gitrun("status", run_id, "--json")
    assert result.code == 0, result.err
    info: dict[str, Any] = json.loads(result.out)
    return info


def lease_of(gitrun: Gitrun, run_id: str) -> dict[str, Any]:
    lease: dict[str, Any] | None = status(gitrun, run_id)["lease"]
    assert lease is not None
    return lease


def slow_task(sandbox_copy: Callable[[str], Path]) -> Path:
    """fix-median with one more test that sleeps ``SLOW_TEST_SECONDS`` at most (from the
    worker's environment, which the verifier passes on), or until the file
    ``SLOW_TEST_UNTIL`` exists: a verifier step that lasts until the test lets it end, so
    what the test checks meanwhile holds however loaded the machine is."""
    task = sandbox_copy("fix-median")
    (task / "repo" / "tests" / "test_slow.py").write_text(
        "import os\nimport time\n\n\ndef test_slow():\n"
        '    deadline = time.monotonic() + float(os.environ.get("SLOW_TEST_SECONDS", "0"))\n'
        '    until = os.environ.get("SLOW_TEST_UNTIL", "")\n'
        "    while time.monotonic() < deadline and not (until and os.path.exists(until)):\n"
        "        time.sleep(0.05)\n"
    )
    return task


@pytest.fixture
def release() -> Iterator[Path]:
    """A file that ends the slow verifier once made: outside /tmp, which the verifier's
    sandbox replaces, so the code under test sees it appear."""
    where = Path(tempfile.mkdtemp(prefix="gitrun-lease-", dir="/var/tmp"))
    try:
        yield where / "release"
    finally:
        shutil.rmtree(where, ignore_errors=True)


def in_verifier(gitrun: Gitrun, run_id: str) -> bool:
    """The run recorded its write and has nothing pending: it is verifying."""
    result = gitrun("status", run_id, "--json")
    if result.code != 0:
        return False  # the run is not registered yet
    info = json.loads(result.out)
    return info.get("phase") == "running" and len(info["receipts"]) == 1 and info["pending"] is None


def pausing_worker(
    gitrun: Gitrun, tmp_path: Path, pause_at: str, *args: str
) -> tuple[subprocess.Popen[str], Path, Path]:
    marker, go = tmp_path / f"paused-{pause_at}", tmp_path / f"go-{pause_at}"
    proc = spawn.popen(
        [sys.executable, "-c", PAUSING_WORKER, pause_at, str(marker), str(go), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=gitrun.env(),
        cwd=gitrun.home.parent,
    )
    return proc, marker, go


@dataclass
class Audit:
    """What git says about a run once the dust settles."""

    phase: str
    generations: list[int]  # the checkpoint chain, oldest first
    identities: dict[int, str]  # generation -> the worker that wrote it
    lease_versions: dict[int, int]  # generation -> the lease it was written under
    intent_keys: list[str]  # every key an intent checkpoint persisted
    receipt_keys: list[str]  # every idempotency key on the branch (git log)
    receipt_leases: list[int]  # each write commit's Gitrun-Lease trailer
    repo: Path
    checkpoint_ref: str


def audit(gitrun: Gitrun, run_id: str) -> Audit:
    opened = service.open_run(run_id, service.Options(Workspace(gitrun.home)))
    refs = find_checkpoint_refs(opened.repo, run_id)
    assert len(refs) == 1, refs
    chain = list(reversed(opened.store.chain(refs[0])))  # every signature verified
    intents = [e.data["key"] for stored in chain for e in stored.state.events if e.kind == "intent"]
    repo = Path(opened.record.repo)
    fmt = (
        "%(trailers:key=Gitrun-Idempotency-Key,valueonly,separator=)|"
        "%(trailers:key=Gitrun-Lease,valueonly,separator=)"
    )
    log = git(repo, "log", f"--format={fmt}", opened.record.branch).splitlines()
    writes = [line.split("|") for line in log if line != "|"]
    return Audit(
        phase=chain[-1].state.phase,
        generations=[s.state.generation for s in chain],
        identities={s.state.generation: s.state.identity for s in chain},
        lease_versions={s.state.generation: s.state.lease_version for s in chain},
        intent_keys=intents,
        receipt_keys=[key for key, _ in writes],
        receipt_leases=[int(lease) for _, lease in writes],
        repo=repo,
        checkpoint_ref=refs[0],
    )


def assert_done_exactly_once(result: Audit, writes: int) -> None:
    """Done; every intent written exactly once; the chain is 1..n with nothing skipped."""
    assert result.phase == "done"
    assert result.generations == list(range(1, len(result.generations) + 1))
    assert len(result.intent_keys) == writes
    assert Counter(result.receipt_keys) == Counter(result.intent_keys)
    assert all(n == 1 for n in Counter(result.receipt_keys).values())


def _staged_git(repo: Path, *args: str) -> str:
    """git with gitrun's stage as an alternate: what no ref names yet (a loser's checkpoint
    object) lives there, never in ``objects/``."""
    stage = str(repo / ".git" / "gitrun" / "stage")
    env = {**os.environ, "GIT_ALTERNATE_OBJECT_DIRECTORIES": stage}
    cmd = ["git", "-C", str(repo), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout


def unreachable_commits(repo: Path) -> dict[str, str]:
    """Commit id -> raw commit text, for every commit no ref (nor reflog) reaches."""
    out = _staged_git(repo, "fsck", "--unreachable", "--no-reflogs", "--no-progress")
    oids = [line.split()[2] for line in out.splitlines() if line.startswith("unreachable commit")]
    return {oid: _staged_git(repo, "cat-file", "commit", oid) for oid in oids}


def checkpoint_identity(raw_commit: str) -> tuple[int, str] | None:
    """(generation, identity) of a checkpoint commit's payload; None for other commits."""
    message = raw_commit.split("\n\n", 1)[1]
    parts = message.split("\n\n")
    if len(parts) != 3 or "Gitrun-Checkpoint: " not in parts[2]:
        return None
    payload = json.loads(parts[1])
    return int(payload["generation"]), str(payload["identity"])


def _write_key(raw_commit: str) -> str | None:
    """The idempotency key trailer of a write commit, None for other commits."""
    found = re.search(r"^Gitrun-Idempotency-Key: (\S+)$", raw_commit, re.M)
    return found.group(1) if found else None


def assert_invisible(repo: Path, oid: str) -> None:
    assert _staged_git(repo, "for-each-ref", "--contains", oid) == ""


# -- two resumes racing on a crashed run ---------------------------------------------


@pytest.mark.timeout(180)
def test_two_resumes_started_together_on_a_crashed_run_one_finishes_the_other_is_told_the_owner(
    gitrun: Gitrun, reap: list[subprocess.Popen[str]], sandbox_copy: Callable[[str], Path]
) -> None:
    # Three rounds at once, each on its own run (crashed at a different point) in one
    # repository: two resumes per run, started together. The verifier takes 3 s, so
    # the winner still owns the run when the slower of the two processes starts.
    points = ["after_intent_checkpoint", "write_ref_moved", "after_file_sync"]
    task = slow_task(sandbox_copy)
    for n, point in enumerate(points):
        crash_run(gitrun, task, f"race-{n}", point)
        dead_owner = lease_of(gitrun, f"race-{n}")
        assert dead_owner["live"]
        assert dead_owner["lease_version"] == 1
    workers = {n: [f"w{n}-a", f"w{n}-b"] for n in range(len(points))}
    procs = {
        n: [
            gitrun.popen("resume", f"race-{n}", "-q", "--worker-id", w, SLOW_TEST_SECONDS="3")
            for w in names
        ]
        for n, names in workers.items()
    }
    for pair in procs.values():
        reap.extend(pair)
    results = {n: [p.communicate(timeout=120) for p in pair] for n, pair in procs.items()}

    for n, point in enumerate(points):
        run_id = f"race-{n}"
        codes = [p.returncode for p in procs[n]]
        assert sorted(codes) == [0, OWNED], results[n]
        winner = workers[n][codes.index(0)]
        out, err = results[n][codes.index(OWNED)]
        line = one_line(err)
        assert out == ""
        assert winner in line, line
        assert UNTIL.search(line), line
        done_line = results[n][codes.index(0)][0].strip()
        assert done_line == f"run {run_id}: done (8/8 required tests passed)"

        lease = lease_of(gitrun, run_id)
        assert (lease["owner_worker"], lease["lease_version"]) == (winner, 2)
        assert not lease["live"]  # released on clean exit
        result = audit(gitrun, run_id)
        assert_done_exactly_once(result, writes=1)
        assert result.receipt_leases == [2 if point == "after_intent_checkpoint" else 1]
        after_crash = [g for g, who in result.identities.items() if who == winner]
        assert after_crash == list(range(after_crash[0], result.generations[-1] + 1))


# -- a live owner ----------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_resume_of_a_run_a_live_worker_owns_exits_at_once_naming_the_owner_and_expiry(
    gitrun: Gitrun,
    sandbox_copy: Callable[[str], Path],
    reap: list[subprocess.Popen[str]],
    release: Path,
) -> None:
    task = slow_task(sandbox_copy)
    owner = gitrun.popen(
        "run", str(task), "--run-id", "r", "-q", "--worker-id", "worker-a",
        SLOW_TEST_SECONDS="60", SLOW_TEST_UNTIL=str(release),
    )  # fmt: skip
    reap.append(owner)
    wait_until(lambda: in_verifier(gitrun, "r"), "the owner to reach its verifier")

    started = time.monotonic()
    second = gitrun("resume", "r", "-q", "--worker-id", "worker-b")
    took = time.monotonic() - started
    assert second.code == OWNED, second.err
    line = one_line(second.err)
    assert "worker-a" in line, line
    assert UNTIL.search(line), line
    assert took < 10, took  # at once: not a wait for the 30 s lease

    info = status(gitrun, "r")
    lease = info["lease"]
    assert lease["owner_worker"] == "worker-a"
    assert lease["lease_version"] == 1
    assert lease["live"] is True
    assert time.time() < lease["expires_at"] <= time.time() + 30
    text = gitrun("status", "r")
    assert re.search(r"lease\s+worker-a v1 live until \d\d:\d\d:\d\d", text.out), text.out

    release.touch()
    out, err = owner.communicate(timeout=60)
    assert owner.returncode == 0, err
    assert "done" in out
    assert lease_of(gitrun, "r")["live"] is False
    result = audit(gitrun, "r")
    assert_done_exactly_once(result, writes=1)
    assert set(result.identities.values()) == {"worker-a"}


# -- the source's race: two recoverers holding the same generation ---------------------


def _race(
    gitrun: Gitrun,
    tmp_path: Path,
    reap: list[subprocess.Popen[str]],
    run_id: str,
    *,
    mode: str,
    names: list[str],
    shared: str,
) -> list[dict[str, Any]]:
    files = {w: (tmp_path / f"{w}.ready", tmp_path / f"{w}.out") for w in names}
    go = tmp_path / f"go-{names[0]}"
    procs = [
        spawn.popen(
            [
                sys.executable,
                "-c",
                RACING_RECOVERER,
                run_id,
                w,
                mode,
                shared,
                str(files[w][0]),
                str(go),
                str(files[w][1]),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=gitrun.env(),
        )
        for w in names
    ]
    reap.extend(procs)
    wait_until(lambda: all(r.exists() for r, _ in files.values()), "both recoverers to be ready")
    go.write_text("go")
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    return [json.loads(files[w][1].read_text()) for w in names]


@pytest.mark.timeout(120)
def test_of_two_recoverers_holding_one_generation_one_advances_and_the_loser_leaves_no_trace(
    gitrun: Gitrun, tmp_path: Path, reap: list[subprocess.Popen[str]]
) -> None:
    crash_run(gitrun, FIX_MEDIAN, "r")
    opened = service.open_run("r", service.Options(Workspace(gitrun.home)))
    repo = opened.repo
    start = service.load_verified(opened)[1].state.generation
    losers: dict[str, str] = {}  # loser worker -> why it was refused
    winners: dict[int, str] = {}
    rounds = [("takeover", n) for n in range(2)] + [("shared", n) for n in range(2)]
    for mode, n in rounds:
        names = [f"{mode}{n}-a", f"{mode}{n}-b"]
        shared = "-:0"
        holder = None
        if mode == "shared":  # both believe they hold the same lease: only the CAS decides
            holder = LeaseManager(repo, "r", f"{mode}{n}", 30)
            holder.acquire(0, takeover_after=0)
            shared = f"{mode}{n}:{holder.fence.version}"
        before = gitstore.read_ref(repo, find_checkpoint_refs(repo, "r")[0])
        results = _race(gitrun, tmp_path, reap, "r", mode=mode, names=names, shared=shared)
        if holder is not None:
            holder.release()
        won = [w for w, res in zip(names, results, strict=True) if res["won"]]
        assert len(won) == 1, results
        loser = next(w for w in names if w not in won)
        refusal = results[names.index(loser)]
        assert refusal["error"] == ("LeaseLost" if mode == "takeover" else "CasFailed"), refusal
        losers[loser] = refusal["error"]
        after = gitstore.read_ref(repo, find_checkpoint_refs(repo, "r")[0])
        assert str(after) == results[names.index(won[0])]["oid"]
        assert after != before
        winners[results[names.index(won[0])]["generation"]] = won[0]

    result = audit(gitrun, "r")
    race_gens = list(range(start + 1, start + 1 + len(rounds)))
    assert result.generations == list(range(1, start + 1 + len(rounds)))
    assert {g: result.identities[g] for g in race_gens} == winners
    # Every loser did write its checkpoint object, and no ref reaches it.
    orphans = {
        ident: oid
        for oid, raw in unreachable_commits(result.repo).items()
        if (ident := checkpoint_identity(raw)) is not None
    }
    for n, loser in enumerate(losers):
        oid = orphans[(race_gens[n], loser)]
        assert_invisible(result.repo, oid)
    verified = gitrun("checkpoint", "verify", "r")
    assert verified.code == 0, verified.err

    finish = gitrun("resume", "r", "-q", "--worker-id", "finisher")
    assert finish.code == 0, finish.err
    assert_done_exactly_once(audit(gitrun, "r"), writes=1)


# -- the SIGSTOP scenario: a paused worker loses its lease ---------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "pause_at",
    [
        pytest.param("after_write_commit_object", id="late-write"),
        pytest.param("after_intent_checkpoint", id="late-checkpoint"),
    ],
)
def test_a_stopped_worker_whose_lease_was_taken_over_has_its_late_work_refused_and_exits_saying_so(
    gitrun: Gitrun, tmp_path: Path, reap: list[subprocess.Popen[str]], pause_at: str
) -> None:
    a, marker, go = pausing_worker(
        gitrun,
        tmp_path,
        pause_at,
        "run",
        str(FIX_MEDIAN),
        "--run-id",
        "r",
        "-q",
        "--worker-id",
        "worker-a",
        "--lease-seconds",
        "2",
    )
    reap.append(a)
    wait_until(marker.exists, f"worker A to reach {pause_at}")
    os.kill(a.pid, signal.SIGSTOP)
    paused_at = status(gitrun, "r")["generation"]
    wait_until(lambda: not lease_of(gitrun, "r")["live"], "A's lease to expire")

    b = gitrun("resume", "r", "-q", "--worker-id", "worker-b", "--lease-seconds", "30")
    assert b.code == 0, b.err
    assert "done" in b.out
    lease = lease_of(gitrun, "r")
    assert (lease["owner_worker"], lease["lease_version"]) == ("worker-b", 2)
    done = audit(gitrun, "r")

    go.write_text("go")
    os.kill(a.pid, signal.SIGCONT)
    out, err = a.communicate(timeout=60)
    assert a.returncode == LEASE_LOST, err
    assert out == ""
    line = one_line(err)
    assert "lease lost" in line, line
    assert "worker-b" in line, line

    result = audit(gitrun, "r")
    assert result == done  # A's late work changed nothing
    assert_done_exactly_once(result, writes=1)
    assert result.receipt_leases == [2]  # the one write is B's
    taken_over = range(paused_at + 1, len(result.generations) + 1)
    assert all(result.identities[g] == "worker-a" for g in range(1, paused_at + 1))
    assert all(result.identities[g] == "worker-b" for g in taken_over)
    assert all(result.lease_versions[g] == 2 for g in taken_over)

    orphans = unreachable_commits(result.repo)
    if pause_at == "after_write_commit_object":
        # A's write was prepared under lease 1 before the takeover and never landed; its
        # intent rode with it (never durable), so B proposed the step again, its own key.
        keys = set(result.receipt_keys)
        late = [
            oid
            for oid, raw in orphans.items()
            if "Gitrun-Lease: 1\n" in raw and _write_key(raw) not in (None, *keys)
        ]
        assert len(late) == 1, orphans
    else:
        # A replayed B's receipt and ran the verifier; whichever came first refused it:
        # the verifier's heartbeat renewing the lost lease (no checkpoint object at all)
        # or the checkpoint's fenced compare-and-swap (one object, reachable from no ref).
        mine = (paused_at + 1, "worker-a")
        late = [oid for oid, raw in orphans.items() if checkpoint_identity(raw) == mine]
        assert len(late) <= 1, orphans
    for oid in late:
        assert_invisible(result.repo, oid)


def stop_holding_no_witness_lock(gitrun: Gitrun, proc: subprocess.Popen[str], run_id: str) -> None:
    """SIGSTOP ``proc`` at a moment it holds no witness lock (its background witness sync
    may hold one for a moment): a stopped holder of it would block every reader."""
    for _ in range(50):
        os.kill(proc.pid, signal.SIGSTOP)
        shown = gitrun("status", run_id, "--json")
        if shown.code == 0 or "witness" not in shown.err:
            return
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError(f"{proc.pid} held the witness lock at every try")


@pytest.mark.timeout(120)
def test_when_a_stopped_worker_dies_the_worker_that_took_over_its_lease_keeps_it(
    gitrun: Gitrun,
    sandbox_copy: Callable[[str], Path],
    reap: list[subprocess.Popen[str]],
    release: Path,
) -> None:
    task = slow_task(sandbox_copy)
    a = gitrun.popen(
        "run",
        str(task),
        "--run-id",
        "r",
        "-q",
        "--worker-id",
        "worker-a",
        "--lease-seconds",
        "2",
        SLOW_TEST_SECONDS="4",
    )
    reap.append(a)
    wait_until(lambda: in_verifier(gitrun, "r"), "A to reach its verifier")
    stop_holding_no_witness_lock(gitrun, a, "r")
    wait_until(lambda: not lease_of(gitrun, "r")["live"], "A's lease to expire")

    b = gitrun.popen(
        "resume", "r", "-q", "--worker-id", "worker-b",
        SLOW_TEST_SECONDS="60", SLOW_TEST_UNTIL=str(release),
    )  # fmt: skip
    reap.append(b)
    wait_until(lambda: lease_of(gitrun, "r")["owner_worker"] == "worker-b", "B to take the lease")
    os.kill(a.pid, signal.SIGCONT)
    out, err = a.communicate(timeout=30)
    assert a.returncode == LEASE_LOST, err
    assert out == ""
    assert "worker-b" in one_line(err)

    # A is gone (its OS locks with it); B is alive and owns the run: no one else may take it.
    c = gitrun("resume", "r", "-q", "--worker-id", "worker-c")
    assert c.code == OWNED, c.err
    assert "worker-b" in one_line(c.err)
    release.touch()
    _, err = b.communicate(timeout=60)
    assert b.returncode == 0, err
    result = audit(gitrun, "r")
    assert_done_exactly_once(result, writes=1)
    assert result.identities[result.generations[-1]] == "worker-b"
    assert "worker-c" not in result.identities.values()


@pytest.mark.timeout(90)
def test_a_resume_never_undoes_the_setup_of_a_run_a_live_worker_is_still_setting_up(
    gitrun: Gitrun, tmp_path: Path, reap: list[subprocess.Popen[str]]
) -> None:
    # A holds its lease, made the branch and worktree, and is inside its first
    # checkpoint's ref transaction: no checkpoint yet, the branch still at the base.
    a, marker, go = pausing_worker(
        gitrun,
        tmp_path,
        "checkpoint_ref_locked",
        "run",
        str(FIX_MEDIAN),
        "--run-id",
        "r",
        "-q",
        "--worker-id",
        "worker-a",
    )
    reap.append(a)
    wait_until(marker.exists, "worker A to be inside its first checkpoint")
    repo = gitrun.repo("fix-median")
    before = snapshot(repo)

    b = gitrun("resume", "r", "-q", "--worker-id", "worker-b")
    assert b.code == OWNED, b.err
    assert "worker-a" in one_line(b.err)
    assert snapshot(repo) == before  # A's setup untouched: branch, worktree, lease
    assert (gitrun.home / "worktrees" / "r" / ".git").exists()

    go.write_text("go")
    out, err = a.communicate(timeout=60)
    assert a.returncode == 0, err
    assert "done" in out
    assert_done_exactly_once(audit(gitrun, "r"), writes=1)


# -- the adapter fences on its own -----------------------------------------------------


def _write(env: Environment, path: str, fence: Fence) -> tuple[str, Any]:
    action = Action("write_file", path=path, content="X = 1\n", description="fencing probe")
    obs = env.observe(full=True)
    key = new_key()
    pre = Precondition(obs.instance_id, obs.head, obs.tree)
    try:
        outcome = env.execute(action, key, action.intent_digest(), pre, fence)
    except LeaseLost as exc:
        return key, exc
    return key, outcome


@pytest.mark.timeout(60)
def test_the_adapter_refuses_a_write_under_a_stale_lease_even_when_called_directly(
    gitrun: Gitrun,
) -> None:
    crash_run(gitrun, FIX_MEDIAN, "r")
    opened = service.open_run("r", service.Options(Workspace(gitrun.home)))
    repo, env = opened.repo, opened.env
    old = LeaseManager(repo, "r", "worker-old", 30)
    old.acquire(0, takeover_after=0)
    new = LeaseManager(repo, "r", "worker-new", 30)
    new.acquire(0, takeover_after=0)
    assert (old.fence.version, new.fence.version) == (2, 3)
    base = gitstore.read_ref(repo, env.branch)

    # (a) The lease ref no longer holds the caller's lease: refused, no commit lands.
    key, refused = _write(env, "stats/extra.py", old.fence)
    assert isinstance(refused, LeaseLost), refused
    assert "worker-new" in str(refused)
    assert gitstore.read_ref(repo, env.branch) == base
    assert gitstore.read_ref(repo, index_ref("r", key)) is None
    assert not (env.worktree / "stats" / "extra.py").exists()
    assert env.write_count == 0

    key, landed = _write(env, "stats/extra.py", new.fence)
    assert not isinstance(landed, LeaseLost), landed
    assert landed.receipt.lease == 3
    assert not landed.replayed
    tip = gitstore.read_ref(repo, env.branch)
    assert str(tip) == landed.receipt.commit

    # (b) Forge the lease ref back to the old worker's version 2: the adapter's own
    # monotonic fence (the tip commit's Gitrun-Lease: 3) still refuses version 2.
    lease, oid = read_lease(repo, "r")
    assert lease is not None
    forged = replace(lease, owner_worker="worker-old", lease_version=2, expires_at=time.time() + 60)
    forged_oid = gitstore.write_blob(repo, canonical_bytes(encode(forged)))
    gitstore.transaction(repo).move(
        lease_ref("r"), oid, forged_oid, message="test: forge the lease"
    ).commit()
    key, refused = _write(env, "stats/extra2.py", Fence("worker-old", 2))
    assert isinstance(refused, LeaseLost), refused
    assert "stale fence" in str(refused)
    assert gitstore.read_ref(repo, env.branch) == tip
    assert gitstore.read_ref(repo, index_ref("r", key)) is None
    assert not (env.worktree / "stats" / "extra2.py").exists()
    assert env.write_count == 1

    receipts = gitrun("receipts", "r", "--json")
    assert [r["lease"] for r in json.loads(receipts.out)] == [3]


# -- renewal ---------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_lease_renewal_keeps_a_verifier_longer_than_the_lease_owned(
    gitrun: Gitrun,
    sandbox_copy: Callable[[str], Path],
    reap: list[subprocess.Popen[str]],
    release: Path,
) -> None:
    task = slow_task(sandbox_copy)
    a = gitrun.popen(
        "run",
        str(task),
        "--run-id",
        "r",
        "-q",
        "--worker-id",
        "worker-a",
        "--lease-seconds",
        "2",
        SLOW_TEST_SECONDS="60",
        SLOW_TEST_UNTIL=str(release),
    )
    reap.append(a)
    wait_until(lambda: in_verifier(gitrun, "r"), "A to reach its verifier")
    expiries = []
    tries = 0
    first = time.monotonic()
    while tries < 2 or time.monotonic() - first < 6:  # three leases' worth of intruders
        intruder = gitrun("resume", "r", "-q", "--worker-id", f"intruder-{tries}")
        info = status(gitrun, "r")
        if info["phase"] != "running":
            break  # the verifier finished while the intruder ran: not a fair try
        assert intruder.code == OWNED, intruder.err
        assert "worker-a" in one_line(intruder.err)
        lease = info["lease"]
        assert (lease["owner_worker"], lease["lease_version"]) == ("worker-a", 1)
        assert lease["live"]
        expiries.append(lease["expires_at"])
        tries += 1
    release.touch()
    assert tries >= 2, tries
    assert expiries == sorted(expiries)
    assert expiries[-1] > expiries[0]  # renewed as it ran

    out, err = a.communicate(timeout=60)
    assert a.returncode == 0, err
    assert "done" in out
    result = audit(gitrun, "r")
    assert_done_exactly_once(result, writes=1)
    assert set(result.identities.values()) == {"worker-a"}
    assert set(result.lease_versions.values()) == {1}


# -- takeover before expiry -----------------------------------------------------------


@pytest.mark.timeout(120)
def test_takeover_after_lets_a_second_worker_take_a_stopped_owners_lease_before_it_expires(
    gitrun: Gitrun,
    sandbox_copy: Callable[[str], Path],
    reap: list[subprocess.Popen[str]],
    release: Path,
) -> None:
    task = slow_task(sandbox_copy)
    a = gitrun.popen(
        "run",
        str(task),
        "--run-id",
        "r",
        "-q",
        "--worker-id",
        "worker-a",
        "--lease-seconds",
        "10",
        SLOW_TEST_SECONDS="60",
        SLOW_TEST_UNTIL=str(release),
    )
    reap.append(a)
    wait_until(lambda: in_verifier(gitrun, "r"), "A to reach its verifier")
    # A renews every few seconds while it works: not stale for 6 s, so not taken.
    early = gitrun("resume", "r", "-q", "--worker-id", "worker-b", "--takeover-after", "6")
    assert early.code == OWNED, early.err

    # Stop A just after a renewal, not in the middle of one (holding the lease ref's lock).
    renewed = lease_of(gitrun, "r")["renewed_at"]
    wait_until(lambda: lease_of(gitrun, "r")["renewed_at"] != renewed, "A to renew its lease")
    os.kill(a.pid, signal.SIGSTOP)
    stopped = time.time()
    expires = lease_of(gitrun, "r")["expires_at"]
    time.sleep(max(0.0, stopped + 2.5 - time.time()))
    b = gitrun("resume", "r", "-q", "--worker-id", "worker-b", "--takeover-after", "2")
    assert b.code == 0, b.err
    lease = lease_of(gitrun, "r")
    assert (lease["owner_worker"], lease["lease_version"]) == ("worker-b", 2)
    assert lease["acquired_at"] < expires  # taken while A's lease was still live

    release.touch()  # A's verifier ends as soon as A runs again
    os.kill(a.pid, signal.SIGCONT)
    _, err = a.communicate(timeout=60)
    assert a.returncode == LEASE_LOST, err
    assert "worker-b" in one_line(err)
    result = audit(gitrun, "r")
    assert_done_exactly_once(result, writes=1)
    assert result.identities[result.generations[-1]] == "worker-b"
