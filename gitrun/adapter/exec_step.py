"""An ``exec`` step: a shell command whose side effect is the change it made to the worktree.

The worktree must hold exactly the precondition tree before the command runs. The
command runs confined (:mod:`gitrun.adapter.shell`); then the whole change it made is scanned,
gated path by path, and committed as ONE write commit with the usual trailers plus

    Gitrun-Exit-Code: <int, or "timeout">
    Gitrun-Output: <oid of the output tree: blobs "stdout" and "stderr", each bounded>
    Gitrun-Output-Digest: sha256:<hex>, over b"stdout <len>\n" + stdout + b"stderr <len>\n" + stderr

(``<len>``: the blob's size in decimal bytes) moved by the same fenced compare-and-swap as
any write (the commit point). The output tree is kept reachable by
``refs/gitrun/runs/<run>/outputs/<key>``, written (fenced) before the commit point, so
``git show <oid>:stdout`` reads it and ``git gc`` keeps it; a crash
before the commit point leaves that ref pointing at an output nothing claims, replaced
when the command runs again under the same key. A command that changes nothing still
commits (same tree): its key is durable. A change the gate refuses puts the worktree back
to the precondition tree and raises :class:`ExecRefused`; nothing is committed.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import pygit2

from gitrun.adapter import dotgit, gitview, sandbox, shell
from gitrun.adapter.environment import Approval, Environment, Outcome
from gitrun.adapter.gate import Gate
from gitrun.adapter.sandbox import Confinement
from gitrun.adapter.scancache import ScanCache
from gitrun.core import faults
from gitrun.core.codec import encode
from gitrun.core.errors import (
    CheckpointRejected,
    EnvironmentDrift,
    GateRejected,
    GitrunError,
    LeaseHeld,
    ReceiptConflict,
    Refused,
)
from gitrun.core.exec_policy import OutputLimits
from gitrun.core.records import (
    EXEC,
    NEEDS_REVIEW,
    TOOL,
    Action,
    Event,
    Precondition,
    Receipt,
    ReviewCase,
)
from gitrun.store import gitstore, oslock, trees
from gitrun.store.atomicfile import atomic_write
from gitrun.store.lease import Fence, fence_guard
from gitrun.store.receipts import output_ref

if TYPE_CHECKING:
    from gitrun.engine.runtime import Runtime

TIMEOUT = "timeout"
STARTED_FILE = "gitrun-exec-started"  # in the worktree's git dir: the key last started
RUNNING_LOCK = "gitrun-exec.flock"  # ditto: held while a command of this worktree lives
RUNNING_WAIT_SECONDS = 20.0  # the supervisor's sweep takes at most ~5 s
FIRST_TRY_SECONDS = 2.0  # then a sandbox init left alone in its namespace is ended


class ExecRefused(GateRejected):
    """The command's change breaks a gate rule: the worktree was put back, nothing committed."""


@dataclass(frozen=True)
class ExecContext:
    """How to run an exec step: the gate for its change, the isolation, the lease heartbeat."""

    gate: Gate
    confinement: Confinement
    hidden: shell.Hidden
    heartbeat: Callable[[], None] | None = None
    git: gitview.GitView | None = None  # the command's view of git (None: git fails in it)


def open_interrupted_review(rt: Runtime, discarded: list[str]) -> None:
    """Freeze the run for a human: the pending exec's command may have run (``retry =
    "review"``); its worktree effects are already discarded, any outside ones are unknown."""
    s = rt.state
    p = s.pending
    if p is None:
        raise GitrunError("no pending exec to review")
    what = (
        f"its effects on {', '.join(discarded[:5])} were discarded"
        if discarded
        else ("it left no change in the worktree")
    )
    reason = (
        f"exec interrupted while its command may have been running ({what}); policy.exec.retry "
        "is review: decide replan (run it again under a new key) or abort"
    )
    at = time.time()
    case = ReviewCase(
        p.action, p.key, p.intent_digest, "", None, "", str(rt.env.head().id), reason, at
    )
    event = Event(
        "exec_interrupted", at, {"key": p.key, "discarded": discarded, "case": encode(case)}
    )
    rt.commit(
        replace(s, phase=NEEDS_REVIEW, stop_reason="exec_interrupted", review=case).with_events(
            event
        )
    )
    rt.say(f"review needed for {p.key}: {reason}; run frozen")


def output_digest(stdout: bytes, stderr: bytes) -> str:
    """The digest of an exec's two streams, each length-prefixed (see the module docstring)."""
    h = hashlib.sha256()
    for name, data in ((b"stdout", stdout), (b"stderr", stderr)):
        h.update(b"%s %d\n" % (name, len(data)))
        h.update(data)
    return "sha256:" + h.hexdigest()


def output_tree(repo: pygit2.Repository, stdout: bytes, stderr: bytes) -> pygit2.Oid:
    """Store the two streams as a tree of two blobs, ``stderr`` and ``stdout``."""
    builder = repo.TreeBuilder()
    for name, data in (("stderr", stderr), ("stdout", stdout)):
        builder.insert(name, repo.create_blob(data), trees.BLOB)
    return builder.write()


def read_output(repo: pygit2.Repository, oid: str) -> tuple[bytes, bytes, str] | None:
    """(stdout, stderr, digest) of the output object ``oid``; None when it is not one.

    A tree holds exactly the blobs ``stdout`` and ``stderr``; a lone blob is the
    interleaved output of receipts made before the streams were split (its digest the
    sha256 of its bytes), read as stdout.
    """
    obj = repo.get(oid) if oid else None
    if isinstance(obj, pygit2.Blob):
        return obj.data, b"", "sha256:" + hashlib.sha256(obj.data).hexdigest()
    if not isinstance(obj, pygit2.Tree):
        return None
    streams = {e.name or "": e for e in obj}
    if sorted(streams) != ["stderr", "stdout"]:
        return None
    out, err = streams["stdout"], streams["stderr"]
    if not (isinstance(out, pygit2.Blob) and isinstance(err, pygit2.Blob)):
        return None
    if out.filemode != trees.BLOB or err.filemode != trees.BLOB:
        return None
    return out.data, err.data, output_digest(out.data, err.data)


def output_of(repo: pygit2.Repository, receipt: Receipt) -> tuple[bytes, bytes] | None:
    """The bounded (stdout, stderr) an exec receipt points at (None for other receipts)."""
    if receipt.output is None:
        return None
    found = read_output(repo, receipt.output)
    if found is None:
        raise EnvironmentDrift("exec-output", f"{receipt.output} is not an exec output")
    return found[0], found[1]


def perform(
    env: Environment, action: Action, key: str, intent_digest: str, pre: Precondition,
    fence: Fence, approval: Approval | None, ctx: ExecContext | ToolContext | None,
) -> Outcome:  # fmt: skip
    """An exec step (``ctx`` its :class:`ExecContext`) or a tool step (its :class:`ToolContext`)."""
    if action.kind == EXEC and isinstance(ctx, ExecContext):
        return execute(env, action, key, intent_digest, pre, fence, approval, ctx)
    if action.kind == TOOL and isinstance(ctx, ToolContext):
        return record_tool(env, action, key, intent_digest, pre, fence, approval, ctx)
    raise GitrunError(f"a {action.kind} step needs its context")


def execute(
    env: Environment,
    action: Action,
    key: str,
    intent_digest: str,
    pre: Precondition,
    fence: Fence,
    approval: Approval | None,
    ctx: ExecContext,
) -> Outcome:
    """Run the exec step at most once for ``key`` (see the module docstring)."""
    begun = _replay_or_head(env, action, key, intent_digest, pre, fence, approval)
    if isinstance(begun, Outcome):
        return begun
    head = begun
    ran = _run_on_clean_tree(env, action, key, head, fence, ctx)
    code = TIMEOUT if ran.exit_code is None else str(ran.exit_code)
    streams = Streams(ran.stdout, ran.stderr, [f"Gitrun-Exit-Code: {code}"])
    return _commit_change(
        env, action, key, intent_digest, pre, fence, approval, head, ctx.gate, streams
    )


def _replay_or_head(
    env: Environment,
    action: Action,
    key: str,
    intent_digest: str,
    pre: Precondition,
    fence: Fence,
    approval: Approval | None,
) -> Outcome | pygit2.Commit:
    """The receipt ``key`` already has (replayed), or HEAD once the precondition and the
    fence hold: where an exec step and a tool step both begin."""
    if action.intent_digest() != intent_digest:
        raise Refused(f"intent digest {intent_digest} does not match the action")
    found = env.lookup(key, since=pre.head)
    if found is not None:
        if found.intent_digest != intent_digest:
            raise ReceiptConflict(found, intent_digest)
        return Outcome(found, replayed=True)
    head = env.head()
    env._check_precondition(head, pre)
    env._check_fence(head, fence, approval)
    return head


@dataclass(frozen=True)
class Streams:
    """What a command or tool call said (kept as an output tree) and its extra trailers."""

    stdout: bytes
    stderr: bytes
    trailers: list[str]


@dataclass(frozen=True)
class ToolContext:
    """How to record a tool step: the gate for its change and what the tool reported
    (None when it is not known: a call reconciled after a crash, a change made outside
    any call)."""

    gate: Gate
    observed: Streams | None = None
    cache: ScanCache | None = None  # what the scan may skip (tool steps come often)


def record_tool(
    env: Environment,
    action: Action,
    key: str,
    intent_digest: str,
    pre: Precondition,
    fence: Fence,
    approval: Approval | None,
    ctx: ToolContext,
) -> Outcome:
    """Record at most once for ``key`` the change an outside tool call already made to
    the worktree: the whole worktree against HEAD, gated path by path and committed as
    ONE write commit, exactly as an exec step's change after its command (a change the
    gate refuses puts the worktree back to HEAD and raises :class:`ExecRefused`)."""
    begun = _replay_or_head(env, action, key, intent_digest, pre, fence, approval)
    if isinstance(begun, Outcome):
        return begun
    head = begun
    streams = ctx.observed or Streams(b"", b"", [])
    return _commit_change(
        env, action, key, intent_digest, pre, fence, approval, head, ctx.gate, streams, ctx.cache
    )


def _commit_change(
    env: Environment,
    action: Action,
    key: str,
    intent_digest: str,
    pre: Precondition,
    fence: Fence,
    approval: Approval | None,
    head: pygit2.Commit,
    gate: Gate,
    streams: Streams,
    cache: ScanCache | None = None,
) -> Outcome:
    """Scan the worktree's whole change against HEAD, gate it, and commit it as one
    write commit with the output kept (the fenced compare-and-swap is the commit point)."""
    changes, new_tree = _checked_output(env, gate, head.tree, fence, cache)
    if cache is not None:
        cache.advance(head.tree, new_tree, changes)
    extra = list(streams.trailers)
    if action.kind == EXEC or streams.stdout or streams.stderr:
        output = output_tree(env.repo, streams.stdout, streams.stderr)
        _keep_output(env, key, output, fence)
        extra += [
            f"Gitrun-Output: {output}",
            f"Gitrun-Output-Digest: {output_digest(streams.stdout, streams.stderr)}",
        ]
    oid = env._commit(
        action, key, intent_digest, pre, fence, approval, head, new_tree, sorted(changes), extra
    )
    faults.point("after_write_commit_object")
    appended = env.append_write(oid, head, fence, approval)
    if appended.replayed:
        return Outcome(appended.receipt, replayed=True)
    faults.point("after_file_sync")  # the files on disk already are the commit's
    return Outcome(appended.receipt, replayed=False)


def _run_on_clean_tree(
    env: Environment, action: Action, key: str, head: pygit2.Commit, fence: Fence, ctx: ExecContext
) -> shell.Ran:
    """Run the command on a worktree that is exactly HEAD, marked started under the lease."""
    dirty = shell.scan(env.repo, env.worktree, head.tree)
    if dirty:
        raise EnvironmentDrift(
            "uncommitted-edits",
            f"{', '.join(sorted(dirty)[:5])} differ from HEAD in {env.worktree}; an exec step "
            "runs only on the precondition tree",
        )
    with command_gone(env) as held:
        with env.fenced(fence):  # the lease is current (checked under its OS lock) as it starts
            _mark_started(env, key)
        ran = shell.run(
            action, env.worktree, confinement=ctx.confinement, hidden=ctx.hidden,
            heartbeat=ctx.heartbeat, hold=held,
            git=None if ctx.git is None else (ctx.git, env.repo),
        )  # fmt: skip
    faults.point("exec_done")
    return ran


@contextmanager
def command_gone(env: Environment) -> Iterator[int]:
    """The worktree's exec lock (in its private git dir), taken once no command started
    in it lives. The exec's supervisor is handed the lock and keeps it until the command's
    whole tree is dead — so when gitrun is killed mid-command, a resume that takes it
    knows nothing of the old command can still write to the worktree it puts back."""
    path = Path(env.wt.path) / RUNNING_LOCK
    try:
        fd: int | None = oslock.acquire(path, FIRST_TRY_SECONDS)
    except oslock.LockBusy:  # a left-behind sandbox init may hold it: end those, then wait
        sandbox.end_empty_sandboxes(path)
        fd = None
    try:
        with _taken(fd, path) as held:
            yield held
    except oslock.LockBusy as exc:
        holder = exc.holder.describe() if exc.holder else "a process that left no record"
        raise LeaseHeld(
            "exec",
            0.0,
            f"an earlier exec command in {env.worktree} is still being ended after "
            f"{RUNNING_WAIT_SECONDS:.0f}s (its lock {path} was taken by {holder}): "
            f"find the process holding it (fuser {path}), end it, then resume",
        ) from exc


@contextmanager
def _taken(fd: int | None, path: Path) -> Iterator[int]:
    """The lock already taken (``fd``), or taken now within the usual wait."""
    if fd is None:
        with oslock.flock(path, RUNNING_WAIT_SECONDS) as waited:
            yield waited
        return
    try:
        yield fd
    finally:
        os.close(fd)


def _mark_started(env: Environment, key: str) -> None:
    """Record, durably and before the command starts, that ``key``'s command may have run
    (in the worktree's private git dir): resume under ``retry = "review"`` asks for it."""
    # The one atomic file path: the worktree's git dir is within the agent's reach, and a
    # link planted at a fixed temp name must never be written through.
    atomic_write(Path(env.wt.path) / STARTED_FILE, key.encode())


def may_have_started(env: Environment, key: str) -> bool:
    """Whether the command of ``key`` may have started (see :func:`_mark_started`)."""
    try:
        return (Path(env.wt.path) / STARTED_FILE).read_text() == key
    except OSError:
        return False


def _checked_output(
    env: Environment, gate: Gate, old: pygit2.Tree, fence: Fence, cache: ScanCache | None = None
) -> tuple[dict[str, shell.Entry | None], pygit2.Oid]:
    """What the command changed and the tree it makes, if the worktree's ``.git`` is still
    gitrun's, the output is within the policy's limits and representable in git, and every
    changed path passes the gate; else the worktree (its ``.git`` too) is put back to
    ``old`` and :class:`ExecRefused` names the rule. Odd modes are cleared first."""
    policy = gate.policy.exec
    limits = policy.limits if policy is not None else OutputLimits()
    try:
        _check_dotgit(env)
        changes = shell.scan(
            env.repo, env.worktree, old, write=True, limits=limits, fix_modes=True, cache=cache
        )
        oid = checked_change(env, gate, old, changes)
    except GateRejected as exc:
        discarded = put_back(env, old, fence)
        shown = ", ".join(discarded[:5]) + (" ..." if len(discarded) > 5 else "")
        said = exc.message.removeprefix(exc.rule + ": ")
        raise ExecRefused(
            exc.rule,
            f"{said}; the worktree was put back to the precondition tree "
            f"(discarded: {shown or 'nothing'}); nothing was committed",
        ) from exc
    return changes, oid


def checked_change(
    env: Environment, gate: Gate, old: pygit2.Tree, changes: dict[str, shell.Entry | None]
) -> pygit2.Oid:
    """The tree ``changes`` make of ``old``, if git can hold every name and every changed
    path passes the gate; else :class:`GateRejected` (nothing is put back here)."""
    gate.check_exec_names(changes)  # a name git refuses would fail the tree write
    oid = _representable_tree(env, old, changes)
    new = env.repo[oid]
    if not isinstance(new, pygit2.Tree):
        raise EnvironmentDrift("exec-tree", f"{oid} is not a tree")
    gate.check_exec_changes(changes, old, new)
    return oid


def tree_at(env: Environment, tree_id: str) -> pygit2.Tree:
    """The tree ``tree_id`` of the run's repository (a run's recorded tree: it must exist)."""
    tree = trees.tree_at(env.repo, tree_id)
    if tree is None:
        raise CheckpointRejected(
            "tree-missing", f"the run's tree {tree_id} is not in the repository"
        )
    return tree


def _check_dotgit(env: Environment) -> None:
    wrong = dotgit.problem(env.worktree, Path(env.wt.path))
    if wrong is not None:
        raise GateRejected(
            "exec-dotgit",
            f"the worktree's .git {wrong} after the command: it must stay the file gitrun "
            "made (a repository of the command's own would run its hooks for the user)",
        )


def _representable_tree(
    env: Environment, old: pygit2.Tree, changes: dict[str, shell.Entry | None]
) -> pygit2.Oid:
    """The tree of the change; a name git (libgit2) will not put in a tree is a refusal."""
    try:
        return trees.tree_with_changes(env.repo, old, as_tree_changes(changes))
    except (pygit2.GitError, ValueError) as exc:
        raise GateRejected(
            "exec-unrepresentable", f"git cannot hold what the command made: {exc}"
        ) from exc


def as_tree_changes(changes: dict[str, shell.Entry | None]) -> dict[str, trees.Change]:
    """The scan's (mode, blob) entries as :func:`trees.tree_with_changes` takes them."""
    out: dict[str, trees.Change] = {}
    for path, found in changes.items():
        if found is None:
            out[path] = None
        elif found[1] is not None:
            out[path] = (found[1], found[0])
    return out


def put_back(env: Environment, tree: pygit2.Tree, fence: Fence) -> list[str]:
    """Restore the worktree to ``tree`` as the lease holder, once no earlier command of
    it lives (:func:`command_gone`); the paths discarded."""
    with command_gone(env), env.fenced(fence):
        fixed = dotgit.put_back(env.worktree, Path(env.wt.path))
        discarded = [".git"] if fixed else []
        discarded += shell.restore(env.repo, env.worktree, tree)
    # Durable now: no journal record names these writes (the branch does not move for
    # them), and a cut after the next checkpoint must not bring the discarded back.
    gitstore.sync_all(env.repo)
    return discarded


def _keep_output(env: Environment, key: str, output: pygit2.Oid, fence: Fence) -> None:
    """Point ``outputs/<key>`` at the output tree, fenced: reachable before the commit point.
    A --remote run's ref moves on the remote in the write's own push (the commit point)."""
    if env.site is not None:
        return
    ref = output_ref(env.run_id, key)
    current = gitstore.read_ref(env.repo, ref)
    if current == output:
        return
    txn = gitstore.transaction(env.repo).guard(fence_guard(env.repo, env.run_id, fence))
    txn.move(ref, current, output, message=f"gitrun exec output {key}").commit()


def tip_is_pending_exec(env: Environment, gate: Gate, tip: pygit2.Commit) -> None:
    """Refuse, as drift, an exec commit whose change the gate would not have let through
    (its tree cannot be recomputed: the command's effects are only known from it)."""
    parent = tip.parents[0]
    changes: dict[str, shell.Entry | None] = {}
    for path in trees.changed_paths(parent.tree, tip.tree):
        mode = trees.entry_mode(tip.tree, path)
        obj = trees.entry(tip.tree, path)
        changes[path] = None if mode is None or obj is None else (mode, obj.id)
    changes = {p: e for p, e in changes.items() if e is None or e[0] != trees.TREE}
    try:
        gate.check_exec_changes(changes, parent.tree, tip.tree)
    except GateRejected as exc:
        raise EnvironmentDrift(
            "foreign-commit", f"{tip.id} carries the exec's key but a change it refuses: {exc}"
        ) from exc
    if tip.message_trailers.get("Gitrun-Action") != EXEC and "Gitrun-Output" not in (
        tip.message_trailers
    ):
        return  # a tool step the tool reported nothing for
    found = read_output(env.repo, tip.message_trailers.get("Gitrun-Output", ""))
    if found is None or found[2] != tip.message_trailers.get("Gitrun-Output-Digest"):
        raise EnvironmentDrift("foreign-commit", f"{tip.id} names no output matching its digest")
