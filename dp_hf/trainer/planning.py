"""The privacy plan of a :class:`~dp_hf.trainer.DPTrainer`: deciding it before training
(:class:`~dp_hf.plan.PrivacyPlan`), exposing it, printing it, and the training logs (epsilon in every line).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch

from dp_hf.accounting.display import delta_text, epsilon_for_logs, shown, significant
from dp_hf.optim import get_optimizer_class
from dp_hf.plan import PrivacyPlan
from dp_hf.validation import check_dataset_size

logger = logging.getLogger(__name__)


class PlanningMixin:
    """``self.plan`` and its values under the trainer's historical names; the printed plan; ``log``."""

    def _plan_privacy(self) -> None:
        """Decide the mechanism before any training: ``self.plan`` (sigma calibrated, delta chosen)."""
        args = self.args
        self.max_private_steps = None
        self._planned_dataset = self.train_dataset
        if self.train_dataset is None:
            self.plan = None
            return
        dataset_size = check_dataset_size(self.train_dataset)
        optimizer_cls = (
            type(self.optimizer) if self.optimizer is not None else get_optimizer_class(args.dp_optimizer)
        )
        self.plan = PrivacyPlan.from_arguments(
            args, dataset_size, adaptive_clipping=getattr(optimizer_cls, "adaptive_clipping", False)
        )
        # max_private_steps (the budget stop) is searched when train() begins, from the accountant as
        # restored then: a search here would be redone there.

    def plan_settings(self) -> dict[str, Any]:
        """The settings the mechanism depends on, which every data-parallel rank must share (no secrets)."""
        args, plan = self.args, self.plan
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        settings = {
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "expected_batch_size": args.expected_batch_size,
            "noise_multiplier": self.noise_multiplier,
            "target_epsilon": args.target_epsilon,
            "target_delta": args.target_delta,
            "per_sample_max_grad_norm": args.per_sample_max_grad_norm,
            "accountant": args.accountant,
            "poisson_sampling": args.poisson_sampling,
            "dp_optimizer": args.dp_optimizer,
            "dp_optimizer_kwargs": args.dp_optimizer_kwargs,
            "optimizers[0]": None if optimizer is None else type(optimizer).__name__,
            # The release all-reduces the clipped sums of these tensors, flat: other tensors on a rank would
            # sum in mismatched coordinates (or fail on the buffer's size).
            "trainable tensors": _trainable_signature(self.model),
        }
        if plan is not None:
            settings.update(
                dataset_size=plan.dataset_size,
                sample_rate=plan.sample_rate,
                planned_steps=plan.planned_steps,
                delta=plan.delta,
                max_grad_norm=plan.max_grad_norm,
            )
        return settings

    def _check_dataset_is_planned(self) -> None:
        # The plan (N, q, delta, sigma) is the construction-time dataset's: a dataset set later would be
        # trained with another dataset's sampling rate (or its first N rows only).
        if self.train_dataset is None and self._planned_dataset is None:
            raise ValueError(
                f"{type(self).__name__} has no training data: pass train_dataset to the constructor (the privacy "
                "plan, with N, q, delta and the noise, is made for it there)."
            )
        if self.train_dataset is None or self.train_dataset is not self._planned_dataset:
            got = "None" if self.train_dataset is None else f"a dataset of {len(self.train_dataset)} examples"
            built = "without one" if self.plan is None else f"with one of {self.dataset_size} examples"
            raise ValueError(
                f"{type(self).__name__}.train_dataset is {got}, but the trainer was built {built}: the privacy "
                "plan (N, q, delta, noise) is made for the dataset given to the constructor. Pass train_dataset "
                "to the constructor of a new trainer."
            )

    # The plan's values, under the names DPTrainer has always exposed (read-only: the plan is frozen).

    @property
    def dataset_size(self) -> int | None:
        return self.plan.dataset_size if self.plan is not None else None

    @property
    def sample_rate(self) -> float | None:
        return self.plan.sample_rate if self.plan is not None else None

    @property
    def steps_per_epoch(self) -> int | None:
        return self.plan.steps_per_epoch if self.plan is not None else None

    @property
    def planned_steps(self) -> int | None:
        return self.plan.planned_steps if self.plan is not None else None

    @property
    def delta(self) -> float | None:
        return self.plan.delta if self.plan is not None else self.args.target_delta

    @property
    def noise_multiplier(self) -> float:
        if self.plan is not None:
            return self.plan.noise_multiplier
        return 0.0 if self.args.disable_dp else float(self.args.noise_multiplier or 0.0)

    def privacy_plan_text(self) -> str:
        """The privacy plan as a compact block: what a user should see before training starts."""
        plan = self.plan
        if self.args.disable_dp:
            return "dp_hf: disable_dp=True: this run is NOT private (no clipping, no noise)."
        if plan is None:
            return "dp_hf: no training dataset, nothing to plan."
        # From the steps already spent (a resume) to the planned total.
        epsilon = self.accountant.epsilon_after(
            max(0, plan.planned_steps - self.accountant.steps),
            plan.noise_multiplier,
            plan.sample_rate,
            plan.delta,
        )
        sigma = shown(
            plan.noise_multiplier, 4, up=False
        )  # down: a sigma read off the plan never gives less epsilon
        why = (
            "given"
            if plan.target_epsilon is None
            else f"calibrated for target epsilon {plan.target_epsilon:g}"
        )
        noise = f"{sigma} ({why})"
        delta_why = (
            f"default: 1/(10 N) rounded down, below 1/N = {1 / plan.dataset_size:.2g}"
            if plan.delta_is_default
            else "given"
        )
        optimizer = self.args.dp_optimizer
        clip = (
            f"per-example norm <= 1 in {optimizer}'s adaptive geometry"
            if plan.max_grad_norm is None
            else f"per-example L2 norm <= {plan.max_grad_norm:g} (all trainable tensors together)"
        )
        sampling = "Poisson" if plan.poisson_sampling else "SHUFFLED (the epsilon below overstates privacy)"
        batch = f"expected batch {plan.expected_batch_size} of N = {plan.dataset_size}"
        if plan.poisson_sampling:
            batch += f"; at most {self.args.physical_batch_size} examples per forward/backward pass"
        passes = f"each example sampled {plan.expected_passes:.3g} time{'' if plan.expected_passes == 1 else 's'} in expectation"
        path = self.per_sample_gradient_mode or "hooks"
        rows = [
            ("unit", "one training example (add/remove)"),
            ("noise multiplier", noise),
            ("sampling", f"{sampling}, q = {shown(plan.sample_rate, 4, up=True)} ({batch})"),
            (
                "steps",
                f"{plan.planned_steps} ({plan.epochs:.3g} epoch{'' if plan.epochs == 1 else 's'} of {plan.steps_per_epoch}; {passes})",
            ),
            ("delta", f"{delta_text(plan.delta)} ({delta_why})"),
            (
                "planned epsilon",
                f"{significant(epsilon, 4)} after {plan.planned_steps} steps ({plan.accountant} accountant)"
                + (
                    "; above the target (the resumed history counts): training stops at the budget"
                    if plan.target_epsilon is not None and epsilon > plan.target_epsilon
                    else ""
                ),
            ),
            ("clipping", f"{clip}; optimizer {optimizer}, {path} per-example path"),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(["dp_hf privacy plan:"] + [f"  {name:<{width}}  {value}" for name, value in rows])

    def _announce_plan(self, state) -> None:
        # Printed (not logged at INFO, which default logging hides) once per trainer, on the main process.
        if not self.is_world_process_zero():
            return
        if not self._plan_announced:
            self._plan_announced = True
            print(self.privacy_plan_text(), flush=True)
        elif not self.args.disable_dp:
            # A later train() call on this trainer continues the run (its sampler and accountant) for the
            # Trainer's max_steps more steps: its epsilon grows, which a user re-running a cell may not expect.
            steps = max(0, state.max_steps - state.global_step)
            if self.max_private_steps is not None:
                steps = min(steps, self.max_private_steps - self.accountant.steps)
            spent = self.accountant.get_epsilon(self.delta)
            after = self.accountant.epsilon_after(steps, self.noise_multiplier, self.sample_rate, self.delta)
            logger.warning(
                "This train() call continues the private run of this trainer: %d more DP steps after the %d "
                "already taken, so epsilon grows from %s to %s (delta %s). Build a new trainer (and model) for a "
                "separate run.",
                steps,
                self.accountant.steps,
                significant(spent, 4, up=True),
                significant(after, 4, up=True),
                self.delta,
            )

    def _check_planned_steps(self, state) -> None:
        # The noise was calibrated for planned_steps: the Trainer must agree on the length of a fresh run.
        fresh = self.accountant.steps == 0 and not self._resuming
        if self.args.disable_dp or not fresh or self.train_dataset is None:
            return
        if state.max_steps != self.planned_steps:
            raise RuntimeError(
                f"the Trainer plans {state.max_steps} steps but the privacy plan has {self.planned_steps} "
                f"(dp_hf.plan.planned_steps for N={self.dataset_size}, expected batch {self.args.expected_batch_size}); "
                "the noise was calibrated for the latter. Set max_steps explicitly."
            )

    def train(self, *args, **kwargs):
        # Why: train() also returns the mean training loss (TrainOutput.training_loss), computed on the
        # private batches without noise; with dp_log_train_loss=False it is kept out of that too (NaN).
        output = super().train(*args, **kwargs)
        if not self.args.disable_dp and not self.args.dp_log_train_loss:
            output = output._replace(training_loss=float("nan"))
        return output

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Why: epsilon belongs in every training log line, the progress bar and state.log_history; the
        # training loss (computed on the private batch, without noise) is dropped if the user asks.
        if not self.args.disable_dp and ("loss" in logs or "train_loss" in logs):
            periodic = "loss" in logs  # a step's log line, not the final summary
            epsilon, delta = self.privacy_spent()
            if "loss" in logs and self._released_grad_norm is not None:
                logs["grad_norm"] = float(self._released_grad_norm)  # of the released, noised gradient
            # Rounded up as the Trainer prints it (.4g): a log line never shows less than was spent.
            logs["epsilon"] = epsilon_for_logs(epsilon)
            logs["delta"] = delta
            if not self.args.dp_log_train_loss:
                measured = [k for k in logs for part in self.args.UNNOISED_TRAIN_MEASUREMENTS if part in k]
                for key in (*self.args.UNNOISED_TRAIN_LOG_KEYS, *measured):
                    logs.pop(key, None)
            if periodic:
                self._prefetch_next_log_epsilon()
        super().log(logs, start_time)


def _trainable_signature(model: Any) -> str:
    """``"<count> tensors, <digest>"`` of the trainable parameters' names, shapes and dtypes, in order."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    text = ";".join(f"{name}:{_shape_of(p)}:{p.dtype}" for name, p in trainable)
    return f"{len(trainable)} tensors, {hashlib.sha256(text.encode()).hexdigest()[:12]}"


def _shape_of(parameter: torch.nn.Parameter) -> str:
    # A lazy module's parameter has no shape before its first forward (refused later, with its reason).
    if isinstance(parameter, torch.nn.parameter.UninitializedParameter):
        return "uninitialized"
    return str(tuple(parameter.shape))
