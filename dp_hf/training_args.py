"""`DPTrainingArguments`: `TrainingArguments` plus the privacy knobs.

The logical batch is ``per_device_train_batch_size * gradient_accumulation_steps
* world_size`` **in expectation** (Poisson sampling); the sample rate is that
over the dataset size. ``per_device_train_batch_size`` stays the physical
micro-batch (memory) bound.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from transformers import TrainingArguments

from dp_hf.accounting import ACCOUNTANTS
from dp_hf.optim import OPTIMIZERS, optimizer_keywords
from dp_hf.per_example.modes import PER_SAMPLE_GRADIENT_MODES
from dp_hf.plan import expected_batch_size
from dp_hf.secret_seeds import SecretSeedsMixin
from dp_hf.validation import (
    check_delta,
    check_epsilon,
    check_max_grad_norm,
    check_noise_multiplier,
    check_non_negative_finite,
    check_positive_finite,
    parse_optimizer_kwargs,
)

logger = logging.getLogger(__name__)


@dataclass(repr=False)
class DPArgumentsMixin(SecretSeedsMixin):
    """The privacy fields, their validation and the secret-seed handling, for any ``TrainingArguments``.

    One implementation for every trainer that gets DP: put it first among the bases of a dataclass
    that also derives from a ``TrainingArguments`` class, and add ``"dp_optimizer_kwargs"`` to its
    ``_VALID_DICT_FIELDS``::

        @dataclass(repr=False)
        class DPMyConfig(DPArgumentsMixin, MyConfig):
            _VALID_DICT_FIELDS = MyConfig._VALID_DICT_FIELDS + ["dp_optimizer_kwargs"]

    (``repr=False`` keeps the mixin's ``__repr__``, which hides the secret seeds.)
    :class:`DPTrainingArguments` and :class:`dp_hf.sft.DPSFTConfig` are built this way.

    Parameters:
        > Privacy budget and mechanism

        target_epsilon (`float` or `None`, defaults to `None`):
            Privacy budget ε. The noise multiplier is calibrated so that the planned steps
            (:func:`dp_hf.plan.planned_steps`) spend at most this, and training stops before a step
            that would exceed it. Give exactly one of `target_epsilon` and `noise_multiplier`.
        noise_multiplier (`float` or `None`, defaults to `None`):
            σ: the Gaussian noise on the clipped sum has std `σ * C`. ε is then whatever the run spends.
        target_delta (`float` or `None`, defaults to `None`):
            δ of the (ε, δ) guarantee. Default: `1/(10 N)` rounded down to one significant digit
            (below `1/N` for `N` training examples); a warning is given for `δ >= 1/N`.
        per_sample_max_grad_norm (`float`, defaults to `1.0`):
            Per-example clip norm `C` (all trainable tensors of an example together, in the
            optimizer's geometry). DP-MacAdam fixes its own adaptive bound instead.
        accountant (`str`, defaults to `"pld"`):
            `"pld"` (dp-accounting privacy loss distributions, tight), `"rdp"` (Rényi DP, looser,
            faster) or `"prv"` (Opacus's PRV upper bound).

        > Sampling and noise

        poisson_sampling (`bool`, defaults to `True`):
            Poisson-sampled logical batches (each example joins each step with probability
            `q = expected batch / N`), as the accounting assumes. `False` uses shuffled fixed-size
            batches, for which the reported ε overstates privacy (a warning says so), shuffled from
            `sampling_seed` (the Trainer's shuffle follows the public `seed`).
        sampling_seed (`int` or `None`, defaults to `None`):
            Seed of the Poisson sampler (or of the shuffle); default OS entropy. Secret: never serialized.
        secure_mode (`bool`, defaults to `False`):
            Fresh OS entropy for every noise draw (with Opacus's smoothing) instead of a seeded
            generator saved in checkpoints; not resumable bit for bit.
        noise_seed (`int` or `None`, defaults to `None`):
            Seed of the noise generator; default OS entropy. Secret: known noise voids the guarantee.

        > Optimizer and per-example gradients

        dp_optimizer (`str`, defaults to `"dp-adamw"`):
            One of the registered DP optimizers (`dp_hf.optim.OPTIMIZERS`); `_` and case are ignored.
        dp_optimizer_kwargs (`dict`, `str` or `None`, defaults to `None`):
            Extra hyperparameters of the DP optimizer, as a dict or a JSON string. `lr`, `betas`,
            `eps` and `weight_decay` come from the usual `TrainingArguments`.
        dp_max_physical_batch_size (`int` or `None`, defaults to `None`):
            Most examples in one forward/backward pass. A Poisson micro-batch is a random size around
            `per_device_train_batch_size`; a larger draw is split into passes of at most this many.
            `None`: `per_device_train_batch_size + ceil(2 sqrt(per_device_train_batch_size))` (64 -> 80),
            about 1.02 passes per step, with activation memory of up to that size (the slack). Set it
            to `per_device_train_batch_size` for a hard memory cap (about 1.3-1.5 passes per step).
        per_sample_gradient_mode (`str`, defaults to `"auto"`):
            `"ghost"` (per-example norms without per-example gradients; optimizers clipping in the
            identity geometry), `"materialize"` (per-example gradients layer by layer; any optimizer)
            or `"auto"` (ghost when possible, else materialize, else Opacus's hooks).

        > Logging and baseline

        dp_log_train_loss (`bool`, defaults to `True`):
            Log the training loss (computed on private batches without noise: not covered by the
            guarantee). `False` drops it (and trainer-specific unnoised statistics) from all logs and
            from `train()`'s result (`training_loss` NaN), and refuses `include_num_input_tokens_seen`
            (a token count of the private batches).
        disable_dp (`bool`, defaults to `False`):
            The non-private baseline through the same code: no clipping, no noise, shuffled batches.

    Fields with a `choices` entry in their metadata (`accountant`, `per_sample_gradient_mode`) are
    checked against it, from Python as from the command line; `dp_optimizer` is normalized first.
    """

    dp_optimizer: str = field(
        default="dp-adamw",
        # No "choices": names are normalized first ("dp_adamw" and "DP-AdamW" mean "dp-adamw"), then checked.
        metadata={"help": f"DP optimizer, one of {sorted(OPTIMIZERS)} ('_' and case are ignored)."},
    )
    dp_optimizer_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Extra hyperparameters of the DP optimizer as a dict or JSON string, e.g. "
            '\'{"gamma_prime": 1e-8}\' for dp-adamw-bc or \'{"h1": 5e-5, "h2": 1.0}\' for dp-macadam. '
            "lr, betas, eps and weight_decay come from the usual TrainingArguments."
        },
    )
    target_epsilon: float | None = field(
        default=None,
        metadata={
            "help": "Privacy budget epsilon; the noise multiplier is calibrated for the planned steps. "
            "Give exactly one of target_epsilon and noise_multiplier."
        },
    )
    noise_multiplier: float | None = field(
        default=None,
        metadata={
            "help": "Noise multiplier sigma (noise std = sigma * per_sample_max_grad_norm). "
            "Give exactly one of target_epsilon and noise_multiplier."
        },
    )
    target_delta: float | None = field(
        default=None,
        metadata={
            "help": "delta of the (epsilon, delta) guarantee; default: 1/(10 N) rounded down to one "
            "significant digit, below 1/N for a training set of N examples."
        },
    )
    per_sample_max_grad_norm: float = field(
        default=1.0,
        metadata={"help": "Per-example clip norm C (DP-MacAdam fixes its own, adaptive, bound)."},
    )
    accountant: str = field(
        default="pld",
        metadata={
            "help": "Privacy accountant: 'pld' (dp-accounting privacy loss distributions, tight; default), "
            "'rdp' (Renyi DP, looser) or 'prv' (Opacus's PRV upper bound).",
            "choices": list(ACCOUNTANTS),
        },
    )
    poisson_sampling: bool = field(
        default=True,
        metadata={
            "help": "Poisson-sampled logical batches, as the accounting assumes. False uses shuffled "
            "fixed-size batches, for which the reported epsilon overstates privacy (a warning says so)."
        },
    )
    secure_mode: bool = field(
        default=False,
        metadata={
            "help": "Draw the noise with fresh OS entropy each step (not reproducible, not resumable "
            "bit for bit) instead of a seeded generator saved in checkpoints."
        },
    )
    noise_seed: int | None = field(
        default=None,
        metadata={
            "help": "Seed of the noise generator (default: OS entropy). Keep it secret: known noise "
            "voids the guarantee."
        },
    )
    sampling_seed: int | None = field(
        default=None,
        metadata={
            "help": "Seed of the Poisson sampler, or of the shuffle with poisson_sampling=False (default: OS entropy)."
        },
    )
    dp_log_train_loss: bool = field(
        default=True,
        metadata={
            "help": "Log the training loss as the Trainer does. It is computed on the private batch without "
            "noise, so it is NOT covered by the guarantee; it reaches the logs, experiment trackers and "
            "trainer_state.json. Set False when you publish logs: 'loss'/'train_loss' are then dropped."
        },
    )
    disable_dp: bool = field(
        default=False,
        metadata={
            "help": "Non-private baseline through the same code: no clipping, no noise, shuffled "
            "batches, the optimizer's update rule on the mean gradient."
        },
    )
    dp_max_physical_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Most examples in one forward/backward pass; a larger Poisson draw is split. Default: "
            "per_device_train_batch_size + ceil(2 sqrt(per_device_train_batch_size)), about 1.02 passes per "
            "step. Set it to per_device_train_batch_size for a hard memory cap (more passes per step)."
        },
    )
    per_sample_gradient_mode: str = field(
        default="auto",
        metadata={
            "help": "How per-example clipping is computed (dp_hf.per_example): 'ghost' (per-example norms without "
            "per-example gradients; optimizers clipping in the identity geometry: dp-sgd, dp-adam(w), -bc, "
            "dp-microadam), 'materialize' (per-example gradients, layer by layer; any optimizer), or 'auto' "
            "(ghost when the optimizer allows it and every trainable module is supported, else materialize).",
            "choices": list(PER_SAMPLE_GRADIENT_MODES),
        },
    )

    def __post_init__(self) -> None:
        # Parsed before the Trainer's own parse of dict fields, whose error does not name the field.
        self.dp_optimizer_kwargs = parse_optimizer_kwargs(self.dp_optimizer_kwargs)
        if self.max_grad_norm not in (0, 0.0, 1.0, None):
            raise ValueError(
                f"max_grad_norm={self.max_grad_norm!r} clips the summed gradient, which has no meaning under DP; "
                "set the per-example clip norm with per_sample_max_grad_norm and leave max_grad_norm unset (or 0)."
            )
        if self.max_grad_norm:
            logger.info(
                "DP training: max_grad_norm (clipping of the summed gradient) is turned off; "
                "per-example gradients are clipped to per_sample_max_grad_norm instead."
            )
            self.max_grad_norm = 0.0
        super().__post_init__()
        self.validate_privacy_arguments()

    def validate_privacy_arguments(self) -> None:
        """Check the privacy arguments (:func:`check_privacy_arguments`); each error names the value and the fix."""
        check_privacy_arguments(self)

    #: Training-log keys computed on the private batches without noise (not covered by the guarantee);
    #: dropped from the logs when ``dp_log_train_loss=False``. Subclasses add their own statistics.
    #: ``total_flos``: the Trainer's estimate from each batch's size and padded length.
    UNNOISED_TRAIN_LOG_KEYS: ClassVar[tuple[str, ...]] = ("loss", "train_loss", "total_flos")
    #: The training summary's measurements of the run, dropped with the loss: its time and rates follow the
    #: realized Poisson batch sizes, and its memory (``*_mem_*`` with ``skip_memory_metrics=False``) the
    #: largest of them, which are private (an audit found them in a pushed trainer_state.json).
    UNNOISED_TRAIN_MEASUREMENTS: ClassVar[tuple[str, ...]] = (
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "_mem_",
    )

    @property
    def physical_batch_size(self) -> int:
        """Most examples in one forward/backward pass (``dp_max_physical_batch_size`` or its default)."""
        if self.dp_max_physical_batch_size is not None:
            return int(self.dp_max_physical_batch_size)
        return default_physical_batch_size(self.per_device_train_batch_size)

    @property
    def expected_batch_size(self) -> int:
        """Expected logical batch over all processes."""
        return expected_batch_size(
            self.per_device_train_batch_size, self.gradient_accumulation_steps, self.world_size
        )

    def privacy_dict(self) -> dict[str, Any]:
        """The privacy arguments, for logs and the model card."""
        return {
            "dp_optimizer": self.dp_optimizer,
            "dp_optimizer_kwargs": dict(self.dp_optimizer_kwargs),
            "target_epsilon": self.target_epsilon,
            "noise_multiplier": self.noise_multiplier,
            "target_delta": self.target_delta,
            "per_sample_max_grad_norm": self.per_sample_max_grad_norm,
            "accountant": self.accountant,
            "poisson_sampling": self.poisson_sampling,
            "secure_mode": self.secure_mode,
            "dp_log_train_loss": self.dp_log_train_loss,
            "disable_dp": self.disable_dp,
        }


@dataclass(repr=False)
class DPTrainingArguments(DPArgumentsMixin, TrainingArguments):
    """Arguments of :class:`dp_hf.DPTrainer` (all of ``TrainingArguments`` plus the privacy fields of
    :class:`DPArgumentsMixin`)."""

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + ["dp_optimizer_kwargs"]


def default_physical_batch_size(per_device_batch: int) -> int:
    """``b + ceil(2 sqrt(b))``: a Poisson micro-batch of mean ``b`` exceeds it with probability ~2.5%.

    Poisson sizes have standard deviation ``sqrt(b)``; capping at the mean would split about half of
    the steps into a full pass plus a small one (1.3-1.5 passes per step), and on a GPU a small pass
    costs almost as much as a full one. Two standard deviations of slack keep it to ~1.02 passes.
    """
    return int(per_device_batch) + math.ceil(2 * math.sqrt(per_device_batch))


#: DP optimizer arguments that DPTrainer sets from DPTrainingArguments' own fields (the field to use).
OWN_OPTIMIZER_ARGUMENTS = {
    "max_grad_norm": "per_sample_max_grad_norm",
    "noise_multiplier": "noise_multiplier or target_epsilon",
    "expected_batch_size": "per_device_train_batch_size and gradient_accumulation_steps",
    "noise_seed": "the argument noise_seed (kept out of the logs)",
    "generator": "noise_seed (kept out of the logs)",
    "secure_mode": "secure_mode",
    "disable_dp": "disable_dp",
    "lr": "learning_rate",
    "betas": "adam_beta1 and adam_beta2",
    "eps": "adam_epsilon",
    "weight_decay": "weight_decay",
}


def check_privacy_arguments(args: Any) -> None:
    """Check the privacy arguments; each error names the value and the fix."""
    if isinstance(args.dp_optimizer, str):
        args.dp_optimizer = args.dp_optimizer.strip().lower().replace("_", "-")
    if args.dp_optimizer not in OPTIMIZERS:
        raise ValueError(
            f"dp_optimizer={args.dp_optimizer!r} is unknown; choose one of {sorted(OPTIMIZERS)}."
        )
    _check_choices(args)
    if args.fp16:
        raise ValueError(
            "fp16=True is not supported: the fp16 loss scaler rescales the summed loss, so per-example "
            "gradients would be clipped at the scaled norm and overflow steps would be skipped after noise "
            "was drawn. Use bf16=True (exact per-example clipping in float32 state) or full precision."
        )
    if args.fsdp:
        raise ValueError(
            f"fsdp={args.fsdp!r}: FSDP is not supported by dp_hf yet (sharded parameters have no per-example "
            "gradients with Opacus hooks). Use data parallelism (accelerate launch --multi_gpu) instead."
        )
    if args.deepspeed:
        raise ValueError(
            "deepspeed is not supported by dp_hf yet: DeepSpeed reduces and steps gradients itself, bypassing "
            "per-example clipping. Use data parallelism (accelerate launch --multi_gpu) instead."
        )
    if args.push_to_hub and str(args.hub_strategy) in (
        "checkpoint",
        "all_checkpoints",
        "HubStrategy.CHECKPOINT",
        "HubStrategy.ALL_CHECKPOINTS",
    ):
        raise ValueError(
            f"hub_strategy={getattr(args.hub_strategy, 'value', args.hub_strategy)!r} uploads whole checkpoints, whose optimizer.pt holds the noise "
            "generator's state: anyone could regenerate the noise. Use hub_strategy='every_save' or 'end'."
        )
    optim = getattr(args, "optim", None)  # an OptimizerNames, a str enum
    if optim not in (None, "adamw_torch_fused", "adamw_torch") or getattr(args, "optim_args", None):
        raise ValueError(
            f"optim={str(getattr(optim, 'value', optim))!r} (optim_args={getattr(args, 'optim_args', None)!r}) is not used: DPTrainer builds the "
            "DP optimizer named by dp_optimizer (one of dp_hf.optim.OPTIMIZERS, e.g. 'dp-sgd', 'dp-adamw') with "
            "its options in dp_optimizer_kwargs. Leave optim and optim_args unset."
        )
    own = [key for key in args.dp_optimizer_kwargs if key in OWN_OPTIMIZER_ARGUMENTS]
    if own:  # the values are not shown: one may be a seed
        raise ValueError(
            f"dp_optimizer_kwargs sets {', '.join(own)}, which DPTrainer takes from its own arguments: the privacy "
            "plan, the accountant and the card read those, and dp_optimizer_kwargs is logged. Set "
            + "; ".join(
                f"{OWN_OPTIMIZER_ARGUMENTS[key]} instead of dp_optimizer_kwargs[{key!r}]" for key in own
            )
            + "."
        )
    accepted = optimizer_keywords(args.dp_optimizer) if args.dp_optimizer in OPTIMIZERS else None
    unknown = sorted(set(args.dp_optimizer_kwargs) - accepted) if accepted is not None else []
    if unknown:
        elsewhere = {key: [name for name in OPTIMIZERS if key in optimizer_keywords(name)] for key in unknown}
        hints = [
            f"{key} is an option of {', '.join(sorted(names))}" for key, names in elsewhere.items() if names
        ]
        if "decoupled_weight_decay" in unknown:
            hints.append("the optimizer's name sets decoupled weight decay: dp-adam vs dp-adamw")
        raise ValueError(
            f"dp_optimizer_kwargs has {', '.join(map(repr, unknown))}, which {args.dp_optimizer} does not take"
            f"{' (' + '; '.join(hints) + ')' if hints else ''}; its "
            f"options: {', '.join(sorted(accepted - set(OWN_OPTIMIZER_ARGUMENTS))) or 'none beyond the arguments'} "
            "(learning rate, betas, epsilon and weight decay come from learning_rate, adam_beta1/2, adam_epsilon, "
            "weight_decay)."
        )
    cap = getattr(args, "dp_max_physical_batch_size", None)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(
            f"dp_max_physical_batch_size={cap!r} must be a positive integer (the most examples per "
            "forward/backward pass), or None for per_device_train_batch_size plus two standard deviations."
        )
    if args.disable_dp:
        return
    if args.gradient_checkpointing or getattr(args, "activation_checkpointing", False):
        raise ValueError(
            "gradient_checkpointing (activation_checkpointing, its transformers 5 name) is not supported with DP: "
            "the Trainer enables it when training starts, after the per-example hooks are attached, and the "
            "recomputed forward passes would record each example's activations twice. Set "
            "gradient_checkpointing=False (reduce the batch or use LoRA to save memory)."
        )
    _check_trainer_options(args)
    check_non_negative_finite("learning_rate", args.learning_rate, "the optimizer's step size")
    if args.dp_optimizer == "dp-sgd" and args.learning_rate == TrainingArguments.learning_rate:
        logger.warning(  # (each run spends privacy: one that barely moves is a waste of budget)
            "learning_rate=%s is the Trainer's default, tuned for non-private Adam: DP-SGD barely moves at it "
            "(0.3-3 is typical, docs/optimizers.md). Set learning_rate, or use dp_optimizer='dp-adamw'.",
            args.learning_rate,
        )
    if (args.target_epsilon is None) == (args.noise_multiplier is None):
        raise ValueError(
            f"give exactly one of target_epsilon and noise_multiplier (got target_epsilon={args.target_epsilon!r}, "
            f"noise_multiplier={args.noise_multiplier!r}); or disable_dp=True for a non-private baseline."
        )
    if args.target_epsilon is not None:
        check_epsilon(args.target_epsilon, "target_epsilon")
    if args.noise_multiplier is not None:
        check_noise_multiplier(args.noise_multiplier)
    if args.target_delta is not None:
        check_delta(args.target_delta, "target_delta")
    check_positive_finite(
        "per_sample_max_grad_norm", args.per_sample_max_grad_norm, "the per-example clip norm C"
    )
    check_max_grad_norm(args.per_sample_max_grad_norm, "per_sample_max_grad_norm")  # and its floor


def logs_token_counts(args: Any) -> bool:
    """Whether the Trainer logs ``num_input_tokens_seen``, a count of the private batches' tokens."""
    return getattr(args, "include_num_input_tokens_seen", "no") not in ("no", False)


def _check_trainer_options(args: Any) -> None:
    """Refuse the Trainer options that DP training cannot honor: they couple examples, change the plan,
    are silently not applied, or make dynamo trace the per-example hooks (before any training starts)."""
    if args.torch_compile:
        raise ValueError(
            f"torch_compile=True (backend {args.torch_compile_backend!r}) is not supported with DP: dynamo "
            "traces the per-example hooks, breaks the graph at every hooked layer and guards on each Poisson "
            "batch size, so it recompiles for every new size until its recompile limit (a 2-layer BERT took "
            "38 s for 10 steps with aot_eager, 100 s for 4 with inductor, against 0.9 s uncompiled), and the "
            "per-example records under compiled autograd are untested. Set torch_compile=False."
        )
    if getattr(args, "label_smoothing_factor", 0):
        raise ValueError(
            f"label_smoothing_factor={args.label_smoothing_factor!r} is not applied by DP training: the Trainer's "
            "smoother averages over the whole batch, and the per-example losses do not use it. Set it to 0, or "
            "smooth each example's loss in per_example_loss_fn."
        )
    if getattr(args, "neftune_noise_alpha", None):
        raise ValueError(
            f"neftune_noise_alpha={args.neftune_noise_alpha!r} is not supported with DP: NEFTune scales the "
            "embedding noise of every example by its batch's padded length, so an example's gradient depends on "
            "the other examples of its batch and the clip bound no longer bounds one example's influence. Unset it."
        )
    if getattr(args, "enable_jit_checkpoint", False):
        raise ValueError(
            "enable_jit_checkpoint=True is not supported with DP: on SIGTERM the Trainer saves a checkpoint in "
            "the middle of a DP step (its random state after the step's batch and dropout masks were drawn) and "
            "then still takes the step, so a resume from it releases that step again with the same noise under "
            "other random draws: the difference of the two releases is noiseless (an audit measured 3.5 C). Set "
            "enable_jit_checkpoint=False and checkpoint with save_steps (checkpoints between steps)."
        )
    if getattr(args, "use_liger_kernel", False):
        raise ValueError(
            f"use_liger_kernel=True (liger_kernel_config={getattr(args, 'liger_kernel_config', None)!r}) is not "
            "supported with DP: the Trainer patches the model with Liger's fused kernels (RMSNorm, SwiGLU, RoPE, "
            "cross-entropy) when training starts, after DP training attached and checked its per-example hooks "
            "on the unpatched modules, and the per-example clipping is not tested against those kernels. Set "
            "use_liger_kernel=False."
        )
    if getattr(args, "auto_find_batch_size", False):
        raise ValueError(
            "auto_find_batch_size=True is not supported with DP: after an out-of-memory error the Trainer would "
            "restart with half the batch, but the batch is part of the privacy plan and the failed attempt's "
            "steps are spent. Bound the memory of a forward/backward pass with dp_max_physical_batch_size "
            "instead (the logical batch keeps its planned sampling rate)."
        )
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy != "random":
        raise ValueError(
            f"train_sampling_strategy={strategy!r} is not supported with DP: the accounting assumes each batch is "
            "a Poisson sample (or, with poisson_sampling=False, a uniform shuffle, already weaker than accounted), "
            "never batches chosen by length or order. Leave train_sampling_strategy='random'."
        )
    if args.poisson_sampling and getattr(args, "dataloader_in_order", True) is False:
        raise ValueError(
            "dataloader_in_order=False is not supported with Poisson sampling: each batch carries the DP step it "
            "was drawn for and is trained in that order (a batch out of order is refused). Leave it True."
        )
    if not args.poisson_sampling and getattr(args, "ignore_data_skip", False):
        raise ValueError(
            "ignore_data_skip=True with poisson_sampling=False: a resumed run would start its epoch's shuffle from "
            "the first batch again and train the batches it trained before the interruption a second time. Set "
            "ignore_data_skip=False (or keep poisson_sampling=True, whose resume never replays a batch)."
        )
    if not args.dp_log_train_loss and logs_token_counts(args):
        raise ValueError(
            f"include_num_input_tokens_seen={args.include_num_input_tokens_seen!r} logs num_input_tokens_seen, a count of the private "
            "batches' tokens without noise, but dp_log_train_loss=False asks for logs without such statistics. "
            "Set include_num_input_tokens_seen='no' (or dp_log_train_loss=True to accept them in the logs)."
        )


def _check_choices(args: Any) -> None:
    # One rule for every field declaring its allowed values in metadata["choices"] (which
    # HfArgumentParser also uses for the command line).
    for f in fields(DPArgumentsMixin):  # the privacy fields (TrainingArguments checks its own)
        choices = f.metadata.get("choices")
        if choices is not None and getattr(args, f.name) not in choices:
            raise ValueError(f"{f.name}={getattr(args, f.name)!r} is unknown; choose one of {list(choices)}.")
