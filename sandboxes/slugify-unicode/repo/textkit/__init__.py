"""Text helpers for URLs and file names."""

from textkit.filenames import safe_filename
from textkit.slug import slugify

__all__ = ["safe_filename", "slugify"]
