"""Private instruction tuning of a causal LM with LoRA: the starting point for private LLM work.

Not a paper reproduction. A causal LM (default ``Qwen/Qwen2.5-0.5B``; GPT-2 and other Hugging Face
causal LMs work too) gets LoRA adapters (peft) on its attention projections; only the adapters are
trained, with DP-AdamW (or DP-MacAdam), Poisson sampling and a target epsilon. Data: an
instruction dataset with Alpaca's columns (default ``tatsu-lab/alpaca``: instruction, input,
output), formatted with the Alpaca prompt, loss on the response tokens only; or any text dataset
with ``--text_column text`` (loss on every token). The unit of privacy is one training example
(one row): if a person can contribute many rows, their privacy is weaker than the epsilon reported.

Commands (from the repository root; accelerate configs are in ``recipes/accelerate_configs/``)::

    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml \\
        -m recipes.llm_lora recipes/configs/llm_lora.yaml

    # GPT-2 (its fused attention projection is called c_attn)
    python -m recipes.llm_lora recipes/configs/llm_lora.yaml --model_name_or_path gpt2 --lora_target_modules c_attn

    # DP-MacAdam (fixes its own clip norm at 1)
    python -m recipes.llm_lora recipes/configs/llm_lora.yaml --dp_optimizer dp-macadam --per_sample_max_grad_norm 1

    # offline pipeline check (tiny random Qwen2 + LoRA, synthetic instructions; seconds on a CPU)
    python -m recipes.llm_lora recipes/configs/llm_lora_smoke.yaml

The output directory holds the LoRA adapter (``adapter_model.safetensors``), the tokenizer and the
privacy card; load it with ``peft.AutoPeftModelForCausalLM.from_pretrained(output_dir)``.
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
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Qwen2Config,
    Qwen2ForCausalLM,
    set_seed,
)

from dp_hf import DPTrainer
from recipes import smoke
from recipes.common import (
    SmokeArguments,
    apply_cpu_threads,
    finish_run,
    parameter_counts,
    parse_recipe_args,
    setup_logging,
)

logger = logging.getLogger(__name__)

PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
PROMPT_WITHOUT_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


@dataclass
class LoraArguments(SmokeArguments):
    """Model, adapters and data (the privacy and optimiser knobs are DPTrainingArguments)."""

    model_name_or_path: str = field(
        default="Qwen/Qwen2.5-0.5B", metadata={"help": "Causal LM: Hub id or path."}
    )
    dataset_name: str = field(default="tatsu-lab/alpaca", metadata={"help": "Hub dataset id."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Dataset configuration, if any."})
    text_column: str | None = field(
        default=None,
        metadata={
            "help": "Train on this raw text column (loss on all tokens) instead of the instruction format."
        },
    )
    max_seq_length: int = field(default=512, metadata={"help": "Examples are truncated to this many tokens."})
    validation_size: int = field(
        default=1000, metadata={"help": "Examples held out for the evaluation loss."}
    )
    split_seed: int = field(default=0, metadata={"help": "Seed of the train/validation split."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(
        default=0.0, metadata={"help": "Dropout on the LoRA input (the DP noise already regularises)."}
    )
    lora_target_modules: str = field(
        default="q_proj,k_proj,v_proj,o_proj",
        metadata={"help": "Comma-separated module names to adapt (GPT-2: c_attn), or 'all-linear'."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training set."})
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "Processes for tokenisation."}
    )
    smoke_train_size: int = field(
        default=256, metadata={"help": "Synthetic training examples in smoke mode."}
    )
    smoke_eval_size: int = field(
        default=32, metadata={"help": "Synthetic validation examples in smoke mode."}
    )


def load_tokenizer_and_model(args: LoraArguments):
    if args.smoke:
        tokenizer = smoke.word_tokenizer("causal", model_max_length=args.max_seq_length)
        config = Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=max(64, args.max_seq_length),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            tie_word_embeddings=True,
        )
        return tokenizer, Qwen2ForCausalLM(config)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:  # GPT-2 and Llama have none; padded label positions are -100 anyway
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    return tokenizer, model


def add_lora(model, args: LoraArguments):
    """Wrap ``model`` with LoRA adapters; only they are trainable."""
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = args.lora_target_modules
    if targets != "all-linear":
        targets = [name.strip() for name in targets.split(",") if name.strip()]
    config = LoraConfig(
        task_type="CAUSAL_LM",
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=targets,
    )
    return get_peft_model(model, config)


def load_raw_data(args: LoraArguments) -> datasets.DatasetDict:
    if args.smoke:
        return datasets.DatasetDict(
            train=smoke.instructions_like(args.smoke_train_size, args.split_seed),
            validation=smoke.instructions_like(args.smoke_eval_size, args.split_seed + 1),
        )
    raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name, split="train")
    parts = raw.train_test_split(test_size=args.validation_size, seed=args.split_seed)
    return datasets.DatasetDict(train=parts["train"], validation=parts["test"])


def encode_instruction(example: dict[str, Any], tokenizer, max_length: int) -> dict[str, list[int]]:
    """Alpaca prompt + response + EOS; labels are -100 on the prompt (the loss is on the answer)."""
    template = PROMPT_WITH_INPUT if example.get("input") else PROMPT_WITHOUT_INPUT
    prompt = template.format(instruction=example["instruction"], input=example.get("input", ""))
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(example["output"], add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id
    ]
    input_ids = (prompt_ids + answer_ids)[:max_length]
    labels = ([-100] * len(prompt_ids) + answer_ids)[:max_length]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def encode_text(example: dict[str, Any], tokenizer, max_length: int, column: str) -> dict[str, list[int]]:
    ids = tokenizer(example[column], add_special_tokens=False)["input_ids"][: max_length - 1] + [
        tokenizer.eos_token_id
    ]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": list(ids)}


def tokenize(raw: datasets.DatasetDict, tokenizer, args: LoraArguments) -> datasets.DatasetDict:
    if args.max_train_samples is not None:
        raw["train"] = raw["train"].select(range(min(args.max_train_samples, len(raw["train"]))))
    if args.text_column:
        function, kwargs = encode_text, dict(column=args.text_column)
    else:
        function, kwargs = encode_instruction, {}
    return raw.map(
        function,
        fn_kwargs=dict(tokenizer=tokenizer, max_length=args.max_seq_length, **kwargs),
        remove_columns=raw["train"].column_names,
        num_proc=args.preprocessing_num_workers,
        desc="tokenize",
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train the adapters, report the validation loss, save; returns the run summary."""
    args, training_args = parse_recipe_args(LoraArguments, argv)
    setup_logging(training_args)
    apply_cpu_threads(args)
    set_seed(training_args.seed)

    tokenizer, model = load_tokenizer_and_model(args)
    model = add_lora(model, args)
    trainable, total = parameter_counts(model)
    logger.info("LoRA: %d trainable parameters of %d (%.2f%%)", trainable, total, 100 * trainable / total)
    with training_args.main_process_first(desc="tokenize"):
        data = tokenize(load_raw_data(args), tokenizer, args)

    trainer = DPTrainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100),
    )
    trainer.train()
    metrics = trainer.evaluate()
    metrics["eval_perplexity"] = math.exp(min(metrics["eval_loss"], 50.0))
    card = {"dataset_name": "synthetic instructions (smoke)" if args.smoke else args.dataset_name}
    if not args.smoke:
        card["base_model"] = args.model_name_or_path
    return finish_run(trainer, "llm_lora", args, metrics, card_metadata=card)


if __name__ == "__main__":
    main(sys.argv[1:])
