"""TinyBERT masked-token prediction on arXiv abstracts: the transformer experiment of
"On Design Principles for Private Adaptive Optimizers" (Ganesh et al.), Section 5.2.

The paper fine-tunes pretrained TinyBERT on masked-token prediction of arXiv abstracts truncated to
512 tokens (1.7M / 0.1M / 0.1M random train / validation / test split), 2000 steps at batch 2048,
clip norm 1, one fixed noise multiplier for all variants, and
compares the variants of DP-Adam by test loss. Its findings: scale-then-privatize beats DP-Adam by
post-processing, and bias correction (DP-AdamBC) does worse except at very high epsilon (many
coordinates of the corrected second moment come out negative at this dimension).

Here: ``dp-adam`` (post-processing), ``dp-adambc`` (bias correction) and ``dp-adam-stp``
(scale-then-privatize) at the same noise, each on the same fixed masks of the test set (masked
once with a seeded collator, so the test losses are comparable across runs). ``dp-adam-stp`` is dp_hf's
RMS-normalized variant by default (``scale_mode="rms"``: the same C = 1 works), not the paper's raw
geometry ``sqrt(v_hat) + gamma_s`` (``scale_mode="raw"``, with C and gamma_s re-tuned).

The dataset id is an example: ``gfissore/arxiv-abstracts-2021`` (about 2M abstracts, column
``abstract``); any dataset with a text column works (``--dataset_name ... --text_column ...``).

Commands (from the repository root; accelerate configs are in ``recipes/accelerate_configs/``)::

    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml \\
        -m recipes.tinybert_mlm recipes/configs/tinybert_mlm.yaml

    # the comparison (scale-then-privatize clips in its own geometry, normalized to RMS 1 by default: the same C works)
    for opt in dp-adam dp-adambc dp-adam-stp; do
      accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml -m recipes.tinybert_mlm \\
          recipes/configs/tinybert_mlm.yaml --dp_optimizer $opt --output_dir outputs/tinybert_mlm/$opt
    done

    # offline pipeline check (tiny random BERT, synthetic abstracts; seconds on a CPU)
    python -m recipes.tinybert_mlm recipes/configs/tinybert_mlm_smoke.yaml
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import datasets
from transformers import (
    AutoModelForMaskedLM,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    DataCollatorForTokenClassification,
    set_seed,
)

from dp_hf import DPTrainer
from recipes import smoke
from recipes.common import (
    SmokeArguments,
    apply_cpu_threads,
    finish_run,
    held_out_split,
    parameter_counts,
    parse_recipe_args,
    setup_logging,
)

logger = logging.getLogger(__name__)


@dataclass
class MlmArguments(SmokeArguments):
    """Model, data and masking (the privacy and optimiser knobs are DPTrainingArguments)."""

    model_name_or_path: str = field(
        default="huawei-noah/TinyBERT_General_4L_312D", metadata={"help": "Hub id or path."}
    )
    dataset_name: str = field(
        default="gfissore/arxiv-abstracts-2021",
        metadata={"help": "Hub dataset of arXiv abstracts (an example id; any text dataset works)."},
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Dataset configuration, if any."})
    text_column: str = field(default="abstract", metadata={"help": "Column holding the text."})
    max_seq_length: int = field(
        default=512, metadata={"help": "Abstracts are truncated to this many tokens."}
    )
    mlm_probability: float = field(
        default=0.15, metadata={"help": "Fraction of tokens masked (BERT's 80/10/10)."}
    )
    validation_size: int = field(
        default=100_000, metadata={"help": "Held-out validation abstracts (paper: 0.1M)."}
    )
    test_size: int = field(default=100_000, metadata={"help": "Held-out test abstracts (paper: 0.1M)."})
    split_seed: int = field(default=0, metadata={"help": "Seed of the random train/validation/test split."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training set."})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Truncate validation and test (evaluation cost; the paper uses all)."}
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "Processes for tokenisation."}
    )
    smoke_train_size: int = field(
        default=256, metadata={"help": "Synthetic training abstracts in smoke mode."}
    )
    smoke_eval_size: int = field(default=64, metadata={"help": "Synthetic validation and test abstracts."})


class MaskedLMCollator:
    """Random masks for training batches; evaluation examples arrive already masked.

    Training examples carry only ``input_ids`` (masked afresh each time, as BERT pretraining), their
    masks drawn from torch's global generator, which DPTrainer reseeds from the secret sampling seed (a
    collator seeded with the public ``args.seed`` would make them known, and shift with which examples
    were sampled before: DPTrainer refuses it); evaluation examples carry fixed ``labels`` from
    :func:`mask_once`, so every optimizer is scored on the same masked tokens, whatever random numbers
    training consumed.
    """

    def __init__(self, tokenizer, mlm_probability: float) -> None:
        self.train_collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=mlm_probability)
        self.eval_collator = DataCollatorForTokenClassification(tokenizer)  # pads labels with -100

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        if features and "labels" in features[0]:
            return self.eval_collator(features)
        return self.train_collator(features)


def mask_once(dataset: datasets.Dataset, tokenizer, mlm_probability: float, seed: int) -> datasets.Dataset:
    """The dataset with fixed ``input_ids`` (masked) and ``labels`` (-100 except at masked tokens)."""
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=mlm_probability, seed=seed)

    def mask(batch: dict[str, list]) -> dict[str, list]:
        lengths = [len(ids) for ids in batch["input_ids"]]
        masked = collator([{"input_ids": ids} for ids in batch["input_ids"]])
        return {
            "input_ids": [row[:n].tolist() for row, n in zip(masked["input_ids"], lengths)],
            "labels": [row[:n].tolist() for row, n in zip(masked["labels"], lengths)],
        }

    return dataset.map(mask, batched=True, batch_size=1000, desc="mask test tokens")


def load_splits(args: MlmArguments) -> datasets.DatasetDict:
    """Train / validation / test splits of raw text (random-like, as the paper's, by a keyed content hash)."""
    if args.smoke:
        return datasets.DatasetDict(
            train=smoke.abstracts_like(args.smoke_train_size, args.split_seed),
            validation=smoke.abstracts_like(args.smoke_eval_size, args.split_seed + 1),
            test=smoke.abstracts_like(args.smoke_eval_size, args.split_seed + 2),
        )
    raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name, split="train")
    # Ranked by a keyed content hash: one raw record more or less changes the training set by one row.
    train, validation, test = held_out_split(raw, [args.validation_size, args.test_size], args.split_seed)
    return datasets.DatasetDict(train=train, validation=validation, test=test)


def tokenize(splits: datasets.DatasetDict, tokenizer, args: MlmArguments) -> datasets.DatasetDict:
    limits = {
        "train": args.max_train_samples,
        "validation": args.max_eval_samples,
        "test": args.max_eval_samples,
    }
    out = {}
    for name, split in splits.items():
        if limits[name] is not None:
            split = split.select(range(min(limits[name], len(split))))

        def encode(batch: dict[str, list]) -> dict[str, list]:
            # Special-token masks are not needed: the collator recomputes them from the ids.
            return tokenizer(batch[args.text_column], truncation=True, max_length=args.max_seq_length)

        out[name] = split.map(
            encode,
            batched=True,
            remove_columns=split.column_names,
            num_proc=args.preprocessing_num_workers,
            desc=f"tokenize {name}",
        )
    return datasets.DatasetDict(out)


def load_tokenizer_and_model(args: MlmArguments):
    if args.smoke:
        tokenizer = smoke.word_tokenizer("bert", model_max_length=args.max_seq_length)
        config = BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=37,
            max_position_embeddings=max(64, args.max_seq_length),
        )
        return tokenizer, BertForMaskedLM(config)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    # TinyBERT's general-distillation checkpoint may lack parts of the MLM head; transformers then
    # initialises them (the decoder is tied to the word embeddings) and says which in its warning.
    model = AutoModelForMaskedLM.from_pretrained(args.model_name_or_path)
    return tokenizer, model


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train, report the test loss on fixed masks, save; returns the run summary."""
    args, training_args = parse_recipe_args(MlmArguments, argv)
    setup_logging(training_args)
    apply_cpu_threads(args)
    set_seed(training_args.seed)

    tokenizer, model = load_tokenizer_and_model(args)
    trainable, total = parameter_counts(model)
    logger.info("trainable parameters: %d of %d", trainable, total)
    with training_args.main_process_first(desc="tokenize and mask"):
        splits = tokenize(load_splits(args), tokenizer, args)
        validation = mask_once(splits["validation"], tokenizer, args.mlm_probability, args.split_seed + 1)
        test = mask_once(splits["test"], tokenizer, args.mlm_probability, args.split_seed + 2)

    trainer = DPTrainer(
        model=model,
        args=training_args,
        train_dataset=splits["train"],
        eval_dataset=validation,
        processing_class=tokenizer,
        data_collator=MaskedLMCollator(tokenizer, args.mlm_probability),
    )
    trainer.train(
        resume_from_checkpoint=training_args.resume_from_checkpoint
    )  # (train() itself never reads it)
    metrics = trainer.evaluate(test, metric_key_prefix="test")
    metrics["test_perplexity"] = math.exp(min(metrics["test_loss"], 50.0))
    card = {"dataset_name": "synthetic abstracts (smoke)" if args.smoke else args.dataset_name}
    if not args.smoke:
        card["base_model"] = args.model_name_or_path
    return finish_run(trainer, "tinybert_mlm", args, metrics, card_metadata=card)


if __name__ == "__main__":
    main(sys.argv[1:])
