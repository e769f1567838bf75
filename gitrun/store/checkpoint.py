"""Signed checkpoints on a ref whose compare-and-swap is the generation high-water mark.

A checkpoint is one commit on ``refs/gitrun/runs/<run>/checkpoints/<task>/<instance>``
whose parent is the previous checkpoint and whose tree is the empty tree: the payload
(canonical JSON of a :class:`RunState`) and its HMAC ride in the commit message. The
commit object is written first (an orphan is harmless); the single ref update from the
previous checkpoint to the new one then commits content and high-water mark at once.

A signature proves authenticity, not freshness: with a :class:`~gitrun.store.witness.Witness`
(the service always gives one) every advance then records the new high-water mark
outside the repository too, and :meth:`CheckpointStore.load` accepts the ref only if it
is that mark or its one successor from the crash window between the two writes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pygit2

from gitrun.core import trailer
from gitrun.core.errors import CasFailed, CheckpointRejected, GitrunError, InvalidState
from gitrun.core.records import RunState
from gitrun.core.validate import validate_state
from gitrun.store import gitstore, sshsig
from gitrun.store.checkpoint_verify import (
    CommitParts,
    ref_gone,
    run_of_ref,
    signed_bytes,
    verify,
    witness_admits,
)
from gitrun.store.checkpoint_verify import message as checkpoint_message
from gitrun.store.keys import Keyring
from gitrun.store.lease import Fence, fence_guard
from gitrun.store.witness import Mark, Witness, admit

SIGNER = pygit2.Signature("gitrun", "gitrun@localhost", 0, 0)


def checkpoint_ref(run_id: str, task_id: str, instance_id: str) -> str:
    return f"refs/gitrun/runs/{run_id}/checkpoints/{task_id}/{instance_id}"


def find_checkpoint_refs(repo: pygit2.Repository, run_id: str) -> list[str]:
    prefix = f"refs/gitrun/runs/{run_id}/checkpoints/"
    return sorted(r for r in repo.references if r.startswith(prefix))


@dataclass(frozen=True)
class Prepared:
    """A checkpoint written and its ref move staged in ``txn``, not yet committed (see
    :meth:`CheckpointStore.prepare`)."""

    ref: str
    state: RunState
    oid: pygit2.Oid
    expected: pygit2.Oid | None
    txn: gitstore.Transaction
    after: tuple[str, ...] = ()

    @property
    def moved(self) -> bool:
        """Whether the checkpoint is the ref's (its transaction moved it)."""
        return self.txn.moved(self.ref)


@dataclass(frozen=True)
class Stored:
    """A verified checkpoint: its state, commit id, and who signed it."""

    state: RunState
    oid: pygit2.Oid
    key_id: str
    committed_at: int


class CheckpointStore:
    """Advance and load one run's checkpoint chain."""

    def __init__(
        self, repo: pygit2.Repository, keyring: Keyring, witness: Witness | None = None
    ) -> None:
        self.repo = repo
        self.keyring = keyring
        self.witness = witness
        self._empty_tree: pygit2.Oid | None = None

    def empty_tree(self) -> pygit2.Oid:
        if self._empty_tree is None:
            self._empty_tree = self.repo.TreeBuilder().write()
        return self._empty_tree

    def advance(
        self, ref: str, state: RunState, expected: pygit2.Oid | None, fence: Fence | None
    ) -> pygit2.Oid:
        """Validate ``state`` fully, write it signed, then move ``ref`` by compare-and-swap.

        An invalid state raises :class:`InvalidState` before any object is written.
        A lost race raises :class:`CasFailed`; nothing of the loser is visible.
        """
        prepared = self.prepare(ref, state, expected, fence)
        self.land(prepared, fence)
        return prepared.oid

    def prepare(
        self,
        ref: str,
        state: RunState,
        expected: pygit2.Oid | None,
        fence: Fence | None,
        after: tuple[str, ...] = (),
    ) -> Prepared:
        """The checkpoint written and its ref move staged, fenced by ``fence``, in a new
        transaction the caller holds: a step's write stages its branch move in the same
        one and commits both (one journal record; docs/design.md §4). ``after`` are the
        crash points passed right after the checkpoint's rename. :meth:`land` after."""
        oid = self.write(ref, state, expected)
        if self.witness is not None:  # the last advance's deferred witness sync first
            self.witness.settle(state.run_id)
        prepared = Prepared(ref, state, oid, expected, gitstore.transaction(self.repo), after)
        _stage(prepared, prepared.txn, fence)
        return prepared

    def land(self, prepared: Prepared, fence: Fence | None) -> None:
        """The prepared checkpoint made the ref's: its transaction committed now if no one
        committed it, moved on its own if that left it unmoved (the write it rode with
        was refused first), then settled."""
        if not prepared.moved:
            txn = prepared.txn
            if txn.committed:  # alone, in a transaction of its own
                txn = _stage(prepared, gitstore.transaction(self.repo), fence)
            txn.commit()
        self.settle(prepared)

    def settle(self, prepared: Prepared) -> None:
        """After the prepared checkpoint's ref moved: its witness advanced."""
        if not prepared.moved:
            raise GitrunError(f"checkpoint {prepared.oid} was never moved to")
        if self.witness is not None:
            self._witness_advance(prepared.ref, prepared.state, prepared.oid, prepared.expected)

    def write(self, ref: str, state: RunState, expected: pygit2.Oid | None) -> pygit2.Oid:
        """Validate ``state`` and write its signed checkpoint commit on ``expected``; no ref
        moves (the caller's compare-and-swap does: a local ref, or a remote's atomic push)."""
        payload = validate_state(state)
        parent = str(expected) if expected is not None else ""
        key_id, mac = self.keyring.sign(signed_bytes(ref, parent, payload))
        message = checkpoint_message(state, payload, key_id, mac)
        parents: list[str | pygit2.Oid] = [expected] if expected is not None else []
        # (typed Oid in pygit2's stubs, a str at run time: the commit's text)
        content = str(
            self.repo.create_commit_string(
                SIGNER, SIGNER, message.decode(), self.empty_tree(), parents
            )
        )
        # also an SSH signature, so stock git verifies it without the keyring
        oid: pygit2.Oid = self.repo.create_commit_with_signature(
            content, sshsig.sign_commit(self.keyring, content)
        )
        return oid

    def _witness_advance(
        self, ref: str, state: RunState, oid: pygit2.Oid, expected: pygit2.Oid | None
    ) -> None:
        """The ref moved: advance the witness (one in-place slot write, fdatasync'd).

        Generation 1 creates it. Otherwise it must hold the parent we advanced from, or
        already this checkpoint (a concurrent load rolled it forward). A witness already
        past us means a new lease holder carried on while we stalled: the witness never
        moves back, and our next fenced write fails with LeaseLost."""
        if self.witness is None:
            return
        mark = Mark(state.run_id, ref, state.generation, str(oid))
        with self.witness.locked(state.run_id):
            if state.generation == 1 and expected is None:
                self.witness.write(mark)
                return
            reading = self.witness.read(state.run_id)
            ahead = reading.mark if reading is not None else None
            if ahead is not None and ahead.ref == ref and ahead.generation > state.generation:
                return
            parent = str(expected) if expected is not None else None
            if admit(self.witness.path(state.run_id), reading, mark, parent):
                self.witness.write(mark, defer=True)  # settled before the next checkpoint

    def load(
        self,
        ref: str,
        *,
        scenario_parts: dict[str, str] | None,
        offered: pygit2.Oid | None = None,
    ) -> Stored:
        """Verify and decode the checkpoint at the high-water mark ``ref``.

        ``scenario_parts`` come from the task file handed in now, never from the
        checkpoint. ``offered`` is a checkpoint commit someone asks us to resume from:
        it must equal the high-water mark.
        """
        if self.witness is None:
            return self._load(ref, scenario_parts, offered)
        run_id = run_of_ref(ref)
        with self.witness.locked(run_id):
            # Under the witness lock the witness cannot move, and a live writer can move
            # the ref at most one generation past it: ref and witness are read together.
            stored = self._load(ref, scenario_parts, offered)
            parents = self._commit(stored.oid).parent_ids
            parent = str(parents[0]) if parents else ""
            witness_admits(self.witness, ref, stored.state, str(stored.oid), parent)
        return stored

    def _load(
        self, ref: str, scenario_parts: dict[str, str] | None, offered: pygit2.Oid | None
    ) -> Stored:
        head = gitstore.read_ref(self.repo, ref)
        if head is None:
            raise ref_gone(ref, self.witnessed(run_of_ref(ref)))
        if offered is not None and offered != head:
            raise CheckpointRejected(
                "stale-generation",
                f"checkpoint {offered} is not the high-water mark {head}; old checkpoints are "
                "never resumed",
            )
        stored = self.read(ref, head)
        state = stored.state
        if scenario_parts is not None:
            _check_scenario(state, scenario_parts)
        return stored

    def rewitness(self, ref: str, generation: int) -> Stored:
        """A human's recovery: anchor the witness at the checkpoint ``ref`` holds now.

        For a repository restored from a backup on purpose (or a lost witness file). The
        checkpoint must verify, and ``generation`` must be its generation, typed by the
        human: what the rollback brings back (consumed nonces included) is their call.
        """
        from gitrun.core.errors import BadInput

        if self.witness is None:
            raise GitrunError("this checkpoint store has no witness to anchor")
        head = gitstore.read_ref(self.repo, ref)
        if head is None:
            raise CheckpointRejected("high-water-mark-missing", f"{ref} does not exist")
        run_id = run_of_ref(ref)
        with self.witness.locked(run_id):
            stored = self.read(ref, head)
            if stored.state.generation != generation:
                raise BadInput(
                    f"{ref} is at generation {stored.state.generation}, not {generation}; "
                    "pass the generation you accept as the newest"
                )
            parents = self._commit(head).parent_ids
            parent = None
            if parents:
                parent = Mark(run_id, ref, generation - 1, str(parents[0]))
            self.witness.reset(Mark(run_id, ref, generation, str(head)), parent)
        return stored

    def witnessed(self, run_id: str) -> str:
        """What the witness says a missing checkpoint ref held, for a refusal message."""
        return "" if self.witness is None else self.witness.hint(run_id)

    def read(self, ref: str, oid: pygit2.Oid) -> Stored:
        """Verify one checkpoint commit's signature and decode it (no scenario check)."""
        commit = self._commit(oid)
        parts = CommitParts(
            str(oid),
            commit.raw_message,
            str(commit.parent_ids[0]) if commit.parent_ids else "",
            str(commit.tree_id),
            lambda: commit.parents[0].message_trailers.get(trailer.CHECKPOINT),
        )
        state, key_id = verify(self.keyring, ref, parts)
        return Stored(state, oid, key_id, int(commit.commit_time))

    def _commit(self, oid: pygit2.Oid) -> pygit2.Commit:
        try:
            obj = self.repo[oid]
        except (KeyError, ValueError, pygit2.GitError) as exc:
            raise CheckpointRejected(
                "corrupt", f"checkpoint object {oid} is unreadable: {exc}"
            ) from exc
        if not isinstance(obj, pygit2.Commit):
            raise CheckpointRejected("corrupt", f"checkpoint {oid} is not a commit")
        return obj

    def chain(self, ref: str, limit: int | None = None) -> list[Stored]:
        """The verified chain, newest first (walks history: for audit, not for steps)."""
        out: list[Stored] = []
        oid = gitstore.read_ref(self.repo, ref)
        while oid is not None and (limit is None or len(out) < limit):
            stored = self.read(ref, oid)
            out.append(stored)
            parents = self._commit(oid).parent_ids
            oid = parents[0] if parents else None
        return out

    def head(self, ref: str) -> pygit2.Oid | None:
        """The high-water mark: the checkpoint commit ``ref`` names, None when absent."""
        return gitstore.read_ref(self.repo, ref)


def _stage(
    prepared: Prepared, txn: gitstore.Transaction, fence: Fence | None
) -> gitstore.Transaction:
    """The prepared checkpoint's ref move staged in ``txn``, fenced by ``fence``."""
    state, generation = prepared.state, prepared.state.generation
    if fence is not None:
        txn.guard(fence_guard(txn.repo, state.run_id, fence))
    return txn.move(
        prepared.ref, prepared.expected, prepared.oid, message=f"gitrun checkpoint g={generation}",
        what=f"checkpoint generation {generation}", crash_prefix="checkpoint_ref",
        after=prepared.after,
    )  # fmt: skip


_PART_NAMES = {
    "task": "the task id/version",
    "policy": "the policy id/version",
    "permissions": "the permissions (allowed actions)",
    "allowlist": "the write allowlist or forbidden paths",
    "verifier": "the verifier expectation",
    "budgets": "the budgets",
    "initial": "the initial state",
}


def _check_scenario(state: RunState, parts: dict[str, str]) -> None:
    from gitrun.core.task import scenario_fingerprint

    changed = [
        k
        for k in sorted(set(parts) | set(state.scenario_parts))
        if parts.get(k) != state.scenario_parts.get(k)
    ]
    if changed:
        what = ", ".join(_PART_NAMES.get(k, k) for k in changed)
        raise CheckpointRejected(
            "scenario-changed", f"the task file handed in differs from the checkpoint's in {what}"
        )
    if scenario_fingerprint(state.scenario_parts) != state.scenario_fingerprint:
        raise CheckpointRejected(
            "scenario-changed", "the scenario fingerprint does not match its parts"
        )


def next_state(state: RunState, **changes: object) -> RunState:
    """The successor state: generation + 1, events reset by the caller after a write."""
    return dataclasses.replace(state, generation=state.generation + 1, **changes)  # type: ignore[arg-type]


__all__ = [
    "CasFailed",
    "CheckpointRejected",
    "CheckpointStore",
    "GitrunError",
    "InvalidState",
    "Stored",
    "checkpoint_ref",
    "find_checkpoint_refs",
    "next_state",
    "run_of_ref",
]
