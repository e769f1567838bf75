"""The session protocol's ``exec`` as an agent that restarts uses it (issue #30): variables
set per command (``env``), and keys made as docs/protocol.md says (position chained with
the request), so a client started again replays what it already did and a different
request is a new step, never a conflict. The real ``gitrun session``, real git."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import SANDBOXES, Gitrun, git
from session_client import Rpc, load_schemas, problems

from gitrun.integrations.session_client import step_key

pytestmark = pytest.mark.timeout(180)
TASK = str(SANDBOXES / "rename-api")
RENAME = 'sed -i "s/calc_area/$NEW_NAME/g" geometry/shapes.py'


def keys(gitrun: Gitrun, run_id: str) -> list[str]:
    fmt = "--format=%(trailers:key=Gitrun-Idempotency-Key,valueonly)"
    log = git(gitrun.repo("rename-api"), "log", "--reverse", fmt, f"gitrun/{run_id}")
    return [line.strip() for line in log.splitlines() if line.strip()]


def test_exec_sets_the_variables_a_request_names_and_they_are_part_of_its_intent(
    gitrun: Gitrun,
) -> None:
    rpc = Rpc(gitrun, TASK, "--run-id", "env")
    params: dict[str, Any] = {"command": RENAME, "env": {"NEW_NAME": "circle_area"}}
    schemas, defs = load_schemas()
    assert problems(params, schemas["exec.params"], defs) == []
    done = rpc.call("exec", **params, idempotency_key="env-rename-1")
    repo = gitrun.repo("rename-api")
    assert git(repo, "grep", "-c", "circle_area", done["commit"], "--", "geometry/shapes.py")
    again = rpc.call("exec", **params, idempotency_key="env-rename-1")
    assert again == {**done, "replayed": True}
    for env, rule in [
        ({"GITRUN_HOME": "/tmp"}, "exec-env"),  # never a GITRUN_* name
        ({"2BAD": "x"}, "exec-env"),
        ({"A": "x\x00y"}, "exec-env"),
        ({"A": 1}, "bad-params"),
        ({"A=B": "x"}, "bad-params"),
    ]:
        err = rpc.fail("exec", command=RENAME, env=env)
        assert err["data"]["rule"] == rule, (env, err)
    assert keys(gitrun, "env") == ["env-rename-1"]  # the refusals changed nothing
    assert rpc.close() == 8


def test_a_client_started_again_with_chained_keys_replays_and_a_new_request_is_a_new_step(
    gitrun: Gitrun,
) -> None:
    first = ["sed -i 's/calc_area/circle_area/g' geometry/shapes.py",
             "sed -i 's/calc_area/circle_area/g' geometry/report.py"]  # fmt: skip
    second = [first[0], "sed -i 's/calc_area/circle_area/g' geometry/totals.py"]

    def session(commands: list[str]) -> list[dict[str, Any]]:
        rpc = Rpc(gitrun, TASK, "--run-id", "again")
        rpc.call("initialize")
        answers, previous = [], ""
        for n, command in enumerate(commands, 1):
            key = step_key("client", n, previous, {"command": command})
            answers.append(rpc.call("exec", command=command, idempotency_key=key))
            previous = key
        assert rpc.close() == 8  # left running: the next session carries it on
        return answers

    ran = session(first)
    again = session(second)
    assert [a["replayed"] for a in ran] == [False, False]
    assert again[0] == {**ran[0], "replayed": True}  # the same first request: not re-run
    assert again[1]["replayed"] is False  # another request at position 2: a new step
    assert again[1]["key"] != ran[1]["key"]
    assert keys(gitrun, "again") == [ran[0]["key"], ran[1]["key"], again[1]["key"]]
    rpc = Rpc(gitrun, TASK, "--run-id", "again")
    assert rpc.call("observe")["phase"] == "running"  # no receipt conflict froze the run
    assert rpc.close() == 8
