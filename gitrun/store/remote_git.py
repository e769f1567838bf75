"""The transport of the remote store: hermetic ``git fetch`` / ``git push --atomic`` runs.

A :class:`Remote` names a shared git remote (any URL git speaks: ``git://``, ``ssh://``,
``https://``, a path) and the local repository whose refs cache it. Its two calls are
the only network operations of gitrun:

- :meth:`Remote.fetch` copies refs with *explicit* refspecs (``refs/gitrun/*`` is not
  fetched by default) and prunes what the remote no longer has: local refs are a cache;
- :meth:`Remote.push` is the commit point: ONE ``git push --atomic --porcelain`` with
  ``--force-with-lease=<ref>:<expected>`` for every ref it moves (empty expected: the ref
  must not exist). Either every ref moves on the server or none does; a rejection is a
  lost compare-and-swap, returned as :class:`Rejected` for the caller to re-read and decide.

Anything else (no route, refused connection, timeout, an unknown repository, the server
refusing the namespace for good) raises :class:`~gitrun.core.errors.RemoteUnavailable`
naming the URL: fail closed, never a silent fallback to the local refs.

Git runs hermetically: no system or global config, no hooks, no terminal prompt, only
the file, git, ssh and https transports, a timeout on every call. Secrets never ride on a
command line: credentials come from the user's ssh agent (``SSH_AUTH_SOCK``) or an
``GIT_ASKPASS`` program they set, both passed through from the environment.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gitrun.core.errors import BadInput, Refused, RemoteUnavailable
from gitrun.store.durable import STAGE_DIR

ZERO = "0" * 40
DEFAULT_TIMEOUT = 30.0  # seconds per git call; GITRUN_REMOTE_TIMEOUT overrides
_PASS_THROUGH = ("PATH", "HOME", "SSH_AUTH_SOCK", "GIT_ASKPASS", "SSH_ASKPASS", "TMPDIR")
_CONFIG = (
    "core.hooksPath=/dev/null",  # no hook of the (agent-writable) repository runs
    "credential.helper=",  # nor a credential helper the repository's config names
    "protocol.allow=never",  # ext:: and friends run commands: only plain transports
    "protocol.file.allow=always",
    "protocol.git.allow=always",
    "protocol.ssh.allow=always",
    "protocol.https.allow=always",
    "protocol.version=2",
    "fetch.unpackLimit=1000000",  # keep fetched objects loose, like everything gitrun writes
    "gc.auto=0",
    "maintenance.auto=false",
)


def git_env() -> dict[str, str]:
    """The environment of every git run: user config, prompts and GIT_* steering gone."""
    env = {k: os.environ[k] for k in _PASS_THROUGH if k in os.environ}
    env.setdefault("PATH", "/usr/bin:/bin")
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_TERMINAL_PROMPT="0",
        GIT_SSH_COMMAND="ssh -o BatchMode=yes -o ConnectTimeout=10",
        GIT_HTTP_LOW_SPEED_LIMIT="1000",
        GIT_HTTP_LOW_SPEED_TIME="20",
        LC_ALL="C",
    )
    return env


def timeout_seconds() -> float:
    raw = os.environ.get("GITRUN_REMOTE_TIMEOUT", "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT
    except ValueError:
        return DEFAULT_TIMEOUT
    return value if value > 0 else DEFAULT_TIMEOUT


@dataclass(frozen=True)
class Update:
    """Move ``ref`` from ``expected`` (None: must not exist) to ``new`` (None: delete)."""

    ref: str
    new: str | None
    expected: str | None

    def refspec(self) -> str:
        return f"{self.new}:{self.ref}" if self.new is not None else f":{self.ref}"

    def lease(self) -> str:
        return f"--force-with-lease={self.ref}:{self.expected or ''}"


@dataclass(frozen=True)
class Rejected:
    """A push the remote did not apply (no ref moved): ``reasons`` per refused ref."""

    reasons: dict[str, str]

    def describe(self) -> str:
        return "; ".join(f"{ref}: {why}" for ref, why in sorted(self.reasons.items()))


class Remote:
    """A shared git remote and the local repository (git dir) that caches its refs."""

    def __init__(self, url: str, git_dir: Path) -> None:
        if not url or url.startswith("-") or "\n" in url:
            raise BadInput(
                f"--remote {url!r} is not a git remote URL; pass git://, ssh://, https:// or a path"
            )
        self.url = url
        self.git_dir = git_dir

    def _run(self, args: Sequence[str], what: str) -> subprocess.CompletedProcess[str]:
        cmd = ["git", f"--git-dir={self.git_dir}"]
        for item in _CONFIG:
            cmd += ["-c", item]
        try:
            proc = subprocess.Popen(
                [*cmd, *args],
                env=self._env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,  # so a timeout ends git's helpers (ssh) with it
            )
        except OSError as exc:
            raise self.unavailable(what, f"git could not start: {exc}") from exc
        try:
            out, err = proc.communicate(timeout=timeout_seconds())
        except subprocess.TimeoutExpired as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise self.unavailable(what, f"no answer within {exc.timeout:.0f}s") from exc
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def _env(self) -> dict[str, str]:
        """git_env, plus gitrun's stage of unsynced objects as an alternate: a commit point
        pushes objects no local ref names yet (they reach objects/ with the local ref move
        that follows the push: gitrun.store.durable)."""
        env = git_env()
        stage = self.git_dir / STAGE_DIR
        if stage.is_dir():
            env["GIT_ALTERNATE_OBJECT_DIRECTORIES"] = str(stage)
        return env

    def unavailable(self, what: str, detail: str) -> RemoteUnavailable:
        """The fail-closed error for a remote that could not do ``what``."""
        return RemoteUnavailable(
            self.url,
            f"remote {self.url} unavailable while {what} ({detail}); nothing was committed "
            "and no local ref claims otherwise: check the remote is up and reachable from "
            "here, then run the command again",
        )

    def fetch(self, refspecs: Sequence[str], what: str = "reading the run's refs") -> None:
        """Copy the refs ``refspecs`` name from the remote; prune the ones it dropped."""
        proc = self._run(
            [
                "fetch",
                "--quiet",
                "--prune",
                "--no-tags",
                "--no-write-fetch-head",
                "--no-recurse-submodules",
                "--",
                self.url,
                *refspecs,
            ],
            what,
        )
        if proc.returncode != 0:
            raise self.local_problem(proc.stderr) or self.unavailable(what, _last_line(proc.stderr))

    def local_problem(self, stderr: str) -> Refused | None:
        """A failure caused by the local repository, not the remote: a ref git cannot
        read (a broken name, a missing object) names itself, not "remote unavailable"."""
        found = _LOCAL_BAD_REF.search(stderr)
        if found is None:
            return None
        ref = found.group(1)
        return Refused(
            f"the local repository {self.git_dir} holds the ref {ref}, which git cannot read "
            "(an invalid ref name or a missing object), so git refused to fetch; the remote "
            f"was not the problem. Remove it (git --git-dir={self.git_dir} update-ref -d "
            f"{ref}, or delete the file under refs/) and run again"
        )

    def push(self, updates: Sequence[Update], what: str = "committing") -> Rejected | None:
        """ONE atomic push of ``updates``, each leased on its expected value.

        None when every ref moved; :class:`Rejected` when none did (a lost CAS, or a
        ref the server refuses); RemoteUnavailable when the remote was not reached.
        """
        if not updates:
            return None
        args = ["push", "--atomic", "--porcelain", "--no-verify"]
        args += [u.lease() for u in updates]
        proc = self._run([*args, "--", self.url, *(u.refspec() for u in updates)], what)
        statuses = _porcelain(proc.stdout)
        wanted = {u.ref for u in updates}
        if proc.returncode == 0 and wanted <= {ref for ref, (flag, _) in statuses.items()
                                               if flag != "!"}:  # fmt: skip
            return None
        refused = {ref: why for ref, (flag, why) in statuses.items() if flag == "!"}
        if refused:
            return Rejected(refused)
        raise self.unavailable(what, _last_line(proc.stderr) or "no status from the remote")


_LOCAL_BAD_REF = re.compile(
    r"(?:fatal|error): (?:bad object|ignoring ref with broken name) (refs/\S+)"
)


def _porcelain(stdout: str) -> dict[str, tuple[str, str]]:
    """``{dst ref: (flag, summary)}`` from ``git push --porcelain`` output."""
    out: dict[str, tuple[str, str]] = {}
    for line in stdout.splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and len(parts[0]) == 1:
            dst = parts[1].rpartition(":")[2]
            out[dst] = (parts[0], parts[2].strip())
    return out


def _last_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    first = next((i for i, ln in enumerate(lines) if ln.startswith(("fatal:", "error:"))), 0)
    return " ".join(lines[first : first + 2])[:300] or "git failed"


__all__ = ["ZERO", "Rejected", "Remote", "Update", "git_env"]
