"""Re-export of :mod:`tcal.models.shapes` for the bench scripts (``from shapes import SHAPES, random_model``)."""
from tcal.models.shapes import SHAPES, random_model

__all__ = ["SHAPES", "random_model"]
