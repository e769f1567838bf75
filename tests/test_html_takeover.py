"""The run page tells a lease takeover from a resume: a worker SIGSTOPped past its lease's
expiry whose run another worker took over shows as a takeover naming both workers (and
the stopped one's late work is refused); a worker SIGKILLed and resumed shows as a
resume after a crash, not as a takeover. Real processes, real signals, a real browser."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import spawn
from browser import Node, needs_chromium, parse, rendered_dom, screenshot
from conftest import SANDBOXES, Gitrun
from helpers import PAUSING_WORKER, one_line

from gitrun.core.errors import Exit

pytestmark = pytest.mark.timeout(180)

FIX_MEDIAN = SANDBOXES / "fix-median"


def _wait_until(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _lease_live(gitrun: Gitrun, run_id: str) -> bool:
    res = gitrun("status", run_id, "--json")
    assert res.code == 0, res.err
    lease = json.loads(res.out)["lease"]
    return bool(lease and lease["live"])


def _page(gitrun: Gitrun, run_id: str, tmp_path: Path) -> Path:
    page = tmp_path / f"{run_id}.html"
    res = gitrun("report", run_id, "--html", str(page))
    assert res.code == 0, res.err
    return page


def _kind(doc: Node, kind: str) -> list[Node]:
    return doc.find(**{"data-kind": kind})


def _paused_and_taken_over(
    gitrun: Gitrun, tmp_path: Path, reap: list[subprocess.Popen[str]]
) -> subprocess.Popen[str]:
    """Worker A runs fix-median with a 2 s lease and is SIGSTOPped after its intent's
    checkpoint; once its lease expired worker B resumes the run to done. A stays stopped
    (alive, holding its owner lock): the caller continues it."""
    marker, go = tmp_path / "paused", tmp_path / "go"
    argv = [sys.executable, "-c", PAUSING_WORKER, "after_intent_checkpoint", str(marker),
            str(go), "run", str(FIX_MEDIAN), "--run-id", "t", "-q", "--worker-id",
            "worker-a", "--lease-seconds", "2"]  # fmt: skip
    a = spawn.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    env=gitrun.env(), cwd=gitrun.home.parent)  # fmt: skip
    reap.append(a)
    _wait_until(marker.exists, "worker A to write its intent's checkpoint")
    os.kill(a.pid, signal.SIGSTOP)
    _wait_until(lambda: not _lease_live(gitrun, "t"), "A's lease to expire")
    b = gitrun("resume", "t", "--worker-id", "worker-b", "--lease-seconds", "30")
    assert b.code == 0, b.err
    assert "taken over from worker worker-a (lease 1): its lease expired" in b.err
    go.write_text("go")
    return a


def test_a_takeover_from_a_stopped_worker_is_recorded_and_shown_naming_both_workers(
    gitrun: Gitrun, tmp_path: Path, reap: list[subprocess.Popen[str]]
) -> None:
    a = _paused_and_taken_over(gitrun, tmp_path, reap)
    os.kill(a.pid, signal.SIGCONT)
    _, err = a.communicate(timeout=60)
    assert a.returncode == Exit.LEASE_LOST, err
    assert "worker-b" in one_line(err)

    doc = parse(_page(gitrun, "t", tmp_path).read_text())
    assert "done" in doc.find(id="phase")[0].all_text()
    assert "checkpoint chain verified" in doc.find(id="chain")[0].all_text()
    taken = _kind(doc, "takeover")
    assert len(taken) == 1
    assert taken[0].find(cls="from-worker")[0].all_text() == "worker-a"
    assert taken[0].find(cls="to-worker")[0].all_text() == "worker-b"
    text = taken[0].all_text()
    assert "(lease v1)" in text
    assert "(lease v2)" in text
    assert "its lease expired" in text
    assert not _kind(doc, "resume")  # the lease change is the takeover, not a resume
    # The takeover is its own checkpoint, written by B under lease 2 before any other.
    kinds = [n.attrs["data-kind"] for n in doc.find(cls="ev")]
    at = kinds.index("takeover")
    assert kinds[at + 1] == "checkpoint"
    first_b = doc.find(cls="ev")[at + 1].all_text()
    assert "worker worker-b" in first_b
    assert "lease v2" in first_b


@pytest.mark.parametrize("resumer", ["worker-b", "worker-a"], ids=["another", "same-owner"])
def test_a_worker_killed_and_resumed_shows_a_resume_not_a_takeover(
    gitrun: Gitrun, tmp_path: Path, resumer: str
) -> None:
    crashed = gitrun("run", str(FIX_MEDIAN), "--run-id", "k", "-q", "--worker-id", "worker-a",
                     GITRUN_CRASH_AT="after_intent_checkpoint")  # fmt: skip
    assert crashed.code == -signal.SIGKILL, crashed.err
    # Its lease is still live (30 s): a dead owner's is taken at once, as a resume.
    assert _lease_live(gitrun, "k")
    done = gitrun("resume", "k", "--worker-id", resumer)
    assert done.code == 0, done.err
    assert "taken over" not in done.out
    doc = parse(_page(gitrun, "k", tmp_path).read_text())
    assert not _kind(doc, "takeover")
    if resumer == "worker-a":
        return  # its own lease again, the same version: nothing marks a new lease
    resumed = _kind(doc, "resume")
    assert len(resumed) == 1
    assert "interrupted" in resumed[0].attrs["class"].split()
    text = resumed[0].all_text()
    assert "killed or crashed" in text
    assert "before: worker worker-a" in text
    assert f"now: worker {resumer}" in text


@needs_chromium
def test_in_a_real_browser_the_takeover_entry_names_both_workers(
    gitrun: Gitrun,
    tmp_path: Path,
    reap: list[subprocess.Popen[str]],
    request: pytest.FixtureRequest,
) -> None:
    a = _paused_and_taken_over(gitrun, tmp_path, reap)
    page = _page(gitrun, "t", tmp_path)  # while A is still stopped
    os.kill(a.pid, signal.SIGCONT)
    a.communicate(timeout=60)
    dom = parse(rendered_dom(page, tmp_path / "profile"))
    taken = dom.find(**{"data-kind": "takeover"})
    assert len(taken) == 1
    head = taken[0].find(cls="head")[0].all_text()
    assert "Lease taken over" in head
    assert "worker-a" in head
    assert "worker-b" in head
    assert not dom.find(**{"data-kind": "resume"})
    shots = Path(request.config.getoption("--screenshots") or tmp_path)
    png = screenshot(page, shots / "run-takeover.png", tmp_path / "profile", 2400)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
