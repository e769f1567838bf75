"""The real run loop on the tests' in-memory checkpoint log, against the git store's outcome.

:class:`gitrun.engine.runtime.Runtime` is typed on the store contracts
(:mod:`gitrun.core.contracts`), so the loop that ``gitrun run`` drives runs unchanged over
:class:`memory_stores.MemoryCheckpointLog`: a gate refusal, a patch, an exec step, the
verifier, every checkpoint in between. Each test runs once over the git checkpoint store
and once over the memory one and asserts the same outcome for both.

The lease stays the git one in both: it is the fence the worktree's branch move checks
inside its own ref transaction, so it lives where the receipts live (the worktree's
repository; on a ``--remote`` run, the remote). A crash the memory store can model is a
process that dies after a named point while its stores survive: the test raises there
(``GITRUN_FAIL_AT``), drops the runtime, and resumes from the checkpoint log as
``gitrun resume`` does (load, reconcile, run).
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pygit2
import pytest
from conftest import SANDBOXES
from helpers import git
from memory_stores import MemoryBackend, MemoryCheckpointLog

from gitrun.adapter.environment import Environment
from gitrun.core import faults
from gitrun.core.contracts import CheckpointLog
from gitrun.core.exec_policy import ExecPolicy
from gitrun.core.records import EXEC, Action, RunState
from gitrun.core.task import Task, load_task
from gitrun.engine.agents import ScriptAgent
from gitrun.engine.approvals import Approvals
from gitrun.engine.recovery import reconcile
from gitrun.engine.runtime import Runtime, at_checkpoint, begin
from gitrun.store import gitstore
from gitrun.store.checkpoint import CheckpointStore
from gitrun.store.keys import Keyring
from gitrun.store.lease import Fence, LeaseManager, fenced

pytestmark = pytest.mark.timeout(180)

RUN = "mem"
SANDBOX = SANDBOXES / "fix-median"
PARTS = {"task": "sha256:fix-median", "policy": "sha256:default"}
NOTE = "stats/NOTES.md"


def _task() -> Task:
    """fix-median, with exec allowed (one command: the note the exec step writes)."""
    task = load_task(SANDBOX)
    policy = replace(
        task.policy,
        allowed_actions=(*task.policy.allowed_actions, EXEC),
        exec=ExecPolicy(allow=("python3 -c *",)),
    )
    return replace(task, policy=policy)


def _agent() -> ScriptAgent:
    """A refused write, the fix, an exec step writing a note, then a plain write."""
    fix = (SANDBOX / "patches" / "fix.diff").read_bytes()
    note = f"open('{NOTE}', 'w').write('median fixed\\n')"
    return ScriptAgent(
        "memory-loop",
        (
            Action.of_bytes("write_file", path="tests/test_median.py", content=b"assert True\n"),
            Action.of_bytes("apply_patch", patch=fix, description="the fix"),
            Action(EXEC, command=f'python3 -c "{note}"', description="write a note"),
            Action.of_bytes("write_file", path="stats/VERSION", content=b"2\n"),
        ),
    )


class GitFenced(MemoryBackend):
    """The memory backend, fencing on the git lease the run holds (its own lease table
    unused): the checkpoint log and the worktree's writes check one lease, as in a run."""

    def __init__(self, repo: pygit2.Repository) -> None:
        super().__init__()
        self.repo = repo

    def check_fence(self, run_id: str, fence: Fence) -> None:
        with fenced(self.repo, run_id, fence):  # the lease ref's lock, the lease checked
            return


@dataclass
class World:
    """A repository, its run's worktree, the git lease, and one checkpoint log."""

    tmp: Path
    repo: pygit2.Repository
    base: str
    lease: LeaseManager
    store: CheckpointLog[Any]
    said: list[str]
    ref: str = ""

    def runtime(self, env: Environment | None = None) -> Runtime:
        """A new run's runtime (``gitrun run``), or one resumed from the log (``resume``)."""
        task, agent = _task(), _agent()
        approvals = Approvals(None)
        if env is None:
            env = Environment.create(
                self.repo, RUN, pygit2.Oid(hex=self.base), self.tmp / "wt",
                f"{task.id}@{task.version}", fence=self.lease.fence,
            )  # fmt: skip
            rt = begin(
                task=task, env=env, store=self.store, lease=self.lease, agent=agent,
                worker="w1", base_commit=self.base, scenario_parts=PARTS,
                say=self.said.append, approvals=approvals, isolation="auto",
            )  # fmt: skip
            self.ref = rt.ref
            return rt
        return at_checkpoint(
            task=task, env=env, store=self.store, ref=self.ref,
            loaded=self.store.load(self.ref, scenario_parts=PARTS), lease=self.lease,
            agent=agent, say=self.said.append, approvals=approvals, isolation="auto",
        )  # fmt: skip


@pytest.fixture(params=["git", "memory"])
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[World]:
    repo_dir = tmp_path / "repo"
    shutil.copytree(SANDBOX / "repo", repo_dir)
    git(repo_dir, "init", "-q", "-b", "main")
    git(repo_dir, "add", "-A")
    git(repo_dir, "commit", "-q", "-m", "base")
    repo = gitstore.open_repo(repo_dir)
    base = git(repo_dir, "rev-parse", "HEAD").strip()
    kid = "hk-" + secrets.token_hex(6)
    ring = Keyring("<test>", kid, {kid: secrets.token_bytes(32)})
    store: CheckpointLog[Any] = (
        CheckpointStore(repo, ring)
        if request.param == "git"
        else MemoryCheckpointLog(GitFenced(repo), ring)
    )
    lease = LeaseManager(repo, RUN, "w1", 30.0)
    lease.acquire(0)
    try:
        yield World(tmp_path, repo, base, lease, store, [])
    finally:
        lease.release()


def _outcome(world: World, final: RunState) -> dict[str, Any]:
    """What a user sees of a finished run, the same whichever store kept its checkpoints."""
    chain = world.store.chain(world.ref)
    if chain[0].oid != world.store.head(world.ref) or chain[0].state.evolve(events=()) != final:
        raise AssertionError("the run's last state is not the checkpoint at the head")
    branch = f"refs/heads/gitrun/{RUN}"
    each_key = "--format=%(trailers:key=Gitrun-Idempotency-Key,valueonly)"
    keys = git(world.tmp / "repo", "log", each_key, branch).split()
    return {
        "phase": (final.phase, final.stop_reason),
        "generations": [c.state.generation for c in chain],
        "events": [e.kind for c in reversed(chain) for e in c.state.events],
        "writes": git(world.tmp / "repo", "log", "--format=%s", branch).splitlines(),
        "one commit per key": len(keys) == len(set(keys)) == final.receipts.count,
        "tree": git(world.tmp / "repo", "rev-parse", f"{branch}^{{tree}}").strip(),
        "note": (world.tmp / "wt" / NOTE).read_text(),
        "verifier": None if final.verifier is None else final.verifier.summary,
    }


WRITES = [
    "gitrun: write_file stats/VERSION",
    "gitrun: exec stats/NOTES.md",
    "gitrun: apply_patch stats/median.py",
    "base",
]
DONE = {
    "phase": ("done", "verified"),
    "generations": [6, 5, 4, 3, 2, 1],
    "events": ["started", "gate_rejected"] + ["intent", "receipt"] * 3 + ["verifier"],
    "writes": WRITES,
    "one commit per key": True,
    "note": "median fixed\n",
    "verifier": "8/8 required tests passed",
}


def _crash_at(monkeypatch: pytest.MonkeyPatch, point: str | None) -> None:
    """Raise at ``point`` from now on (None: no more): the process dies there, its stores stay."""
    if point is None:
        monkeypatch.delenv(faults.FAIL_VAR, raising=False)
    else:
        monkeypatch.setenv(faults.FAIL_VAR, point)
    monkeypatch.setattr(faults, "_env", None)  # the variables are read once per process


def _resume(world: World) -> RunState:
    """``gitrun resume``: the checkpoint at the head, a reconcile with the worktree, the loop."""
    env = Environment(world.repo, RUN, world.tmp / "wt", "fix-median@1")
    rt = world.runtime(env)
    reconcile(rt)
    return rt.run()


@pytest.fixture(scope="module")
def fixed_tree(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tree the run's writes make, made by plain git: the patch, the note, the version."""
    repo = tmp_path_factory.mktemp("oracle") / "repo"
    shutil.copytree(SANDBOX / "repo", repo)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "apply", str(SANDBOX / "patches" / "fix.diff"))
    (repo / NOTE).write_text("median fixed\n")
    (repo / "stats" / "VERSION").write_text("2\n")
    git(repo, "add", "-A")
    return git(repo, "write-tree").strip()


def test_a_whole_run_gives_the_same_outcome_on_either_checkpoint_log(
    world: World, fixed_tree: str
) -> None:
    """A refused write, a patch, an exec step, a write, the verifier: done, on both."""
    out = _outcome(world, world.runtime().run())
    tree = out.pop("tree")
    assert out == DONE
    assert tree == fixed_tree
    # The checkpoints are where the store keeps them: in git only for the git store.
    in_git = git(world.tmp / "repo", "for-each-ref", f"refs/gitrun/runs/{RUN}/checkpoints")
    assert bool(in_git.strip()) == isinstance(world.store, CheckpointStore)


@pytest.mark.parametrize(
    "point",
    [
        "after_intent_checkpoint",  # window 2: the intent durable, not its write
        "after_write_commit_object",  # window 2: the commit made, no ref names it
        "after_receipt_index",  # window 3: the write's branch moved, no checkpoint says so
    ],
)
def test_a_crash_in_a_write_window_resumes_to_the_same_outcome_each_write_once(
    world: World, monkeypatch: pytest.MonkeyPatch, point: str, fixed_tree: str
) -> None:
    _crash_at(monkeypatch, point)
    with pytest.raises(faults.InjectedFailure):
        world.runtime().run()
    _crash_at(monkeypatch, None)
    crashed_at = world.store.load(world.ref, scenario_parts=PARTS).state
    assert crashed_at.pending is not None  # the patch's intent, durable, its receipt not
    assert crashed_at.pending.action.kind == "apply_patch"
    out = _outcome(world, _resume(world))
    assert out["phase"] == ("done", "verified")
    assert out["writes"] == WRITES
    assert out["one commit per key"]
    assert out["tree"] == fixed_tree
