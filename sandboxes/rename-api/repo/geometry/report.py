from geometry.shapes import calc_area


def describe(radius: float) -> str:
    return f"a circle of radius {radius} covers {calc_area(radius):.2f}"
