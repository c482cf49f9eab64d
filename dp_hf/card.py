"""Privacy model cards: ``README.md`` with a "Privacy" section and a machine-readable ``privacy.json``.

:class:`~dp_hf.trainer.DPTrainer` writes both files next to the weights each
time it saves a model: the final ``save_model()``, every checkpoint, and the
folder that ``push_to_hub()`` uploads (PEFT adapters included: the adapter
directory gets them). ``dp-hf card OUTPUT_DIR`` re-renders the card of an
existing output directory from its ``privacy.json`` (and ``trainer_state.json``,
when present, for the latest evaluation metrics)::

    dp-hf card outputs/run1            # print the card
    python -m dp_hf.card outputs/run1 --write   # (re)write outputs/run1/README.md

``privacy.json`` reproduces the reported epsilon::

    report = json.load(open("privacy.json"))
    compute_epsilon(report["sample_rate"], report["noise_multiplier"], report["steps"],
                    report["delta"], report["accountant"])   # one (sigma, q) for the whole run
    epsilon_from_report(report)                              # any history (composes all of it)

Card metadata. What cannot be inferred can be set on the trainer before saving::

    trainer.card_metadata = {
        "dataset_name": "imdb",          # default: train_dataset.info.dataset_name / builder_name
        "base_model": "bert-base-uncased",  # default: model.config._name_or_path (if a Hub id)
        "license": "apache-2.0",
        "language": "en",
        "model_name": "bert-imdb-dp",    # default: the hub_model_id's name or output_dir's name
        "tags": ["sentiment"],           # added to "differential-privacy" and "dp-hf"
        "pipeline_tag": "text-classification",  # default: from the model class
    }

``trainer.push_to_hub(language=..., license=..., finetuned_from=..., dataset=..., tags=...)``
arguments, which the Trainer passes to ``create_model_card``, take precedence.

What is never written: training examples or tokens of any kind (only counts
and aggregate evaluation metrics), the Hub token, and the values of
``noise_seed`` / ``sampling_seed`` (only whether they were fixed: a published
noise seed would void the guarantee).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from dp_hf import __version__
from dp_hf.accounting import PrivacyAccountant, accounting_library_version
from dp_hf.audit.report import audit_card_lines

logger = logging.getLogger(__name__)

__all__ = [
    "CARD_METADATA_KEYS",
    "CARD_NAME",
    "PRIVACY_NAME",
    "SCHEMA_VERSION",
    "build_privacy_report",
    "epsilon_from_report",
    "eval_metrics_from_log_history",
    "load_privacy_report",
    "main_card",
    "render_card",
    "render_card_for_output_dir",
    "write_card_files",
]

CARD_NAME = "README.md"
PRIVACY_NAME = "privacy.json"
TRAINER_STATE_NAME = "trainer_state.json"  # what transformers.Trainer writes in each checkpoint
SCHEMA_VERSION = 1

# Keys a user may put in ``trainer.card_metadata``.
CARD_METADATA_KEYS = (
    "model_name",
    "base_model",
    "dataset_name",
    "eval_dataset_name",
    "license",
    "language",
    "tags",
    "pipeline_tag",
)

# Builder names of local files, not datasets on the Hub (as transformers' TrainingSummary excludes them).
_GENERIC_BUILDERS = {
    "csv",
    "json",
    "pandas",
    "parquet",
    "text",
    "arrow",
    "generator",
    "imagefolder",
    "audiofolder",
}

# Evaluation log entries that are timings or positions, not metrics.
_NON_METRIC_EVAL_KEYS = {"runtime", "samples_per_second", "steps_per_second", "model_preparation_time"}

# Implementation switches torch keeps next to the hyperparameters; they do not change the update.
_TORCH_BOOKKEEPING_KEYS = {"differentiable", "foreach", "fused", "capturable"}

_MACADAM = ("dp-macadam", "dp-macadam-bc")
_SCALE_THEN_PRIVATIZE = ("dp-adam-stp", "dp-adamw-stp")

PRIVACY_UNIT = "one training example (one row of the training dataset)"
ADJACENCY = "add/remove: neighbouring training sets differ by adding or removing one example"

_PUBLIC_NOISE_SEED = (
    "the noise, if `noise_seed` becomes known: this run fixed `noise_seed`, so anyone who learns the seed can "
    "regenerate and subtract the noise. The seed is not written here; keep it (and the checkpoints' "
    "optimizer state, which holds the noise generator) secret"
)
_PUBLIC_SAMPLING_SEED = (
    "the batch composition, if `sampling_seed` becomes known: this run fixed `sampling_seed`, and the "
    "amplification by Poisson sampling assumes the sampled batches are secret"
)


# --------------------------------------------------------------------------- the report (privacy.json)


def build_privacy_report(trainer: Any, **card_overrides: Any) -> dict[str, Any]:
    """The content of ``privacy.json`` for a :class:`~dp_hf.trainer.DPTrainer`, now.

    ``card_overrides`` (keys of :data:`CARD_METADATA_KEYS`) take precedence
    over ``trainer.card_metadata``, which takes precedence over what is inferred
    from the model and the datasets. All values are JSON-serialisable;
    infinite numbers (epsilon without noise) are ``null``.
    """
    args = trainer.args
    accountant: PrivacyAccountant = trainer.accountant
    optimizer = getattr(trainer, "dp_optimizer", None) or getattr(trainer, "optimizer", None)
    dataset_size = getattr(trainer, "dataset_size", None)
    sample_rate = getattr(trainer, "sample_rate", None)
    delta = getattr(trainer, "delta", None)
    noise_multiplier = float(getattr(trainer, "noise_multiplier", None) or 0.0)
    steps = accountant.steps

    epsilon: float | None = None
    if delta is not None:
        epsilon = trainer.privacy_spent()[0]
    not_private_reason = None
    if args.disable_dp:
        not_private_reason = "disable_dp=True: no per-example clipping and no noise"
    elif dataset_size is None:
        not_private_reason = "this trainer had no training dataset, so nothing was trained with DP by it"
    elif epsilon is None or not math.isfinite(epsilon):
        not_private_reason = "noise multiplier 0: the noiseless updates have infinite epsilon"

    metadata = _card_metadata(trainer, card_overrides, private=not_private_reason is None)
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "private": not_private_reason is None,
        "not_private_reason": not_private_reason,
        "privacy_unit": PRIVACY_UNIT,
        "adjacency": ADJACENCY,
        "epsilon": epsilon,
        "delta": delta,
        "target_epsilon": args.target_epsilon,
        "noise_multiplier": noise_multiplier,
        "sample_rate": sample_rate,
        "steps": steps,
        # "epochs" is kept for older readers: it is the expected passes (steps x q), not the Trainer's epochs.
        "epochs": steps * sample_rate if sample_rate is not None else None,
        "expected_passes": steps * sample_rate if sample_rate is not None else None,
        "steps_per_epoch": getattr(trainer, "steps_per_epoch", None),
        "trainer_epochs": steps / trainer.steps_per_epoch
        if getattr(trainer, "steps_per_epoch", None)
        else None,
        "accountant": accountant.mechanism,
        "accounting_library": accounting_library_version(trainer.accountant.mechanism),
        "accountant_state": accountant.state_dict(),
        "expected_batch_size": args.expected_batch_size,
        "batch": {
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "world_size": args.world_size,
        },
        "clipping": _clipping(args, optimizer),
        "optimizer": _optimizer_summary(args, optimizer),
        "sampling": _sampling(args),
        "dataset": {"name": metadata["dataset_name"], "size": dataset_size},
        "secure_mode": bool(args.secure_mode),
        "noise_seed_fixed": args.noise_seed is not None,
        "sampling_seed_fixed": args.sampling_seed is not None,
        "stopped_by_budget": bool(getattr(trainer, "stopped_by_budget", False)),
        "global_step": int(trainer.state.global_step),
        "not_covered": _not_covered(args, metadata),
        "audit": trainer.audit_report.to_dict()
        if getattr(trainer, "audit_report", None) is not None
        else None,
        "warnings": _consistency_warnings(trainer, optimizer, noise_multiplier),
        "versions": _versions(metadata["library_name"] == "peft"),
        "model_card": {
            key: metadata[key]
            for key in (
                "model_name",
                "base_model",
                "library_name",
                "pipeline_tag",
                "license",
                "language",
                "tags",
            )
        }
        | {
            "datasets": metadata["datasets"],
            "eval_dataset_name": metadata["eval_dataset_name"],
            "evaluation": eval_metrics_from_log_history(trainer.state.log_history),
        },
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
        prefix = prefixes[0]
        metrics = {}
        for key, value in entry.items():
            if not key.startswith(prefix + "_"):
                continue
            name = key[len(prefix) + 1 :]
            if name in _NON_METRIC_EVAL_KEYS or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                metrics[name] = value
        if metrics:  # sorted: trainer_state.json stores its log entries with sorted keys
            return {
                "step": entry.get("step"),
                "epoch": entry.get("epoch"),
                "split": prefix,
                "metrics": dict(sorted(metrics.items())),
            }
    return None


def _card_metadata(trainer: Any, overrides: Mapping[str, Any], private: bool) -> dict[str, Any]:
    """Model-card metadata: explicit overrides, then ``trainer.card_metadata``, then inferred values."""
    user = dict(getattr(trainer, "card_metadata", None) or {})
    unknown = sorted(set(user) - set(CARD_METADATA_KEYS))
    if unknown:
        # A warning, not an error: a typo here must not crash a checkpoint save in the middle of training.
        logger.warning(
            "trainer.card_metadata has unknown keys %s (ignored); use %s.", unknown, list(CARD_METADATA_KEYS)
        )
    chosen = {key: user.get(key) for key in CARD_METADATA_KEYS}
    chosen.update({key: value for key, value in overrides.items() if value is not None})

    model = _unwrap(trainer)
    is_adapter = _is_peft_model(model)
    base = model.get_base_model() if is_adapter else model
    args = trainer.args
    model_name = chosen["model_name"]
    if not model_name:
        if args.hub_model_id:
            model_name = args.hub_model_id.rstrip("/").split("/")[-1]
        else:
            model_name = os.path.basename(os.path.normpath(os.path.abspath(args.output_dir))) or "model"
    user_tags = chosen["tags"] or []
    user_tags = [user_tags] if isinstance(user_tags, str) else list(user_tags)
    # A non-private model must not be listed under the Hub's differential-privacy tag.
    tags = (["differential-privacy", "dp-hf"] if private else ["dp-hf", "not-differentially-private"]) + [
        tag for tag in user_tags if tag not in ("differential-privacy", "dp-hf")
    ]
    dataset_names = [str(name) for name in _as_list(chosen["dataset_name"]) if name]
    dataset_name = dataset_names[0] if dataset_names else _dataset_name(trainer.train_dataset)
    eval_dataset = trainer.eval_dataset
    if isinstance(eval_dataset, Mapping):  # several eval sets: the log keys carry their names
        eval_dataset = None
    return {
        "model_name": str(model_name),
        "base_model": chosen["base_model"] or _base_model_id(model, base),
        "library_name": "peft" if is_adapter else "transformers",
        "pipeline_tag": _first(chosen["pipeline_tag"]) or _pipeline_tag(base),
        "license": chosen["license"],
        "language": chosen["language"],
        "tags": tags,
        "dataset_name": dataset_name,
        "datasets": dataset_names or ([dataset_name] if dataset_name else []),
        # Never the training set's name: an evaluation set is named only when known.
        "eval_dataset_name": _first(chosen["eval_dataset_name"]) or _dataset_name(eval_dataset),
    }


def _unwrap(trainer: Any) -> Any:
    accelerator = getattr(trainer, "accelerator", None)
    return accelerator.unwrap_model(trainer.model) if accelerator is not None else trainer.model


def _is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def _base_model_id(model: Any, base: Any) -> str | None:
    """A Hub id of the pretrained model, or None (built from a config, or loaded from a local directory)."""
    candidates = []
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, Mapping):
        candidates += [getattr(cfg, "base_model_name_or_path", None) for cfg in peft_config.values()]
    candidates.append(getattr(getattr(base, "config", None), "_name_or_path", None))
    for name in candidates:
        # A local path would be meaningless (and possibly revealing) on the Hub.
        if name and isinstance(name, str) and not os.path.isdir(name) and not os.path.isabs(name):
            return name
    return None


def _pipeline_tag(model: Any) -> str | None:
    """The Hub task of a transformers model class (as the Trainer's own card infers it)."""
    try:
        from transformers.modelcard import TASK_MAPPING
    except ImportError:  # pragma: no cover - depends on the transformers version
        return None
    class_name = type(model).__name__
    for task, mapping in TASK_MAPPING.items():
        if class_name in {name for names in mapping.values() for name in _as_list(names)}:
            return task
    return None


def _dataset_name(dataset: Any) -> str | None:
    """``datasets.Dataset.info.dataset_name`` (or its builder name, unless a generic file loader)."""
    info = getattr(dataset, "info", None)
    if info is None:
        return None
    for name in (getattr(info, "dataset_name", None), getattr(info, "builder_name", None)):
        if name and name not in _GENERIC_BUILDERS:
            return str(name)
    return None


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
        return {
            "max_grad_norm": clip,
            "adaptive": True,
            "description": (
                f"scale-then-privatize: each example's gradient is divided coordinate-wise by "
                f"s_t = sqrt(vhat_(t-1)) + gamma_s and clipped to L2 norm {clip:g} in that geometry; "
                f"{clip:g} is not a bound on the raw gradient"
            ),
        }
    return {
        "max_grad_norm": clip,
        "adaptive": False,
        "description": f"per-example L2 norm of the gradient clipped to C = {clip:g}",
    }


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
    groups = []
    for group in optimizer.param_groups:
        differing = {
            key: group[key] for key in rule_keys if key in group and group[key] != hyperparameters[key]
        }
        groups.append(
            {
                "num_parameters": sum(p.numel() for p in group["params"]),
                "weight_decay": group.get("weight_decay"),
            }
            | differing
        )
    return {
        "name": _optimizer_name(args, optimizer),
        "class": type(optimizer).__name__,
        "hyperparameters": hyperparameters | schedule,
        "param_groups": groups,
    }


def _sampling(args: Any) -> dict[str, Any]:
    if args.disable_dp:
        return {"method": "shuffled", "accounting_holds": False, "warning": None}
    if args.poisson_sampling:
        return {"method": "poisson", "accounting_holds": True, "warning": None}
    from dp_hf.sampling import SHUFFLED_SAMPLING_WARNING

    return {"method": "shuffled", "accounting_holds": False, "warning": SHUFFLED_SAMPLING_WARNING}


#: Where the card points for the full threat model.
THREAT_MODEL = "the threat model of dp_hf (`docs/threat-model.md` in the dp_hf repository)"


def _not_covered(args: Any, metadata: Mapping[str, Any]) -> list[str]:
    base = f" ({metadata['base_model']})" if metadata["base_model"] else ""
    items = [
        f"the pretraining data of the base model{base}: only this fine-tuning run is private",
        "hyperparameter search or tuning on the private data: epsilon is for this single run, and every "
        "other run on the same data spends privacy too",
        "any evaluation data, and the evaluation metrics reported here (computed without noise)",
        "choices made from the private data before training (e.g. a tokenizer or vocabulary fitted on it)",
        "people who contribute several examples: the unit is one example, not one person",
    ]
    if getattr(args, "dp_log_train_loss", True) and not args.disable_dp:
        # Other unnoised training statistics that trainer logs (e.g. trl's mean_token_accuracy, entropy).
        extra = [k for k in getattr(args, "UNNOISED_TRAIN_LOG_KEYS", ()) if k not in ("loss", "train_loss")]
        also = f" (and {', '.join(extra)})" if extra else ""
        items.append(
            f"the training loss{also} in the logs, experiment trackers and trainer_state.json: "
            f"{'they are' if extra else 'it is'} computed on the private batches without noise (train with "
            f"dp_log_train_loss=False to keep {'them' if extra else 'it'} out)"
        )
    if args.noise_seed is not None:
        items.append(_PUBLIC_NOISE_SEED)
    if args.sampling_seed is not None:
        items.append(_PUBLIC_SAMPLING_SEED)
    return items


def _consistency_warnings(trainer: Any, optimizer: Any, noise_multiplier: float) -> list[str]:
    """Mismatches between the accounted mechanism and the optimizer that ran (e.g. one passed in by hand)."""
    if optimizer is None or trainer.args.disable_dp:
        return []
    notes = []
    used = getattr(optimizer, "noise_multiplier", None)
    if used is not None and not math.isclose(used, noise_multiplier):
        notes.append(
            f"the optimizer's noise multiplier ({used:g}) differs from the accounted one ({noise_multiplier:g})"
        )
    expected = getattr(optimizer, "expected_batch_size", None)
    if expected is not None and not math.isclose(expected, trainer.args.expected_batch_size):
        notes.append(
            f"the optimizer's expected batch ({expected:g}) differs from the sampler's "
            f"({trainer.args.expected_batch_size})"
        )
    for note in notes:
        logger.warning("privacy card: %s; the reported epsilon may not describe this run.", note)
    return notes


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


def _first(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


# --------------------------------------------------------------------------- rendering (README.md)


def render_card(report: Mapping[str, Any], evaluation: Mapping[str, Any] | None = None) -> str:
    """The model card (YAML front matter + Markdown) for a ``privacy.json`` report.

    ``evaluation`` (as returned by :func:`eval_metrics_from_log_history`) replaces the one stored in the
    report, e.g. a newer one from ``trainer_state.json``.
    """
    from huggingface_hub import EvalResult, ModelCardData

    meta = report["model_card"]
    if evaluation is None:
        evaluation = meta.get("evaluation")
    metrics = (evaluation or {}).get("metrics") or {}
    eval_dataset = meta.get("eval_dataset_name")
    eval_results = [
        EvalResult(
            task_type=meta.get("pipeline_tag") or "other",
            dataset_type=eval_dataset or "custom",
            dataset_name=eval_dataset or "custom evaluation data",
            metric_type=name,
            metric_value=value,
            metric_name=_title(name),
        )
        for name, value in metrics.items()
    ]
    data = ModelCardData(
        base_model=meta.get("base_model"),
        datasets=meta.get("datasets") or None,
        language=meta.get("language"),
        license=meta.get("license"),
        library_name=meta.get("library_name"),
        model_name=meta.get("model_name") if eval_results else None,  # only model-index uses it
        pipeline_tag=meta.get("pipeline_tag"),
        tags=meta.get("tags"),
        eval_results=eval_results or None,
    )
    body = "\n".join(
        [
            f"# {meta.get('model_name')}",
            "",
            _intro(report),
            "",
            _privacy_section(report),
            _evaluation_section(evaluation, metrics),
            "## Training with dp_hf",
            "",
            "Trained with dp_hf (differentially private fine-tuning of Hugging Face models). `privacy.json` next "
            "to this card holds every value above in machine-readable form.",
            "",
        ]
    )
    return f"---\n{data.to_yaml()}\n---\n\n{body}"


def _intro(report: Mapping[str, Any]) -> str:
    meta = report["model_card"]
    base = meta.get("base_model")
    what = "A PEFT adapter" if meta.get("library_name") == "peft" else "A model"
    # Without a known base model dp_hf cannot tell fine-tuning from training from scratch: say "trained".
    source = f" fine-tuned from [{base}](https://huggingface.co/{base})" if base else " trained"
    dataset = report["dataset"]
    size = f"{dataset['size']} training examples" if dataset.get("size") is not None else ""
    if dataset.get("name"):
        data = f" on {_md(dataset['name'])}" + (f" ({size})" if size else "")
    else:
        data = f" on {size}" if size else ""
    if report["private"]:
        eps = _fmt_epsilon(report["epsilon"])
        return (
            f"{what}{source}{data} with differential privacy: ({eps}, {report['delta']:g})-DP "
            "for each training example."
        )
    return f"{what}{source}{data}. **It is NOT differentially private** (see below)."


def _steps_text(report: Mapping[str, Any]) -> str:
    """``90 steps (15 epochs of 6 steps; each example sampled 16 times in expectation = steps × q)``."""
    passes = report.get("expected_passes", report.get("epochs"))
    sampled = f"each example sampled {passes:.3g} times in expectation = steps × q"
    per_epoch, epochs = report.get("steps_per_epoch"), report.get("trainer_epochs")
    if per_epoch and epochs is not None:
        return f"{_steps(report['steps'])} ({epochs:.3g} epochs of {per_epoch} steps; {sampled})"
    return f"{_steps(report['steps'])} ({sampled})"


def _privacy_section(report: Mapping[str, Any]) -> str:
    lines = ["## Privacy", ""]
    if not report["private"]:
        lines += [
            f"**This model is NOT private.** Reason: {report['not_private_reason']}. No differential-privacy "
            "guarantee of any kind applies to its training data; it is a non-private baseline.",
            "",
            f"Training: {_steps(report['steps'])}, expected batch {report['expected_batch_size']}, "
            f"optimizer `{report['optimizer']['name']}` ({_hyperparameters(report['optimizer'])}), "
            f"dp_hf {report['versions']['dp_hf']}.",
            "",
        ]
        return "\n".join(lines)

    sampling = report["sampling"]
    if not sampling["accounting_holds"]:
        lines += [f"> **Warning: the accounting does not hold for this run.** {sampling['warning']}", ""]
    for warning in report.get("warnings") or []:
        lines += [f"> **Warning:** {warning}; the epsilon below may not describe this run.", ""]
    dataset = report["dataset"]
    optimizer = report["optimizer"]
    clipping = report["clipping"]
    rows = [
        ("Unit of privacy", f"{report['privacy_unit']}; {report['adjacency']}"),
        ("Epsilon (ε) spent", _fmt_epsilon(report["epsilon"])),
        ("Delta (δ)", f"{report['delta']:g}"),
        ("Accountant", f"{report['accountant'].upper()} ({report['accounting_library']})"),
        ("Noise multiplier σ", f"{report['noise_multiplier']:.6g}"),
        ("Sample rate q", f"{report['sample_rate']:.6g}"),
        ("Steps", _steps_text(report)),
        ("Expected logical batch", str(report["expected_batch_size"])),
        ("Clipping", clipping["description"]),
        ("Sampling", _sampling_text(sampling)),
        ("Optimizer", f"`{optimizer['name']}` ({_hyperparameters(optimizer)})"),
        ("Training data", f"{_md(dataset.get('name') or 'not named')}, {dataset.get('size')} examples"),
        ("Noise generator", _noise_text(report)),
        ("Library", f"dp_hf {report['versions']['dp_hf']}"),
    ]
    if report.get("target_epsilon") is not None:
        stop = " (training stopped at the budget)" if report.get("stopped_by_budget") else ""
        rows.insert(2, ("Target epsilon", f"{report['target_epsilon']:g}{stop}"))
    lines += [
        f"This model was trained with differential privacy: **(ε, δ) = ({_fmt_epsilon(report['epsilon'])}, "
        f"{report['delta']:g})** for {report['privacy_unit']}, under {report['adjacency']}. The weights "
        "(and anything computed from them) reveal at most this much about whether any one example was in "
        "the training set.",
        "",
        "| | |",
        "|---|---|",
        *[f"| {name} | {_cell(value)} |" for name, value in rows],
        "",
        *(audit_card_lines(report["audit"]) if report.get("audit") else []),
        "### What the guarantee does not cover",
        "",
        *[f"- {item}" for item in report["not_covered"]],
        "",
        f"What dp_hf protects, refuses and does not cover is listed item by item in {THREAT_MODEL}.",
        "",
        "### Reproducing epsilon",
        "",
    ]
    history = report["accountant_state"]["history"]
    if len(history) <= 1:
        lines += [
            "```python",
            "from dp_hf.accounting import compute_epsilon",
            "",
            f"compute_epsilon(sample_rate={report['sample_rate']!r}, noise_multiplier={report['noise_multiplier']!r}, "
            f"steps={report['steps']!r}, delta={report['delta']!r}, accountant={report['accountant']!r})",
            "```",
        ]
    else:
        lines += [
            f"The noise multiplier or sample rate changed during training ({len(history)} phases); compose the "
            "whole history stored in `privacy.json`:",
            "",
            "```python",
            "import json",
            "from dp_hf.card import epsilon_from_report",
            "",
            'epsilon_from_report(json.load(open("privacy.json")))',
            "```",
        ]
    lines.append("")
    return "\n".join(lines)


def _evaluation_section(evaluation: Mapping[str, Any] | None, metrics: Mapping[str, Any]) -> str:
    if not metrics:
        return ""
    where = f" (step {evaluation.get('step')})" if evaluation and evaluation.get("step") is not None else ""
    split = (evaluation or {}).get("split")
    if split and split != "eval":
        where = f" on the `{split}` split{where}"
    rows = [f"| {_cell(_title(name))} | {value:.6g} |" for name, value in metrics.items()]
    return "\n".join(
        [
            "## Evaluation",
            "",
            f"Latest evaluation{where}. These metrics were computed without noise: they are not covered by the "
            "privacy guarantee.",
            "",
            "| Metric | Value |",
            "|---|---|",
            *rows,
            "",
            "",
        ]
    )


def _hyperparameters(optimizer: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={_fmt_value(value)}" for key, value in optimizer["hyperparameters"].items())


def _sampling_text(sampling: Mapping[str, Any]) -> str:
    if sampling["method"] == "poisson":
        return "Poisson: each example joins each logical batch independently with probability q"
    return "shuffled fixed-size batches: **the Poisson accounting above does not hold**"


def _steps(count: int) -> str:
    return f"{count} step" if count == 1 else f"{count} steps"


def _noise_text(report: Mapping[str, Any]) -> str:
    if report["secure_mode"]:
        return "freshly seeded from OS entropy at every draw (secure_mode)"
    if report["noise_seed_fixed"]:
        return "seeded with a user-fixed noise_seed (not published here; the guarantee needs it secret)"
    return "seeded once from OS entropy"


def _fmt_epsilon(epsilon: float | None) -> str:
    return "∞" if epsilon is None else f"{epsilon:.4g}"


def _fmt_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "(" + ", ".join(_fmt_value(item) for item in value) + ")"
    return str(value)


def _title(name: str) -> str:
    return " ".join(part.capitalize() for part in name.split("_"))


def _md(text: Any) -> str:
    """User-given text inside Markdown: no raw HTML, no line breaks."""
    return str(text).replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def _cell(text: Any) -> str:
    return _md(text).replace("|", "\\|")


# --------------------------------------------------------------------------- files


def write_card_files(trainer: Any, output_dir: str, **card_overrides: Any) -> dict[str, Any]:
    """Write ``privacy.json`` and ``README.md`` for ``trainer`` into ``output_dir``; returns the report."""
    report = build_privacy_report(trainer, **card_overrides)
    os.makedirs(output_dir, exist_ok=True)
    _write_atomic(os.path.join(output_dir, PRIVACY_NAME), json.dumps(report, indent=2) + "\n")
    _write_atomic(os.path.join(output_dir, CARD_NAME), render_card(report))
    logger.info("wrote the privacy model card (%s, %s) to %s", CARD_NAME, PRIVACY_NAME, output_dir)
    return report


def load_privacy_report(output_dir: str) -> dict[str, Any]:
    """Read ``privacy.json`` of an output directory (a save of :class:`~dp_hf.trainer.DPTrainer`)."""
    path = os.path.join(output_dir, PRIVACY_NAME)
    if not os.path.isdir(output_dir):
        raise ValueError(
            f"{output_dir!r} is not a directory; pass a DPTrainer output or checkpoint directory."
        )
    if not os.path.isfile(path):
        raise ValueError(
            f"{path} does not exist: DPTrainer.save_model() writes it (dp_hf >= 0.1.0) next to the weights and "
            "in each checkpoint; pass such a directory."
        )
    with open(path, encoding="utf-8") as handle:
        report = json.load(handle)
    version = report.get("schema_version") if isinstance(report, dict) else None
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ValueError(
            f"{path} has schema_version {version!r}; this dp_hf reads up to {SCHEMA_VERSION}. Upgrade dp_hf."
        )
    return report


def render_card_for_output_dir(output_dir: str) -> str:
    """The card of an output directory, with the latest evaluation of its ``trainer_state.json`` if any."""
    report = load_privacy_report(output_dir)
    evaluation = None
    state_path = os.path.join(output_dir, TRAINER_STATE_NAME)
    if os.path.isfile(state_path):
        with open(state_path, encoding="utf-8") as handle:
            evaluation = eval_metrics_from_log_history(json.load(handle).get("log_history") or [])
    return render_card(report, evaluation)


def _write_atomic(path: str, text: str) -> None:
    # A crash mid-write must not leave a truncated card next to valid weights.
    directory = os.path.dirname(path) or "."
    handle, tmp_path = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as tmp:
            tmp.write(text)
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise


# --------------------------------------------------------------------------- command line


def main_card(args: argparse.Namespace) -> int:
    """``dp-hf card OUTPUT_DIR [--write]``: print the card, or write it to ``OUTPUT_DIR/README.md``.

    Bad input raises ``ValueError`` (the ``dp-hf`` command turns it into a usage error, status 2).
    """
    card = render_card_for_output_dir(args.output_dir)
    if getattr(args, "write", False):
        path = os.path.join(args.output_dir, CARD_NAME)
        _write_atomic(path, card)
        print(f"wrote {path}", file=sys.stderr)
    else:
        sys.stdout.write(card)
    return 0


def add_card_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the ``card`` command (``output_dir``, ``--write``)."""
    parser.add_argument("output_dir", help="training output or checkpoint directory (with privacy.json)")
    parser.add_argument("--write", action="store_true", help="write OUTPUT_DIR/README.md instead of printing")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dp_hf.card OUTPUT_DIR [--write]``."""
    parser = argparse.ArgumentParser(
        prog="python -m dp_hf.card", description="Render a dp_hf privacy model card."
    )
    add_card_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return main_card(args)
    except ValueError as err:
        parser.error(str(err))
    return 2  # unreachable: parser.error exits


if __name__ == "__main__":
    sys.exit(main())
