"""Steps an outside agent's tool calls already made: each call's change to the run's
worktree recorded as ONE gated, exactly-once step (a ``tool`` action) through the same
durable path an ``exec`` step's change takes (intent checkpoint, then one receipt commit).

An outside agent (Claude Code) runs its tools itself, in the run's worktree; gitrun is
called around each call, one short process per call (a hook). Each such process opens
the run under its lease (:func:`opened_run`), reconciles it (a pending step a killed
process left is finished once, under its own key), records what it must, writes the
checkpoint its receipt rides in, and lets the lease go.

A call in progress is noted in the worktree's private git dir (:data:`CALL_FILE`) before
it runs; a change found there later without its receipt (the agent was killed mid-call)
is recorded under that call's key, once. A change no call explains (someone edited the
worktree between calls) is recorded as its own ``outside`` step before the next call.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gitrun.adapter import calllog, shell
from gitrun.adapter.agent_git import restore_run_refs
from gitrun.adapter.exec_step import Streams, ToolContext, checked_change, tree_at
from gitrun.adapter.fswatch import DirWatch
from gitrun.adapter.gate import normalise_path
from gitrun.adapter.scancache import ScanCache
from gitrun.app.opening import Options, lease_store, load_verified, open_run
from gitrun.core.codec import digest
from gitrun.core.errors import BadInput, Frozen, GateRejected
from gitrun.core.exec_policy import OutputLimits
from gitrun.core.records import (
    EXEC,
    NEEDS_REVIEW,
    RUNNING,
    TERMINAL,
    TOOL,
    Action,
    Receipt,
    RunState,
)
from gitrun.engine.jsonrpc import RpcError
from gitrun.engine.recovery import reconcile
from gitrun.engine.session import propose
from gitrun.engine.session_agent import SessionAgent
from gitrun.engine.session_rpc import KEY_PATTERN, check_key
from gitrun.store.atomicfile import replace_unsynced

if TYPE_CHECKING:
    from gitrun.engine.runtime import Runtime

CALL_FILE = "gitrun-tool-call.json"  # in the worktree's private git dir: the call under way
SCAN_CACHE_FILE = "gitrun-scan-cache.json"  # ditto: what a scan may skip (scancache.py)
OUTSIDE = "outside"  # the tool name of a change no call made
_KEY = re.compile(KEY_PATTERN + r"\Z")


@dataclass(frozen=True)
class ToolCall:
    """One tool call as gitrun records it: the key is its idempotency key."""

    tool: str
    key: str
    input_digest: str
    session: str = ""

    def action(self) -> Action:
        return Action(TOOL, description=f"{self.tool} {self.key}", tool=self.tool,
                      tool_input=self.input_digest)  # fmt: skip

    def trailers(self) -> list[str]:
        out = [f"Gitrun-Tool: {self.tool}"]
        if self.session:
            out.append(f"Gitrun-Session: {self.session}")
        return out


def call_key(raw: object) -> str:
    """A tool call id as an idempotency key: itself when it has gitrun's key syntax, else
    a digest of it (so any id the agent sends names one key, and nothing else)."""
    if isinstance(raw, str) and _KEY.match(raw) and ".." not in raw and not raw.endswith(".lock"):
        return raw
    text = json.dumps(raw, sort_keys=True)
    return "call-" + digest({"id": text}).removeprefix("sha256:")[:40]


def input_digest(tool_input: object) -> str:
    """The intent digest of a tool call's input (canonical JSON)."""
    return digest({"tool_input": tool_input})


@dataclass
class ToolRun:
    """A run opened for one hook: its runtime and the session whose steps it drives."""

    rt: Runtime
    agent: SessionAgent
    cache: ScanCache
    restored: tuple[str, ...] = ()  # what the agent's own git moved and this hook put back

    @property
    def state(self) -> RunState:
        return self.rt.state

    @property
    def worktree(self) -> Path:
        return self.rt.env.worktree

    def running(self) -> bool:
        return self.rt.state.phase not in TERMINAL and self.rt.state.phase != NEEDS_REVIEW

    # -- the call under way --------------------------------------------------------------

    def _call_path(self) -> Path:
        return Path(self.rt.env.wt.path) / CALL_FILE

    def note_call(self, call: ToolCall) -> None:
        """Say which call is about to change the worktree (not durable: a lost note only
        makes a killed call's change an ``outside`` step)."""
        data = {"tool": call.tool, "key": call.key, "input": call.input_digest,
                "session": call.session}  # fmt: skip
        replace_unsynced(self._call_path(), json.dumps(data).encode())

    def noted_call(self) -> ToolCall | None:
        try:
            data = json.loads(self._call_path().read_text())
            call = ToolCall(str(data["tool"]), check_key(data["key"]) or "", str(data["input"]),
                            str(data.get("session", "")))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError, RpcError):
            return None  # no note, or one a process never finished writing: no claim
        return call if call.key else None

    def forget_call(self) -> None:
        with suppress(FileNotFoundError):
            os.unlink(self._call_path())

    # -- looking ---------------------------------------------------------------------------

    def changes(
        self, *, write: bool = False, fix_modes: bool = False
    ) -> dict[str, shell.Entry | None]:
        """What the worktree holds beyond HEAD (stored too with ``write``: then every new
        directory is entered and the policy's output limits hold, as for an exec step)."""
        policy = self.rt.gate.policy.exec
        limits = policy.limits if policy is not None else OutputLimits()
        return shell.scan(
            self.rt.env.repo, self.worktree, tree_at(self.rt.env, self.rt.state.env.tree),
            write=write, limits=limits, fix_modes=fix_modes, cache=self.cache,
        )  # fmt: skip

    def check_changes(self, changes: dict[str, shell.Entry | None]) -> None:
        """Refuse (GateRejected, nothing changed) a change the path or name rules do not
        allow, or one git cannot hold."""
        rt = self.rt
        checked_change(rt.env, rt.gate, tree_at(rt.env, rt.state.env.tree), changes)

    # -- gating a call before it runs ------------------------------------------------------

    def check_paths(self, paths: list[str]) -> None:
        """An edit tool's paths (relative to the worktree) against the path rules."""
        tree = tree_at(self.rt.env, self.rt.state.env.tree)
        for raw in paths:
            self.rt.gate.check_path(normalise_path(raw), tree)

    def check_command(self, command: str) -> None:
        """A shell command against the policy's ``[policy.exec]`` allow and deny."""
        action = Action(EXEC, command=command)
        self.rt.gate.check_action(
            action, tree_at(self.rt.env, self.rt.state.env.tree), on_disk=False
        )

    # -- recording -------------------------------------------------------------------------

    def record(self, call: ToolCall, observed: Streams | None) -> Receipt | str:
        """The worktree's whole change since the last step as ONE step under the call's
        key (a change the gate refuses: the worktree is put back and GateRejected); a
        call that changed nothing is a record on the run's call log instead (its commit
        id returned), never a commit on the branch. Either is made once per key."""
        streams = Streams(
            observed.stdout if observed else b"",
            observed.stderr if observed else b"",
            [*(observed.trailers if observed else []), *call.trailers()],
        )
        last = self.rt.state.receipts.last  # a helper killed after its commit: replayed
        found = last if last is not None and last.key == call.key else None
        found = found or self.rt.env.lookup(call.key, since=self.rt.state.env.head)
        if found is not None and found.intent_digest == call.action().intent_digest():
            return found
        logged = calllog.find(self.rt.env, call.key)
        if logged is not None:
            return logged
        if self.running() and not self._changed():
            return self._log_unchanged(call, streams)
        self.rt.tool = ToolContext(self.rt.gate, streams, self.cache)
        try:
            return self._step(call.action(), call.key)
        finally:
            self.rt.tool = ToolContext(self.rt.gate, None, self.cache)

    def _changed(self) -> bool:
        """Whether the worktree differs from HEAD, looked at as the step's commit will
        (so that a resident helper's scan cache answers that scan without a walk); a
        change the rules refuse counts: the step refuses it and puts the worktree back."""
        try:
            return bool(self.changes(write=True, fix_modes=True))
        except GateRejected:
            return True

    def _log_unchanged(self, call: ToolCall, streams: Streams) -> str:
        """The record of a call that changed nothing, on the call log (adapter/calllog.py)."""
        action = call.action()
        pairs = [
            ("Gitrun-Action", TOOL),
            ("Gitrun-Idempotency-Key", call.key),
            ("Gitrun-Intent-Digest", action.intent_digest()),
        ]
        for line in streams.trailers:
            name, _, value = line.partition(": ")
            pairs.append((name, value))
        subject = f"gitrun: {call.tool} (no change)"
        return calllog.append(self.rt.env, subject, pairs, streams.stdout, streams.stderr)

    def _step(self, action: Action, key: str) -> Receipt:
        """One gated step under ``key`` (its receipt again when the key is recorded with
        this intent; another intent under it opens a review), as a session's write."""
        rt = self.rt
        if rt.state.phase != RUNNING:
            raise GateRejected("run-ended", f"run {rt.state.run_id} is {rt.state.phase}")
        found = rt.env.lookup(key, since=rt.state.env.head)  # the index ref, or nothing new
        if found is not None and found.intent_digest == action.intent_digest():
            return found
        checked = rt.gate.check_action(action, tree_at(self.rt.env, self.rt.state.env.tree))
        propose(rt, self.agent, checked, key)
        rt.execute_pending()
        s = rt.state
        if s.phase == NEEDS_REVIEW:
            raise Frozen(f"key {key} was already used for another intent: {rt.frozen_message()}")
        last = s.receipts.last
        if s.pending is not None or last is None or last.key != key:
            raise rt.abandoned or GateRejected("refused", f"the step {key} was abandoned")
        return last

    def sweep(self, current: str | None = None) -> Receipt | str | None:
        """Record what the worktree holds beyond HEAD before anything else: the change of
        a call that was killed (under its noted key, once) or one no call made (an
        ``outside`` step). A change the rules refuse is not discarded here (it may be the
        user's own work): the caller refuses to go on, naming it."""
        noted = self.noted_call()
        changes = self.changes(write=True)
        if not changes:
            if noted is not None and noted.key != current:
                self.forget_call()
            return None
        self.check_changes(changes)
        if noted is not None and noted.key != current and self.rt.env.lookup(noted.key) is None:
            call = noted
        else:
            call = ToolCall(OUTSIDE, f"outside-{uuid.uuid4().hex[:20]}", "", "")
        receipt = self.record(call, None)
        if call is noted:
            self.forget_call()
        return receipt


def scan_cache_path(rt: Runtime) -> Path:
    return Path(rt.env.wt.path) / SCAN_CACHE_FILE


@dataclass
class Resident:
    """What a long-lived hook helper keeps between calls: the worktree's scan cache in
    memory, with a watch that spares the walk when nothing changed (adapter/fswatch.py)."""

    cache: ScanCache | None = None

    def cache_for(self, rt: Runtime) -> ScanCache:
        if self.cache is None:
            cache = ScanCache.load(scan_cache_path(rt))
            cache.watch = DirWatch.start(rt.env.worktree)
            self.cache = cache
        return self.cache

    def forget(self) -> None:
        """Drop what is kept (after a call that failed in a way not foreseen)."""
        self.close()
        self.cache = None

    def close(self) -> None:
        if self.cache is not None:
            self.cache.save()
            if isinstance(self.cache.watch, DirWatch):
                self.cache.watch.close()


@contextmanager
def opened_run(run_id: str, opts: Options, warm: Resident | None = None) -> Iterator[ToolRun]:
    """The run under its lease, reconciled (a pending step finished once, its files left
    as they are: they are the next step's); on the way out the receipt that rides is
    checkpointed and the lease let go. ``warm``: a resident process's scan cache and
    watch, kept between calls (else the worktree's cache file is read and written)."""
    from gitrun.app.service import build_runtime
    from gitrun.engine.agents import load_agent

    opened = open_run(run_id, opts)
    agent, _ = load_agent(opened.record.agent, opened.task)
    if not isinstance(agent, SessionAgent) or agent.spec != "claude":
        raise BadInput(
            f"run {run_id} is driven by --agent {opened.record.agent}, not by Claude Code; "
            "start one with: gitrun claude"
        )
    lease = lease_store(opened.repo, run_id, opts, opened.site)
    _, stored = load_verified(opened)
    lease.acquire(stored.state.generation, opts.takeover_after)
    try:
        ref, stored = load_verified(opened)  # the previous owner may have moved on
        rt = build_runtime(opened, ref, stored, lease, agent, opts)
        restored: list[str] = []
        if rt.state.phase == RUNNING and rt.state.pending is None and rt.env.site is None:
            # no step under way: a move of HEAD or the branch is the agent's own git's
            restored = restore_run_refs(rt.env, rt.state.env.head, lease.fence)
        if rt.state.phase not in TERMINAL and rt.state.phase != NEEDS_REVIEW:
            reconcile(rt, dirty_ok=True)
        cache = warm.cache_for(rt) if warm is not None else ScanCache.load(scan_cache_path(rt))
        rt.tool = ToolContext(rt.gate, None, cache)
        if rt.state.phase == RUNNING and rt.state.pending is not None:
            rt.execute_pending()  # a pending step a killed hook left: recorded once, its key
        yield ToolRun(rt, agent, cache, tuple(restored))
        if warm is None:
            cache.save()
        else:
            cache.settle()
        rt.pause()  # the receipt riding becomes the checkpoint
    finally:
        lease.release()


def result_json(receipt: Receipt) -> dict[str, Any]:
    return {"commit": receipt.commit, "key": receipt.key, "paths": list(receipt.paths)}
