"""Deprecated alias of :mod:`dp_hf.per_example` (fast per-example clipping); import from there.

Kept so that existing imports keep working: every public name this module exported is re-exported
from its new home (:mod:`dp_hf.per_example.ghost` for :class:`FastClipping` and
:func:`attach_fast_clipping`, :mod:`dp_hf.per_example.modes` for the mode names and
:func:`resolve_per_sample_gradient_mode`). Note: ``resolve_per_sample_gradient_mode`` looks up
``dp_hf.per_example.modes.unsupported_modules``; patching ``unsupported_modules`` here has no effect.
"""

from __future__ import annotations

from dp_hf.per_example.errors import PerSampleGradientError, UnsupportedModuleError
from dp_hf.per_example.ghost.clipping import FastClipping, attach_fast_clipping
from dp_hf.per_example.ghost.norms import clip_factors  # the fast path's clipping rule (dp_hf.privatizer's)
from dp_hf.per_example.ghost.support import unsupported_modules
from dp_hf.per_example.modes import (
    LAYER_STRATEGIES,
    PER_SAMPLE_GRADIENT_MODES,
    has_identity_geometry,
    is_identity_geometry,
    resolve_per_sample_gradient_mode,
)
from dp_hf.per_example.validate import validate_model
from dp_hf.privatizer import Geometry

__all__ = [
    "FastClipping",
    "Geometry",
    "LAYER_STRATEGIES",
    "PER_SAMPLE_GRADIENT_MODES",
    "PerSampleGradientError",
    "UnsupportedModuleError",
    "attach_fast_clipping",
    "clip_factors",
    "has_identity_geometry",
    "is_identity_geometry",
    "resolve_per_sample_gradient_mode",
    "unsupported_modules",
    "validate_model",
]
