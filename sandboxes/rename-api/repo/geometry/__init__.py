from geometry.shapes import calc_area, square_area

__all__ = ["calc_area", "square_area"]
