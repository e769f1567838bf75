"""gitrun: a Git-backed runtime for code-editing agents."""

from __future__ import annotations

__version__ = "0.1.0"
