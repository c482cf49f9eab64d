"""DPSFTTrainer / DPSFTConfig: DP for trl's SFTTrainer (offline, CPU, a tiny Llama and a local tokenizer)."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle

import datasets
import pytest
import torch

pytest.importorskip("trl")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer  # noqa: E402
from trl import SFTConfig  # noqa: E402

from dp_hf import (  # noqa: E402
    DPSFTConfig,
    DPSFTTrainer,
    DPTrainer,
    DPTrainerMixin,
    DPTrainingArguments,
    make_private_trainer,
)
from dp_hf.sampling import PoissonBatchSampler  # noqa: E402
from dp_hf.sft import sft_per_example_losses  # noqa: E402
from recipes.smoke import NUMBERS, chat_tokenizer, chats_like  # noqa: E402
from tests.dp_training import QUICK_RUN_ARGS, bert_classifier, classification_data  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def tiny_llama(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def prompt_completion(n: int, seed: int = 0) -> datasets.Dataset:
    """trl's prompt-completion format, conversational (a user prompt, an assistant completion)."""
    chats = chats_like(n, seed)["messages"]
    return datasets.Dataset.from_dict(
        {"prompt": [chat[:1] for chat in chats], "completion": [chat[1:] for chat in chats]}
    )


def sft_args(output_dir, **overrides) -> DPSFTConfig:
    defaults = dict(
        QUICK_RUN_ARGS,
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        max_steps=4,
        noise_multiplier=0.5,
        max_length=32,
        bf16=False,
        dataset_num_proc=None,
    )
    defaults.update(overrides)
    return DPSFTConfig(**defaults)


def lora_config():
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


# ------------------------------------------------------------------ configuration


def test_config_has_the_dp_fields_and_validation(tmp_path):
    from transformers import TrainingArguments

    dp_fields = {f.name for f in dataclasses.fields(DPTrainingArguments)} - {
        f.name for f in dataclasses.fields(TrainingArguments)
    }
    sft_fields = {f.name for f in dataclasses.fields(DPSFTConfig)}
    assert dp_fields <= sft_fields
    assert issubclass(DPSFTConfig, SFTConfig)
    # the same validation (one implementation): the same errors
    for bad in (
        dict(noise_multiplier=None),
        dict(noise_multiplier=0.5, target_epsilon=1.0),
        dict(dp_optimizer="adamw"),
        dict(accountant="moments"),
        dict(per_sample_max_grad_norm=0.0),
        dict(max_grad_norm=5.0),
    ):
        with pytest.raises(ValueError) as sft_error:
            sft_args(tmp_path, **bad)
        with pytest.raises(ValueError) as plain_error:
            DPTrainingArguments(output_dir=str(tmp_path), **{"noise_multiplier": 0.5, **bad})
        assert str(sft_error.value) == str(plain_error.value)
    args = sft_args(
        tmp_path, dp_optimizer="dp-sgd", dp_optimizer_kwargs='{"nesterov": true, "momentum": 0.9}'
    )
    assert args.dp_optimizer_kwargs == {"nesterov": True, "momentum": 0.9}
    assert args.max_grad_norm == 0.0 and args.gradient_checkpointing is False
    # secret seeds never leave the process
    assert "noise_seed=1" not in repr(args) and "sampling_seed=2" not in str(args)
    assert args.to_dict()["noise_seed"] == "<NOISE_SEED>"
    restored = pickle.loads(pickle.dumps(args))
    assert restored.noise_seed is None and restored.sampling_seed is None


@pytest.mark.parametrize(
    "options, option_name",
    [
        (dict(packing=True, packing_strategy="bfd"), "packing=False"),
        (dict(packing=True, packing_strategy="bfd_split"), "packing=False"),
        (dict(packing=True, packing_strategy="wrapped"), "packing=False"),
        (dict(gradient_checkpointing=True), "gradient_checkpointing=False"),
        (dict(label_smoothing_factor=0.1), "label_smoothing_factor"),
    ],
)
def test_refuses_options_that_mix_examples(tmp_path, tokenizer, options, option_name):
    with pytest.raises(ValueError, match=option_name):
        sft_args(tmp_path, **options)
    # ...and when the option is turned on after the config was built: refused before any data is prepared
    args = sft_args(tmp_path)
    for key, value in options.items():
        setattr(args, key, value)
    with pytest.raises(ValueError, match=option_name):
        DPSFTTrainer(
            model=tiny_llama(tokenizer),
            args=args,
            train_dataset=chats_like(32, 0),
            processing_class=tokenizer,
        )
    # the non-private baseline may use them
    sft_args(tmp_path, disable_dp=True, **options)


def test_refuses_plain_configs_and_batch_losses(tmp_path, tokenizer):
    data = chats_like(32, 0)
    plain = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False)
    with pytest.raises(TypeError, match="DPSFTTrainer needs DPSFTConfig"):
        DPSFTTrainer(model=tiny_llama(tokenizer), args=plain, train_dataset=data, processing_class=tokenizer)
    with pytest.raises(TypeError, match="DPSFTTrainer needs DPSFTConfig"):
        DPSFTTrainer(
            model=tiny_llama(tokenizer),
            args=DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, use_cpu=True),
            train_dataset=data,
            processing_class=tokenizer,
        )
    with pytest.raises(TypeError, match="compute_loss_func"):
        DPSFTTrainer(
            model=tiny_llama(tokenizer),
            args=sft_args(tmp_path),
            train_dataset=data,
            processing_class=tokenizer,
            compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum(),
        )
    with pytest.raises(TypeError, match="DPTrainer needs DPTrainingArguments"):
        DPTrainer(model=bert_classifier(), args=sft_args(tmp_path), train_dataset=classification_data(64))


def test_make_private_trainer(tmp_path):
    assert make_private_trainer(DPTrainer) is DPTrainer
    PrivateTrainer = make_private_trainer(Trainer, DPTrainingArguments)
    assert issubclass(PrivateTrainer, DPTrainerMixin) and PrivateTrainer.__name__ == "DPTrainer"
    assert issubclass(DPSFTTrainer, DPTrainerMixin)
    from tests.dp_training import dp_args

    args = dp_args(tmp_path, max_steps=2)
    reference = DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(64))
    reference.train()
    made = PrivateTrainer(
        model=bert_classifier(), args=dp_args(tmp_path, max_steps=2), train_dataset=classification_data(64)
    )
    made.train()
    assert made.privacy_spent() == reference.privacy_spent()
    for p, q in zip(reference.model.parameters(), made.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


# ------------------------------------------------------------------ per-example losses


def test_labels_follow_assistant_and_completion_masks(tmp_path, tokenizer):
    assistant = DPSFTTrainer(
        model=tiny_llama(tokenizer),
        args=sft_args(tmp_path, assistant_only_loss=True),
        train_dataset=chats_like(16, 0),
        processing_class=tokenizer,
    )
    completion = DPSFTTrainer(
        model=tiny_llama(tokenizer),
        args=sft_args(tmp_path),  # completion_only_loss defaults to True on prompt-completion data
        train_dataset=prompt_completion(16, 0),
        processing_class=tokenizer,
    )
    everything = DPSFTTrainer(
        model=tiny_llama(tokenizer),
        args=sft_args(tmp_path, completion_only_loss=False),
        train_dataset=prompt_completion(16, 0),
        processing_class=tokenizer,
    )
    for trainer in (assistant, completion):
        for example, chat in zip(trainer.train_dataset, chats_like(16, 0)["messages"]):
            trained = [t for t, label in zip(example["input_ids"], example["labels"]) if label != -100]
            # exactly the assistant's words and its end-of-turn token
            answer = chat[-1]["content"].split() + ["<eos>"]
            assert tokenizer.convert_ids_to_tokens(trained) == answer
    for example in everything.train_dataset:
        assert example["labels"] == example["input_ids"]


def test_per_example_loss_is_the_examples_own(tmp_path, tokenizer):
    trainer = DPSFTTrainer(
        model=tiny_llama(tokenizer),
        args=sft_args(tmp_path, assistant_only_loss=True, dp_token_reduction="sum"),
        train_dataset=chats_like(16, 0),
        processing_class=tokenizer,
    )
    examples = [trainer.train_dataset[i] for i in range(3)]
    batch = trainer.data_collator(examples)
    with torch.no_grad():
        losses = trainer.compute_per_example_losses(trainer.model, batch)
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    for i, example in enumerate(examples):
        n = len(example["input_ids"])
        row_logits = torch.log_softmax(logits[i, : n - 1].float(), -1)
        targets = torch.tensor(example["labels"][1:])
        keep = targets != -100
        expected = -row_logits[keep].gather(-1, targets[keep].unsqueeze(-1)).sum()
        torch.testing.assert_close(losses[i], expected, rtol=1e-5, atol=1e-5)
    mean, _, mask = sft_per_example_losses(logits, batch["labels"], reduction="mean")
    torch.testing.assert_close(mean * mask.sum(1), losses, rtol=1e-5, atol=1e-5)


def _per_example_norms(trainer, examples) -> torch.Tensor:
    """The per-example norms the trainer's own clipping path computes (hooks and optimizer, as in training)."""
    model = trainer.model
    model.train()
    trainer.create_optimizer()
    batch = trainer.data_collator(examples)
    trainer.compute_per_example_losses(model, batch).sum().backward()
    if trainer.fast_clipping is not None:
        norms = trainer.fast_clipping.accumulate(trainer.dp_optimizer)
    else:
        norms = trainer.dp_optimizer.clip_and_accumulate()
    trainer.dp_optimizer.zero_grad()
    return norms.detach().clone()


@pytest.mark.parametrize("fmt", ["conversational", "prompt_completion"])
@pytest.mark.parametrize("lora", [False, True])
def test_one_examples_gradient_ignores_the_others(tmp_path, tokenizer, fmt, lora):
    data = chats_like(16, 0) if fmt == "conversational" else prompt_completion(16, 0)
    extra = dict(assistant_only_loss=True) if fmt == "conversational" else {}
    trainer = DPSFTTrainer(
        model=tiny_llama(tokenizer),
        args=sft_args(tmp_path, **extra),
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=lora_config() if lora else None,
    )
    examples = [trainer.train_dataset[i] for i in range(3)]
    norms = _per_example_norms(trainer, examples)
    # change example 1: a longer one (the batch's padding changes too)
    longest = max(range(len(trainer.train_dataset)), key=lambda i: len(trainer.train_dataset[i]["input_ids"]))
    other = trainer.train_dataset[longest]
    assert len(other["input_ids"]) > max(len(e["input_ids"]) for e in (examples[0], examples[2]))
    changed = _per_example_norms(trainer, [examples[0], other, examples[2]])
    torch.testing.assert_close(changed[[0, 2]], norms[[0, 2]], rtol=1e-5, atol=1e-6)
    alone = _per_example_norms(trainer, [examples[0]])
    torch.testing.assert_close(alone[0], norms[0], rtol=1e-5, atol=1e-6)
    assert torch.all(norms > 0)


def test_max_length_truncation(tmp_path, tokenizer):
    trainer = DPSFTTrainer(
        model=tiny_llama(tokenizer),
        args=sft_args(tmp_path, max_length=6, completion_only_loss=False),
        train_dataset=prompt_completion(16, 0),
        processing_class=tokenizer,
    )
    assert max(len(e["input_ids"]) for e in trainer.train_dataset) == 6


def prompt_learning_config(kind: str):
    from peft import PromptEncoderConfig, PromptTuningConfig

    if kind == "prompt-tuning":
        return PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    return PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, encoder_hidden_size=16)


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("kind", ["prompt-tuning", "p-tuning"])
def test_prompt_learning_per_example_norms_are_each_examples_own(tmp_path, tokenizer, kind, mode):
    """The virtual tokens' logits come first: the labels (popped before the forward) are padded for them, as PEFT's
    own forward pads them. Before, the forward failed with torch's bare 'Expected input batch_size (24) to match
    target batch_size (21)', then inside PEFT's forward (its prompt encoded once and repeated over the batch)."""
    trainer = DPSFTTrainer(
        model=tiny_llama(tokenizer),
        args=sft_args(tmp_path, per_sample_gradient_mode=mode),
        train_dataset=chats_like(16, 0),
        processing_class=tokenizer,
        peft_config=prompt_learning_config(kind),
    )
    examples = [trainer.train_dataset[i] for i in range(3)]
    norms = _per_example_norms(trainer, examples)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    with (
        trainer.fast_clipping.hooks_off()
    ):  # plain autograd, one example; its loss PEFT's (labels padded by PEFT)
        for i, example in enumerate(examples):
            loss = trainer.model(**trainer.data_collator([example])).loss
            expected = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]).norm()
            torch.testing.assert_close(norms[i], expected, rtol=1e-5, atol=1e-7)
    assert torch.all(norms > 0)


@pytest.mark.parametrize("kind", ["prompt-tuning", "p-tuning"])
def test_prompt_learning_trains_and_logs_epsilon(tmp_path, tokenizer, kind):
    trainer = DPSFTTrainer(
        model=tiny_llama(tokenizer),
        args=sft_args(tmp_path, max_steps=2),
        train_dataset=chats_like(32, 0),
        processing_class=tokenizer,
        peft_config=prompt_learning_config(kind),
    )
    prompt = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    logged = [entry["epsilon"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2 and 0 < logged[0] < logged[1] < float("inf")
    assert all(not torch.equal(p, prompt[n]) for n, p in trainer.model.named_parameters() if p.requires_grad)


def test_prompt_learning_with_padding_free_rows_is_refused_when_built(tmp_path, tokenizer):
    """One prompt per packed row would be shared by the row's examples (and PEFT drops the position_ids)."""
    with pytest.raises(ValueError, match="padding_free=True with PEFT PROMPT_TUNING.*Set padding_free=False"):
        DPSFTTrainer(
            model=tiny_llama(tokenizer),
            args=sft_args(tmp_path, padding_free=True, max_length=None),
            train_dataset=chats_like(16, 0),
            processing_class=tokenizer,
            peft_config=prompt_learning_config("prompt-tuning"),
        )


# ------------------------------------------------------------------ training


def test_lora_training_logs_epsilon_and_writes_card(tmp_path, tokenizer):
    trainer = DPSFTTrainer(
        model=tiny_llama(tokenizer),
        args=sft_args(tmp_path, noise_multiplier=None, target_epsilon=4.0, assistant_only_loss=True),
        train_dataset=chats_like(128, 0),
        processing_class=tokenizer,
        peft_config=lora_config(),
    )
    loader = trainer.get_train_dataloader()
    assert isinstance(loader.batch_sampler, PoissonBatchSampler)  # trl's loader is replaced by ours
    trainer.train()
    epsilon, delta = trainer.privacy_spent()
    assert 0 < epsilon <= 4.0 and trainer.accountant.steps == 4
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 4 and all(0 < entry["epsilon"] <= 4.0 for entry in logged)
    assert all("mean_token_accuracy" in entry and "entropy" in entry for entry in logged)
    assert not any("num_tokens" in entry for entry in trainer.state.log_history)
    trainer.save_model()
    assert os.path.isfile(tmp_path / "adapter_model.safetensors")
    privacy = json.loads((tmp_path / "privacy.json").read_text())
    assert privacy["epsilon"] == pytest.approx(epsilon, abs=1e-3)
    card = (tmp_path / "README.md").read_text()
    assert "mean_token_accuracy, entropy" in card


def test_full_finetuning_without_train_statistics(tmp_path, tokenizer):
    model = tiny_llama(tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DPSFTTrainer(
        model=model,
        args=sft_args(tmp_path, dp_log_train_loss=False, loss_type="dft"),
        train_dataset=prompt_completion(64, 0),
        processing_class=tokenizer,
    )
    trainer.train()
    assert trainer.accountant.steps == 4
    for name, p in trainer.model.named_parameters():
        assert not torch.equal(p, before[name]), name  # every tensor trained (clipped, noised)
    for entry in trainer.state.log_history:
        assert not {"loss", "train_loss", "mean_token_accuracy", "entropy"} & set(entry)
    assert any("epsilon" in entry for entry in trainer.state.log_history)


@pytest.mark.slow
def test_resume_gives_same_parameters_and_epsilon(tmp_path, tokenizer):
    data = chats_like(64, 0)
    common = dict(max_steps=6, save_strategy="steps", save_steps=3, assistant_only_loss=True)

    def make(output_dir, seed=0):
        return DPSFTTrainer(
            model=tiny_llama(tokenizer, seed=seed),
            args=sft_args(output_dir, **common),
            train_dataset=data,
            processing_class=tokenizer,
        )

    full = make(tmp_path / "full")
    full.train()
    first = make(tmp_path / "cut")
    first.train()
    checkpoint = tmp_path / "cut" / "checkpoint-3"
    assert (checkpoint / "dp_state.pt").is_file() and (checkpoint / "privacy.json").is_file()
    resumed = make(tmp_path / "cut", seed=123)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.accountant.steps == full.accountant.steps == 6
    assert resumed.privacy_spent() == full.privacy_spent()
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)

    # trl's token metrics are the training forwards' only: the loss check's three extra forwards (in the
    # first step a trainer runs) used to add theirs to step 4's log line.
    def metrics(trainer):
        keys = ("loss", "entropy", "mean_token_accuracy")
        return [
            {k: e[k] for k in keys}
            for e in trainer.state.log_history
            if e.get("step", 0) > 3 and "entropy" in e
        ]

    assert len(metrics(full)) == 3 and metrics(resumed) == metrics(full)


def test_budget_stop(tmp_path, tokenizer):
    trainer = DPSFTTrainer(
        model=tiny_llama(tokenizer),
        args=sft_args(tmp_path, noise_multiplier=None, target_epsilon=2.0, max_steps=3),
        train_dataset=prompt_completion(64, 0),
        processing_class=tokenizer,
    )
    trainer.train()
    assert trainer.privacy_spent()[0] <= 2.0


def test_numbers_vocabulary_is_in_the_tokenizer(tokenizer):
    assert all(tokenizer.convert_tokens_to_ids(word) != tokenizer.unk_token_id for word in NUMBERS)
