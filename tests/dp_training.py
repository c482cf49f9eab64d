"""Tiny DPTrainer runs shared by the trainer and card tests: a random BERT classifier, data it can learn,
and DPTrainingArguments for a quick CPU run."""

from __future__ import annotations

import datasets
import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

from dp_hf import DPTrainingArguments

VOCAB = 40
SEQ = 8


def bert_classifier(seed: int = 0, **overrides) -> BertForSequenceClassification:
    """A tiny random BERT classifier; ``overrides`` replace any of its config values."""
    torch.manual_seed(seed)
    config = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2,
    )
    config.update(overrides)
    return BertForSequenceClassification(BertConfig(**config))


def classification_data(n: int = 256, seed: int = 0, name: str | None = None) -> datasets.Dataset:
    """Class-0 sentences use tokens 5..21, class-1 sentences tokens 22..39: every token carries the label."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    ids = torch.randint(5, 22, (n, SEQ), generator=g) + 17 * labels.view(-1, 1)
    ids[:, 0] = 2  # [CLS]-like
    info = datasets.DatasetInfo(dataset_name=name) if name else None
    return datasets.Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": [[1] * SEQ] * n, "labels": labels.tolist()}, info=info
    )


#: Arguments every quick CPU test run shares (DPTrainer's and DPSFTTrainer's): fixed seeds, no saving,
#: no trackers, a log line per step.
QUICK_RUN_ARGS = dict(
    gradient_accumulation_steps=2,
    learning_rate=1e-2,
    per_sample_max_grad_norm=1.0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
    noise_seed=1,
    sampling_seed=2,
    use_cpu=True,
    disable_tqdm=True,
)


def dp_args(output_dir, **overrides) -> DPTrainingArguments:
    defaults = dict(
        QUICK_RUN_ARGS,
        output_dir=str(output_dir),
        per_device_train_batch_size=16,
        num_train_epochs=2,
        noise_multiplier=0.3,
    )
    defaults.update(overrides)
    return DPTrainingArguments(**defaults)


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def pad_token_rows(features: list[dict], side: str) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of ``features`` padded with 0 to the longest, on ``side``."""
    longest = max(len(f["input_ids"]) for f in features)
    ids, mask = [], []
    for f in features:
        pad, ones = [0] * (longest - len(f["input_ids"])), [1] * len(f["input_ids"])
        ids.append(pad + f["input_ids"] if side == "left" else f["input_ids"] + pad)
        mask.append(pad + ones if side == "left" else ones + pad)
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


class Gain(nn.Module):
    """A trainable elementwise scale the fast paths have no rule for: the model then runs on Opacus's hooks."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def bert_on_opacus_hooks(model: BertForSequenceClassification | None = None) -> nn.Module:
    """``model`` (default :func:`bert_classifier`) with a :class:`Gain` after its classifier: DPTrainer then
    takes Opacus's hooks."""
    model = bert_classifier() if model is None else model
    model.classifier = nn.Sequential(model.classifier, Gain(model.config.num_labels))
    return model


def one_sgd_step(clip: float, lr: float) -> dict:
    """DPTrainingArguments of one plain DP-SGD step at sigma = 0 (``theta_0 - theta_1 = lr S / B``): the
    sensitivity tests' black-box measurement, where one example moves the update by at most ``2 clip lr / B``."""
    return dict(
        max_steps=1,
        dp_optimizer="dp-sgd",
        learning_rate=lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        noise_multiplier=0.0,
        per_sample_max_grad_norm=clip,
    )


def one_sgd_step_args(
    output_dir, batch_size: int, clip: float, lr: float, **overrides
) -> DPTrainingArguments:
    """:func:`one_sgd_step`'s arguments for ``batch_size`` examples per device, a quiet CPU run with fixed seeds
    (sampling, noise, model) and no checkpoints; ``overrides`` take precedence."""
    defaults = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=batch_size,
        **one_sgd_step(clip, lr),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        noise_seed=1,
        sampling_seed=2,
    )
    return DPTrainingArguments(**{**defaults, **overrides})
