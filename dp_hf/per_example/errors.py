"""The two errors of per-example gradients: a model refused up front, and a run refused as it happens.

:class:`UnsupportedModuleError` is raised before training (or on a call pattern that makes a module
unsupported); :class:`PerSampleGradientError` during a forward or backward pass whose per-example
gradients would be wrong. Both paths (Opacus's hooks and the fast clipping hooks) raise these.
"""

from __future__ import annotations

__all__ = ["PerSampleGradientError", "UnsupportedModuleError"]


class UnsupportedModuleError(ValueError):
    """The model contains a module for which exact per-example gradients cannot be computed.

    ``problems`` lists ``(module_path, module_type_name, reason)`` for every offending module, so
    callers can report all of them at once instead of fixing one per run.
    """

    def __init__(self, problems: list[tuple[str, str, str]]):
        self.problems = problems
        lines = [f"  - {path or '<root>'} ({type_name}): {reason}" for path, type_name, reason in problems]
        super().__init__(
            "dp_hf cannot compute exact per-example gradients for this model:\n" + "\n".join(lines)
        )


class PerSampleGradientError(RuntimeError):
    """Per-example gradients would be wrong for this forward/backward pass (detected at run time)."""
