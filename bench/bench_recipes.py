"""What a reproduction of each GPU recipe costs: DPTrainer throughput on the recipe's real shapes.

    python bench/bench_recipes.py --device cuda [--recipes bert_qnli deit_cifar10] [--steps 200] [--json PATH]
    OMP_NUM_THREADS=1 python bench/bench_recipes.py --smoke          # tiny models on a CPU, seconds

For each recipe config of ``recipes/configs/`` (bert_qnli, deit_cifar10, deit_cifar100, tinybert_mlm,
llm_lora) the recipe's own code builds the run: its argument dataclass and ``DPTrainingArguments`` /
``DPSFTConfig`` parsed from the YAML file (``recipes.common.parse_recipe_args``), its layer freezing
(``bert_qnli.freeze_all_but_last_block``), its LoRA setup (``llm_lora.add_lora``), its image transforms
(``ImageBatchTransform``) and collators, and its trainer class. Only two things are swapped, so that
nothing is downloaded:

* ``from_pretrained`` -> ``from_config`` of a hand-written config of the real architecture (random
  weights: the same parameter count and shapes, so the same cost);
* ``load_dataset`` -> synthetic rows of the real dataset size ``N`` and the shapes the model sees
  (token ids of the full ``max_seq_length`` / ``max_length``, 32x32 CIFAR-size images through the
  recipe's crop/resize/flip/normalise to 224x224), generated on the fly by a ``torch`` dataset of
  length ``N`` (``llm_lora``: a pre-tokenized ``datasets.Dataset`` of ``N`` rows, trl needs one).

The trainer is built with the recipe's full arguments (so its privacy plan, ``planned_steps``, the
noise calibration, the learning-rate schedule and DP-MicroAdam's horizon are the recipe's) except:
no evaluation, no saving, ``report_to none``; a callback stops training after ``--steps`` steps.
The step time is the median, after ``--warmup`` steps, of the interval between consecutive step ends
(CUDA synchronized), which includes loading the step's Poisson batch (the Trainer fetches it before
``on_step_begin``); the compute-only median (step begin to end) is reported too. The projected time
is ``planned_steps x median step time``: training only, without evaluation, checkpoints or start-up.

Synthetic sequences all have the full length, so text steps are an upper bound: the recipes pad
dynamically, and QNLI pairs / Alpaca examples are mostly far shorter than 256 / 512 tokens.

``--smoke`` shrinks the models, shapes, batches and ``N`` (CPU, seconds; used by
``tests/test_bench_recipes.py``); its ``planned_steps`` column is still the real run's (real ``N``,
the YAML's batch and epochs), from ``dp_hf.plan``, the functions DPTrainer plans with.
"""

from __future__ import annotations

import os

# Nothing may be downloaded: the models are built from configs, the data and tokenizers locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/bench_recipes.py` from anywhere: import dp_hf and recipes
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import HfArgumentParser, TrainerCallback  # noqa: E402

from dp_hf import DPTrainingArguments  # noqa: E402
from dp_hf.plan import planned_steps, steps_per_epoch  # noqa: E402
from recipes.common import CONFIG_DIR, load_yaml_config, parameter_counts, parse_recipe_args  # noqa: E402

logger = logging.getLogger("bench_recipes")

RECIPES = ("bert_qnli", "deit_cifar10", "deit_cifar100", "tinybert_mlm", "llm_lora")
SMOKE_N = 256  # synthetic rows in --smoke mode


# ----------------------------------------------------------------------------------- timing


class StepTimer(TrainerCallback):
    """Times each optimizer step (CUDA synchronized) and stops training after ``max_steps`` steps.

    ``intervals``: from one step end to the next (the first from train begin): the whole cost of a
    step, data loading included. ``compute``: ``on_step_begin`` to ``on_step_end``, which excludes
    fetching the step's micro-batches (the Trainer does that before ``on_step_begin``).
    """

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.intervals: list[float] = []
        self.compute: list[float] = []
        self._begin = 0.0
        self._last_end = 0.0

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        self._last_end = self._now()

    def on_step_begin(self, args, state, control, **kwargs):
        self._begin = self._now()

    def on_step_end(self, args, state, control, **kwargs):
        end = self._now()
        self.compute.append(end - self._begin)
        self.intervals.append(end - self._last_end)
        self._last_end = end
        if state.global_step >= self.max_steps:
            control.should_training_stop = True
        return control


# ----------------------------------------------------------------------------------- synthetic data


def word_level_tokenizer(vocab_size: int, specials: dict[int, str], **special_tokens: str):
    """A local ``PreTrainedTokenizerFast`` of ``vocab_size`` ids (``specials`` at their real ids, the rest
    ``tok<i>``): what the recipes' collators need (pad / mask ids, special-token masks, ``len``), no Hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {specials.get(i, f"tok{i}"): i for i in range(vocab_size)}
    unk = special_tokens.get("unk_token", next(iter(specials.values())))
    backend = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens)


BERT_SPECIALS = {0: "[PAD]", 100: "[UNK]", 101: "[CLS]", 102: "[SEP]", 103: "[MASK]"}  # bert-base vocab ids
BERT_SPECIAL_TOKENS = dict(
    pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]"
)


class BertTokenRows(torch.utils.data.Dataset):
    """``n`` tokenized rows of ``length`` tokens, made on the fly from the row index: ``[CLS] a [SEP]``
    (or the pair ``[CLS] a [SEP] b [SEP]`` with its token types), plus a binary ``label`` if asked."""

    def __init__(self, n: int, length: int, vocab_size: int, pair: bool, label: bool) -> None:
        self.n, self.length, self.vocab_size, self.pair, self.label = n, length, vocab_size, pair, label

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        rng = np.random.default_rng(index)
        ids = rng.integers(104, self.vocab_size, self.length).tolist()  # past the specials
        ids[0], ids[-1] = 101, 102
        types = [0] * self.length
        if self.pair:
            middle = self.length // 3  # QNLI: a short question, then the sentence
            ids[middle] = 102
            types[middle + 1 :] = [1] * (self.length - middle - 1)
        row = {"input_ids": ids, "token_type_ids": types, "attention_mask": [1] * self.length}
        if self.label:
            row["label"] = int(rng.integers(2))
        return row


class CifarRows(torch.utils.data.Dataset):
    """``n`` CIFAR-size (32x32x3 uint8) images made on the fly, through the recipe's training transform
    (random crop with padding, resize to the model's size, flip, normalise): ``pixel_values``, ``labels``."""

    def __init__(self, n: int, num_classes: int, transform, label_column: str) -> None:
        self.n, self.num_classes, self.transform, self.label_column = n, num_classes, transform, label_column

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        rng = np.random.default_rng(index)
        image = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        label = int(rng.integers(self.num_classes))
        out = self.transform({self.transform.image_column: [image], self.label_column: [label]})
        return {"pixel_values": out["pixel_values"][0], "labels": out["labels"][0]}


def sft_rows(n: int, length: int, vocab_size: int, prompt_fraction: float = 0.25):
    """A pre-tokenized ``datasets.Dataset`` of ``n`` rows of ``length`` tokens (what trl's preparation
    makes of Alpaca): ``input_ids`` and ``labels`` (-100 on the prompt, loss on the completion)."""
    import datasets
    import pyarrow as pa

    rng = np.random.default_rng(0)
    ids = rng.integers(0, min(vocab_size, 151_643), (n, length), dtype=np.int32)  # below Qwen's specials
    labels = ids.copy()
    labels[:, : int(length * prompt_fraction)] = -100
    table = pa.table(
        {
            "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), length),
            "labels": pa.FixedSizeListArray.from_arrays(pa.array(labels.reshape(-1)), length),
        }
    )
    return datasets.Dataset(table)


# ----------------------------------------------------------------------------------- the recipes


@dataclass
class Built:
    """What a recipe builder returns: the trainer (not yet trained) and how it was made."""

    trainer: Any
    model_name: str
    shape: str
    precision: str
    real_n: int
    real_planned_steps: int
    notes: str


def _parse(module, yaml_name: str, overrides: Sequence[str]):
    args_cls = {
        "bert_qnli": "QnliArguments",
        "deit_cifar": "CifarArguments",
        "tinybert_mlm": "MlmArguments",
        "llm_lora": "LoraArguments",
    }[module.__name__.rsplit(".", 1)[-1]]
    recipe_cls = getattr(module, args_cls)
    config = load_yaml_config(CONFIG_DIR / yaml_name)
    # A false flag that the installed transformers/trl does not have yet (activation_checkpointing, older
    # than transformers 5.23) turns nothing off: drop it instead of refusing the YAML as the recipe does.
    parser = HfArgumentParser((recipe_cls, getattr(recipe_cls, "training_args_class", DPTrainingArguments)))
    known = {action.dest for action in parser._actions}
    for key in [k for k, v in config.items() if k not in known and v is False]:
        logger.warning("%s: %s=false dropped (no such argument in the installed libraries)", yaml_name, key)
        del config[key]
    return parse_recipe_args(recipe_cls, list(overrides), defaults=config)


def _real_planned_steps(yaml_name: str, module, real_n: int, base_overrides: Sequence[str]) -> int:
    """The full run's step count: the YAML's batch and epochs / max_steps at the real N, counted by
    ``dp_hf.plan`` (what ``DPTrainer.planned_steps`` is)."""
    _, training_args = _parse(module, yaml_name, base_overrides)
    epoch_steps = steps_per_epoch(dataset_size=real_n, expected_batch_size=training_args.expected_batch_size)
    return planned_steps(
        epoch_steps, num_train_epochs=training_args.num_train_epochs, max_steps=training_args.max_steps
    )


def _precision(training_args, model) -> str:
    weights = next(model.parameters()).dtype
    text = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(weights, str(weights))
    if training_args.bf16:
        text += " + bf16 autocast"
    elif training_args.fp16:
        text += " + fp16 autocast"
    return text


def build_bert_qnli(overrides: list[str], smoke: bool, timer: StepTimer) -> Built:
    from transformers import AutoModelForSequenceClassification, BertConfig, DataCollatorWithPadding

    from dp_hf import DPTrainer
    from recipes import bert_qnli

    real_n = 104_743  # GLUE QNLI training pairs
    real_steps = _real_planned_steps("bert_qnli.yaml", bert_qnli, real_n, overrides)
    smoke_overrides = ["--max_seq_length", "32", "--per_device_train_batch_size", "8"]
    args, training_args = _parse(bert_qnli, "bert_qnli.yaml", overrides + (smoke_overrides if smoke else []))
    id2label = dict(enumerate(bert_qnli.LABELS))
    label2id = {label: i for i, label in id2label.items()}
    if smoke:
        config = BertConfig(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=37,
            max_position_embeddings=64,
        )
    else:  # bert-base-cased
        config = BertConfig(vocab_size=28996)
    config.num_labels, config.id2label, config.label2id = 2, id2label, label2id
    model = AutoModelForSequenceClassification.from_config(config)
    if args.trainable_layers == "last_block":
        bert_qnli.freeze_all_but_last_block(model)
    tokenizer = word_level_tokenizer(config.vocab_size, BERT_SPECIALS, **BERT_SPECIAL_TOKENS)
    n = SMOKE_N if smoke else real_n
    trainer = DPTrainer(
        model=model,
        args=training_args,
        train_dataset=BertTokenRows(n, args.max_seq_length, config.vocab_size, pair=True, label=True),
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
    )
    return Built(
        trainer,
        "bert-base-cased (BertConfig, vocab 28996)" if not smoke else "tiny BERT (smoke)",
        f"seq {args.max_seq_length}",
        _precision(training_args, model),
        real_n,
        real_steps,
        f"trainable_layers={args.trainable_layers}; every pair padded to the full max_seq_length",
    )


def _build_deit(yaml_name: str, num_classes: int, real_n: int):
    def build(overrides: list[str], smoke: bool, timer: StepTimer) -> Built:
        from transformers import AutoModelForImageClassification, ViTConfig, default_data_collator

        from dp_hf import DPTrainer
        from recipes import deit_cifar
        from recipes.image_transforms import IMAGENET_MEAN, IMAGENET_STD, ImageBatchTransform

        real_steps = _real_planned_steps(yaml_name, deit_cifar, real_n, overrides)
        smoke_overrides = [
            "--image_size", "16", "--per_device_train_batch_size", "8",
            "--gradient_accumulation_steps", "2", "--dataloader_num_workers", "0",
        ]  # fmt: skip
        args, training_args = _parse(deit_cifar, yaml_name, overrides + (smoke_overrides if smoke else []))
        training_args.remove_unused_columns = False  # as deit_cifar.main
        labels = [f"class_{i}" for i in range(num_classes)]
        if smoke:
            config = ViTConfig(
                image_size=16,
                patch_size=4,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=37,
            )
        else:  # facebook/deit-tiny-patch16-224: a ViT-architecture checkpoint (model_type "vit")
            if args.model_name_or_path != "facebook/deit-tiny-patch16-224":
                raise ValueError(f"no hand-written config for {args.model_name_or_path}")
            config = ViTConfig(
                image_size=224,
                patch_size=16,
                num_channels=3,
                hidden_size=192,
                num_hidden_layers=12,
                num_attention_heads=3,
                intermediate_size=768,
                hidden_act="gelu",
                layer_norm_eps=1e-12,
                qkv_bias=True,
            )
        config.num_labels = num_classes
        config.id2label = dict(enumerate(labels))
        config.label2id = {name: i for i, name in config.id2label.items()}
        model = AutoModelForImageClassification.from_config(config)
        image_size = args.image_size or model.config.image_size
        transform = ImageBatchTransform(
            image_size=image_size,
            train=True,
            image_column=args.image_column,
            label_column=args.label_column,
            mean=IMAGENET_MEAN,
            std=IMAGENET_STD,
            crop_padding=args.crop_padding,
        )
        n = SMOKE_N if smoke else real_n
        trainer = DPTrainer(
            model=model,
            args=training_args,
            train_dataset=CifarRows(n, num_classes, transform, args.label_column),
            data_collator=default_data_collator,
        )
        return Built(
            trainer,
            "DeiT-Tiny (ViTConfig 192d/12L/3H)" if not smoke else "tiny ViT (smoke)",
            f"{image_size}x{image_size} image",
            _precision(training_args, model),
            real_n,
            real_steps,
            f"full fine-tuning, {num_classes} classes; random uint8 images (no PNG decoding), "
            f"{training_args.dataloader_num_workers} loader workers",
        )

    return build


def build_tinybert_mlm(overrides: list[str], smoke: bool, timer: StepTimer) -> Built:
    from transformers import AutoModelForMaskedLM, BertConfig

    from dp_hf import DPTrainer
    from recipes import tinybert_mlm

    # The YAML's arithmetic takes the paper's 1.7M training abstracts; the planned steps are
    # max_steps (2000) whatever N is, only q and epsilon depend on it.
    real_n = 1_700_000
    real_steps = _real_planned_steps("tinybert_mlm.yaml", tinybert_mlm, real_n, overrides)
    smoke_overrides = [
        "--max_seq_length", "32", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2",
    ]  # fmt: skip
    args, training_args = _parse(
        tinybert_mlm, "tinybert_mlm.yaml", overrides + (smoke_overrides if smoke else [])
    )
    if smoke:
        config = BertConfig(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=37,
            max_position_embeddings=64,
        )
    else:  # huawei-noah/TinyBERT_General_4L_312D
        config = BertConfig(
            vocab_size=30522,
            hidden_size=312,
            num_hidden_layers=4,
            num_attention_heads=12,
            intermediate_size=1200,
            max_position_embeddings=512,
            type_vocab_size=2,
        )
    model = AutoModelForMaskedLM.from_config(config)
    tokenizer = word_level_tokenizer(config.vocab_size, BERT_SPECIALS, **BERT_SPECIAL_TOKENS)
    n = SMOKE_N if smoke else real_n
    trainer = DPTrainer(
        model=model,
        args=training_args,
        train_dataset=BertTokenRows(n, args.max_seq_length, config.vocab_size, pair=False, label=False),
        processing_class=tokenizer,
        data_collator=tinybert_mlm.MaskedLMCollator(tokenizer, args.mlm_probability),
    )
    return Built(
        trainer,
        "TinyBERT 4L-312D (BertConfig)" if not smoke else "tiny BERT MLM (smoke)",
        f"seq {args.max_seq_length}",
        _precision(training_args, model),
        real_n,
        real_steps,
        "N = 1.7M (the YAML's arithmetic); every abstract padded to the full max_seq_length",
    )


QWEN_SPECIALS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}


def build_llm_lora(overrides: list[str], smoke: bool, timer: StepTimer) -> Built:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from dp_hf import DPSFTTrainer
    from recipes import llm_lora

    real_n = 51_002  # tatsu-lab/alpaca's 52,002 minus 1,000 held out
    real_steps = _real_planned_steps("llm_lora.yaml", llm_lora, real_n, overrides)
    smoke_overrides = [
        "--max_length", "32", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2",
        "--bf16", "false",
    ]  # fmt: skip
    args, training_args = _parse(llm_lora, "llm_lora.yaml", overrides + (smoke_overrides if smoke else []))
    # The rows are tokenized and truncated already (trl's preparation would only re-map them).
    training_args.dataset_kwargs = {"skip_prepare_dataset": True}
    if smoke:
        config = Qwen2Config(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
        dtype = torch.float32
        tokenizer = word_level_tokenizer(256, {255: "<|endoftext|>"}, pad_token="<|endoftext|>")
    else:
        if args.model_name_or_path != "Qwen/Qwen2.5-0.5B":
            raise ValueError(f"no hand-written config for {args.model_name_or_path}")
        # Qwen/Qwen2.5-0.5B's config.json (494M parameters, 136M of them the tied embedding). Its
        # weights are bf16 ("torch_dtype": "bfloat16"), and from_pretrained's default dtype="auto"
        # (transformers 5) keeps them so: the recipe trains bf16 weights (fp32 LoRA adapters, peft's
        # autocast_adapter_dtype) under bf16 autocast.
        config = Qwen2Config(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            hidden_act="silu",
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1_000_000.0,
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=32768,
            max_window_layers=24,
            attention_dropout=0.0,
            bos_token_id=151643,
            eos_token_id=151643,
        )
        dtype = torch.bfloat16
        tokenizer = word_level_tokenizer(
            151936, QWEN_SPECIALS, pad_token="<|endoftext|>", eos_token="<|endoftext|>"
        )
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = llm_lora.add_lora(model, args)
    n = SMOKE_N if smoke else real_n
    trainer = DPSFTTrainer(
        model=model,
        args=training_args,
        train_dataset=sft_rows(n, training_args.max_length, config.vocab_size),
        processing_class=tokenizer,
    )
    return Built(
        trainer,
        "Qwen2.5-0.5B + LoRA r16 q,k,v,o (Qwen2Config)" if not smoke else "tiny Qwen2 + LoRA (smoke)",
        f"seq {training_args.max_length}",
        _precision(training_args, model),
        real_n,
        real_steps,
        "every example padded to the full max_length (Alpaca's are far shorter); trl's preparation skipped",
    )


BUILDERS: dict[str, Callable[[list[str], bool, StepTimer], Built]] = {
    "bert_qnli": build_bert_qnli,
    "deit_cifar10": _build_deit("deit_cifar10.yaml", 10, 45_000),
    "deit_cifar100": _build_deit("deit_cifar100.yaml", 100, 45_000),
    "tinybert_mlm": build_tinybert_mlm,
    "llm_lora": build_llm_lora,
}


# ----------------------------------------------------------------------------------- running


def bench_recipe(name: str, *, device: str, steps: int, warmup: int, smoke: bool) -> dict[str, Any]:
    """Build the recipe's trainer on synthetic data, train ``steps`` steps, return the row."""
    from transformers import set_seed

    output_dir = tempfile.mkdtemp(prefix=f"bench_{name}_")  # nothing is saved there
    overrides = ["--output_dir", output_dir, "--report_to", "none", "--eval_strategy", "no"]
    overrides += ["--save_strategy", "no", "--load_best_model_at_end", "false", "--push_to_hub", "false"]
    if device == "cpu":
        overrides += ["--use_cpu", "true"]
    if smoke:
        overrides += ["--disable_tqdm", "true", "--logging_steps", "1000000"]
    timer = StepTimer(steps)
    set_seed(0)
    started = time.perf_counter()
    built = BUILDERS[name](overrides, smoke, timer)
    trainer = built.trainer
    trainer.add_callback(timer)  # after DPTrainer's PrivacyCallback: its step-end work is timed too
    setup_s = time.perf_counter() - started
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with contextlib.redirect_stdout(
        sys.stderr
    ):  # the printed privacy plan and metrics: keep stdout for the table
        trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    done = len(timer.intervals)
    skip = warmup if done > warmup else max(0, done - 1)
    median_step = statistics.median(timer.intervals[skip:])
    median_compute = statistics.median(timer.compute[skip:])
    args = trainer.args
    batch = args.expected_batch_size
    planned = built.real_planned_steps
    if not smoke and trainer.planned_steps != planned:
        raise RuntimeError(f"{name}: DPTrainer plans {trainer.planned_steps} steps, dp_hf.plan {planned}")
    trainable, total = parameter_counts(trainer.model)
    row = {
        "recipe": name,
        "smoke": smoke,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "model": built.model_name,
        "trainable_params": trainable,
        "total_params": total,
        "shape": built.shape,
        "precision": built.precision,
        "dp_optimizer": args.dp_optimizer,
        "per_sample_gradient_mode": trainer.per_sample_gradient_mode,
        "per_device_batch": args.per_device_train_batch_size,
        "grad_accum": args.gradient_accumulation_steps,
        "expected_batch": batch,
        "noise_multiplier": trainer.noise_multiplier,
        "clip_norm": args.per_sample_max_grad_norm,
        "steps_run": done,
        "steps_timed": done - skip,
        "median_step_s": median_step,
        "median_compute_s": median_compute,
        "steps_per_s": 1.0 / median_step,
        "examples_per_s": batch / median_step,
        "peak_gpu_mem_gib": peak,
        "dataset_size": built.real_n,
        "run_dataset_size": trainer.dataset_size,
        "planned_steps": planned,
        "projected_hours": planned * median_step / 3600,
        "setup_s": setup_s,
        "notes": built.notes,
    }
    del trainer, built
    if cuda:
        torch.cuda.empty_cache()
    return row


def _params(count: int) -> str:
    return f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count / 1e3:.1f}K"


def _hours(hours: float) -> str:
    minutes = round(hours * 60)
    return f"{minutes // 60}h{minutes % 60:02d}" if minutes >= 60 else f"{hours * 60:.1f} min"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    header = (
        "| recipe | model | trainable / total | batch (per device x accum = B) | shape | precision | optimizer "
        "| s/step (compute) | steps/s | examples/s | peak GPU mem | planned steps (N) | projected train time |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['recipe']} | ERROR: {r['error'][:200]} |" + " |" * 11)
            continue
        mem = "-" if r["peak_gpu_mem_gib"] is None else f"{r['peak_gpu_mem_gib']:.1f} GiB"
        lines.append(
            f"| {r['recipe']} | {r['model']} | {_params(r['trainable_params'])} / {_params(r['total_params'])} "
            f"| {r['per_device_batch']} x {r['grad_accum']} = {r['expected_batch']} | {r['shape']} "
            f"| {r['precision']} | {r['dp_optimizer']} ({r['per_sample_gradient_mode']}) "
            f"| {r['median_step_s']:.3f} ({r['median_compute_s']:.3f}) | {r['steps_per_s']:.3g} "
            f"| {r['examples_per_s']:.4g} | {mem} | {r['planned_steps']:,} ({r['dataset_size']:,}) "
            f"| {_hours(r['projected_hours'])} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument(
        "--steps", type=int, default=None, help="optimizer steps per recipe (default 200; smoke 4)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="steps not timed (default 10; smoke 1)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available; smoke: cpu)")
    parser.add_argument("--smoke", action="store_true", help="tiny models, shapes and N on the CPU (seconds)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    options = parser.parse_args(argv)
    steps = options.steps or (4 if options.smoke else 200)
    warmup = options.warmup if options.warmup is not None else (1 if options.smoke else 10)
    device = options.device or ("cpu" if options.smoke or not torch.cuda.is_available() else "cuda")
    if steps < 1 or warmup < 0:
        parser.error("--steps must be positive and --warmup non-negative")
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("absl").setLevel(logging.ERROR)
    rows = []
    for name in options.recipes:
        try:
            row = bench_recipe(name, device=device, steps=steps, warmup=warmup, smoke=options.smoke)
        except Exception as err:  # report it and go on with the other recipes
            traceback.print_exc()
            row = {"recipe": name, "smoke": options.smoke, "error": f"{type(err).__name__}: {err}"}
        rows.append(row)
        print(json.dumps(row, default=str), file=sys.stderr, flush=True)
        if options.json:  # after every recipe, so a long run that is cut short keeps what it measured
            options.json.parent.mkdir(parents=True, exist_ok=True)
            options.json.write_text(json.dumps(rows, indent=2, default=str) + "\n")
    print(markdown_table(rows))
    print(
        f"\n{'SMOKE (tiny models on the CPU; the projection is meaningless) ' if options.smoke else ''}"
        f"median of the steps after {warmup} warm-up ones ({steps} run); "
        "s/step: step end to step end (data loading included), compute: step begin to end; "
        "examples/s = expected batch B / s/step; projected train time = planned steps x s/step on one "
        "device, without evaluation, checkpoints or start-up. Text rows use full-length sequences "
        "(an upper bound: the recipes pad dynamically)."
    )
    return rows


if __name__ == "__main__":
    sys.exit(1 if any("error" in row for row in main()) else 0)
