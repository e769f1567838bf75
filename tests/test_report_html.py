"""``gitrun report RUN --html FILE``: the run as one self-contained page, checked as a
person would in a real browser (headless Chromium), on a run whose file names, contents,
command and output an attacker chose, killed mid-run and resumed."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from browser import Node, needs_chromium, parse, rendered_dom, screenshot
from conftest import ROOT, SANDBOXES, Gitrun, relocate_workspace, scrub_env
from helpers import Keys
from report_world import (
    EXEC_COMMAND,
    LONG_LINES,
    PLANTED_NAME,
    PLANTED_TAG,
    TITLE_SCRIPT,
    hostile_task,
)

from gitrun.store.evidence import load_trust_roots

RUN = "h1"
ALLOWED_TAGS = {
    "html", "head", "meta", "title", "style", "body", "header", "main", "h1", "h2", "p",
    "span", "dl", "dt", "dd", "ol", "ul", "li", "div", "code", "pre", "details", "summary",
    "table", "tr", "th", "td", "b", "a", "tbody",
}  # fmt: skip


@dataclass(frozen=True)
class World:
    env: dict[str, str]
    tmp: Path
    page: Path
    proc: subprocess.CompletedProcess[str]


def _gitrun(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gitrun", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=240, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """The hostile run, SIGKILLed after its second write's commit object, resumed to done,
    and its report written."""
    tmp = tmp_path_factory.mktemp("report")
    with pytest.MonkeyPatch.context() as mp:
        scrub_env(mp, tmp / "home")
        env = {**os.environ, "GITRUN_HOME": str(tmp / "ws")}
        task = hostile_task(tmp / "hostile")
        killed = _gitrun({**env, "GITRUN_CRASH_AT": "after_write_commit_object:2"},
                         "run", str(task), "--run-id", RUN, "-q")  # fmt: skip
        assert killed.returncode == -9, killed.stderr
        done = _gitrun(env, "resume", RUN, "-q")
        assert done.returncode == 0, done.stderr
        page = tmp / "report.html"
        proc = _gitrun(env, "report", RUN, "--html", str(page))
        yield World(env, tmp, page, proc)


def _items(doc: Node, kind: str) -> list[Node]:
    return doc.find(**{"data-kind": kind})


def test_the_report_is_written_and_named_with_the_verdict(world: World) -> None:
    assert world.proc.returncode == 0, world.proc.stderr
    assert world.proc.stdout == f"run {RUN}: done; report written to {world.page}\n"


def test_the_page_is_self_contained_no_script_no_external_reference(world: World) -> None:
    doc = parse(world.page.read_text())
    tags = {n.tag for n in doc.walk()} - {"#document"}
    assert tags <= ALLOWED_TAGS, tags - ALLOWED_TAGS
    for node in doc.walk():
        for name, value in node.attrs.items():
            assert not name.startswith("on"), (node.tag, name)
            assert "//" not in value or name == "content", (node.tag, name, value)
    csp = doc.find(**{"http-equiv": "Content-Security-Policy"})
    assert csp
    assert "default-src 'none'" in csp[0].attrs["content"]


def test_every_planted_text_is_shown_as_text(world: World) -> None:
    doc = parse(world.page.read_text())
    text = doc.all_text()
    for planted in (PLANTED_NAME, TITLE_SCRIPT, PLANTED_TAG, EXEC_COMMAND,
                    "<iframe id=evil></iframe>", "<style>body{display:none}</style>"):  # fmt: skip
        assert planted in text, planted
    assert not doc.find(id="planted")
    assert not doc.find(id="evil")


def test_the_timeline_shows_refusal_intents_receipts_resume_and_verdict(world: World) -> None:
    doc = parse(world.page.read_text())
    assert "done" in doc.find(id="phase")[0].all_text()
    assert "passed" in doc.find(id="verdict-text")[0].all_text()
    chain = doc.find(id="chain")[0]
    assert "checkpoint chain verified" in chain.all_text()
    assert "SSH signatures good on 7 of 7" in chain.all_text()
    refused = _items(doc, "gate_rejected")
    assert len(refused) == 1
    assert refused[0].find(cls="rule")[0].all_text() == "path-forbidden"
    assert "config/defaults.toml" in refused[0].all_text()
    assert len(_items(doc, "intent")) == 3
    receipts = _items(doc, "receipt")
    assert len(receipts) == 3
    exec_receipt = next(r for r in receipts if r.find(cls="command"))
    assert exec_receipt.find(cls="command")[0].all_text() == f"$ {EXEC_COMMAND}"
    assert exec_receipt.find(cls="exit")[0].all_text() == "0"
    assert exec_receipt.find(cls="stdout")[0].all_text() == TITLE_SCRIPT + "\n"
    resume = _items(doc, "resume")
    assert len(resume) == 1
    assert "interrupted" in resume[0].attrs["class"].split()
    assert _items(doc, "exec_discarded")  # the killed exec step's leftovers, put back
    verifier = _items(doc, "verifier")[-1]
    outcomes = {
        row.find(tag="code")[0].all_text(): row.find(cls="outcome")[0].all_text()
        for row in verifier.find(tag="tr")[1:]
    }
    assert outcomes["tests/test_config.py::test_client_options_from_defaults"] == "passed"
    assert "bwrap" in verifier.all_text() or "none" in verifier.all_text()


def test_a_large_diff_is_collapsed_and_kept_whole(world: World) -> None:
    doc = parse(world.page.read_text())
    planted = next(r for r in _items(doc, "receipt") if PLANTED_NAME in r.all_text())
    diff = planted.find(cls="diff")[0]
    assert diff.tag == "details"
    assert "open" not in diff.attrs
    text = diff.all_text()
    assert f"+line {LONG_LINES - 1} {PLANTED_TAG}" in text
    assert all(f"+line {i} {PLANTED_TAG}" in text for i in range(LONG_LINES))
    small = next(r for r in _items(doc, "receipt") if r.find(cls="command"))
    assert "open" in small.find(cls="diff")[0].attrs
    # a long output too: the exec's stderr, every line kept under a closed toggle
    stderr = small.find(cls="stderr")[0]
    toggle = next(d for d in small.find(tag="details") if stderr in d.walk())
    assert "open" not in toggle.attrs
    assert stderr.all_text().splitlines()[1:] == [str(i) for i in range(1, LONG_LINES + 1)]


def test_a_tampered_chain_is_reported_refused_and_the_page_says_so(
    world: World, tmp_path: Path
) -> None:
    env = {**world.env, "GITRUN_HOME": str(tmp_path / "ws")}
    relocate_workspace(world.tmp / "ws", tmp_path / "ws")
    repo = tmp_path / "ws" / "repos" / "guarded-config"
    refs = subprocess.run(["git", "for-each-ref", "--format=%(refname)",
                           f"refs/gitrun/runs/{RUN}/checkpoints/"], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.split()  # fmt: skip
    head = subprocess.run(["git", "rev-parse", f"{refs[0]}~1"], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    subprocess.run(["git", "update-ref", refs[0], head], cwd=repo, check=True)  # a rollback
    page = tmp_path / "tampered.html"
    proc = _gitrun(env, "report", RUN, "--html", str(page))
    assert proc.returncode == 5
    assert proc.stderr.startswith("gitrun: ")
    assert len(proc.stderr.splitlines()) == 1
    assert str(page) in proc.stderr
    chain = parse(page.read_text()).find(id="chain")[0]
    assert "NOT verified" in chain.all_text()


def test_an_unknown_run_is_one_line_and_writes_nothing(world: World, tmp_path: Path) -> None:
    proc = _gitrun(world.env, "report", "nope", "--html", str(tmp_path / "x.html"))
    assert proc.returncode == 2
    assert "unknown run id 'nope'" in proc.stderr
    assert not (tmp_path / "x.html").exists()


@needs_chromium
def test_in_a_real_browser_the_page_shows_the_run_and_no_planted_markup_ran(
    world: World, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    dom = parse(rendered_dom(world.page, tmp_path / "profile"))
    assert dom.find(tag="title")[0].all_text() == f"gitrun run {RUN}: done"  # no script ran
    assert not dom.find(id="planted")
    assert not dom.find(id="evil")
    assert not [n for n in dom.walk() if n.tag in ("script", "img", "iframe")]
    assert "done" in dom.find(id="phase")[0].all_text()
    assert "verifier passed" in dom.find(id="verdict-text")[0].all_text()
    refused = dom.find(**{"data-kind": "gate_rejected"})[0]
    assert refused.find(cls="rule")[0].all_text() == "path-forbidden"
    diff_lines = [n.all_text() for n in dom.find(cls="d-add")]
    assert f"+{TITLE_SCRIPT}" in diff_lines
    assert "+<style>body{display:none}</style>" in diff_lines
    text = dom.all_text()
    assert PLANTED_NAME in text
    assert "tests/test_config.py::test_client_options_from_defaults" in text
    shots = Path(request.config.getoption("--screenshots") or tmp_path)
    png = screenshot(world.page, shots / "run-report.png", tmp_path / "profile", 3400)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_approved_run_shows_the_freeze_the_approval_and_its_signer(
    gitrun: Gitrun, keys: Keys, tmp_path: Path
) -> None:
    roots = str(keys.roots)
    task = str(SANDBOXES / "retire-legacy")
    assert gitrun("run", task, "--run-id", "ap", "-q", "--trust-roots", roots).code == 3
    assert gitrun("approve", "ap", "--key", str(keys["alice"]), "--trust-roots", roots).code == 0
    assert gitrun("resume", "ap", "-q", "--trust-roots", roots).code == 0
    page = tmp_path / "ap.html"
    res = gitrun("report", "ap", "--html", str(page))
    assert res.code == 0, res.err
    doc = parse(page.read_text())
    risky = [n for n in _items(doc, "intent") if "needs approval" in n.all_text()]
    assert len(risky) == 1
    assert "delete_file units/legacy.py" in risky[0].all_text()
    assert any("awaiting_approval" in n.all_text() for n in _items(doc, "checkpoint"))
    approval = _items(doc, "approval")
    assert len(approval) == 1
    alice = next(r.id for r in load_trust_roots(keys.roots).values() if r.name == "alice")
    assert f"signer{alice}" in approval[0].all_text()
    assert "expires_at20" in approval[0].all_text()  # a date, not epoch seconds
    receipt = next(r for r in _items(doc, "receipt") if "units/legacy.py" in r.all_text())
    assert "sha256:" in receipt.find(tag="dd")[3].all_text()  # its approval fingerprint
    resume = _items(doc, "resume")
    assert resume
    assert "interrupted" not in resume[0].attrs["class"].split()
    assert "awaiting_approval" in resume[0].all_text()
