"""The card's files in an output directory: writing ``privacy.json`` + ``README.md``, and reading them back.

Owns the file names, :func:`write_card_files` (what :class:`~dp_hf.trainer.DPTrainer` calls on
every save), :func:`load_privacy_report` (a directory's ``privacy.json``, schema checked),
:func:`render_card_for_output_dir` (with the latest evaluation of its ``trainer_state.json``) and
:func:`write_readme`. Every file is written atomically: a crash never leaves a truncated card.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any

from dp_hf.card.render import render_card
from dp_hf.card.report import SCHEMA_VERSION, build_privacy_report, eval_metrics_from_log_history

logger = logging.getLogger(__package__)  # "dp_hf.card", one logger for the package

__all__ = [
    "CARD_NAME",
    "PRIVACY_NAME",
    "TRAINER_STATE_NAME",
    "load_privacy_report",
    "render_card_for_output_dir",
    "write_card_files",
    "write_readme",
]

CARD_NAME = "README.md"
PRIVACY_NAME = "privacy.json"
TRAINER_STATE_NAME = "trainer_state.json"  # what transformers.Trainer writes in each checkpoint


def write_card_files(
    trainer: Any, output_dir: str, *, checkpoint: bool = False, **card_overrides: Any
) -> dict[str, Any]:
    """Write ``privacy.json`` and ``README.md`` for ``trainer`` into ``output_dir``; returns the report.

    ``checkpoint``: ``output_dir`` is a training checkpoint (its card says not to publish the directory).
    """
    report = build_privacy_report(trainer, **card_overrides)
    report["checkpoint"] = checkpoint
    os.makedirs(output_dir, exist_ok=True)
    _write_atomic(os.path.join(output_dir, PRIVACY_NAME), json.dumps(report, indent=2) + "\n")
    _write_atomic(os.path.join(output_dir, CARD_NAME), render_card(report))
    logger.info("wrote the privacy model card (%s, %s) to %s", CARD_NAME, PRIVACY_NAME, output_dir)
    return report


def write_readme(output_dir: str, card: str) -> str:
    """Write the rendered ``card`` to ``output_dir/README.md`` (atomically); returns that path."""
    path = os.path.join(output_dir, CARD_NAME)
    _write_atomic(path, card)
    return path


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
