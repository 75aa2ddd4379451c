"""The calibration pipeline (generic: it names no method): capture, Hessians and statistics, the
calibration cache, Fisher salience, smoothing folds, recipes and the run report."""

from .calibration import StopForward
from .pipeline import quantize_model
from .report import RunReport
from .run import run
from .settings import Calibration, RunSettings

__all__ = ["Calibration", "RunReport", "RunSettings", "StopForward", "quantize_model", "run"]
