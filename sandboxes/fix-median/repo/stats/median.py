"""Median of a sequence of numbers."""

from collections.abc import Iterable


def median(values: Iterable[float]) -> float:
    """Return the median (middle value) of *values*.

    The input does not need to be sorted. For an even number of values
    the median is the mean of the two middle values.

    Raises ValueError if *values* is empty.
    """
    data = sorted(values)
    n = len(data)
    if n == 0:
        raise ValueError("median() arg is an empty sequence")
    mid = n // 2
    if n % 2 == 1:
        return data[mid]
    return data[mid]
