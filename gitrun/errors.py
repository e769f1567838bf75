"""The error hierarchy: one root, families that carry what a caller can act on.

Every family maps to one process exit code (see :data:`EXIT_CODES`) so the CLI can
turn any :class:`GitrunError` into one line and a distinct status.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class Exit(IntEnum):
    """Process exit codes, documented in the README."""

    DONE = 0
    FAILED = 1  # the run finished but did not pass (verifier failed, aborted, out of budget)
    BAD_INPUT = 2  # the user's input is wrong; nothing was changed
    FROZEN = 3  # waiting for a human: approval or review
    OWNED = 4  # another worker holds the run's lease
    REFUSED = 5  # integrity refusal: checkpoint, environment or receipt does not hold
    LEASE_LOST = 6  # this worker lost its lease mid-run; the new owner carries on
    CONFLICT = 7  # a compare-and-swap lost a race; nothing of the loser is visible


class GitrunError(Exception):
    """Root of every error gitrun raises on purpose."""

    exit_code: Exit = Exit.REFUSED

    def __init__(self, message: str, **facts: Any) -> None:
        super().__init__(message)
        self.message = message
        self.facts = facts

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
        super().__init__(f"{rule}: {message}", rule=rule)
        self.rule = rule


class PatchError(GateRejected):
    """A unified diff is malformed or does not apply to the precondition tree."""

    def __init__(self, message: str) -> None:
        super().__init__("patch-does-not-apply", message)


class CheckpointRejected(GitrunError):
    """A checkpoint failed verification on load; nothing was changed."""

    exit_code = Exit.REFUSED

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"checkpoint rejected ({reason}): {message}", reason=reason)
        self.reason = reason


class InvalidState(GitrunError, ValueError):
    """A new state failed validation; the high-water mark did not move."""

    exit_code = Exit.REFUSED


class CasFailed(GitrunError):
    """A compare-and-swap lost: the ref no longer held the expected value."""

    exit_code = Exit.CONFLICT

    def __init__(self, ref: str, expected: str | None, actual: str | None, what: str = "") -> None:
        detail = f" ({what})" if what else ""
        super().__init__(
            f"compare-and-swap on {ref} lost{detail}: expected {expected or 'absent'}, "
            f"found {actual or 'absent'}",
            ref=ref,
            expected=expected,
            actual=actual,
        )
        self.ref = ref
        self.expected = expected
        self.actual = actual


class EnvironmentDrift(GitrunError):
    """The worktree is not the state the checkpoint (or the precondition) names."""

    exit_code = Exit.REFUSED

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"environment refused ({reason}): {message}", reason=reason)
        self.reason = reason


class ReceiptDrift(GitrunError):
    """The receipt cache and the authoritative commit disagree; no replay is claimed."""

    exit_code = Exit.REFUSED

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"receipt drift ({reason}): {message}", reason=reason)
        self.reason = reason


class ReceiptConflict(GitrunError):
    """Same idempotency key, different intent digest: the run must go to review."""

    exit_code = Exit.FROZEN

    def __init__(self, receipt: Any, intent_digest: str) -> None:
        super().__init__(
            f"idempotency key {receipt.key} already committed as {receipt.commit} with intent "
            f"{receipt.intent_digest}, not {intent_digest}",
            receipt=receipt,
        )
        self.receipt = receipt
        self.intent_digest = intent_digest


class LeaseHeld(GitrunError):
    """Another live worker owns the run."""

    exit_code = Exit.OWNED

    def __init__(self, owner: str, expires_at: float, message: str) -> None:
        super().__init__(message, owner=owner, expires_at=expires_at)
        self.owner = owner
        self.expires_at = expires_at


class LeaseLost(GitrunError):
    """This worker's lease was taken over or expired; its late work is refused."""

    exit_code = Exit.LEASE_LOST

    def __init__(self, owner: str | None, message: str) -> None:
        super().__init__(message, owner=owner)
        self.owner = owner


class Frozen(GitrunError):
    """The run waits for a human (approval or review); nothing executes until then."""

    exit_code = Exit.FROZEN


class ApprovalRefused(GitrunError, PermissionError):
    """Approval or review evidence does not verify or does not bind this action."""

    exit_code = Exit.FROZEN

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"evidence refused ({reason}): {message}", reason=reason)
        self.reason = reason


class KeyFileError(GitrunError):
    """A key file is missing, unreadable, has unsafe permissions, or is malformed."""

    exit_code = Exit.BAD_INPUT
