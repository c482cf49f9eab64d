"""The privacy plan of a run: the one home of its mechanism (q, sigma, T, delta, C), and its step count.

:class:`PrivacyPlan` is decided once, before training, from the arguments and the
dataset size (calibrating sigma for a ``target_epsilon``); the trainer, the
optimizer it builds, the budget stop, the printed plan, the logs and the card
all read it. It also gives the run's DP event for ``dp_accounting``.

How many steps a run takes is the one computation the CLI, the trainer, the recipes and the
card share.

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

import dataclasses
import logging
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from dp_hf.validation import (
    check_positive_int,
    check_sample_rate,
    default_delta,
    warn_if_delta_too_large,
)

__all__ = [
    "ADJACENCY",
    "PRIVACY_UNIT",
    "PrivacyPlan",
    "expected_batch_size",
    "planned_steps",
    "steps_per_epoch",
]

logger = logging.getLogger(__name__)

PRIVACY_UNIT = "one training example (one row of the training dataset)"
ADJACENCY = "add/remove: neighbouring training sets differ by adding or removing one example"


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

    Computed exactly on the integers, rounding half to even like Python's ``round``. Given ``q``, on the
    fraction ``B / N`` it is the float of (the simplest one within ``2^-50`` of it, denominator up to
    ``10^7``), else on its decimal value: ``q = 200 / 1100`` as the decimal ``0.18181818181818182`` rounded
    ``1 / q = 5.49999...`` to 5 steps where the trainer's ``round(1100 / 200)`` takes 6.
    """
    if dataset_size is not None and expected_batch_size is not None:
        n = check_positive_int("dataset_size", dataset_size)
        b = check_positive_int("expected_batch_size", expected_batch_size)
        ratio = Fraction(n, b)
    elif sample_rate is not None:
        q = Fraction(check_sample_rate(sample_rate))
        simplest = q.limit_denominator(10**7)
        ratio = 1 / (
            simplest if simplest and abs(simplest - q) <= q * Fraction(1, 2**50) else Fraction(repr(float(q)))
        )
    else:
        raise ValueError("steps_per_epoch needs dataset_size and expected_batch_size, or sample_rate.")
    return max(1, round(ratio))


def shuffled_steps_per_epoch(
    dataset_size: int,
    per_device_batch: int,
    accumulation: int,
    world_size: int = 1,
    *,
    drop_last: bool = False,
) -> int:
    """Optimizer steps per epoch of shuffled fixed-size batches, as ``transformers.Trainer`` counts them.

    The data loader yields ``ceil(N / b)`` batches, shared among the ``world_size`` processes (accelerate
    gives each the same number); with ``drop_last``, ``floor(N / b)`` batches and the remainder that does
    not fill every process is dropped. An epoch is ``ceil(batches per process / accumulation)`` steps.
    """
    n = check_positive_int("dataset_size", dataset_size)
    b = check_positive_int("per_device_batch", per_device_batch)
    world = check_positive_int("world_size", world_size)
    per_process = (n // b) // world if drop_last else math.ceil(math.ceil(n / b) / world)
    return max(1, math.ceil(per_process / check_positive_int("accumulation", accumulation)))


def _check_shuffle_shards_without_repeats(args: Any, dataset_size: int) -> None:
    """Refuse shuffled batches that accelerate would complete with examples already trained this epoch."""
    batch, world = args.per_device_train_batch_size, args.world_size
    if world > 1 and not args.dataloader_drop_last and dataset_size % (batch * world):
        raise ValueError(
            f"poisson_sampling=False on {world} processes: {dataset_size} examples do not fill the epoch's last "
            f"batches of {batch} on every process ({dataset_size} is not a multiple of {batch * world}), and "
            "accelerate completes them with examples from the start of the epoch, which would then be trained "
            "twice in the epoch. Set dataloader_drop_last=True (the last examples of each epoch's shuffle are "
            "left out), or keep poisson_sampling=True."
        )


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


@dataclass(frozen=True)
class PrivacyPlan:
    """The mechanism of one private run, fixed before training: the single source of q, sigma, T, delta, C.

    Each step samples every one of ``dataset_size`` examples with probability ``sample_rate``
    (``expected_batch_size / dataset_size``), clips each example's gradient to ``max_grad_norm`` in
    the optimizer's geometry (``None``: an optimizer with its own adaptive bound, DP-MacAdam's 1),
    adds ``N(0, noise_multiplier^2 C^2)`` once and divides by ``expected_batch_size``;
    ``planned_steps`` such steps make ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), T)``,
    accounted by ``accountant`` at ``delta``. ``target_epsilon`` is the budget sigma was calibrated
    for (``None`` when sigma was given). ``disable_dp`` plans are the non-private baseline.
    """

    dataset_size: int
    expected_batch_size: int
    sample_rate: float
    steps_per_epoch: int
    planned_steps: int
    noise_multiplier: float
    delta: float
    delta_is_default: bool
    max_grad_norm: float | None
    accountant: str
    target_epsilon: float | None = None
    poisson_sampling: bool = True
    disable_dp: bool = False
    unit: str = PRIVACY_UNIT
    adjacency: str = ADJACENCY

    @classmethod
    def from_arguments(cls, args: Any, dataset_size: int, adaptive_clipping: bool = False) -> PrivacyPlan:
        """The plan for ``args`` (a :class:`~dp_hf.training_args.DPArgumentsMixin`) and ``N = dataset_size``.

        Calibrates sigma for ``args.target_epsilon`` over the planned steps; warns when delta is
        not below ``1/N`` and when batches are shuffled instead of Poisson-sampled.
        """
        from dp_hf.accounting import calibrate_noise_multiplier

        batch = int(args.expected_batch_size)
        if batch > dataset_size:
            raise ValueError(
                f"expected logical batch {batch} (per_device_train_batch_size * gradient_accumulation_steps * "
                f"world_size) exceeds the dataset size {dataset_size}; reduce the batch."
            )
        if args.poisson_sampling and not args.disable_dp:
            epoch_steps = steps_per_epoch(dataset_size=dataset_size, expected_batch_size=batch)
        else:  # shuffled fixed-size batches: the epoch is the Trainer's data loader
            if not args.disable_dp:
                _check_shuffle_shards_without_repeats(args, dataset_size)
            epoch_steps = shuffled_steps_per_epoch(
                dataset_size,
                args.per_device_train_batch_size,
                args.gradient_accumulation_steps,
                args.world_size,
                drop_last=args.dataloader_drop_last,
            )
        steps = planned_steps(epoch_steps, num_train_epochs=args.num_train_epochs, max_steps=args.max_steps)
        delta_is_default = args.target_delta is None
        delta = default_delta(dataset_size) if delta_is_default else float(args.target_delta)
        sample_rate = batch / dataset_size
        common = dict(
            dataset_size=dataset_size,
            expected_batch_size=batch,
            sample_rate=sample_rate,
            steps_per_epoch=epoch_steps,
            planned_steps=steps,
            delta=delta,
            delta_is_default=delta_is_default,
            accountant=args.accountant,
            poisson_sampling=bool(args.poisson_sampling),
        )
        if args.disable_dp:
            logger.warning("disable_dp=True: this run is NOT private (no clipping, no noise).")
            return cls(**common, noise_multiplier=0.0, max_grad_norm=None, disable_dp=True)
        warn_if_delta_too_large(delta, dataset_size)
        if args.noise_multiplier is not None:
            sigma = float(args.noise_multiplier)
        else:
            sigma = calibrate_noise_multiplier(
                args.target_epsilon, delta, sample_rate, steps, accountant=args.accountant
            )
        if not args.poisson_sampling:
            from dp_hf.sampling import warn_shuffled_sampling

            warn_shuffled_sampling()
        return cls(
            **common,
            noise_multiplier=sigma,
            max_grad_norm=None if adaptive_clipping else float(args.per_sample_max_grad_norm),
            target_epsilon=args.target_epsilon,
        )

    @property
    def epochs(self) -> float:
        """The planned steps in the Trainer's epochs (``planned_steps / steps_per_epoch``)."""
        return self.planned_steps / self.steps_per_epoch

    @property
    def expected_passes(self) -> float:
        """How many times each example is sampled in expectation over the planned steps (``T * q``)."""
        return self.planned_steps * self.sample_rate

    def epsilon(self, steps: int | None = None) -> float:
        """Epsilon at ``delta`` after ``steps`` steps of this plan (default: the planned steps)."""
        from dp_hf.accounting import compute_epsilon

        if self.disable_dp:
            return math.inf
        steps = self.planned_steps if steps is None else steps
        return compute_epsilon(self.sample_rate, self.noise_multiplier, steps, self.delta, self.accountant)

    def dp_event(self, steps: int | None = None) -> Any:
        """``SelfComposed(PoissonSampled(q, Gaussian(sigma)), T)`` as a ``dp_accounting`` event."""
        import dp_accounting

        steps = self.planned_steps if steps is None else steps
        step = dp_accounting.PoissonSampledDpEvent(
            self.sample_rate, dp_accounting.GaussianDpEvent(self.noise_multiplier)
        )
        return dp_accounting.SelfComposedDpEvent(step, steps)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
