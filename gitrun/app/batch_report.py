"""What the SWE-bench batch page shows, read from the files a batch leaves behind.

The batch summary ``<report dir>/<model>.<run id>.json`` names each instance's result;
each evaluated instance has ``logs/run_evaluation/<run id>/<model>/<instance>/`` with
``report.json``, ``test_output.txt`` and ``gitrun.json``. These shapes change as the
harness follows SWE-bench, so every field is read defensively: a missing or odd one
shows as ``-``, never an error. Each instance's gitrun run gives its duration and, with
``runs_dir``, its own run page (:mod:`gitrun.app.run_report`), linked from the batch's.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from gitrun.app.options import Options
from gitrun.core.errors import BadInput, GitrunError

__all__ = ["batch_report", "find_batch"]

STATUSES = (("resolved", "resolved_ids"), ("unresolved", "unresolved_ids"),
            ("error", "error_ids"), ("empty", "empty_patch_ids"),
            ("incomplete", "incomplete_ids"))  # fmt: skip
LOGS = ("report.json", "test_output.txt", "gitrun.json")


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def find_batch(report_dir: Path, run_id: str | None) -> tuple[str, Path]:
    """The batch's run id and its summary file in ``report_dir``; BadInput naming what
    is missing or ambiguous."""
    if not report_dir.is_dir():
        raise BadInput(f"--batch {report_dir}: no such directory")
    found = sorted(
        p for p in report_dir.glob("*.json")
        if isinstance(_json(p), dict) and "submitted_ids" in _json(p)
    )  # fmt: skip
    if run_id is not None:
        found = [p for p in found if p.name.endswith(f".{run_id}.json")]
    if not found:
        which = f" for run id {run_id}" if run_id else ""
        raise BadInput(f"--batch {report_dir}: no batch report (<model>.<run_id>.json){which}")
    ids = sorted({p.name.rsplit(".", 2)[-2] for p in found})
    if len(ids) > 1:
        raise BadInput(f"--batch {report_dir}: several batches ({', '.join(ids)}); name one")
    if len(found) > 1:
        raise BadInput(f"--batch {report_dir}: several models' reports for {ids[0]}")
    return ids[0], found[0]


def _href(target: Path, page_dir: Path) -> str:
    """A relative link from the page to ``target`` (``./``-prefixed, percent-encoded)."""
    return "./" + quote(os.path.relpath(target, page_dir))


def _failing(report: Any, iid: str) -> list[str]:
    body = report.get(iid) if isinstance(report, dict) else None
    status = body.get("tests_status") if isinstance(body, dict) else None
    if not isinstance(status, dict):
        return []
    out: list[str] = []
    for group in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        split = status.get(group)
        failure = split.get("failure") if isinstance(split, dict) else None
        out += [t for t in failure if isinstance(t, str)] if isinstance(failure, list) else []
    return out


def _duration(opts: Options, rid: str) -> str:
    """How long the instance's gitrun run took (start to its last checkpoint)."""
    from gitrun.app.opening import load_verified, open_run

    try:
        _, stored = load_verified(open_run(rid, opts), check_scenario=False)
    except GitrunError:
        return "-"
    seconds = stored.state.updated_at - stored.state.started_at
    return f"{seconds:.1f} s"


def _instance(iid: str, status: str, logs: Path | None, page_dir: Path, opts: Options,
              runs_dir: Path | None) -> dict[str, Any]:  # fmt: skip
    entry: dict[str, Any] = {"id": iid, "status": status, "duration": "-", "apply": "-",
                             "failing": [], "links": []}  # fmt: skip
    if logs is None:
        return entry
    meta = _json(logs / "gitrun.json")
    meta = meta if isinstance(meta, dict) else {}
    stage = meta.get("stage")
    entry["apply"] = str(stage) if stage else str(meta.get("reason") or "-")
    entry["failing"] = _failing(_json(logs / "report.json"), iid)
    rid = meta.get("gitrun_run_id")
    if isinstance(rid, str) and rid:
        entry["run_id"] = rid
        entry["duration"] = _duration(opts, rid)
        if runs_dir is not None:
            page = _run_page(rid, opts, runs_dir)
            if page is not None:
                entry["links"].append(("run report", _href(page, page_dir)))
    entry["links"] += [(n, _href(logs / n, page_dir)) for n in LOGS if (logs / n).is_file()]
    return entry


def _run_page(rid: str, opts: Options, runs_dir: Path) -> Path | None:
    """The instance's run page, written beside the batch's; None if it cannot be read."""
    from gitrun.app.report_html import run_page
    from gitrun.app.run_report import run_report
    from gitrun.store.atomicfile import atomic_write

    try:
        text = run_page(run_report(rid, opts))
    except GitrunError:
        return None
    out = runs_dir / f"{rid}.html"
    atomic_write(out, text.encode("utf-8"), parent_mode=0o755)
    return out


def batch_report(report_dir: Path, run_id: str | None, page: Path, opts: Options) -> dict[str, Any]:
    """The batch page's data; each instance's run page goes to ``<page stem>-runs/``."""
    rid, summary_path = find_batch(report_dir, run_id)
    summary = _json(summary_path)
    model = summary_path.name[: -len(f".{rid}.json")]
    logs_root = report_dir / "logs" / "run_evaluation" / rid / model
    page_dir = page.resolve().parent
    runs_dir = page_dir / f"{page.stem}-runs"
    counts: dict[str, int] = {}
    instances = []
    for status, key in STATUSES:
        ids = summary.get(key) if isinstance(summary.get(key), list) else []
        counts[status] = len(ids)
        for iid in sorted(str(i) for i in ids):
            logs = logs_root / iid if (logs_root / iid).is_dir() else None
            instances.append(_instance(iid, status, logs, page_dir, opts, runs_dir))
    facts = [("report", str(summary_path)), ("model", model.replace("__", "/")),
             ("submitted", summary.get("submitted_instances", "-")),
             ("total in the dataset", summary.get("total_instances", "-")),
             ("page made", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))]  # fmt: skip
    return {"run_id": rid, "counts": counts, "facts": facts, "instances": instances}
