"""Arithmetic mean."""

from collections.abc import Iterable


def mean(values: Iterable[float]) -> float:
    """Return the arithmetic mean of *values*.

    Raises ValueError if *values* is empty.
    """
    data = list(values)
    if not data:
        raise ValueError("mean() arg is an empty sequence")
    return sum(data) / len(data)
