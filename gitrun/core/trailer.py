"""The ``Gitrun-*`` trailer block of gitrun's commits: one codec for write commits
(receipts) and checkpoints alike.

A write commit's message is a subject, a body and a trailer block naming the run, task,
action, idempotency key, intent digest, instance, lease and approval; ``git log
--format=%(trailers)`` shows it and :mod:`gitrun.store.receipts` reads a receipt back from it. A
checkpoint's block carries its generation, signing key id and HMAC
(:mod:`gitrun.store.checkpoint`). Pure: no pygit2 and no I/O; the bytes it writes are the ones
gitrun has always written (the checkpoint signature check compares them exactly).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

RUN = "Gitrun-Run"
TASK = "Gitrun-Task"
ACTION = "Gitrun-Action"
IDEMPOTENCY_KEY = "Gitrun-Idempotency-Key"
INTENT_DIGEST = "Gitrun-Intent-Digest"
INSTANCE = "Gitrun-Instance"
LEASE = "Gitrun-Lease"
APPROVAL = "Gitrun-Approval"

CHECKPOINT = "Gitrun-Checkpoint"
KEY_ID = "Gitrun-Key-Id"
SIGNATURE = "Gitrun-Signature"
HMAC_PREFIX = "hmac-sha256:"

WRITE = (RUN, TASK, ACTION, IDEMPOTENCY_KEY, INTENT_DIGEST, INSTANCE, LEASE, APPROVAL)
"""A write commit's trailers, in the order they are written."""

__all__ = [
    "ACTION",
    "APPROVAL",
    "CHECKPOINT",
    "HMAC_PREFIX",
    "IDEMPOTENCY_KEY",
    "INSTANCE",
    "INTENT_DIGEST",
    "KEY_ID",
    "LEASE",
    "RUN",
    "SIGNATURE",
    "TASK",
    "WRITE",
    "MalformedTrailer",
    "checkpoint_block",
    "format_block",
    "lease_of",
    "parse_block",
    "write_key",
    "write_message",
]


class MalformedTrailer(ValueError):
    """A line of a trailer block that is not ``Key: value``."""

    def __init__(self, line: str) -> None:
        super().__init__(f"malformed trailer {line!r}")
        self.line = line


def format_block(pairs: Iterable[tuple[str, object]]) -> str:
    """The trailer block of ``pairs``: one ``Key: value`` line each, in order, each ending
    in a newline."""
    return "".join(f"{key}: {value}\n" for key, value in pairs)


def parse_block(text: str) -> dict[str, str]:
    """The trailers of a block :func:`format_block` wrote; :class:`MalformedTrailer` on a
    line that is not ``Key: value`` (gitrun reads its own blocks strictly)."""
    trailers: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(": ")
        if not sep:
            raise MalformedTrailer(line)
        trailers[key] = value
    return trailers


def write_message(subject: str, body: str, pairs: Iterable[tuple[str, object]]) -> str:
    """A write commit's message: subject, body, then the trailer block as the last
    paragraph (where git looks for trailers)."""
    return f"{subject}\n\n{body}\n\n" + format_block(pairs)


def checkpoint_block(generation: int, key_id: str, mac: str) -> str:
    """A checkpoint commit's trailer block: its generation, key id and HMAC-SHA256."""
    return format_block(
        ((CHECKPOINT, generation), (KEY_ID, key_id), (SIGNATURE, HMAC_PREFIX + mac))
    )


def write_key(trailers: Mapping[str, str], run_id: str) -> str | None:
    """The idempotency key of a write commit of run ``run_id``, else None."""
    if trailers.get(RUN) != run_id:
        return None
    return trailers.get(IDEMPOTENCY_KEY)


def lease_of(trailers: Mapping[str, str]) -> int:
    """The lease version a write commit was made under (0 when absent); ValueError when
    the trailer is not an integer."""
    return int(trailers.get(LEASE, "0"))
