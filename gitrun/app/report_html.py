"""HTML pages of a run (:func:`run_page`) and of a SWE-bench batch (:func:`batch_page`).

One self-contained file each: inline CSS, no script, no network, no external asset; a
Content-Security-Policy that allows none of them either. Every text that reaches the
page from a run (file names, contents, commands, outputs, messages, test ids: an agent
or the tests wrote them) goes through :func:`esc`; only this module's own fixed markup is
not escaped. Large diffs and outputs are collapsed in ``<details>``, never cut.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["batch_page", "esc", "run_page"]

COLLAPSE_LINES = 80
COLLAPSE_CHARS = 6000
CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; "
    "form-action 'none'"
)

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1f2328;
background:#f6f8fa}
header{padding:18px 28px;border-bottom:1px solid #d0d7de;background:#fff}
h1{font-size:22px;margin:0 0 6px}h2{font-size:16px;margin:22px 28px 8px}
.verdict.pass h1{color:#1a7f37}.verdict.fail h1{color:#cf222e}.verdict.wait h1{color:#9a6700}
.chain{display:inline-block;padding:3px 10px;border-radius:12px;font-weight:600;margin:4px 0}
.chain.ok{background:#dafbe1;color:#116329}.chain.bad{background:#ffebe9;color:#a40e26}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:8px 0 0}
dl.facts dt{color:#656d76}
dl.facts dd{margin:0;font-family:ui-monospace,monospace;word-break:break-all}
ol.timeline{list-style:none;margin:0;padding:8px 28px 40px}
.ev{background:#fff;border:1px solid #d0d7de;border-left:5px solid #8c959f;border-radius:6px;
margin:8px 0;padding:8px 12px}.ev-checkpoint{padding:4px 12px;font-size:13px}.ev p{margin:4px 0}
.ev .head{font-weight:600}.ev .when{float:right;color:#656d76;font-size:12px;font-weight:400}
.ev-checkpoint{border-left-color:#8250df;background:#fbf8ff}.ev-receipt{border-left-color:#0969da}
.ev-gate_rejected{border-left-color:#cf222e;background:#fff5f5}.ev-intent{border-left-color:#bf8700}
.ev-verifier.pass{border-left-color:#1a7f37}.ev-verifier.fail{border-left-color:#cf222e}
.ev-resume{border-left-color:#fb8500;background:#fff8f0}
.ev-takeover{border-left-color:#cf222e;background:#fff0f3}
.ev-approval,.ev-review_decision{border-left-color:#1a7f37}
code,pre{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12.5px}
pre{background:#f6f8fa;border:1px solid #eaeef2;border-radius:4px;padding:6px 8px;margin:6px 0;
overflow-x:auto;white-space:pre-wrap;word-break:break-all}
.d-add{color:#116329;background:#dafbe1}.d-del{color:#82071e;background:#ffebe9}
.d-hunk{color:#8250df}.d-file{font-weight:700}
.rule{background:#ffebe9;color:#a40e26;padding:1px 6px;border-radius:4px;font-weight:700}
table{border-collapse:collapse;margin:6px 0}
td,th{border:1px solid #d0d7de;padding:3px 8px;text-align:left}
th{background:#f6f8fa}.o-passed,.o-resolved{color:#1a7f37;font-weight:600}
.o-failed,.o-error,.o-unresolved{color:#cf222e;font-weight:600}.o-skipped,.o-empty{color:#9a6700}
summary{cursor:pointer;color:#0969da}.muted{color:#656d76}
.counts span{display:inline-block;margin-right:16px;font-size:16px}
"""


def esc(value: object) -> str:
    """Text as HTML text (and attribute) content: every ``<>&"'`` escaped."""
    return html.escape("" if value is None else str(value), quote=True)


def page(title: str, header: str, body: str) -> str:
    """A whole self-contained document."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{STYLE}</style></head>\n"
        f"<body>{header}\n<main>{body}</main></body></html>\n"
    )


def block(title: str, text: str, cls: str = "", closed: bool = False) -> str:
    """``text`` in a ``<pre>``; collapsed under ``title`` when it is large (all of it kept)
    or ``closed``."""
    lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
    body = f'<pre class="{cls}">{esc(text)}</pre>'
    large = closed or lines > COLLAPSE_LINES or len(text) > COLLAPSE_CHARS
    return (
        f"<details{'' if large else ' open'}><summary>{esc(title)} ({lines} lines)</summary>"
        f"{body}</details>"
    )


def diff_block(diff: str) -> str:
    """A unified diff, each line marked added, removed, hunk or file header."""
    rows = []
    for line in diff.splitlines():
        if line.startswith(("+++", "---", "diff --git")):
            cls = "d-file"
        elif line.startswith("+"):
            cls = "d-add"
        elif line.startswith("-"):
            cls = "d-del"
        elif line.startswith("@@"):
            cls = "d-hunk"
        else:
            cls = ""
        rows.append(f'<span class="{cls}">{esc(line)}</span>' if cls else esc(line))
    count = len(rows)
    large = count > COLLAPSE_LINES or len(diff) > COLLAPSE_CHARS
    return (
        f'<details class="diff"{"" if large else " open"}><summary>diff ({count} lines)</summary>'
        f'<pre class="diff">{chr(10).join(rows)}</pre></details>'
    )


def facts(rows: Iterable[tuple[str, object]]) -> str:
    return "<dl class=\"facts\">" + "".join(
        f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in rows
    ) + "</dl>"  # fmt: skip


def outcome_table(outcomes: dict[str, str], caption: str = "test") -> str:
    rows = "".join(
        f'<tr><td><code>{esc(t)}</code></td><td class="outcome o-{esc(o)}">{esc(o)}</td></tr>'
        for t, o in sorted(outcomes.items())
    )
    head = f"<tr><th>{esc(caption)}</th><th>outcome</th></tr>"
    return f'<table class="outcomes">{head}{rows}</table>'


def _li(kind: str, head: str, when: str, body: str = "", extra: str = "") -> str:
    cls = f"ev ev-{kind}" + (f" {extra}" if extra else "")
    return (
        f'<li class="{cls}" data-kind="{esc(kind)}"><div class="head">{head}'
        f'<span class="when">{esc(when)}</span></div>{body}</li>'
    )


def _verdict_class(phase: str, verifier: dict[str, Any] | None) -> str:
    if phase == "done" and (verifier is None or verifier.get("passed")):
        return "pass"
    if phase in ("awaiting_approval", "needs_review", "running"):
        return "wait"
    return "fail"


def _run_header(r: dict[str, Any]) -> str:
    v = r.get("verifier")
    phase = str(r.get("phase", "unknown"))
    stop = f" ({r['stop_reason']})" if r.get("stop_reason") else ""
    if v is not None:
        verdict = f"verifier {'passed' if v.get('passed') else 'failed'}: {v.get('summary', '')}"
    else:
        verdict = "no verifier verdict"
    if r.get("verified"):
        good, total = r.get("ssh_good", 0), r.get("checkpoints", 0)
        chain = (
            f'<p id="chain" class="chain ok">checkpoint chain verified: {esc(total)} '
            f"checkpoints, HMAC good; SSH signatures good on {esc(good)} of {esc(total)}</p>"
        )
    else:
        chain = (
            '<p id="chain" class="chain bad">checkpoint chain NOT verified: '
            f"{esc(r.get('chain_error', ''))}</p>"
        )
    rows = [("task", f"{r['task']} {r.get('title', '')}".strip()), ("repository", r["repo"]),
            ("branch", r["branch"]), ("head", r.get("head", "-")), ("base", r.get("base", "-")),
            ("generation", r.get("generation", "-")), ("receipts", r.get("receipt_count", "-")),
            ("checkpoint ref", r.get("checkpoint_ref", "-")),
            ("report made", r["generated_at"])]  # fmt: skip
    return (
        f'<header id="verdict" class="verdict {_verdict_class(phase, v)}">'
        f'<h1>run {esc(r["run_id"])}: <span id="phase">{esc(phase + stop)}</span></h1>'
        f'<p id="verdict-text">{esc(verdict)}</p>{chain}{facts(rows)}</header>'
    )


def _receipt(e: dict[str, Any]) -> str:
    state = " (replayed)" if e.get("replayed") else ""
    state += " (written after the last checkpoint)" if e.get("unrecorded") else ""
    head = (
        f"Receipt <code>{esc(e['commit'][:12])}</code> {esc(e['action'])} "
        f'<span class="muted">key {esc(e["key"])}{esc(state)}</span>'
    )
    rows = [("commit", e["commit"]), ("paths", ", ".join(e["paths"]) or "-"),
            ("lease", e["lease"]), ("approval", e["approval"])]  # fmt: skip
    body = facts(rows) + block("commit message", e["message"], closed=True)
    if "exit_code" in e:
        command = e.get("command") or "(command not recorded in the chain)"
        body += f'<pre class="command">$ {esc(command)}</pre>'
        body += f'<p>exit code <code class="exit">{esc(e["exit_code"])}</code></p>'
        body += block("stdout", e.get("stdout", ""), "stdout")
        body += block("stderr", e.get("stderr", ""), "stderr")
    body += diff_block(e["diff"])
    return _li("receipt", head, e["at"], body)


def _resume(e: dict[str, Any]) -> str:
    why = (
        "the previous process was interrupted while running (killed or crashed)"
        if e["interrupted"]
        else f"the run had stopped ({e['previous_phase']})"
    )
    head = f"Resumed under lease v{esc(e['lease'])}"
    body = (
        f"<p>{esc(why)}; before: worker {esc(e['from_worker'])} with lease "
        f"v{esc(e['from_lease'])}; now: worker {esc(e['worker'])}</p>"
    )
    return _li("resume", head, e["at"], body, "interrupted" if e["interrupted"] else "")


def _takeover(e: dict[str, Any]) -> str:
    head = (
        f'Lease taken over: worker <span class="to-worker">{esc(e["worker"])}</span> '
        f"(lease v{esc(e['lease'])}) took the run from worker "
        f'<span class="from-worker">{esc(e["from_worker"])}</span> '
        f"(lease v{esc(e['from_lease'])})"
    )
    rows = [("previous holder", e["from_worker"]), ("its lease", e["from_lease"]),
            ("last renewed", e["from_renewed_at"]), ("expired at", e["from_expires_at"]),
            ("new holder", e["worker"]), ("new lease", e["lease"]),
            ("phase", e["previous_phase"])]  # fmt: skip
    body = (
        f"<p>not a resume after a crash: worker {esc(e['from_worker'])} was still at work "
        f"on the run (stopped, hung or out of reach) when {esc(e['how'])}; any write it "
        f"tries under lease v{esc(e['from_lease'])} is refused</p>{facts(rows)}"
    )
    return _li("takeover", head, e["at"], body)


def _checkpoint(e: dict[str, Any]) -> str:
    stop = f" ({e['stop_reason']})" if e["stop_reason"] else ""
    ssh = f"good, key {e['ssh']}" if e["ssh"] else "missing or not good"
    head = f"Checkpoint g={esc(e['generation'])} recorded: {esc(e['phase'] + stop)}"
    line = (
        f'<p class="muted">commit <code>{esc(e["commit"][:12])}</code> · worker '
        f"{esc(e['worker'])} · lease v{esc(e['lease'])} · HMAC key {esc(e['key_id'])} · "
        f'SSH signature <span class="ssh">{esc(ssh)}</span></p>'
    )
    return _li("checkpoint", head, e["at"], line)


def _verifier(e: dict[str, Any]) -> str:
    d = e["data"]
    passed = bool(d.get("passed"))
    head = f"Verifier {'passed' if passed else 'failed'}: {esc(d.get('summary', ''))}"
    rows = [("ran on commit", d.get("head", "")), ("tree", d.get("tree", "")),
            ("isolation", d.get("isolation", ""))]  # fmt: skip
    outcomes = d.get("outcomes") if isinstance(d.get("outcomes"), dict) else {}
    body = facts(rows) + outcome_table(outcomes)
    return _li("verifier", head, e["at"], body, "pass" if passed else "fail")


def _event(e: dict[str, Any]) -> str:
    kind, d, at = e["kind"], e["data"], e["at"]
    if kind == "verifier":
        return _verifier(e)
    if kind == "gate_rejected":
        head = f"Gate refused: {esc(d.get('action', ''))}"
        body = (
            f'<p>rule <span class="rule">{esc(d.get("rule", ""))}</span> '
            f'<span class="message">{esc(d.get("message", ""))}</span></p>'
        )
        return _li(kind, head, at, body)
    if kind == "intent":
        risk = f" [needs approval: {d['risk']}]" if d.get("risk") else ""
        head = f"Proposal: {esc(d.get('action', ''))}{esc(risk)}"
        return _li(kind, head, at, facts([("key", d.get("key")), ("intent", d.get("digest"))]))
    titles = {
        "started": "Run started",
        "approval": "Approval accepted",
        "review_decision": "Review decision",
        "receipt_conflict": "Receipt conflict: frozen for review",
        "frozen": "Frozen for a human",
        "exec_discarded": "Crash recovery: an unfinished exec step's changes discarded",
        "exec_interrupted": "Crash recovery: an interrupted exec step frozen for review",
        "step_crashed": "Step crashed gitrun again at the same point: frozen for review",
        "agent_started": "Agent started",
    }
    head = esc(titles.get(kind, kind))
    rows = [(k, _value(k, v)) for k, v in sorted(d.items())]
    return _li(kind, head, at, facts(rows))


def _value(name: str, value: Any) -> str:
    """An event's field as text: times as UTC dates, structures as JSON."""
    if name.endswith("_at") and isinstance(value, int | float) and not isinstance(value, bool):
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(value))
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def run_page(r: dict[str, Any]) -> str:
    """The run report page for :func:`gitrun.app.run_report.run_report`'s data."""
    items = []
    for e in r["timeline"]:
        if e["kind"] == "receipt":
            items.append(_receipt(e))
        elif e["kind"] == "checkpoint":
            items.append(_checkpoint(e))
        elif e["kind"] == "resume":
            items.append(_resume(e))
        elif e["kind"] == "takeover":
            items.append(_takeover(e))
        else:
            items.append(_event(e))
    body = f'<h2>Timeline (oldest first)</h2><ol class="timeline">{"".join(items)}</ol>'
    return page(f"gitrun run {r['run_id']}: {r.get('phase', '')}", _run_header(r), body)


def batch_page(b: dict[str, Any]) -> str:
    """The SWE-bench batch page for :func:`gitrun.app.batch_report.batch_report`'s data."""
    counts = b["counts"]
    header = (
        f'<header id="verdict" class="verdict {"pass" if counts.get("resolved") else "fail"}">'
        f'<h1>SWE-bench batch {esc(b["run_id"])}</h1><p class="counts" id="counts">'
        + "".join(
            f'<span class="o-{esc(k)}" data-count="{esc(k)}">{esc(k)} <b>{esc(v)}</b></span>'
            for k, v in counts.items()
        )
        + f"</p>{facts(b.get('facts', []))}</header>"
    )
    rows = []
    for inst in b["instances"]:
        failing = inst.get("failing") or []
        fail = "".join(f"<li><code>{esc(t)}</code></li>" for t in failing)
        links = "".join(
            f'<a href="{esc(href)}">{esc(label)}</a> ' for label, href in inst.get("links", [])
        )
        rows.append(
            f'<tr data-instance="{esc(inst["id"])}"><td><code>{esc(inst["id"])}</code></td>'
            f'<td class="status o-{esc(inst["status"])}">{esc(inst["status"])}</td>'
            f"<td>{esc(inst.get('duration', ''))}</td><td>{esc(inst.get('apply', ''))}</td>"
            f'<td><ul class="failing">{fail}</ul></td><td>{links}</td></tr>'
        )
    table = (
        '<table id="instances"><tr><th>instance</th><th>status</th><th>duration</th>'
        "<th>patch applied by</th><th>failing tests</th><th>reports and logs</th></tr>"
        + "".join(rows)
        + "</table>"
    )
    body = f'<h2>Instances</h2><div style="padding:0 28px 40px">{table}</div>'
    return page(f"gitrun SWE-bench batch {b['run_id']}", header, body)
