"""A step's intent checkpoint riding with its write: one journal record, one sync.

docs/design.md §4 makes the intent (checkpoint ``g+1``, the pending action) durable before
the write. For a write of files that order needs no sync of its own: the intent's
checkpoint commit is written when the step is proposed, and its ref moves in the same
transaction as the write's branch move (:class:`gitrun.store.refmove.Transaction`, its
two ordered moves): one journal record holds both commits and both refs, one
``fdatasync`` makes them durable, and the checkpoint ref is renamed before the branch.
So every state a crash can leave is one the step protocol already covers:

- killed before that record: nothing of the step is durable (window 1: the agent is
  asked again, the step re-proposed under a fresh key);
- killed between the two renames: the intent without its write (window 2,
  ``after_intent_checkpoint`` is passed right there): resume executes it once, same key;
- killed after the branch rename: the write without its receipt in a checkpoint
  (window 3): resume finds the key's commit and records it;
- a power cut: recovery replays the record, both refs or neither.

The witness then names ``g+1`` (as after any advance: the checkpoint is durable before
the witness does). An exec step, an action needing approval, a --remote run, or any other
path than the write itself lands the intent on its own first, exactly as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from gitrun.core.errors import GitrunError
from gitrun.core.records import RUNNING, RunState
from gitrun.store.checkpoint import CheckpointStore, Prepared

if TYPE_CHECKING:
    from gitrun.engine.runtime import Runtime

AFTER = ("after_intent_checkpoint",)  # passed right after the intent's ref moves
RIDING_KINDS = frozenset({"write_file", "delete_file", "apply_patch"})


class Rider:
    """The runtime's riding intent: its checkpoint written, its ref move waiting for the
    write's, and what the machine said of it (held until the intent is durable)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.prepared: Prepared | None = None
        self.proposing = False  # inside step()'s Proposed: its Persist may ride
        self._say = say
        self._held: list[str] = []

    @contextlib.contextmanager
    def proposal(self) -> Iterator[None]:
        self.proposing = True
        try:
            yield
        finally:
            self.proposing = False

    def start(self, prepared: Prepared) -> None:
        self.prepared = prepared

    def hold(self, line: str) -> bool:
        """Keep ``line`` until the riding intent is durable; False when none rides."""
        if self.prepared is None or self.prepared.moved:
            return False
        self._held.append(line)
        return True

    def take(self) -> Prepared | None:
        prepared, self.prepared = self.prepared, None
        return prepared

    def say_held(self, *, durable: bool = True) -> None:
        """Say the held lines (dropped when the intent never became durable)."""
        held, self._held = self._held, []
        for line in held if durable else ():
            self._say(line)


def may_ride(rt: Runtime, state: RunState) -> bool:
    """Whether the intent ``state`` persists can ride with its write."""
    pending = state.pending
    return (
        pending is not None
        and state.phase == RUNNING
        and pending.risk is None
        and pending.action.kind in RIDING_KINDS
        and rt.env.site is None
        and type(rt.store) is CheckpointStore
    )


def start(rt: Runtime, state: RunState) -> None:
    """The intent ``state`` written and its ref move staged in the step's transaction,
    which the write then commits (:func:`may_ride` said it may)."""
    store = _local(rt)
    rt.rider.start(store.prepare(rt.ref, state, rt.checkpoint, rt.lease.fence, AFTER))


def land(rt: Runtime) -> None:
    """The riding intent (if any) becomes the checkpoint: settled when its write moved
    its ref, moved on its own otherwise; what was said of it is said once it is durable."""
    prepared = rt.rider.take()
    if prepared is None:
        return
    try:
        _local(rt).land(prepared, rt.lease.fence)
    finally:
        rt.rider.say_held(durable=prepared.moved)
    rt.checkpoint = prepared.oid
    rt.lease.maybe_renew(rt.state.generation)


def _local(rt: Runtime) -> CheckpointStore:
    """The runtime's checkpoint store, which rides only when it is the local git one."""
    store = rt.store
    if not isinstance(store, CheckpointStore):
        raise GitrunError("only the local checkpoint store lets an intent ride with its write")
    return store


def land_after_failure(rt: Runtime) -> None:
    """The write raised: the intent becomes the checkpoint all the same (settled if its
    ref moved, else moved now), as it was before any write was tried, so the refusal
    leaves it pending for resume; a failure to land it leaves the write's error to say."""
    with contextlib.suppress(GitrunError, OSError):
        rt.land()


__all__ = ["AFTER", "RIDING_KINDS", "Rider", "land", "land_after_failure", "may_ride", "start"]
