"""What the card says about the model and its data: the Hub metadata of the model card.

Owns :data:`CARD_METADATA_KEYS` and :func:`card_metadata`: the user's explicit overrides, then
``trainer.card_metadata``, then what is inferred from the model (base model id, PEFT or
transformers, pipeline task) and the datasets (their names), and the tags (``differential-privacy``
only on a private model).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from dp_hf.distributed import trainer_model

logger = logging.getLogger(__package__)  # "dp_hf.card", one logger for the package

__all__ = ["CARD_METADATA_KEYS", "card_metadata"]

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


def card_metadata(
    trainer: Any, overrides: Mapping[str, Any], private: bool, proven: bool = True
) -> dict[str, Any]:
    """Model-card metadata: explicit overrides, then ``trainer.card_metadata``, then inferred values.

    ``private``: trained with clipping and noise; ``proven``: the accounting's assumptions hold (Poisson
    sampling), so the stated epsilon is a bound. Only a proven guarantee gets the ``differential-privacy`` tag."""
    chosen = _chosen_metadata(trainer, overrides)
    model = trainer_model(trainer)
    is_adapter = _is_peft_model(model)
    base = model.get_base_model() if is_adapter else model
    dataset_names = [str(name) for name in _as_list(chosen["dataset_name"]) if name]
    dataset_name = dataset_names[0] if dataset_names else _dataset_name(trainer.train_dataset)
    eval_dataset = trainer.eval_dataset
    if isinstance(eval_dataset, Mapping):  # several eval sets: the log keys carry their names
        eval_dataset = None
    return {
        "model_name": str(chosen["model_name"] or _default_model_name(trainer.args)),
        "base_model": chosen["base_model"] or _base_model_id(model, base),
        "library_name": "peft" if is_adapter else "transformers",
        "pipeline_tag": _first(chosen["pipeline_tag"]) or _pipeline_tag(base),
        "license": chosen["license"],
        "language": chosen["language"],
        "tags": _tags(chosen["tags"], private, proven),
        "dataset_name": dataset_name,
        "datasets": dataset_names or ([dataset_name] if dataset_name else []),
        # Never the training set's name: an evaluation set is named only when known.
        "eval_dataset_name": _first(chosen["eval_dataset_name"]) or _dataset_name(eval_dataset),
    }


def _chosen_metadata(trainer: Any, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``trainer.card_metadata`` (unknown keys warned about and ignored), updated with the overrides."""
    user = dict(getattr(trainer, "card_metadata", None) or {})
    unknown = sorted(set(user) - set(CARD_METADATA_KEYS))
    if unknown:
        # A warning, not an error: a typo here must not crash a checkpoint save in the middle of training.
        logger.warning(
            "trainer.card_metadata has unknown keys %s (ignored); use %s.", unknown, list(CARD_METADATA_KEYS)
        )
    chosen = {key: user.get(key) for key in CARD_METADATA_KEYS}
    chosen.update({key: value for key, value in overrides.items() if value is not None})
    return chosen


def _default_model_name(args: Any) -> str:
    """The hub_model_id's name, else the output directory's name."""
    if args.hub_model_id:
        return args.hub_model_id.rstrip("/").split("/")[-1]
    return os.path.basename(os.path.normpath(os.path.abspath(args.output_dir))) or "model"


def _tags(user_tags: Any, private: bool, proven: bool) -> list[str]:
    user_tags = user_tags or []
    user_tags = [user_tags] if isinstance(user_tags, str) else list(user_tags)
    # A non-private model, or one whose epsilon is not a proven bound (shuffled batches), must not be listed
    # under the Hub's differential-privacy tag.
    if not private:
        ours = ["dp-hf", "not-differentially-private"]
    else:
        ours = ["differential-privacy", "dp-hf"] if proven else ["dp-hf", "dp-guarantee-not-proven"]
    return ours + [tag for tag in user_tags if tag not in ("differential-privacy", "dp-hf")]


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
    candidates.append(getattr(getattr(base, "config", None), "name_or_path", None))
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


def _first(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]
