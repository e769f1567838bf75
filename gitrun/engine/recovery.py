"""Reconciliation on resume: accept the environment only if it is exactly the
checkpointed state, or that state plus the one commit the pending intent produces.

Window by window (docs/design.md §6):

1. no pending intent: re-observe; the agent decides again from the same cursor;
2. intent persisted, branch unmoved: the loop executes it once with the same key;
3. branch moved by exactly the pending write: verify that commit is the deterministic
   result (parent, trailers, tree), finish an interrupted file sync, record the receipt.
   Not only a crash's window: a step's receipt has no checkpoint of its own (it rides
   in the next one), so every run stopped between two steps is left here;
4. receipt recorded: nothing to redo; the loop replays only the state transition.

The receipt cached in the checkpoint is checked against the authoritative commit first:
any drift stops the run with a clear error and never claims a replay.
"""

from __future__ import annotations

import time
from dataclasses import replace

from gitrun.adapter import exec_step, shell
from gitrun.adapter.gittypes import Commit, Oid, Repository, commit_at, oid, tree_at
from gitrun.core.codec import encode
from gitrun.core.errors import EnvironmentDrift, GateRejected, GitrunError, ReceiptDrift
from gitrun.core.exec_policy import REVIEW
from gitrun.core.records import EXEC, LEASE_TAKEOVER, RUNNING, TOOL, Event, RunState
from gitrun.engine.runtime import Runtime
from gitrun.store import gitstore, receipts, trees


def check_cached_receipt(rt: Runtime, *, repair: bool = True) -> None:
    """The checkpoint's last receipt must equal, field by field, the commit it names."""
    last = rt.state.receipts.last
    if last is None:
        return
    found = rt.env.lookup(last.key, repair=repair)
    if found is None:
        raise ReceiptDrift(
            "receipt-missing",
            f"the checkpoint records {last.commit} for {last.key}, but no such write is on "
            f"{rt.env.branch} (history rewritten?)",
        )
    cached, actual = encode(last), encode(found)
    differing = sorted(k for k in cached if cached[k] != actual.get(k))
    if differing:
        raise ReceiptDrift(
            "receipt-fields",
            f"receipt for {last.key} differs between checkpoint and commit in "
            f"{', '.join(differing)}",
        )


def reconcile(rt: Runtime, *, apply: bool = True, dirty_ok: bool = False) -> str:
    """Bring the runtime and the environment into agreement; return what was done.

    With ``apply=False`` it only makes every check (and raises every refusal) without
    writing anything: resume runs it before it takes the lease, so a refusal changes
    nothing, not even the lease. ``dirty_ok``: files that differ from HEAD are the next
    tool step's (an outside agent's tool calls change the worktree between steps; the
    caller records them), not drift.
    """
    s = rt.state
    env = rt.env
    if not env.worktree.exists():
        raise EnvironmentDrift("worktree-missing", f"the run's worktree {env.worktree} was deleted")
    instance = env.instance_id()
    if instance != s.env.instance_id:
        raise EnvironmentDrift(
            "other-instance",
            f"worktree instance {instance} is not the checkpoint's {s.env.instance_id}",
        )
    _require_branch(rt)
    env.check_head_on_branch()
    tip = env.head()
    checkpointed = oid(s.env.head)
    explained = _explained(rt)
    if not _holds(env.repo, tip.id, checkpointed) or not _holds(env.repo, tip.id, explained):
        # Moved backwards or sideways: name that, not the receipts it made unreachable.
        raise _classify_drift(env.repo, explained, tip.id)
    check_cached_receipt(rt, repair=apply)
    skip = _own_leftovers(rt, apply=apply)
    lost = env.power_loss_paths()  # gitrun's own writes a power cut may have taken
    if lost and apply:
        env.repair_power_loss(lost, rt.lease.fence)
        rt.say(f"after a power cut: put back {len(lost)} path(s) the journal recovered")
    elif lost:
        skip = [*skip, *sorted(lost)]
    if apply:
        record_takeover(rt)
    if str(tip.id) == s.env.head:
        return _at_checkpointed_head(rt, tip, skip, apply=apply, dirty_ok=dirty_ok)
    if s.pending is not None and _is_pending_write(rt, tip):
        return _reconcile_write(rt, tip, skip, apply=apply, dirty_ok=dirty_ok)
    raise _classify_drift(env.repo, explained, tip.id)


def _holds(repo: Repository, tip: Oid, commit: Oid) -> bool:
    return tip == commit or repo.descendant_of(tip, commit)


def _explained(rt: Runtime) -> Oid:
    """The last commit the checkpoint accounts for: its HEAD, or the pending intent's write
    made on it. A step's receipt rides in the run's next checkpoint, so a stopped run's
    branch is normally one write ahead; drift is named from that write (its receipt index
    says it was made: a branch without it was moved back or rewritten)."""
    s = rt.state
    head = oid(s.env.head)
    if s.pending is None:
        return head
    indexed = gitstore.read_ref(rt.env.repo, receipts.index_ref(s.run_id, s.pending.key))
    commit = commit_at(rt.env.repo, indexed) if indexed is not None else None
    if commit is None or list(commit.parent_ids) != [head]:
        return head
    receipt = rt.env.receipt_of(commit)
    return commit.id if receipt is not None and receipt.key == s.pending.key else head


def _reconcile_write(
    rt: Runtime, tip: Commit, skip: list[str], *, apply: bool, dirty_ok: bool = False
) -> str:
    """Window 3: the branch moved by exactly the pending write; take its receipt in
    (``conflict`` opens a review; ``apply=False`` only checks)."""
    s, env = rt.state, rt.env
    if s.pending is None:
        raise ReceiptDrift("not-pending", "a write to reconcile needs a pending intent")
    # Through the receipt index, not the tip alone: an index naming another commit
    # (the real receipt, lost to a history rewrite) is drift, and a missing index
    # (killed while writing it) is rebuilt, clearing its stale lock.
    receipt = env.lookup(s.pending.key, since=s.env.head, repair=apply)
    if receipt is None:
        raise EnvironmentDrift("foreign-commit", f"{tip.id} is not a gitrun write")
    if receipt.commit != str(tip.id):
        raise ReceiptDrift(
            "index-mismatch",
            f"the receipt index for {s.pending.key} names {receipt.commit}, "
            f"not the branch tip {tip.id}",
        )
    if receipt.intent_digest != s.pending.intent_digest:
        if apply:
            rt.conflict(receipt)
        return "conflict"
    if not apply:
        env.repair_sync(check_only=True, skip=skip)
        return "write-reconciled"
    env.repair_sync(rt.lease.fence)
    obs = env.observe(full=not dirty_ok)
    if obs.dirty and not dirty_ok:
        raise EnvironmentDrift("uncommitted-edits", f"uncommitted changes: {list(obs.dirty[:5])}")
    rt.accept(receipt, replayed=True)
    return "write-reconciled"


def _at_checkpointed_head(
    rt: Runtime, tip: Commit, skip: list[str], *, apply: bool, dirty_ok: bool = False
) -> str:
    """The branch is where the checkpoint left it: windows 1 and 2."""
    s = rt.state
    if s.pending is not None and s.pending.action.kind == EXEC:
        return _exec_interrupted(rt, tip, apply=apply)
    if s.pending is not None and s.pending.action.kind == TOOL:
        # The call already ran outside gitrun: what the worktree holds is its change,
        # recorded (once, under its key) when the pending step executes.
        return "tool-pending"
    if dirty_ok:
        if str(tip.tree_id) != s.env.tree:
            raise EnvironmentDrift("tree-changed", f"HEAD tree {tip.tree_id} is not {s.env.tree}")
    else:
        _require_exact(rt, s, skip)
    if s.pending is None:
        return "exact"
    rt.env.check_writable(s.pending.action, tip.tree, skip)  # a link in its way: refuse now
    return "intent-without-write"


def _exec_interrupted(rt: Runtime, tip: Commit, *, apply: bool) -> str:
    """A pending exec without a receipt: whatever the worktree holds beyond HEAD are the
    command's unproven partial effects. Put the worktree back to the precondition tree
    (the discarded paths named in the trace), then run once more under the same key —
    or, with ``retry = "review"`` and a command that may have started, freeze for review."""
    s = rt.state
    p = s.pending
    if p is None:
        raise GitrunError("no pending exec")
    if str(tip.tree_id) != s.env.tree:
        raise EnvironmentDrift("tree-changed", f"HEAD tree {tip.tree_id} is not {s.env.tree}")
    if not apply:
        shell.scan(rt.env.repo, rt.env.worktree, tip.tree)  # readable, or refuse now
        return "exec-interrupted"
    discarded = exec_step.put_back(rt.env, tip.tree, rt.lease.fence)
    shell_policy = rt.task.policy.exec
    review = shell_policy is not None and shell_policy.retry == REVIEW
    if review and (discarded or exec_step.may_have_started(rt.env, p.key)):
        exec_step.open_interrupted_review(rt, discarded)
        return "exec-interrupted, frozen for review"
    if not discarded:
        return "exec-interrupted, nothing to discard; running it again"
    event = Event("exec_discarded", time.time(), {"key": p.key, "paths": discarded})
    rt.commit(replace(s).with_events(event))
    shown = ", ".join(discarded[:10]) + (" ..." if len(discarded) > 10 else "")
    rt.say(f"exec {p.key} was interrupted: discarded its unproven effects on {shown}")
    return "exec-interrupted, partial effects discarded; running it again under the same key"


def _own_leftovers(rt: Runtime, *, apply: bool) -> list[str]:
    """gitrun's temp files a kill left next to the paths of the pending or last write:
    removed under the lease (``apply``), else only named so the check passes over them."""
    s = rt.state
    paths: set[str] = set(s.receipts.last.paths) if s.receipts.last is not None else set()
    if s.pending is not None:
        tree = tree_at(rt.env.repo, s.pending.precondition.tree)
        try:
            if tree is not None:
                paths |= set(rt.env.plan_changes(s.pending.action, tree, write=False))
        except GateRejected:
            pass  # the action will be abandoned; it wrote nothing
    if not paths:
        return []
    if apply:
        rt.env.remove_leftovers(paths, rt.lease.fence)
        return []
    return rt.env.leftovers(paths)


def _require_branch(rt: Runtime) -> None:
    """The run's branch must exist; if not, say which commit the checkpoint names."""
    env, head = rt.env, rt.state.env.head
    if gitstore.read_ref(env.repo, env.branch) is None:
        last = str(_explained(rt))  # the pending's write, when its receipt rides still
        names = head if last == head else f"{head} and its pending write {last}"
        raise EnvironmentDrift(
            "branch-missing",
            f"{env.branch} does not exist; the checkpoint names {names}: restore it with "
            f"`git -C {env.repo.workdir or env.repo.path} update-ref {env.branch} {last}` "
            "and resume; nothing was changed",
        )


def _require_exact(rt: Runtime, s: RunState, skip: list[str]) -> None:
    obs = rt.env.observe(full=True, skip=skip)
    if obs.tree != s.env.tree:
        raise EnvironmentDrift("tree-changed", f"HEAD tree {obs.tree} is not {s.env.tree}")
    if obs.dirty:
        raise EnvironmentDrift(
            "uncommitted-edits",
            f"same HEAD {obs.head[:12]} but different files: {', '.join(obs.dirty[:5])}; "
            "commit nothing there, restore them (git checkout -- .) and resume",
        )


def _is_pending_write(rt: Runtime, tip: Commit) -> bool:
    """True when ``tip`` is exactly the one commit the pending intent produces."""
    p = rt.state.pending
    if p is None or len(tip.parents) != 1 or str(tip.parents[0].id) != rt.state.env.head:
        return False
    receipt = rt.env.receipt_of(tip)
    if receipt is None or receipt.key != p.key:
        return False
    if receipt.intent_digest != p.intent_digest:
        return True  # same key, another intent: a receipt conflict for review, not drift
    if receipt.instance_id != p.precondition.instance_id or receipt.action != p.action.kind:
        raise EnvironmentDrift(
            "foreign-commit", f"{tip.id} carries the key but not the intent's trailers"
        )
    if p.action.kind in (EXEC, TOOL):  # its tree is known only from the commit: gate every path
        exec_step.tip_is_pending_exec(rt.env, rt.gate, tip)
        return True
    parent_tree = tip.parents[0].tree
    expected = trees.tree_with_changes(
        rt.env.repo, parent_tree, rt.env.plan_changes(p.action, parent_tree)
    )
    if expected != tip.tree_id:
        raise EnvironmentDrift(
            "foreign-commit",
            f"{tip.id} carries the intent but not the tree it deterministically makes",
        )
    return True


def _classify_drift(repo: Repository, expected: Oid, tip: Oid) -> EnvironmentDrift:
    if repo.descendant_of(expected, tip):
        return EnvironmentDrift(
            "head-moved-backwards", f"the branch went back from {expected} to {tip}"
        )
    if repo.descendant_of(tip, expected):
        return EnvironmentDrift(
            "extra-commits", f"the branch has commits after {expected} that no intent explains"
        )
    return EnvironmentDrift("foreign-history", f"the branch at {tip} does not contain {expected}")


def record_takeover(rt: Runtime) -> None:
    """A lease taken from another worker still at work on the run (stopped, hung, or out
    of reach, its lease expired or not renewed) is a takeover, not a resume after a
    crash: one checkpoint records who held the run, under which lease, and how it was
    taken, before anything else is written."""
    taken, held = rt.lease.pop_takeover(), rt.lease.lease
    if taken is None or held is None or rt.state.phase != RUNNING:
        return  # a run stopped for a human was let go by its owner, not taken from it
    expired = taken.expires_at <= held.acquired_at
    data = {
        "from_worker": taken.owner_worker,
        "from_lease": taken.lease_version,
        "from_renewed_at": taken.renewed_at,
        "from_expires_at": taken.expires_at,
        "how": "its lease expired" if expired else "its lease was not renewed in time",
        "worker": held.owner_worker,
        "lease": held.lease_version,
    }
    rt.commit(rt.state.with_events(Event(LEASE_TAKEOVER, held.acquired_at, data)))
    rt.say(
        f"run {rt.state.run_id} taken over from worker {taken.owner_worker} "
        f"(lease {taken.lease_version}): {data['how']}"
    )
