"""The calibration pipeline (generic: it names no method): capture, Hessians and statistics, the
calibration cache, Fisher salience, smoothing folds, recipes and the run report."""

from .calibration import StopForward
from .pipeline import quantize_model
from .report import RunReport

__all__ = ["RunReport", "StopForward", "quantize_model"]
