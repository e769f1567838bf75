"""Conversions between metric and imperial units."""

KM_PER_MILE = 1.609344


def km_to_miles(km: float) -> float:
    """Kilometres to miles."""
    return km * KM_PER_MILE


def celsius_to_fahrenheit(celsius: float) -> float:
    """Degrees Celsius to degrees Fahrenheit."""
    return celsius * 9 / 5 + 32
