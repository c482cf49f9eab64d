"""The privacy report: the content of ``privacy.json``, built from a trainer, and what can be read back from one.

Owns :func:`build_privacy_report` (the mechanism, from ``trainer.plan`` when the trainer has one, else
from its public attributes; the clipping and optimizer that ran, and their hyperparameters; the sampling;
what the guarantee does not cover; the versions), :func:`epsilon_from_report` and
:func:`eval_metrics_from_log_history`. The model's Hub metadata comes from :mod:`dp_hf.card.metadata`;
rendering the report is :mod:`dp_hf.card.render`'s job, writing it :mod:`dp_hf.card.files`'.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dp_hf import __version__
from dp_hf.accounting import PrivacyAccountant, accounting_library_version
from dp_hf.accounting.pld import pld_grid
from dp_hf.card.metadata import card_metadata
from dp_hf.plan import ADJACENCY, PRIVACY_UNIT  # re-exported: the card states the plan's unit
from dp_hf.training_args import logs_token_counts

logger = logging.getLogger(__package__)  # "dp_hf.card", one logger for the package

__all__ = [
    "ADJACENCY",
    "PRIVACY_UNIT",
    "SCHEMA_VERSION",
    "build_privacy_report",
    "epsilon_from_report",
    "eval_metrics_from_log_history",
]

SCHEMA_VERSION = 1

# Evaluation log entries that are timings or positions, not metrics.
_NON_METRIC_EVAL_KEYS = {"runtime", "samples_per_second", "steps_per_second", "model_preparation_time"}

# Implementation switches torch keeps next to the hyperparameters; they do not change the update.
_TORCH_BOOKKEEPING_KEYS = {"differentiable", "foreach", "fused", "capturable"}

_MACADAM = ("dp-macadam", "dp-macadam-bc")
_SCALE_THEN_PRIVATIZE = ("dp-adam-stp", "dp-adamw-stp")


_PUBLIC_NOISE_SEED = (
    "the noise, if `noise_seed` becomes known: this run fixed `noise_seed`, so anyone who learns the seed can "
    "regenerate and subtract the noise. The seed is not written here; keep it (and the checkpoints' "
    "optimizer state, which holds the noise generator) secret"
)
_PUBLIC_SAMPLING_SEED = (
    "the batch composition, if `sampling_seed` becomes known: this run fixed `sampling_seed`, and the "
    "amplification by Poisson sampling assumes the sampled batches are secret"
)


# --------------------------------------------------------------------------- the report


def build_privacy_report(trainer: Any, **card_overrides: Any) -> dict[str, Any]:
    """The content of ``privacy.json`` for a :class:`~dp_hf.trainer.DPTrainer`, now.

    ``card_overrides`` (keys of :data:`~dp_hf.card.metadata.CARD_METADATA_KEYS`) take precedence
    over ``trainer.card_metadata``, which takes precedence over what is inferred
    from the model and the datasets. All values are JSON-serialisable;
    infinite numbers (epsilon without noise) are ``null``.
    """
    args = trainer.args
    accountant: PrivacyAccountant = trainer.accountant
    optimizer = getattr(trainer, "dp_optimizer", None) or getattr(trainer, "optimizer", None)
    mechanism = _mechanism(trainer)
    steps = accountant.steps
    epsilon = trainer.privacy_spent()[0] if mechanism.delta is not None else None
    not_private_reason = _not_private_reason(args, mechanism, epsilon)
    sampling = _sampling(args)
    fresh_noise_resumes = list(getattr(trainer, "fresh_noise_resumes", []))
    metadata = card_metadata(
        trainer, card_overrides, private=not_private_reason is None, proven=sampling["accounting_holds"]
    )
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "private": not_private_reason is None,
        "not_private_reason": not_private_reason,
        # private and the accounting's assumptions met (Poisson sampling): epsilon is a proven bound.
        "guarantee_holds": not_private_reason is None and sampling["accounting_holds"],
        "privacy_unit": PRIVACY_UNIT,
        "adjacency": ADJACENCY,
        "epsilon": epsilon,
        "delta": mechanism.delta,
        # delta >= 1/N allows publishing one example in full (dp_hf warned at the start): said on the card.
        "delta_at_least_one_over_n": bool(
            mechanism.delta is not None
            and mechanism.dataset_size
            and mechanism.delta * mechanism.dataset_size >= 1
        ),
        "target_epsilon": args.target_epsilon,
        # The current phase's sigma and q; "phases" has every (sigma, q, steps) the accountant composed
        # (a run resumed with other settings has several: then these two describe its last phase only).
        "noise_multiplier": mechanism.noise_multiplier,
        "sample_rate": mechanism.sample_rate,
        "steps": steps,
        "phases": [
            {"noise_multiplier": sigma, "sample_rate": q, "steps": count}
            for sigma, q, count in accountant.history
        ],
        **_length(steps, mechanism, accountant.history),
        "accountant": accountant.mechanism,
        "accounting_library": accounting_library_version(accountant.mechanism),
        "accountant_state": accountant.state_dict(),
        # The PLD grid epsilon was computed on (finer than dp_accounting's default 1e-4 for small q): with
        # the default grid dp_accounting's own bound is a little looser, e.g. 0.050105 for dp_hf's 0.0499978.
        "pld_value_discretization_interval": (
            pld_grid(accountant.history)
            if accountant.mechanism == "pld"
            and accountant.history
            and all(e[0] > 0 for e in accountant.history)
            else None
        ),
        "expected_batch_size": mechanism.expected_batch_size,
        "batch": {
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "world_size": args.world_size,
        },
        "clipping": _clipping(args, optimizer),
        "optimizer": _optimizer_summary(args, optimizer),
        "sampling": sampling,
        "dataset": {"name": metadata["dataset_name"], "size": mechanism.dataset_size},
        "secure_mode": bool(args.secure_mode),
        "noise_seed_fixed": args.noise_seed is not None,
        "sampling_seed_fixed": args.sampling_seed is not None,
        "stopped_by_budget": bool(getattr(trainer, "stopped_by_budget", False)),
        "global_step": int(trainer.state.global_step),
        "fresh_noise_resumes": fresh_noise_resumes,
        "not_covered": _not_covered(args, metadata, fresh_noise_resumes),
        "audit": _audit(trainer),
        "warnings": _consistency_warnings(args, optimizer, mechanism),
        "versions": _versions(metadata["library_name"] == "peft"),
        "model_card": _model_card(metadata, trainer.state.log_history),
    }
    return _jsonable(report)


def epsilon_from_report(report: Mapping[str, Any]) -> float:
    """Epsilon of the full accountant history stored in ``privacy.json`` (any number of ``(sigma, q)``)."""
    accountant = PrivacyAccountant()
    accountant.load_state_dict(report["accountant_state"])
    return accountant.get_epsilon(report["delta"])


def eval_metrics_from_log_history(log_history: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The latest evaluation in a Trainer log history: ``{"step", "epoch", "split", "metrics": {name: value}}``.

    An evaluation entry is one with ``{prefix}_runtime`` (what ``Trainer.evaluate(...,
    metric_key_prefix=prefix)`` logs: ``eval`` by default, ``test`` in the demo). Metric names lose
    that prefix and are sorted; timings and non-finite values are dropped. ``None`` when the history
    holds no evaluation.
    """
    for entry in reversed(list(log_history or [])):
        prefixes = [
            key[: -len("_runtime")] for key in entry if key.endswith("_runtime") and key != "train_runtime"
        ]
        if not prefixes:
            continue
        metrics = _eval_metrics(entry, prefixes[0])
        if metrics:  # sorted: trainer_state.json stores its log entries with sorted keys
            return {
                "step": entry.get("step"),
                "epoch": entry.get("epoch"),
                "split": prefixes[0],
                "metrics": dict(sorted(metrics.items())),
            }
    return None


def _eval_metrics(entry: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The finite numeric ``{prefix}_*`` values of one log entry, prefix removed, timings left out."""
    metrics = {}
    for key, value in entry.items():
        if not key.startswith(prefix + "_"):
            continue
        name = key[len(prefix) + 1 :]
        if name in _NON_METRIC_EVAL_KEYS or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            metrics[name] = value
    return metrics


# --------------------------------------------------------------------------- the mechanism


@dataclass(frozen=True)
class _Mechanism:
    """The accounted mechanism as the report states it (``None``: no training dataset, so no plan)."""

    noise_multiplier: float
    sample_rate: float | None
    delta: float | None
    dataset_size: int | None
    steps_per_epoch: int | None
    expected_batch_size: int


def _mechanism(trainer: Any) -> _Mechanism:
    """From ``trainer.plan`` (a :class:`~dp_hf.plan.PrivacyPlan`) when set, else the trainer's attributes."""
    plan = getattr(trainer, "plan", None)
    if plan is not None:
        return _Mechanism(
            noise_multiplier=float(plan.noise_multiplier or 0.0),
            sample_rate=plan.sample_rate,
            delta=plan.delta,
            dataset_size=plan.dataset_size,
            steps_per_epoch=plan.steps_per_epoch,
            expected_batch_size=plan.expected_batch_size,
        )
    return _Mechanism(
        noise_multiplier=float(getattr(trainer, "noise_multiplier", None) or 0.0),
        sample_rate=getattr(trainer, "sample_rate", None),
        delta=getattr(trainer, "delta", None),
        dataset_size=getattr(trainer, "dataset_size", None),
        steps_per_epoch=getattr(trainer, "steps_per_epoch", None),
        expected_batch_size=trainer.args.expected_batch_size,
    )


def _not_private_reason(args: Any, mechanism: _Mechanism, epsilon: float | None) -> str | None:
    if args.disable_dp:
        return "disable_dp=True: no per-example clipping and no noise"
    if mechanism.dataset_size is None:
        return "this trainer had no training dataset, so nothing was trained with DP by it"
    if epsilon is None or not math.isfinite(epsilon):
        return "noise multiplier 0: the noiseless updates have infinite epsilon"
    return None


def _length(steps: int, mechanism: _Mechanism, history: Any) -> dict[str, Any]:
    """The run's length as expected passes (``sum of steps x q`` over the history) and as the Trainer's epochs."""
    if history:
        passes = sum(sample_rate * num_steps for _, sample_rate, num_steps in history)
    else:
        passes = steps * mechanism.sample_rate if mechanism.sample_rate is not None else None
    per_epoch = mechanism.steps_per_epoch
    return {
        # "epochs" is kept for older readers: it is the expected passes (steps x q), not the Trainer's epochs.
        "epochs": passes,
        "expected_passes": passes,
        "steps_per_epoch": per_epoch,
        "trainer_epochs": steps / per_epoch if per_epoch else None,
    }


def _clipping(args: Any, optimizer: Any) -> dict[str, Any]:
    if args.disable_dp:
        return {
            "max_grad_norm": None,
            "adaptive": False,
            "description": "none (disable_dp=True: no clipping)",
        }
    name = _optimizer_name(args, optimizer)
    clip = float(getattr(optimizer, "max_grad_norm", args.per_sample_max_grad_norm))
    if name in _MACADAM:
        return {
            "max_grad_norm": 1.0,
            "adaptive": True,
            "description": (
                "adaptive (DP-MacAdam): each example's gradient is centered by the running mean estimate "
                "mhat and scaled coordinate-wise by the adaptive bound b_t (both from earlier privatized "
                "steps), then clipped to L2 norm 1 in that geometry; 1 is not a bound on the raw gradient"
            ),
        }
    if name in _SCALE_THEN_PRIVATIZE:
        if getattr(optimizer, "scale_mode", "rms") == "raw":
            scale = "s_t = sqrt(vhat_(t-1)) + gamma_s (the paper's raw form)"
        else:
            scale = "s_t = shape of sqrt(vhat_(t-1)), floored and normalized to RMS 1 over all coordinates"
        return {
            "max_grad_norm": clip,
            "adaptive": True,
            "description": (
                f"scale-then-privatize: each example's gradient is divided coordinate-wise by "
                f"{scale} and clipped to L2 norm {clip:g} in that geometry; "
                f"{clip:g} is not a bound on the raw gradient"
            ),
        }
    return {
        "max_grad_norm": clip,
        "adaptive": False,
        "description": f"per-example L2 norm of the gradient clipped to C = {clip:g}",
    }


def _sampling(args: Any) -> dict[str, Any]:
    if args.disable_dp:
        return {"method": "shuffled", "accounting_holds": False, "warning": None}
    if args.poisson_sampling:
        return {"method": "poisson", "accounting_holds": True, "warning": None}
    from dp_hf.sampling import SHUFFLED_SAMPLING_WARNING

    return {"method": "shuffled", "accounting_holds": False, "warning": SHUFFLED_SAMPLING_WARNING}


def _consistency_warnings(args: Any, optimizer: Any, mechanism: _Mechanism) -> list[str]:
    """Mismatches between the accounted mechanism and the optimizer that ran (e.g. one passed in by hand)."""
    if optimizer is None or args.disable_dp:
        return []
    notes = []
    noise_multiplier = mechanism.noise_multiplier
    used = getattr(optimizer, "noise_multiplier", None)
    if used is not None and not math.isclose(used, noise_multiplier):
        notes.append(
            f"the optimizer's noise multiplier ({used:g}) differs from the accounted one ({noise_multiplier:g})"
        )
    expected = getattr(optimizer, "expected_batch_size", None)
    if expected is not None and not math.isclose(expected, mechanism.expected_batch_size):
        notes.append(
            f"the optimizer's expected batch ({expected:g}) differs from the sampler's "
            f"({mechanism.expected_batch_size})"
        )
    for note in notes:
        logger.warning("privacy card: %s; the reported epsilon may not describe this run.", note)
    return notes


# --------------------------------------------------------------------------- the optimizer


def _optimizer_name(args: Any, optimizer: Any) -> str:
    """Registry name (``"dp-adamw"``) of the optimizer actually used; the class name if unregistered."""
    if optimizer is None:
        return args.dp_optimizer
    from dp_hf.optim import OPTIMIZERS

    class_name = type(optimizer).__name__
    matches = [name for name, (_, cls) in OPTIMIZERS.items() if cls == class_name]
    return matches[0] if matches else class_name


def _optimizer_summary(args: Any, optimizer: Any) -> dict[str, Any]:
    """Name, hyperparameters (group 0, with the initial lr) and the per-group differences."""
    schedule = {
        "lr_scheduler_type": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        "warmup_steps": args.warmup_steps,
    }
    if optimizer is None:  # saved before training created the optimizer: the arguments are all there is
        hyperparameters = {"lr": args.learning_rate, "weight_decay": args.weight_decay}
        hyperparameters.update(args.dp_optimizer_kwargs)
        return {
            "name": args.dp_optimizer,
            "class": None,
            "hyperparameters": hyperparameters | schedule,
            "param_groups": [],
        }
    # The rule's hyperparameters are the keys of its defaults (torch adds bookkeeping keys to the groups);
    # their values come from group 0, and "lr" is the value set before the scheduler moved it.
    rule_keys = [key for key in optimizer.defaults if key != "lr" and key not in _TORCH_BOOKKEEPING_KEYS]
    first = optimizer.param_groups[0] if optimizer.param_groups else {}
    hyperparameters = {"lr": first.get("initial_lr", optimizer.defaults.get("lr"))}
    hyperparameters.update({key: first.get(key, optimizer.defaults[key]) for key in rule_keys})
    return {
        "name": _optimizer_name(args, optimizer),
        "class": type(optimizer).__name__,
        "hyperparameters": hyperparameters | schedule,
        "param_groups": [_param_group(group, rule_keys, hyperparameters) for group in optimizer.param_groups],
    }


def _param_group(group: Mapping[str, Any], rule_keys: list[str], first: Mapping[str, Any]) -> dict[str, Any]:
    """Size and weight decay of one parameter group, and its hyperparameters that differ from group 0."""
    differing = {key: group[key] for key in rule_keys if key in group and group[key] != first[key]}
    return {
        "num_parameters": sum(p.numel() for p in group["params"]),
        "weight_decay": group.get("weight_decay"),
    } | differing


# --------------------------------------------------------------------------- what the guarantee covers


def _not_covered(args: Any, metadata: Mapping[str, Any], fresh_noise_resumes: list[int]) -> list[str]:
    base = f" ({metadata['base_model']})" if metadata["base_model"] else ""
    items = [
        f"the pretraining data of the base model{base}: only this fine-tuning run is private",
        "hyperparameter search or tuning on the private data: epsilon is for this single run, and every "
        "other run on the same data spends privacy too",
        "any evaluation data, and the evaluation metrics reported here (computed without noise)",
        "choices made from the private data before training (e.g. a tokenizer or vocabulary fitted on it)",
        "people who contribute several examples: the unit is one example, not one person",
        "the number of training examples N, which this card and privacy.json state (q = B / N is computed from "
        "it): it is treated as public, as in Opacus, though under add/remove adjacency it changes with one example",
    ]
    if getattr(args, "dp_log_train_loss", True) and not args.disable_dp:
        items.append(_unnoised_training_loss(args))
    if logs_token_counts(args) and not args.disable_dp:
        items.append(
            f"the number of input tokens seen (include_num_input_tokens_seen={args.include_num_input_tokens_seen!r}: "
            "num_input_tokens_seen in the logs), counted on the private batches without noise"
        )
    if fresh_noise_resumes:
        steps = ", ".join(str(step) for step in fresh_noise_resumes)
        items.append(
            f"what an interrupted run released from the steps after step {steps}, where this run resumed from a "
            "checkpoint with fresh noise (changed settings, or secure_mode): those steps were taken again, and the "
            "interrupted run's logs (grad_norm), evaluations or pushed models from them are second releases that "
            "epsilon does not count"
        )
    if args.noise_seed is not None:
        items.append(_PUBLIC_NOISE_SEED)
    if args.sampling_seed is not None:
        items.append(_PUBLIC_SAMPLING_SEED)
    return items


def _unnoised_training_loss(args: Any) -> str:
    # Other unnoised training statistics that trainer logs (e.g. trl's mean_token_accuracy, entropy).
    extra = [k for k in getattr(args, "UNNOISED_TRAIN_LOG_KEYS", ()) if k not in ("loss", "train_loss")]
    extra.append("the run's time, rates and memory in the training summary")
    also = f" (and {', '.join(extra)})" if extra else ""
    return (
        f"the training loss{also} in the logs, experiment trackers and trainer_state.json: "
        f"{'they are' if extra else 'it is'} computed on the private batches without noise (train with "
        f"dp_log_train_loss=False to keep {'them' if extra else 'it'} out)"
    )


def _audit(trainer: Any) -> dict[str, Any] | None:
    audit_report = getattr(trainer, "audit_report", None)
    return audit_report.to_dict() if audit_report is not None else None


def _versions(with_peft: bool) -> dict[str, str]:
    import torch
    import transformers

    versions = {
        "dp_hf": __version__,
        "dp_accounting": accounting_library_version().split(" ", 1)[1],
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    if with_peft:
        import peft

        versions["peft"] = peft.__version__
    return versions


def _model_card(metadata: Mapping[str, Any], log_history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The report's ``model_card`` entry: the Hub metadata and the latest evaluation."""
    keys = ("model_name", "base_model", "library_name", "pipeline_tag", "license", "language", "tags")
    return {key: metadata[key] for key in keys} | {
        "datasets": metadata["datasets"],
        "eval_dataset_name": metadata["eval_dataset_name"],
        "evaluation": eval_metrics_from_log_history(log_history),
    }


# --------------------------------------------------------------------------- small helpers


def _jsonable(value: Any) -> Any:
    """JSON-safe copy: tuples become lists, non-finite floats ``null``, tensors numbers, others strings."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(item) for item in value]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # 0-d tensors / numpy scalars
        return _jsonable(value.item())
    if hasattr(value, "tolist"):
        return _jsonable(value.tolist())
    return str(value)
