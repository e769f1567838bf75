"""Which changed paths change how pytest runs: the pure judgement behind the SWE-bench
runner reset (gitrun/core/runner_files.py), on file contents pytest itself would read."""

from __future__ import annotations

import pytest

from gitrun.core.runner_files import command_paths, pytest_sections, runner_reason

SETUP_CFG = b"[metadata]\nname = x\n\n[tool:pytest]\naddopts = -q\ntestpaths =\n    tests\n"


@pytest.mark.parametrize(
    "path",
    ["conftest.py", "a/b/conftest.py", "pytest.toml", "x/.pytest.toml", ".pytest.ini",
     "pytest.ini", "site.pth", "deep/er/x.pth", "sitecustomize.py", "pkg/usercustomize/m.py",
     "x-1.0.dist-info/entry_points.txt", "src/X.EGG-INFO/PKG-INFO", "lib/a.egg/EGG-INFO/x",
     "a.egg-link", "pkg/__pycache__/m.cpython-311.pyc", "m.pyc", ".pytest_cache/v/x",
     "pytest.py", "_pytest/__init__.py", "pluggy/x.py", "py.py", "xdist.py",
     "gitrun_verdict.py"],
)  # fmt: skip
def test_runner_files_count_whatever_their_content(path: str) -> None:
    assert runner_reason(path, None, b"") is not None
    assert runner_reason(path, b"a", b"b") is not None


@pytest.mark.parametrize(
    "path", ["stats/median.py", "README.md", "pkg/pytest.py", "docs/py.txt", "tests/test_x.py"]
)
def test_ordinary_files_do_not_count(path: str) -> None:
    assert runner_reason(path, b"a", b"b") is None


@pytest.mark.parametrize(
    ("old", "new", "changed"),
    [
        (SETUP_CFG, SETUP_CFG.replace(b"name = x", b"name = y"), False),
        (SETUP_CFG, SETUP_CFG.replace(b"addopts = -q\n", b"") + b"addopts = -q\n", False),
        (SETUP_CFG, SETUP_CFG + b"# a comment\n; another\n", False),
        (SETUP_CFG, SETUP_CFG.replace(b"-q", b"-q -p cheat"), True),
        (SETUP_CFG, SETUP_CFG + b"    more\n", True),  # a continuation of testpaths
        # iniconfig keeps the spaces: pytest no longer reads that section
        (SETUP_CFG, SETUP_CFG.replace(b"[tool:pytest]", b"[ tool:pytest ]"), True),
        (b"[metadata]\nname = x\n", b"[metadata]\nname = x\n[TOOL:PYTEST]\naddopts = -p c\n",
         True),
        (SETUP_CFG, SETUP_CFG + b"[tool:pytest]\nx = 1\n", True),  # duplicate: unparseable
        (SETUP_CFG, b"\xff" + SETUP_CFG, True),  # not UTF-8
        (None, b"[pytest]\naddopts = -p cheat\n", True),
        (None, b"[testenv]\ncommands = pytest -p x\n", False),
    ],
)  # fmt: skip
def test_ini_pytest_sections_are_compared_parsed(
    old: bytes | None, new: bytes, changed: bool
) -> None:
    for name in ("setup.cfg", "tox.ini", "ci/custom.ini"):
        assert (runner_reason(name, old, new) is not None) is changed, name


PYPROJECT = b'[project]\nname = "x"\n\n[tool.pytest.ini_options]\na = "1"\nb = ["2"]\n'


@pytest.mark.parametrize(
    ("new", "changed"),
    [
        (PYPROJECT.replace(b'a = "1"\nb = ["2"]', b"b = [ '2' ]  # same\na = '1'"), False),
        (PYPROJECT.replace(b'name = "x"', b'name = "y"'), False),
        (PYPROJECT + b'addopts = "-p cheat"\n', True),
        (PYPROJECT + b"[pytest]\naddopts = '-p cheat'\n", True),
        (PYPROJECT + b'[tool.pytest]\naddopts = ["-p", "cheat"]\n', True),
        (PYPROJECT.replace(b"[tool.pytest.ini_options]", b"[tool.other]"), True),
        (PYPROJECT + b"[[broken", True),
    ],
)
def test_toml_pytest_tables_are_compared_parsed(new: bytes, changed: bool) -> None:
    assert (runner_reason("pyproject.toml", PYPROJECT, new) is not None) is changed
    assert (pytest_sections("x.toml", PYPROJECT) != pytest_sections("x.toml", new)) is changed


def test_the_files_a_test_command_names_are_runner_files() -> None:
    named = command_paths("./tests/runtests.py --verbosity 2 a.b && bash ci/run.sh tests/")
    assert named == ("tests/runtests.py", "ci/run.sh", "tests")
    assert runner_reason("tests/runtests.py", b"a", b"b", named) is not None
    assert runner_reason("tests/other.py", b"a", b"b", named) is None
    assert "tox.ini" in command_paths("tox --current-env -epy39 -v --")
    assert "tox.ini" not in named
