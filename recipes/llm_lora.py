"""Private chat fine-tuning of a causal LM with LoRA and trl: the starting point for private LLM work.

Not a paper reproduction. A causal LM (default ``Qwen/Qwen2.5-0.5B``; any Hugging Face causal LM
whose tokenizer has a chat template) gets LoRA adapters (peft) on its attention projections; only
the adapters are trained by :class:`dp_hf.DPSFTTrainer` (trl's ``SFTTrainer`` with DP: Poisson
sampling, per-example clipping, noise, a target epsilon), configured by :class:`dp_hf.DPSFTConfig`
(trl's ``SFTConfig`` plus the privacy fields). Data, as trl takes it:

* a conversational dataset with a ``messages`` column (loss on the assistant turns with
  ``assistant_only_loss: true``, which needs ``{% generation %}`` markers in the chat template or
  a template trl knows how to patch);
* an instruction dataset with Alpaca's columns (default ``tatsu-lab/alpaca``: instruction, input,
  output), turned into conversational prompt-completion pairs (a user turn, an assistant turn): the
  loss is on the completion only (trl's ``completion_only_loss``);
* or any text dataset with ``--text_column text`` (loss on every token).

``max_length`` truncates each example (trl's preparation); ``packing`` and ``padding_free`` are
refused under DP (a packed row would be clipped as one unit). The unit of privacy is one training
example (one conversation, one row): if a person can contribute many rows, their privacy is weaker
than the epsilon reported.

Commands (from the repository root; accelerate configs are in ``recipes/accelerate_configs/``)::

    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml \\
        -m recipes.llm_lora recipes/configs/llm_lora.yaml

    # DP-MacAdam (fixes its own clip norm at 1)
    python -m recipes.llm_lora recipes/configs/llm_lora.yaml --dp_optimizer dp-macadam --per_sample_max_grad_norm 1

    # offline pipeline check (tiny random Llama + LoRA, a word-level chat tokenizer built locally,
    # synthetic conversations, assistant-only loss; seconds on a CPU)
    python -m recipes.llm_lora recipes/configs/llm_lora_smoke.yaml

The output directory holds the LoRA adapter (``adapter_model.safetensors``), the tokenizer (with its
chat template) and the privacy card; load it with
``peft.AutoPeftModelForCausalLM.from_pretrained(output_dir)``.
"""

from __future__ import annotations

import logging
import math
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import datasets
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, set_seed

from dp_hf import DPSFTConfig, DPSFTTrainer
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
class LoraArguments(SmokeArguments):
    """Model, adapters and data (the privacy, optimiser and SFT knobs are DPSFTConfig's)."""

    training_args_class: ClassVar[type] = DPSFTConfig

    model_name_or_path: str = field(
        default="Qwen/Qwen2.5-0.5B",
        metadata={"help": "Causal LM: Hub id or path (its tokenizer needs a chat template)."},
    )
    dataset_name: str = field(default="tatsu-lab/alpaca", metadata={"help": "Hub dataset id."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Dataset configuration, if any."})
    text_column: str | None = field(
        default=None,
        metadata={"help": "Train on this raw text column (loss on all tokens) instead of chat data."},
    )
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
    smoke_train_size: int = field(
        default=256, metadata={"help": "Synthetic training conversations in smoke mode."}
    )
    smoke_eval_size: int = field(
        default=32, metadata={"help": "Synthetic validation conversations in smoke mode."}
    )


def load_tokenizer_and_model(args: LoraArguments, max_length: int | None = None):
    if args.smoke:
        tokenizer = smoke.chat_tokenizer(model_max_length=max_length or 64)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=max(64, max_length or 0),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
            tie_word_embeddings=False,
        )
        return tokenizer, LlamaForCausalLM(config)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.chat_template is None and not args.text_column:
        raise ValueError(
            f"the tokenizer of {args.model_name_or_path} has no chat template; use a chat/instruct model, set "
            "tokenizer.chat_template, or train on raw text with --text_column."
        )
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
    with warnings.catch_warnings():
        # peft asks transformers for the deprecated is_gradient_checkpointing; nothing a user can act on.
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        return get_peft_model(model, config)


def load_raw_data(args: LoraArguments) -> datasets.DatasetDict:
    if args.smoke:
        return datasets.DatasetDict(
            train=smoke.chats_like(args.smoke_train_size, args.split_seed),
            validation=smoke.chats_like(args.smoke_eval_size, args.split_seed + 1),
        )
    raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name, split="train")
    # Ranked by a keyed content hash: one raw record more or less changes the training set by one row.
    train, validation = held_out_split(raw, [args.validation_size], args.split_seed)
    return datasets.DatasetDict(train=train, validation=validation)


def alpaca_to_chat(example: dict[str, Any]) -> dict[str, list[dict[str, str]]]:
    """Alpaca's instruction (and input) as a user turn, its output as the assistant's completion."""
    question = example["instruction"] + (f"\n\n{example['input']}" if example.get("input") else "")
    return {
        "prompt": [{"role": "user", "content": question}],
        "completion": [{"role": "assistant", "content": example["output"]}],
    }


def to_sft_format(raw: datasets.DatasetDict, args: LoraArguments) -> datasets.DatasetDict:
    """trl's formats: ``messages`` (kept), Alpaca columns (-> prompt-completion chats) or ``text``."""
    if args.max_train_samples is not None:
        raw["train"] = raw["train"].select(range(min(args.max_train_samples, len(raw["train"]))))
    columns = raw["train"].column_names
    if args.text_column:
        return raw.map(lambda e: {"text": e[args.text_column]}, remove_columns=columns, desc="text")
    if "messages" in columns or {"prompt", "completion"} <= set(columns):
        return raw
    return raw.map(alpaca_to_chat, remove_columns=columns, desc="to chat")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train the adapters, report the validation loss, save; returns the run summary."""
    args, training_args = parse_recipe_args(LoraArguments, argv)
    setup_logging(training_args)
    apply_cpu_threads(args)
    set_seed(training_args.seed)

    tokenizer, model = load_tokenizer_and_model(args, training_args.max_length)
    model = add_lora(model, args)
    trainable, total = parameter_counts(model)
    logger.info("LoRA: %d trainable parameters of %d (%.2f%%)", trainable, total, 100 * trainable / total)
    with training_args.main_process_first(desc="load data"):
        data = to_sft_format(load_raw_data(args), args)

    # trl tokenizes with the chat template, masks the prompt / non-assistant turns and truncates to
    # max_length; DPSFTTrainer then trains with Poisson sampling and per-example clipping.
    trainer = DPSFTTrainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        processing_class=tokenizer,
    )
    trainer.train(
        resume_from_checkpoint=training_args.resume_from_checkpoint
    )  # (train() itself never reads it)
    metrics = trainer.evaluate()
    metrics["eval_perplexity"] = math.exp(min(metrics["eval_loss"], 50.0))
    card = {"dataset_name": "synthetic conversations (smoke)" if args.smoke else args.dataset_name}
    if not args.smoke:
        card["base_model"] = args.model_name_or_path
    return finish_run(trainer, "llm_lora", args, metrics, card_metadata=card)


if __name__ == "__main__":
    main(sys.argv[1:])
