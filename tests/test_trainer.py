"""DPTrainer on tiny random models: learning, accounting, baseline equality, resume, budget, bad input."""

from __future__ import annotations

import math
import os

import datasets
import pytest
import torch
from dp_training import (
    SEQ,
    VOCAB,
    bert_classifier,
    classification_data,
    dp_args,
    pad_token_rows,
    params_of,
    train_losses,
)
from tiny_models import tiny_image_batch, tiny_vit_classifier
from transformers import (
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
    ViTConfig,
    ViTForImageClassification,
)

from dp_hf import DPTrainer, DPTrainingArguments
from dp_hf.accounting import compute_epsilon
from dp_hf.accounting.display import epsilon_for_logs
from dp_hf.optim import OPTIMIZERS, DPAdamW
from dp_hf.trainer.weights import saved_weight_renames


def test_bert_classifier_learns_and_logs_epsilon(tmp_path):
    data = classification_data(512)
    args = dp_args(
        tmp_path,
        per_device_train_batch_size=32,
        num_train_epochs=2,
        noise_multiplier=0.001,  # DP-Adam on a random tiny BERT is fragile; the noise itself is tested elsewhere
        logging_steps=2,
        accountant="rdp",  # PLD is slow at such tiny noise; the PLD path is checked by the other tests
    )
    trainer = DPTrainer(model=bert_classifier(), args=args, train_dataset=data)
    trainer.train()
    losses = train_losses(trainer)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    steps = trainer.state.global_step
    assert steps == trainer.planned_steps == 2 * round(512 / 64)
    assert trainer.accountant.steps == steps
    expected = compute_epsilon(64 / 512, 0.001, steps, trainer.delta, accountant="rdp")
    logged = [e for e in trainer.state.log_history if "epsilon" in e]
    assert logged and logged[-1]["epsilon"] == pytest.approx(expected, rel=1e-3)
    assert logged[-1]["epsilon"] >= expected  # rounded up, never below what was spent
    assert trainer.privacy_spent()[0] == pytest.approx(expected, rel=1e-9)
    assert trainer.delta < 1 / 512


@pytest.mark.parametrize("dp_optimizer", ["dp-sgd", "dp-adamw"])
def test_target_epsilon_is_calibrated_and_met(tmp_path, dp_optimizer):
    data = classification_data(128)
    args = dp_args(
        tmp_path, noise_multiplier=None, target_epsilon=2.0, max_steps=6, dp_optimizer=dp_optimizer
    )
    trainer = DPTrainer(model=bert_classifier(), args=args, train_dataset=data)
    assert trainer.noise_multiplier > 0
    trainer.train()
    epsilon, delta = trainer.privacy_spent()
    assert epsilon <= 2.0
    assert epsilon == pytest.approx(2.0, rel=0.05)
    assert trainer.state.global_step == 6


def test_disable_dp_matches_plain_trainer(tmp_path):
    data = classification_data(96)
    common = dict(
        per_device_train_batch_size=16,
        learning_rate=1e-3,
        weight_decay=0.01,
        max_steps=5,
        report_to="none",
        save_strategy="no",
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        max_grad_norm=0.0,
        optim="adamw_torch",
    )
    plain = Trainer(
        model=bert_classifier(),
        args=TrainingArguments(output_dir=str(tmp_path / "plain"), **common),
        train_dataset=data,
    )
    plain.train()
    ours = DPTrainer(
        model=bert_classifier(),
        args=DPTrainingArguments(
            output_dir=str(tmp_path / "ours"), disable_dp=True, dp_optimizer="dp-adamw", **common
        ),
        train_dataset=data,
    )
    ours.train()
    for (name, p), q in zip(plain.model.named_parameters(), ours.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_resume_gives_same_parameters_and_epsilon(tmp_path):
    data = classification_data(128)
    common = dict(max_steps=8, save_strategy="steps", save_steps=3, gradient_accumulation_steps=2)
    full = DPTrainer(model=bert_classifier(), args=dp_args(tmp_path / "full", **common), train_dataset=data)
    full.train()

    first = DPTrainer(model=bert_classifier(), args=dp_args(tmp_path / "cut", **common), train_dataset=data)
    first.train()
    checkpoint = os.path.join(tmp_path / "cut", "checkpoint-6")
    assert os.path.isfile(os.path.join(checkpoint, "dp_state.pt"))

    resumed = DPTrainer(
        model=bert_classifier(seed=123), args=dp_args(tmp_path / "cut", **common), train_dataset=data
    )
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.accountant.steps == full.accountant.steps == 8
    assert resumed.privacy_spent() == full.privacy_spent()
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def _image_data(n: int) -> datasets.Dataset:
    batch = tiny_image_batch(batch_size=n, seed=5)
    return datasets.Dataset.from_dict(
        {"pixel_values": batch["pixel_values"].tolist(), "labels": batch["labels"].tolist()}
    )


def test_resume_reads_weights_that_transformers_renames(tmp_path):
    """save_pretrained writes ViT's encoder under its Hub names (vit.encoder.layer.0...), which the Trainer's
    resume read without renaming: the encoder silently went on from the resumed model's initial weights."""
    assert saved_weight_renames(tiny_vit_classifier()) and not saved_weight_renames(bert_classifier())
    data = _image_data(32)
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, per_device_train_batch_size=8)
    full = DPTrainer(
        model=tiny_vit_classifier(), args=dp_args(tmp_path / "full", **common), train_dataset=data
    )
    full.train()
    DPTrainer(
        model=tiny_vit_classifier(), args=dp_args(tmp_path / "cut", **common), train_dataset=data
    ).train()
    checkpoint = os.path.join(tmp_path / "cut", "checkpoint-2")
    resumed = DPTrainer(
        model=tiny_vit_classifier(seed=123), args=dp_args(tmp_path / "cut", **common), train_dataset=data
    )
    resumed.train(resume_from_checkpoint=checkpoint)
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)

    # A checkpoint that lacks a weight of the model is refused, not loaded in part.
    from safetensors.torch import load_file, save_file

    weights = os.path.join(checkpoint, "model.safetensors")
    saved = load_file(weights)
    save_file({k: v for k, v in saved.items() if "classifier" not in k}, weights, metadata={"format": "pt"})
    again = DPTrainer(
        model=tiny_vit_classifier(), args=dp_args(tmp_path / "again", **common), train_dataset=data
    )
    with pytest.raises(
        RuntimeError, match=r"left 2 weight\(s\) unread \(classifier\.weight, classifier\.bias\)"
    ):
        again.train(resume_from_checkpoint=checkpoint)

    # Frozen weights never change: those a checkpoint does not hold (MoE experts that save_pretrained
    # splits; Marian's unsaved sinusoids) keep their values, as in the run that saved it.
    def frozen_head():
        model = tiny_vit_classifier()
        model.classifier.requires_grad_(False)
        return model

    DPTrainer(model=frozen_head(), args=dp_args(tmp_path / "frozen", **common), train_dataset=data).train()
    weights = os.path.join(tmp_path / "frozen", "checkpoint-2", "model.safetensors")
    saved = load_file(weights)
    save_file({k: v for k, v in saved.items() if "classifier" not in k}, weights, metadata={"format": "pt"})
    resumed = DPTrainer(model=frozen_head(), args=dp_args(tmp_path / "frozen", **common), train_dataset=data)
    resumed.train(resume_from_checkpoint=os.path.dirname(weights))
    assert resumed.state.global_step == 4


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_registered_optimizer_trains_through_the_trainer(tmp_path, name):
    """DPTrainer passed adam_epsilon to DP-AdamBC, whose parent takes eps but which sets it itself: the two BC
    rules could not be built at all (TypeError: multiple values for 'eps'). Adding an optimizer is adding a
    registry entry; this row then trains it."""
    trainer = DPTrainer(
        model=bert_classifier(),
        args=dp_args(tmp_path, max_steps=1, dp_optimizer=name),
        train_dataset=classification_data(32),
    )
    trainer.train()
    assert trainer.accountant.steps == 1 and trainer.dp_optimizer.dp_step == 1


def test_the_progress_bar_shows_the_exact_epsilon_when_the_budget_stops_training():
    """On a GPU the bar shows a value computed ahead (about a second old), exact only at max_steps: a run
    stopped by its budget ended showing 1.743 for 1.917 (an audit). The stop's step now sets the exact
    value too, rounded up like every shown epsilon."""
    from types import SimpleNamespace

    from transformers import TrainerControl

    from dp_hf.trainer.budget import PrivacyCallback

    shown = []
    bar = SimpleNamespace(set_postfix=lambda values, refresh=False: shown.append(values))
    trainer = SimpleNamespace(
        max_private_steps=8,
        accountant=SimpleNamespace(steps=8),
        privacy_spent=lambda: (1.9170001, 1e-5),
        epsilon_ahead=lambda: True,
        callback_handler=SimpleNamespace(callbacks=[SimpleNamespace(training_bar=bar)]),
        stopped_by_budget=False,
        args=SimpleNamespace(target_epsilon=2.0),
    )
    callback = PrivacyCallback(trainer)
    callback._last_bar_update, callback._bar_epsilon = float("inf"), None  # not due for a refresh
    state = SimpleNamespace(global_step=8, max_steps=12)
    control = callback.on_step_end(SimpleNamespace(disable_dp=False), state, TrainerControl())
    assert control.should_training_stop and trainer.stopped_by_budget
    assert shown == [{"epsilon": "1.918"}]


@pytest.mark.parametrize("ahead_on_a_worker", [False, True], ids=["cpu", "accelerator"])
@pytest.mark.parametrize("seconds_per_step", [0.02, 0.3, 1.5])
def test_the_progress_bar_never_shows_less_than_was_spent(monkeypatch, ahead_on_a_worker, seconds_per_step):
    """The bar was refreshed at most once a second with the epsilon of that moment, so it showed less than
    was spent until the next refresh (a newcomer saw 0.927 while the log line said 1.467). Now each shown
    value is the epsilon after the steps of about the next second, and is replaced once training passes
    them; the values are computed about once a second, not every step."""
    import concurrent.futures
    from types import SimpleNamespace

    from transformers import TrainerControl

    from dp_hf.trainer import budget

    clock = [100.0]
    monkeypatch.setattr(budget.time, "monotonic", lambda: clock[0])
    spent = lambda steps: 0.01 * steps**0.5  # noqa: E731  (increasing in the steps, as epsilon is)
    computed = []

    def epsilon_after(extra, sigma, q, delta):
        computed.append(extra)
        return spent(accountant.steps + extra)

    def prefetch_epsilon_after(extra, sigma, q, delta):
        future = concurrent.futures.Future()
        future.set_result(epsilon_after(extra, sigma, q, delta))
        return future

    shown = []
    bar = SimpleNamespace(set_postfix=lambda values, refresh=False: shown.append(float(values["epsilon"])))
    accountant = SimpleNamespace(
        steps=0, epsilon_after=epsilon_after, prefetch_epsilon_after=prefetch_epsilon_after
    )
    trainer = SimpleNamespace(
        max_private_steps=None,
        accountant=accountant,
        privacy_spent=lambda: (spent(accountant.steps), 1e-5),
        epsilon_ahead=lambda: ahead_on_a_worker,
        callback_handler=SimpleNamespace(callbacks=[SimpleNamespace(training_bar=bar)]),
        begin_private_training=lambda state: None,
        _prefetch_next_log_epsilon=lambda: None,
        noise_multiplier=1.0,
        sample_rate=0.01,
        delta=1e-5,
    )
    callback = budget.PrivacyCallback(trainer)
    args, steps = SimpleNamespace(disable_dp=False), 300
    state = SimpleNamespace(global_step=0, max_steps=steps)
    callback.on_train_begin(args, state, TrainerControl())
    for step in range(1, steps + 1):
        clock[0] += seconds_per_step
        accountant.steps = state.global_step = step
        callback.on_step_end(args, state, TrainerControl())
        assert shown and shown[-1] >= spent(step), f"step {step}: the bar shows {shown[-1]} < {spent(step)}"
    assert shown[-1] == math.ceil(spent(steps) * 1000) / 1000  # the last value is exact (rounded up)
    seconds = steps * seconds_per_step
    assert len(computed) <= 2 * (seconds + 1) + steps * (seconds_per_step >= 1)  # about once a second


@pytest.mark.slow
def test_budget_stop_never_exceeds_target(tmp_path):
    data = classification_data(128)
    common = dict(noise_multiplier=None, target_epsilon=1.0, save_strategy="steps", save_steps=2)
    first = DPTrainer(
        model=bert_classifier(), args=dp_args(tmp_path, max_steps=4, **common), train_dataset=data
    )
    first.train()
    assert first.privacy_spent()[0] <= 1.0
    assert first.state.global_step == 4

    # Resume from step 2 asking for 40 steps: the noise is calibrated for 40 fresh steps, but 2 steps were
    # already spent at the old noise, so the budget runs out first and training stops before exceeding it.
    resumed = DPTrainer(
        model=bert_classifier(),
        args=dp_args(tmp_path / "resumed", max_steps=40, **common),
        train_dataset=data,
    )
    resumed.train(resume_from_checkpoint=os.path.join(tmp_path, "checkpoint-2"))
    assert resumed.stopped_by_budget
    steps = resumed.accountant.steps
    assert 2 < steps < 40 and resumed.state.global_step == steps
    assert resumed.privacy_spent()[0] <= 1.0
    one_more = resumed.accountant.epsilon_after(
        1, resumed.noise_multiplier, resumed.sample_rate, resumed.delta
    )
    assert one_more > 1.0

    # A budget smaller than what the checkpoint already spent: refuse to train at all.
    smaller = dict(common, target_epsilon=0.9)
    exhausted = DPTrainer(
        model=bert_classifier(),
        args=dp_args(tmp_path / "exhausted", max_steps=40, **smaller),
        train_dataset=data,
    )
    with pytest.raises(RuntimeError, match="budget is spent"):
        exhausted.train(resume_from_checkpoint=os.path.join(tmp_path, "checkpoint-4"))


def test_evaluation_costs_no_privacy(tmp_path):
    data = classification_data(64)
    trainer = DPTrainer(
        model=bert_classifier(), args=dp_args(tmp_path, max_steps=2), train_dataset=data, eval_dataset=data
    )
    trainer.train()
    before = trainer.privacy_spent()
    metrics = trainer.evaluate()
    trainer.predict(data)
    assert "eval_loss" in metrics and math.isfinite(metrics["eval_loss"])
    assert trainer.privacy_spent() == before
    assert trainer.accountant.steps == 2


@pytest.mark.slow
def test_masked_lm_learns(tmp_path):
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForMaskedLM(config)
    g = torch.Generator().manual_seed(0)
    # Repetitive sequences: the masked token equals its neighbours.
    tokens = torch.randint(5, VOCAB, (256, 1), generator=g).repeat(1, SEQ)
    data = datasets.Dataset.from_dict({"input_ids": tokens.tolist()})

    class Tok:  # the minimal tokenizer interface DataCollatorForLanguageModeling needs
        mask_token = "[MASK]"
        mask_token_id = 4
        pad_token_id = 0
        all_special_ids = [0, 1, 2, 3, 4]

        def __len__(self):
            return VOCAB

        def pad(self, features, return_tensors="pt", **kwargs):
            return {"input_ids": torch.tensor([f["input_ids"] for f in features])}

        def get_special_tokens_mask(self, ids, already_has_special_tokens=True):
            return [0] * len(ids)

        def convert_tokens_to_ids(self, token):
            return 4

    collator = DataCollatorForLanguageModeling(
        Tok(), mlm_probability=0.3
    )  # masks from the reseeded torch RNG
    args = dp_args(tmp_path, num_train_epochs=6, learning_rate=1e-2, noise_multiplier=0.01, accountant="rdp")
    trainer = DPTrainer(model=model, args=args, train_dataset=data, data_collator=collator)

    def masked_loss() -> float:  # every sequence with its middle token masked: a fixed evaluation
        masked = tokens.clone()
        masked[:, SEQ // 2] = Tok.mask_token_id
        labels = torch.full_like(tokens, -100)
        labels[:, SEQ // 2] = tokens[:, SEQ // 2]
        with torch.no_grad():
            return model(input_ids=masked, labels=labels).loss.item()

    before = masked_loss()
    trainer.train()
    after = masked_loss()
    # 3.69 -> 2.58-3.18 for four (noise, sampling) seed pairs; the per-step training losses of ~8
    # sequences scatter by ~0.6 and compared runs' first and last steps by chance.
    assert after < before - 0.3, (before, after)


def test_gpt2_lora_causal_lm_learns(tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = get_peft_model(
        GPT2LMHeadModel(config),
        LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True),
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora" in n for n in trainable)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    # Sequences counting upwards: next token = previous + 1.
    starts = torch.randint(5, VOCAB - SEQ, (256, 1), generator=torch.Generator().manual_seed(0))
    ids = starts + torch.arange(SEQ)
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = dp_args(tmp_path, num_train_epochs=4, learning_rate=2e-2, noise_multiplier=0.01, accountant="rdp")
    trainer = DPTrainer(model=model, args=args, train_dataset=data)

    def loss_on_all() -> float:  # per-step training losses of ~8 sequences scatter too much to compare
        with torch.no_grad():
            return model(input_ids=ids, labels=ids).loss.item()

    before = loss_on_all()
    trainer.train()
    after = loss_on_all()
    assert after < before - 0.1, (before, after)  # 3.73 -> 3.51 for each of four sampling seeds tried
    for n, p in model.named_parameters():
        if n in frozen_before:
            assert torch.equal(p, frozen_before[n]), n


def test_vit_image_classifier_learns(tmp_path):
    torch.manual_seed(0)
    config = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=1,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=37,
        num_labels=2,
    )
    model = ViTForImageClassification(config)
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (256,), generator=g)
    pixels = torch.randn(256, 1, 8, 8, generator=g) * 0.3 + labels.view(-1, 1, 1, 1).float() * 2 - 1
    data = datasets.Dataset.from_dict(
        {"pixel_values": pixels.tolist(), "labels": labels.tolist()}
    ).with_format("torch")
    args = dp_args(tmp_path, num_train_epochs=3, learning_rate=1e-2, noise_multiplier=0.01, accountant="rdp")
    trainer = DPTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = train_losses(trainer)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses


def test_partly_frozen_bert_trains_only_unfrozen(tmp_path):
    model = bert_classifier()
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith(("bert.encoder.layer.1.", "bert.pooler", "classifier"))
    before = params_of(model)
    trainer = DPTrainer(
        model=model, args=dp_args(tmp_path, max_steps=3), train_dataset=classification_data(64)
    )
    trainer.train()
    for name, p in model.named_parameters():
        changed = not torch.equal(p, before[name])
        assert changed == p.requires_grad, name


# ---------------------------------------------------------------------------- bad input


class NoLength(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield {"input_ids": [2, 5], "labels": 0}


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(noise_multiplier=None), "exactly one of target_epsilon and noise_multiplier"),
        (dict(target_epsilon=3.0), "exactly one of target_epsilon and noise_multiplier"),
        (dict(noise_multiplier=None, target_epsilon=-1.0), "-1.0"),
        (dict(fp16=True), "fp16"),
        (dict(dp_optimizer="adam"), "'adam'"),
        (dict(accountant="gdp"), "'gdp'"),
        (dict(per_sample_max_grad_norm=0.0), "per_sample_max_grad_norm"),
        (dict(per_sample_max_grad_norm=1e-30), "per_sample_max_grad_norm = 1e-30 is below 2"),
        (dict(max_grad_norm=0.5), "per_sample_max_grad_norm"),
        (dict(target_delta=1.5), "1.5"),
        (dict(dp_max_physical_batch_size=0), "dp_max_physical_batch_size=0"),
        (dict(dp_max_physical_batch_size=2.5), "dp_max_physical_batch_size=2.5"),
        (dict(dataloader_in_order=False), "dataloader_in_order=False"),
    ],
)
def test_bad_arguments_fail_before_training(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        dp_args(tmp_path, **overrides)


def test_loader_workers_train_the_same_batches(tmp_path):
    """The Trainer's loader options reach the Poisson loader, and worker processes change no batch."""
    data = classification_data(48)
    common = dict(max_steps=5, noise_seed=3, sampling_seed=4)  # 5 steps: past the first epoch (3 steps)
    alone = DPTrainer(model=bert_classifier(), args=dp_args(tmp_path / "a", **common), train_dataset=data)
    alone.train()
    workers = dict(dataloader_num_workers=1, dataloader_persistent_workers=True, dataloader_prefetch_factor=3)
    pooled = DPTrainer(
        model=bert_classifier(), args=dp_args(tmp_path / "b", **common, **workers), train_dataset=data
    )
    loader = pooled.get_train_dataloader()
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor) == (1, True, 3)
    pooled.train()
    assert pooled.accountant.steps == alone.accountant.steps == 5
    for (name, p), q in zip(alone.model.named_parameters(), pooled.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_dataset_without_length_is_refused(tmp_path):
    with pytest.raises(ValueError, match="length"):
        DPTrainer(model=bert_classifier(), args=dp_args(tmp_path, max_steps=2), train_dataset=NoLength())


def test_batchnorm_model_is_refused(tmp_path):
    model = bert_classifier()
    model.classifier = torch.nn.Sequential(torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 2))
    with pytest.raises(ValueError, match="BatchNorm"):
        DPTrainer(model=model, args=dp_args(tmp_path), train_dataset=classification_data(64))


def test_non_dp_optimizer_is_refused(tmp_path):
    model = bert_classifier()
    with pytest.raises(TypeError, match="not a DP optimizer"):
        DPTrainer(
            model=model,
            args=dp_args(tmp_path),
            train_dataset=classification_data(64),
            optimizers=(torch.optim.AdamW(model.parameters()), None),
        )


def test_dp_optimizer_can_be_passed_in(tmp_path):
    model = bert_classifier()
    data = classification_data(64)
    optimizer = DPAdamW(
        model.parameters(), lr=1e-3, noise_multiplier=0.3, max_grad_norm=1.0, expected_batch_size=32
    )
    trainer = DPTrainer(
        model=model, args=dp_args(tmp_path, max_steps=2), train_dataset=data, optimizers=(optimizer, None)
    )
    trainer.train()
    assert optimizer.dp_step == 2 == trainer.accountant.steps


def test_batch_larger_than_dataset_is_refused(tmp_path):
    with pytest.raises(ValueError, match="exceeds the dataset size"):
        DPTrainer(model=bert_classifier(), args=dp_args(tmp_path), train_dataset=classification_data(16))


def test_shuffled_batches_warn(tmp_path):
    with pytest.warns(UserWarning, match="overstates the privacy"):
        DPTrainer(
            model=bert_classifier(),
            args=dp_args(tmp_path, poisson_sampling=False),
            train_dataset=classification_data(64),
        )


def test_fsdp_and_deepspeed_are_refused(tmp_path):
    with pytest.raises(ValueError, match="FSDP"):
        dp_args(tmp_path, fsdp="full_shard")


@pytest.mark.parametrize(
    "noise_multiplier, max_grad_norm, message",
    [
        (0.1, 1.0, r"noise_multiplier 0.1"),
        # Sigma and B were compared, C was not: an optimizer clipping to 10 C trained under the plan's epsilon.
        (0.3, 10.0, r"max_grad_norm 10.0 \(plan: 1.0\)"),
    ],
)
def test_hand_built_optimizer_must_match_the_plan(tmp_path, noise_multiplier, max_grad_norm, message):
    model = bert_classifier()
    optimizer = DPAdamW(
        model.parameters(),
        lr=1e-3,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        expected_batch_size=32,
    )
    trainer = DPTrainer(
        model=model,
        args=dp_args(tmp_path, max_steps=2),
        train_dataset=classification_data(64),
        optimizers=(optimizer, None),
    )
    with pytest.raises(ValueError, match=message):
        trainer.train()
    assert optimizer.dp_step == 0


def test_pickled_arguments_hold_no_secrets(tmp_path):
    import pickle

    args = dp_args(tmp_path, hub_token="hf_SECRET_TOKEN", noise_seed=12345, sampling_seed=678)
    blob = pickle.dumps(args)
    assert b"hf_SECRET_TOKEN" not in blob
    restored = pickle.loads(blob)
    assert restored.noise_seed is None and restored.sampling_seed is None and restored.hub_token is None
    assert args.noise_seed == 12345  # the live object is untouched


def test_checkpoint_push_is_refused(tmp_path):
    with pytest.raises(ValueError, match="noise"):
        dp_args(tmp_path, push_to_hub=True, hub_strategy="checkpoint", hub_model_id="me/model")


@pytest.mark.parametrize("disable_dp", [False, True])
def test_macadam_from_trainer_arguments(tmp_path, disable_dp):
    # DP-MacAdam fixes its clip norm to 1: a user's per_sample_max_grad_norm must not break it.
    overrides = dict(dp_optimizer="dp-macadam", per_sample_max_grad_norm=0.1, max_steps=2)
    if disable_dp:
        overrides.update(disable_dp=True, noise_multiplier=None)
    trainer = DPTrainer(
        model=bert_classifier(), args=dp_args(tmp_path, **overrides), train_dataset=classification_data(64)
    )
    trainer.train()
    assert trainer.dp_optimizer.max_grad_norm == 1.0
    assert trainer.dp_optimizer.dp_step == 2


def test_collator_that_mixes_examples_is_refused(tmp_path):
    from transformers import default_data_collator

    def centering_collator(features):
        # Subtracts the batch mean of the labels' one-hot from every row: couples examples.
        batch = default_data_collator(features)
        batch["attention_mask"] = (
            batch["attention_mask"] - batch["attention_mask"].float().mean(0).round().long() + 1
        )
        batch["input_ids"] = (batch["input_ids"] + batch["input_ids"].sum(0, keepdim=True)) % VOCAB
        return batch

    trainer = DPTrainer(
        model=bert_classifier(),
        args=dp_args(tmp_path, max_steps=1),
        train_dataset=classification_data(64),
        data_collator=centering_collator,
    )
    with pytest.raises(ValueError, match="mixes examples"):
        trainer.train()


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_collator_is_accepted_on_the_right(side):
    from transformers import DataCollatorWithPadding

    from dp_hf.batches import check_collator_is_per_example

    class Pad:
        padding_side = side
        pad_token_id = 0
        model_input_names = ["input_ids", "attention_mask"]

        def pad(self, features, return_tensors="pt", **kwargs):
            return pad_token_rows(features, side)

    features = [{"input_ids": [5, 6, 7]}, {"input_ids": [8]}, {"input_ids": [9, 10]}]
    if side == "right":
        check_collator_is_per_example(DataCollatorWithPadding(Pad()), features)
        return
    # Left padding moves an example's tokens with its batch's longest one (absolute position embeddings).
    with pytest.raises(ValueError, match="pads on the left"):
        check_collator_is_per_example(DataCollatorWithPadding(Pad()), features)


def test_calibrated_run_needs_no_budget_search(tmp_path, monkeypatch):
    # With target_epsilon the noise is calibrated for the planned steps, so the plan is within the budget:
    # the trainer checks that one (cached) epsilon instead of searching the largest step count (~0.5 s).
    import dp_hf.trainer.budget as budget

    def no_search(*args, **kwargs):
        raise AssertionError("the budget search ran for a run that fits its plan")

    monkeypatch.setattr(budget, "steps_within_budget", no_search)
    args = dp_args(tmp_path, noise_multiplier=None, target_epsilon=2.0, max_steps=3)
    trainer = DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(64))
    trainer.train()
    assert trainer.max_private_steps == trainer.planned_steps == 3 == trainer.accountant.steps
    assert not trainer.stopped_by_budget and trainer.privacy_spent()[0] <= 2.0


def test_log_lines_take_their_epsilon_computed_ahead(tmp_path, monkeypatch):
    """Each log line's epsilon is the exact PLD value at its step, computed on the accounting's worker
    thread while the steps before it trained (or found in the cache), never twice (and the final
    summary line, at the last logging step, is the same value)."""
    import threading

    from dp_hf import accounting

    computed = []  # (thread, steps) of every epsilon computation
    compute = accounting.epsilon._epsilon

    def spy(name, history, delta, coarsening):
        computed.append((threading.current_thread().name, sum(entry[2] for entry in history)))
        return compute(name, history, delta, coarsening)

    accounting.epsilon.epsilon_of_history.cache_clear()
    monkeypatch.setattr(accounting.epsilon, "_epsilon", spy)
    monkeypatch.setattr(DPTrainer, "epsilon_ahead", lambda self: True)  # by default on accelerators only
    args = dp_args(tmp_path, noise_multiplier=1.0, max_steps=6, logging_steps=2)
    trainer = DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(128))
    trainer.train()
    logged = {e["step"]: e["epsilon"] for e in trainer.state.log_history if "loss" in e}
    assert sorted(logged) == [2, 4, 6]
    for step, epsilon in logged.items():
        assert epsilon == epsilon_for_logs(compute_epsilon(trainer.sample_rate, 1.0, step, trainer.delta))
    # 6 (the plan's epsilon, printed before training) here; 2 and 4 ahead; 6 again is a cache hit
    assert sorted(computed) == [("MainThread", 6), ("dp_hf-epsilon_0", 2), ("dp_hf-epsilon_0", 4)], computed
    assert trainer.state.log_history[-1]["epsilon"] == logged[6]


def test_epsilon_is_computed_when_asked_on_the_cpu(tmp_path, monkeypatch):
    """Training on the CPU: no epsilon computed ahead (the cores train), each log line's own."""
    import threading

    from dp_hf import accounting

    threads = []
    compute = accounting.epsilon._epsilon

    def spy(*args):
        threads.append(threading.current_thread().name)
        return compute(*args)

    accounting.epsilon.epsilon_of_history.cache_clear()
    monkeypatch.setattr(accounting.epsilon, "_epsilon", spy)
    args = dp_args(tmp_path, noise_multiplier=1.0, max_steps=4, logging_steps=2)
    trainer = DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(128))
    trainer.train()
    assert not trainer.epsilon_ahead()
    assert threads == ["MainThread"] * 2  # the plan's (step 4's, then cached) and step 2's


def test_a_batchnorm_in_eval_mode_is_refused_by_the_trainer_too(tmp_path):
    # validate_model accepts a frozen BatchNorm in eval mode (an own loop can keep it there); the Trainer puts
    # the model in train mode at every step, where it would use batch statistics and update its running ones.
    model = bert_classifier()
    model.classifier = torch.nn.Sequential(torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 2))
    model.classifier[0].requires_grad_(False)
    model.classifier[0].eval()
    with pytest.raises(
        ValueError, match=r"classifier\.0 \(BatchNorm1d\): BatchNorm is not supported by DPTrainer"
    ):
        DPTrainer(model=model, args=dp_args(tmp_path), train_dataset=classification_data(64))
