"""SWE-bench files, pure: instance records, predictions, per-repo specs, the report shapes.

Parsing follows the harness's field names (``repo, instance_id, base_commit, patch,
test_patch, FAIL_TO_PASS, PASS_TO_PASS, version, ...``); FAIL_TO_PASS / PASS_TO_PASS are
JSON-encoded strings in the published datasets, lists elsewhere. Nothing here reads a file
it was not handed as bytes, nor touches git.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gitrun.core.codec import digest
from gitrun.core.errors import BadInput

__all__ = [
    "Instance",
    "Prediction",
    "RepoSpec",
    "instance_report",
    "parse_instances",
    "parse_predictions",
    "parse_specs",
    "run_report",
    "safe_component",
]

GOLD = "gold"
_MAX_COMPONENT_BYTES = 200  # a file name holds 255; room for the report's suffixes
GOLD_MODEL = "gold"


@dataclass(frozen=True)
class RepoSpec:
    """How to test a repository (or one version of it): the command and its requirements."""

    test_cmd: str
    pip_requirements: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {"test_cmd": self.test_cmd, "pip_requirements": list(self.pip_requirements)}


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


def _record_spec(rec: Mapping[str, Any], where: str) -> RepoSpec | None:
    cmd = rec.get("test_cmd", rec.get("test_command"))
    if cmd is None:
        return None
    if isinstance(cmd, list) and all(isinstance(c, str) for c in cmd):
        cmd = " ".join(cmd)
    if not isinstance(cmd, str) or not cmd.strip():
        raise BadInput(f"{where}: test_cmd must be a non-empty string")
    return RepoSpec(cmd, _requirements(rec.get("pip_requirements", []), where))


def _requirements(value: object, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = value.split()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadInput(f"{where}: pip_requirements must be a list of requirement strings")
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
            )
        )  # fmt: skip
    return tuple(out)


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
    """Predictions by instance id; ``data=None`` means ``gold`` (each instance's own patch)."""
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
    return out


def parse_specs(data: bytes, what: str = "spec file") -> dict[str, RepoSpec]:
    """The per-repo spec file: JSON keyed by ``owner/name`` or ``owner/name@version``,
    each ``{"test_cmd": ..., "pip_requirements": [...]}``."""
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
        spec = _record_spec(rec, f"{what}: {key}")
        if spec is None:
            raise BadInput(f"{what}: {key} needs test_cmd")
        out[key] = spec
    return out


def instance_report(
    inst: Instance, patch: str | None, applied: bool, outcomes: Mapping[str, str] | None
) -> dict[str, Any]:
    """The harness's per-instance ``report.json`` body for this instance."""
    body: dict[str, Any] = {
        "patch_is_None": patch is None,
        "patch_exists": bool(patch),
        "patch_successfully_applied": applied,
        "resolved": False,
    }
    if outcomes is None:
        return {inst.instance_id: body}
    status: dict[str, dict[str, list[str]]] = {
        "FAIL_TO_PASS": _split(inst.fail_to_pass, outcomes),
        "PASS_TO_PASS": _split(inst.pass_to_pass, outcomes),
        "FAIL_TO_FAIL": {"success": [], "failure": []},
        "PASS_TO_FAIL": {"success": [], "failure": []},
    }
    body["resolved"] = (
        not status["FAIL_TO_PASS"]["failure"] and not status["PASS_TO_PASS"]["failure"]
    )
    body["tests_status"] = status
    return {inst.instance_id: body}


def _split(tests: Sequence[str], outcomes: Mapping[str, str]) -> dict[str, list[str]]:
    return {
        "success": [t for t in tests if outcomes.get(t) == "passed"],
        "failure": [t for t in tests if outcomes.get(t) != "passed"],
    }


def run_report(
    instances: Sequence[Instance], submitted: Sequence[str], results: Mapping[str, str]
) -> dict[str, Any]:
    """The harness's ``<model>.<run_id>.json``; ``results`` maps an id to resolved,
    unresolved, empty_patch or error (absent: not finished)."""
    ids = sorted(i.instance_id for i in instances)

    def pick(*kinds: str) -> list[str]:
        return sorted(i for i, r in results.items() if r in kinds)

    completed = pick("resolved", "unresolved")
    incomplete = sorted(set(ids) - set(results))
    return {
        "total_instances": len(ids),
        "submitted_instances": len(submitted),
        "completed_instances": len(completed),
        "resolved_instances": len(pick("resolved")),
        "unresolved_instances": len(pick("unresolved")),
        "empty_patch_instances": len(pick("empty_patch")),
        "error_instances": len(pick("error")),
        "completed_ids": completed,
        "incomplete_ids": incomplete,
        "empty_patch_ids": pick("empty_patch"),
        "submitted_ids": sorted(submitted),
        "resolved_ids": pick("resolved"),
        "unresolved_ids": pick("unresolved"),
        "error_ids": pick("error"),
        "schema_version": 2,
    }
