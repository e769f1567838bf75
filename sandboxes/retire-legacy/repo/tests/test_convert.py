import importlib

import pytest

from units import celsius_to_fahrenheit, km_to_miles


def test_km_to_miles():
    assert km_to_miles(1.609344) == pytest.approx(1.0)


def test_marathon_in_miles():
    assert km_to_miles(42.195) == pytest.approx(26.2188, abs=1e-4)


def test_freezing_point():
    assert celsius_to_fahrenheit(0) == 32


def test_body_temperature():
    assert celsius_to_fahrenheit(37) == pytest.approx(98.6)


def test_legacy_rounding_helpers_are_gone():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("units.legacy")
