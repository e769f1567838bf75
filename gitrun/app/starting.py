"""Starting a run: its registration, a start again with the same id, an interrupted setup.

A run's life begins with one exclusive act, its registry record
(:meth:`Workspace.register`), which says ``setup_done = False`` until the first
checkpoint is durable. That marker is gitrun's own evidence: a run whose setup never
finished may be set up again by whoever owns it next; a run whose setup did finish is
never re-created, whatever refs went missing since (resume refuses and deletes nothing).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from gitrun.adapter import dotgit
from gitrun.adapter.gittypes import Repository, discover
from gitrun.app.workspace import RunRecord, Workspace
from gitrun.core.errors import CheckpointRejected, GitrunError, KeyFileError
from gitrun.core.task import Task
from gitrun.engine.agents import ScriptAgent
from gitrun.store import gitstore
from gitrun.store.keys import Keyring, load_keyring
from gitrun.store.lease import Fence, fenced

PartsOf = Callable[[Repository, str], dict[str, str]]


def repo_dir(repo: Repository) -> str:
    """The directory a run's record names for its repository."""
    return str(Path(repo.path).parent if not repo.is_bare else repo.path)


def keyring_for_new_run(ws: Workspace) -> Keyring:
    """The keyring a new run signs with, created (exclusively) only if no run needs it."""
    # Every run creates its keyring before it registers: a run seen here whose keyring
    # is absent when looked at again means the keyring was lost, not not-yet-written.
    if not ws.key_file.exists():
        users = runs_keyed_by(ws, ws.key_file)
        if users and not ws.key_file.exists():
            raise KeyFileError(
                f"key file {ws.key_file} is missing but {len(users)} run(s) of {ws.root} "
                f"(e.g. {users[0]}) are signed with it; restore it from a backup (or pass "
                "--key-file): a fresh key would leave them unverifiable"
            )
    return load_keyring(ws.key_file)


def runs_keyed_by(ws: Workspace, key_file: Path) -> list[str]:
    """The registered runs whose checkpoints ``key_file`` signs."""
    default, wanted = ws.root / "keys" / "checkpoint.keyring", key_file.resolve()
    out = []
    for rid in ws.runs_ids():
        try:
            recorded = ws.load(rid).key_file
        except GitrunError:
            out.append(rid)  # unreadable: in doubt, it may need this keyring
            continue
        if Path(recorded or default).resolve() == wanted:
            out.append(rid)
    return out


def differences(
    record: RunRecord,
    task: Task,
    agent: ScriptAgent,
    spec: str,
    repo_path: Path | None,
    ws: Workspace,
    parts_of: PartsOf,
) -> list[str]:
    """What a new start's inputs change against the run's (empty: the same run).

    ``parts_of(repo, base)`` is the scenario of ``task`` on the run's base commit.
    """
    out = []
    if task.task_dir != record.task_dir:
        out.append(f"task dir {task.task_dir} (the run's is {record.task_dir})")
    if spec != record.agent:
        out.append(f"agent {spec} (the run's is {record.agent})")
    elif record.agent_identity and agent.identity != record.agent_identity:
        out.append(f"agent {spec}: its plan or patch content changed")
    wanted = _repo_dir_of(task, ws, repo_path)
    if Path(wanted).resolve() != Path(record.repo).resolve():
        out.append(f"repo {wanted} (the run's is {record.repo})")
    if record.scenario_parts:
        try:
            parts = parts_of(gitstore.open_repo(record.repo), record.base_commit)
        except GitrunError:
            parts = {}
        changed = sorted(
            k
            for k in parts.keys() | record.scenario_parts.keys()
            if parts.get(k) != record.scenario_parts.get(k)
        )
        if changed:
            out.append(f"task file content ({', '.join(changed)})")
    return out


def _repo_dir_of(task: Task, ws: Workspace, repo_path: Path | None) -> str:
    """The repository a start with these inputs would use (found, never created)."""
    where = repo_path if repo_path is not None else task.initial.path
    if where is None:
        return str(ws.root / "repos" / task.id)
    found = discover(where) if Path(where).exists() else None
    return str(Path(found).parent) if found else str(where)


def mark_set_up(ws: Workspace, repo: Repository, run_id: str, fence: Fence) -> None:
    """Record that the run's first checkpoint is durable (its lease holder only)."""
    with fenced(repo, run_id, fence):
        current = ws.load(run_id)
        if not current.setup_done:
            ws.save(replace(current, setup_done=True))


def mark_missing(repo: Repository, rec: RunRecord, witnessed: str = "") -> CheckpointRejected:
    """The refusal for a set-up run whose checkpoint ref is gone: never re-create it.
    ``witnessed`` is the witness's word on what the ref held (the commit to restore)."""
    missing = f"its checkpoint ref (refs/gitrun/runs/{rec.run_id}/checkpoints/...){witnessed}"
    if gitstore.read_ref(repo, rec.branch) is None:
        missing += f" and its branch {rec.branch}"
    return CheckpointRejected(
        "high-water-mark-missing",
        f"run {rec.run_id} finished its setup but {missing} are missing from {rec.repo}; "
        f"nothing was changed (worktree {rec.worktree} kept): restore them from a backup "
        "with `git update-ref`, or start over under another --run-id",
    )


def check_unstarted(repo: Repository, rec: RunRecord) -> None:
    """Refuse to redo a setup unless all of gitrun's own evidence says none finished.

    The registry must still say setup; the branch must be absent or at the base and no
    receipt may exist. Anything else is work that must not be discarded.
    """
    tip = gitstore.read_ref(repo, rec.branch)
    prefix = f"refs/gitrun/runs/{rec.run_id}/receipts/"
    receipts = [r for r in repo.references if r.startswith(prefix)]
    if rec.setup_done or (tip is not None and str(tip) != rec.base_commit) or receipts:
        raise CheckpointRejected(
            "high-water-mark-missing",
            f"run {rec.run_id} has no checkpoint ref, yet its registry, branch or receipts "
            f"show work was done; nothing was changed (worktree {rec.worktree} kept): "
            "restore the checkpoint ref from a backup with `git update-ref`, or start over "
            "under another --run-id",
        )


def discard_setup(repo: Repository, rec: RunRecord) -> None:
    """Undo a setup a crash interrupted before the first checkpoint (nothing was done)."""
    wt_name = f"gitrun-{rec.run_id}"
    dotgit.unlock(dotgit.admin_dir(gitstore.common_dir(repo), rec.run_id))  # else prune refuses
    if wt_name in repo.list_worktrees():
        repo.lookup_worktree(wt_name).prune(True)
    # add_worktree killed half-way leaves an admin dir libgit2 neither lists nor prunes,
    # and then refuses to add the worktree again: it holds nothing of value yet.
    shutil.rmtree(gitstore.common_dir(repo) / "worktrees" / wt_name, ignore_errors=True)
    shutil.rmtree(rec.worktree, ignore_errors=True)
    tip = gitstore.read_ref(repo, rec.branch)
    if tip is not None:
        gitstore.transaction(repo).move(
            rec.branch, tip, None, message="gitrun: discard unstarted run"
        ).commit()


def clear_stale_locks(repo: Repository, run_id: str) -> None:
    """Remove the ``<ref>.lock`` files a killed gitrun writer left on this run's refs.

    Only refs no later step of the run will lock need this (a discarded instance's
    checkpoint ref; the lease of a finished run): every ref write clears its own.
    """
    cdir = gitstore.common_dir(repo)
    folder = cdir / "refs" / "gitrun" / "runs" / run_id
    for lock in sorted(folder.rglob("*.lock")) if folder.is_dir() else []:
        with gitstore.os_locks(repo, [str(lock.relative_to(cdir))[: -len(".lock")]]):
            pass  # holding the ref's OS lock removes its stale lock file
