"""`DPTrainer`: private training inside the Hugging Face `Trainer`.

Switching a fine-tuning script to DP means replacing ``TrainingArguments`` with
:class:`~dp_hf.training_args.DPTrainingArguments` and ``Trainer`` with
:class:`DPTrainer`. What changes underneath:

* the model gets per-example gradient hooks (:mod:`dp_hf.per_example`), and is
  refused before training if a module mixes examples (BatchNorm) or has none;
* each optimizer step consumes one Poisson-sampled logical batch, delivered as
  ``gradient_accumulation_steps`` loader items; an item larger than
  ``dp_max_physical_batch_size`` (default: the per-device batch plus two standard
  deviations of its Poisson size) is split further (memory bound);
* the loss is a sum of per-example losses (:mod:`dp_hf.losses`), each
  micro-batch is clipped right after its backward pass, and the DP optimizer
  adds the noise once per logical step;
* the accountant is stepped by the optimizer's own step hook, epsilon is
  logged, training stops before a step that would exceed ``target_epsilon``,
  and checkpoints hold all DP state.

The Trainer methods overridden are few; each says why.

The package splits the mixin by concern, one module each: :mod:`~dp_hf.trainer.planning` (the
privacy plan, its printout, the logs), :mod:`~dp_hf.trainer.budget` (accountant, budget stop,
progress bar), :mod:`~dp_hf.trainer.data` (Poisson loader, no replay, one example per row),
:mod:`~dp_hf.trainer.step` (DP optimizer, per-example losses, clipping) and
:mod:`~dp_hf.trainer.checkpoint` (DP state in checkpoints, privacy card on save).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from transformers import Trainer

from dp_hf.accounting import PrivacyAccountant
from dp_hf.distributed import (
    agree_on_seed,
    check_data_parallel_only,
    check_launched_processes_joined,
    check_same_dataset,
    check_same_plan,
    check_same_progress,
    check_same_setting,
)
from dp_hf.losses import infer_task
from dp_hf.optim import DPOptimizer, get_optimizer_class

# Imported with the trainer rather than inside its first construction: Opacus's per-sample machinery
# is a one-time import (~0.2-0.4 s) like the Trainer's own, and construction should cost construction.
from dp_hf.per_example import attach_fast_clipping, attach_grad_sample, resolve_per_sample_gradient_mode
from dp_hf.per_example.validate import refuse_batch_norm
from dp_hf.prompt_learning import check_prompt_learning
from dp_hf.sampling import PoissonBatchSampler
from dp_hf.secret_seeds import reseed_global_generators
from dp_hf.shuffling import SecretShuffleSampler
from dp_hf.trainer.budget import BudgetMixin, PrivacyCallback
from dp_hf.trainer.checkpoint import DP_STATE_NAME, PrivateCheckpointMixin, progress_fields
from dp_hf.trainer.data import PoissonDataMixin
from dp_hf.trainer.planning import PlanningMixin
from dp_hf.trainer.step import PrivateStepMixin
from dp_hf.training_args import DPArgumentsMixin, DPTrainingArguments
from dp_hf.versions import check_tested_versions

logger = logging.getLogger(__name__)


def _check_dtypes_unchanged(trainable: list[tuple[str, torch.Tensor, torch.dtype]]) -> None:
    """Refuse training tensors whose dtype changed since the trainer was built: evaluate() or predict() outside
    train() with fp16_full_eval/bf16_full_eval casts the model in place (transformers' evaluation loop), and
    DP training then ran on float16 weights, which fp16=True is refused for (an audit)."""
    changed = [f"{name} ({dtype} -> {p.dtype})" for name, p, dtype in trainable if p.dtype != dtype]
    if changed:
        raise RuntimeError(
            f"{len(changed)} trainable tensor(s) changed dtype since the trainer was built, e.g. {changed[0]}: "
            "evaluate() or predict() before train() with fp16_full_eval or bf16_full_eval casts the model in "
            "place, and DP training would run on those weights. Evaluate after training, unset "
            "fp16_full_eval/bf16_full_eval, or cast the model before building the trainer."
        )


def warn_if_evaluated_on_training_data(train_dataset: Any, eval_dataset: Any) -> None:
    """Warn when an evaluation set is the training set itself: its metrics (logs, the card's evaluation table,
    ``load_best_model_at_end``'s choice) are then statistics of the private data without noise."""
    sets = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
    if train_dataset is not None and any(s is train_dataset for s in sets):
        warnings.warn(
            "eval_dataset is the training dataset: its metrics (in the logs, trackers and the privacy card, and "
            "load_best_model_at_end's choice of checkpoint) are computed on the private data without noise, "
            "and epsilon does not cover them. Evaluate on held-out data before publishing them.",
            UserWarning,
            stacklevel=3,
        )


check_tested_versions()  # the Trainer internals overridden by the mixins are version-sensitive

__all__ = ["DP_STATE_NAME", "DPTrainer", "DPTrainerMixin", "PrivacyCallback", "make_private_trainer"]


class DPTrainerMixin(PlanningMixin, BudgetMixin, PoissonDataMixin, PrivateStepMixin, PrivateCheckpointMixin):
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
            heads whose per-example loss :mod:`dp_hf.losses` cannot infer (``labels`` is the
            batch's ``"labels"``, or None without them: question answering reads its
            ``start_positions``/``end_positions`` from ``inputs``; with PEFT prompt tuning or P-tuning,
            padded on the left with ``-100`` for the virtual tokens, as PEFT's forward pads them).

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
        # Again here: the arguments may have been changed after they were built (and checked).
        args.validate_privacy_arguments()
        # Out of the fields before any callback sees them: trackers read fields (ClearML: getattr over
        # dataclasses.fields), not just to_dict. The trainer reads them with args.secret_seed().
        args.hide_secret_seeds()
        if kwargs.get("compute_loss_func") is not None and not args.disable_dp:
            raise TypeError(
                "compute_loss_func is not used by DPTrainer: it differentiates one loss per example. Pass "
                "per_example_loss_fn=fn(outputs, labels, inputs) -> one loss per example instead."
            )
        _refuse_batch_loss_override(type(self), args)
        optimizers = kwargs.get("optimizers", (None, None))
        if optimizers and optimizers[0] is not None and not isinstance(optimizers[0], DPOptimizer):
            raise TypeError(
                f"optimizers[0] is a {type(optimizers[0]).__name__}, which is not a DP optimizer: it would update "
                "with unclipped, noiseless gradients. Pass a dp_hf.optim optimizer or set args.dp_optimizer."
            )
        if kwargs.get("model_init") is not None and not args.disable_dp:
            raise TypeError(  # (the refusal came from the new model's unclipped gradients, naming a tensor)
                "model_init is not supported by DPTrainer: it attaches the per-example hooks to the model and checks "
                "it when built, and the Trainer calls model_init again in train() (and for each hyperparameter "
                "search trial), replacing it with an unhooked model. Pass model=model_init() instead."
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
        check_launched_processes_joined(self.args.world_size)
        check_same_setting("disable_dp", bool(args.disable_dp))  # first: it decides the collectives below
        # One secret sampling seed on every rank (rank 0's draw when none is given), decided here,
        # where every rank is sure to pass: each rank must draw the same Poisson masks.
        self.sampling_seed = agree_on_seed(args.secret_seed("sampling_seed"), "sampling_seed")
        if not args.disable_dp:
            check_same_dataset(self.train_dataset, self.sampling_seed)  # index i is one example on every rank
        self.per_example_loss_fn = per_example_loss_fn
        if not args.disable_dp:
            warn_if_evaluated_on_training_data(self.train_dataset, self.eval_dataset)
        self.stopped_by_budget = False
        self.grad_sample_handle = None
        self.fast_clipping = None  # dp_hf.per_example.ghost hooks, when they handle the model
        self.per_sample_gradient_mode = None  # "ghost" or "materialize" once resolved
        self.sampler: PoissonBatchSampler | None = None
        self.shuffle_sampler: SecretShuffleSampler | None = None  # poisson_sampling=False only
        self._resuming = False  # set while a train() call resumes from a checkpoint (see _start_sampler)
        self._micro_batch_index = 0  # micro-batches of the current DP step seen so far
        self._losses_checked = False  # dp_hf.trainer.probe: once a micro-batch of two or more came
        self._batch_dimensions_checked = False  # dp_hf.trainer.probe: on the first micro-batch
        self._gradients_checked = False  # dp_hf.trainer.probe: the clipping's attribution, once
        self._probing_losses = False  # True during the probe's forwards
        self._plan_announced = False
        self._hooked_optimizer: DPOptimizer | None = None
        self._released_grad_norm: torch.Tensor | None = None
        self.accountant = PrivacyAccountant(args.accountant)
        self._plan_privacy_on_every_rank()
        if not args.disable_dp:
            # Ghost clipping when the optimizer clips in the identity geometry; per-example gradients
            # (dp_hf.per_example.ghost's layer-wise ones, or Opacus's hooks for modules it lacks) otherwise.
            optimizer = (
                self.optimizer if self.optimizer is not None else get_optimizer_class(args.dp_optimizer)
            )
            refuse_batch_norm(self.model)
            check_prompt_learning(self.model)  # the PEFT prompt-learning methods without exact gradients here
            self.per_sample_gradient_mode, fast = resolve_per_sample_gradient_mode(
                args.per_sample_gradient_mode, optimizer, self.model
            )
            # (its training step runs the batch-dimension probe itself, with its losses and context)
            if fast:
                self.fast_clipping = attach_fast_clipping(
                    self.model, mode=self.per_sample_gradient_mode, probe_batch_dimensions=False
                )
            else:
                self.grad_sample_handle = attach_grad_sample(self.model, probe_batch_dimensions=False)
            self.task = infer_task(self.model)
            if self.task is None and per_example_loss_fn is None:
                raise ValueError(
                    f"cannot tell the per-example loss of {type(self.model).__name__}; pass "
                    "per_example_loss_fn=fn(outputs, labels, inputs) -> one loss per example."
                )
        # The trainable tensors' dtypes the hooks were attached and checked with (see begin_private_training).
        self._trainable_dtypes = [
            (n, p, p.dtype) for n, p in self.model.named_parameters() if p.requires_grad
        ]
        self.add_callback(PrivacyCallback(self))

    def _plan_privacy_on_every_rank(self) -> None:
        # The plan (sigma calibrated) is final here, where every rank is sure to pass: its settings are
        # compared across ranks (a rank with its own batch or C trained examples twice or not at all, or
        # released 91.6 C), and a rank whose plan fails makes the others refuse instead of waiting.
        if self.args.disable_dp:
            self._plan_privacy()
            return
        try:
            self._plan_privacy()
        except Exception as error:
            check_same_plan(None, error)
            raise
        check_same_plan(self.plan_settings())

    def begin_private_training(self, state) -> None:
        """When ``train()`` begins (called by :class:`PrivacyCallback`): refuse a spent budget or a step count
        other than the plan's, put the sampler at the next DP step, print the plan."""
        self._check_budget_at_start()
        self._check_planned_steps(state)
        if not self.args.disable_dp:
            # Again, with other random rows: a rank that reordered its dataset in place after the trainer was
            # built (a list reversed, a set_transform) trained an example on two ranks in one step (2x C).
            check_same_dataset(self.train_dataset, self.sampling_seed + 1)
            # A rank resumed from another checkpoint than its peers (or afresh) would sum its share of one
            # Poisson step with their shares of another in every release.
            check_same_progress(progress_fields(self, state))
            _check_dtypes_unchanged(self._trainable_dtypes)
        self._start_sampler(state)  # (after the collective above: a failure here may be one rank's alone)
        if not self.args.disable_dp:
            self._reseed_global_generators()
        self._announce_plan(state)

    def _reseed_global_generators(self) -> None:
        # The Trainer seeded torch, numpy and random with the public args.seed, and dropout masks (and a
        # collator's random masking) come from them by row position: whoever knows the seed computes how
        # one example changes every other example's masks (beyond the clip bound). They restart from the
        # secret sampling seed (the checkpoint's on resume, where transformers then restores the secret
        # rng_state.pth as before), this process's rank and the DP step: reproducible with a fixed
        # sampling_seed, fresh OS entropy otherwise. Loader workers draw their seeds from torch's.
        secret = self.secret_sampling_seed()
        reseed_global_generators(secret, "global", self.args.process_index, self.accountant.steps)


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


def _refuse_batch_loss_override(cls: type, args: Any) -> None:
    """A user's ``compute_loss`` override (class weights, say) is never called in DP training: refuse it."""
    owner = next(klass for klass in cls.__mro__ if "compute_loss" in vars(klass))
    if args.disable_dp or owner.__module__.split(".")[0] in ("dp_hf", "transformers", "trl"):
        return
    raise TypeError(
        f"{owner.__name__}.compute_loss is not used to train: DP training differentiates one loss per example "
        "(the Trainer's compute_loss returns one for the batch), so the override would only change "
        "evaluate()'s loss. Override compute_per_example_losses(model, inputs) -> one loss per example, or pass "
        "per_example_loss_fn=fn(outputs, labels, inputs) (e.g. a class-weighted cross entropy with "
        "reduction='none')."
    )
