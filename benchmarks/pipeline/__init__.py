"""The pipeline's costs: the calibration statistics cache, data-parallel calibration."""
