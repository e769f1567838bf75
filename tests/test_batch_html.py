"""The SWE-bench batch page: ``gitrun swebench … --html FILE`` as the batch ends, and
``gitrun report --batch DIR --html FILE`` later from the files it left, checked in
headless Chromium. The model's name (it names files and shows on the page) is markup."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest
from browser import Node, needs_chromium, parse, rendered_dom, screenshot
from conftest import ROOT, scrub_env
from swebench_data import BUNDLE, OWNER, make_repos

MEDIAN = f"{OWNER}__fix-median-1"
SLUG = f"{OWNER}__slugify-unicode-1"
MODEL = "<script>document.title='pwned'</script>"
BATCH = "b1"
pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True)
class Batch:
    env: dict[str, str]
    tmp: Path
    page: Path
    out: subprocess.CompletedProcess[str]


def _gitrun(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gitrun", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=280, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def envs() -> Iterator[Path]:
    """The environments both batches build (the same, cached by digest)."""
    envs = Path(tempfile.mkdtemp(prefix="gitrun-batch-envs-", dir="/var/tmp"))
    yield envs
    shutil.rmtree(envs, ignore_errors=True)


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory, envs: Path) -> Iterator[Batch]:
    """A batch of the bundled instances: median's prediction is wrong, slugify's empty."""
    tmp = tmp_path_factory.mktemp("batch")
    with pytest.MonkeyPatch.context() as mp:
        scrub_env(mp, tmp / "home")
        env = {**os.environ, "GITRUN_HOME": str(tmp / "ws"), "GITRUN_SWEBENCH_ENVS": str(envs)}
        make_repos(tmp / "repos")
        shutil.copy(BUNDLE / "specs.json", tmp / "repos" / "gitrun-swebench.json")
        wrong = {json.loads(x)["instance_id"]: json.loads(x)["model_patch"]
                 for x in (BUNDLE / "preds-wrong.jsonl").read_text().splitlines()}  # fmt: skip
        preds = [{"instance_id": MEDIAN, "model_name_or_path": MODEL, "model_patch": wrong[MEDIAN]},
                 {"instance_id": SLUG, "model_name_or_path": MODEL, "model_patch": ""}]  # fmt: skip
        (tmp / "preds.json").write_text(json.dumps(preds))
        page = tmp / "pages" / "batch.html"
        page.parent.mkdir()
        out = _gitrun(env, "swebench", "--dataset", str(BUNDLE / "instances.jsonl"),
                      "--predictions", str(tmp / "preds.json"), "--repos", str(tmp / "repos"),
                      "--run-id", BATCH, "--report-dir", str(tmp / "out"),
                      "--html", str(page))  # fmt: skip
        yield Batch(env, tmp, page, out)


@pytest.fixture(scope="module")
def error_batch(tmp_path_factory: pytest.TempPathFactory, envs: Path) -> Iterator[Batch]:
    """median's prediction does not apply (an error), slugify's is the gold patch."""
    tmp = tmp_path_factory.mktemp("errbatch")
    with pytest.MonkeyPatch.context() as mp:
        scrub_env(mp, tmp / "home")
        env = {**os.environ, "GITRUN_HOME": str(tmp / "ws"), "GITRUN_SWEBENCH_ENVS": str(envs)}
        make_repos(tmp / "repos")
        shutil.copy(BUNDLE / "specs.json", tmp / "repos" / "gitrun-swebench.json")
        gold = {json.loads(x)["instance_id"]: json.loads(x)["patch"]
                for x in (BUNDLE / "instances.jsonl").read_text().splitlines()}  # fmt: skip
        broken = "--- a/nowhere.py\n+++ b/nowhere.py\n@@ -1,1 +1,1 @@\n-<b>x</b>\n+y\n"
        preds = [
            {"instance_id": MEDIAN, "model_name_or_path": "m", "model_patch": broken},
            {"instance_id": SLUG, "model_name_or_path": "m", "model_patch": gold[SLUG]},
        ]
        (tmp / "preds.json").write_text(json.dumps(preds))
        out = _gitrun(env, "swebench", "--dataset", str(BUNDLE / "instances.jsonl"),
                      "--predictions", str(tmp / "preds.json"), "--repos", str(tmp / "repos"),
                      "--run-id", "b2", "--report-dir", str(tmp / "out"))  # fmt: skip
        page = tmp / "b2.html"
        rebuilt = _gitrun(env, "report", "--batch", str(tmp / "out"), "--html", str(page))
        assert rebuilt.returncode == 0, rebuilt.stderr
        yield Batch(env, tmp, page, out)


def _row(doc: Node, iid: str) -> Node:
    return doc.find(**{"data-instance": iid})[0]


def _check_page(doc: Node, page: Path) -> None:
    counts = {
        n.attrs["data-count"]: n.all_text() for n in doc.find(tag="span") if "data-count" in n.attrs
    }
    assert counts["resolved"] == "resolved 0"
    assert counts["unresolved"] == "unresolved 1"
    assert counts["empty"] == "empty 1"
    median = _row(doc, MEDIAN)
    assert median.find(cls="status")[0].all_text() == "unresolved"
    failing = [n.all_text() for n in median.find(cls="failing")[0].find(tag="code")]
    assert "tests/test_median.py::test_even_length" in failing
    assert median.find(tag="td")[3].all_text() == "strict"  # the apply stage
    assert median.find(tag="td")[2].all_text().endswith(" s")  # a duration
    links = {a.all_text(): a.attrs["href"] for a in median.find(tag="a")}
    assert set(links) == {"run report", "report.json", "test_output.txt", "gitrun.json"}
    for href in links.values():
        assert href.startswith("./")
        assert (page.parent / unquote(href)).is_file(), href
    assert "run " in (page.parent / unquote(links["run report"])).read_text()
    slug = _row(doc, SLUG)
    assert slug.find(cls="status")[0].all_text() == "empty"
    assert MODEL in doc.all_text()  # the model's name, shown as text


def test_swebench_html_writes_the_batch_page_as_the_batch_ends(batch: Batch) -> None:
    assert batch.out.returncode == 0, batch.out.stderr
    lines = batch.out.stdout.splitlines()
    assert lines[-1] == (f"swebench {BATCH}: 0 resolved, 1 unresolved, 0 error, 1 empty, "
                         f"0 incomplete; page written to {batch.page}")  # fmt: skip
    doc = parse(batch.page.read_text())
    _check_page(doc, batch.page)
    assert not [n for n in doc.walk() if n.tag == "script"]


def test_report_batch_rebuilds_the_page_from_the_records(batch: Batch, tmp_path: Path) -> None:
    page = tmp_path / "again.html"
    res = _gitrun(batch.env, "report", "--batch", str(batch.tmp / "out"), "--html", str(page))
    assert res.returncode == 0, res.stderr
    assert res.stdout.endswith(f"page written to {page}\n")
    _check_page(parse(page.read_text()), page)


def test_a_batch_with_an_error_and_a_resolved_instance_shows_both_with_the_reason(
    error_batch: Batch,
) -> None:
    assert error_batch.out.returncode == 1, error_batch.out.stderr  # an error in the batch
    doc = parse(error_batch.page.read_text())
    counts = {
        n.attrs["data-count"]: n.all_text() for n in doc.find(tag="span") if "data-count" in n.attrs
    }
    assert (counts["resolved"], counts["error"]) == ("resolved 1", "error 1")
    median = _row(doc, MEDIAN)
    assert median.find(cls="status")[0].all_text() == "error"
    applied = median.find(tag="td")[3].all_text()
    assert applied not in ("", "-", "strict"), applied  # why it was not applied
    slug = _row(doc, SLUG)
    assert slug.find(cls="status")[0].all_text() == "resolved"
    assert slug.find(cls="failing")[0].find(tag="code") == []
    links = {a.all_text() for a in slug.find(tag="a")}
    assert {"run report", "report.json", "test_output.txt"} <= links


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--batch", "{tmp}/nowhere"], "no such directory"),
        (["--batch", "{tmp}/repos"], "no batch report"),
        (
            ["nope", "--batch", "{tmp}/out"],
            "no batch report (<model>.<run_id>.json) for run id nope",
        ),
        (["--batch", "{tmp}/out", "--html", "-"], "name a file"),
        (["--html", "{tmp}/x.html"], "name a RUN"),
        (["r"], "--html FILE"),
    ],
)
def test_bad_report_inputs_are_one_line_and_exit_2(
    batch: Batch, args: list[str], words: str
) -> None:
    argv = [a.format(tmp=batch.tmp) for a in args]
    if "--html" not in argv:
        argv += ["--html", str(batch.tmp / "x.html")] if "--batch" in argv else []
    res = _gitrun(batch.env, "report", *argv)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("gitrun: ")
    assert len(res.stderr.splitlines()) == 1
    assert words in res.stderr
    assert not (batch.tmp / "x.html").exists()


@needs_chromium
def test_in_a_real_browser_the_batch_page_shows_counts_statuses_and_failing_tests(
    batch: Batch, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    dom = parse(rendered_dom(batch.page, tmp_path / "profile"))
    assert dom.find(tag="title")[0].all_text() == f"gitrun SWE-bench batch {BATCH}"
    assert not [n for n in dom.walk() if n.tag in ("script", "img", "iframe")]
    _check_page(dom, batch.page)
    run_page = batch.page.parent / unquote(
        next(
            a.attrs["href"] for a in _row(dom, MEDIAN).find(tag="a") if a.all_text() == "run report"
        )
    )
    run_dom = parse(rendered_dom(run_page, tmp_path / "profile"))
    assert "failed" in run_dom.find(id="verdict-text")[0].all_text()
    shots = Path(request.config.getoption("--screenshots") or tmp_path)
    png = screenshot(batch.page, shots / "batch-report.png", tmp_path / "profile", 700)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
