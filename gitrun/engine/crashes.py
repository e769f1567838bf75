"""Crash memory: a step that crashes gitrun at the same point twice is not tried a third
time; the run goes to ``needs_review`` with the error recorded.

A crash here is an exception gitrun did not mean to raise (exit 70: a bug, or an input
no rule foresaw) while it executes a pending intent. Resume runs the intent again under
the same key, which is right after a kill or a power cut, but an input that makes
gitrun fail deterministically would fail on every resume: the run would be wedged for
good. So each such crash is written down (the intent's key, where it happened, the
error) in the worktree's git dir, next to the instance id, out of the agent's reach in
the exec sandbox; before the intent executes again, two crashes of that key at the same
point open a review case instead (:func:`gitrun.engine.runtime.Runtime.execute_pending`).

A SIGKILL leaves no record: kills and power cuts are what resume is for, and they are
retried. A write error of the disk (:class:`~gitrun.core.errors.StorageFailed`) is not
counted either: it says nothing about the step, and the disk is checked first.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from gitrun.core import machine as m
from gitrun.core.errors import Exit, GitrunError, StorageFailed
from gitrun.core.records import NEEDS_REVIEW, RUNNING, Event, ReviewCase
from gitrun.store.atomicfile import atomic_write, read_bytes

if TYPE_CHECKING:
    from gitrun.engine.runtime import Runtime

CRASH_FILE = "gitrun-crashes.json"
REVIEW_AFTER = 2  # crashes of one step at one point before it goes to review
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FAULTS = os.path.join(_PACKAGE, "core", "faults.py")
MAX_ERROR_CHARS = 2000


@dataclass(frozen=True)
class Crash:
    """How often the pending step ``key`` crashed at ``point``, and the last error."""

    key: str
    point: str
    error: str
    count: int


def is_crash(exc: BaseException) -> bool:
    """An exception gitrun did not mean to raise (exit 70), other than a disk error."""
    if not isinstance(exc, Exception) or isinstance(exc, StorageFailed):
        return False
    return not isinstance(exc, GitrunError) or exc.exit_code == Exit.INTERNAL


def point_of(exc: BaseException) -> str:
    """Where ``exc`` was raised: its type and the innermost frame inside gitrun (a fault
    point's caller, for a failure injected there)."""
    where = "?"
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename.startswith(_PACKAGE + os.sep) and frame.filename != _FAULTS:
            rel = os.path.relpath(frame.filename, os.path.dirname(_PACKAGE))
            where = f"{rel}:{frame.lineno} in {frame.name}"
    return f"{type(exc).__name__} at {where}"


class CrashLog:
    """The crash record of one run's worktree (``<worktree git dir>/gitrun-crashes.json``)."""

    def __init__(self, git_dir: Path | str) -> None:
        self.path = Path(git_dir) / CRASH_FILE

    def read(self) -> Crash | None:
        """The last recorded crash, or None (none yet, or a record gitrun cannot read)."""
        try:
            data = json.loads(read_bytes(self.path))
            return Crash(str(data["key"]), str(data["point"]), str(data["error"]),
                         int(data["count"]))  # fmt: skip
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            return None  # unreadable: counting starts again, never a refusal

    def record(self, key: str, exc: BaseException) -> Crash:
        """Count one more crash of step ``key``; a new step or a new point starts at 1."""
        point = point_of(exc)
        error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        last = self.read()
        same = last is not None and last.key == key and last.point == point
        crash = Crash(key, point, error, last.count + 1 if same and last is not None else 1)
        atomic_write(self.path, json.dumps(asdict(crash), sort_keys=True).encode())
        return crash

    def repeated(self, key: str) -> Crash | None:
        """The crash record of ``key`` once it crashed :data:`REVIEW_AFTER` times at one
        point, else None."""
        crash = self.read()
        if crash is None or crash.key != key or crash.count < REVIEW_AFTER:
            return None
        return crash


def log_of(rt: Runtime) -> CrashLog:
    """The run's crash record, in its worktree's git dir."""
    return CrashLog(rt.env.wt.path)


def remember(rt: Runtime, key: str | None, exc: BaseException) -> None:
    """Record ``exc`` against step ``key`` (None: no step) if it is a crash; never masks
    it (a missing worktree, a full disk while writing the record)."""
    if key is not None and is_crash(exc):
        with contextlib.suppress(GitrunError, OSError):
            log_of(rt).record(key, exc)


def review_repeated(rt: Runtime) -> bool:
    """Freeze a running run for a human if its pending step crashed gitrun twice at one
    point (the error in the review case and the chain); False when it did not."""
    p = rt.state.pending
    if p is None or rt.state.phase != RUNNING:
        return False
    crash = log_of(rt).repeated(p.key)
    if crash is None:
        return False
    reason = (
        f"step {p.key} ({p.action.summary()}) crashed gitrun {crash.count} times at "
        f"{crash.point}: {crash.error}; it is not tried again: decide replan (the agent "
        "proposes again, the key is quarantined) or abort"
    )
    at = time.time()
    head = str(rt.env.head().id)
    case = ReviewCase(p.action, p.key, p.intent_digest, "", None, "", head, reason, at)
    facts = {"key": p.key, "point": crash.point, "error": crash.error, "count": crash.count}
    frozen = replace(rt.state, phase=NEEDS_REVIEW, stop_reason="step_crashed", review=case)
    rt.commit(frozen.with_events(Event("step_crashed", at, facts)))
    rt.say(f"review needed for {p.key}: {reason}; run frozen")
    return True


def verify_unless_repeated(
    rt: Runtime, effect: m.RunVerifier, verify: Callable[[m.RunVerifier], None]
) -> None:
    """``verify(effect)``, unless verifying this tree crashed gitrun twice at one point:
    then the run ends failed with the error as the verdict's summary (there is no pending
    step to review, and running the tests again would crash again)."""
    key = f"verify-{effect.tree}"
    crash = log_of(rt).repeated(key)
    if crash is None:
        try:
            verify(effect)
        except Exception as exc:
            remember(rt, key, exc)
            raise
        return
    obs = rt.clean_at(effect)
    why = (
        f"verifying {effect.tree[:12]} crashed gitrun {crash.count} times at "
        f"{crash.point}: {crash.error}; it is not run again"
    )
    failed = m.VerifierCannotStart(
        obs.head, obs.tree, obs.status_digest, why, tuple(rt.task.verifier.required),
        time.time(), {"crashed": crash.point, "error": crash.error},
    )  # fmt: skip
    rt.apply(failed)
