"""SWE-bench files, pure: instance records, predictions, per-repo specs, the report shapes.

Parsing follows the harness's field names (``repo, instance_id, base_commit, patch,
test_patch, FAIL_TO_PASS, PASS_TO_PASS, version, ...``); FAIL_TO_PASS / PASS_TO_PASS are
JSON-encoded strings in the published datasets, lists elsewhere. Nothing here reads a file
it was not handed as bytes, nor touches git.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gitrun.core.codec import digest
from gitrun.core.errors import BadInput

__all__ = [
    "END_TEST_OUTPUT",
    "INFRA_SIGNATURES",
    "START_TEST_OUTPUT",
    "Instance",
    "Prediction",
    "RepoSpec",
    "classify_text",
    "eval_script_test_cmd",
    "harness_log",
    "instance_report",
    "parse_instances",
    "parse_predictions",
    "parse_specs",
    "run_report",
    "safe_component",
    "spec_from",
    "test_directives",
]

# The harness's log markers (swebench.harness.constants, 4.x and 5.x alike): its grader
# (grading.get_logs_eval) reads only what its eval script prints between the first two,
# and 5.x checks the test command's exit status it prints after the second.
START_TEST_OUTPUT = ">>>>> Start Test Output"
END_TEST_OUTPUT = ">>>>> End Test Output"
TEST_EXIT_CODE = ">>>>> Test Exit Code"
APPLY_PATCH_FAIL = ">>>>> Patch Apply Failed"
APPLY_PATCH_PASS = ">>>>> Applied Patch"  # noqa: S105 - a log marker, not a password
# 5.x's advisory classifier of failed instances (harness/infra_failure.py, swebench 5.0.2):
# (reason, tier, pattern), first match wins; the run report lists them by tier.
TIER_ENVIRONMENT, TIER_AMBIGUOUS = "environment", "ambiguous"
INFRA_SIGNATURES = tuple(
    (reason, tier, re.compile(pattern, re.MULTILINE))
    for reason, tier, pattern in (
        ("browser_launch_failed", TIER_ENVIRONMENT,
         r"Failed to launch|Failed to connect to the bus"),
        ("display_unavailable", TIER_ENVIRONMENT,
         r"cannot open display|Missing X server|unable to open X display"),
        ("out_of_memory", TIER_ENVIRONMENT, r"Cannot allocate memory|OutOfMemoryError|^Killed$"),
        ("container_unavailable", TIER_ENVIRONMENT,
         r"Error response from daemon|Cannot connect to the Docker daemon"),
        ("network_unreachable", TIER_ENVIRONMENT,
         r"Could not resolve host|Temporary failure in name resolution"),
        ("missing_module", TIER_AMBIGUOUS,
         r"Cannot find module|MODULE_NOT_FOUND|ModuleNotFoundError"),
        ("no_tests_collected", TIER_AMBIGUOUS, r"no tests ran|collected 0 items"),
        ("tests_timed_out", TIER_AMBIGUOUS, r"Timeout error: \d+ seconds exceeded"),
    )
)  # fmt: skip
GOLD = "gold"
_MAX_COMPONENT_BYTES = 200  # a file name holds 255; room for the report's suffixes
GOLD_MODEL = "gold"


@dataclass(frozen=True)
class RepoSpec:
    """How to build a repository's test environment and run its tests, in the harness's
    vocabulary (swebench 4.x ``MAP_REPO_VERSION_TO_SPECS`` entries): the interpreter
    (``python``, a version such as ``"3.9"``; None: the one gitrun runs on), shell
    commands run in a copy of the repository at the instance's base commit before and as
    its install (``pre_install``, ``install``), packages from PyPI (``pip_packages``;
    ``packages``: ``requirements.txt`` read from the repository at the instance's
    environment commit, or a list of package names), shell commands run before the tests
    (``eval_commands``), and the test command, to which the test files ``test_patch``
    touches are appended (``directives``) as the harness does."""

    test_cmd: str
    pip_packages: tuple[str, ...] = ()
    python: str | None = None
    pre_install: tuple[str, ...] = ()
    install: str | None = None
    packages: str | None = None
    eval_commands: tuple[str, ...] = ()
    directives: bool = False

    def to_json(self) -> dict[str, object]:
        return {
            "test_cmd": self.test_cmd, "pip_packages": list(self.pip_packages),
            "python": self.python, "pre_install": list(self.pre_install), "install": self.install,
            "packages": self.packages, "eval_commands": list(self.eval_commands),
            "test_directives": self.directives,
        }  # fmt: skip


@dataclass(frozen=True)
class Instance:
    """One SWE-bench task instance, plus the spec gitrun tests it with."""

    instance_id: str
    repo: str
    base_commit: str
    patch: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    version: str
    spec: RepoSpec | None  # from the record; else the spec file's entry for the repo
    allow_test_infra: bool
    record_digest: str  # over the whole record as given
    environment_setup_commit: str = ""  # where requirements.txt is read (else base_commit)
    eval_script: str = ""  # swebench 5.x rows: the harness's eval script (its test command)
    eval_type: str = "pass_and_fail"  # swebench 5.x rows: how the harness grades them

    @property
    def env_key(self) -> str:
        return f"{self.repo}@{self.version}"


@dataclass(frozen=True)
class Prediction:
    instance_id: str
    model: str
    patch: str | None


def _records(data: bytes, what: str) -> list[Any]:
    """A JSON document (list, or dict of records) or JSON Lines, as a list of values."""
    text = data.decode("utf-8", "replace").strip()
    if not text:
        return []
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
        out = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise BadInput(f"{what}: line {n} is not JSON ({exc.msg})") from exc
        return out
    if isinstance(doc, list):
        return doc
    if isinstance(doc, dict):
        return [doc] if "instance_id" in doc else [
            dict(v, instance_id=v.get("instance_id", k)) if isinstance(v, dict) else v
            for k, v in doc.items()
        ]  # fmt: skip
    raise BadInput(f"{what}: expected a JSON list, a JSON object or JSON Lines")


def _str_field(rec: Mapping[str, Any], key: str, where: str, *, default: str | None = None) -> str:
    value = rec.get(key, default)
    if not isinstance(value, str):
        raise BadInput(f"{where}: field {key!r} must be a string")
    return value


def _test_list(rec: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = rec.get(key, [])
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise BadInput(f"{where}: {key} is a string but not JSON ({exc.msg})") from exc
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadInput(f"{where}: {key} must be a list of test ids (or its JSON encoding)")
    return tuple(value)


# The spec keys gitrun reads (the harness's, and gitrun's own), and the harness's keys it
# knows it does not use (Docker resources, conda switches, other languages' build steps).
_SPEC_KEYS = frozenset({
    "test_cmd", "test_command", "pip_packages", "pip_requirements", "python", "pre_install",
    "install", "packages", "eval_commands", "test_directives",
})  # fmt: skip
_HARNESS_ONLY_KEYS = frozenset({
    "nano_cpus", "execute_test_as_nonroot", "no_use_env", "env_patches", "docker_specs",
    "rebuild_cmd", "build", "image", "apt-pkgs", "env_vars", "test_timeout",
})  # fmt: skip


def spec_from(rec: Mapping[str, Any], where: str, *, strict: bool = True) -> RepoSpec | None:
    """The spec ``rec`` holds (None without a test command): a record's own fields, an
    entry of gitrun's spec file, or of the harness's spec map (``strict=False``: keys
    gitrun does not know are left alone there; in gitrun's own files they are refused)."""
    cmd = rec.get("test_cmd", rec.get("test_command"))
    if cmd is None:
        return None
    if strict:
        unknown = sorted(set(rec) - _SPEC_KEYS - _HARNESS_ONLY_KEYS)
        if unknown:
            raise BadInput(f"{where}: unknown spec key {unknown[0]!r} (known: "
                           f"{', '.join(sorted(_SPEC_KEYS))})")  # fmt: skip
    if isinstance(cmd, list) and all(isinstance(c, str) for c in cmd):
        cmd = " && ".join(cmd) if len(cmd) > 1 else " ".join(cmd)
    if not isinstance(cmd, str) or not cmd.strip():
        raise BadInput(f"{where}: test_cmd must be a non-empty string")
    python = rec.get("python")
    if python is not None and not (isinstance(python, str) and re.fullmatch(r"\d+\.\d+", python)):
        raise BadInput(f'{where}: python must be a version such as "3.9", not {python!r}')
    install, packages = rec.get("install"), rec.get("packages")
    for key, value in (("install", install), ("packages", packages)):
        if value is not None and not isinstance(value, str):
            raise BadInput(f"{where}: {key} must be a string")
    directives = rec.get("test_directives", False)
    if not isinstance(directives, bool):
        raise BadInput(f"{where}: test_directives must be true or false")
    pip = rec.get("pip_packages", rec.get("pip_requirements", []))
    return RepoSpec(
        cmd, _strings(pip, "pip_packages", where), python,
        _strings(rec.get("pre_install", []), "pre_install", where, split=False),
        install or None, packages or None,
        _strings(rec.get("eval_commands", []), "eval_commands", where, split=False),
        directives,
    )  # fmt: skip


def _record_spec(rec: Mapping[str, Any], where: str) -> RepoSpec | None:
    return spec_from({k: v for k, v in rec.items() if k in _SPEC_KEYS}, where)


def _strings(value: object, key: str, where: str, *, split: bool = True) -> tuple[str, ...]:
    if isinstance(value, str):
        value = value.split() if split else [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadInput(f"{where}: {key} must be a list of strings")
    return tuple(value)


def parse_instances(data: bytes, what: str = "dataset") -> tuple[Instance, ...]:
    """Every instance record of ``data``, strictly: a missing field is named with its index."""
    out: list[Instance] = []
    seen: set[str] = set()
    for i, rec in enumerate(_records(data, what)):
        where = f"{what}: record {i}"
        if not isinstance(rec, dict):
            raise BadInput(f"{where} is not a JSON object")
        iid = safe_component(_str_field(rec, "instance_id", where), f"{where}: instance_id")
        where = f"{what}: instance {iid}"
        if iid in seen:
            raise BadInput(f"{where} appears twice")
        seen.add(iid)
        repo = _str_field(rec, "repo", where)
        if repo.count("/") != 1 or ".." in repo:
            raise BadInput(f"{where}: repo {repo!r} must be 'owner/name'")
        out.append(
            Instance(
                iid, repo, _str_field(rec, "base_commit", where),
                _str_field(rec, "patch", where, default=""),
                _str_field(rec, "test_patch", where),
                _test_list(rec, "FAIL_TO_PASS", where), _test_list(rec, "PASS_TO_PASS", where),
                str(rec.get("version", "")), _record_spec(rec, where),
                rec.get("allow_test_infra") is True, digest(rec),
                str(rec.get("environment_setup_commit") or ""), str(rec.get("eval_script") or ""),
                _eval_type(rec, where),
            )
        )  # fmt: skip
    return tuple(out)


# swebench 5.x's EvalType values (harness/constants): a row without one is pass_and_fail
PASS_AND_FAIL, FAIL_ONLY = "pass_and_fail", "fail_only"


def _eval_type(rec: Mapping[str, Any], where: str) -> str:
    value = rec.get("eval_type") or PASS_AND_FAIL
    if value not in (PASS_AND_FAIL, FAIL_ONLY):
        raise BadInput(f"{where}: eval_type {value!r} is not {PASS_AND_FAIL!r} or {FAIL_ONLY!r}")
    return str(value)


def safe_component(value: str, what: str) -> str:
    """``value`` when it is one safe path component (it names a log directory and a file
    under ``--report-dir``); else a one-line :class:`BadInput` saying what to change."""
    bad = (
        not value
        or value in (".", "..")
        or len(value.encode("utf-8", "surrogateescape")) > _MAX_COMPONENT_BYTES
        or any(c in "/\\" or not c.isprintable() for c in value)
    )
    if bad:
        raise BadInput(
            f"{what} {value[:80]!r} is not a safe file name: it must be 1 to "
            f"{_MAX_COMPONENT_BYTES} bytes, not '.' or '..', with no '/', '\\' or control "
            "characters"
        )
    return value


def parse_predictions(
    data: bytes | None, instances: Sequence[Instance], what: str = "predictions"
) -> dict[str, Prediction]:
    """Predictions by instance id; ``data=None`` means ``gold`` (each instance's own patch).
    A prediction for an id ``instances`` lacks is refused, naming it (as the harness does)."""
    if data is None:
        return {i.instance_id: Prediction(i.instance_id, GOLD_MODEL, i.patch) for i in instances}
    out: dict[str, Prediction] = {}
    for i, rec in enumerate(_records(data, what)):
        if not isinstance(rec, dict):
            raise BadInput(f"{what}: record {i} is not a JSON object")
        iid = _str_field(rec, "instance_id", f"{what}: record {i}")
        model = rec.get("model_name_or_path")
        if not isinstance(model, str) or not model.strip() or ".." in model:
            raise BadInput(f"{what}: {iid}: model_name_or_path must be a non-empty string")
        safe_component(model.replace("/", "__"), f"{what}: {iid}: model_name_or_path")
        patch = rec.get("model_patch")
        if patch is not None and not isinstance(patch, str):
            raise BadInput(f"{what}: {iid}: model_patch must be a string or null")
        out[iid] = Prediction(iid, model, patch)
    unknown = sorted(set(out) - {i.instance_id for i in instances})
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise BadInput(f"{what}: instance {unknown[0]}{more} is not in the dataset")
    return out


def parse_specs(data: bytes, what: str = "spec file") -> dict[str, RepoSpec]:
    """gitrun's spec file: JSON keyed by ``owner/name`` or ``owner/name@version``, each
    entry in the harness's vocabulary (:class:`RepoSpec`), strictly read."""
    try:
        doc = json.loads(data)
    except json.JSONDecodeError as exc:
        raise BadInput(f"{what}: not JSON ({exc.msg})") from exc
    if not isinstance(doc, dict):
        raise BadInput(f"{what}: expected a JSON object keyed by 'owner/name[@version]'")
    out = {}
    for key, rec in doc.items():
        if not isinstance(rec, dict):
            raise BadInput(f"{what}: {key} must be an object")
        spec = spec_from(rec, f"{what}: {key}")
        if spec is None:
            raise BadInput(f"{what}: {key} needs test_cmd")
        out[key] = spec
    return out


# The harness 4.x's get_test_directives: the files test_patch touches, but data files.
_NON_TEST_EXTS = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml",
                  ".yaml", ".toml")  # fmt: skip


def test_directives(inst: Instance) -> tuple[str, ...]:
    """What the harness appends to the test command (4.x ``get_test_directives``): the
    files the test patch touches, data files left out; Django's as dotted test modules."""
    if inst.repo == "swe-bench/humaneval":  # the harness's fixed command for that repo
        return ("test.py",)
    found = re.findall(r"diff --git a/.* b/(.*)", inst.test_patch)
    paths = [d for d in found if not d.endswith(_NON_TEST_EXTS)]
    if inst.repo == "django/django":
        paths = [d.removesuffix(".py").removeprefix("tests/").replace("/", ".") for d in paths]
    return tuple(paths)


def eval_script_test_cmd(script: str) -> str | None:
    """The test command of a swebench 5.x ``eval_script``: its lines between the
    harness's start and end markers (directives included); None when it has no markers."""
    lines = script.splitlines()
    starts = [n for n, x in enumerate(lines) if START_TEST_OUTPUT in x]
    ends = [n for n, x in enumerate(lines) if END_TEST_OUTPUT in x]
    if not starts or not ends or ends[0] <= starts[0] + 1:
        return None
    return "\n".join(lines[starts[0] + 1 : ends[0]]).strip() or None


def instance_report(
    inst: Instance, patch: str | None, applied: bool, outcomes: Mapping[str, str] | None
) -> dict[str, Any]:
    """The harness's per-instance ``report.json`` body (swebench 5.x's shape: 4.x's fields
    and ``infra_failure``). Graded as 5.x grades (``get_eval_tests_report``): a
    FAIL_TO_PASS test passes when it passed (an xfail is a pass); a PASS_TO_PASS test is
    kept when it passed or was skipped; a test absent from the run fails. A ``fail_only``
    row (``eval_type``) fails only a test that failed; with no required test run at all
    it is not resolved (the harness's grader finds no sign the suite ran)."""
    body: dict[str, Any] = {
        "patch_is_None": patch is None,
        "patch_exists": patch is not None,
        "patch_successfully_applied": applied and outcomes is not None,
        "resolved": False,
        "infra_failure": False,
    }
    if outcomes is None:
        return {inst.instance_id: body}
    fail_only = inst.eval_type == FAIL_ONLY
    status: dict[str, dict[str, list[str]]] = {
        "FAIL_TO_PASS": _split(inst.fail_to_pass, outcomes, ("passed",), fail_only),
        "PASS_TO_PASS": _split(inst.pass_to_pass, outcomes, ("passed", "skipped"), fail_only),
        "FAIL_TO_FAIL": {"success": [], "failure": []},
        "PASS_TO_FAIL": {"success": [], "failure": []},
    }
    ran = not fail_only or any(
        outcomes.get(t) not in (None, "missing") for t in (*inst.fail_to_pass, *inst.pass_to_pass)
    )
    body["resolved"] = ran and not (
        status["FAIL_TO_PASS"]["failure"] or status["PASS_TO_PASS"]["failure"]
    )
    body["tests_status"] = status
    return {inst.instance_id: body}


def _split(
    tests: Sequence[str], outcomes: Mapping[str, str], good: tuple[str, ...], fail_only: bool
) -> dict[str, list[str]]:
    if fail_only:  # the harness's check_fail_only: only a test that failed is a failure
        bad = [t for t in tests if outcomes.get(t) == "failed"]
        return {"success": [t for t in tests if t not in bad], "failure": bad}
    return {
        "success": [t for t in tests if outcomes.get(t) in good],
        "failure": [t for t in tests if outcomes.get(t) not in good],
    }


def harness_log(printed: bytes, exit_code: int | None, command: str) -> bytes:
    """``test_output.txt`` in the shape the harness's eval script leaves (``set -x``
    lines, the markers around the test command's output, 5.x's exit status line), so its
    grader reads gitrun's logs as its own. ``printed`` is the command's whole output."""
    body = printed + (b"" if not printed or printed.endswith(b"\n") else b"\n")
    code = "" if exit_code is None else str(exit_code)
    head = f"+ : '{START_TEST_OUTPUT}'\n+ {command}\n".encode()
    tail = f"+ SWEBENCH_TEST_EXIT_CODE={code}\n+ : '{END_TEST_OUTPUT}'\n"
    if exit_code is not None:
        tail += f"+ echo '{TEST_EXIT_CODE}: {code}'\n{TEST_EXIT_CODE}: {code}\n"
    return head + body + tail.encode()


def classify_text(text: str) -> tuple[str, str] | None:
    """The harness 5.x's ``(reason, tier)`` for a failed instance's logs, or None."""
    for reason, tier, pattern in INFRA_SIGNATURES:
        if text and pattern.search(text):
            return reason, tier
    return None


def run_report(
    instances: Sequence[Instance],
    submitted: Sequence[str],
    results: Mapping[str, str],
    failures: Mapping[str, tuple[str, str]] | None = None,
    errors: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The harness's ``<model>.<run_id>.json`` (swebench 5.x's shape, ``schema_version``
    2); ``results`` maps an id to resolved, unresolved, empty_patch or error (absent: not
    finished); ``failures`` an unresolved or error id to its ``(reason, tier)``
    (:func:`classify_text`, or gitrun's own knowledge of an environment that failed);
    ``errors`` an error id to gitrun's one-line reason (``gitrun_error_reasons``, gitrun's
    own field)."""
    ids = sorted(i.instance_id for i in instances)

    def pick(*kinds: str) -> list[str]:
        return sorted(i for i, r in results.items() if r in kinds)

    failed = {
        i: f for i, f in (failures or {}).items() if results.get(i) in ("unresolved", "error")
    }
    infra = sorted(i for i, (_, tier) in failed.items() if tier == TIER_ENVIRONMENT)
    ambiguous = sorted(i for i, (_, tier) in failed.items() if tier != TIER_ENVIRONMENT)
    completed = pick("resolved", "unresolved")
    incomplete = sorted(set(ids) - set(submitted))
    return {
        "total_instances": len(ids),
        "submitted_instances": len(submitted),
        "completed_instances": len(completed),
        "resolved_instances": len(pick("resolved")),
        "unresolved_instances": len(pick("unresolved")),
        "infra_failure_instances": len(infra),
        "ambiguous_failure_instances": len(ambiguous),
        "empty_patch_instances": len(pick("empty_patch")),
        "error_instances": len(pick("error")),
        "completed_ids": completed,
        "incomplete_ids": incomplete,
        "empty_patch_ids": pick("empty_patch"),
        "submitted_ids": sorted(submitted),
        "resolved_ids": pick("resolved"),
        "unresolved_ids": pick("unresolved"),
        "infra_failure_ids": infra,
        "ambiguous_failure_ids": ambiguous,
        "failure_reasons": {i: failed[i][0] for i in sorted(failed)},
        "error_ids": pick("error"),
        "schema_version": 2,
        "gitrun_error_reasons": {i: r for i, r in sorted((errors or {}).items())
                                 if results.get(i) == "error"},
    }  # fmt: skip
