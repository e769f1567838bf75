"""Which files change how the test runner behaves: judged per path of a tree diff, pure.

A SWE-bench prediction is graded by the tests the dataset names, so nothing it changes
may change *how* those tests run. :func:`runner_reason` says whether a changed path (with
its old and new bytes) is such a file, and why:

- every ``conftest.py``, at any depth (pytest loads them as plugins);
- the files pytest reads its configuration from. The names come from pytest's own
  discovery, ``CONFIG_LOADERS_BY_NAME`` in ``_pytest/config/findpaths.py`` (pytest 9.x):
  ``pytest.toml``, ``.pytest.toml``, ``pytest.ini``, ``.pytest.ini`` (always the
  configuration, even without a section: any change counts), ``pyproject.toml``,
  ``tox.ini``, ``setup.cfg``; and ``CONFIG_LOADERS_BY_SUFFIX`` (``.ini``, ``.cfg``,
  ``.toml``) for a file a test command names with ``-c``. For those the pytest
  sections are compared *parsed* (``[pytest]`` and ``[tool:pytest]`` of an INI file,
  ``[pytest]`` and ``[tool.pytest]`` of a TOML file): reordered keys or an edit to
  another section do not count, any change to what pytest reads does. A file either
  side cannot parse counts as changed;
- ``.pth`` files, ``sitecustomize`` / ``usercustomize`` (module or package), and package
  metadata (``*.dist-info``, ``*.egg-info``, ``*.egg``, ``*.egg-link``): entry points
  such as ``pytest11`` are read from any of them on ``sys.path``;
- compiled bytecode (``__pycache__``, ``*.pyc``, ``*.pyo``): an unchecked-hash ``.pyc``
  is imported in place of its source (PEP 552), a test file's or a conftest's too;
- ``.pytest_cache`` (``--lf``/``--sw`` read it);
- a module or package at the tree's root named like the runner or a module it imports
  at start-up (``pytest``, ``_pytest``, ``pluggy``, ...): ``python -m pytest`` puts the
  working directory first on ``sys.path``, so it would run instead of the real one;
- the files the test command itself names (``./tests/runtests.py``), and ``tox.ini``
  when it runs ``tox``;
- (:func:`shadowing_module`) a module or package *new* at the tree's root or in
  ``src/`` named like a standard-library module or the runner's: when the spec installs
  the repository both directories come first on ``PYTHONPATH``, ahead of the standard
  library and site-packages, so ``src/pytest.py`` or a root ``argparse.py`` would be
  imported by pytest itself before it runs anything (gitrun/app/swebench_run.py). A
  module the reference tree already has there is the repository's own code.

The INI reading follows iniconfig (``_parse.py``), the parser pytest uses, line for
line; section names are matched ignoring case and surrounding space, a superset of
what pytest reads.
"""

from __future__ import annotations

import shlex
import sys
import tomllib
from collections.abc import Callable, Collection, Iterable

__all__ = [
    "RUNNER_MODULES",
    "SECTION_SUFFIXES",
    "SHADOW_DIRS",
    "command_paths",
    "pytest_sections",
    "runner_reason",
    "shadowing_module",
]

_ALWAYS_CONFIG = frozenset({"pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini"})
_INI_SUFFIXES = (".ini", ".cfg")
SECTION_SUFFIXES = (*_INI_SUFFIXES, ".toml")  # files whose pytest sections are compared
_INI_SECTIONS = frozenset({"pytest", "tool:pytest"})
_SITE = frozenset({"sitecustomize", "usercustomize"})
_METADATA = (".dist-info", ".egg-info", ".egg", ".egg-link")
_BYTECODE = (".pyc", ".pyo")
_COMMENT = "#;"
RUNNER_MODULES = frozenset(
    {
        # pytest and what it imports before it collects anything (its requirements)
        "pytest", "_pytest", "py", "pluggy", "iniconfig", "packaging", "pygments",
        "exceptiongroup", "tomli", "colorama",
        # pytest-xdist and its transport, gitrun's own verdict plugin
        "xdist", "execnet", "gitrun_verdict",
    }
)  # fmt: skip


SHADOW_DIRS = ("", "src/")  # on PYTHONPATH first when the repository is installed
_SHADOWABLE = frozenset(sys.stdlib_module_names) | RUNNER_MODULES


def shadowing_module(path: str, present: Collection[tuple[str, str]]) -> str | None:
    """The module name a path *added* at the root or in ``src/`` makes importable ahead of
    the standard library and the runner (``argparse.py``, ``src/pytest.py``,
    ``src/_pytest/__init__.py``, an extension module), or None. ``present``: (directory,
    module name) of what the reference tree already has there (``("src/", "flask")``):
    the repository's own modules are its code, not a shadow."""
    for where in SHADOW_DIRS:
        if not path.startswith(where):
            continue
        parts = path[len(where) :].split("/")
        if len(parts) == 1:
            name, _, suffix = parts[0].partition(".")
            module = suffix == "py" or suffix.endswith(("so", "pyd"))
        else:
            name, module = parts[0], parts[1:] == ["__init__.py"]
        if module and name in _SHADOWABLE and (where, name) not in present:
            return name
    return None


def runner_reason(
    path: str, old: bytes | None, new: bytes | None, command: Iterable[str] = ()
) -> str | None:
    """Why changing ``path`` from ``old`` to ``new`` (None: absent) changes how the tests
    run, or None when it does not. ``command``: the paths the test command names."""
    if path in set(command):
        return "a file the test command runs"
    parts = path.split("/")
    for reason, hit in _RULES:
        if hit(parts):
            return reason
    name = parts[-1]
    if name.endswith(SECTION_SUFFIXES) and (
        pytest_sections(name, old) != pytest_sections(name, new)
    ):
        return f"pytest section of {name}"
    return None


def _shadows_runner(parts: list[str]) -> bool:
    """A package directory, module or extension at the root named like the runner."""
    if len(parts) > 1:
        return parts[0] in RUNNER_MODULES
    stem, _, rest = parts[0].partition(".")
    return stem in RUNNER_MODULES and rest.endswith(("py", "pyc", "so", "pyd"))


_RULES: tuple[tuple[str, Callable[[list[str]], bool]], ...] = (
    ("conftest.py", lambda parts: parts[-1] == "conftest.py"),
    ("pytest configuration file", lambda parts: parts[-1] in _ALWAYS_CONFIG),
    (".pth file", lambda parts: parts[-1].endswith(".pth")),
    ("site customisation", lambda parts: any(p.split(".", 1)[0] in _SITE for p in parts)),
    ("package metadata (entry points)",
     lambda parts: any(p.lower().endswith(_METADATA) for p in parts)),
    ("compiled bytecode", lambda parts: "__pycache__" in parts or parts[-1].endswith(_BYTECODE)),
    ("pytest cache", lambda parts: ".pytest_cache" in parts),
    ("shadows the test runner", _shadows_runner),
)  # fmt: skip


def pytest_sections(name: str, data: bytes | None) -> object:
    """What pytest reads from the file ``name`` holding ``data``, as a comparable value:
    None when absent or without a pytest section, a marker when it does not parse."""
    if data is None:
        return None
    try:
        text = data.decode("utf-8").removeprefix("\N{BYTE ORDER MARK}")
        if name.endswith(".toml"):
            return _toml_sections(text)
        return _ini_sections(text)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, ValueError):
        return ("unparseable", data)


def _toml_sections(text: str) -> object:
    doc = tomllib.loads(text)
    tool = doc.get("tool")
    found = {
        "pytest": doc.get("pytest"),
        "tool.pytest": tool.get("pytest") if isinstance(tool, dict) else tool,
    }
    return {k: v for k, v in found.items() if v is not None} or None


def _ini_sections(text: str) -> object:
    """iniconfig's grammar: comment lines, ``[section]``, ``name = value`` or
    ``name: value``, indented continuation lines; a duplicate section or name, a value
    before any section or a line it cannot read is a ValueError, as in iniconfig."""
    sections: dict[str, dict[str, list[str]]] = {}
    section: str | None = None
    last: list[str] | None = None
    for line in text.splitlines():
        stripped = "" if line.lstrip()[:1] in tuple(_COMMENT) else line.rstrip()
        if not stripped:
            continue
        if stripped[0] == "[":
            head = stripped
            for c in _COMMENT:
                head = head.split(c)[0].rstrip()
            if head[-1:] == "]":
                section = head[1:-1]
                if section in sections:
                    raise ValueError(f"duplicate section {section!r}")
                sections[section] = {}
                last = None
                continue
            if last is None:
                raise ValueError("unexpected continuation")
            last.append(stripped.strip())
        elif not stripped[0].isspace():
            key, value = _key_value(stripped)
            if section is None:
                raise ValueError("no section header")
            if key in sections[section]:
                raise ValueError(f"duplicate name {key!r}")
            last = sections[section][key] = [value] if value else []
        else:
            if last is None:
                raise ValueError("unexpected continuation")
            last.append(stripped.strip())
    found = {
        k: {key: "\n".join(v) for key, v in body.items()}
        for k, body in sections.items()
        if k.strip().lower() in _INI_SECTIONS
    }
    return found or None


def _key_value(line: str) -> tuple[str, str]:
    name, eq, value = line.partition("=")
    if not eq or ":" in name:
        name, colon, value = line.partition(":")
        if not colon:
            raise ValueError(f"unexpected line {line!r}")
    return name.strip(), value.strip()


def command_paths(command: str) -> tuple[str, ...]:
    """The relative paths a shell test command names (``./tests/runtests.py``,
    ``tests/run.sh``), normalised to tree paths, words that hold no ``/`` left out; and
    ``tox.ini`` when the command runs ``tox``."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    out = ["tox.ini"] if "tox" in words else []  # tox runs what its tox.ini says
    for word in words:
        if "/" in word and not word.startswith(("/", "-", "$")) and "::" not in word:
            path = word.removeprefix("./").rstrip("/")
            if path and ".." not in path.split("/"):
                out.append(path)
    return tuple(dict.fromkeys(out))
