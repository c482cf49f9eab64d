"""BERT-base-cased on GLUE QNLI, privately: the text experiment of the DP-AdamW paper.

Chooi, Cong, Li, Sun, "DP-AdamW: Investigating Decoupled Weight Decay and Bias Correction in Private
Deep Learning" (ICML 2025 workshop), Section 4.2 / Table 2 and Appendix C.2:

* ``bert-base-cased``, everything frozen except the last Transformer block, the pooler and the
  classifier (about 7.7M trainable parameters of 108M);
* expected batch 32 (Poisson), 10 epochs, epsilon in {1, 3, 7}, the same noise for every optimizer;
* grid: learning rate in [1e-6, 5e-3], weight decay in {0, 1e-5, 1e-4}, clip norm C in
  {0.05, 0.1, 0.2}; ``gamma' = 1e-8`` for DP-AdamW-BC;
* optimizers DP-AdamW, DP-AdamW-BC, DP-Adam, DP-AdamBC, DP-SGD (DP-MacAdam works too);
* accuracy on QNLI's labelled validation split (GLUE's test labels are not public; the paper calls
  its held-out split "test").

Commands (from the repository root; accelerate configs are in ``recipes/accelerate_configs/``)::

    # one GPU, epsilon 3, DP-AdamW (the config's defaults)
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml \\
        -m recipes.bert_qnli recipes/configs/bert_qnli.yaml

    # several GPUs: keep per_device_train_batch_size * gradient_accumulation_steps * num_processes = 32
    accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml --num_processes 2 \\
        -m recipes.bert_qnli recipes/configs/bert_qnli.yaml --per_device_train_batch_size 16

    # the paper's table: every optimizer at every epsilon (then tune lr / weight decay / C per cell)
    for eps in 1 3 7; do for opt in dp-adamw dp-adamw-bc dp-adam dp-adambc dp-sgd; do
      accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml -m recipes.bert_qnli \\
          recipes/configs/bert_qnli.yaml --target_epsilon $eps --dp_optimizer $opt \\
          --output_dir outputs/bert_qnli/$opt-eps$eps
    done; done

    # DP-MacAdam fixes its own clip norm (1, in its adaptive geometry)
    python -m recipes.bert_qnli recipes/configs/bert_qnli.yaml --dp_optimizer dp-macadam --per_sample_max_grad_norm 1

    # offline pipeline check (tiny random BERT, synthetic QNLI-like pairs; seconds on a CPU)
    python -m recipes.bert_qnli recipes/configs/bert_qnli_smoke.yaml

DP-SGD needs a much larger learning rate than the Adam family (no per-coordinate normalisation).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import datasets
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    set_seed,
)

from dp_hf import DPTrainer
from recipes import smoke
from recipes.common import (
    SmokeArguments,
    accuracy_metric,
    apply_cpu_threads,
    finish_run,
    parameter_counts,
    parse_recipe_args,
    setup_logging,
)

logger = logging.getLogger(__name__)

LABELS = ("entailment", "not_entailment")  # QNLI's label names, in order


@dataclass
class QnliArguments(SmokeArguments):
    """Model, data and freezing (the privacy and optimiser knobs are DPTrainingArguments)."""

    model_name_or_path: str = field(default="bert-base-cased", metadata={"help": "Hub id or local path."})
    dataset_name: str = field(default="nyu-mll/glue", metadata={"help": "Hub dataset id."})
    dataset_config_name: str = field(default="qnli", metadata={"help": "Dataset configuration (GLUE task)."})
    max_seq_length: int = field(
        default=256,
        metadata={"help": "Question + sentence truncated to this many tokens (padding is dynamic)."},
    )
    trainable_layers: str = field(
        default="last_block",
        metadata={
            "help": "'last_block': train only the last Transformer block, the pooler and the classifier "
            "(the paper); 'all': full fine-tuning."
        },
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Truncate the training set (debugging)."}
    )
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the evaluation set."})
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "Processes for tokenisation."}
    )
    use_evaluate: bool = field(
        default=True,
        metadata={
            "help": "Accuracy via evaluate.load('accuracy') (needs the Hub once); numpy if unavailable."
        },
    )
    smoke_train_size: int = field(default=256, metadata={"help": "Synthetic training pairs in smoke mode."})
    smoke_eval_size: int = field(default=64, metadata={"help": "Synthetic validation pairs in smoke mode."})

    def __post_init__(self) -> None:
        if self.trainable_layers not in ("last_block", "all"):
            raise ValueError(
                f"trainable_layers must be 'last_block' or 'all', got {self.trainable_layers!r}."
            )


def freeze_all_but_last_block(model) -> None:
    """Train only the last encoder block, the pooler and the classifier (as Li et al. 2022, Tang et al.
    2023 and the DP-AdamW paper): a small, well-conditioned parameter set, so less noise in total."""
    prefix = model.base_model_prefix  # "bert"
    last = model.config.num_hidden_layers - 1
    trainable = (f"{prefix}.encoder.layer.{last}.", f"{prefix}.pooler.", "classifier.")
    for name, parameter in model.named_parameters():
        parameter.requires_grad = name.startswith(trainable)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"no parameter of {type(model).__name__} starts with {trainable}; is it a BERT model?"
        )


def load_tokenizer_and_model(args: QnliArguments):
    id2label = dict(enumerate(LABELS))
    label2id = {label: i for i, label in id2label.items()}
    if args.smoke:
        tokenizer = smoke.word_tokenizer("bert", model_max_length=args.max_seq_length)
        config = BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=37,
            max_position_embeddings=max(64, args.max_seq_length),
            num_labels=2,
            id2label=id2label,
            label2id=label2id,
        )
        return tokenizer, BertForSequenceClassification(config)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name_or_path, num_labels=2, id2label=id2label, label2id=label2id
    )
    return tokenizer, model


def load_raw_data(args: QnliArguments, seed: int) -> datasets.DatasetDict:
    if args.smoke:
        return datasets.DatasetDict(
            train=smoke.qnli_like(args.smoke_train_size, seed),
            validation=smoke.qnli_like(args.smoke_eval_size, seed + 1),
        )
    return datasets.load_dataset(args.dataset_name, args.dataset_config_name)


def tokenize(
    raw: datasets.DatasetDict, tokenizer, args: QnliArguments
) -> tuple[datasets.Dataset, datasets.Dataset]:
    train, evaluation = raw["train"], raw["validation"]
    if args.max_train_samples is not None:
        train = train.select(range(min(args.max_train_samples, len(train))))
    if args.max_eval_samples is not None:
        evaluation = evaluation.select(range(min(args.max_eval_samples, len(evaluation))))

    def encode(batch: dict[str, list]) -> dict[str, list]:
        return tokenizer(
            batch["question"], batch["sentence"], truncation=True, max_length=args.max_seq_length
        )

    # Keep only what the model reads: ids, masks and "label" (the collator renames it to "labels").
    drop = [c for c in train.column_names if c != "label"]
    encoded = [
        split.map(
            encode,
            batched=True,
            remove_columns=drop,
            num_proc=args.preprocessing_num_workers,
            desc="tokenize",
        )
        for split in (train, evaluation)
    ]
    return encoded[0], encoded[1]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train, evaluate on QNLI validation, save; returns the run summary."""
    args, training_args = parse_recipe_args(QnliArguments, argv)
    setup_logging(training_args)
    apply_cpu_threads(args)
    set_seed(training_args.seed)

    tokenizer, model = load_tokenizer_and_model(args)
    if args.trainable_layers == "last_block":
        freeze_all_but_last_block(model)
    trainable, total = parameter_counts(model)
    logger.info("trainable parameters: %d of %d (%.1f%%)", trainable, total, 100 * trainable / total)

    with training_args.main_process_first(desc="tokenize"):
        train_set, eval_set = tokenize(load_raw_data(args, training_args.seed), tokenizer, args)

    trainer = DPTrainer(
        model=model,
        args=training_args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy_metric(use_evaluate=args.use_evaluate and not args.smoke),
    )
    trainer.train(
        resume_from_checkpoint=training_args.resume_from_checkpoint
    )  # (train() itself never reads it)
    metrics = trainer.evaluate()
    card = {
        "dataset_name": "synthetic QNLI-like pairs (smoke)"
        if args.smoke
        else f"{args.dataset_name}/{args.dataset_config_name}"
    }
    if not args.smoke:
        card["base_model"] = args.model_name_or_path
    return finish_run(trainer, "bert_qnli", args, metrics, card_metadata=card)


if __name__ == "__main__":
    main(sys.argv[1:])
