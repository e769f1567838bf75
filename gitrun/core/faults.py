"""Named crash points for fault injection.

``GITRUN_CRASH_AT=<point>[:<nth>]`` kills this process with SIGKILL the nth time (default
the first) execution reaches ``<point>``: no cleanup, no ``finally`` blocks, exactly like a
power cut or the OOM killer. ``gitrun debug crash-points`` lists the points.

``GITRUN_PAUSE_AT=<point>[:<nth>]`` (tests only) stops this process with SIGSTOP there
instead, so a test can take its lease over and wake it with SIGCONT: a stale worker.

``GITRUN_FAIL_AT=<point>`` (tests only) raises :class:`InjectedFailure` there every time:
a bug of gitrun's that an input triggers deterministically, so every resume meets it
again (a step crashing twice at one point goes to review: :mod:`gitrun.engine.crashes`).

``GITRUN_DELAY_AT=<point>:<milliseconds>`` (tests only) sleeps there every time: it
widens a window that is microseconds wide (a temp file written, not yet renamed), so kills
at random moments land in it often enough to count.
"""

from __future__ import annotations

import os
import time

ENV_VAR = "GITRUN_CRASH_AT"
PAUSE_VAR = "GITRUN_PAUSE_AT"
DELAY_VAR = "GITRUN_DELAY_AT"
FAIL_VAR = "GITRUN_FAIL_AT"


class InjectedFailure(RuntimeError):
    """Raised at the point ``GITRUN_FAIL_AT`` names: an unexpected exception (exit 70)."""


# name -> the crash window it sits in (docs/design.md §6), shown by `gitrun debug crash-points`.
POINTS: dict[str, str] = {
    "setup_unregistered": "setup: no run of this id registered when looked at, nothing written",
    "setup_before_register": "setup: inputs checked, the run not registered yet (run again)",
    "setup_lease_taken": "setup: registered and leased, no branch or worktree yet",
    "setup_worktree_added": "setup: branch and worktree made, no instance id yet",
    "before_propose": "window 1: before a proposal; the last write's receipt may still ride",
    "after_intent_checkpoint": "window 2: intent persisted, no evidence of the write",
    "exec_running": "window 2: an exec step's command running (one pass per 20 ms poll)",
    "exec_done": "window 2: an exec step's command finished, its change not yet committed",
    "after_write_commit_object": "window 2: the commit object exists but no ref points to it",
    "write_ref_locked": "inside the branch ref transaction: ref lock files held, nothing moved",
    "write_ref_synced": "inside the branch move: write objects and ref lock durable, not renamed",
    "write_ref_moved": "window 3: the branch renamed (commit point), its final sync not yet",
    "receipt_index_locked": "window 3: the branch move durable, its index entry's lock "
    "written, not renamed",
    "after_receipt_index": "window 3: branch and index moved, worktree files not synced",
    "temp_file_written": "window 3: a worktree file's temp copy written, not renamed into place",
    "mid_file_sync": "window 3: some worktree files synced, others not",
    "after_file_sync": "window 3: files synced, receipt not in the checkpoint",
    "receipt_riding": "window 3: receipt recorded in memory, riding to the next checkpoint",
    "checkpoint_ref_locked": "inside the checkpoint ref transaction: lock held, nothing moved",
    "checkpoint_ref_synced": "inside the checkpoint move: commit object durable, not renamed",
    "checkpoint_ref_moved": "window 4: checkpoint ref renamed, not yet synced, no witness",
    "checkpoint_witness_torn": "window 4: the witness slot half written (a torn write)",
    "checkpoint_witness_written": "window 4: ref and witness advanced, not yet acted on",
    "witness_sync_deferred": "window 4: the witness slot written, its sync not yet run "
    "(a background thread; the run's next checkpoint waits for it)",
    "before_verify": "before the verifier runs; the last receipt rides in its verdict",
    "after_verify": "the verifier passed or failed, its event not yet checkpointed",
}

_counts: dict[str, dict[str, int]] = {ENV_VAR: {}, PAUSE_VAR: {}}
# The four variables as this process read them at its first point: a step passes ~17
# points, and three environment look-ups each were ~1% of its CPU. Read once per process
# (a forked child reads them afresh): tests set them per child process, never mid-run.
_env: dict[str, str] | None = None


def _forget_env() -> None:
    global _env  # noqa: PLW0603 - one cache per process
    _env = None


os.register_at_fork(after_in_child=_forget_env)


def _read_env() -> dict[str, str]:
    global _env  # noqa: PLW0603 - one cache per process
    if _env is None:
        _env = {var: os.environ.get(var, "") for var in (ENV_VAR, PAUSE_VAR, DELAY_VAR, FAIL_VAR)}
    return _env


def _target(spec: str) -> tuple[str, int] | None:
    if not spec:
        return None
    name, _, nth = spec.partition(":")
    return name, int(nth) if nth.isdigit() else 1


def _hit(var: str, spec: str, name: str) -> bool:
    target = _target(spec)
    if target is None or target[0] != name:
        return False
    counts = _counts[var]
    counts[name] = counts.get(name, 0) + 1
    return counts[name] == target[1]


def point(name: str) -> None:
    """Die here with SIGKILL if ``GITRUN_CRASH_AT`` names this point (and this pass);
    stop with SIGSTOP if ``GITRUN_PAUSE_AT`` does; raise if ``GITRUN_FAIL_AT`` does."""
    if name not in POINTS:
        raise ValueError(f"unknown crash point {name}")
    env = _read_env()
    crash, pause, delay, fail = env[ENV_VAR], env[PAUSE_VAR], env[DELAY_VAR], env[FAIL_VAR]
    if not (crash or pause or delay or fail):
        return
    if fail == name:
        raise InjectedFailure(f"injected failure at {name} (GITRUN_FAIL_AT)")
    import signal  # only when a fault is set: gitrun status loads no signal module

    if _hit(ENV_VAR, crash, name):
        os.kill(os.getpid(), signal.SIGKILL)
    if _hit(PAUSE_VAR, pause, name):
        os.kill(os.getpid(), signal.SIGSTOP)
    if delay:
        where, _, millis = delay.partition(":")
        if where == name and millis.isdigit():
            time.sleep(int(millis) / 1000)
