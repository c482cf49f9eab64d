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
        "base_model": "bert-base-uncased",  # default: model.config.name_or_path (if a Hub id)
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

The package owns the privacy card from a trainer to the files and back; its modules:

* :mod:`dp_hf.card.report`: the report (``privacy.json``'s content) built from a trainer,
  :func:`epsilon_from_report`, :func:`eval_metrics_from_log_history`;
* :mod:`dp_hf.card.metadata`: the model card's Hub metadata (:data:`CARD_METADATA_KEYS`, the user's
  values, what is inferred from the model and the datasets);
* :mod:`dp_hf.card.render`: :func:`render_card`, the report as ``README.md`` (Hub YAML front matter);
* :mod:`dp_hf.card.files`: :func:`write_card_files`, :func:`load_privacy_report`,
  :func:`render_card_for_output_dir` (an output directory's ``privacy.json`` and ``trainer_state.json``);
* :mod:`dp_hf.card.cli`: the ``card`` command (:func:`add_card_arguments`, :func:`main_card`, :func:`main`).
"""

from __future__ import annotations

import logging

from dp_hf.card.cli import add_card_arguments, main, main_card
from dp_hf.card.files import (
    CARD_NAME,
    PRIVACY_NAME,
    TRAINER_STATE_NAME,
    load_privacy_report,
    render_card_for_output_dir,
    write_card_files,
    write_readme,
)
from dp_hf.card.metadata import CARD_METADATA_KEYS
from dp_hf.card.render import THREAT_MODEL, render_card
from dp_hf.card.report import (
    ADJACENCY,
    PRIVACY_UNIT,
    SCHEMA_VERSION,
    build_privacy_report,
    epsilon_from_report,
    eval_metrics_from_log_history,
)

logger = logging.getLogger(__name__)  # the package's one logger ("dp_hf.card"), as its modules use

__all__ = [
    "ADJACENCY",
    "CARD_METADATA_KEYS",
    "CARD_NAME",
    "PRIVACY_NAME",
    "PRIVACY_UNIT",
    "SCHEMA_VERSION",
    "THREAT_MODEL",
    "TRAINER_STATE_NAME",
    "add_card_arguments",
    "build_privacy_report",
    "epsilon_from_report",
    "eval_metrics_from_log_history",
    "load_privacy_report",
    "main",
    "main_card",
    "render_card",
    "render_card_for_output_dir",
    "write_card_files",
    "write_readme",
]
