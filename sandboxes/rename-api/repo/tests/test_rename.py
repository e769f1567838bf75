import math
from pathlib import Path

import geometry
from geometry import report, shapes, totals


def test_circle_area():
    assert math.isclose(geometry.circle_area(2.0), 4 * math.pi)


def test_callers_use_the_new_name():
    assert report.describe(1.0) == "a circle of radius 1.0 covers 3.14"
    assert math.isclose(totals.total_area([1.0, 1.0]), 2 * math.pi)


def test_the_old_name_is_gone():
    assert not hasattr(shapes, "calc_area")
    package = Path(geometry.__file__).parent
    assert not [p.name for p in package.glob("*.py") if "calc_area" in p.read_text()]


def test_square_area():
    assert geometry.square_area(3.0) == 9.0
