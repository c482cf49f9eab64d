"""DPTrainer refuses a model whose forward updates a buffer from the data (dp_hf/trainer/buffers.py).

A buffer is saved with the model and read by its forward, without noise: a running mean of the inputs
written as tensor ops would publish a statistic of the training set. BatchNorm and InstanceNorm with
running statistics are refused by type; these are the user's own buffers, found by running the forward
on two examples from the same buffer values.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dp_hf import DPTrainer
from dp_hf.trainer.buffers import check_buffers_ignore_the_data
from tests.dp_training import VOCAB, bert_classifier, classification_data, dp_args, params_of

REFUSAL = "updates buffer"


class _Classifier(nn.Module):
    """Embedding, mean over tokens, a Linear head; ``update`` says how forward touches its buffer."""

    def __init__(self, update: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, 2)
        self.update = update
        self.register_buffer("running_mean", torch.zeros(16))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.embed(input_ids).mean(dim=1)
        if self.training and self.update == "in_place":  # a running mean written as tensor ops
            self.running_mean.mul_(0.9).add_(0.1 * h.detach().mean(dim=0))
        elif self.training and self.update == "replaced":
            self.running_mean = 0.9 * self.running_mean + 0.1 * h.detach().mean(dim=0)
        elif self.training and self.update == "counter":  # data-independent: allowed
            self.steps += 1
        return {"logits": self.head(h - self.running_mean)}


def _cross_entropy(outputs, labels, inputs):
    return nn.functional.cross_entropy(outputs["logits"], labels, reduction="none")


def _trainer(model, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPTrainer(
            model=model,
            args=dp_args(tmp_path, max_steps=2, per_device_train_batch_size=8),
            train_dataset=classification_data(64),
            per_example_loss_fn=_cross_entropy,
        )


@pytest.mark.parametrize("update", ["in_place", "replaced"])
def test_a_buffer_updated_from_the_data_is_refused_before_the_first_step(tmp_path, update):
    model = _Classifier(update)
    before = params_of(model)
    trainer = _trainer(model, tmp_path)
    with pytest.raises(ValueError, match=rf"{REFUSAL}\(s\) running_mean from its input"):
        trainer.train()
    assert trainer.dp_optimizer.dp_step == 0
    for name, value in params_of(model).items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("update", ["in_place", "replaced"])
def test_the_buffer_probe_gives_a_refused_buffer_its_value_and_tensor_back(update):
    model = _Classifier(update).train()
    original = model.running_mean
    batch = {"input_ids": torch.randint(0, VOCAB, (4, 8))}

    def losses(m, inputs):
        return m(**inputs)["logits"].sum(dim=1)

    with pytest.raises(ValueError, match=REFUSAL):
        check_buffers_ignore_the_data(losses, model, batch, torch.enable_grad)
    assert model.running_mean is original and torch.equal(original, torch.zeros(16))


@pytest.mark.parametrize("update", ["counter", "none"])
def test_data_independent_or_eval_only_buffers_train(tmp_path, update):
    model = _Classifier(update)
    trainer = _trainer(model, tmp_path)
    trainer.train()
    assert trainer.dp_optimizer.dp_step == 2


def test_the_probe_leaves_bert_and_its_random_state_as_they_were(tmp_path):
    # BERT's buffers (position ids, token type ids) are constants: it passes, and its buffers, modes and the
    # random state after the probe are those before it.
    model = bert_classifier()
    model.train()
    batch = next(iter(torch.utils.data.DataLoader(classification_data(8).with_format("torch"), batch_size=8)))
    batch = {k: v for k, v in batch.items() if k != "labels"}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    state = torch.random.get_rng_state()

    def losses(m, inputs):
        return m(**inputs).logits.sum(dim=1)

    assert check_buffers_ignore_the_data(losses, model, batch, torch.enable_grad)
    assert torch.equal(torch.random.get_rng_state(), state)
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name
    assert model.training
    assert not check_buffers_ignore_the_data(
        losses, model, {k: v[:1] for k, v in batch.items()}, torch.enable_grad
    )
