"""The error hierarchy: one root, families that carry what a caller can act on.

Every family maps to one process exit code (:class:`Exit`) so the CLI can turn any
:class:`GitrunError` into one line and a distinct status. Each family also subclasses
the built-in a caller would catch (``ValueError`` for input and stored data that do
not hold, ``PermissionError`` for refused actions, ``TimeoutError`` for locks held too
long, ``RuntimeError`` for races and ownership), and carries its facts as typed
attributes. A plain :class:`GitrunError` is a broken invariant of gitrun itself:
exit 70, like any unexpected exception.
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gitrun.core.records import Receipt


class Exit(IntEnum):
    """Process exit codes, documented in the README."""

    DONE = 0
    FAILED = 1  # the run finished but did not pass (verifier failed, aborted, out of budget)
    BAD_INPUT = 2  # the user's input is wrong; nothing was changed
    FROZEN = 3  # waiting for a human: approval or review
    OWNED = 4  # another worker holds the run's lease
    REFUSED = 5  # integrity refusal: checkpoint, environment, receipt or transition does not hold
    LEASE_LOST = 6  # this worker lost its lease mid-run; the new owner carries on
    CONFLICT = 7  # a race lost (a ref CAS, a run id taken); nothing of the loser is visible
    AGENT_GONE = 8  # the session's agent left before the run ended; resume continues it
    REMOTE_UNAVAILABLE = 9  # the shared git remote could not be reached or refused; nothing moved
    EXTRA_MISSING = 10  # an option needs an optional extra that is not installed; nothing ran
    INTERNAL = 70  # a bug in gitrun (EX_SOFTWARE); GITRUN_DEBUG=1 shows the traceback
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT); the run resumes from its last checkpoint


class GitrunError(Exception):
    """Root of every error gitrun raises on purpose; raised plain, an internal error."""

    exit_code: Exit = Exit.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class BadInput(GitrunError, ValueError):
    """The user handed in something wrong: a path, a file, an id, an option."""

    exit_code = Exit.BAD_INPUT


class TaskError(BadInput):
    """A task or plan file is missing, malformed, or has unknown/missing fields."""


class UnknownRun(BadInput, LookupError):
    """No run with that id is known in the workspace."""


class GateRejected(GitrunError, PermissionError):
    """The contract gate refused a proposed action; nothing was written."""

    exit_code = Exit.REFUSED

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"{rule}: {message}")
        self.rule = rule


class PatchError(GateRejected):
    """A unified diff is malformed or does not apply to the precondition tree."""

    def __init__(self, message: str) -> None:
        super().__init__("patch-does-not-apply", message)


class Refused(GitrunError, ValueError):
    """Integrity refusal: stored state (a ref, a record, the worktree) does not hold.

    Raised plain where no narrower family fits (a symbolic ref, an unreadable registry).
    """

    exit_code = Exit.REFUSED


class CheckpointRejected(Refused):
    """A checkpoint failed verification on load; nothing was changed."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"checkpoint rejected ({reason}): {message}")
        self.reason = reason


class InvalidState(Refused):
    """A new state failed validation (``rule`` names the invariant); the high-water mark
    did not move."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"invalid state ({rule}): {message}")
        self.rule = rule


class LeaseUnreadable(Refused):
    """The lease ref points at something that is not a gitrun lease (rewritten by hand?)."""

    def __init__(self, oid: str, problem: str) -> None:
        super().__init__(
            f"the run's lease ref points at {oid}, which is not a gitrun lease ({problem}); "
            "no worker may own the run until the ref holds a gitrun lease again"
        )
        self.oid = oid
        self.problem = problem


class RefLocked(GitrunError, TimeoutError):
    """A ref's lock stayed held (by a live process) longer than gitrun waits."""

    exit_code = Exit.REFUSED

    def __init__(self, ref: str, message: str) -> None:
        super().__init__(message)
        self.ref = ref


class StorageFailed(GitrunError, OSError):
    """The disk reported a write error at a durability barrier: nothing after it is
    acknowledged (exit 70, like any failure of gitrun's own machinery)."""

    @classmethod
    def on(cls, where: object, why: str) -> StorageFailed:
        """The one message of a write error on the disk holding ``where``."""
        return cls(
            f"the disk holding {where} reported a write error ({why}): the last "
            "change is not acknowledged; check the disk, then resume the run"
        )


class CasFailed(GitrunError, RuntimeError):
    """A compare-and-swap lost: the ref no longer held the expected value."""

    exit_code = Exit.CONFLICT

    def __init__(self, ref: str, expected: str | None, actual: str | None, what: str = "") -> None:
        detail = f" ({what})" if what else ""
        super().__init__(
            f"compare-and-swap on {ref} lost{detail}: expected {expected or 'absent'}, "
            f"found {actual or 'absent'}"
        )
        self.ref = ref
        self.expected = expected
        self.actual = actual


class EnvironmentDrift(Refused):
    """The worktree is not the state the checkpoint (or the precondition) names."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"environment refused ({reason}): {message}")
        self.reason = reason


class ReceiptDrift(Refused):
    """The receipt cache and the authoritative commit disagree; no replay is claimed."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"receipt drift ({reason}): {message}")
        self.reason = reason


class ReceiptConflict(GitrunError, RuntimeError):
    """Same idempotency key, different intent digest: the run must go to review."""

    exit_code = Exit.FROZEN

    def __init__(self, receipt: Receipt, intent_digest: str) -> None:
        super().__init__(
            f"idempotency key {receipt.key} already committed as {receipt.commit} with intent "
            f"{receipt.intent_digest}, not {intent_digest}"
        )
        self.receipt = receipt
        self.intent_digest = intent_digest


class RunTaken(GitrunError, RuntimeError):
    """Another process registered the same run id first; nothing of it was touched."""

    exit_code = Exit.CONFLICT


class LeaseHeld(GitrunError, RuntimeError):
    """Another live worker owns the run."""

    exit_code = Exit.OWNED

    def __init__(self, owner: str, expires_at: float, message: str) -> None:
        super().__init__(message)
        self.owner = owner
        self.expires_at = expires_at


class LeaseLost(GitrunError, RuntimeError):
    """This worker's lease was taken over or expired; its late work is refused."""

    exit_code = Exit.LEASE_LOST

    def __init__(self, owner: str | None, message: str) -> None:
        super().__init__(message)
        self.owner = owner


class Frozen(GitrunError, RuntimeError):
    """The run waits for a human (approval or review); nothing executes until then."""

    exit_code = Exit.FROZEN


class IllegalTransition(GitrunError, RuntimeError):
    """The run's phase (or its pending intent) does not accept this event; nothing changed."""

    exit_code = Exit.REFUSED

    def __init__(self, phase: str, event: object, message: str) -> None:
        super().__init__(message)
        self.phase = phase
        self.event = event

    @property
    def event_name(self) -> str:
        return type(self.event).__name__


class RunFrozen(IllegalTransition, Frozen):
    """Refused because the run waits for a human (or is not running): exit as Frozen."""

    exit_code = Exit.FROZEN


class AgentGone(GitrunError, RuntimeError):
    """The session's agent closed its pipe or exited before the run ended; resumable."""

    exit_code = Exit.AGENT_GONE


class ApprovalRefused(GitrunError, PermissionError):
    """Approval or review evidence does not verify or does not bind this action."""

    exit_code = Exit.FROZEN

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"evidence refused ({reason}): {message}")
        self.reason = reason


class RemoteUnavailable(GitrunError, ConnectionError):
    """The shared git remote (the source of truth of a ``--remote`` run) could not be
    reached, timed out, or refused the update for a reason other than a lost race.

    Fail closed: no local fallback, nothing claims success; the caller retries later.
    """

    exit_code = Exit.REMOTE_UNAVAILABLE

    def __init__(self, url: str, message: str) -> None:
        super().__init__(message)
        self.url = url


class ExtraMissing(GitrunError, ImportError):
    """An option needs an optional extra (``extra``) that is not installed; nothing ran."""

    exit_code = Exit.EXTRA_MISSING

    def __init__(self, extra: str, what: str) -> None:
        super().__init__(f"{what} needs the {extra} extra: pip install 'gitrun[{extra}]'")
        self.extra = extra


class KeyFileError(BadInput):
    """A key file is missing, unreadable, has unsafe permissions, or is malformed."""


class UnknownBatch(BadInput, LookupError):
    """The shared remote has no such batch (or one without the inputs a worker needs)."""
