from geometry import shapes


def total_area(radii: list[float]) -> float:
    return sum(shapes.calc_area(r) for r in radii)
