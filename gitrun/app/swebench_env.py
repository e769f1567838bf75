"""Test environments for SWE-bench instances: a Python venv built from the spec, before the tests.

An environment is what the harness's spec says (:class:`gitrun.core.swebench.RepoSpec`),
built in this order, each step's output kept in the environment's ``build.log``:

1. ``python -m venv`` with the interpreter the spec names (:func:`find_python`);
2. ``pip install`` of ``packages`` (``requirements.txt`` read from the repository at the
   instance's environment commit, never downloaded; or a list of names) and
   ``pip_packages`` — from the package index pip is configured with (PyPI);
3. a copy of the repository at the instance's base commit (``src/``, from ``git
   archive``), where ``pre_install`` and then ``install`` run with the venv first on
   ``PATH`` (``pip install -e .`` installs the repository's dependencies and metadata).

It is built once under a file lock (two workers never build the same one), cached by the
digest of everything it is built from (:func:`env_spec`: a new digest is a new
directory), and complete only once its marker file exists; a build cut short is removed
and redone. The tests never build: they run later, in the verifier, with the venv's
``bin/`` first on ``PATH``, the tested tree ahead of the installed copy on
``PYTHONPATH``, and (under bubblewrap) the whole environment read-only.

A step that fails is :class:`EnvironmentFailed` for that instance, naming the step and
its last line of output: an infrastructure error, never a verdict. This is a virtualenv,
not a Docker image: the tests share the host's kernel, system libraries and compilers.

The cache lives outside the gitrun workspace and outside /tmp (the verifier's sandbox
hides both from the code under test): ``$GITRUN_SWEBENCH_ENVS``, else
``$XDG_CACHE_HOME/gitrun/swebench-envs``, else ``~/.cache/gitrun/swebench-envs``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from filelock import FileLock

from gitrun.core.codec import digest
from gitrun.core.errors import BadInput, Exit, GitrunError
from gitrun.core.swebench import Instance, RepoSpec
from gitrun.store.atomicfile import atomic_write, replace_unsynced

MARKER = "gitrun-env.json"
BUILD_LOG = "build.log"
_STEP_SECONDS = 1800  # one build step's limit (the harness's default per-instance timeout)


class EnvironmentFailed(GitrunError):
    """An instance's test environment could not be built (an interpreter missing, an
    install step failing): an infrastructure error of that instance, never a verdict."""

    exit_code = Exit.FAILED


def cache_root() -> Path:
    if os.environ.get("GITRUN_SWEBENCH_ENVS"):
        return Path(os.environ["GITRUN_SWEBENCH_ENVS"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "gitrun" / "swebench-envs"


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


def find_python(version: str | None) -> Path:
    """The interpreter for ``version`` ("3.9"): ``python3.9`` on ``PATH``, else pyenv's
    newest ``$PYENV_ROOT/versions/3.9.*`` (``~/.pyenv`` by default), else uv's
    ``~/.local/share/uv/python/cpython-3.9.*``; None: the interpreter gitrun runs on.
    Each candidate is asked its version; none found is :class:`EnvironmentFailed`."""
    if version is None:
        return Path(sys.executable)
    tried = [f"python{version} on PATH"]
    cands = [shutil.which(f"python{version}")]
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    uv = Path(os.environ.get("UV_PYTHON_INSTALL_DIR") or Path.home() / ".local/share/uv/python")
    for root, pattern, exe in ((pyenv, f"{version}.*", f"bin/python{version}"),
                               (uv, f"cpython-{version}.*", f"bin/python{version}")):  # fmt: skip
        tried.append(str(root / pattern))
        found = sorted(root.glob(pattern), key=lambda p: _version_key(p.name), reverse=True)
        cands += [str(p / exe) for p in found]
    for cand in cands:
        if cand and Path(cand).is_file() and _reports(Path(cand), version):
            return Path(cand)
    raise EnvironmentFailed(
        f"python {version} is not available on this machine (looked for {', '.join(tried)}); "
        "install it (e.g. `pyenv install " + version + "`) or change the spec's python"
    )


def _version_key(name: str) -> tuple[int, ...]:
    digits = name.removeprefix("cpython-").split("-")[0].split(".")
    return tuple(int(d) if d.isdigit() else -1 for d in digits)


def _reports(python: Path, version: str) -> bool:
    try:
        done = subprocess.run(
            [str(python), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, check=False, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.decode().strip() == version


def env_spec(spec: RepoSpec, inst: Instance, base_tree: str) -> dict[str, object]:
    """What an environment is built from: its digest names its directory. The repository's
    base tree counts only when the spec installs the repository (or runs pre_install in it)."""
    uses_tree = bool(spec.install or spec.pre_install)
    return {
        "env": f"{inst.repo}@{inst.version}",
        "python": spec.python or sys.version,
        "pip_packages": list(spec.pip_packages),
        "packages": spec.packages,
        "requirements_commit": (inst.environment_setup_commit or inst.base_commit)
        if spec.packages == "requirements.txt" else None,
        "pre_install": list(spec.pre_install),
        "install": spec.install,
        "tree": base_tree if uses_tree else None,
    }  # fmt: skip


def ensure_env(spec: RepoSpec, inst: Instance, repo: Path, base_tree: str) -> Path:
    """The environment for ``spec`` (its directory: ``bin/``, and ``src/`` when the spec
    installs the repository), built now if it is not yet complete."""
    want = env_spec(spec, inst, base_tree)
    name = digest(want).split(":")[-1][:20]
    root = checked_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    home = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (home / MARKER).is_file():
            _build(home, spec, inst, repo, base_tree)
            atomic_write(home / MARKER, (json.dumps(want, indent=2) + "\n").encode())
    return home


def _build(home: Path, spec: RepoSpec, inst: Instance, repo: Path, base_tree: str) -> None:
    if home.exists():
        shutil.rmtree(home)  # a build cut short: never trust half an environment
    python = find_python(spec.python)
    home.mkdir(parents=True)
    log = home / BUILD_LOG
    _step(log, "venv", [str(python), "-m", "venv", str(home)], home)
    pip = [str(home / "bin" / "python"), "-m", "pip", "install", "-q"]
    wanted = _packages(spec, inst, repo, home)
    if wanted:
        _step(log, "packages", [*pip, *wanted], home)
    if spec.pip_packages:
        _step(log, "pip_packages", [*pip, *spec.pip_packages], home)
    if not (spec.install or spec.pre_install):
        return
    src = home / "src"
    src.mkdir()
    _archive(repo, base_tree, src)
    path = f"{home / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    for n, command in enumerate(spec.pre_install, 1):
        _step(log, f"pre_install {n}", ["bash", "-c", command], src, path)
    if spec.install:
        _step(log, "install", ["bash", "-c", spec.install], src, path)


def _packages(spec: RepoSpec, inst: Instance, repo: Path, home: Path) -> list[str]:
    """``pip install`` arguments for the spec's ``packages``: ``-r`` a requirements file
    read from the repository at the instance's environment commit (never downloaded), or
    the names it lists. An environment.yml needs conda, which gitrun does not run."""
    if spec.packages is None:
        return []
    if spec.packages == "environment.yml":
        raise EnvironmentFailed(
            "the spec's packages is environment.yml: a conda environment, which gitrun does "
            "not build; give the spec pip_packages instead"
        )
    if spec.packages != "requirements.txt":
        return spec.packages.split()
    commit = inst.environment_setup_commit or inst.base_commit
    done = subprocess.run(
        ["git", "-C", str(repo), "show", f"{commit}:requirements.txt"],
        capture_output=True, check=False, env=_git_env(),
    )  # fmt: skip
    if done.returncode != 0:
        raise EnvironmentFailed(
            f"the spec's packages is requirements.txt, but {inst.repo} has none at {commit[:12]}"
        )
    replace_unsynced(home / "requirements.txt", done.stdout, mode=0o644)  # scratch
    return ["-r", str(home / "requirements.txt")]


def _git_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}


def _archive(repo: Path, tree: str, dest: Path) -> None:
    """The files of ``tree`` under ``dest`` (``git archive`` piped to ``tar``)."""
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", tree],
        capture_output=True, check=False, env=_git_env(),
    )  # fmt: skip
    if archive.returncode != 0:
        said = archive.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or ["?"]
        raise EnvironmentFailed(f"copying {repo} at {tree[:12]} for the install: {said[0]}")
    untar = subprocess.run(
        ["tar", "-x", "-C", str(dest)], input=archive.stdout, capture_output=True, check=False
    )
    if untar.returncode != 0:
        raise EnvironmentFailed(f"unpacking {repo} at {tree[:12]}: tar failed")


def _step(log: Path, what: str, argv: Sequence[str], cwd: Path, path: str | None = None) -> None:
    """Run one build step, its output appended to ``log``; a failure names the step and
    its last line of output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITRUN_", "GIT_"))}
    env |= {"PATH": path} if path else {}
    env["VIRTUAL_ENV"] = str(log.parent)
    with log.open("ab") as out:
        out.write(f"+ [{what}] {' '.join(argv)}\n".encode())
        out.flush()
        try:
            done = subprocess.run(
                list(argv), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                check=False, timeout=_STEP_SECONDS,
            )  # fmt: skip
            code: int | str = done.returncode
        except subprocess.TimeoutExpired:
            code = f"timeout after {_STEP_SECONDS}s"
        except OSError as exc:
            code = f"cannot start: {exc.strerror}"
    if code != 0:
        tail = log.read_bytes()[-4096:].decode("utf-8", "replace").strip().splitlines()
        last = tail[-1].strip()[:200] if tail else "no output"
        raise EnvironmentFailed(
            f"environment step {what} failed ({code}): {last} (whole output: {log})"
        )
