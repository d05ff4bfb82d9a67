"""Offline calibration: capture Q/K/V statistics, fit rotations, calibrate clip ratios, bundle files."""

from .bundle import (
    BundleError,
    RotationBundle,
    data_free_bundle,
    load_bundle,
    load_seed_pt,
    orthogonality_error,
    save_bundle,
)
from .capture import CalibrationStats, capture_statistics
from .clip_calibration import DEFAULT_RHO_GRID, ClipChoice, calibrate_layer_clip
from .fit import COMPOSITIONS, METHODS, compose, fit_bundle

__all__ = [
    "BundleError",
    "COMPOSITIONS",
    "CalibrationStats",
    "ClipChoice",
    "DEFAULT_RHO_GRID",
    "METHODS",
    "RotationBundle",
    "calibrate_layer_clip",
    "capture_statistics",
    "compose",
    "data_free_bundle",
    "fit_bundle",
    "load_bundle",
    "load_seed_pt",
    "orthogonality_error",
    "save_bundle",
]
