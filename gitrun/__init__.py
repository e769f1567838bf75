"""gitrun: a Git-backed runtime for code-editing agents."""

from __future__ import annotations

__version__ = "0.1.0"


def version_text() -> str:
    """``gitrun --version``: one line (here, so that both the fast entry point and the
    Typer CLI print it without importing each other)."""
    return f"gitrun {__version__}"
