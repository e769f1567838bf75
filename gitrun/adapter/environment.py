"""The environment adapter: one git worktree per run, writes as commits (receipts).

A write builds its tree from the parent's tree (only touched paths), commits it with a
trailer block, then moves the run's branch in one ref transaction that also locks the
lease ref and refuses unless the caller's lease is current (fencing). That ref move is
the commit point of the side effect; the receipt index ref and the files on disk are
derived from it and repaired when a crash leaves them behind.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import pygit2

from gitrun.adapter import dotgit, safefs
from gitrun.adapter.worktree import INDEX_BASE_FILE, WorktreeFiles
from gitrun.core import faults, trailer
from gitrun.core.codec import digest
from gitrun.core.contracts import Appended
from gitrun.core.env_records import CLEAN_STATUS as CLEAN_STATUS  # noqa: PLC0414 - re-export
from gitrun.core.env_records import Approval as Approval  # noqa: PLC0414 - re-export for callers
from gitrun.core.env_records import Observation as Observation  # noqa: PLC0414 - re-export
from gitrun.core.env_records import Outcome as Outcome  # noqa: PLC0414 - re-export for callers
from gitrun.core.errors import (
    EnvironmentDrift,
    GateRejected,
    GitrunError,
    LeaseLost,
    ReceiptConflict,
    Refused,
)
from gitrun.core.records import EXEC, REWIND, TOOL, Action, Precondition, Receipt
from gitrun.store import gitstore, trees
from gitrun.store.atomicfile import atomic_write, read_bytes
from gitrun.store.lease import Fence, fenced
from gitrun.store.receipts import GitReceiptLog
from gitrun.store.receipts import branch_ref as branch_ref  # noqa: PLC0414 - re-export for callers
from gitrun.store.receipts import index_ref as index_ref  # noqa: PLC0414 - re-export for callers
from gitrun.store.remote import RemoteReceiptLog, RemoteSite

if TYPE_CHECKING:
    from gitrun.adapter.exec_step import ExecContext, ToolContext

INSTANCE_FILE = "gitrun-instance.json"
AUTHOR = ("gitrun", "gitrun@localhost")

TRAILERS = trailer.WRITE  # a write commit's trailers, in order (gitrun.core.trailer)


class Environment(WorktreeFiles):
    """The adapter for one run's worktree."""

    def __init__(
        self,
        repo: pygit2.Repository,
        run_id: str,
        worktree: Path,
        task_label: str,
        *,
        site: RemoteSite | None = None,
    ) -> None:
        self.repo = repo
        self.site = site  # a --remote run: its receipts live on the shared remote
        self.run_id = run_id
        self.worktree = worktree
        self.branch = branch_ref(run_id)
        self.task_label = task_label
        self._wt: pygit2.Repository | None = None
        self._dotgit: bytes | None = None  # the bytes of gitrun's .git file, once read
        self.write_count = 0  # commits this process actually made (not replays)

    # -- creation and identity ---------------------------------------------------------

    @classmethod
    def create(
        cls,
        repo: pygit2.Repository,
        run_id: str,
        base: pygit2.Oid,
        worktree: Path,
        task_label: str,
        *,
        fence: Fence | None = None,
        site: RemoteSite | None = None,
    ) -> Environment:
        """Branch at ``base``, a worktree on it, and a fresh instance id in its git dir.

        With ``fence``, all of it happens under the lease ref's OS lock with the lease
        checked first (:func:`gitrun.store.lease.fenced`): a worker whose run was taken over
        while it was stopped creates nothing, and a takeover cannot start half-way.
        """
        guard = fenced(repo, run_id, fence) if fence else contextlib.nullcontext()
        with guard:
            if worktree.exists():
                raise EnvironmentDrift("worktree-exists", f"{worktree} already exists")
            branch = branch_ref(run_id)
            gitstore.transaction(repo).move(
                branch, None, base, message="gitrun: run branch", what="branch"
            ).commit()
            worktree.parent.mkdir(parents=True, exist_ok=True)
            # libgit2 creates <common dir>/worktrees without exist_ok: two first runs of one
            # repository at once race on it (AlreadyExistsError). Make it first.
            (gitstore.common_dir(repo) / "worktrees").mkdir(exist_ok=True)
            repo.add_worktree(f"gitrun-{run_id}", str(worktree), repo.references[branch])
            # libgit2 syncs none of the worktree's admin files or checked-out files, and
            # ref moves no longer sync the filesystem (the journal): make them durable now.
            gitstore.sync_all(repo)
            faults.point("setup_worktree_added")
            env = cls(repo, run_id, worktree, task_label, site=site)
            gitdir = Path(env.wt.path)
            atomic_write(gitdir / INDEX_BASE_FILE, str(base).encode())  # base is checked out
            create_instance(gitdir, worktree)
        return env

    @property
    def wt(self) -> pygit2.Repository:
        """The worktree's repository, opened by its admin dir: never through the
        worktree's ``.git`` entry, which an exec's command can replace (:mod:`dotgit`)."""
        if self._wt is None:
            admin = dotgit.admin_dir(gitstore.common_dir(self.repo), self.run_id)
            if not self.worktree.is_dir():
                raise EnvironmentDrift("worktree-missing", f"{self.worktree} no longer exists")
            if not (admin / "gitdir").is_file():
                raise EnvironmentDrift(
                    "worktree-missing",
                    f"the worktree {self.worktree} has lost its git admin dir {admin} ("
                    "`git worktree prune` removes it when the worktree's .git file is "
                    "missing); the run cannot go on there: its receipts stay on "
                    f"the branch {self.branch.removeprefix('refs/heads/')}",
                )
            with contextlib.suppress(OSError):  # best effort: a read-only repository
                dotgit.lock(admin, self.run_id)  # keeps `git worktree prune` off it
            self._wt = gitstore.open_repo(admin)
        return self._wt

    def check_dotgit(self) -> None:
        """The worktree's ``.git`` must be exactly the file gitrun made (drift otherwise)."""
        admin = Path(self.wt.path)
        if self._dotgit is None:
            self._dotgit = dotgit.expected(admin)
        wrong = dotgit.problem(self.worktree, admin, self._dotgit)
        if wrong is not None:
            path = shlex.quote(str(self.worktree / ".git"))
            line = shlex.quote(self._dotgit.decode("utf-8", "replace").rstrip("\n"))
            raise EnvironmentDrift(
                "dotgit-replaced",
                f"{self.worktree / '.git'} {wrong}, not the file gitrun made; a git command "
                f"run there would use another repository. Put gitrun's back "
                f"(rm -rf {path} && printf '%s\\n' {line} > {path}) and resume",
            )

    def instance_id(self) -> str:
        """The instance id, valid only for the worktree at the path it was made for."""
        gitdir = self.wt.path.rstrip("/")  # a string: asked twice a step; a Path costs more
        try:
            record = json.loads(read_bytes(os.path.join(gitdir, INSTANCE_FILE)).decode())
        except (OSError, ValueError) as exc:
            raise EnvironmentDrift(
                "other-instance",
                f"{self.worktree} is not the run's environment: its git dir {gitdir} has no "
                "gitrun instance id (same commit, another worktree)",
            ) from exc
        here = safefs.realpath(self.worktree)  # str(Path.resolve()), without the Path
        if record.get("worktree") != here:
            raise EnvironmentDrift(
                "other-instance",
                f"{here} is a copy of the worktree at {record.get('worktree')}: same files, "
                "different environment instance",
            )
        return str(record["instance_id"])

    # -- observation -------------------------------------------------------------------

    def head(self) -> pygit2.Commit:
        """The run branch's tip commit (EnvironmentDrift when it is gone)."""
        return self.receipt_log.tip()

    def check_head_on_branch(self) -> None:
        """The worktree's HEAD must be the symbolic ref to the run's branch.

        A detached HEAD or another branch at the same commit looks identical by commit
        and files, but the next write moves only the run's branch and leaves that HEAD
        behind: refuse before writing, saying how to put it back.
        """
        head = self.wt.references.get("HEAD")
        target = head.target if head is not None else None
        if isinstance(target, str) and target == self.branch:
            return
        what = (
            f"detached at {str(target)[:12]}"
            if isinstance(target, pygit2.Oid)
            else f"on {target or 'nothing'}"
        )
        short = self.branch.removeprefix("refs/heads/")
        raise EnvironmentDrift(
            "head-not-on-branch",
            f"the worktree's HEAD is {what}, not {short}; put it back with "
            f"`git -C {self.worktree} checkout {short}` and resume; nothing was written",
        )

    def observe(self, full: bool = True, skip: Collection[str] = ()) -> Observation:
        """Instance, HEAD commit and tree, and (when ``full``) a digest of ``git status``
        (without the paths in ``skip``)."""
        instance = self.instance_id()
        self.check_dotgit()
        self.check_head_on_branch()  # so the worktree's HEAD is the branch's commit too
        head = self.head()
        dirty: tuple[str, ...] = ()
        status = CLEAN_STATUS
        if full:
            entries = self.status(skip)
            dirty = tuple(path for path, _ in entries)
            status = digest([[p, int(f)] for p, f in entries]) if entries else CLEAN_STATUS
        return Observation(instance, str(head.id), str(head.tree_id), status, dirty)

    # -- receipts ----------------------------------------------------------------------

    @functools.cached_property
    def receipt_log(self) -> GitReceiptLog:
        """The run's receipt log (lookup, append, index; the remote's on a --remote run)."""
        if self.site is not None:
            return RemoteReceiptLog(self.site, self.run_id, owner_reads=True)
        return GitReceiptLog(self.repo, self.run_id)

    def receipt_of(self, commit: pygit2.Commit) -> Receipt | None:
        """The receipt a gitrun write commit carries, or None for any other commit."""
        return self.receipt_log.receipt_of(commit)

    def lookup(self, key: str, since: str | None = None, *, repair: bool = True) -> Receipt | None:
        """Find the receipt for ``key`` (see :meth:`GitReceiptLog.lookup`)."""
        return self.receipt_log.lookup(key, since, repair=repair)

    def receipt_of_trailers_only(self, commit: pygit2.Commit) -> str | None:
        return self.receipt_log.key_of(commit)

    def receipts(self) -> list[Receipt]:
        """Every receipt on the branch, oldest first (reads history: for audit, not steps)."""
        return self.receipt_log.receipts()

    # -- writing -----------------------------------------------------------------------

    def execute(
        self,
        action: Action,
        key: str,
        intent_digest: str,
        precondition: Precondition,
        fence: Fence,
        approval: Approval | None = None,
        *,
        shell: ExecContext | ToolContext | None = None,
        txn: gitstore.Transaction | None = None,
    ) -> Outcome:
        """Perform ``action`` at most once for ``key``; see docs/design.md §4 step 5. An exec
        needs ``shell`` (:func:`gitrun.adapter.exec_step.execute`). ``txn``, the caller's
        transaction holding the intent's checkpoint move, gets the branch move and is
        committed at the commit point (not for a replay: it is left uncommitted)."""
        if action.kind in (EXEC, TOOL):  # the worktree's whole change (exec_step.perform)
            from gitrun.adapter.exec_step import perform

            return perform(self, action, key, intent_digest, precondition, fence, approval, shell)
        if action.intent_digest() != intent_digest:
            raise Refused(f"intent digest {intent_digest} does not match the action")
        replayed = self._replay(key, intent_digest, precondition)
        if replayed is not None:
            return replayed
        head = self.head()
        self._check_precondition(head, precondition)
        self._check_fence(head, fence, approval)
        changes = self.plan_changes(action, head.tree)
        self._check_clean(head.tree, changes)
        new_tree = trees.tree_with_changes(self.repo, head.tree, dict(changes))
        oid = self._commit(
            action, key, intent_digest, precondition, fence, approval, head, new_tree,
            sorted(changes),
        )  # fmt: skip
        faults.point("after_write_commit_object")
        return self._commit_point(oid, head, changes, fence, approval, txn)

    def _replay(self, key: str, intent_digest: str, pre: Precondition) -> Outcome | None:
        """The receipt ``key`` already has (the write happened: replay it), or None; a
        receipt for another intent under the same key is a conflict."""
        found = self.lookup(key, since=pre.head)
        if found is None:
            return None
        if found.intent_digest != intent_digest:
            raise ReceiptConflict(found, intent_digest)
        return Outcome(found, replayed=True)

    def _commit_point(
        self,
        oid: pygit2.Oid,
        head: pygit2.Commit,
        changes: dict[str, trees.Change],
        fence: Fence,
        approval: Approval | None,
        txn: gitstore.Transaction | None = None,
    ) -> Outcome:
        """Append the write commit to the receipt log (the branch move: the commit point),
        then bring the files on disk to the new tree (as durable as the move: covered)."""
        with gitstore.covering(self.repo):
            appended = self.append_write(oid, head, fence, approval, txn)
            if appended.replayed:
                return Outcome(appended.receipt, replayed=True)
            commit = self.repo[oid]
            if not isinstance(commit, pygit2.Commit):
                raise GitrunError(f"{oid} is not a commit")
            # After the transaction committed: the lease ref's OS lock is taken afresh (flock is
            # per open file; nesting it in the ref transaction would deadlock this process).
            self.sync_files(head.tree, commit.tree, changes, fence)
        faults.point("after_file_sync")
        return Outcome(appended.receipt, replayed=False)

    def append_write(
        self, oid: pygit2.Oid, head: pygit2.Commit, fence: Fence, approval: Approval | None,
        txn: gitstore.Transaction | None = None,
    ) -> Appended:  # fmt: skip
        """The commit point of every write kind: the fenced branch move (refused after an
        approval's expiry), counted when it is not a replay."""
        expiry = [gitstore.Guard(self.branch, _expiry_check(approval))] if approval else []
        appended = self.receipt_log.append(oid, str(head.id), fence, guards=expiry, txn=txn)
        if not appended.replayed:
            self.write_count += 1
            faults.point("after_receipt_index")
        return appended

    def _check_precondition(self, head: pygit2.Commit, pre: Precondition) -> None:
        instance = self.instance_id()
        if instance != pre.instance_id:
            raise EnvironmentDrift(
                "other-instance", f"precondition instance {pre.instance_id}, found {instance}"
            )
        if str(head.id) != pre.head or str(head.tree_id) != pre.tree:
            raise EnvironmentDrift(
                "head-moved", f"{self.branch} is at {head.id}, the intent was planned at {pre.head}"
            )

    def _check_fence(self, head: pygit2.Commit, fence: Fence, approval: Approval | None) -> None:
        trailers = head.message_trailers
        if trailers.get(trailer.RUN) == self.run_id:
            highest = trailer.lease_of(trailers)
            if fence.version < highest:
                raise LeaseLost(
                    None,
                    f"stale fence: lease {fence.version} is older than lease {highest}, "
                    "which already wrote to this worktree",
                )
        if approval is not None and approval.expires_at <= time.time():
            raise GateRejected("approval-expired", "the approval expired before the write")

    def fenced(self, fence: Fence) -> AbstractContextManager[None]:
        """The worktree's files change only under the lease's OS lock (lease.fenced)."""
        return fenced(self.repo, self.run_id, fence)

    def check_writable(self, action: Action, tree: pygit2.Tree, skip: Collection[str] = ()) -> None:
        """Refuse, writing nothing, when the disk would stop ``action`` from executing
        cleanly on ``tree``: a link or file in its way, or edits on its paths (but those
        in ``skip``, which resume puts back first). A refusal the gate makes (the action
        is abandoned when it executes) is not checked here."""
        try:
            changes = self.plan_changes(action, tree, write=False)
        except GateRejected:
            return
        self._check_clean(tree, {p: c for p, c in changes.items() if p not in skip})

    def plan_changes(
        self, action: Action, tree: pygit2.Tree, *, write: bool = True
    ) -> dict[str, trees.Change]:
        """The path → new (blob, mode) map an action makes against ``tree`` (no ref moves).
        With ``write=False`` the blobs are only hashed, not stored."""
        blob = self.repo.create_blob if write else pygit2.hash
        content = action.content_bytes()
        if action.kind == "write_file" and action.path is not None and content is not None:
            mode = trees.entry_mode(tree, action.path)
            keep = mode if mode in (trees.BLOB, trees.EXEC) else trees.BLOB
            return {action.path: (blob(content), keep)}
        if action.kind == "delete_file" and action.path is not None:
            if trees.entry(tree, action.path) is None:
                raise GateRejected(
                    "missing-path", f"{action.path} does not exist; nothing to delete"
                )
            return {action.path: None}
        patch = action.patch_bytes()
        if action.kind == "apply_patch" and patch is not None:
            return self._patch_changes(patch, tree, blob)
        target = self.repo.get(action.tree) if action.kind == REWIND and action.tree else None
        if isinstance(target, pygit2.Tree):
            return trees.rewind_changes(tree, target)
        raise GateRejected("malformed-action", f"{action.kind} lacks the fields it needs")

    def _patch_changes(
        self, text: bytes, tree: pygit2.Tree, blob: Callable[[bytes], pygit2.Oid]
    ) -> dict[str, trees.Change]:
        """The patch's changes as blobs: parsed and applied once per (tree, patch) for the
        whole step (:func:`gitrun.core.patch_plan.plan_patch`; the gate planned it first).
        Imported here: ``gitrun status`` loads this module and needs neither (issue #15)."""
        from gitrun.adapter.gate import GitTree
        from gitrun.core.patch_plan import plan_patch

        plan = plan_patch(text, GitTree(tree))
        return {p: None if c is None else (blob(c[0]), c[1]) for p, c in plan.changes.items()}

    def _check_clean(self, tree: pygit2.Tree, changes: dict[str, trees.Change]) -> None:
        """Refuse, before any file is written, a write whose paths are not exactly
        ``tree``'s on disk (bytes, mode, type) or run through a link or file on disk."""
        for path in sorted(changes):
            if not self.same(safefs.inspect(self.worktree, path), trees.entry_state(tree, path)):
                raise EnvironmentDrift(
                    "uncommitted-edits", f"{path} has uncommitted changes in {self.worktree}"
                )

    def _commit(
        self,
        action: Action,
        key: str,
        intent_digest: str,
        pre: Precondition,
        fence: Fence,
        approval: Approval | None,
        head: pygit2.Commit,
        tree: pygit2.Oid,
        paths: list[str],
        extra: Sequence[str] = (),
    ) -> pygit2.Oid:
        """The write commit; ``extra`` trailer lines (an exec's) follow the usual ones."""
        body = " ".join(action.description.split()) or action.summary()
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        values = (
            self.run_id,
            self.task_label,
            action.kind,
            key,
            intent_digest,
            pre.instance_id,
            fence.version,
            approval.fingerprint if approval else "none",
        )
        more = [tuple(line.split(": ", 1)) for line in extra]  # e.g. an exec's exit code
        label = action.tool if action.kind == TOOL and action.tool else action.kind
        message = trailer.write_message(
            f"gitrun: {label} {shown or '(no change)'}",
            body.replace("---", "- - -"),
            [*zip(trailer.WRITE, values, strict=True), *((k, v) for k, v in more)],
        )
        sig = pygit2.Signature(*AUTHOR, int(time.time()), 0)
        oid: pygit2.Oid = self.repo.create_commit(None, sig, sig, message, tree, [head.id])
        return oid


def create_instance(gitdir: Path, worktree: Path, instance_id: str | None = None) -> None:
    """Write the worktree's instance id, durably, where none exists (never replace one)."""
    dotgit.record(gitdir, worktree)  # the .git file git just made: gitrun's, checked after execs
    record = {"instance_id": instance_id or str(uuid.uuid4()), "worktree": str(worktree.resolve())}
    try:
        atomic_write(gitdir / INSTANCE_FILE, json.dumps(record).encode(), exclusive=True)
    except FileExistsError as exc:
        raise EnvironmentDrift(
            "instance-exists", f"{gitdir} already holds an instance id; it is never replaced"
        ) from exc


def _expiry_check(approval: Approval) -> Callable[[pygit2.Oid | None], None]:
    def check(_: pygit2.Oid | None) -> None:
        if approval.expires_at <= time.time():
            raise GateRejected("approval-expired", "the approval expired before the commit point")

    return check
