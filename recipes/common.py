"""Pieces every recipe shares: YAML + command-line parsing, accuracy, and the end-of-run report.

Argument parsing follows the Hugging Face example scripts (an ``HfArgumentParser`` over the
recipe's own dataclass and :class:`dp_hf.DPTrainingArguments`) with one addition: a YAML file
given as the *first* argument supplies the defaults and any ``--flag value`` after it overrides
them, so a paper configuration can be varied without copying it::

    python -m recipes.bert_qnli recipes/configs/bert_qnli.yaml --target_epsilon 1 --dp_optimizer dp-sgd

(``HfArgumentParser.parse_yaml_file`` alone cannot do this: it builds the dataclasses directly
and ignores the command line.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from transformers import HfArgumentParser

from dp_hf import DPTrainingArguments
from dp_hf.accounting.display import epsilon_up

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
RESULTS_NAME = "dp_results.json"
# Arguments of which a run takes exactly one: naming one on the command line drops the other
# from the configuration, so `--noise_multiplier 1.0` works on a config that sets target_epsilon.
EXCLUSIVE_ARGUMENTS = (("target_epsilon", "noise_multiplier"),)


# ----------------------------------------------------------------------------------- arguments


class _ConfigLoader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-5`` as a string; accept it as a float, as YAML 1.2 and Python do."""


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def load_yaml_config(path: str | os.PathLike) -> dict[str, Any]:
    """The mapping in a recipe's YAML file (an empty file is an empty mapping)."""
    with open(path, encoding="utf-8") as handle:
        config = yaml.load(handle, Loader=_ConfigLoader)
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a recipe config must be a mapping of argument names to values.")
    return config


def parse_recipe_args(
    recipe_cls: type, argv: Sequence[str] | None = None, defaults: dict[str, Any] | None = None
) -> tuple[Any, DPTrainingArguments]:
    """``(recipe_args, training_args)`` from ``[config.yaml] [--flag value ...]``.

    The YAML keys are the same names as the command-line flags (without ``--``); an unknown key is
    an error rather than being silently ignored. Precedence, lowest first: the dataclass defaults,
    ``defaults`` (a recipe's embedded configuration), the YAML file, the command line.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # A recipe whose trainer takes other arguments (llm_lora: trl's DPSFTConfig) names their class.
    parser = HfArgumentParser((recipe_cls, getattr(recipe_cls, "training_args_class", DPTrainingArguments)))
    config = dict(defaults or {})
    source = f"{recipe_cls.__name__} defaults"
    if argv and argv[0].endswith((".yaml", ".yml")):
        source = argv.pop(0)
        config.update(load_yaml_config(source))
    on_command_line = _command_line_values(argv)
    for group in EXCLUSIVE_ARGUMENTS:
        if on_command_line.keys() & set(group):
            for name in set(group) - on_command_line.keys():
                config.pop(name, None)
    # dp_optimizer_kwargs are the hyperparameters of the configuration's optimizer (h1/h2 of
    # DP-MacAdam, density of DP-MicroAdam...): another optimizer would reject them.
    new_optimizer = on_command_line.get("dp_optimizer")
    if (
        new_optimizer is not None
        and "dp_optimizer_kwargs" not in on_command_line
        and config.get("dp_optimizer_kwargs")
        and _optimizer_key(new_optimizer) != _optimizer_key(str(config.get("dp_optimizer", "")))
    ):
        logger.warning(
            "--dp_optimizer %s replaces the configured %s, so its dp_optimizer_kwargs %s are dropped; "
            "pass --dp_optimizer_kwargs to set the new optimizer's own.",
            new_optimizer,
            config.get("dp_optimizer"),
            config.pop("dp_optimizer_kwargs"),
        )
    if config:
        _use_config_as_defaults(parser, config, source)
    recipe_args, training_args = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    return recipe_args, training_args


def _optimizer_key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _command_line_values(argv: Sequence[str]) -> dict[str, str | None]:
    """``{name: value}`` of the ``--name value`` / ``--name=value`` flags (value None for a bare flag)."""
    values: dict[str, str | None] = {}
    for position, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        name, equals, value = arg[2:].partition("=")
        if not equals:
            following = argv[position + 1] if position + 1 < len(argv) else None
            value = None if following is None or following.startswith("--") else following
        values[name] = value
    return values


def _use_config_as_defaults(parser: HfArgumentParser, config: dict[str, Any], source: str) -> None:
    actions = [action for action in parser._actions if action.dest != "help"]
    known = {action.dest for action in actions}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(
            f"{source}: unknown argument(s) {unknown}; the keys must be recipe or DPTrainingArguments "
            "fields (see `python -m recipes.<name> --help`)."
        )
    for action in actions:
        if action.dest in config:
            action.required = False  # the file provides it; the command line may still override it
    # argparse passes string defaults through the argument's type, so "1e-3" or "true" convert as
    # they would on the command line; other YAML values (numbers, lists, mappings) are kept as they are.
    parser.set_defaults(**config)


@dataclass
class CommonArguments:
    """Fields every recipe has (a recipe's own dataclass inherits them)."""

    cpu_threads: int | None = field(
        default=None,
        metadata={
            "help": "torch.set_num_threads for CPU runs (default: torch's choice). Small models on a shared "
            "or small CPU run faster on 1 thread: more threads mostly wait on each other."
        },
    )


@dataclass
class SmokeArguments(CommonArguments):
    """Fields of the paper recipes, which all have an offline smoke mode."""

    smoke: bool = field(
        default=False,
        metadata={
            "help": "Offline pipeline check: a tiny random model built from a config and a tiny synthetic "
            "dataset replace the Hub downloads; everything else (DPTrainer, evaluation, saving) is the same."
        },
    )


def apply_cpu_threads(args: CommonArguments) -> None:
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)


def setup_logging(training_args: DPTrainingArguments) -> None:
    """INFO logs on the main process (the privacy plan, epsilon), warnings elsewhere."""
    import datasets
    import transformers

    level = logging.INFO if training_args.should_log else logging.WARNING
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=level)
    for name in ("dp_hf", "recipes"):
        logging.getLogger(name).setLevel(level)
    # dp-accounting's RDP bound logs a warning for every order it skips during noise calibration.
    logging.getLogger("absl").setLevel(logging.ERROR)
    # The libraries' own INFO lines (config dumps, file writes) would drown the privacy plan.
    transformers.utils.logging.set_verbosity_warning()
    datasets.utils.logging.set_verbosity_warning()


# ----------------------------------------------------------------------------------- metrics


def numpy_accuracy(predictions: np.ndarray, references: np.ndarray) -> float:
    """Fraction of exact matches; what ``evaluate.load("accuracy")`` computes."""
    predictions = np.asarray(predictions).reshape(-1)
    references = np.asarray(references).reshape(-1)
    if predictions.shape != references.shape:
        raise ValueError(f"{predictions.shape[0]} predictions for {references.shape[0]} references.")
    return float((predictions == references).mean()) if references.size else math.nan


def accuracy_metric(use_evaluate: bool = True) -> Callable[[Any], dict[str, float]]:
    """A ``compute_metrics`` function for the Trainer: accuracy of the arg-max prediction.

    ``evaluate.load("accuracy")`` downloads its metric script from the Hub unless it is cached,
    so offline (``HF_HUB_OFFLINE=1`` or no network) it fails; then the same number is computed
    with numpy and a warning says so. ``use_evaluate=False`` skips the attempt (smoke runs).
    """
    metric = None
    if use_evaluate:
        try:
            import evaluate

            metric = evaluate.load("accuracy")
        except Exception as err:  # any failure (offline, no cache) has the same fallback
            logger.warning(
                "evaluate.load('accuracy') is unavailable (%s: %s); computing accuracy with numpy instead "
                "(identical definition: mean of prediction == label).",
                type(err).__name__,
                str(err).splitlines()[0] if str(err) else "",
            )

    def compute_metrics(eval_pred) -> dict[str, float]:
        logits = (
            eval_pred.predictions[0] if isinstance(eval_pred.predictions, tuple) else eval_pred.predictions
        )
        predictions = np.argmax(logits, axis=-1)
        if metric is not None:
            return {
                "accuracy": float(
                    metric.compute(predictions=predictions, references=eval_pred.label_ids)["accuracy"]
                )
            }
        return {"accuracy": numpy_accuracy(predictions, eval_pred.label_ids)}

    return compute_metrics


# ----------------------------------------------------------------------------------- reporting


def parameter_counts(model) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def privacy_summary(trainer) -> dict[str, Any]:
    """The mechanism and the guarantee of a finished (or running) DPTrainer run."""
    args = trainer.args
    epsilon, delta = trainer.privacy_spent()
    return {
        "private": not args.disable_dp,
        "epsilon": None if args.disable_dp else epsilon,
        "delta": delta,
        "target_epsilon": args.target_epsilon,
        "noise_multiplier": trainer.noise_multiplier,
        # The optimizer's own C: DP-MacAdam clips to 1 in its geometry, whatever per_sample_max_grad_norm says.
        "per_sample_max_grad_norm": getattr(
            getattr(trainer, "dp_optimizer", None), "max_grad_norm", args.per_sample_max_grad_norm
        ),
        "sample_rate": trainer.sample_rate,
        "expected_batch_size": args.expected_batch_size,
        "dataset_size": trainer.dataset_size,
        "steps": trainer.accountant.steps,
        "planned_steps": trainer.planned_steps,
        "stopped_by_budget": trainer.stopped_by_budget,
        "accountant": args.accountant,
        "dp_optimizer": args.dp_optimizer,
        "dp_optimizer_kwargs": dict(args.dp_optimizer_kwargs),
        "poisson_sampling": args.poisson_sampling,
    }


def held_out_split(dataset, sizes: Sequence[int], seed: int) -> list:
    """``[rest, part_1, ...]``: ``part_k`` holds ``sizes[k]`` rows, the rows with the smallest keyed content
    hashes (``seed`` keys them), in hash order; ``rest`` the other rows in their order.

    The training set a DP guarantee covers must change by at most one row when one record is added to (or
    removed from) the raw data. ``Dataset.train_test_split(seed=...)`` permutes with a generator whose result
    depends on the dataset's length: one more raw record moved 107 (CIFAR-10), 890 (Alpaca) and 1,787 (arXiv)
    training rows, all of them known to an adversary who knows the other records and the public seed (an
    audit). Ranked by hash, a record added either lands in ``rest`` (one more training row) or in a part,
    pushing that part's last row into ``rest`` (one more training row, another record's): a neighbouring
    training set either way. Not stratified: per-class sizes would depend on the data. Image and audio
    columns are hashed from their encoded bytes, without decoding.
    """
    import datasets

    if sum(sizes) >= len(dataset):
        raise ValueError(f"held-out sizes {list(sizes)} leave no training rows (of {len(dataset)}).")
    view = dataset
    for name, feature in dataset.features.items():
        if isinstance(feature, (datasets.Image, datasets.Audio)):
            view = view.cast_column(name, type(feature)(decode=False))
    salt = f"dp_hf held-out split {seed}".encode()
    keys = [_row_key(row, salt) for row in view]
    order = sorted(range(len(keys)), key=keys.__getitem__)
    parts, start = [], 0
    for size in sizes:
        parts.append(dataset.select(order[start : start + size]))
        start += size
    held = set(order[:start])
    return [dataset.select([i for i in range(len(dataset)) if i not in held]), *parts]


def _row_key(row: dict[str, Any], salt: bytes) -> bytes:
    digest = hashlib.sha256(salt)
    for key in sorted(row):
        digest.update(key.encode())
        digest.update(json.dumps(row[key], sort_keys=True, default=_encoded).encode())
    return digest.digest()


def _encoded(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return hashlib.sha256(value).hexdigest()
    if isinstance(value, np.ndarray):
        return hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest() + str(value.shape)
    return repr(value)


def finish_run(
    trainer,
    recipe: str,
    recipe_args: Any,
    metrics: dict[str, float],
    extra: dict[str, Any] | None = None,
    card_metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Save the model (with its processing class), write ``dp_results.json`` and log the summary.

    ``DPTrainer.save_model`` writes the privacy card (``README.md``, ``privacy.json``) itself when
    ``dp_hf.card`` is installed, with ``card_metadata`` (dataset name, base model...) for what it
    cannot infer. ``dp_results.json`` is the recipe's own record (arguments, metrics, epsilon) for
    tables and sweeps. Returns the summary that was written.
    """
    output_dir = trainer.args.output_dir
    if card_metadata:
        trainer.card_metadata = {**(getattr(trainer, "card_metadata", None) or {}), **card_metadata}
    trainer.save_model(output_dir)
    trainable, total = parameter_counts(trainer.model)
    summary = {
        "recipe": recipe,
        "metrics": metrics,
        "privacy": privacy_summary(trainer),
        "trainable_parameters": trainable,
        "total_parameters": total,
        "recipe_args": dataclasses.asdict(recipe_args),
        # Written by DPTrainer.save_model when dp_hf.card is installed.
        "privacy_card": os.path.isfile(os.path.join(output_dir, "privacy.json")),
        **(extra or {}),
    }
    if trainer.args.should_save:
        with open(os.path.join(output_dir, RESULTS_NAME), "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=2, default=str)
    privacy = summary["privacy"]
    shown = ", ".join(
        f"{k}={v:.4f}"
        for k, v in metrics.items()
        if isinstance(v, float) and not k.endswith(("_runtime", "_per_second", "epoch"))
    )
    if privacy["private"]:
        guarantee = f"({epsilon_up(privacy['epsilon'], 3):.3f}, {privacy['delta']:.1e})-DP"
    else:
        guarantee = "NOT private (disable_dp=True)"
    logger.info(
        "%s finished: %s; %s after %d steps (sigma=%.4g, q=%.4g, %s); model%s saved to %s",
        recipe,
        shown,
        guarantee,
        privacy["steps"],
        privacy["noise_multiplier"],
        privacy["sample_rate"],
        privacy["dp_optimizer"],
        " and privacy card" if summary["privacy_card"] else "",
        output_dir,
    )
    return summary
