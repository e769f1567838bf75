"""docs/scaling-out.md's examples use the real command line: every option of every
``gitrun`` command they print exists, the shell scripts parse, the manifest is a
Kubernetes Indexed Job that runs ``gitrun worker``. (The schedulers themselves are not
run here; the worker's behaviour is tests/test_worker.py's.)"""

from __future__ import annotations

import re
import subprocess

import pytest
import typer
from conftest import ROOT

from gitrun.cli import app

DOC = (ROOT / "docs" / "scaling-out.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", DOC, re.S)


def options(command: str) -> set[str]:
    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return {opt for param in cmd.params for opt in param.opts}


def test_every_gitrun_command_line_in_the_doc_uses_options_the_command_has() -> None:
    seen = 0
    for _, body in BLOCKS:
        text = body.replace("\\\n", " ")
        for command, args in re.findall(r"\bgitrun (worker|swebench|keys rotate)\b([^\n#]*)", text):
            if command == "keys rotate":
                continue
            used = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", args))
            assert used <= options(command), (command, used - options(command))
            seen += 1
    assert seen >= 5  # the quick start, the publish, and one per scheduler


def test_the_shell_examples_parse() -> None:
    scripts = [body for lang, body in BLOCKS if lang in ("bash", "sh")]
    assert len(scripts) >= 3
    for body in scripts:
        done = subprocess.run(["bash", "-n"], input=body, text=True, capture_output=True,
                              check=False, timeout=30)  # fmt: skip
        assert done.returncode == 0, (body[:200], done.stderr)


def test_the_kubernetes_example_is_an_indexed_job_running_gitrun_worker() -> None:
    yaml = pytest.importorskip("yaml")
    (manifest,) = [yaml.safe_load(body) for lang, body in BLOCKS if lang == "yaml"]
    assert (manifest["apiVersion"], manifest["kind"]) == ("batch/v1", "Job")
    spec = manifest["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # a podFailurePolicy needs it
    (container,) = spec["template"]["spec"]["containers"]
    assert "exec gitrun worker " in container["args"][0]
    rule = spec["podFailurePolicy"]["rules"][0]
    assert rule["onExitCodes"]["containerName"] == container["name"]
    assert {2, 5} <= set(rule["onExitCodes"]["values"])  # a restart cannot help
    assert 9 not in rule["onExitCodes"]["values"]  # remote unreachable: retried
