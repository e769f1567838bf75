"""Small descriptive-statistics helpers."""

from stats.mean import mean
from stats.median import median

__all__ = ["mean", "median"]
