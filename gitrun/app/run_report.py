"""What ``gitrun report RUN --html FILE`` shows, read from git: the run as a timeline.

The verified checkpoint chain (oldest first) gives the events (each proposal, gate
refusal, approval, review decision, verifier verdict, freeze, start and resume); the
run's branch gives each receipt's commit, its diff and an exec step's output; each
checkpoint's two signatures are checked (the HMAC with the keyring, the SSH signature
with the keyring's public halves). Everything here is plain data for
:mod:`gitrun.app.report_html`, which escapes all of it.
"""

from __future__ import annotations

import time
from typing import Any

from gitrun.adapter.exec_step import output_of
from gitrun.adapter.show import commit_diff
from gitrun.app.opening import Opened, Options, load_verified, open_run
from gitrun.core.codec import encode
from gitrun.core.errors import CheckpointRejected
from gitrun.core.records import LEASE_TAKEOVER, Event, Receipt, RunState
from gitrun.store import sshsig
from gitrun.store.checkpoint import Stored

__all__ = ["run_report"]


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _receipt_entry(opened: Opened, receipt: Receipt, actions: dict[str, Any]) -> dict[str, Any]:
    """A receipt with what a person checks: commit, message, diff, exec command/output."""
    repo = opened.repo
    commit = repo.get(receipt.commit)
    entry: dict[str, Any] = {
        "kind": "receipt",
        "commit": receipt.commit,
        "key": receipt.key,
        "action": receipt.action,
        "paths": list(receipt.paths),
        "approval": receipt.approval,
        "lease": receipt.lease,
        "message": str(getattr(commit, "message", "")),  # a Commit (None: not in the repo)
        "diff": commit_diff(repo, receipt.commit),
        "at": _when(receipt.committed_at),
    }
    action = actions.get(receipt.key)
    if action is not None and action.get("kind") == "exec":
        entry["command"] = action.get("command") or " ".join(action.get("argv") or [])
    if receipt.action == "exec":
        entry["exit_code"] = "timeout/killed" if receipt.exit_code is None else receipt.exit_code
        streams = output_of(repo, receipt)
        stdout, stderr = streams if streams is not None else (b"", b"")
        entry["stdout"], entry["stderr"] = _text(stdout), _text(stderr)
    return entry


def _checkpoint_entry(stored: Stored, ssh: str) -> dict[str, Any]:
    s = stored.state
    return {
        "kind": "checkpoint",
        "generation": s.generation,
        "phase": s.phase,
        "stop_reason": s.stop_reason or "",
        "worker": s.identity,
        "lease": s.lease_version,
        "commit": str(stored.oid),
        "key_id": stored.key_id,
        "ssh": ssh,
        "at": _when(s.updated_at),
    }


def _resume_entry(s: RunState, prev: RunState) -> dict[str, Any] | None:
    """A new lease: another process carried on from ``prev``; after a checkpoint still
    "running", that process was interrupted (killed or crashed: a takeover from a worker
    still at work is recorded as one, :func:`_takeover_entry`)."""
    if s.lease_version == prev.lease_version:
        return None
    return {
        "kind": "resume",
        "at": _when(prev.updated_at),
        "worker": s.identity,
        "lease": s.lease_version,
        "from_worker": prev.identity,
        "from_lease": prev.lease_version,
        "previous_phase": prev.phase,
        "interrupted": prev.phase == "running",
    }


def _takeover_entry(ev: Event, prev: RunState | None) -> dict[str, Any]:
    """The lease taken from a worker still at work on the run (stopped, hung, out of
    reach): who held it under which lease, who took it, and how."""
    d = ev.data if isinstance(ev.data, dict) else {}
    return {
        "kind": "takeover",
        "at": _when(ev.at),
        "worker": str(d.get("worker", "")),
        "lease": d.get("lease", ""),
        "from_worker": str(d.get("from_worker", "")),
        "from_lease": d.get("from_lease", ""),
        "how": str(d.get("how", "")),
        "from_renewed_at": _maybe_when(d.get("from_renewed_at")),
        "from_expires_at": _maybe_when(d.get("from_expires_at")),
        "previous_phase": prev.phase if prev is not None else "",
    }


def _maybe_when(at: object) -> str:
    if isinstance(at, int | float) and not isinstance(at, bool):
        return _when(float(at))
    return "-"


def _event_entry(kind: str, at: float, data: Any) -> dict[str, Any]:
    return {"kind": kind, "at": _when(at), "data": data if isinstance(data, dict) else {}}


def _ssh_status(opened: Opened, keys: list[sshsig.SshKey], oid: str) -> str:
    found = sshsig.commit_signature(opened.repo, oid, keys)
    return found.fingerprint if found is not None else ""


def run_report(run_id: str, opts: Options) -> dict[str, Any]:
    """The whole run for the HTML report: verdict, chain verification, timeline."""
    opened = open_run(run_id, opts)
    receipts = opened.env.receipts()  # read from git: shown even when the chain fails
    report: dict[str, Any] = {
        "run_id": run_id,
        "task": f"{opened.task.id}@{opened.task.version}",
        "title": opened.task.title,
        "repo": opened.record.repo,
        "branch": opened.record.branch.removeprefix("refs/heads/"),
        "generated_at": _when(time.time()),
    }
    try:
        ref, stored = load_verified(opened, check_scenario=False)
        chain = list(reversed(opened.store.chain(ref)))
    except CheckpointRejected as exc:
        report |= {"verified": False, "chain_error": str(exc), "phase": "unknown"}
        actions: dict[str, Any] = {}
        report["timeline"] = [_receipt_entry(opened, r, actions) for r in receipts]
        report["verifier"] = None
        return report
    keyring = opened.store.keyring
    keys = [sshsig.public_key(keyring, k) for k in keyring.key_ids()]
    state = stored.state
    report |= {
        "verified": True,
        "chain_error": "",
        "checkpoint_ref": ref,
        "phase": state.phase,
        "stop_reason": state.stop_reason or "",
        "generation": state.generation,
        "head": state.env.head,
        "base": state.env.base_commit,
        "receipt_count": len(receipts),
        "verifier": encode(state.verifier) if state.verifier is not None else None,
    }
    ssh = {str(c.oid): _ssh_status(opened, keys, str(c.oid)) for c in chain}
    report["checkpoints"] = len(chain)
    report["ssh_good"] = sum(1 for v in ssh.values() if v)
    report["timeline"] = _timeline(opened, chain, receipts, ssh)
    return report


def _timeline(
    opened: Opened, chain: list[Stored], receipts: list[Receipt], ssh: dict[str, str]
) -> list[dict[str, Any]]:
    """Each checkpoint after the events it recorded, oldest first; each receipt placed at
    its event; a resume (or a takeover) marked where a new lease begins."""
    by_commit = {r.commit: r for r in receipts}
    actions: dict[str, Any] = {}
    out: list[dict[str, Any]] = []
    prev: RunState | None = None
    shown: set[str] = set()
    for stored in chain:
        s = stored.state
        if s.pending is not None:
            actions[s.pending.key] = encode(s.pending.action)
        takeover = next((ev for ev in s.events if ev.kind == LEASE_TAKEOVER), None)
        resumed = _resume_entry(s, prev) if prev is not None else None
        if takeover is not None:  # a new lease, taken from a worker still at work
            out.append(_takeover_entry(takeover, prev))
        elif resumed is not None:
            out.append(resumed)
        for ev in s.events:  # what happened since the previous checkpoint, then it
            if ev.kind == LEASE_TAKEOVER:
                continue
            if ev.kind == "receipt":
                commit = str(ev.data.get("receipt", {}).get("commit", ""))
                found = by_commit.get(commit)
                if found is not None and commit not in shown:
                    shown.add(commit)
                    entry = _receipt_entry(opened, found, actions)
                    entry["replayed"] = bool(ev.data.get("replayed"))
                    out.append(entry)
                    continue
            out.append(_event_entry(ev.kind, ev.at, ev.data))
        out.append(_checkpoint_entry(stored, ssh[str(stored.oid)]))
        prev = s
    for r in receipts:  # written after the last checkpoint: not yet recorded by one
        if r.commit not in shown:
            entry = _receipt_entry(opened, r, actions)
            entry["unrecorded"] = True
            out.append(entry)
    return out
