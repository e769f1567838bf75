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
import json
from dataclasses import dataclass

import pygit2

from gitrun.core import trailer
from gitrun.core.codec import DecodeError, canonical_bytes, decode, encode
from gitrun.core.errors import CasFailed, CheckpointRejected, GitrunError, InvalidState
from gitrun.core.records import SCHEMA_VERSION, RunState
from gitrun.core.validate import validate_state
from gitrun.store import gitstore
from gitrun.store.keys import Keyring
from gitrun.store.lease import Fence, fence_guard
from gitrun.store.witness import Mark, Witness, admit

SIGNATURE_DOMAIN = b"gitrun-checkpoint/1\n"
SIGNER = pygit2.Signature("gitrun", "gitrun@localhost", 0, 0)
EMPTY_TREE = pygit2.Oid(hex="4b825dc642cb6eb9a060e54bf8d69288fbee4904")  # git's empty tree


def checkpoint_ref(run_id: str, task_id: str, instance_id: str) -> str:
    return f"refs/gitrun/runs/{run_id}/checkpoints/{task_id}/{instance_id}"


def run_of_ref(ref: str) -> str:
    """The run id a checkpoint ref names (``refs/gitrun/runs/<run>/checkpoints/...``)."""
    parts = ref.split("/")
    if len(parts) < 6 or parts[:3] != ["refs", "gitrun", "runs"] or parts[4] != "checkpoints":
        raise CheckpointRejected("wrong-run", f"{ref} is not a gitrun checkpoint ref")
    return parts[3]


def find_checkpoint_refs(repo: pygit2.Repository, run_id: str) -> list[str]:
    prefix = f"refs/gitrun/runs/{run_id}/checkpoints/"
    return sorted(r for r in repo.references if r.startswith(prefix))


@dataclass(frozen=True)
class Stored:
    """A verified checkpoint: its state, commit id, and who signed it."""

    state: RunState
    oid: pygit2.Oid
    key_id: str
    committed_at: int


def _signed_bytes(ref: str, parent: str, payload: bytes) -> bytes:
    return SIGNATURE_DOMAIN + ref.encode() + b"\n" + parent.encode() + b"\n" + payload


def _message(state: RunState, payload: bytes, key_id: str, mac: str) -> bytes:
    subject = f"gitrun checkpoint g={state.generation} {state.phase} run={state.run_id}"
    trailers = trailer.checkpoint_block(state.generation, key_id, mac)
    return subject.encode() + b"\n\n" + payload + b"\n\n" + trailers.encode()


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
        oid = self.write(ref, state, expected)
        guards = [fence_guard(self.repo, state.run_id, fence)] if fence is not None else []
        gitstore.update_ref(
            self.repo,
            ref,
            expected,
            oid,
            guards=guards,
            message=f"gitrun checkpoint g={state.generation}",
            what=f"checkpoint generation {state.generation}",
            crash_prefix="checkpoint_ref",
        )
        if self.witness is not None:
            self._witness_advance(ref, state, oid, expected)
        return oid

    def write(self, ref: str, state: RunState, expected: pygit2.Oid | None) -> pygit2.Oid:
        """Validate ``state`` and write its signed checkpoint commit on ``expected``; no ref
        moves (the caller's compare-and-swap does: a local ref, or a remote's atomic push)."""
        payload = validate_state(state)
        parent = str(expected) if expected is not None else ""
        key_id, mac = self.keyring.sign(_signed_bytes(ref, parent, payload))
        message = _message(state, payload, key_id, mac)
        parents = [expected] if expected is not None else []
        oid: pygit2.Oid = self.repo.create_commit(
            None, SIGNER, SIGNER, message.decode(), self.empty_tree(), parents
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
                self.witness.write(mark)

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
            here = Mark(stored.state.run_id, ref, stored.state.generation, str(stored.oid))
            parent = str(parents[0]) if parents else None
            path = self.witness.path(run_id)
            if admit(path, self.witness.read(run_id), here, parent):
                self.witness.write(here)
        return stored

    def _load(
        self, ref: str, scenario_parts: dict[str, str] | None, offered: pygit2.Oid | None
    ) -> Stored:
        head = gitstore.read_ref(self.repo, ref)
        if head is None:
            raise CheckpointRejected(
                "high-water-mark-missing",
                f"{ref} does not exist; no checkpoint can be trusted"
                + self.witnessed(run_of_ref(ref)),
            )
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
        raw = commit.raw_message
        subject, payload, trailers = _split(raw, oid)
        key_id = trailers.get(trailer.KEY_ID, "")
        signature = trailers.get(trailer.SIGNATURE, "")
        if not signature.startswith(trailer.HMAC_PREFIX):
            raise CheckpointRejected(
                "bad-signature", f"checkpoint {oid} has no HMAC-SHA256 signature"
            )
        parent = str(commit.parent_ids[0]) if commit.parent_ids else ""
        verdict = self.keyring.verify(
            key_id, _signed_bytes(ref, parent, payload), signature.removeprefix(trailer.HMAC_PREFIX)
        )
        if verdict is None:
            raise CheckpointRejected(
                "unknown-key", f"checkpoint {oid} is signed with key {key_id!r}, not in the keyring"
            )
        if not verdict:
            raise CheckpointRejected(
                "bad-signature", f"checkpoint {oid} does not verify with key {key_id}"
            )
        state = _decode_state(payload, oid)
        if canonical_bytes(encode(state)) != payload:
            raise CheckpointRejected(
                "corrupt", f"checkpoint {oid} payload is not in canonical form"
            )
        # The HMAC covers the payload; the subject and trailers around it (what `git log`
        # shows) must be exactly what that payload produces, and the tree the empty tree.
        mac = signature.removeprefix(trailer.HMAC_PREFIX)
        if raw != _message(state, payload, key_id, mac) or commit.tree_id != EMPTY_TREE:
            raise CheckpointRejected(
                "corrupt", f"checkpoint {oid}: subject, trailers or tree are not what it signed"
            )
        _check_chain(state, trailers, commit, ref)
        del subject
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


def _split(raw: bytes, oid: pygit2.Oid) -> tuple[bytes, bytes, dict[str, str]]:
    parts = raw.split(b"\n\n")
    if len(parts) != 3 or not parts[2].endswith(b"\n"):
        raise CheckpointRejected("corrupt", f"checkpoint {oid} is not in the checkpoint format")
    try:
        trailers = trailer.parse_block(parts[2].decode("utf-8", "replace"))
    except trailer.MalformedTrailer as exc:
        raise CheckpointRejected(
            "corrupt", f"checkpoint {oid} has a malformed trailer {exc.line!r}"
        ) from None
    return parts[0], parts[1], trailers


def _decode_state(payload: bytes, oid: pygit2.Oid) -> RunState:
    try:
        doc = json.loads(payload)
    except ValueError as exc:
        raise CheckpointRejected("corrupt", f"checkpoint {oid} payload is not JSON") from exc
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA_VERSION:
        found = doc.get("schema") if isinstance(doc, dict) else None
        raise CheckpointRejected(
            "schema-version",
            f"checkpoint {oid} has schema {found!r}; this gitrun reads schema {SCHEMA_VERSION}",
        )
    try:
        return decode(RunState, doc)
    except DecodeError as exc:
        reason = "unknown-fields" if "unknown field" in str(exc) else "schema"
        raise CheckpointRejected(reason, f"checkpoint {oid}: {exc}") from exc


def _check_chain(
    state: RunState, trailers: dict[str, str], commit: pygit2.Commit, ref: str
) -> None:
    if trailers.get(trailer.CHECKPOINT) != str(state.generation):
        raise CheckpointRejected("corrupt", "generation trailer and payload disagree")
    if not ref.startswith(f"refs/gitrun/runs/{state.run_id}/checkpoints/{state.task_id}/"):
        raise CheckpointRejected("wrong-run", f"checkpoint of run {state.run_id} found on {ref}")
    if not ref.endswith("/" + state.env.instance_id):
        raise CheckpointRejected("wrong-instance", "checkpoint instance does not match its ref")
    parents = commit.parents
    expected_parent_gen = str(state.generation - 1)
    if parents:
        parent_gen = parents[0].message_trailers.get(trailer.CHECKPOINT)
        if parent_gen != expected_parent_gen:
            raise CheckpointRejected(
                "generation-gap", f"generation {state.generation} follows {parent_gen}"
            )
    elif state.generation != 1:
        raise CheckpointRejected("generation-gap", f"generation {state.generation} has no parent")


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
