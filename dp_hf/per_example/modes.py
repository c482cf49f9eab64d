"""How per-example clipping is computed: the mode names (one list) and the policy that picks one.

* ``"ghost"``: per-example norms without per-example gradients; only for optimizers that clip in
  the identity geometry (``c = 0``, ``s = 1``).
* ``"materialize"``: per-example gradients formed layer by layer; any geometry.
* ``"auto"`` (``DPTrainingArguments.per_sample_gradient_mode`` only): ghost when possible.

Either fast mode needs every trainable module to be supported by the fast path
(``dp_hf.per_example.ghost.unsupported_modules``, looked up there on each call, so patching it there
is seen); otherwise Opacus's hooks write ``p.grad_sample``. Importing this module is cheap (no
Opacus, no transformers): the fast path is loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from dp_hf.per_example.errors import UnsupportedModuleError

if TYPE_CHECKING:
    from dp_hf.privatizer import Geometry

__all__ = [
    "AUTO",
    "FAST_CLIPPING_MODES",
    "GHOST",
    "LAYER_STRATEGIES",
    "MATERIALIZE",
    "PER_SAMPLE_GRADIENT_MODES",
    "has_identity_geometry",
    "is_identity_geometry",
    "resolve_per_sample_gradient_mode",
]

AUTO, GHOST, MATERIALIZE = "auto", "ghost", "materialize"

#: Modes of :class:`~dp_hf.per_example.ghost.clipping.FastClipping`.
FAST_CLIPPING_MODES = (GHOST, MATERIALIZE)

#: Values of ``DPTrainingArguments.per_sample_gradient_mode``.
PER_SAMPLE_GRADIENT_MODES = (AUTO, *FAST_CLIPPING_MODES)

#: Layer strategies of FastClipping: ``"auto"`` keeps the smaller of ``G_i`` and ``(a_i, g_i)`` per
#: layer call; ``"ghost"`` / ``"materialize"`` force one (for tests and benchmarks).
LAYER_STRATEGIES = (AUTO, GHOST, MATERIALIZE)


def is_identity_geometry(geometry: Geometry) -> bool:
    """``c = 0`` and ``s = 1`` for every tensor: the clipped sum then needs only per-example norms."""
    shift_identity = geometry.shift is None or all(c is None for c in geometry.shift)
    scale_identity = geometry.scale is None or all(s is None for s in geometry.scale)
    return shift_identity and scale_identity


def has_identity_geometry(optimizer: Any) -> bool:
    """Whether a DP optimizer (class or instance) always clips in the identity geometry.

    True when it declares ``identity_geometry = True`` and does not override ``geometry()``
    (a subclass that adapts its geometry but forgot the flag is thus never given ghost clipping).
    """
    from dp_hf.optim.base import DPOptimizer

    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    if getattr(cls, "identity_geometry", False) is not True:
        return False
    return getattr(cls, "geometry", None) is DPOptimizer.geometry


def resolve_per_sample_gradient_mode(requested: str, optimizer: Any, model: nn.Module) -> tuple[str, bool]:
    """``(mode, fast)`` for a DP optimizer (class or instance) and a model.

    ``mode`` is ``"ghost"`` (norms only, identity geometry) or ``"materialize"`` (per-example
    gradients, any geometry); ``fast`` says whether the fast path's hooks handle the model
    (otherwise Opacus's hooks write ``p.grad_sample``). ``"auto"`` picks ghost whenever the
    optimizer's geometry is the identity and the model is supported.
    """
    if requested not in PER_SAMPLE_GRADIENT_MODES:
        raise ValueError(
            f"per_sample_gradient_mode={requested!r} is unknown; choose one of {list(PER_SAMPLE_GRADIENT_MODES)}."
        )
    from dp_hf.per_example import ghost  # the fast path's support table, looked up at each call

    problems = ghost.unsupported_modules(model)
    identity = has_identity_geometry(optimizer)
    name = optimizer.__name__ if isinstance(optimizer, type) else type(optimizer).__name__
    if requested == GHOST:
        if not identity:
            raise ValueError(
                f"per_sample_gradient_mode='ghost' needs an optimizer that clips in the identity geometry "
                f"(c = 0, s = 1); {name} adapts its clipping geometry and needs the per-example gradients "
                "themselves. Use 'materialize' or 'auto'."
            )
        if problems:
            raise UnsupportedModuleError(problems)
        return GHOST, True
    if requested == MATERIALIZE:
        return MATERIALIZE, not problems
    return (GHOST, True) if identity and not problems else (MATERIALIZE, not problems)
