"""Unit conversions for the fleet dashboard."""

from units.convert import celsius_to_fahrenheit, km_to_miles

__all__ = ["celsius_to_fahrenheit", "km_to_miles"]
