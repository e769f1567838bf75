"""Open an existing run for a use case: its record, task, repository, environment, and
the checkpoint store that verifies it.

Shared by the run use cases (:mod:`gitrun.app.service`) and the read-only and evidence ones
(:mod:`gitrun.app.reports`); it loads nothing ``gitrun status`` does not need (no agents,
runtime, approvals or cryptography at import).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gitrun.adapter.environment import Environment
from gitrun.adapter.gittypes import GitError, Repository, commit_at
from gitrun.app.options import Options, quiet
from gitrun.app.workspace import RunRecord, Workspace, check_run_id
from gitrun.core import trailer
from gitrun.core.errors import CheckpointRejected, GitrunError
from gitrun.core.task import Task, load_task
from gitrun.store import gitstore, trees
from gitrun.store.checkpoint import CheckpointStore, Stored, checkpoint_ref, find_checkpoint_refs
from gitrun.store.checkpoint_verify import no_ref
from gitrun.store.keys import Keyring, load_keyring
from gitrun.store.lease import DEFAULT_DURATION, LeaseManager
from gitrun.store.remote import RemoteCheckpointLog, RemoteSite
from gitrun.store.remote_lease import RemoteLeaseStore
from gitrun.store.witness import Witness

if TYPE_CHECKING:
    from gitrun.core.records import RunState

__all__ = [
    "Opened",
    "Options",
    "base_parts",
    "checkpoint_store",
    "cli_options",
    "keyring_store",
    "lease_store",
    "load_verified",
    "open_run",
    "report_finished",
    "the_ref",
]


def cli_options(
    workspace: Path | None,
    key_file: Path | None,
    worker: str | None = None,
    lease_seconds: float = DEFAULT_DURATION,
    takeover_after: float | None = None,
    say: Callable[[str], None] | None = None,
    trust_roots: Path | None = None,
    isolation: str | None = None,
    remote: str | None = None,
) -> Options:
    """The options of a CLI command from its flags (None: the default of each)."""
    from gitrun.app.inputs import refuse_stdin
    from gitrun.core.isolation import check_setting

    refuse_stdin(key_file, "--key-file", "the checkpoint keyring is a file gitrun reads and "
                 "writes (it makes one when missing), not standard input")  # fmt: skip
    opts = Options(
        Workspace(workspace, key_file),
        lease_seconds=lease_seconds,
        takeover_after=takeover_after,
        say=say or quiet,
        trust_roots=trust_roots,
        isolation=None if isolation is None else check_setting(isolation),
        remote=remote,
    )
    if worker:
        opts.worker = worker
    return opts


@dataclass
class Opened:
    record: RunRecord
    task: Task
    repo: Repository
    env: Environment
    store: CheckpointStore
    site: RemoteSite | None = None  # a --remote run's handle on the shared remote


def base_parts(task: Task, repo: Repository, record_base: str | None) -> dict[str, str]:
    """Scenario parts from the task file as handed in now (initial state recomputed)."""
    if task.initial.repo_dir is not None:
        commit, tree = trees.hash_base(Path(task.initial.repo_dir), task.initial.message)
    elif task.initial.commit is not None:
        commit = task.initial.commit
        found = commit_at(repo, commit)
        tree = str(found.tree_id) if found is not None else "missing"
    else:
        commit = record_base or ""
        found = commit_at(repo, commit) if commit else None
        tree = str(found.tree_id) if found is not None else "missing"
    return task.scenario_parts(commit, tree)


def keyring_store(
    repo: Repository, ws: Workspace, site: RemoteSite | None = None
) -> CheckpointStore:
    """The checkpoint store of an existing run: its keyring must exist (never made here)."""
    return checkpoint_store(repo, ws, load_keyring(ws.key_file, create=False), site)


def checkpoint_store(
    repo: Repository, ws: Workspace, keyring: Keyring, site: RemoteSite | None = None
) -> CheckpointStore:
    """The one way the product builds a checkpoint store: always with the workspace's
    freshness witness, since a signature alone proves no freshness; on a --remote run,
    the remote's log, whose freshness is the remote every machine shares, checked against
    the witness of what this machine saw there (anyone who can push can move it back)."""
    if site is not None:
        return RemoteCheckpointLog(site, keyring, Witness(ws.witness_dir, keyring))
    return CheckpointStore(repo, keyring, Witness(ws.witness_dir, keyring))


def lease_store(
    repo: Repository, run_id: str, opts: Options, site: RemoteSite | None
) -> LeaseManager:
    """The one way the product builds a run's lease handle (the remote's on a --remote run)."""
    if site is not None:
        return RemoteLeaseStore(site, run_id, opts.worker, opts.lease_seconds)
    return LeaseManager(repo, run_id, opts.worker, opts.lease_seconds)


def remote_site(repo: Repository, url: str | None) -> RemoteSite | None:
    return None if url is None else RemoteSite(repo, url)


def open_run(run_id: str, opts: Options, task_dir: Path | None = None) -> Opened:
    ws = opts.workspace
    record = ws.load(check_run_id(run_id))
    task = load_task(task_dir or record.task_dir)
    repo = gitstore.open_repo(record.repo)
    site = remote_site(repo, opts.remote_for(record))
    label = f"{task.id}@{task.version}"
    env = Environment(repo, record.run_id, Path(record.worktree), label, site=site)
    return Opened(record, task, repo, env, keyring_store(repo, ws, site), site)


def the_ref(opened: Opened) -> str | None:
    """The run's checkpoint ref: read by name (cheap), else found by a scan."""
    try:
        direct = checkpoint_ref(opened.record.run_id, opened.task.id, opened.env.instance_id())
    except GitrunError:
        direct = None
    if direct is not None and gitstore.read_ref(opened.repo, direct) is not None:
        return direct
    refs = find_checkpoint_refs(opened.repo, opened.record.run_id)
    if len(refs) > 1:
        raise CheckpointRejected(
            "ambiguous", f"run {opened.record.run_id} has {len(refs)} checkpoint refs"
        )
    return refs[0] if refs else None


def load_verified(opened: Opened, *, check_scenario: bool = True) -> tuple[str, Stored]:
    ref = the_ref(opened)
    if ref is None:
        raise no_ref(opened.record.run_id, opened.store.witnessed(opened.record.run_id))
    parts = (
        base_parts(opened.task, opened.repo, opened.record.base_commit) if check_scenario else None
    )
    return ref, opened.store.load(ref, scenario_parts=parts)


def report_finished(opened: Opened, state: RunState, opts: Options) -> RunState:
    """A finished run reports its result again, after tidying what a kill left behind
    (and, after a power cut, putting its last writes back in its worktree)."""
    from gitrun.app import starting  # loads the agents: not on gitrun status's path

    # e.g. the lease's, if the finished run died releasing it
    starting.clear_stale_locks(opened.repo, opened.record.run_id)
    if not opened.env.worktree.exists():
        return state
    lost = opened.env.power_loss_paths()
    if lost:
        lease = lease_store(opened.repo, opened.record.run_id, opts, opened.site)
        lease.acquire(state.generation, opts.takeover_after)
        try:
            opened.env.repair_power_loss(lost, lease.fence)
        finally:
            with contextlib.suppress(GitrunError):
                lease.release()
    opened.env.sync_index()  # killed after its last checkpoint, before the index sync
    return state


def lease_floor(opened: Opened, state: RunState) -> int:
    """The highest lease version known to have written to the run: its checkpoint's, or
    the one on its branch tip (a write whose receipt still rides). A new lease starts
    above it even when the lease ref was deleted by hand."""
    try:
        tip = opened.env.head()
        on_branch = trailer.lease_of(tip.message_trailers)
    except (GitrunError, ValueError, KeyError, GitError):
        on_branch = 0  # no branch, no trailer: reconcile names that under the lease
    return max(state.lease_version, on_branch)
