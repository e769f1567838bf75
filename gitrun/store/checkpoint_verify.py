"""Verifying one checkpoint commit, over its parts (bytes and hex ids), without pygit2.

:class:`gitrun.store.checkpoint.CheckpointStore` reads a commit through pygit2 and
``gitrun status`` reads it through :mod:`gitrun.store.gitread` (issue #15); both hand its
parts to :func:`verify` and :func:`witness_admits`, so the two make the same checks in
the same order and refuse with the same words.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from gitrun.core import trailer
from gitrun.core.codec import DecodeError, canonical_bytes, decode, encode
from gitrun.core.errors import CheckpointRejected
from gitrun.core.records import SCHEMA_VERSION, RunState
from gitrun.store.keys import Keyring
from gitrun.store.witness import Mark, Witness, admit

SIGNATURE_DOMAIN = b"gitrun-checkpoint/1\n"
EMPTY_TREE_HEX = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"  # git's empty tree


class CommitParts:
    """What verifying a checkpoint reads of its commit. ``parent_generation`` reads the
    first parent's ``Gitrun-Checkpoint`` trailer, called only once all else holds."""

    __slots__ = ("oid", "parent", "parent_generation", "raw_message", "tree")

    def __init__(
        self,
        oid: str,
        raw_message: bytes,
        parent: str,  # the first parent's id, "" for none
        tree: str,
        parent_generation: Callable[[], str | None],
    ) -> None:
        self.oid = oid
        self.raw_message = raw_message
        self.parent = parent
        self.tree = tree
        self.parent_generation = parent_generation


def run_of_ref(ref: str) -> str:
    """The run id a checkpoint ref names (``refs/gitrun/runs/<run>/checkpoints/...``)."""
    parts = ref.split("/")
    if len(parts) < 6 or parts[:3] != ["refs", "gitrun", "runs"] or parts[4] != "checkpoints":
        raise CheckpointRejected("wrong-run", f"{ref} is not a gitrun checkpoint ref")
    return parts[3]


def no_ref(run_id: str, hint: str) -> CheckpointRejected:
    """A run without any checkpoint ref (``hint``: what its witness says it held)."""
    return CheckpointRejected(
        "high-water-mark-missing",
        f"run {run_id} has no checkpoint ref under refs/gitrun/runs/{run_id}/checkpoints/; "
        "nothing can be trusted" + hint,
    )


def ref_gone(ref: str, hint: str) -> CheckpointRejected:
    """The checkpoint ref ``ref`` does not exist (``hint``: what the witness says)."""
    return CheckpointRejected(
        "high-water-mark-missing", f"{ref} does not exist; no checkpoint can be trusted" + hint
    )


def signed_bytes(ref: str, parent: str, payload: bytes) -> bytes:
    return SIGNATURE_DOMAIN + ref.encode() + b"\n" + parent.encode() + b"\n" + payload


def message(state: RunState, payload: bytes, key_id: str, mac: str) -> bytes:
    subject = f"gitrun checkpoint g={state.generation} {state.phase} run={state.run_id}"
    trailers = trailer.checkpoint_block(state.generation, key_id, mac)
    return subject.encode() + b"\n\n" + payload + b"\n\n" + trailers.encode()


def verify(keyring: Keyring, ref: str, commit: CommitParts) -> tuple[RunState, str]:
    """The state a checkpoint commit holds and its key id, once its signature, form and
    place in the chain hold; CheckpointRejected naming what does not."""
    oid, raw = commit.oid, commit.raw_message
    _, payload, trailers = split(raw, oid)
    key_id = trailers.get(trailer.KEY_ID, "")
    signature = trailers.get(trailer.SIGNATURE, "")
    if not signature.startswith(trailer.HMAC_PREFIX):
        raise CheckpointRejected("bad-signature", f"checkpoint {oid} has no HMAC-SHA256 signature")
    mac = signature.removeprefix(trailer.HMAC_PREFIX)
    verdict = keyring.verify(key_id, signed_bytes(ref, commit.parent, payload), mac)
    if verdict is None:
        raise CheckpointRejected(
            "unknown-key", f"checkpoint {oid} is signed with key {key_id!r}, not in the keyring"
        )
    if not verdict:
        raise CheckpointRejected(
            "bad-signature", f"checkpoint {oid} does not verify with key {key_id}"
        )
    state = decode_state(payload, oid)
    if canonical_bytes(encode(state)) != payload:
        raise CheckpointRejected("corrupt", f"checkpoint {oid} payload is not in canonical form")
    # The HMAC covers the payload; the subject and trailers around it (what `git log`
    # shows) must be exactly what that payload produces, and the tree the empty tree.
    if raw != message(state, payload, key_id, mac) or commit.tree != EMPTY_TREE_HEX:
        raise CheckpointRejected(
            "corrupt", f"checkpoint {oid}: subject, trailers or tree are not what it signed"
        )
    check_chain(state, trailers, commit, ref)
    return state, key_id


def split(raw: bytes, oid: str) -> tuple[bytes, bytes, dict[str, str]]:
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


def decode_state(payload: bytes, oid: str) -> RunState:
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


def check_chain(state: RunState, trailers: dict[str, str], commit: CommitParts, ref: str) -> None:
    if trailers.get(trailer.CHECKPOINT) != str(state.generation):
        raise CheckpointRejected("corrupt", "generation trailer and payload disagree")
    if not ref.startswith(f"refs/gitrun/runs/{state.run_id}/checkpoints/{state.task_id}/"):
        raise CheckpointRejected("wrong-run", f"checkpoint of run {state.run_id} found on {ref}")
    if not ref.endswith("/" + state.env.instance_id):
        raise CheckpointRejected("wrong-instance", "checkpoint instance does not match its ref")
    expected_parent_gen = str(state.generation - 1)
    if commit.parent:
        parent_gen = commit.parent_generation()
        if parent_gen != expected_parent_gen:
            raise CheckpointRejected(
                "generation-gap", f"generation {state.generation} follows {parent_gen}"
            )
    elif state.generation != 1:
        raise CheckpointRejected("generation-gap", f"generation {state.generation} has no parent")


def witness_admits(witness: Witness, ref: str, state: RunState, oid: str, parent: str) -> None:
    """The freshness check of a verified checkpoint (the caller holds the run's witness
    lock): it must be the witnessed high-water mark, or its successor from the crash
    window, and then the witness is rolled forward to it."""
    here = Mark(state.run_id, ref, state.generation, oid)
    path = witness.path(state.run_id)
    if admit(path, witness.read(state.run_id), here, parent or None):
        witness.write(here)


__all__ = [
    "EMPTY_TREE_HEX",
    "SIGNATURE_DOMAIN",
    "CommitParts",
    "check_chain",
    "decode_state",
    "message",
    "no_ref",
    "ref_gone",
    "run_of_ref",
    "signed_bytes",
    "split",
    "verify",
    "witness_admits",
]
