"""Runs whose source of truth is a shared git remote (``--remote URL``).

A ``--remote`` run keeps every ref it has on the remote: the branch and the control refs
(checkpoints, lease, receipt index) under ``refs/gitrun/runs/<run>/``, plus a small
``record`` blob that says what a machine needs to take the run over (its agent spec,
base commit, task id and scenario). The stores are built by
:func:`gitrun.app.opening.checkpoint_store` and :func:`~gitrun.app.opening.lease_store`
(one factory each); this module publishes a new run's setup and adopts a run another
machine started.

Every machine must verify the others' checkpoints, so all of them sign with the same
checkpoint keyring: hand it to each machine out of band (``--key-file`` /
``GITRUN_KEY_FILE``, mode 0600). It is never pushed and never leaves the key file.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from gitrun.adapter import dotgit
from gitrun.adapter.environment import Environment, branch_ref, create_instance
from gitrun.adapter.worktree import INDEX_BASE_FILE
from gitrun.app.opening import Options, base_parts
from gitrun.app.starting import repo_dir
from gitrun.app.workspace import RunRecord
from gitrun.core.codec import canonical_bytes
from gitrun.core.errors import (
    BadInput,
    CheckpointRejected,
    EnvironmentDrift,
    RunTaken,
)
from gitrun.core.task import Task
from gitrun.store import gitstore
from gitrun.store.atomicfile import atomic_write
from gitrun.store.checkpoint import find_checkpoint_refs
from gitrun.store.keys import load_keyring
from gitrun.store.lease import Fence
from gitrun.store.remote import RemoteCheckpointLog, RemoteSite, RemoteTransaction
from gitrun.store.witness import Witness

RECORD_FIELDS = ("agent", "agent_identity", "base_commit", "created_by", "scenario_parts")


def record_ref(run_id: str) -> str:
    """The ref of a remote run's record blob (what another machine needs to adopt it)."""
    return f"refs/gitrun/runs/{run_id}/record"


def on_remote(site: RemoteSite, run_id: str) -> bool:
    """Whether the remote already holds run ``run_id`` (fetched into the cache now)."""
    site.sync(run_id)
    repo = site.repo
    return gitstore.read_ref(repo, record_ref(run_id)) is not None or bool(
        find_checkpoint_refs(repo, run_id)
    )


def publish(site: RemoteSite, record: RunRecord, task: Task, fence: Fence) -> None:
    """Push a new run's branch (at its base) and record, fenced: one atomic push.

    A branch already at the base is this same setup pushed before a crash; a record of
    another start (another machine took the run id) is :class:`RunTaken`.
    """
    doc = {name: getattr(record, name) for name in RECORD_FIELDS} | {"task_id": task.id}
    blob = str(gitstore.write_blob(site.repo, canonical_bytes(doc)))
    branch, ref, base = record.branch, record_ref(record.run_id), record.base_commit
    fresh = [False]

    def plan(txn: RemoteTransaction) -> None:
        txn.guard(fence)
        tip = site.branch_on_remote(record.run_id) if fresh[0] else None
        if tip is None or str(tip) != base:
            txn.move(
                branch,
                None,
                base,
                what="a new run's branch",
                seen=None if tip is None else str(tip),
            )
        there = gitstore.read_ref(site.repo, ref) if fresh[0] else None
        if there is None:
            txn.move(ref, None, blob, seen=None)
        elif str(there) != blob:
            raise RunTaken(
                f"run {record.run_id} was started first from another machine on {site.url}; "
                "pick another --run-id"
            )
        fresh[0] = True

    site.transact(record.run_id, plan, f"publishing run {record.run_id}")


def adopt(site: RemoteSite, run_id: str, task: Task, opts: Options) -> RunRecord:
    """Register on this machine a run another machine started on the remote, with a
    worktree of its own at the remote branch: the checkpoint is verified first (the
    shared keyring, the task handed in now), so a refusal registers nothing."""
    ws = opts.workspace
    doc = _remote_record(site, run_id)
    if doc.get("task_id") != task.id:
        raise BadInput(
            f"run {run_id} on {site.url} runs task {doc.get('task_id')!r}, not {task.id!r}"
        )
    refs = find_checkpoint_refs(site.repo, run_id)
    if len(refs) != 1:
        raise CheckpointRejected(
            "high-water-mark-missing" if not refs else "ambiguous",
            f"run {run_id} has {len(refs)} checkpoint refs on {site.url}; it cannot be taken over",
        )
    keyring = load_keyring(ws.key_file, create=False)
    store = RemoteCheckpointLog(site, keyring, Witness(ws.witness_dir, keyring))
    base = str(doc["base_commit"])
    store.load(refs[0], scenario_parts=base_parts(task, site.repo, base))
    worktree = ws.worktree_path(run_id)
    _worktree_at_tip(site, run_id, worktree, refs[0].rsplit("/", 1)[1])
    record = RunRecord(
        run_id, repo_dir(site.repo), task.task_dir, str(worktree), branch_ref(run_id),
        str(doc["agent"]), base, time.time(), created_by=opts.worker,
        agent_identity=str(doc["agent_identity"]), scenario_parts=_parts(doc),
        setup_done=True, key_file=str(ws.key_file.resolve()), remote=site.url,
    )  # fmt: skip
    ws.register(record)
    return record


def _parts(doc: dict[str, object]) -> dict[str, str]:
    parts = doc["scenario_parts"]
    if not isinstance(parts, dict):
        raise CheckpointRejected("corrupt", "the remote run record has no scenario parts")
    return {str(k): str(v) for k, v in parts.items()}


def _remote_record(site: RemoteSite, run_id: str) -> dict[str, object]:
    oid = gitstore.read_ref(site.repo, record_ref(run_id))
    if oid is None:
        raise BadInput(
            f"run {run_id} is neither registered here nor on {site.url}; check the run id "
            "and the remote"
        )
    try:
        doc = json.loads(gitstore.read_blob(site.repo, oid))
    except ValueError as exc:
        raise CheckpointRejected("corrupt", f"{record_ref(run_id)} is not a run record") from exc
    if not isinstance(doc, dict) or not all(name in doc for name in RECORD_FIELDS):
        raise CheckpointRejected("corrupt", f"{record_ref(run_id)} is not a run record")
    return doc


def _worktree_at_tip(site: RemoteSite, run_id: str, worktree: Path, instance_id: str) -> None:
    """A fresh worktree checked out at the run's branch (as fetched) that carries the
    checkpoint's instance id: the environment moves with the run, and resume judges it
    exactly as the checkpointed state (HEAD, tree, clean status). A worktree left by an
    adopt killed before it registered holds nothing the remote lacks: it is made anew."""
    repo = site.repo
    name = f"gitrun-{run_id}"
    dotgit.unlock(dotgit.admin_dir(gitstore.common_dir(repo), run_id))  # else prune refuses
    if name in repo.list_worktrees():
        repo.lookup_worktree(name).prune(True)
    shutil.rmtree(gitstore.common_dir(repo) / "worktrees" / name, ignore_errors=True)
    shutil.rmtree(worktree, ignore_errors=True)
    branch = branch_ref(run_id)
    tip = gitstore.read_ref(repo, branch)
    if tip is None:
        raise EnvironmentDrift("branch-missing", f"{branch} is not on {site.url}")
    worktree.parent.mkdir(parents=True, exist_ok=True)
    (gitstore.common_dir(repo) / "worktrees").mkdir(exist_ok=True)
    repo.add_worktree(name, str(worktree), repo.references[branch])
    gitstore.sync_all(repo)  # libgit2 syncs none of it
    gitdir = Path(Environment(repo, run_id, worktree, "", site=site).wt.path)
    atomic_write(gitdir / INDEX_BASE_FILE, str(tip).encode())  # the tip is checked out
    create_instance(gitdir, worktree, instance_id)


def check_same_remote(opts: Options, record: RunRecord) -> None:
    """Refuse a --remote that is not the run's own (a run never changes its store)."""
    if opts.remote and opts.remote != (record.remote or None):
        where = record.remote or "its own repository (a local run)"
        raise BadInput(f"run {record.run_id} keeps its refs in {where}, not --remote {opts.remote}")


__all__ = ["adopt", "check_same_remote", "on_remote", "publish", "record_ref"]
