"""Portable file names."""

import re

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
MAX_LENGTH = 255


def safe_filename(name: str, replacement: str = "_") -> str:
    """Return *name* reduced to characters that are safe on every platform.

    Unsafe runs become *replacement*, leading dots are removed (no hidden
    files) and the result is cut to MAX_LENGTH characters.
    """
    name = name.strip()
    name = name.encode("ascii", "ignore").decode("ascii")
    name = _UNSAFE.sub(replacement, name).lstrip(".")
    return (name or "unnamed")[:MAX_LENGTH]
