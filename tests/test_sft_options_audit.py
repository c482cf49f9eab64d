"""Black-box audit of DPSFTTrainer's options: each one is refused before training, or keeps the guarantee.

The guarantee, read off the parameters as in tests/test_sensitivity.py: one plain DP-SGD step at
``sigma = 0`` with every example in the batch (expected batch = dataset size, ``q = 1``), no momentum,
weight decay or schedule, and ``C`` far below every example's gradient norm. Replacing one example
then moves the update by at most ``2 C lr / B``. Each accepted option (alone, on a tiny Llama, full
fine-tuning and LoRA) is run on two neighbouring datasets and the ratio (update change / bound) must
not exceed 1. The refused options must be refused with an error naming the option, both when the
config is built and when the option is set afterwards. And the logs written with
``dp_log_train_loss=False`` (log history, trainer_state.json, the train() metrics) must hold no
statistic of the private batches (loss, token counts, trl's accuracy and entropy), with epsilon in
every training log line.
"""

from __future__ import annotations

import glob
import json
import warnings

import datasets
import pytest
import torch

pytest.importorskip("trl")

from test_sft import lora_config, prompt_completion, sft_args, tiny_llama  # noqa: E402

from dp_hf import DPSFTTrainer, DPTrainingArguments  # noqa: E402
from dp_hf.sft import no_accelerator  # noqa: E402
from recipes.smoke import chat_tokenizer, chats_like  # noqa: E402
from tests.dp_training import one_sgd_step  # noqa: E402

CLIP, LR, N = 1e-3, 1e3, 6
ONE_SGD_STEP = dict(
    per_device_train_batch_size=N,  # expected batch = N: q = 1
    gradient_accumulation_steps=1,
    **one_sgd_step(CLIP, LR),
)


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def model_for(tokenizer, lora: bool):
    model = tiny_llama(tokenizer)
    if lora:
        from peft import get_peft_model

        torch.manual_seed(1)
        config = lora_config()
        config.init_lora_weights = False  # B != 0, so A has a gradient too
        model = get_peft_model(model, config)
    return model


def pool(kind: str) -> datasets.Dataset:
    """``N + 1`` examples: the datasets are ``0..N-1`` and the same with example 0 replaced by ``N``."""
    if kind == "prompt-completion":
        return prompt_completion(N + 1, seed=5)
    chats = chats_like(N + 1, 5)
    if kind == "conversational":
        return chats
    texts = [" ".join(message["content"] for message in chat) for chat in chats["messages"]]
    return datasets.Dataset.from_dict({kind: texts})  # a language-modeling column named `kind`


def trainable(model) -> torch.Tensor:
    return torch.cat([p.detach().double().flatten() for p in model.parameters() if p.requires_grad])


def update_of_one_step(tokenizer, dataset, lora: bool, options: dict, output_dir) -> torch.Tensor:
    model = model_for(tokenizer, lora)
    before = trainable(model)
    args = sft_args(output_dir, **{"max_length": None, **ONE_SGD_STEP, **options})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0 and delta >= 1/N warn, rightly
        trainer = DPSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
        trainer.train()
    assert trainer.state.global_step == 1 and trainer.sample_rate == 1.0
    return before - trainable(model)


# name -> (dataset kind, DPSFTConfig options): each accepted option alone
ACCEPTED = {
    "prompt-completion (completion only)": ("prompt-completion", {}),
    "padding_free": ("prompt-completion", dict(padding_free=True)),
    "completion_only_loss=False": ("prompt-completion", dict(completion_only_loss=False)),
    "assistant_only_loss": ("conversational", dict(assistant_only_loss=True)),
    "dataset_text_field": ("body", dict(dataset_text_field="body")),
    "max_length truncation, keep_end": ("prompt-completion", dict(max_length=12, truncation_mode="keep_end")),
    "loss_type=dft": ("prompt-completion", dict(loss_type="dft")),
    "dp_token_reduction=sum": ("prompt-completion", dict(dp_token_reduction="sum")),
    "pad_to_multiple_of=8": ("prompt-completion", dict(pad_to_multiple_of=8)),
    "average_tokens_across_devices=False": ("prompt-completion", dict(average_tokens_across_devices=False)),
    "eval_packing=True": ("prompt-completion", dict(eval_packing=True)),
    "dataloader_drop_last": ("prompt-completion", dict(dataloader_drop_last=True)),
    "shuffle_dataset": ("prompt-completion", dict(shuffle_dataset=True)),
}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", list(ACCEPTED))
def test_replacing_one_example_moves_the_update_within_the_bound(tokenizer, name, lora, tmp_path):
    kind, options = ACCEPTED[name]
    examples = pool(kind)
    first = update_of_one_step(tokenizer, examples.select(range(N)), lora, options, tmp_path / "a")
    second = update_of_one_step(tokenizer, examples.select([N, *range(1, N)]), lora, options, tmp_path / "b")
    bound = 2 * CLIP * LR / N
    ratio = float((first - second).norm()) / bound
    assert 0.0 < ratio <= 1.0 + 1e-6, f"{name}: update change / (2 C lr / B) = {ratio:.6f}"
    # every example was clipped to C: the update is at most C lr (the mean of N clipped gradients)
    assert float(first.norm()) <= CLIP * LR * (1 + 1e-6)


# options refused with DP: (options, what the error must say)
REFUSED = [
    (dict(use_liger_kernel=True), r"use_liger_kernel=True .* Set use_liger_kernel=False"),
    (dict(enable_jit_checkpoint=True), r"enable_jit_checkpoint=True is not supported with DP: .*save_steps"),
    (dict(packing=True, packing_strategy="bfd"), r"packing=True .*packing=False"),
    (dict(packing=True, packing_strategy="wrapped"), r"packing=True .*packing=False"),
    (
        dict(padding_free=True, max_length=None, pad_to_multiple_of=8),
        r"pad_to_multiple_of=8 .*pad_to_multiple_of=None",
    ),
    (dict(neftune_noise_alpha=5.0), r"neftune_noise_alpha=5.0 is not supported with DP"),
    (dict(label_smoothing_factor=0.1), r"label_smoothing_factor=0.1"),
    (dict(gradient_checkpointing=True), r"gradient_checkpointing=False"),
    (dict(torch_compile=True), r"torch_compile=True .*Set torch_compile=False"),
    (dict(auto_find_batch_size=True), r"auto_find_batch_size=True is not supported with DP"),
    (dict(train_sampling_strategy="group_by_length"), r"train_sampling_strategy='group_by_length'"),
    (
        dict(include_num_input_tokens_seen="all", dp_log_train_loss=False),
        r"include_num_input_tokens_seen='all'",
    ),
]


@pytest.mark.parametrize(
    "options, message", REFUSED, ids=[next(iter(o)) + str(i) for i, (o, _) in enumerate(REFUSED)]
)
def test_refused_before_training_with_the_option_named(tokenizer, options, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        sft_args(tmp_path, **options)
    # ...and when set after the config was built: refused when the trainer is built
    args = sft_args(tmp_path, max_length=options.get("max_length", 32))
    for key, value in options.items():
        setattr(args, key, value)
    with pytest.raises(ValueError, match=message):
        DPSFTTrainer(
            model=tiny_llama(tokenizer),
            args=args,
            train_dataset=prompt_completion(8),
            processing_class=tokenizer,
        )


def test_liger_kernels_are_refused_for_the_plain_trainer_too(tmp_path):
    with pytest.raises(ValueError, match=r"use_liger_kernel=True .* Set use_liger_kernel=False"):
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, use_liger_kernel=True)
    DPTrainingArguments(output_dir=str(tmp_path), disable_dp=True, use_liger_kernel=True)  # the baseline may


@pytest.mark.skipif(not no_accelerator(), reason="trl offloads activations only from an accelerator")
def test_activation_offloading_without_an_accelerator_is_explained(tokenizer, tmp_path):
    with pytest.raises(
        ValueError, match=r"activation_offloading=True needs a GPU.*activation_offloading=False"
    ):
        DPSFTTrainer(
            model=tiny_llama(tokenizer),
            args=sft_args(tmp_path, activation_offloading=True),
            train_dataset=prompt_completion(8),
            processing_class=tokenizer,
        )


#: What a run with dp_log_train_loss=False may log: the noised gradient's norm, the privacy spent, the
#: schedule, and the evaluation metrics (evaluation data is not covered, as the card says).
PUBLIC_LOG_KEYS = {"grad_norm", "epsilon", "delta", "learning_rate", "epoch", "step"}


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding-free"])
def test_logs_hold_no_unnoised_statistic_of_the_training_batches(tokenizer, padding_free, tmp_path):
    args = sft_args(
        tmp_path,
        padding_free=padding_free,
        max_length=None,
        dp_log_train_loss=False,
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPSFTTrainer(
            model=tiny_llama(tokenizer),
            args=args,
            train_dataset=prompt_completion(32, 0),
            eval_dataset=prompt_completion(8, 1),
            processing_class=tokenizer,
        )
        output = trainer.train()
    saved = json.load(open(sorted(glob.glob(str(tmp_path / "checkpoint-*" / "trainer_state.json")))[-1]))
    for history in (trainer.state.log_history, saved["log_history"]):
        train_lines = [line for line in history if not any(key.startswith("eval_") for key in line)]
        assert train_lines and all("epsilon" in line for line in train_lines)
        leaked = {key for line in train_lines for key in line} - PUBLIC_LOG_KEYS
        assert not leaked, f"unnoised training statistics in the logs: {sorted(leaked)}"
    assert saved["total_flos"] == 0 and saved["num_input_tokens_seen"] == 0
    assert set(output.metrics) <= PUBLIC_LOG_KEYS and output.metrics["epsilon"] > 0
    assert output.training_loss != output.training_loss  # NaN: the mean training loss is not released
