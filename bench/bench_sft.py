"""Step time of dp_hf.DPSFTTrainer against trl's SFTTrainer on a tiny Llama (CPU, offline).

    OMP_NUM_THREADS=1 python -m bench.bench_sft [--steps 30] [--threads 1] [--padding-free] [--repeats 3]

Same model, data (synthetic conversations, assistant-only loss), expected batch and max_length; the
median optimizer-step time after a warm-up, for full fine-tuning and LoRA. DP runs use Poisson
sampling (the batch size varies around the expected one) and per-example clipping; SFTTrainer runs
use trl's fused LM head and shuffled fixed-size batches. ``--repeats R`` alternates all runs R times
and reports the median over the rounds, with the range of the per-round ratios (a shared machine's
load drifts between runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback
from trl import SFTConfig, SFTTrainer

from dp_hf import DPSFTConfig, DPSFTTrainer
from recipes.smoke import chat_tokenizer, chats_like


class _StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def _model(tokenizer, hidden: int, layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
        )
    )


def run(
    kind: str, lora: bool, steps: int, hidden: int, layers: int, batch: int, padding_free: bool = False
) -> dict:
    tokenizer = chat_tokenizer()
    data = chats_like(1024, 0, system=True)
    common = dict(
        padding_free=padding_free,
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=1e-3,
        max_length=None if padding_free else 64,  # trl: padding_free needs max_length=None
        assistant_only_loss=True,
        logging_steps=steps,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        seed=0,
    )
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]
        )
    if kind == "sft":
        args = SFTConfig(**common, gradient_checkpointing=False)
        trainer_cls = SFTTrainer
    else:
        args = DPSFTConfig(**common, noise_multiplier=1.0, noise_seed=1, sampling_seed=2)
        trainer_cls = DPSFTTrainer
    timer = _StepTimer()
    trainer = trainer_cls(
        model=_model(tokenizer, hidden, layers),
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[timer],
    )
    trainer.train()
    measured = timer.times[3:]
    return {
        "trainer": trainer_cls.__name__,
        "lora": lora,
        "padding_free": padding_free,
        "median_step_s": statistics.median(measured),
        "steps_timed": len(measured),
        "mode": getattr(trainer, "per_sample_gradient_mode", None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--padding-free", action="store_true", help="also time padding_free=True (packed rows)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="alternate all runs this many times")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    rows = []
    layouts = (False, True) if options.padding_free else (False,)
    for _ in range(options.repeats):
        for padding_free in layouts:
            for lora in (False, True):
                for kind in ("sft", "dp"):
                    rows.append(
                        run(
                            kind,
                            lora,
                            options.steps,
                            options.hidden,
                            options.layers,
                            options.batch,
                            padding_free,
                        )
                    )
                    print(json.dumps(rows[-1]), flush=True)
    for padding_free in layouts:
        for lora in (False, True):
            runs = [r for r in rows if r["lora"] == lora and r["padding_free"] == padding_free]
            sft = [r["median_step_s"] for r in runs if r["trainer"] == "SFTTrainer"]
            dp = [r["median_step_s"] for r in runs if r["trainer"] != "SFTTrainer"]
            ratios = [d / s for s, d in zip(sft, dp)]
            spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
            print(
                f"{'LoRA' if lora else 'full'}{', padding-free' if padding_free else ''}: SFTTrainer "
                f"{statistics.median(sft) * 1e3:.1f} ms/step, DPSFTTrainer {statistics.median(dp) * 1e3:.1f} "
                f"ms/step ({runs[-1]['mode']}), ratio {statistics.median(dp) / statistics.median(sft):.2f}x{spread}"
            )


if __name__ == "__main__":
    main()
