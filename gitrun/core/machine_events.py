"""What the state machine takes in (events) and hands out (effects); pure records.

Events carry everything the machine needs from the world, time included, already
checked where checking needs I/O or keys (signatures, the re-read receipt, the gate's
view of the worktree). Effects are instructions, performed by the runtime in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gitrun.core.records import Action, Pending, Precondition, Receipt, RunState


@dataclass(frozen=True)
class Grant:
    """A verified approval as the adapter enforces it: its fingerprint and its expiry."""

    fingerprint: str  # Signed.fingerprint() = digest of the encoded evidence in the pending
    expires_at: float


# -- events: the agent and the gate ----------------------------------------------------


@dataclass(frozen=True)
class Proposed:
    """The gate accepted a write; its fresh key was made now, before any side effect."""

    action: Action
    key: str
    digest: str
    risk: str | None
    precondition: Precondition
    at: float


@dataclass(frozen=True)
class ProposalRejected:
    """The gate refused a proposal (a ``budget-*`` rule ends the run, as BudgetExhausted).

    ``last``: it was the agent's last proposal, so the run ends failed (its last write
    did not land, so HEAD is not its work; a verifier pass would call a refusal done).
    """

    rule: str
    message: str
    summary: str
    at: float
    last: bool = False


@dataclass(frozen=True)
class BudgetExhausted:
    """The gate's budget check refused the next proposal: the run fails."""

    rule: str
    message: str
    summary: str
    at: float


@dataclass(frozen=True)
class Finished:
    """The agent says the task is done: the verifier decides."""

    at: float


# -- events: execution and receipts ------------------------------------------------------


@dataclass(frozen=True)
class ExecuteDue:
    """The loop is about to execute the pending intent; ``grant`` is its verified approval."""

    at: float
    grant: Grant | None = None


@dataclass(frozen=True)
class ApprovalExpired:
    """The pending action's approval was found expired before it executed."""

    at: float


@dataclass(frozen=True)
class PendingRejectedAtExecute:
    """Gated again at execute time (every rule but the budgets, against the intent's
    precondition tree; the key was looked up first and not found) and refused by policy:
    the pending is abandoned, the run goes on. Drift on disk is not this event: the
    adapter refuses it and the intent stays pending for after the human's fix."""

    rule: str
    message: str
    at: float


@dataclass(frozen=True)
class WriteReceipt:
    """The adapter's receipt for the pending key: a new write, or one found (replayed)."""

    receipt: Receipt
    replayed: bool
    environment_version: str  # the branch tip now (kept in a review case if one opens)
    at: float
    grant: Grant | None = None  # the pending's verified approval, when it holds one


@dataclass(frozen=True)
class ReceiptConflict:
    """The adapter found the pending key committed with another intent digest."""

    receipt: Receipt
    environment_version: str
    at: float


@dataclass(frozen=True)
class Pause:
    """The driver stops without a checkpoint of its own (a session's agent left, a rewind's
    one step is done): the receipt still riding in memory, if any, is written now."""

    at: float


# -- events: humans --------------------------------------------------------------------


@dataclass(frozen=True)
class _EvidenceIn:
    evidence: Any  # the encoded Signed evidence, as the checkpoint keeps it
    signer: str
    nonce: str
    expires_at: float
    at: float


@dataclass(frozen=True)
class ApprovalAccepted(_EvidenceIn):
    """A verified approval for a pending action that holds none yet."""


@dataclass(frozen=True)
class ApprovalRefreshed(_EvidenceIn):
    """A verified approval replacing the held (expired) one, which is sealed."""


@dataclass(frozen=True)
class ReviewReplan:
    """A trusted reviewer's replan, checked against the receipt and branch re-read now."""

    evidence: Any
    signer: str
    nonce: str
    reread_fingerprint: str
    head: str
    tree: str
    status: str  # status digest of the fresh observation
    at: float


@dataclass(frozen=True)
class ReviewAbort:
    """A trusted reviewer's abort, checked against the receipt and branch re-read now."""

    evidence: Any
    signer: str
    nonce: str
    reread_fingerprint: str
    head: str
    at: float


@dataclass(frozen=True)
class VerifierResult:
    """The verifier's verdict on an observed HEAD/tree (clean before and after)."""

    passed: bool
    head: str
    tree: str
    status: str
    summary: str
    outcomes: dict[str, str]
    exit_code: int | None
    timed_out: bool
    at: float
    extra: dict[str, Any] = field(default_factory=dict)  # more trace facts (network, …)
    isolation: str = "none"  # the sandbox the tests ran under ("bwrap" or "none")


@dataclass(frozen=True)
class VerifierCannotStart:
    """The test command could not be started (not found, not executable): the run fails,
    every required test counted an error."""

    head: str
    tree: str
    status: str
    summary: str
    required: tuple[str, ...]
    at: float
    extra: dict[str, Any] = field(default_factory=dict)
    isolation: str = "none"


MachineEvent = (
    Proposed
    | ProposalRejected
    | BudgetExhausted
    | Finished
    | ExecuteDue
    | ApprovalExpired
    | PendingRejectedAtExecute
    | WriteReceipt
    | ReceiptConflict
    | ApprovalAccepted
    | ApprovalRefreshed
    | ReviewReplan
    | ReviewAbort
    | VerifierResult
    | VerifierCannotStart
    | Pause
)

# -- effects ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Persist:
    """Advance the checkpoint to ``state`` (validated, signed, CAS, fenced)."""

    state: RunState


@dataclass(frozen=True)
class Hold:
    """Make ``state`` the run's without writing it: a recorded receipt rides in the next
    checkpoint the run writes anyway (the next intent, a freeze, the verdict, a pause).
    Until then the write commit on the branch is the authority, and resume takes it in
    from there (window 3 of docs/design.md §6); ``state.events`` holds what is still unwritten.
    """

    state: RunState


@dataclass(frozen=True)
class Execute:
    """Execute the persisted pending intent once, with its own key and fence."""

    pending: Pending
    grant: Grant | None


@dataclass(frozen=True)
class RunVerifier:
    """Run the verifier on this HEAD and tree, then report a VerifierResult."""

    head: str
    tree: str


@dataclass(frozen=True)
class Freeze:
    """Stop the loop: the run waits for a human (raise Frozen with ``message``)."""

    reason: str
    message: str


@dataclass(frozen=True)
class Say:
    """One progress line for the user."""

    line: str


@dataclass(frozen=True)
class ClearInbox:
    """The evidence of ``kind`` in the inbox was consumed: clear it."""

    kind: str


@dataclass(frozen=True)
class SyncIndex:
    """Bring the worktree's index up to HEAD (bounds how far it lags)."""


Effect = Persist | Hold | Execute | RunVerifier | Freeze | Say | ClearInbox | SyncIndex

Outcome = tuple[RunState, tuple[Effect, ...]]
