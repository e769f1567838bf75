"""Pure, versioned records: actions, receipts, the run state a checkpoint carries.

No I/O here. Every record is a frozen dataclass; :mod:`gitrun.core.codec` encodes it to
canonical JSON and decodes it strictly (unknown field → error).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field, fields, replace
from typing import Any

from gitrun.core.codec import DecodeError, digest, encode, optional_field

SCHEMA_VERSION = 1
ADAPTER_NAMESPACE_PREFIX = "git:"
ADAPTER_VERSION = "gitrun-git/1"

ACTION_KINDS = ("write_file", "delete_file", "apply_patch", "exec")
EXEC = "exec"
# A rewind restores an earlier tree of the run as one new step (never a listed policy
# action: it is allowed wherever some write is, and every path it changes meets the rules).
REWIND = "rewind"
# A tool step records the change an outside agent's tool call (Claude Code's Edit, Write,
# Bash, ...) already made to the worktree: never a listed policy action either; every path
# it changed meets the rules, as an exec step's do.
TOOL = "tool"


def kind_allowed(kind: str, allowed: tuple[str, ...]) -> bool:
    """Whether a policy allowing ``allowed`` allows ``kind`` (a rewind or a tool step:
    when any write is)."""
    return kind in allowed or (kind in (REWIND, TOOL) and bool(allowed))


# Phases of a run; a checkpoint names one explicitly.
RUNNING = "running"
AWAITING_APPROVAL = "awaiting_approval"
NEEDS_REVIEW = "needs_review"
DONE = "done"
FAILED = "failed"
PHASES = (RUNNING, AWAITING_APPROVAL, NEEDS_REVIEW, DONE, FAILED)
TERMINAL = (DONE, FAILED)

# The trace event a checkpoint carries when its worker took the run's lease from another
# worker still at work on it (see gitrun.engine.recovery.record_takeover).
LEASE_TAKEOVER = "lease_takeover"


@dataclass(frozen=True)
class Action:
    """A write the agent proposes. Exactly the fields its kind needs are set.

    File content and patches are bytes, carried byte-exactly in canonical JSON: as text
    (``content`` / ``patch``) when they are valid UTF-8, else as base64 (``content_b64``
    / ``patch_b64``). :meth:`of_bytes` picks the form; never both are set.
    """

    kind: str
    path: str | None = None
    content: str | None = None
    patch: str | None = None
    description: str = ""
    content_b64: str | None = optional_field()
    patch_b64: str | None = optional_field()
    # exec only: a ``bash -c`` string or an argv (exactly one), the working directory
    # (relative, inside the worktree), the timeout and the environment variable names
    # passed through (the gate fills the last two in from the policy).
    command: str | None = optional_field()
    argv: tuple[str, ...] | None = optional_field()
    cwd: str | None = optional_field()
    timeout_seconds: float | None = optional_field()
    env: tuple[str, ...] | None = optional_field()
    tree: str | None = optional_field()  # rewind only: the tree oid the step restores
    # tool only: the outside tool's name and the digest of its input (the intent)
    tool: str | None = optional_field()
    tool_input: str | None = optional_field()
    # exec only: variables set for the command, "NAME=value" sorted by name (a client's
    # own values, e.g. mini-swe-agent's environment.env; never a GITRUN_* name)
    set_env: tuple[str, ...] | None = optional_field()

    def __post_init__(self) -> None:
        self.content_bytes()  # each payload has one well-formed form, or the record is refused
        self.patch_bytes()

    @classmethod
    def of_bytes(
        cls,
        kind: str,
        *,
        path: str | None = None,
        content: bytes | None = None,
        patch: bytes | None = None,
        description: str = "",
    ) -> Action:
        """The action carrying ``content`` / ``patch`` exactly, as text when they are UTF-8."""
        content_text, content_b64 = _text_or_b64(content)
        patch_text, patch_b64 = _text_or_b64(patch)
        return cls(kind, path, content_text, patch_text, description, content_b64, patch_b64)

    def content_bytes(self) -> bytes | None:
        """The exact bytes a ``write_file`` writes."""
        return _field_bytes(self.content, self.content_b64, "content")

    def patch_bytes(self) -> bytes | None:
        """The exact bytes of an ``apply_patch`` diff."""
        return _field_bytes(self.patch, self.patch_b64, "patch")

    def intent(self) -> dict[str, Any]:
        """The normalised parameters the intent digest is computed over: a function of the
        bytes only (text when UTF-8, base64 otherwise; the base64 keys appear only then, so
        a UTF-8 action digests exactly as it did before they existed)."""
        if self.kind == EXEC:
            intent: dict[str, Any] = {
                "kind": self.kind,
                "command": self.command,
                "argv": None if self.argv is None else list(self.argv),
                "cwd": self.cwd,
                "timeout_seconds": self.timeout_seconds,
                "env": None if self.env is None else list(self.env),
            }
            if self.set_env is not None:  # only then: older exec intents digest as before
                intent["set_env"] = list(self.set_env)
            return intent
        if self.kind == REWIND:
            return {"kind": self.kind, "tree": self.tree}
        if self.kind == TOOL:
            return {"kind": self.kind, "tool": self.tool, "tool_input": self.tool_input}
        content, content_b64 = _text_or_b64(self.content_bytes())
        patch, patch_b64 = _text_or_b64(self.patch_bytes())
        out: dict[str, Any] = {
            "kind": self.kind, "path": self.path, "content": content, "patch": patch
        }  # fmt: skip
        if content_b64 is not None:
            out["content_b64"] = content_b64
        if patch_b64 is not None:
            out["patch_b64"] = patch_b64
        return out

    def intent_digest(self) -> str:
        """The digest of :meth:`intent`, computed once per action: it is frozen, so its
        fields (all immutable values) never change, and a step asks four times."""
        found: str | None = self.__dict__.get("_intent_digest")
        if found is None:
            found = digest(self.intent())
            object.__setattr__(self, "_intent_digest", found)
        return found

    def summary(self) -> str:
        if self.kind == "apply_patch":
            lines = len((self.patch_bytes() or b"").splitlines())
            return f"apply_patch ({lines} diff lines)"
        if self.kind == EXEC:
            shown = self.command if self.argv is None else " ".join(self.argv)
            shown = " ".join((shown or "").split())
            return f"exec {shown[:60]}" + ("..." if len(shown) > 60 else "")
        if self.kind == REWIND:
            return f"rewind to tree {(self.tree or '?')[:12]}"
        if self.kind == TOOL:
            return f"tool {self.tool}"
        return f"{self.kind} {self.path}"


def _text_or_b64(data: bytes | None) -> tuple[str | None, str | None]:
    """``data`` as (text, None) when it is UTF-8, else (None, base64)."""
    if data is None:
        return None, None
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        return None, base64.b64encode(data).decode("ascii")


def _field_bytes(text: str | None, b64: str | None, name: str) -> bytes | None:
    """The bytes of a text-or-base64 pair; DecodeError when the pair is malformed."""
    if text is not None and b64 is not None:
        raise DecodeError(f"Action.{name}", f"both {name} and {name}_b64 are set")
    try:
        if b64 is not None:
            return base64.b64decode(b64.encode("ascii"), validate=True)
        return None if text is None else text.encode("utf-8")
    except (ValueError, UnicodeEncodeError) as exc:  # binascii.Error is a ValueError
        raise DecodeError(f"Action.{name}", f"not UTF-8 text or base64: {exc}") from exc


def new_key() -> str:
    """A fresh idempotency key, made before any side effect and persisted with the intent."""
    import uuid

    return "k-" + uuid.uuid4().hex


@dataclass(frozen=True)
class Receipt:
    """The adapter's receipt: a write commit on the run's branch, read back from git."""

    namespace: str  # "git:<branch ref>"
    version: str  # adapter protocol version
    commit: str  # receipt id: the commit oid
    key: str
    intent_digest: str
    action: str
    parent: str
    tree: str
    run_id: str
    instance_id: str
    lease: int
    approval: str  # approval evidence fingerprint, or "none"
    committed_at: int  # committer time of the commit (seconds)
    paths: tuple[str, ...]
    exit_code: int | None = optional_field()  # exec: the command's exit code (None: killed)
    output: str | None = optional_field()  # exec: the oid of the bounded output blob

    def fingerprint(self) -> str:
        """The digest of the encoded receipt, computed once per receipt (as
        :meth:`Action.intent_digest`: frozen, immutable fields; a step asks twice)."""
        found: str | None = self.__dict__.get("_fingerprint")
        if found is None:
            found = digest(encode(self))
            object.__setattr__(self, "_fingerprint", found)
        return found


@dataclass(frozen=True)
class Precondition:
    """The environment state a pending write was planned against."""

    instance_id: str
    head: str
    tree: str


@dataclass(frozen=True)
class Pending:
    """An intent persisted before its side effect (crash window 2 starts here)."""

    action: Action
    key: str
    intent_digest: str
    risk: str | None  # why it needs approval, or None
    precondition: Precondition
    approval: Any | None  # signed approval evidence (encoded), bound to this pending
    proposed_at: float


@dataclass(frozen=True)
class EnvState:
    """The environment as last observed: identity and fingerprint, not a copy of the world."""

    instance_id: str
    worktree: str
    branch: str
    base_commit: str
    head: str
    tree: str
    status_digest: str
    observation_version: str  # = head commit oid
    adapter_generation: int  # number of writes committed on the branch by this run


@dataclass(frozen=True)
class Budgets:
    """What a run has spent so far: proposals, steps, wall time and cost."""

    proposals: int = 0
    steps: int = 0
    wall_seconds: float = 0.0
    cost: float = 0.0


@dataclass(frozen=True)
class Scope:
    """What the run is allowed to do, re-checked before continuing."""

    allowed_actions: tuple[str, ...]
    write_allowlist: tuple[str, ...]
    forbidden_paths: tuple[str, ...]
    policy_version: str


@dataclass(frozen=True)
class VerifierEvent:
    """A verdict, bound to the tree it really ran on and the isolation it ran under."""

    head: str
    tree: str  # the tree materialised for the tests (checked equal to the last write's)
    passed: bool
    summary: str
    outcomes: dict[str, str]
    at: float
    isolation: str = "none"  # "bwrap" or "none"


@dataclass(frozen=True)
class Event:
    """One trace entry. ``data`` is free-form JSON."""

    kind: str
    at: float
    data: Any


@dataclass(frozen=True)
class ReceiptLog:
    """All receipts of the run, bounded: the count, a hash chain over every receipt
    fingerprint in order, and the last receipt in full. Each receipt appears in full in
    the ``events`` of the checkpoint that recorded it, so the chain is auditable."""

    count: int = 0
    chain: str = ""
    last: Receipt | None = None

    def add(self, receipt: Receipt) -> ReceiptLog:
        return ReceiptLog(
            count=self.count + 1,
            chain=digest([self.chain, receipt.fingerprint()]),
            last=receipt,
        )


@dataclass(frozen=True)
class ReviewCase:
    """A frozen receipt conflict, kept whole until a trusted reviewer decides."""

    action: Action
    key: str
    pending_digest: str
    receipt_digest: str  # "" when there is no receipt (an interrupted exec)
    receipt: Receipt | None
    receipt_fingerprint: str
    environment_version: str
    reason: str
    opened_at: float


@dataclass(frozen=True)
class RunState:
    """What one checkpoint holds. Bounded in size: the trace lives in the chain."""

    schema: int
    run_id: str
    task_id: str
    task_version: str
    policy_id: str
    policy_version: str
    scenario_fingerprint: str
    scenario_parts: dict[str, str]
    agent: str
    identity: str  # the worker that wrote this checkpoint
    generation: int
    phase: str
    stop_reason: str | None
    cursor: int
    budgets: Budgets
    scope: Scope
    env: EnvState
    lease_version: int
    pending: Pending | None
    receipts: ReceiptLog
    quarantined_keys: tuple[str, ...]
    used_nonces: tuple[str, ...]
    review: ReviewCase | None
    sealed: tuple[Any, ...]  # superseded approvals and closed review cases, kept whole
    verifier: VerifierEvent | None
    events: tuple[Event, ...]  # new trace events since the previous checkpoint
    trace_count: int
    trace_chain: str
    started_at: float
    updated_at: float = field(default=0.0)
    # the isolation the external agent (--agent cmd:) last started under: kind, network
    agent_isolation: dict[str, str] | None = optional_field()  # noqa: RUF009 - None default

    def with_events(self, *events: Event) -> RunState:
        """Append trace events, extending the trace hash chain."""
        chain = self.trace_chain
        for ev in events:
            chain = digest([chain, encode(ev)])
        return self.evolve(
            events=self.events + events,
            trace_count=self.trace_count + len(events),
            trace_chain=chain,
        )

    def evolve(self, **changes: Any) -> RunState:
        """``dataclasses.replace(self, **changes)`` at an eighth of its cost (a step makes
        six): the fields copied, then ``changes`` set. Exact for RunState: no
        ``__post_init__``, every field set by ``__init__``, nothing else in its dict."""
        if not changes.keys() <= _STATE_FIELDS:
            return replace(self, **changes)  # the TypeError naming the unknown field
        new = object.__new__(RunState)
        values = new.__dict__
        values.update(self.__dict__)
        values.update(changes)
        return new


_STATE_FIELDS = frozenset(f.name for f in fields(RunState))


def first_state(
    *,
    run_id: str,
    task: tuple[str, str],
    policy: tuple[str, str],
    scenario: tuple[str, dict[str, str]],
    agent: str,
    identity: str,
    scope: Scope,
    env: EnvState,
    lease_version: int,
    at: float,
) -> RunState:
    """Generation 1 of a run: running at cursor 0, nothing pending, no receipt, no trace
    yet. ``task`` and ``policy`` are (id, version); ``scenario`` is (fingerprint, parts)."""
    return RunState(
        schema=SCHEMA_VERSION, run_id=run_id, task_id=task[0], task_version=task[1],
        policy_id=policy[0], policy_version=policy[1], scenario_fingerprint=scenario[0],
        scenario_parts=dict(scenario[1]), agent=agent, identity=identity, generation=1,
        phase=RUNNING, stop_reason=None, cursor=0, budgets=Budgets(), scope=scope, env=env,
        lease_version=lease_version, pending=None, receipts=ReceiptLog(), quarantined_keys=(),
        used_nonces=(), review=None, sealed=(), verifier=None, events=(), trace_count=0,
        trace_chain="", started_at=at, updated_at=at,
    )  # fmt: skip
