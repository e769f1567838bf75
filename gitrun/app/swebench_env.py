"""Test environments for SWE-bench instances: one Python venv per (repo, version) spec.

Built once with ``python -m venv`` and ``pip install`` of the spec's requirements, under a
file lock (two workers never build the same one), cached by the digest of its spec (the
interpreter, the requirements, the repo and version) and rebuilt when the spec changes —
a new digest is a new directory. Complete only once its marker file exists; a build cut
short is removed and redone. This is a virtualenv, not a Docker image: the tests share
the host's kernel, system libraries, network and interpreter build.

The cache lives outside the gitrun workspace and outside /tmp (the verifier's sandbox hides
both from the code under test): ``$GITRUN_SWEBENCH_ENVS``, else
``$XDG_CACHE_HOME/gitrun/swebench-envs``, else ``~/.cache/gitrun/swebench-envs``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

from gitrun.core.codec import digest
from gitrun.core.errors import BadInput, Exit, GitrunError
from gitrun.core.swebench import RepoSpec
from gitrun.store.atomicfile import atomic_write

MARKER = "gitrun-env.json"


class EnvironmentFailed(GitrunError):
    """An instance's test environment could not be built (an interpreter missing, an
    install step failing): an infrastructure error of that instance, never a verdict."""

    exit_code = Exit.FAILED


def checked_cache_root() -> Path:
    """The cache directory, refused (before anything runs) where the tests cannot see it."""
    root = cache_root().resolve()
    if root.is_relative_to("/tmp"):  # noqa: S108 - refused, not used
        raise BadInput(
            f"the environment cache {root} lies under /tmp, which the verifier's sandbox "
            "replaces by an empty tmpfs; set GITRUN_SWEBENCH_ENVS to a directory elsewhere "
            "(e.g. /var/tmp/gitrun-envs)"
        )
    return root


def cache_root() -> Path:
    if os.environ.get("GITRUN_SWEBENCH_ENVS"):
        return Path(os.environ["GITRUN_SWEBENCH_ENVS"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "gitrun" / "swebench-envs"


def env_spec(spec: RepoSpec, env_key: str) -> dict[str, object]:
    """What an environment is built from: its digest names its directory."""
    return {
        "env": env_key,
        "python": sys.version,
        "requirements": list(spec.pip_requirements),
    }


def ensure_env(spec: RepoSpec, env_key: str) -> Path:
    """The ``bin/`` of the environment for ``spec``, built now if it is not yet complete."""
    want = env_spec(spec, env_key)
    name = digest(want).split(":")[-1][:20]
    root = checked_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    home = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (home / MARKER).is_file():
            _build(home, spec)
            atomic_write(home / MARKER, (json.dumps(want, indent=2) + "\n").encode())
    return home / "bin"


def _build(home: Path, spec: RepoSpec) -> None:
    if home.exists():
        shutil.rmtree(home)  # a build cut short: never trust half an environment
    steps = [[sys.executable, "-m", "venv", str(home)]]
    if spec.pip_requirements:
        steps.append([str(home / "bin" / "python"), "-m", "pip", "install", "-q",
                      *spec.pip_requirements])  # fmt: skip
    for argv in steps:
        done = subprocess.run(argv, capture_output=True, check=False)
        if done.returncode != 0:
            said = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or ["?"]
            raise EnvironmentFailed(f"environment for {' '.join(spec.pip_requirements)}: {said[0]}")
