"""Forward/backward passes per DP step: the Poisson slack of the default physical batch, and the hard cap."""

from __future__ import annotations

import math

import pytest
from dp_training import bert_classifier, classification_data, dp_args

from dp_hf import DPTrainer
from dp_hf.training_args import default_physical_batch_size


class PassCounter:
    """Forward pre-hook recording the batch size of every training forward pass."""

    def __init__(self, model) -> None:
        self.sizes: list[int] = []
        model.register_forward_pre_hook(self, with_kwargs=True)

    trainer = None  # its one-time probes' forward passes (on 1 and 2 examples) are not training passes

    def __call__(self, module, args, kwargs) -> None:
        if module.training and not (self.trainer is not None and self.trainer._probing_losses):
            self.sizes.append(int(kwargs["input_ids"].shape[0]))


@pytest.mark.parametrize("batch, expected", [(1, 3), (4, 8), (16, 24), (64, 80), (100, 120)])
def test_default_physical_batch_is_two_standard_deviations_above_the_mean(batch, expected):
    assert default_physical_batch_size(batch) == expected
    # The probability that a Poisson(b) draw exceeds the default is small: few steps need two passes.
    tail = 1 - sum(math.exp(-batch) * batch**k / math.factorial(k) for k in range(expected + 1))
    assert tail < 0.03


def run(tmp_path, **overrides):
    model = bert_classifier()
    counter = PassCounter(model)
    args = dp_args(tmp_path, gradient_accumulation_steps=1, per_device_train_batch_size=16, **overrides)
    trainer = counter.trainer = DPTrainer(model=model, args=args, train_dataset=classification_data(256))
    trainer.train()
    return trainer, counter.sizes


def test_default_takes_about_one_pass_per_step(tmp_path):
    trainer, sizes = run(tmp_path, max_steps=40)
    steps = trainer.state.global_step
    assert steps == 40
    # Capping passes at the mean (the former behaviour) split about half of the steps in two.
    assert len(sizes) / steps <= 1.1, (len(sizes), steps)
    assert max(sizes) <= default_physical_batch_size(16)
    assert "at most 24 examples per forward/backward pass" in trainer.privacy_plan_text()


def test_hard_cap_splits_every_larger_draw(tmp_path):
    trainer, sizes = run(tmp_path, max_steps=20, dp_max_physical_batch_size=5)
    assert max(sizes) <= 5
    # 20 steps of ~16 examples need at least 4 passes each: the cap binds, the examples are all trained.
    assert len(sizes) >= 3 * 20
    assert trainer.state.global_step == 20
