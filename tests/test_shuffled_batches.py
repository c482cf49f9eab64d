"""``poisson_sampling=False``: shuffled batches whose order only the secret sampling seed decides.

The Trainer's shuffle followed the public ``seed`` / ``data_seed`` (logged with the arguments), so
anyone could recompute which examples shared each step; these tests train and read the batches.
"""

from __future__ import annotations

import os

import pytest
import torch

from dp_hf import DPTrainer
from dp_hf.shuffling import SecretShuffleSampler
from tests.dp_training import bert_classifier, classification_data, dp_args

pytestmark = pytest.mark.filterwarnings("ignore:Training with shuffled fixed-size batches")

N, BATCH = 24, 8


def train_and_record(
    output_dir, resume_from_checkpoint=None, **overrides
) -> tuple[DPTrainer, list[list[int]]]:
    """Train on N indexed examples (2 epochs of N / BATCH steps); the example indices of every step."""
    data = classification_data(N).map(lambda _, i: {"idx": i}, with_indices=True)
    settings = dict(
        poisson_sampling=False,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
        num_train_epochs=2,
        remove_unused_columns=False,
    )
    trainer = DPTrainer(
        model=bert_classifier(), args=dp_args(output_dir, **{**settings, **overrides}), train_dataset=data
    )
    seen: list[list[int]] = []
    step = trainer.training_step

    def record(model, inputs, num_items_in_batch=None):
        seen.append(inputs.pop("idx").tolist())
        return step(model, inputs, num_items_in_batch)

    trainer.training_step = record
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer, seen


def test_the_order_follows_the_secret_seed_not_the_public_ones(tmp_path):
    _, secret_2 = train_and_record(tmp_path / "a", sampling_seed=2, seed=0)
    _, public_changed = train_and_record(tmp_path / "b", sampling_seed=2, seed=5, data_seed=7)
    _, secret_3 = train_and_record(tmp_path / "c", sampling_seed=3, seed=0)
    assert secret_2 == public_changed
    assert secret_2 != secret_3
    # Each epoch is a permutation of the whole dataset, and the two epochs are shuffled differently.
    per_epoch = N // BATCH
    epochs = [sum(secret_2[k * per_epoch : (k + 1) * per_epoch], []) for k in range(2)]
    assert [sorted(epoch) for epoch in epochs] == [list(range(N))] * 2
    assert epochs[0] != epochs[1]


def test_a_resumed_run_trains_the_batches_of_an_uninterrupted_one(tmp_path):
    common = dict(save_strategy="steps", save_steps=2)
    full, full_batches = train_and_record(tmp_path / "full", **common)
    train_and_record(tmp_path / "cut", **common)
    checkpoint = os.path.join(tmp_path / "cut", "checkpoint-4")  # mid-way through the second epoch
    # A fresh secret seed here: the checkpoint's seed must replace it, or the skipped batches of the epoch
    # would not be the ones trained before the interruption.
    resumed, resumed_batches = train_and_record(
        tmp_path / "cut", resume_from_checkpoint=checkpoint, sampling_seed=None, **common
    )
    assert resumed_batches == full_batches[4:]
    assert resumed.privacy_spent() == full.privacy_spent()
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_the_sampler_alone():
    sampler = SecretShuffleSampler(10, seed=7)
    first = list(sampler)
    assert sorted(first) == list(range(10)) and len(sampler) == 10
    assert list(sampler) == first  # the same epoch, the same order
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first
    restored = SecretShuffleSampler(10, seed=123)
    restored.load_state_dict(sampler.state_dict())
    assert list(restored) == second
    with pytest.raises(ValueError, match="dataset_size"):
        SecretShuffleSampler(0, seed=1)


def test_a_resume_that_would_replay_the_epochs_first_batches_is_refused(tmp_path):
    with pytest.raises(ValueError, match="ignore_data_skip=True with poisson_sampling=False"):
        dp_args(tmp_path, poisson_sampling=False, ignore_data_skip=True)
    dp_args(tmp_path, ignore_data_skip=True)  # Poisson batches are never replayed (test_privacy_holes)


@pytest.mark.parametrize(
    "settings, steps",
    [
        (
            dict(per_device_train_batch_size=8, gradient_accumulation_steps=1),
            9,
        ),  # 68 = 8 x 8 + 4: a short batch
        (dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, dataloader_drop_last=True), 8),
        (dict(per_device_train_batch_size=4, gradient_accumulation_steps=2), 9),  # 17 batches of 4
        (dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, disable_dp=True), 9),
    ],
)
def test_an_epoch_of_shuffled_batches_is_planned_as_the_trainer_runs_it(tmp_path, settings, steps):
    # The plan counted round(N / B) steps per epoch, the Poisson sampler's: with 68 examples in batches of 8
    # the Trainer runs 9 and the run was refused ("the Trainer plans 9 steps but the privacy plan has 8").
    if settings.get("disable_dp"):
        settings = dict(settings, noise_multiplier=None)
    args = dp_args(tmp_path, poisson_sampling=False, num_train_epochs=1, **settings)
    trainer = DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(68))
    assert trainer.planned_steps == steps
    trainer.train()
    assert trainer.state.global_step == trainer.accountant.steps == steps
