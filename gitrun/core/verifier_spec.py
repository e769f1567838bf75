"""What a task's verifier is and what one run of it found: :class:`VerifierSpec` (the
test command and the FAIL_TO_PASS / PASS_TO_PASS ids) and :class:`VerifierResult`.

Records with their strict JSON codec, apart from :mod:`gitrun.engine.verifier` (which runs the
command) so that a task file can be parsed without loading git or the sandbox runner;
:mod:`gitrun.engine.verifier` re-exports both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from gitrun.core import isolation as settings
from gitrun.core.errors import BadInput

__all__ = ["VerifierResult", "VerifierSpec", "positive_number"]

_SPEC_FIELDS = frozenset({"command", "junit", "fail_to_pass", "pass_to_pass", "timeout_seconds"})
_OPTIONAL_SPEC_FIELDS = frozenset({"isolation"})


@dataclass(frozen=True)
class VerifierSpec:
    """How to verify a task: the test command and the tests that must pass."""

    command: tuple[str, ...]
    junit: bool
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    timeout_seconds: float
    isolation: str = settings.AUTO  # the task's setting; a command-line --isolation overrides it

    def __post_init__(self) -> None:
        for name in ("command", "fail_to_pass", "pass_to_pass"):
            object.__setattr__(self, name, _str_tuple(name, getattr(self, name)))
        if not self.command:
            raise BadInput("verifier command is empty")
        if not isinstance(self.junit, bool):
            raise BadInput("verifier junit must be true or false")
        if not positive_number(self.timeout_seconds):
            raise BadInput(
                f"verifier timeout_seconds must be positive, not {self.timeout_seconds!r}"
            )
        if self.junit and not self.required:
            raise BadInput("a JUnit verifier needs at least one FAIL_TO_PASS or PASS_TO_PASS id")
        settings.check_setting(self.isolation, "verifier isolation")

    @property
    def required(self) -> tuple[str, ...]:
        """Every FAIL_TO_PASS and PASS_TO_PASS id once, in spec order."""
        return tuple(dict.fromkeys(self.fail_to_pass + self.pass_to_pass))

    def to_json(self) -> dict[str, object]:
        """The canonical JSON form (lists, not tuples).

        ``isolation`` appears only when it is not the default, so the scenario fingerprint
        of every task that does not set it is what it was before the setting existed.
        """
        out: dict[str, object] = {
            "command": list(self.command),
            "junit": self.junit,
            "fail_to_pass": list(self.fail_to_pass),
            "pass_to_pass": list(self.pass_to_pass),
            "timeout_seconds": float(self.timeout_seconds),
        }
        if self.isolation != settings.AUTO:
            out["isolation"] = self.isolation
        return out

    @classmethod
    def from_json(cls, data: object) -> VerifierSpec:
        """Decode :meth:`to_json` output strictly: unknown or missing fields are refused."""
        if not isinstance(data, Mapping):
            raise BadInput("verifier spec must be a JSON object")
        unknown = set(data) - _SPEC_FIELDS - _OPTIONAL_SPEC_FIELDS
        missing = _SPEC_FIELDS - set(data)
        if unknown or missing:
            raise BadInput(f"verifier spec: unknown {sorted(unknown)}, missing {sorted(missing)}")
        junit, timeout = data["junit"], data["timeout_seconds"]
        isolation = data.get("isolation", settings.AUTO)
        if not isinstance(isolation, str):
            raise BadInput(f"verifier isolation must be a string, not {isolation!r}")
        if not isinstance(junit, bool):
            raise BadInput("verifier junit must be true or false")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise BadInput(f"verifier timeout_seconds must be a number, not {timeout!r}")
        return cls(
            command=_str_tuple("command", data["command"]),
            junit=junit,
            fail_to_pass=_str_tuple("fail_to_pass", data["fail_to_pass"]),
            pass_to_pass=_str_tuple("pass_to_pass", data["pass_to_pass"]),
            timeout_seconds=float(timeout),
            isolation=isolation,
        )


@dataclass(frozen=True)
class VerifierResult:
    """What one verifier run found; ``outcomes`` covers only the required ids."""

    passed: bool
    outcomes: dict[str, str]
    exit_code: int | None
    timed_out: bool
    duration_seconds: float
    summary: str
    output_tail: str

    def to_json(self) -> dict[str, object]:
        """The canonical JSON form."""
        return {
            "passed": self.passed,
            "outcomes": dict(self.outcomes),
            "exit_code": self.exit_code,
            "timed_out": self.timed_out,
            "duration_seconds": round(self.duration_seconds, 3),
            "summary": self.summary,
            "output_tail": self.output_tail,
        }


def positive_number(value: object) -> bool:
    """A finite, positive int or float (a bool is no number here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and value > 0


def _str_tuple(name: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise BadInput(f"verifier {name} must be a list of strings")
    items = tuple(value)
    if not all(isinstance(item, str) and item for item in items):
        raise BadInput(f"verifier {name} must hold only non-empty strings")
    return items
