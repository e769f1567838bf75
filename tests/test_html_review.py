"""The run page shows a review: a step that crashed gitrun twice froze the run for a
reviewer, whose signed decision the page shows (decision, signer, the case it closed),
then the resume that carried on."""

from __future__ import annotations

from pathlib import Path

import pytest
from browser import Node, parse
from conftest import Gitrun
from helpers import Keys
from test_input import make_task

from gitrun.core.errors import Exit
from gitrun.store.evidence import load_trust_roots

pytestmark = pytest.mark.timeout(240)

PLAN = 'schema = 1\n[[step]]\nkind = "write_file"\npath = "f.txt"\ncontent = "new\\n"\n'


def _kind(doc: Node, kind: str) -> list[Node]:
    return doc.find(**{"data-kind": kind})


def test_a_reviewed_run_shows_the_freeze_the_decision_and_its_signer(
    gitrun: Gitrun, keys: Keys, tmp_path: Path
) -> None:
    task = make_task(tmp_path, {"f.txt": b"old\n"}, plan=PLAN)
    fail = {"GITRUN_FAIL_AT": "after_write_commit_object"}
    assert gitrun("run", str(task), "--run-id", "rv", "-q", **fail).code == Exit.INTERNAL
    assert gitrun("resume", "rv", **fail).code == Exit.INTERNAL
    assert gitrun("resume", "rv", **fail).code == Exit.FROZEN
    decided = gitrun("review", "decide", "rv", "replan", "--key", str(keys["bob"]))
    assert decided.code == 0, decided.err
    assert gitrun("resume", "rv", "-q", "--trust-roots", str(keys.roots)).code == Exit.DONE
    page = tmp_path / "rv.html"
    res = gitrun("report", "rv", "--html", str(page))
    assert res.code == 0, res.err
    doc = parse(page.read_text())
    assert any("needs_review (step_crashed)" in n.all_text() for n in _kind(doc, "checkpoint"))
    crashed = _kind(doc, "step_crashed")
    assert len(crashed) == 1
    assert "frozen for review" in crashed[0].find(cls="head")[0].all_text()
    assert "InjectedFailure" in crashed[0].all_text()
    decision = _kind(doc, "review_decision")
    assert len(decision) == 1
    bob = next(r.id for r in load_trust_roots(keys.roots).values() if r.name == "bob")
    text = decision[0].all_text()
    assert "replan" in text
    assert bob in text
    resumed = _kind(doc, "resume")
    assert any("the run had stopped (needs_review)" in n.all_text() for n in resumed)
