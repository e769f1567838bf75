"""gitrun's pytest plugin: every test outcome goes to gitrun the moment pytest reports it.

Not imported by gitrun: the verifier copies this file, as ``gitrun_verdict.py``, into a
directory the sandbox shows read-only, puts that directory on ``PYTHONPATH`` and runs
pytest with ``-p gitrun_verdict``. It runs in the *test environment's* interpreter, so it
uses the standard library only and the syntax of Python 3.7.

The verifier hands it one end of a socket pair, named by :data:`ENV` (removed from the
environment here, and the descriptor made non-inheritable, so no process the tests start
gets either). gitrun has already written a random token and a newline to it; the plugin
reads that once and then writes one JSON line per record, each carrying the token:

- ``begin`` when pytest configures it (before any test module is imported);
- ``test`` for each report pytest logs (node id, phase, outcome, whether xfail-marked);
- ``end`` once the session has finished and the JUnit report is written, with pytest's
  exit status and the SHA-256 of that report's bytes.

Lines go out as they happen: what the code under test does later (an ``atexit`` hook, a
rewritten report file) cannot take back a line gitrun has already been sent.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import pytest

ENV = "PYTEST_GITRUN_VERDICT"
_TOKEN_BYTES = 128


class _Channel:
    def __init__(self, fd: int, token: str) -> None:
        self.fd = fd
        self.token = token
        self.broken = False

    def send(self, record: dict[str, Any]) -> None:
        if self.broken:
            return
        record["t"] = self.token
        data = (json.dumps(record, sort_keys=True) + "\n").encode("utf-8", "surrogateescape")
        try:
            while data:
                data = data[os.write(self.fd, data) :]
        except OSError:
            self.broken = True  # gitrun sees the stream stop: never a passing verdict


def _open() -> _Channel | None:
    raw = os.environ.pop(ENV, None)
    if raw is None or not raw.isdigit():
        return None  # e.g. an xdist worker: the controller process reports its tests
    fd = int(raw)
    try:
        os.set_inheritable(fd, False)
        token = b""
        while not token.endswith(b"\n") and len(token) < _TOKEN_BYTES:
            chunk = os.read(fd, _TOKEN_BYTES - len(token))
            if not chunk:
                return None
            token += chunk
    except OSError:
        return None
    return _Channel(fd, token.decode("ascii", "replace").strip())


_channel = _open()


def pytest_configure(config: Any) -> None:
    if _channel is not None:
        _channel.send({"k": "begin", "v": 1})


def pytest_runtest_logreport(report: Any) -> None:
    if _channel is not None:
        _channel.send(
            {
                "k": "test",
                "id": str(report.nodeid),
                "when": str(report.when),
                "o": str(report.outcome),
                "x": hasattr(report, "wasxfail"),
            }
        )


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: Any, exitstatus: Any) -> None:
    """Last of every plugin's: the JUnit report (if any) is written and closed by now."""
    if _channel is None:
        return
    path = getattr(session.config.option, "xmlpath", None)
    junit = None
    if path:
        try:
            with open(path, "rb") as fh:
                junit = hashlib.sha256(fh.read()).hexdigest()
        except OSError:
            junit = None
    _channel.send({"k": "end", "status": int(exitstatus), "junit": junit})
