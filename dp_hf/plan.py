"""How many steps a run takes: the one computation the CLI, the trainer, the recipes and the card share.

The accountant composes one Poisson-subsampled Gaussian step per optimizer step,
so a noise multiplier calibrated for ``T`` steps meets its budget only if the run
takes at most ``T`` steps. The ``dp-hf noise`` planning command and
:class:`~dp_hf.DPTrainer` therefore must count steps identically; both call
:func:`planned_steps`.

With Poisson sampling at rate ``q = B / N`` (``B`` the expected logical batch
over all processes: ``per_device_train_batch_size * gradient_accumulation_steps
* num_processes``) an *epoch* is defined as ``round(N / B)`` logical steps, so
that each example is sampled about once per epoch in expectation. A run of
``E`` epochs takes ``ceil(E * round(N / B))`` steps, computed with the same
floating-point product as ``transformers.Trainer`` (which decides how many steps
actually run); ``max_steps > 0`` overrides the epochs, as in the Trainer.
Each example is then sampled ``T * q`` times in expectation, which is not
exactly ``E`` (``round`` is not ``N / B``): the card states both.
"""

from __future__ import annotations

import math
from fractions import Fraction

from dp_hf.validation import check_positive_int, check_sample_rate

__all__ = ["expected_batch_size", "planned_steps", "steps_per_epoch"]


def expected_batch_size(
    per_device_train_batch_size: int, gradient_accumulation_steps: int = 1, num_processes: int = 1
) -> int:
    """The expected logical batch ``B`` over all processes (Poisson sampling draws ``B`` in expectation)."""
    return (
        check_positive_int("per_device_train_batch_size", per_device_train_batch_size)
        * check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
        * check_positive_int("num_processes", num_processes)
    )


def steps_per_epoch(
    *,
    dataset_size: int | None = None,
    expected_batch_size: int | None = None,
    sample_rate: float | None = None,
) -> int:
    """Logical steps per epoch: ``max(1, round(N / B))``, or ``round(1 / q)`` given only ``q``.

    Computed exactly on the integers (or on the decimal value of ``q``), rounding half to even
    like Python's ``round``.
    """
    if dataset_size is not None and expected_batch_size is not None:
        n = check_positive_int("dataset_size", dataset_size)
        b = check_positive_int("expected_batch_size", expected_batch_size)
        ratio = Fraction(n, b)
    elif sample_rate is not None:
        ratio = 1 / Fraction(repr(check_sample_rate(sample_rate)))
    else:
        raise ValueError("steps_per_epoch needs dataset_size and expected_batch_size, or sample_rate.")
    return max(1, round(ratio))


def planned_steps(
    epoch_steps: int, *, num_train_epochs: float | None = None, max_steps: int | None = None
) -> int:
    """Optimizer steps of a run: ``max_steps`` when positive, else ``ceil(num_train_epochs * epoch_steps)``.

    ``epoch_steps`` comes from :func:`steps_per_epoch`. The product is the float product that
    ``transformers.Trainer`` computes, so the count is the one the Trainer runs (e.g. 0.55
    epochs of 100 steps are 56 steps there: ``0.55 * 100 = 55.00000000000001``).
    """
    epoch_steps = check_positive_int("steps per epoch", epoch_steps)
    if max_steps is not None and max_steps > 0:
        return int(max_steps)
    if num_train_epochs is None or not (math.isfinite(num_train_epochs) and num_train_epochs > 0):
        raise ValueError(
            f"num_train_epochs must be positive and finite when max_steps is not set, got {num_train_epochs!r}."
        )
    return math.ceil(num_train_epochs * epoch_steps)
