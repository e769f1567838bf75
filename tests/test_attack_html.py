"""The HTML run report of a Claude Code run whose hook payloads an attacker wrote: the
tool name, session id, Bash command and output, and the file names it changed are
markup. Rendered by headless Chromium, the page must show them as text, run nothing, and
plant no element (the tool receipts' own fields are newer than tests/test_report_html.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from browser import needs_chromium, parse, rendered_dom
from conftest import git

GITRUN = [sys.executable, "-m", "gitrun"]
MARKUP = (
    '<img src=x onerror="document.title=1"><b id="planted">B</b><script>document.title=2</script>'
)


def _gitrun(
    env: dict[str, str], *args: str, stdin: bytes = b""
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*GITRUN, *args], env=env, input=stdin, capture_output=True,
                          timeout=120, check=False)  # fmt: skip


@needs_chromium
def test_a_claude_runs_report_shows_forged_tool_fields_as_text_in_chromium(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "a.txt").write_text("a\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    env = {**os.environ, "GITRUN_HOME": str(tmp_path / "ws")}
    made = _gitrun(env, "claude", "--repo", str(repo), "--run-id", "x1", "--no-launch")
    assert made.returncode == 0, made.stderr
    wt = tmp_path / "ws" / "worktrees" / "x1"

    def payload(event: str) -> bytes:
        return json.dumps({
            "session_id": MARKUP, "hook_event_name": event, "tool_name": MARKUP,
            "tool_use_id": "toolu_markup_0001", "tool_input": {"command": MARKUP},
            "tool_response": {"stdout": MARKUP, "stderr": MARKUP},
        }).encode()  # fmt: skip

    pre = _gitrun(env, "hook", "pre-tool-use", "--run", "x1", stdin=payload("PreToolUse"))
    assert pre.returncode == 0, pre.stderr
    (wt / '<b id="planted2">').mkdir()
    (wt / '<b id="planted2">' / "<img src=x onerror=alert(1)>.txt").write_text(MARKUP)
    post = _gitrun(env, "hook", "post-tool-use", "--run", "x1", stdin=payload("PostToolUse"))
    assert post.returncode == 0, post.stderr
    assert "Gitrun-Tool: <img" in git(repo, "log", "-1", "--format=%B", "gitrun/x1")
    page = tmp_path / "x1.html"
    report = _gitrun(env, "report", "x1", "--html", str(page))
    assert report.returncode == 0, report.stderr
    doc = parse(rendered_dom(page, tmp_path / "profile"))
    assert not doc.find(id="planted")
    assert not doc.find(id="planted2")
    assert not doc.find(tag="img")
    assert not doc.find(tag="script")
    assert doc.find(tag="title")[0].all_text() == "gitrun run x1: running"
    text = doc.all_text()
    assert text.count(MARKUP) >= 3  # the tool, the session, the output: shown as text
    assert "<img src=x onerror=alert(1)>.txt" in text
