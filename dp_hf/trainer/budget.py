"""The privacy budget of a :class:`~dp_hf.trainer.DPTrainer` run: the accountant's steps, the budget
stop before a step that would exceed ``target_epsilon``, and the callback that shows epsilon.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import IntervalStrategy

from dp_hf.accounting import steps_within_budget
from dp_hf.accounting.display import delta_text, epsilon_up

logger = logging.getLogger(__name__)


class PrivacyCallback(TrainerCallback):
    """Begins private training (budget, plan, sampler), shows epsilon in the progress bar, and stops
    training before a step that would exceed the budget."""

    def __init__(self, trainer: Any) -> None:  # a DPTrainerMixin
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.begin_private_training(state)
        self.trainer._prefetch_next_log_epsilon()  # the first log line's, as every later line's
        self._last_bar_update = time.monotonic()
        self._bar_steps_at_update = self.trainer.accountant.steps
        self._bar_covers = -1  # the shown epsilon is that after this many steps (none shown yet)
        self._bar_epsilon = None  # (a Future of the epsilon after `covers` steps, covers) being computed

    def _progress_bar(self):
        for callback in self.trainer.callback_handler.callbacks:
            bar = getattr(callback, "training_bar", None)
            if bar is not None:
                return bar
        return None

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        bar = self._progress_bar() if not args.disable_dp else None
        budget_reached = (
            trainer.max_private_steps is not None and trainer.accountant.steps >= trainer.max_private_steps
        )
        last = state.global_step >= state.max_steps or budget_reached  # the bar's last value is exact
        if bar is not None and last:
            self._show(bar, trainer.privacy_spent()[0], trainer.accountant.steps)
        elif bar is not None:
            self._show_ahead(bar, state)
        if budget_reached and state.global_step < state.max_steps:
            epsilon, delta = trainer.privacy_spent()
            logger.warning(
                "Privacy budget reached: epsilon=%s (target %s, delta=%s) after %d steps; one more step would "
                "exceed target_epsilon, so training stops here.",
                epsilon_up(epsilon, 4),
                trainer.args.target_epsilon,
                delta_text(delta),
                trainer.accountant.steps,
            )
            trainer.stopped_by_budget = True
            control.should_training_stop = True
        return control

    def _show(self, bar, epsilon: float, covers: int) -> None:
        bar.set_postfix({"epsilon": f"{epsilon_up(epsilon, 3):.3f}"}, refresh=False)
        self._bar_covers = covers

    def _show_ahead(self, bar, state) -> None:
        """Epsilon in the progress bar, never below what was spent: the epsilon after the steps of about the
        next second (within the run and the budget), refreshed once training passes them or a second went by.

        Each value composes the accountant's history (cheap once cached, not free): not every step. Before, the
        bar showed the epsilon of its last refresh (up to a second old: 0.927 while 1.467 was spent). On an
        accelerator the next value is computed on the accounting's worker thread while training runs; when it
        is not ready in time it is computed on the spot.
        """
        trainer, steps, now = self.trainer, self.trainer.accountant.steps, time.monotonic()
        elapsed = now - self._last_bar_update
        if elapsed < 1.0 and steps <= self._bar_covers:
            return
        ahead = max(1, math.ceil((steps - self._bar_steps_at_update) / max(elapsed, 1e-9)))  # steps a second
        room = state.max_steps - state.global_step
        if trainer.max_private_steps is not None:
            room = min(room, trainer.max_private_steps - steps)
        args = (trainer.noise_multiplier, trainer.sample_rate, trainer.delta)
        pending = self._bar_epsilon
        if pending is not None and pending[0].done() and self._bar_covers < steps <= pending[1]:
            self._show(bar, pending[0].result(), pending[1])
        if steps > self._bar_covers:
            extra = max(1, min(ahead, room))
            self._show(bar, trainer.accountant.epsilon_after(extra, *args), steps + extra)
        if trainer.epsilon_ahead() and (pending is None or pending[0].done()):
            extra = max(1, min(2 * ahead, room))
            self._bar_epsilon = (trainer.accountant.prefetch_epsilon_after(extra, *args), steps + extra)
        self._last_bar_update, self._bar_steps_at_update = now, steps


class BudgetMixin:
    """Accountant stepping and the budget stop (one accountant step per noised update, never past the budget)."""

    def privacy_spent(self) -> tuple[float, float]:
        """``(epsilon, delta)`` spent so far (``(inf, delta)`` when DP is disabled)."""
        if self.args.disable_dp:
            return math.inf, self.delta
        return self.accountant.get_epsilon(self.delta), self.delta

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        # Registered as the optimizer's step post-hook: one accountant step per noised update, no more, no less.
        self.accountant.step(self.noise_multiplier, self.sample_rate)
        self._micro_batch_index = 0
        # The released (noised) gradient is in p.grad until zero_grad(): its norm is post-processing of
        # a DP output, free to log. (A norm of the clipped or unclipped gradients would not be.) Taken
        # only for a step the Trainer will log: on a CPU it ran alongside the next step's noise draw
        # and cost ~3 ms a step for tiny BERT, where the rest of the step is ~50 ms.
        self._released_grad_norm = None
        if not self._logs_step(self.state.global_step + 1):
            return
        grads = [p.grad for p in optimizer.trainable_params() if p.grad is not None]
        if grads:
            self._released_grad_norm = torch.linalg.vector_norm(
                torch.stack([n.float() for n in torch._foreach_norm(grads)])
            )

    def epsilon_ahead(self) -> bool:
        """Whether epsilon for the logs and the progress bar is computed ahead on a worker thread.

        On an accelerator: its host's cores wait on the device most of the time. Not when training
        runs on the CPU: its cores are busy with the model (on a 2-core VM the work only moved, and
        the runs measured no faster), so epsilon is computed when asked, as before.
        """
        return self.args.device.type != "cpu"

    def _prefetch_next_log_epsilon(self) -> None:
        """Compute the next log line's epsilon on the accounting's worker thread while training runs.

        That line's :meth:`privacy_spent` then takes the result (~15-50 ms per PLD evaluation: with a
        log every 10 steps of ~40 ms, a tenth of the training time when computed on the spot). Only a
        guess of the history (the same ``(sigma, q)`` up to the next logging step, or the last step);
        when it is wrong, the line's epsilon is computed as before.
        """
        logging_steps = self.state.logging_steps
        if (
            not self.epsilon_ahead()
            or self.args.logging_strategy != IntervalStrategy.STEPS
            or not logging_steps
        ):
            return
        step = self.state.global_step
        target = min(
            (step // logging_steps + 1) * logging_steps,
            self.state.max_steps,
            self.max_private_steps if self.max_private_steps is not None else self.state.max_steps,
        )
        if target > step:
            self.accountant.prefetch_epsilon_after(
                target - step, self.noise_multiplier, self.sample_rate, self.delta
            )

    def _logs_step(self, step: int) -> bool:
        """Whether the Trainer's step logging (DefaultFlowCallback) will log after optimizer step ``step``.

        A log asked for by another callback gets no ``grad_norm`` (never a stale one).
        """
        if step == 1 and self.args.logging_first_step:
            return True
        logging_steps = self.state.logging_steps
        return (
            self.args.logging_strategy == IntervalStrategy.STEPS
            and bool(logging_steps)
            and step % logging_steps == 0
        )

    def _budget_allows_step(self) -> bool:
        return self.max_private_steps is None or self.accountant.steps + 1 <= self.max_private_steps

    def _steps_within_budget(self) -> int:
        """Largest total step count whose epsilon stays within ``target_epsilon`` (the accounting's one search)."""
        return steps_within_budget(
            self.args.target_epsilon,
            self.delta,
            self.sample_rate,
            self.noise_multiplier,
            accountant=self.accountant.mechanism,
            history=self.accountant.history,
            guess=self.planned_steps,
        )

    def _check_budget_at_start(self) -> None:
        if self.args.disable_dp or self.args.target_epsilon is None:
            return
        remaining = self.planned_steps - self.accountant.steps if self.planned_steps else -1
        if remaining >= 0 and (
            self.accountant.epsilon_after(remaining, self.noise_multiplier, self.sample_rate, self.delta)
            <= self.args.target_epsilon
        ):
            # The whole planned run fits the budget (on a fresh run, the calibration's own guarantee: that
            # epsilon is a cache hit). The Trainer takes no step past the plan, so the plan is the stop; the
            # largest step count within the budget (a search of several accounting evaluations, ~0.5 s)
            # is only needed when the plan does not fit, e.g. resuming with more steps at new noise.
            self.max_private_steps = self.planned_steps
        else:
            self.max_private_steps = self._steps_within_budget()
        if self.max_private_steps <= self.accountant.steps:
            epsilon, _ = self.privacy_spent()
            raise RuntimeError(
                f"the privacy budget is spent: epsilon={epsilon_up(epsilon, 4)} after {self.accountant.steps} steps and one more "
                f"step would exceed target_epsilon={self.args.target_epsilon}. Nothing was trained."
            )
