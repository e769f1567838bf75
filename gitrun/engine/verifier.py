"""Run a task's test command in a worktree and judge FAIL_TO_PASS / PASS_TO_PASS.

The verdict follows the SWE-bench harness: the run passes when every FAIL_TO_PASS and
every PASS_TO_PASS test passes (an expected failure, ``xfail``, counts as passing, as it
does there). Per-test outcomes come from gitrun's own pytest plugin, streamed over an
inherited socket as pytest reports each test (:class:`_Channel`,
:mod:`gitrun.core.outcome_stream`), never from scraping the console; the JUnit XML report
(pytest's ``xunit1`` family) must agree with the stream byte for byte and test for test,
or the run fails as ``verdict-tampered``. Plugin autoload is off
(``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``): only the plugins a command names with ``-p`` load.

Tests are matched by the ``(classname, name)`` pair pytest derives from a node id, not
by rebuilding ``file::name``: a test method inherited from a base class in another
module carries the *base* module in ``file``, while ``classname`` always follows the
node id.

The runtime verifies a fresh materialisation of HEAD's tree (:func:`verify_tree`), never
the worktree, so nothing git does not show can change the verdict. The child runs
without a shell, under :mod:`gitrun.adapter.sandbox`'s supervisor (its whole process tree dies
with gitrun) and, where the isolation setting gives one, inside bubblewrap; it gets no
``GITRUN_*`` variable, its output goes to a file outside the tree it tests, and bytecode
writing is disabled. A caller that wants the command's whole output (bounded, e.g. for a
SWE-bench ``test_output.txt``) names a ``keep_log`` file, written once the child is gone.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import select
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gitrun.adapter import sandbox
from gitrun.adapter.gittypes import Repository
from gitrun.adapter.materialise import materialise, scratch
from gitrun.adapter.sandbox import (
    UNCONFINED,
    CommandCannotStart,
    Confinement,
    Layout,
    SandboxFailed,
)
from gitrun.adapter.scratch import private as private_scratch
from gitrun.core.errors import BadInput
from gitrun.core.junit import (
    ERROR,
    FAILED,
    MISSING,
    PASSED,
    UnusableReport,
    junit_key,
    parse_junit,
    report_bytes,
)
from gitrun.core.junit import SKIPPED as SKIPPED  # noqa: PLC0414 - re-export, like its siblings
from gitrun.core.outcome_stream import MAX_STREAM_BYTES, TAMPERED, Tampered, read_stream
from gitrun.core.verifier_spec import VerifierResult as VerifierResult  # noqa: PLC0414 - re-export
from gitrun.core.verifier_spec import VerifierSpec as VerifierSpec  # noqa: PLC0414 - re-export
from gitrun.core.verifier_spec import positive_number
from gitrun.store.atomicfile import atomic_write, replace_unsynced

_SCRUBBED_PREFIX = "GITRUN_"  # no variable of gitrun's (home, key file, fault injection)
_POLL_SECONDS = 0.05
_TAIL_LINES = 40
_TAIL_BYTES = 16 * 1024
_LISTED_IDS = 3
KEPT_LOG_BYTES = 1024 * 1024  # the most of a command's output ``keep_log`` keeps (its end)
PLUGIN = "gitrun_verdict"  # gitrun's pytest plugin, as the test command imports it
PLUGIN_ENV = "PYTEST_GITRUN_VERDICT"  # the descriptor of its end of the outcome channel


@dataclass(frozen=True)
class _Run:
    exit_code: int | None
    timed_out: bool
    duration_seconds: float
    started: bool = True
    cannot_start: str = ""  # why the command could not be executed


class _Ticker:
    """Calls heartbeat and progress every ``interval`` seconds of elapsed time."""

    def __init__(
        self,
        heartbeat: Callable[[], None] | None,
        progress: Callable[[str], None] | None,
        interval: float,
    ) -> None:
        self._heartbeat = heartbeat
        self._progress = progress
        self._interval = interval
        self._next_at = interval

    def tick_if_due(self, elapsed: float) -> None:
        if elapsed < self._next_at:
            return
        self._next_at = elapsed + self._interval
        if self._heartbeat is not None:
            self._heartbeat()
        if self._progress is not None:
            self._progress(f"verifier: running {int(elapsed)}s")


@dataclass(frozen=True)
class Secrets:
    """What the code under test must not see: directories and files to hide."""

    dirs: tuple[Path, ...] = ()
    files: tuple[Path, ...] = ()


def verify_tree(
    spec: VerifierSpec,
    repo: Repository,
    tree_id: str,
    *,
    confinement: Confinement,
    secrets: Secrets,
    **hooks: Any,
) -> tuple[VerifierResult, str]:
    """Judge the tree ``tree_id`` in a fresh materialisation of it; also its oid as written.

    The scratch directory lies outside every secret (the workspace, the common git dir),
    holds only the tree, and is removed afterwards. ``hooks`` go to :func:`run_verifier`.
    """
    with scratch(secrets.dirs) as tmp:
        tree_dir = tmp / "tree"
        made = materialise(repo, tree_id, tree_dir)
        result = run_verifier(spec, tree_dir, confinement=confinement, secrets=secrets, **hooks)
    return result, made


def run_verifier(
    spec: VerifierSpec,
    workdir: Path,
    *,
    heartbeat: Callable[[], None] | None = None,
    progress: Callable[[str], None] | None = None,
    heartbeat_interval: float = 1.0,
    confinement: Confinement = UNCONFINED,
    secrets: Secrets | None = None,
    keep_log: Path | None = None,
) -> VerifierResult:
    """Run ``spec.command`` in ``workdir`` and judge the required tests.

    ``heartbeat`` is called every ``heartbeat_interval`` seconds (the runtime renews its
    lease there); if it raises, the child's process tree is killed and the error
    propagates. A command that cannot start raises :class:`CommandCannotStart`; a
    sandbox bubblewrap cannot build raises :class:`SandboxFailed`. With ``keep_log``, the
    command's output (stdout and stderr, its last :data:`KEPT_LOG_BYTES`) is copied there.
    """
    if not workdir.is_dir():
        raise BadInput(f"verifier workdir {workdir} is not a directory")
    if not positive_number(heartbeat_interval):
        raise BadInput(f"heartbeat_interval must be positive, not {heartbeat_interval!r}")
    ticker = _Ticker(heartbeat, progress, heartbeat_interval)
    hide = secrets or Secrets()
    workdir = workdir.resolve()
    with private_scratch("gitrun-verifier-") as out:  # no other run's sandbox shows it
        report = out / "junit.xml"
        with _Channel(out if spec.junit else None) as channel:
            run, tail = _run_command(spec, workdir, out, ticker, confinement, hide, channel)
        if keep_log is not None:
            _keep(out / "output.log", keep_log)
        _refuse_unstarted(spec, run, confinement, tail)
        outcomes, summary = _verdict(spec, run, report, channel)
        if spec.junit and not report.exists() and not channel.data and tail.strip():
            # e.g. "No module named pytest": the one line that tells the user what to do
            summary += f" (the command said: {tail.strip().splitlines()[-1][:200]})"
    return _result(spec, run, outcomes, summary, tail)


class _Channel:
    """The socket gitrun's pytest plugin streams outcomes to (:mod:`gitrun.core.outcome_stream`).

    One end is handed to the test command (its number in :data:`PLUGIN_ENV`), after a
    random token and a newline were written to it; gitrun keeps the other and reads it
    while the command runs, so a full socket never blocks the tests. The plugin's source
    is copied into ``out/plugin`` (shown read-only inside the sandbox) and named with
    ``-p``; plugin autoload is off for every verifier command.
    """

    def __init__(self, out: Path | None) -> None:
        self.active = out is not None
        self.token = secrets.token_hex(16)
        self.data = bytearray()
        self.overflow = False
        self.plugin_dir = out / "plugin" if out is not None else None
        self.ours = self.theirs = -1

    def __enter__(self) -> _Channel:
        if self.plugin_dir is None:
            return self
        self.plugin_dir.mkdir(mode=0o755)
        source = Path(__file__).with_name("verdict_plugin.py").read_bytes()
        replace_unsynced(self.plugin_dir / f"{PLUGIN}.py", source, mode=0o444)  # scratch
        (self.plugin_dir / f"{PLUGIN}.py").chmod(0o444)
        self.plugin_dir.chmod(0o555)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.ours, self.theirs = ours.detach(), theirs.detach()
        os.write(self.ours, self.token.encode() + b"\n")
        os.set_blocking(self.ours, False)
        return self

    def started(self) -> None:
        """The command has its copy: ours of its end goes (so its end reads as EOF)."""
        if self.theirs >= 0:
            os.close(self.theirs)
            self.theirs = -1

    def drain(self) -> None:
        """Read whatever the plugin has sent so far, without blocking."""
        while self.ours >= 0:
            try:
                chunk = os.read(self.ours, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                os.close(self.ours)
                self.ours = -1
                return
            if len(self.data) + len(chunk) > MAX_STREAM_BYTES:
                self.overflow = True
            else:
                self.data += chunk

    def wait(self, seconds: float) -> None:
        """Sleep up to ``seconds``, waking to read as soon as the plugin writes."""
        if self.ours < 0:
            time.sleep(seconds)
            return
        if select.select([self.ours], [], [], seconds)[0]:
            self.drain()

    def __exit__(self, *exc: object) -> None:
        self.started()
        self.drain()
        if self.ours >= 0:
            os.close(self.ours)
            self.ours = -1
        if self.plugin_dir is not None and self.plugin_dir.is_dir():
            self.plugin_dir.chmod(0o755)  # so the scratch directory can be removed


def _run_command(
    spec: VerifierSpec,
    workdir: Path,
    out: Path,
    ticker: _Ticker,
    confinement: Confinement,
    hide: Secrets,
    channel: _Channel,
) -> tuple[_Run, str]:
    """Run the command under the supervisor, its report and log in ``out`` (outside the
    tree it tests): how it ended and the tail of what it printed."""
    if out.is_relative_to(workdir):
        raise BadInput(f"temporary directory {out} lies inside the worktree {workdir}")
    report = out / "junit.xml"
    blank = out / "blank"
    blank.touch(0o444)
    shown = [] if channel.plugin_dir is None else [channel.plugin_dir]
    layout = Layout.of([workdir, out], hide.dirs, hide.files, workdir, blank, shown=shown)
    env = _child_env(confinement, hide.files)
    if channel.plugin_dir is not None:
        env[PLUGIN_ENV] = str(channel.theirs)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(channel.plugin_dir), env.get("PYTHONPATH", "")) if p
        )
    with (out / "output.log").open("w+b") as log:
        child = sandbox.spawn(
            _argv(spec, report), cwd=workdir, env=env, log=log, confinement=confinement,
            layout=layout, give=() if channel.theirs < 0 else (channel.theirs,),
        )  # fmt: skip
        channel.started()
        run = _supervise(child, spec.timeout_seconds, ticker, channel)
        return run, _tail(log)


def _result(
    spec: VerifierSpec, run: _Run, outcomes: dict[str, str], summary: str, tail: str
) -> VerifierResult:
    """The verdict: passed only in time, with every required test passing (and, for a
    coarse verifier without a report, the command exiting 0)."""
    passed = (
        not run.timed_out
        and (spec.junit or run.exit_code == 0)
        and all(outcome == PASSED for outcome in outcomes.values())
    )
    return VerifierResult(
        passed=passed,
        outcomes=outcomes,
        exit_code=run.exit_code,
        timed_out=run.timed_out,
        duration_seconds=run.duration_seconds,
        summary=summary,
        output_tail=tail,
    )


def _refuse_unstarted(spec: VerifierSpec, run: _Run, confinement: Confinement, tail: str) -> None:
    if run.cannot_start:
        raise CommandCannotStart(
            f"verifier command {spec.command[0]!r} cannot start: {run.cannot_start}"
        )
    if not run.started and not run.timed_out:
        said = tail.strip().splitlines()[-1][:200] if tail.strip() else "no output"
        where = "bubblewrap could not set up the sandbox" if confinement.confined else "failed"
        raise SandboxFailed(f"the verifier's supervisor {where}: {said}")


def _argv(spec: VerifierSpec, report: Path) -> list[str]:
    argv = [part.replace("{python}", sys.executable) for part in spec.command]
    if spec.junit:
        # no:cacheprovider keeps pytest from writing .pytest_cache into the worktree
        argv += [f"--junitxml={report}", "-o", "junit_family=xunit1", "-p", "no:cacheprovider",
                 "-p", PLUGIN]  # fmt: skip
    return argv


def _child_env(confinement: Confinement, secret_files: tuple[Path, ...]) -> dict[str, str]:
    """The caller's environment without any ``GITRUN_*`` variable or one naming a secret."""
    named = {str(f) for f in secret_files} | {str(f.resolve()) for f in secret_files}
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(_SCRUBBED_PREFIX) and not any(n in value for n in named)
    }
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # no plugin found by entry point (a *.dist-info the tree plants, or anything else
    # installed): only the plugins the command names with -p, and gitrun's own
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    if confinement.confined:
        env["TMPDIR"] = "/tmp"  # noqa: S108 - the sandbox's own private tmpfs
    return env


def _supervise(
    child: sandbox.Supervised, timeout: float, ticker: _Ticker, channel: _Channel
) -> _Run:
    start = time.monotonic()
    try:
        timed_out = _wait(child, start, timeout, ticker, channel)
    finally:
        child.stop()
    duration = time.monotonic() - start
    started, code, why = child.outcome()
    return _Run(None if timed_out else code, timed_out, duration, started, why)


def _wait(
    child: sandbox.Supervised, start: float, timeout: float, ticker: _Ticker, channel: _Channel
) -> bool:
    """Poll until the child exits (False) or the timeout passes (True), reading the
    outcome stream meanwhile."""
    while not child.exited():
        elapsed = time.monotonic() - start
        if elapsed >= timeout:
            return True
        ticker.tick_if_due(elapsed)
        channel.wait(_POLL_SECONDS)
    return False


def _tail(log: IO[bytes]) -> str:
    size = os.fstat(log.fileno()).st_size
    log.seek(max(0, size - _TAIL_BYTES))
    lines = log.read().decode("utf-8", "replace").splitlines()
    return "\n".join(lines[-_TAIL_LINES:])


def _keep(log: Path, target: Path) -> None:
    """Copy the end of ``log`` to ``target`` atomically, saying so when its start is cut."""
    with log.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        fh.seek(max(0, size - KEPT_LOG_BYTES))
        data = fh.read()
    if size > len(data):
        cut = size - len(data)
        data = f"[gitrun: output truncated: the first {cut} bytes are not kept]\n".encode() + data
    atomic_write(target, data, parent_mode=0o755)


def _verdict(
    spec: VerifierSpec, run: _Run, report: Path, channel: _Channel
) -> tuple[dict[str, str], str]:
    required = spec.required
    if run.timed_out:
        summary = f"timed out after {spec.timeout_seconds:g}s; required tests not judged"
        return dict.fromkeys(required, ERROR), summary
    if not spec.junit:
        outcome = PASSED if run.exit_code == 0 else FAILED
        summary = f"command exited {run.exit_code} (coarse verdict: no per-test report)"
        return dict.fromkeys(required, outcome), summary
    if channel.overflow:
        return dict.fromkeys(required, ERROR), (
            f"verifier error: the outcome stream passed {MAX_STREAM_BYTES} bytes"
        )
    try:
        outcomes = _streamed(required, report, channel)
    except Tampered as exc:
        return dict.fromkeys(required, ERROR), f"{TAMPERED}: {exc}"
    except UnusableReport as exc:
        return dict.fromkeys(required, ERROR), f"verifier error: {exc}"
    return outcomes, _summary(spec, outcomes)


def _streamed(required: tuple[str, ...], report: Path, channel: _Channel) -> dict[str, str]:
    """Each required test's outcome from the stream, once the JUnit report agrees with it
    byte for byte (the digest the plugin sent) and test for test; else :class:`Tampered`
    (or :class:`UnusableReport` when pytest never reported anything)."""
    stream = read_stream(bytes(channel.data), channel.token)
    data = report_bytes(report)
    if not stream.began:
        if data is not None:
            raise Tampered("a JUnit report was written but pytest streamed no outcome")
        raise UnusableReport("no JUnit report was written")
    if not stream.ended:
        raise UnusableReport(
            "the outcome stream stopped before pytest's end record (the test session died, "
            "or the code under test closed its channel)"
        )
    if data is None or stream.junit_sha256 is None:
        raise Tampered("pytest finished, but its JUnit report is gone")
    if hashlib.sha256(data).hexdigest() != stream.junit_sha256:
        raise Tampered("the JUnit report was changed after pytest wrote it")
    cases = parse_junit(data)
    outcomes = {node: stream.cases.get(junit_key(node), MISSING) for node in required}
    for node, outcome in outcomes.items():
        if cases.get(junit_key(node), MISSING) != outcome:
            raise Tampered(f"{node}: the JUnit report and the outcome stream disagree")
    return outcomes


def _summary(spec: VerifierSpec, outcomes: Mapping[str, str]) -> str:
    still = [node for node in spec.fail_to_pass if outcomes[node] != PASSED]
    regressed = [node for node in spec.pass_to_pass if outcomes[node] != PASSED]
    if not still and not regressed:
        return f"{len(outcomes)}/{len(outcomes)} required tests passed"
    parts = []
    if still:
        parts.append("FAIL_TO_PASS still failing: " + _listing(still, outcomes))
    if regressed:
        parts.append("PASS_TO_PASS regressed: " + _listing(regressed, outcomes))
    return "; ".join(parts)


def _listing(nodes: list[str], outcomes: Mapping[str, str]) -> str:
    shown = [n if outcomes[n] == FAILED else f"{n} ({outcomes[n]})" for n in nodes[:_LISTED_IDS]]
    more = len(nodes) - _LISTED_IDS
    return ", ".join(shown) + (f" (+{more} more)" if more > 0 else "")
