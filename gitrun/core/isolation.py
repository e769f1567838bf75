"""The verifier's isolation settings (``--isolation`` / ``[verifier] isolation``): pure
names and their check, shared by the task parser and the sandbox that enforces them."""

from __future__ import annotations

from gitrun.core.errors import BadInput

AUTO = "auto"
REQUIRED = "required"
NONE = "none"
SETTINGS = (AUTO, REQUIRED, NONE)


def check_setting(value: str, where: str = "--isolation") -> str:
    """``value`` if it is an isolation setting, else a one-line :class:`BadInput`."""
    if value not in SETTINGS:
        raise BadInput(f"{where} must be one of {', '.join(SETTINGS)}, not {value!r}")
    return value
