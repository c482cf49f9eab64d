"""`DPTrainer`: private training inside the Hugging Face `Trainer`.

Switching a fine-tuning script to DP means replacing ``TrainingArguments`` with
:class:`~dp_hf.training_args.DPTrainingArguments` and ``Trainer`` with
:class:`DPTrainer`. What changes underneath:

* the model gets per-example gradient hooks (:mod:`dp_hf.grad_sample`), and is
  refused before training if a module mixes examples (BatchNorm) or has none;
* each optimizer step consumes one Poisson-sampled logical batch, delivered as
  ``gradient_accumulation_steps`` loader items; an item larger than
  ``per_device_train_batch_size`` is split further (memory bound);
* the loss is a sum of per-example losses (:mod:`dp_hf.losses`), each
  micro-batch is clipped right after its backward pass, and the DP optimizer
  adds the noise once per logical step;
* the accountant is stepped by the optimizer's own step hook, epsilon is
  logged, training stops before a step that would exceed ``target_epsilon``,
  and checkpoints hold all DP state.

The Trainer methods overridden are few; each says why.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import time
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback

from dp_hf.accounting import PrivacyAccountant
from dp_hf.distributed import agree_on_seed, check_data_parallel_only, unwrap_ddp
from dp_hf.losses import infer_task, per_example_loss
from dp_hf.optim import DPOptimizer, get_optimizer_class
from dp_hf.plan import PrivacyPlan
from dp_hf.sampling import (
    STEP_TAG_KEY,
    EmptyBatchCollator,
    PoissonBatchSampler,
    StepTaggedDataset,
    check_batch_is_per_example,
    check_collator_is_per_example,
    split_microbatch,
)
from dp_hf.training_args import DPArgumentsMixin, DPTrainingArguments
from dp_hf.validation import check_dataset_size
from dp_hf.versions import check_tested_versions

logger = logging.getLogger(__name__)

check_tested_versions()  # the Trainer internals overridden below are version-sensitive

DP_STATE_NAME = "dp_state.pt"


class _DPDataLoader(DataLoader):
    # The Trainer calls `set_epoch` on loaders that have it; the sampler's draws depend on the epoch.
    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


class _PrivacyCallback(TrainerCallback):
    """Stops training before a step that would exceed the budget."""

    def __init__(self, trainer: DPTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._check_budget_at_start()
        self.trainer._check_planned_steps(state)
        self.trainer._start_sampler(state)
        self.trainer._announce_plan()
        self._last_bar_update = 0.0

    def _progress_bar(self):
        for callback in self.trainer.callback_handler.callbacks:
            bar = getattr(callback, "training_bar", None)
            if bar is not None:
                return bar
        return None

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        # Epsilon in the progress bar as training runs (at most once a second: each value composes
        # the accountant's history, cheap once cached but not free).
        bar = self._progress_bar() if not args.disable_dp else None
        now = time.monotonic()
        if bar is not None and (now - self._last_bar_update >= 1.0 or state.global_step >= state.max_steps):
            bar.set_postfix({"epsilon": f"{trainer.privacy_spent()[0]:.3f}"}, refresh=False)
            self._last_bar_update = now
        budget_reached = (
            trainer.max_private_steps is not None and trainer.accountant.steps >= trainer.max_private_steps
        )
        if budget_reached and state.global_step < state.max_steps:
            epsilon, delta = trainer.privacy_spent()
            logger.warning(
                "Privacy budget reached: epsilon=%.4f (target %s, delta=%.3g) after %d steps; one more step would "
                "exceed target_epsilon, so training stops here.",
                epsilon,
                trainer.args.target_epsilon,
                delta,
                trainer.accountant.steps,
            )
            trainer.stopped_by_budget = True
            control.should_training_stop = True
        return control


class DPTrainerMixin:
    """The DP behaviour of :class:`DPTrainer`, for any ``transformers.Trainer`` subclass.

    Put it first among the bases, before the Trainer class, and pair it with arguments that carry
    the privacy fields (:class:`~dp_hf.training_args.DPArgumentsMixin`)::

        class DPMyTrainer(DPTrainerMixin, MyTrainer):
            dp_args_class = DPMyConfig  # a dataclass(DPArgumentsMixin, MyConfig)

    or ``make_private_trainer(MyTrainer)``. It overrides, and does not call back into, the
    Trainer's ``get_train_dataloader``, ``training_step`` (the loss is
    :meth:`compute_per_example_losses`, not ``compute_loss``), ``create_optimizer``,
    ``_get_num_items_in_batch``, ``log``, checkpoint saving/loading and ``save_model`` /
    ``create_model_card``; a subclass that changes those in ways that matter for privacy
    (its own sampler, a batch-normalized loss) must be checked, as :class:`dp_hf.sft.DPSFTTrainer`
    does for trl's ``SFTTrainer``.

    Args (beyond ``Trainer``'s):
        per_example_loss_fn: ``fn(outputs, labels, inputs) -> [b]`` losses, for
            heads whose per-example loss :mod:`dp_hf.losses` cannot infer.

    ``trainer.privacy_spent()`` returns ``(epsilon, delta)`` at any time;
    ``trainer.noise_multiplier``, ``trainer.sample_rate``, ``trainer.delta`` and
    ``trainer.planned_steps`` describe the mechanism.
    """

    #: The arguments class this trainer needs (checked before anything is built).
    dp_args_class: type = DPArgumentsMixin

    def __init__(
        self,
        model=None,
        args: DPArgumentsMixin | None = None,
        *trainer_args,
        per_example_loss_fn=None,
        **kwargs,
    ):
        wanted = self.dp_args_class
        if args is None or not isinstance(args, wanted):
            raise TypeError(
                f"{type(self).__name__} needs {wanted.__name__}, got {type(args).__name__}; replace the plain "
                f"arguments with dp_hf.{wanted.__name__}(..., target_epsilon=... or noise_multiplier=...)."
            )
        optimizers = kwargs.get("optimizers", (None, None))
        if optimizers and optimizers[0] is not None and not isinstance(optimizers[0], DPOptimizer):
            raise TypeError(
                f"optimizers[0] is a {type(optimizers[0]).__name__}, which is not a DP optimizer: it would update "
                "with unclipped, noiseless gradients. Pass a dp_hf.optim optimizer or set args.dp_optimizer."
            )
        if kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise TypeError(
                "optimizer_cls_and_kwargs is not supported by DPTrainer; set args.dp_optimizer instead."
            )
        # FSDP/DeepSpeed from an accelerate config file: refuse before the Trainer sets them up.
        check_data_parallel_only()
        super().__init__(model, args, *trainer_args, **kwargs)
        # ...and whatever route configured accelerate's state (e.g. a plugin passed programmatically).
        check_data_parallel_only(self.accelerator.distributed_type)
        # One secret sampling seed on every rank (rank 0's draw when none is given), decided here,
        # where every rank is sure to pass: each rank must draw the same Poisson masks.
        self.sampling_seed = agree_on_seed(args.sampling_seed, "sampling_seed")
        self.per_example_loss_fn = per_example_loss_fn
        self.stopped_by_budget = False
        self.grad_sample_handle = None
        self.fast_clipping = None  # dp_hf.ghost hooks, when they handle the model
        self.per_sample_gradient_mode = None  # "ghost" or "materialize" once resolved
        self.sampler: PoissonBatchSampler | None = None
        self._resuming = False  # set while a train() call resumes from a checkpoint (see _start_sampler)
        self._micro_batch_index = 0  # micro-batches of the current DP step seen so far
        self._plan_announced = False
        self._hooked_optimizer: DPOptimizer | None = None
        self._released_grad_norm: torch.Tensor | None = None
        self.accountant = PrivacyAccountant(args.accountant)
        self._plan_privacy()
        if not args.disable_dp:
            from dp_hf.ghost import attach_fast_clipping, resolve_per_sample_gradient_mode
            from dp_hf.grad_sample import attach_grad_sample

            # Ghost clipping when the optimizer clips in the identity geometry; per-example gradients
            # (dp_hf.ghost's layer-wise ones, or Opacus's hooks for modules it lacks) otherwise.
            optimizer = (
                self.optimizer if self.optimizer is not None else get_optimizer_class(args.dp_optimizer)
            )
            self.per_sample_gradient_mode, fast = resolve_per_sample_gradient_mode(
                args.per_sample_gradient_mode, optimizer, self.model
            )
            if fast:
                self.fast_clipping = attach_fast_clipping(self.model, mode=self.per_sample_gradient_mode)
            else:
                self.grad_sample_handle = attach_grad_sample(self.model)
            self.task = infer_task(self.model)
            if self.task is None and per_example_loss_fn is None:
                raise ValueError(
                    f"cannot tell the per-example loss of {type(self.model).__name__}; pass "
                    "per_example_loss_fn=fn(outputs, labels, inputs) -> one loss per example."
                )
        self.add_callback(_PrivacyCallback(self))

    # ------------------------------------------------------------------ planning
    def _plan_privacy(self) -> None:
        """Decide the mechanism before any training: ``self.plan`` (sigma calibrated, delta chosen)."""
        args = self.args
        self.max_private_steps = None
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
        if args.target_epsilon is not None and not args.disable_dp:
            self.max_private_steps = self._steps_within_budget()
        logger.info("DP plan: %s", self.plan)

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

    def _steps_within_budget(self) -> int:
        """Largest total step count whose epsilon stays within ``target_epsilon``."""
        target = self.args.target_epsilon

        def within(total_steps: int) -> bool:
            extra = total_steps - self.accountant.steps
            eps = self.accountant.epsilon_after(extra, self.noise_multiplier, self.sample_rate, self.delta)
            return eps <= target

        low = self.accountant.steps
        if not within(low + 1):
            return low
        # The noise is usually calibrated for exactly the planned steps: try that bracket first,
        # since each evaluation composes a privacy loss distribution.
        planned = max(low + 1, self.planned_steps)
        if within(planned) and not within(planned + 1):
            return planned
        high = planned
        while within(high):
            low, high = high, 2 * high
        while high - low > 1:  # within(low) and not within(high)
            mid = (low + high) // 2
            low, high = (mid, high) if within(mid) else (low, mid)
        return low

    def _check_budget_at_start(self) -> None:
        if self.args.disable_dp or self.args.target_epsilon is None:
            return
        self.max_private_steps = self._steps_within_budget()
        if self.max_private_steps <= self.accountant.steps:
            epsilon, _ = self.privacy_spent()
            raise RuntimeError(
                f"the privacy budget is spent: epsilon={epsilon:.4f} after {self.accountant.steps} steps and one more "
                f"step would exceed target_epsilon={self.args.target_epsilon}. Nothing was trained."
            )

    def privacy_plan_text(self) -> str:
        """The privacy plan as a compact block: what a user should see before training starts."""
        args = self.args
        if args.disable_dp:
            return "dp_hf: disable_dp=True: this run is NOT private (no clipping, no noise)."
        if self.train_dataset is None:
            return "dp_hf: no training dataset, nothing to plan."
        steps = self.planned_steps
        epsilon = self.accountant.epsilon_after(
            max(0, steps - self.accountant.steps), self.noise_multiplier, self.sample_rate, self.delta
        )
        if args.target_epsilon is not None:
            noise = f"{self.noise_multiplier:.4f} (calibrated for target epsilon {args.target_epsilon:g})"
        else:
            noise = f"{self.noise_multiplier:.4f} (given)"
        delta_why = (
            "given"
            if args.target_delta is not None
            else f"default: 1/(10 N) rounded down, below 1/N = {1 / self.dataset_size:.2g}"
        )
        optimizer = self.dp_optimizer if getattr(self, "dp_optimizer", None) is not None else None
        adaptive = getattr(optimizer or get_optimizer_class(args.dp_optimizer), "adaptive_clipping", False)
        clip = (
            f"per-example norm <= 1 in {args.dp_optimizer}'s adaptive geometry"
            if adaptive
            else f"per-example L2 norm <= {args.per_sample_max_grad_norm:g} (all trainable tensors together)"
        )
        sampling = "Poisson" if args.poisson_sampling else "SHUFFLED (the epsilon below overstates privacy)"
        rows = [
            ("unit", "one training example (add/remove)"),
            ("noise multiplier", noise),
            (
                "sampling",
                f"{sampling}, q = {self.sample_rate:.4g} (expected batch {args.expected_batch_size} of N = {self.dataset_size})",
            ),
            (
                "steps",
                f"{steps} ({steps / self.steps_per_epoch:.3g} epochs of {self.steps_per_epoch}; each example sampled {steps * self.sample_rate:.3g} times in expectation)",
            ),
            ("delta", f"{self.delta:.3g} ({delta_why})"),
            ("planned epsilon", f"{epsilon:.4g} after {steps} steps ({args.accountant} accountant)"),
            (
                "clipping",
                f"{clip}; optimizer {args.dp_optimizer}, {self.per_sample_gradient_mode or 'hooks'} per-example path",
            ),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(["dp_hf privacy plan:"] + [f"  {name:<{width}}  {value}" for name, value in rows])

    def _announce_plan(self) -> None:
        # Printed (not logged at INFO, which default logging hides) once per trainer, on the main process.
        if self._plan_announced or not self.is_world_process_zero():
            return
        self._plan_announced = True
        print(self.privacy_plan_text(), flush=True)

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

    def _start_sampler(self, state) -> None:
        # The next loader item must train DP step accountant.steps, never an earlier one. On resume the
        # Trainer skips the first global_step % steps_per_epoch items of its epoch (unless
        # ignore_data_skip): those positions become empty placeholders, never drawn again.
        self._micro_batch_index = 0
        if self.sampler is None:
            return
        epoch, skipped = 0, 0
        if self._resuming:
            epoch = state.global_step // self.steps_per_epoch
            skipped = 0 if self.args.ignore_data_skip else state.global_step % self.steps_per_epoch
        self._resuming = False
        self.sampler.start_at(self.accountant.steps, epoch=epoch, skipped=skipped)

    def _check_step_tag(self, inputs: dict[str, Any]) -> None:
        # Each Poisson micro-batch carries the DP step it was drawn for: a batch of an earlier step
        # (a replay) or of a later one (skipped steps) is refused before its forward pass.
        tag = inputs.pop(STEP_TAG_KEY, None)
        if self.sampler is None:
            return
        expected = (self.accountant.steps, self._micro_batch_index)
        if tag is None or (tag.step, tag.micro_batch) != expected:
            found = "no step tag" if tag is None else f"step {tag.step}, micro-batch {tag.micro_batch}"
            raise RuntimeError(
                f"a training micro-batch drawn for {found} arrived when DP step {expected[0]}, micro-batch "
                f"{expected[1]} was due: Poisson batches must be trained once, in order (a replayed batch would "
                "be counted twice by the accountant as if independent). This is a dp_hf bug or an unsupported "
                "custom training loop; please report it."
            )
        if inputs:
            check_batch_is_per_example(inputs, tag.num_examples, self.data_collator)
        self._micro_batch_index += 1

    # ------------------------------------------------------------------ privacy state
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
        # a DP output, free to log. (A norm of the clipped or unclipped gradients would not be.)
        grads = [p.grad for p in optimizer.trainable_params() if p.grad is not None]
        if grads:
            self._released_grad_norm = torch.linalg.vector_norm(
                torch.stack([n.float() for n in torch._foreach_norm(grads)])
            )

    def _budget_allows_step(self) -> bool:
        return self.max_private_steps is None or self.accountant.steps + 1 <= self.max_private_steps

    # ------------------------------------------------------------------ overrides
    def create_optimizer(self, model=None):
        # Why: the optimizer must be the DP optimizer, built with the planned noise and expected batch.
        if self.optimizer is None:
            model = model if model is not None else self.model
            optimizer_cls = get_optimizer_class(self.args.dp_optimizer)
            decay = set(self.get_decay_parameter_names(model))
            trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for n, p in trainable if n in decay], "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
            ]
            groups = [g for g in groups if g["params"]]
            self.optimizer = optimizer_cls(groups, **self._optimizer_kwargs(optimizer_cls))
        # A second train() finds the optimizer that accelerate wrapped during the first one.
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(f"the optimizer must be a dp_hf DP optimizer, got {type(optimizer).__name__}.")
        self._check_optimizer_matches_plan(optimizer)
        self.dp_optimizer = optimizer
        if self._hooked_optimizer is not optimizer:  # once per optimizer (a second train() reuses it)
            optimizer.register_step_post_hook(self._on_optimizer_step)
            optimizer.budget_guard = self._budget_allows_step
            self._hooked_optimizer = optimizer
        return self.optimizer

    def _check_optimizer_matches_plan(self, optimizer: DPOptimizer) -> None:
        # The accountant uses the trainer's plan; an optimizer built by hand must add exactly that noise.
        if self.args.disable_dp:
            return
        mismatches = []
        if not math.isclose(optimizer.noise_multiplier, self.noise_multiplier, rel_tol=1e-9):
            mismatches.append(
                f"noise_multiplier {optimizer.noise_multiplier!r} (plan: {self.noise_multiplier!r})"
            )
        if not math.isclose(optimizer.expected_batch_size, self.args.expected_batch_size, rel_tol=1e-9):
            mismatches.append(
                f"expected_batch_size {optimizer.expected_batch_size!r} (plan: {self.args.expected_batch_size!r} "
                "= per_device_train_batch_size * gradient_accumulation_steps * world_size)"
            )
        if mismatches:
            raise ValueError(
                "the optimizer passed to DPTrainer disagrees with the privacy plan: "
                + "; ".join(mismatches)
                + ". Build it with the same values or let DPTrainer build it from args.dp_optimizer."
            )

    def _optimizer_kwargs(self, optimizer_cls) -> dict[str, Any]:
        args = self.args
        accepted = inspect.signature(optimizer_cls.__init__).parameters
        kwargs: dict[str, Any] = {"lr": args.learning_rate}
        candidates = {
            "betas": (args.adam_beta1, args.adam_beta2),
            "eps": args.adam_epsilon,
        }
        kwargs.update({k: v for k, v in candidates.items() if k in accepted})
        if getattr(optimizer_cls, "adaptive_clipping", False):
            # DP-MacAdam fixes C = 1 in its own adaptive geometry; per_sample_max_grad_norm does not apply.
            if args.per_sample_max_grad_norm != 1.0 and not args.disable_dp:
                logger.warning(
                    "%s clips to norm 1 in its adaptive geometry; per_sample_max_grad_norm=%s is not used.",
                    args.dp_optimizer,
                    args.per_sample_max_grad_norm,
                )
        else:
            kwargs["max_grad_norm"] = math.inf if args.disable_dp else args.per_sample_max_grad_norm
        kwargs.update(
            noise_multiplier=0.0 if args.disable_dp else self.noise_multiplier,
            expected_batch_size=args.expected_batch_size,
            noise_seed=args.noise_seed,
            secure_mode=args.secure_mode,
            disable_dp=args.disable_dp,
        )
        kwargs.update(args.dp_optimizer_kwargs)
        return kwargs

    def get_train_dataloader(self) -> DataLoader:
        # Why: Poisson-sampled logical batches (the accounting's assumption) instead of shuffled ones.
        if self.args.disable_dp or not self.args.poisson_sampling:
            return super().get_train_dataloader()
        dataset = self.train_dataset
        collator = self.data_collator
        try:
            import datasets

            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:  # pragma: no cover - datasets is a dependency
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        probe = [dataset[i] for i in range(min(4, self.dataset_size))]
        check_collator_is_per_example(collator, probe)
        if self.sampler is None:
            self.sampler = PoissonBatchSampler(
                dataset_size=self.dataset_size,
                sample_rate=self.sample_rate,
                steps_per_epoch=self.steps_per_epoch,
                num_micro_batches=self.args.gradient_accumulation_steps,
                num_replicas=self.args.world_size,
                rank=self.args.process_index,
                seed=self.sampling_seed,
                tag_batches=True,
            )
        return _DPDataLoader(
            StepTaggedDataset(dataset),
            batch_sampler=self.sampler,
            collate_fn=EmptyBatchCollator(collator),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    def _get_grad_norm(self, model, grad_norm=None):
        # Why: before the optimizer step the Trainer would take the norm of p.grad, which is empty (consumed
        # by clipping) under DP: it logged 0. log() reports the released gradient's norm instead.
        if self.args.disable_dp:
            return super()._get_grad_norm(model, grad_norm)
        return None

    def _get_num_items_in_batch(self, batch_samples, device):
        # Why: our loss is a sum of per-example losses, never normalized by the realized token count
        # (which would couple examples); empty Poisson micro-batches also have no "labels".
        if self.args.disable_dp:
            return super()._get_num_items_in_batch(batch_samples, device)
        return None

    def training_step(self, model, inputs, num_items_in_batch=None):
        # Why: per-example loss sum, backward and clip-and-accumulate for each bounded micro-batch.
        if self.args.disable_dp:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        self._check_step_tag(inputs)
        local_expected = self.args.expected_batch_size / self.args.world_size
        if not inputs:  # empty Poisson micro-batch: nothing to clip; the step still adds noise
            return torch.zeros((), device=self.args.device)
        # Under data parallelism, bypass the DDP wrapper: DDP would all-reduce the unclipped gradients
        # (the privatizer reduces the clipped sums in step()) and runs collectives in forward that a rank
        # with an empty micro-batch never enters. Its gradient hooks stay inert without its forward.
        module = unwrap_ddp(model)
        inputs = self._prepare_inputs(inputs)
        total = torch.zeros((), device=self.args.device)
        for piece in split_microbatch(inputs, self.args.per_device_train_batch_size):
            with self.compute_loss_context_manager():
                losses = self.compute_per_example_losses(module, piece)
            loss = losses.sum()
            # Not accelerator.backward: it divides by gradient_accumulation_steps, and the per-example
            # gradients must be those of each example's own loss, unscaled.
            loss.backward()
            if self.fast_clipping is not None:
                self.fast_clipping.accumulate(self.dp_optimizer)
            else:
                self.dp_optimizer.clip_and_accumulate()
            total = total + loss.detach()
        return total / local_expected

    def _track_num_input_tokens(self, inputs):
        # Why: an empty Poisson micro-batch ({}) has no input_ids, so the Trainer would warn and skip the
        # gather of the token count over ranks that it runs after every micro-batch, leaving the other
        # ranks waiting in an unmatched collective. Count zero tokens, and take part in the gather.
        if not inputs and self.args.include_num_input_tokens_seen != "no":
            if self.args.world_size > 1:
                zero = torch.zeros((), dtype=torch.int64, device=self.args.device)
                self.state.num_input_tokens_seen += self.accelerator.gather(zero).sum().item()
            return
        super()._track_num_input_tokens(inputs)

    def compute_per_example_losses(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        """One loss per example, ``[b]``; their sum is what is differentiated."""
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        if labels is None:
            raise ValueError(
                f"the training batch has no 'labels' (keys: {sorted(inputs)}); DPTrainer computes one loss per "
                "example from the logits and the labels (use a collator that sets them, e.g. "
                "DataCollatorForLanguageModeling for masked/causal LM)."
            )
        outputs = model(**inputs)
        if self.per_example_loss_fn is not None:
            losses = self.per_example_loss_fn(outputs, labels, inputs)
        else:
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
            losses = per_example_loss(logits, labels, self.task, model)
        if losses.dim() != 1 or losses.shape[0] != labels.shape[0]:
            raise ValueError(
                f"per-example losses must have shape [{labels.shape[0]}], got {tuple(losses.shape)}."
            )
        return losses

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Why: epsilon belongs in every training log line, the progress bar and state.log_history; the
        # training loss (computed on the private batch, without noise) is dropped if the user asks.
        if not self.args.disable_dp and ("loss" in logs or "train_loss" in logs):
            epsilon, delta = self.privacy_spent()
            if "loss" in logs and self._released_grad_norm is not None:
                logs["grad_norm"] = float(self._released_grad_norm)  # of the released, noised gradient
            logs["epsilon"] = round(epsilon, 4)
            logs["delta"] = delta
            if not self.args.dp_log_train_loss:
                for key in self.args.UNNOISED_TRAIN_LOG_KEYS:
                    logs.pop(key, None)
        super().log(logs, start_time)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Why: the accountant and the sampler are DP state too; a resume without them would reset epsilon.
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            torch.save(self.dp_state_dict(), os.path.join(output_dir, DP_STATE_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # Why: restore the accountant and sampler with the optimizer (noise generator inside its state).
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        self._resuming = True
        path = os.path.join(checkpoint, DP_STATE_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} is missing: this checkpoint has no DP state (accountant, sampler), so resuming from it "
                "would under-report epsilon. Resume from a checkpoint written by DPTrainer."
            )
        self.load_dp_state_dict(torch.load(path, weights_only=False))

    def dp_state_dict(self) -> dict[str, Any]:
        """Accountant, sampler and the privacy plan, as saved in each checkpoint."""
        return {
            "accountant": self.accountant.state_dict(),
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": getattr(self, "sample_rate", None),
            "delta": getattr(self, "delta", None),
            "dataset_size": self.dataset_size,
        }

    def load_dp_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("sample_rate") is not None and not math.isclose(state["sample_rate"], self.sample_rate):
            warnings.warn(
                f"resuming with sample rate {self.sample_rate} but the checkpoint used {state['sample_rate']}; "
                "the accountant composes both.",
                UserWarning,
                stacklevel=2,
            )
        self.accountant.load_state_dict(state["accountant"])
        if state.get("sampler") is not None:
            if self.sampler is None:
                self.get_train_dataloader()
            if self.sampler is not None:
                self.sampler.load_state_dict(state["sampler"])

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # Why: every saved model (final save and each checkpoint) must carry its privacy card and privacy.json.
        super().save_model(output_dir, _internal_call)
        if not self.args.should_save:
            return
        from dp_hf.card import write_card_files

        target = output_dir if output_dir is not None else self.args.output_dir
        write_card_files(self, target)
        if (
            self.args.push_to_hub
            and self.args.hub_strategy != "end"
            and _internal_call
            and os.path.abspath(target) != os.path.abspath(self.args.output_dir)
        ):
            # A checkpoint push uploads output_dir with this checkpoint's weights copied in: the card goes too.
            write_card_files(self, self.args.output_dir)

    def create_model_card(
        self,
        language: str | None = None,
        license: str | None = None,
        tags: str | list[str] | None = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
    ) -> None:
        # Why: push_to_hub calls this just before uploading; the Trainer's card would replace our privacy card.
        if not self.is_world_process_zero():
            return
        from dp_hf.card import write_card_files

        write_card_files(
            self,
            self.args.output_dir,
            language=language,
            license=license,
            tags=tags,
            model_name=model_name,
            base_model=finetuned_from,
            pipeline_tag=tasks,
            dataset_name=dataset if dataset is not None else dataset_tags,
        )


class DPTrainer(DPTrainerMixin, Trainer):
    """A `transformers.Trainer` that trains with differential privacy (see :class:`DPTrainerMixin`)."""

    dp_args_class = DPTrainingArguments


def make_private_trainer(
    trainer_cls: type, args_cls: type = DPArgumentsMixin, name: str | None = None
) -> type:
    """``DPTrainerMixin`` on top of ``trainer_cls``: a Trainer subclass that trains with DP.

    ``args_cls`` is the arguments class the new trainer requires (a dataclass deriving from
    :class:`~dp_hf.training_args.DPArgumentsMixin` and the Trainer's own arguments class); by default
    any arguments with the privacy fields. Check the new class against the caveats of
    :class:`DPTrainerMixin` (its sampler and its loss must not be replaced by ``trainer_cls``).
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise TypeError(f"make_private_trainer needs a transformers.Trainer subclass, got {trainer_cls!r}.")
    if issubclass(trainer_cls, DPTrainerMixin):
        return trainer_cls
    return type(
        name or f"DP{trainer_cls.__name__}",
        (DPTrainerMixin, trainer_cls),
        {"dp_args_class": args_cls, "__module__": trainer_cls.__module__},
    )
