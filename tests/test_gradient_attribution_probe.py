"""The once-per-run check that the clipping credits each example its own gradient (dp_hf.trainer.probe).

A forward that moves rows of the batch and moves them back (``flip(0)`` ... ``flip(0)``, a head that
gathers positions of the whole flattened batch into new rows and scatters them back) keeps every shape
and each example's loss its own, so the loss and batch-dimension probes pass; but the hooks, which
take row ``i`` of each layer as example ``i``, then clip vectors that mix several examples. These tests
show that such models are refused before the first step, that ordinary models are not and train bit
for bit as without the probe, and (probe bypassed) that the mixing does break the clip bound.
"""

from __future__ import annotations

import contextlib
import time
import warnings

import datasets
import pytest
import torch
import torch.nn.functional as F
from tiny_models import lora_bert, tiny_gpt2_lm, tiny_llama_lm, tiny_text_batch
from torch import nn

from dp_hf import DPTrainer
from dp_hf.per_example import attach_fast_clipping, attach_grad_sample
from dp_hf.trainer.probe import check_gradients_follow_the_examples
from tests.dp_training import (
    VOCAB,
    Gain,
    bert_classifier,
    bert_on_opacus_hooks,
    classification_data,
    dp_args,
    one_sgd_step_args,
    params_of,
)

REFUSAL = "the per-example clipping credits one example's gradient to another"
PROBE = "dp_hf.trainer.step.check_gradients_follow_the_examples"


class _RowMixingClassifier(nn.Module):
    """Embedding, a hidden Linear and a head; ``mix`` moves the batch's rows around the hidden layer.

    ``"flip"``: the hidden layer sees the batch reversed (and its output is reversed back).
    ``"gather"``: a "sparse" hidden layer sees only the positions of odd token ids, gathered from the
    whole flattened batch and cut into ``b`` rows of equal length (the last padded), then scattered back.
    Either way each example's loss depends on that example alone; only the hidden layer's rows mix.
    """

    def __init__(self, mix: str | None, opacus: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mix = mix
        self.emb = nn.Embedding(VOCAB, 16)
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Sequential(nn.Linear(16, 2), Gain(2)) if opacus else nn.Linear(16, 2)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)  # [b, T, d]
        if self.mix == "flip":
            h = h + self.hidden(h.flip(0)).flip(0)
        elif self.mix == "gather":
            b, d = h.shape[0], h.shape[-1]
            flat = h.reshape(-1, d)
            picked = (input_ids.reshape(-1) % 2 == 1).nonzero().squeeze(1)  # a batch-wide mask
            n = picked.shape[0]
            rows = torch.cat([flat[picked], flat.new_zeros((-n) % b, d)]).reshape(b, -1, d)
            moved = self.hidden(rows).reshape(-1, d)[:n]
            h = flat.index_add(0, picked, moved).reshape(h.shape)
        else:
            h = h + self.hidden(h)
        return {"logits": self.head(torch.tanh(h).mean(1))}


def _cross_entropy(outputs, labels, inputs):
    return F.cross_entropy(outputs["logits"], labels, reduction="none")


def _mixing_trainer(tmp_path, mix, opacus=False, **overrides):
    return DPTrainer(
        model=_RowMixingClassifier(mix, opacus),
        args=dp_args(tmp_path, max_steps=2, remove_unused_columns=False, **overrides),
        train_dataset=classification_data(64),
        per_example_loss_fn=_cross_entropy,
    )


@pytest.mark.parametrize("mode", ["ghost", "materialize", "opacus"])
@pytest.mark.parametrize("mix", ["flip", "gather"])
def test_a_forward_that_mixes_batch_rows_is_refused_before_any_step(tmp_path, mix, mode):
    if mode == "opacus":  # a module without a fast rule: Opacus's hooks
        trainer = _mixing_trainer(tmp_path, mix, opacus=True)
        assert trainer.fast_clipping is None and trainer.grad_sample_handle is not None
    else:
        trainer = _mixing_trainer(tmp_path, mix, per_sample_gradient_mode=mode)
    before = params_of(trainer.model)
    with pytest.raises(ValueError, match=REFUSAL) as refused:
        trainer.train()
    message = str(refused.value)
    assert "hidden.weight" in message and "Do not mix batch rows inside forward" in message
    assert trainer.accountant.steps == 0
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0, msg=name)
    assert trainer.model.training


@pytest.mark.parametrize("mix", ["flip", "gather"])
def test_without_the_probe_a_row_mixing_model_trains(tmp_path, mix, monkeypatch):
    # The other probes do not see it: the refusal above is this probe's.
    monkeypatch.setattr(PROBE, lambda *args: True)
    trainer = _mixing_trainer(tmp_path, mix)
    trainer.train()
    assert trainer.accountant.steps == 2


def _lm_rows(n: int) -> datasets.Dataset:
    batch = tiny_text_batch(batch_size=n, seed=3)
    return datasets.Dataset.from_dict(
        {
            "input_ids": batch["input_ids"].tolist(),
            "attention_mask": batch["attention_mask"].tolist(),
            "labels": batch["lm_labels"].tolist(),
        }
    )


def _classification_rows(n: int) -> datasets.Dataset:
    batch = tiny_text_batch(batch_size=n, seed=3)
    return datasets.Dataset.from_dict(
        {k: batch[k].tolist() for k in ("input_ids", "attention_mask", "labels")}
    )


# name -> (model factory, dataset, DPTrainingArguments overrides)
ORDINARY = {
    # Hidden and attention dropout on: the probe's passes must draw the same numbers at the same rows.
    "bert-dropout": (
        lambda: bert_classifier(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1),
        lambda: classification_data(64),
        {},
    ),
    "bert-opacus-hooks": (bert_on_opacus_hooks, lambda: classification_data(64), {}),
    "gpt2": (lambda: tiny_gpt2_lm(dropout=0.1), lambda: _lm_rows(32), {}),
    "llama": (tiny_llama_lm, lambda: _lm_rows(32), {"per_sample_gradient_mode": "materialize"}),
    "lora-bert": (lambda: lora_bert(lora_dropout=0.1), lambda: _classification_rows(32), {}),
}


@pytest.mark.parametrize("name", list(ORDINARY))
def test_ordinary_models_pass_and_train_as_without_the_probe(name, tmp_path, monkeypatch):
    factory, data, overrides = ORDINARY[name]

    def run(output_dir):
        trainer = DPTrainer(
            model=factory(),
            args=dp_args(output_dir, max_steps=3, per_device_train_batch_size=8, **overrides),
            train_dataset=data(),
        )
        trainer.train()
        return trainer

    probed = run(tmp_path / "probed")
    assert probed._gradients_checked
    monkeypatch.setattr(PROBE, lambda *args: True)
    unprobed = run(tmp_path / "unprobed")
    for (n, p), q in zip(probed.model.named_parameters(), unprobed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("path", ["ghost", "opacus"])
def test_the_probe_itself(path):
    # Own-loop use, without DPTrainer: the probe restores modes, .grad, random state and hooks' state.
    model = _RowMixingClassifier(None, opacus=path == "opacus")
    model.train()
    clipping = attach_fast_clipping(model) if path == "ghost" else attach_grad_sample(model)
    params = [p for p in model.parameters() if p.requires_grad]
    inputs = {"input_ids": torch.randint(3, VOCAB, (5, 6), generator=torch.Generator().manual_seed(1))}
    labels = torch.tensor([0, 1, 1, 0, 1])

    def losses(model, inputs):
        return F.cross_entropy(
            model(inputs["input_ids"])["logits"], labels[: inputs["input_ids"].shape[0]], reduction="none"
        )

    state = torch.get_rng_state()
    start = time.perf_counter()
    assert check_gradients_follow_the_examples(
        losses, model, inputs, contextlib.nullcontext, params, clipping
    )
    elapsed_ms = 1e3 * (time.perf_counter() - start)
    assert elapsed_ms < 5e3
    assert torch.equal(torch.get_rng_state(), state)
    assert model.training and all(p.grad is None for p in params)
    assert clipping.enabled if path == "ghost" else clipping.hooks_enabled
    assert not (
        clipping.recorder.records
        if path == "ghost"
        else any(hasattr(p, "grad_sample") and p.grad_sample is not None for p in params)
    )
    # A micro-batch of one: nothing to compare.
    one = {"input_ids": inputs["input_ids"][:1]}
    assert not check_gradients_follow_the_examples(
        losses, model, one, contextlib.nullcontext, params, clipping
    )
    model.mix = "flip"
    with pytest.raises(ValueError, match=REFUSAL):
        check_gradients_follow_the_examples(losses, model, inputs, contextlib.nullcontext, params, clipping)
    assert model.training and all(p.grad is None for p in params)


CLIP = 1e-3  # below every example's gradient norm: each row is clipped to norm C
LR = 1e3
SPECIAL_TOKEN = 3  # (unused by classification_data) the replaced example's tokens


def _sensitivity_model(mix: str | None) -> nn.Module:
    """The row-mixing classifier with small embeddings but a large one for :data:`SPECIAL_TOKEN`.

    The example made of that token then has a much larger gradient than the others in every layer, so
    under ``flip(0)`` it dominates two clipped rows: its own (embedding, head) and its partner's (hidden).
    """
    model = _RowMixingClassifier(mix)
    with torch.no_grad():
        model.emb.weight.mul_(0.1)
        model.emb.weight[SPECIAL_TOKEN].mul_(30.0)
    return model


def _update_of_one_step(mix: str | None, rows: list[dict], tmp_path) -> torch.Tensor:
    """``theta_0 - theta_1`` of one DP-SGD step at sigma = 0 with every example in the batch (q = 1)."""
    model = _sensitivity_model(mix)
    before = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    args = one_sgd_step_args(tmp_path, len(rows), CLIP, LR, remove_unused_columns=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0 and delta >= 1/N warn, rightly
        trainer = DPTrainer(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_list(rows),
            per_example_loss_fn=_cross_entropy,
        )
        trainer.train()
    assert trainer.sample_rate == 1.0 and trainer.state.global_step == 1
    return before - torch.cat([p.detach().double().flatten() for p in model.parameters()])


@pytest.mark.parametrize("mix", [None, "flip"])
def test_without_the_probe_the_flip_model_breaks_the_clip_bound(tmp_path, monkeypatch, mix):
    # Replace-one neighbours (same size, q = 1): with per-example clipping the update moves by at most
    # 2 C lr / B. The neighbours differ in example 0's label (its gradient flips sign). Under flip(0) the
    # hidden layer's share of its gradient is clipped in the last example's row, so two clipped rows move
    # by up to 2 C each. The same model without flip(0) stays within the bound (the measurement is sound).
    monkeypatch.setattr(PROBE, lambda *args: True)
    rows = classification_data(8).to_list()
    rows[0] = dict(rows[0], input_ids=[2] + [SPECIAL_TOKEN] * (len(rows[0]["input_ids"]) - 1), labels=0)
    neighbour = [dict(rows[0], labels=1), *rows[1:]]
    moved = (
        _update_of_one_step(mix, rows, tmp_path / "a") - _update_of_one_step(mix, neighbour, tmp_path / "b")
    ).norm()
    bound = 2 * CLIP * LR / len(rows)
    ratio = float(moved) / bound
    print(
        f"mix={mix}: the update moved by {float(moved):.6g}, bound 2 C lr / B = {bound:.6g}: {ratio:.3f}x the bound"
    )
    if mix is None:
        assert ratio <= 1 + 1e-4
        return
    assert ratio > 1.2
    monkeypatch.undo()  # with the probe: refused before the step
    with pytest.raises(ValueError, match=REFUSAL):
        _update_of_one_step(mix, rows, tmp_path / "c")


@pytest.mark.parametrize("attach", [attach_fast_clipping, attach_grad_sample], ids=["fast", "opacus"])
@pytest.mark.parametrize("was_on", [True, False], ids=["on", "off"])
def test_hooks_off_gives_plain_autograd_and_restores_the_previous_state(attach, was_on):
    """The probe's truth (and the input-space audit's scoring) runs inside ``hooks_off()``: nothing is
    recorded there, autograd's ``.grad`` is the plain one, and hooks that were off stay off afterwards."""
    model = tiny_gpt2_lm()
    handle = attach(model)
    is_on = (lambda: handle.enabled) if attach is attach_fast_clipping else (lambda: handle.hooks_enabled)
    if not was_on:
        (handle.disable if attach is attach_fast_clipping else handle.disable_hooks)()
    batch = tiny_text_batch(batch_size=3)
    try:
        with handle.hooks_off():
            assert not is_on()
            model(input_ids=batch["input_ids"]).logits.float().square().sum().backward()
        assert is_on() is was_on
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)  # plain autograd
        assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
        if attach is attach_fast_clipping:
            assert not handle.recorder.records
        with pytest.raises(RuntimeError, match="boom"), handle.hooks_off():
            raise RuntimeError("boom")
        assert is_on() is was_on
    finally:
        handle.remove()
