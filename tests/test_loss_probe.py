"""The once-per-run check that each example's loss depends on that example only (dp_hf.trainer.probe)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from dp_hf import DPTrainer
from dp_hf.trainer.probe import check_losses_are_per_example
from tests.dp_training import bert_classifier, classification_data, dp_args, params_of


def divided_by_batch_size(outputs, labels, inputs):
    # A realized batch size in a denominator: each example's loss depends on how many came with it.
    return F.cross_entropy(outputs.logits, labels, reduction="none") / labels.shape[0]


def in_batch_negatives(outputs, labels, inputs):
    # Each example's loss is contrasted against the others' logits (a contrastive-style coupling).
    logits = outputs.logits
    return F.cross_entropy(logits, labels, reduction="none") + torch.logsumexp(logits[:, 0], dim=0)


@pytest.mark.parametrize("loss_fn", [divided_by_batch_size, in_batch_negatives])
def test_a_coupled_loss_is_refused_before_any_step(tmp_path, loss_fn):
    model = bert_classifier()
    before = params_of(model)
    trainer = DPTrainer(
        model=model,
        args=dp_args(tmp_path, max_steps=2),
        train_dataset=classification_data(64),
        per_example_loss_fn=loss_fn,
    )
    with pytest.raises(ValueError, match="the per-example losses depend on the other examples"):
        trainer.train()
    assert trainer.accountant.steps == 0
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0, msg=name)
    assert model.training  # the probe's eval mode was undone


def test_a_per_example_loss_trains(tmp_path):
    trainer = DPTrainer(
        model=bert_classifier(),
        args=dp_args(tmp_path, max_steps=2),
        train_dataset=classification_data(64),
        per_example_loss_fn=lambda outputs, labels, inputs: F.cross_entropy(
            outputs.logits, labels, reduction="none"
        ),
    )
    trainer.train()
    assert trainer._losses_checked and trainer.accountant.steps == 2


def _linear_losses(model, inputs):
    return model(inputs["x"]).sum(dim=1)


def test_the_probe_itself():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Dropout(0.5))
    model.train()
    inputs = {"x": torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), "labels": torch.zeros(5)}
    # Dropout is off during the probe (eval mode), so a per-example model passes, and train mode returns.
    assert check_losses_are_per_example(_linear_losses, model, inputs, contextlib.nullcontext) is True
    assert model.training
    # Fewer than two examples: nothing to compare, the caller tries the next micro-batch.
    assert (
        check_losses_are_per_example(_linear_losses, model, {"x": torch.randn(1, 3)}, contextlib.nullcontext)
        is False
    )

    def coupled(model, inputs):
        out = model(inputs["x"]).sum(dim=1)
        return out + out.mean()

    with pytest.raises(ValueError, match="example 0: .* in its micro-batch of 5, .* alone"):
        check_losses_are_per_example(coupled, model, inputs, contextlib.nullcontext)
    assert model.training

    def nan_for_example_0(model, inputs):
        # e.g. a token loss over no labelled token: NaN together and alone, which is not a coupling
        out = model(inputs["x"]).sum(dim=1)
        return torch.where(inputs["x"][:, 0] > 5, torch.nan, out)

    inputs["x"][0, 0] = 10.0
    assert check_losses_are_per_example(nan_for_example_0, model, inputs, contextlib.nullcontext) is True
    # Both compared examples NaN: equal, but nothing was compared, so not counted as checked.
    inputs["x"][-1, 0] = 10.0
    assert check_losses_are_per_example(nan_for_example_0, model, inputs, contextlib.nullcontext) is False


def test_the_probe_changes_nothing_in_training(tmp_path, monkeypatch):
    # Same seeds with and without the probe: the same parameters, bit for bit. With dropout on, any draw
    # of the probe from torch's generator would change the training's dropout masks.
    def run(name):
        trainer = DPTrainer(
            model=bert_classifier(hidden_dropout_prob=0.1),
            args=dp_args(tmp_path / name, max_steps=3),
            train_dataset=classification_data(64),
        )
        trainer.train()
        return trainer.model

    probed = run("probed")
    monkeypatch.setattr("dp_hf.trainer.step.check_losses_are_per_example", lambda *args: True)
    unprobed = run("unprobed")
    for (name, p), q in zip(probed.named_parameters(), unprobed.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


class _CentersInTrainMode(torch.nn.Module):
    # Parameter-free batch centering, only while training (BatchNorm's coupling without its class, like an
    # MoE router's train-only expert capacity): a no-op in eval mode, where the probe used to run.
    def forward(self, x):
        return x - x.mean(0, keepdim=True) if self.training else x


class _TinyClassifier(torch.nn.Module):
    def __init__(self, center: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(40, 16)
        torch.nn.init.normal_(self.emb.weight, std=10.0)  # logits far from 0: a visible coupling
        self.lin = torch.nn.Linear(16, 16)
        self.center = _CentersInTrainMode() if center else torch.nn.Identity()
        self.drop = torch.nn.Dropout(0.5)  # dropout must not make an honest model fail the probe
        self.out = torch.nn.Linear(16, 2)

    def forward(self, input_ids, attention_mask=None):
        h = self.drop(self.lin(self.emb(input_ids).mean(1)))
        h = F.dropout(h, 0.3, self.training)  # functional dropout: same draws in both probe passes
        return {"logits": self.out(self.center(h))}


def _cross_entropy(outputs, labels, inputs):
    return F.cross_entropy(outputs["logits"], labels, reduction="none")


@pytest.mark.parametrize("center", [False, True])
def test_a_train_mode_only_coupling_is_refused(tmp_path, center):
    model = _TinyClassifier(center)
    before = params_of(model)
    trainer = DPTrainer(
        model=model,
        args=dp_args(tmp_path, max_steps=1, remove_unused_columns=False),
        train_dataset=classification_data(64),
        per_example_loss_fn=_cross_entropy,
    )
    if not center:
        trainer.train()
        assert trainer._losses_checked and trainer.accountant.steps == 1
        return
    with pytest.raises(ValueError, match="in train mode the per-example losses depend on the other examples"):
        trainer.train()
    assert trainer.accountant.steps == 0
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0, msg=name)
    assert model.training and model.drop.training  # every module's mode is back


def test_the_train_mode_probe_keeps_modes_and_random_state():
    model = _TinyClassifier(center=False)
    model.lin.eval()  # a module the user keeps in eval mode stays so
    inputs = {"input_ids": torch.randint(0, 40, (6, 5), generator=torch.Generator().manual_seed(1))}

    def losses(model, inputs):
        return model(inputs["input_ids"])["logits"].sum(dim=1) * 10.0

    state = torch.get_rng_state()
    for _ in range(3):  # deterministic: dropout never makes an honest model fail
        assert check_losses_are_per_example(losses, model, inputs, contextlib.nullcontext) is True
    assert torch.equal(torch.get_rng_state(), state)
    assert model.training and model.drop.training and not model.lin.training
    model.center = _CentersInTrainMode()
    with pytest.raises(ValueError, match="copies of itself"):
        check_losses_are_per_example(losses, model, inputs, contextlib.nullcontext)
    assert model.training and model.drop.training and not model.lin.training
