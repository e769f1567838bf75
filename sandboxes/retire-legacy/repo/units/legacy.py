"""Deprecated 1.x helpers, kept only until every caller moved to units.convert.

They silently round to whole numbers, which is what the dashboard bug report is about.
"""

from units.convert import celsius_to_fahrenheit, km_to_miles


def miles(km: float) -> int:
    return round(km_to_miles(km))


def fahrenheit(celsius: float) -> int:
    return round(celsius_to_fahrenheit(celsius))
