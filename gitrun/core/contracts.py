"""The three store contracts the runtime depends on: checkpoint log, lease store, receipt log.

Each is a small :class:`typing.Protocol`. The git implementations are the product
(:class:`gitrun.store.checkpoint.CheckpointStore`, :class:`gitrun.store.lease.LeaseManager`,
:class:`gitrun.store.receipts.GitReceiptLog`); an in-memory one of each lives in the tests
(``tests/memory_stores.py``) and one conformance suite (``tests/conformance/``) runs
against every implementation, so a new store (a remote one) is done when it passes it.

What every implementation must honour, whatever it stores in:

- **One commit point per change**: a compare-and-swap of one head. A loser raises
  :class:`~gitrun.core.errors.CasFailed` and nothing of it is visible (an orphan object it
  wrote may stay; no head names it).
- **Fencing in the same step**: a write presents the :class:`~gitrun.store.lease.Fence` it
  believes it holds; the store re-reads the lease *inside* the compare-and-swap and raises
  :class:`~gitrun.core.errors.LeaseLost` (nothing moves) unless the lease still names that
  owner and version and has not expired. The fence is checked before the head is compared.
- **Strict errors, nothing changed on refusal**: every refusal leaves every head as it was.

This module is pure: no pygit2, no I/O. Store-specific ids are type parameters (git
uses ``pygit2.Oid`` for checkpoint heads; the receipt log speaks hex commit ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:  # records only: the lease records move to the pure core with the layout
    from gitrun.core.records import Receipt, RunState
    from gitrun.store.lease import Fence, Lease

Id = TypeVar("Id")
Id_co = TypeVar("Id_co", covariant=True)
Write_contra = TypeVar("Write_contra", contravariant=True)


class LoadedCheckpoint(Protocol[Id_co]):
    """A verified checkpoint: the state, the id of the head it was read from, its signer."""

    @property
    def state(self) -> RunState: ...

    @property
    def oid(self) -> Id_co: ...

    @property
    def key_id(self) -> str: ...

    @property
    def committed_at(self) -> int: ...


class CheckpointLog(Protocol[Id]):
    """One run's signed checkpoint chain; the head of ``ref`` is the generation high-water mark.

    - :meth:`advance` validates ``state`` fully first (``gitrun.core.validate.validate_state``):
      an invalid state raises :class:`~gitrun.core.errors.InvalidState` *before anything is
      written*, not even an orphan object. It then writes the signed checkpoint and moves
      the head from ``expected`` (None: the ref must not exist) to it in one
      compare-and-swap, fenced by ``fence`` when one is given (stale fence →
      :class:`~gitrun.core.errors.LeaseLost`, lost race → :class:`~gitrun.core.errors.CasFailed`;
      either way the head is unchanged).
    - :meth:`load` returns the checkpoint at the head only after verifying its signature
      with the store's keyring and decoding it strictly; anything else raises
      :class:`~gitrun.core.errors.CheckpointRejected` with a ``reason``: ``high-water-mark-missing``
      (no head), ``stale-generation`` (``offered`` is not the head), ``bad-signature``
      (tampered), ``unknown-key`` (signed with a key the keyring lacks), ``scenario-changed``
      (``scenario_parts`` differ from the checkpoint's), ``corrupt`` and schema reasons.
    """

    def head(self, ref: str) -> Id | None:
        """The id of the checkpoint at the high-water mark, None when ``ref`` has none."""
        ...

    def advance(self, ref: str, state: RunState, expected: Id | None, fence: Fence | None) -> Id:
        """Validate, write signed, compare-and-swap the head from ``expected``; the new id."""
        ...

    def load(
        self, ref: str, *, scenario_parts: dict[str, str] | None, offered: Id | None = None
    ) -> LoadedCheckpoint[Id]:
        """Verify and decode the checkpoint at the head of ``ref`` (strict; see above)."""
        ...

    def chain(self, ref: str, limit: int | None = None) -> Sequence[LoadedCheckpoint[Id]]:
        """Every checkpoint of ``ref`` (at most ``limit``), newest first, each verified as
        :meth:`load` verifies the head (CheckpointRejected on the first that fails); empty
        when ``ref`` has none. It walks the history: for audit and rewind, not per step."""
        ...


class LeaseStore(Protocol):
    """One worker's handle on one run's lease; the lease version is the fencing token.

    - :meth:`acquire` takes the lease when it is free, already this worker's, expired, not
      renewed for ``takeover_after`` seconds, or held by a worker known dead. A change of
      owner bumps ``lease_version`` by one; re-acquiring one's own lease keeps it.
      Otherwise :class:`~gitrun.core.errors.LeaseHeld` naming the owner and its expiry.
      A second live handle with the same worker id is refused the same way.
    - :meth:`check_takeable` makes the same decision and writes nothing.
    - :meth:`renew` extends the lease by compare-and-swap; :class:`~gitrun.core.errors.LeaseLost`
      when it is no longer this worker's (taken over, expired, or never acquired).
    - :meth:`release` expires the lease now and keeps its version, so the next owner's
      version is higher and every fence of this one is refused from then on.
    - :attr:`fence` is what writers present; LeaseLost when the handle holds no lease.
    - :meth:`pop_takeover` is the lease :meth:`acquire` took from another worker still at
      work on the run (not a resume after that worker's crash), once; None afterwards.
    """

    @property
    def run_id(self) -> str: ...

    @property
    def worker(self) -> str: ...

    @property
    def duration(self) -> float: ...

    @property
    def lease(self) -> Lease | None: ...

    @property
    def fence(self) -> Fence: ...

    def acquire(self, state_version: int, takeover_after: float | None = None) -> Lease:
        """Take the lease (see above) recording checkpoint generation ``state_version``."""
        ...

    def check_takeable(self, takeover_after: float | None = None) -> tuple[Lease | None, object]:
        """Raise LeaseHeld unless acquire may take the lease now; (current lease, its id)."""
        ...

    def renew(self, state_version: int | None = None) -> Lease:
        """Extend this worker's lease; LeaseLost if it is no longer this worker's."""
        ...

    def maybe_renew(self, state_version: int | None = None) -> None:
        """Renew when a third of the lease has passed (cheap enough to call every step)."""
        ...

    def release(self) -> None:
        """Give the lease up on a clean exit: expire it now, keep its version."""
        ...

    def pop_takeover(self) -> Lease | None:
        """The lease the last acquire took from another worker at work on the run, once."""
        ...


@dataclass(frozen=True)
class Appended:
    """What :meth:`ReceiptStore.append` did: the key's receipt, and whether it already was."""

    receipt: Receipt
    replayed: bool


class ReceiptStore(Protocol[Write_contra]):
    """One run's receipt log: the authoritative history of its writes plus a key index.

    The history is the authority; the index (key → receipt id) is a cache that is
    rebuilt from it and never trusted over it.

    - :meth:`lookup` finds the receipt for ``key``: the index first (an entry that names
      no receipt of that key raises :class:`~gitrun.core.errors.ReceiptDrift` ``index-mismatch``;
      one no longer in the history ``receipt-not-on-branch``), then the history from the
      head down to, not including, ``since`` (the precondition head of the pending intent:
      a fresh key cannot sit below it; None walks to the run's base). A receipt found in
      the history is written back to the index unless ``repair`` is False.
    - :meth:`append` is the commit point of a write. ``write`` is the store's prepared
      write. For git it is the oid of the write commit that
      :meth:`gitrun.adapter.environment.Environment.execute` built (trailer block, tree, parent =
      the head it planned at); append is then the one ref transaction that locks the
      lease ref, refuses unless ``fence`` is current (plus any extra guard execute adds,
      e.g. the approval's expiry), compares the run branch with ``expected`` and moves
      it to that commit, followed by the index entry (derived, repairable). Refusals: a
      stale ``fence`` raises LeaseLost before any head is compared or any receipt is
      returned; a key that already has a receipt (as :meth:`lookup` with
      ``since=expected`` sees it) writes nothing and returns it as ``replayed`` when the
      intent digest is the same, or raises :class:`~gitrun.core.errors.ReceiptConflict`; a
      write not based on ``expected`` raises ReceiptDrift ``not-a-write``; a head that
      moved raises CasFailed. The caller looks the key up before it prepares the write
      (docs/design.md §4 step 5, the replay path); append's own bounded check is the last
      line against a second receipt for one key.
    - :meth:`rebuild_index` rewrites the index entry of every receipt in the history and
      returns how many entries it wrote (entries already right are not rewritten).
    """

    def head(self) -> str:
        """The id of the newest receipt, or the run's base when it has none."""
        ...

    def lookup(self, key: str, since: str | None = None, *, repair: bool = True) -> Receipt | None:
        """The receipt for ``key``: the index, then the history above ``since``."""
        ...

    def append(self, write: Write_contra, expected: str, fence: Fence) -> Appended:
        """Commit ``write`` as the new head (fenced CAS from ``expected``); its receipt."""
        ...

    def rebuild_index(self) -> int:
        """Re-derive the key index from the history; the number of entries written."""
        ...

    def receipts(self) -> list[Receipt]:
        """Every receipt in the history, oldest first (for audit, not per step)."""
        ...


__all__ = ["Appended", "CheckpointLog", "LeaseStore", "LoadedCheckpoint", "ReceiptStore"]
