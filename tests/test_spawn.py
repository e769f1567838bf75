"""The suite's fork server (tests/spawn.py, tests/zygote.py) gives the process an exec
would: same argv, path, directory, environment, descriptors, signal dispositions, exit
codes, output and libgit2 configuration search path; a real pid that signals reach."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import spawn
from conftest import Gitrun

# What a process can see of how it was started.
PROBE = """
import json, os, signal, sys, threading
import pygit2
from pygit2.enums import ConfigLevel, Option
fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "env": dict(os.environ),
    "stdin": sys.stdin.read(), "fds": fds[:3], "more_fds": len(fds) > 4,
    "main": __name__, "spec": repr(globals().get("__spec__")),
    "signals": {s: str(signal.getsignal(getattr(signal, s)))
                for s in ("SIGINT", "SIGPIPE", "SIGCHLD", "SIGTERM", "SIGXFSZ")},
    "optimize": sys.flags.optimize, "bytecode": sys.dont_write_bytecode,
    "threads": threading.active_count(), "sid": os.getsid(0) == os.getpid(),
    "libgit2_global": pygit2.option(Option.GET_SEARCH_PATH, ConfigLevel.GLOBAL),
    "libgit2_xdg": pygit2.option(Option.GET_SEARCH_PATH, ConfigLevel.XDG),
}))
sys.exit(int(sys.argv[1]))
"""


def both(argv: list[str], **kwargs: Any) -> tuple[Any, Any]:
    """The same call forked (the server must take it) and exec'd."""
    forked = spawn.popen(argv, **kwargs)
    assert isinstance(forked, spawn.Forked), "the fork server refused a call it should take"
    execd = subprocess.Popen(argv, **kwargs)
    return forked, execd


def test_a_forked_child_sees_what_an_execd_one_sees(tmp_path: Path) -> None:
    home = tmp_path / "probe-home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / "xdg")}
    env |= {"PYTHONDONTWRITEBYTECODE": "1", "SOME_VARIABLE": "a value"}
    argv = [sys.executable, *spawn.FLAGS, "-c", PROBE, "7", "an argument"]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    forked, execd = both(argv, env=env, cwd=tmp_path, text=True, **pipes)
    seen = []
    for proc in (forked, execd):
        out, err = proc.communicate("the input", timeout=60)
        assert (proc.returncode, err) == (7, ""), err
        seen.append(json.loads(out))
    assert seen[0] == seen[1]
    assert seen[0]["libgit2_global"] == str(home)  # libgit2 looks at this HOME, not the server's
    assert seen[0]["env"] == env
    assert (seen[0]["stdin"], seen[0]["argv"]) == ("the input", ["-c", "7", "an argument"])


def test_a_new_session_is_one_for_the_forked_child_too(tmp_path: Path) -> None:
    argv = [sys.executable, *spawn.FLAGS, "-c", PROBE, "0"]
    forked, execd = both(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    seen = [json.loads(p.communicate(timeout=60)[0]) for p in (forked, execd)]
    assert seen[0]["sid"]
    assert seen[1]["sid"]


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("raise SystemExit(3)", 3),
        ("raise SystemExit('a message')", 1),
        ("import sys; sys.exit()", 0),
        ("raise ValueError('boom')", 1),
        ("raise KeyboardInterrupt", -signal.SIGINT),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL),
        ("import atexit; atexit.register(print, 'at exit'); print('first')", 0),
        (
            "import threading, time; threading.Thread(target=lambda: (time.sleep(0.2), "
            "print('joined'))).start()",
            0,
        ),
    ],
)
def test_exit_codes_output_and_tracebacks_are_the_interpreters(code: str, status: int) -> None:
    argv = [sys.executable, *spawn.FLAGS, "-c", code]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    forked, execd = both(argv, text=True, **pipes)
    results = [(p.communicate(timeout=60), p.returncode) for p in (forked, execd)]
    assert results[0] == results[1]
    assert results[0][1] == status


def test_the_cli_prints_the_same_and_exits_the_same(gitrun: Gitrun) -> None:
    for args in (["--help"], ["no-such-command"], ["debug", "crash-points"], ["list"]):
        argv = gitrun.argv(*args)
        kwargs: dict[str, Any] = {"capture_output": True, "text": True, "env": gitrun.env()}
        forked = spawn.run(argv, cwd=gitrun.home.parent, **kwargs)
        execd = subprocess.run(argv, cwd=gitrun.home.parent, check=False, **kwargs)
        assert (forked.returncode, forked.stdout, forked.stderr) == (
            execd.returncode,
            execd.stdout,
            execd.stderr,
        )


def test_signals_reach_the_real_process_and_its_status_comes_back() -> None:
    proc = spawn.popen([sys.executable, *spawn.FLAGS, "-c", "import time; time.sleep(60)"])
    assert isinstance(proc, spawn.Forked)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "SIGSTOP did not stop it"
        time.sleep(0.01)
    assert proc.poll() is None  # stopped is not ended
    os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert proc.poll() == -signal.SIGTERM


def test_what_a_fork_cannot_give_is_execd() -> None:
    argv = [sys.executable, *spawn.FLAGS, "-c", "pass"]
    other = {**os.environ, "PYTHONHASHSEED": "1234"}
    for proc in (
        spawn.popen(argv, pass_fds=[0]),
        spawn.popen([sys.executable, "-X", "dev", "-c", "pass"]),
        spawn.popen(argv, env=other),
    ):
        assert not isinstance(proc, spawn.Forked)
        assert proc.wait(timeout=60) == 0
    with pytest.raises(FileNotFoundError):  # as subprocess.Popen raises it, not a child's exit
        spawn.popen(argv, cwd="/nonexistent/directory")
