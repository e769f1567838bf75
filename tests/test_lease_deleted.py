"""A lease ref deleted by hand (issue #27 §6): one `resume` finishes the run. The new
lease must be newer than every lease that wrote to the run, or its first write is
refused as a stale fence (exit 6) and only a second resume went through."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from conftest import Gitrun, git
from test_input import make_task

from gitrun.core.errors import Exit

pytestmark = pytest.mark.timeout(180)

PLAN = """schema = 1
[[step]]
kind = "write_file"
path = "a.txt"
content = "a\\n"
[[step]]
kind = "write_file"
path = "b.txt"
content = "b\\n"
[[step]]
kind = "write_file"
path = "c.txt"
content = "c\\n"
"""


def test_a_lease_ref_deleted_by_hand_needs_one_resume(gitrun: Gitrun, tmp_path: Path) -> None:
    task = make_task(tmp_path, {"f.txt": b"x\n"}, plan=PLAN)
    first = gitrun("run", str(task), "--run-id", "gone", "-q", GITRUN_CRASH_AT="after_file_sync")
    assert first.code == -signal.SIGKILL, first.err
    second = gitrun("resume", "gone", GITRUN_CRASH_AT="after_file_sync")  # a newer lease writes
    assert second.code == -signal.SIGKILL, second.err
    repo = gitrun.repo("input-task")
    trailers = git(repo, "log", "--format=%(trailers:key=Gitrun-Lease,valueonly)", "gitrun/gone")
    assert max(int(v) for v in trailers.split()) >= 2, trailers
    git(repo, "update-ref", "-d", "refs/gitrun/runs/gone/lease")
    done = gitrun("resume", "gone")
    assert done.code == Exit.DONE, done.err
    info = json.loads(gitrun("status", "gone", "--json").out)
    assert info["phase"] == "done"
