import math


def calc_area(radius: float) -> float:
    """The area of a circle of the given radius."""
    return math.pi * radius * radius


def square_area(side: float) -> float:
    return side * side
