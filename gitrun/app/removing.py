"""``gitrun rm RUN``: remove a run whole, so its storage is bounded by what you keep.

A run's receipts, checkpoints, outputs and leases are objects in its repository, reachable
only from the run's own refs (``refs/heads/gitrun/<run>`` and ``refs/gitrun/runs/<run>/``).
Removing those refs, its worktree, its freshness witness, its registry entry (and a
Claude Code settings file) leaves every object of the run unreachable: ``git gc`` collects
them (``git gc --prune=now`` at once). gitrun prunes nothing itself: the repository is the
user's, and its other unreachable objects are not gitrun's to drop.

The run's lease is taken first (a live worker or hook refuses, exit 4) and deleted last;
the registry entry goes after everything else, so a removal killed half-way is finished
by running ``gitrun rm RUN`` again.
"""

from __future__ import annotations

import shutil
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from gitrun.adapter import dotgit, shell
from gitrun.app.opening import Opened, Options, lease_store, load_verified, open_run
from gitrun.core.errors import EnvironmentDrift, GitrunError
from gitrun.store import gitstore, trees
from gitrun.store.lease_record import lease_ref


@dataclass(frozen=True)
class Removed:
    run_id: str
    repo: str
    refs: int
    worktree: str


def remove(run_id: str, opts: Options, *, force: bool = False) -> Removed:
    """Remove run ``run_id`` (see the module docstring). Without ``force``, a worktree
    holding files that differ from the run's last receipt is refused, nothing removed."""
    opened = open_run(run_id, opts)
    repo, record = opened.repo, opened.record
    lease = lease_store(repo, run_id, opts, opened.site)
    if opened.site is not None:
        raise GitrunError(f"run {run_id} lives on the remote {opened.site.url}; rm is local only")
    lease.acquire(0, opts.takeover_after)
    lease_name = lease_ref(run_id)
    try:
        worktree = Path(record.worktree)
        if not force and worktree.is_dir():
            _check_saved(opened, worktree)
        wt_name = f"gitrun-{run_id}"
        dotgit.unlock(dotgit.admin_dir(gitstore.common_dir(repo), run_id))  # else prune refuses
        if wt_name in repo.list_worktrees():
            repo.lookup_worktree(wt_name).prune(True)
        shutil.rmtree(gitstore.common_dir(repo) / "worktrees" / wt_name, ignore_errors=True)
        shutil.rmtree(worktree, ignore_errors=True)
        prefix = f"refs/gitrun/runs/{run_id}/"
        names = [r for r in repo.references if r.startswith(prefix) and r != lease_name]
        names += [record.branch] if gitstore.read_ref(repo, record.branch) is not None else []
        for name in names:
            old = gitstore.read_ref(repo, name)
            if old is not None:
                gitstore.transaction(repo).move(
                    name, old, None, message=f"gitrun rm {run_id}"
                ).commit()
    except BaseException:
        lease.release()
        raise
    lease.release()
    old_lease = gitstore.read_ref(repo, lease_name)
    if old_lease is not None:
        gitstore.transaction(repo).move(
            lease_name, old_lease, None, message=f"gitrun rm {run_id}"
        ).commit()
    ws = opts.workspace
    for path in (ws.witness_dir / run_id, ws.witness_dir / f".{run_id}.lock",
                 ws.root / "claude" / f"{run_id}.settings.json"):  # fmt: skip
        with suppress(FileNotFoundError):
            path.unlink()
    ws.forget(run_id)
    return Removed(run_id, record.repo, len(names) + 1, str(worktree))


def _check_saved(opened: Opened, worktree: Path) -> None:
    """Refuse when the worktree holds work no receipt has (it would be lost)."""
    try:
        _, stored = load_verified(opened, check_scenario=False)
        tree = trees.tree_at(opened.repo, stored.state.env.tree)
    except GitrunError:
        return  # no verified checkpoint: nothing to compare with; the refs go anyway
    if tree is None:
        return
    changed = shell.scan(opened.repo, worktree, tree)
    if changed:
        shown = ", ".join(sorted(changed)[:5])
        raise EnvironmentDrift(
            "uncommitted-edits",
            f"the worktree {worktree} holds changes no receipt has ({shown}); nothing was "
            f"removed: keep them elsewhere, or remove anyway with gitrun rm {opened.record.run_id} "
            "--force",
        )
