"""Models that evade the once-per-run probes of dp_hf.trainer (an audit: probe.py, buffers.py, rows.py).

Each attack is a small model a user could write: a layer that moves batch rows only in batches of more
than two rows, a sort of the batch by length that the probed pair happens to be in order for, a
"packing" path taken only when at least three rows are padded, a running statistic kept in a plain
attribute rather than a registered buffer. The pair probe (two examples, a 2-row batch) passed the first
three and one DP-SGD step at sigma 0 moved by ~1.34x the bound 2 C lr / B when one example was replaced;
the buffer probe did not see the fourth. They are now refused before the first step
(:mod:`dp_hf.trainer.rows`, :func:`dp_hf.trainer.buffers.check_buffers_ignore_the_data`). What a
once-per-run probe cannot see (a model that starts mixing after it ran) is kept as strict xfails.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings

import datasets
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import TrainerCallback

from dp_hf import DPTrainer
from dp_hf.per_example import attach_fast_clipping, attach_grad_sample
from dp_hf.trainer.rows import check_examples_keep_their_rows, weight_patterns
from tests.dp_training import VOCAB, Gain, classification_data, dp_args, one_sgd_step_args

ROWS_REFUSAL = "with only examples .* weighed in the loss"
BUFFER_REFUSAL = "updates buffer"
ROWS_CHECK = "dp_hf.trainer.rows.check_examples_keep_their_rows"
CLIP, LR, SPECIAL = 1e-3, 1e3, 3
MOVES = ["flip_above_two_rows", "sort_by_length", "roll_when_three_padded"]


class _Attack(nn.Module):
    """Embedding, a hidden Linear around which ``mix`` may move rows, a head (``opacus``: plus a Gain)."""

    def __init__(self, mix: str | None, opacus: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mix = mix
        self.emb = nn.Embedding(VOCAB, 16)
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Sequential(nn.Linear(16, 2), Gain(2)) if opacus else nn.Linear(16, 2)
        self.statistic = torch.zeros(16)  # a plain attribute, not a registered buffer
        self.scale = 1.0
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("running_mean", torch.zeros(16))
        with torch.no_grad():  # one example (made of SPECIAL) has a much larger gradient than the others
            self.emb.weight.mul_(0.1)
            self.emb.weight[SPECIAL].mul_(30.0)

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids)
        mix = self.mix
        if mix == "flip_above_two_rows" and h.shape[0] > 2:  # e.g. a batched kernel used only for big batches
            return self._head(h + self.hidden(h.flip(0)).flip(0))
        if mix == "sort_by_length":  # bucket the rows by length for the hidden layer, then restore the order
            order = torch.sort(-attention_mask.sum(1), stable=True).indices
            return self._head(h + self.hidden(h[order])[torch.argsort(order)])
        if mix == "roll_when_three_padded" and int((attention_mask == 0).any(1).sum()) > 2:
            return self._head(h + self.hidden(h.roll(1, 0)).roll(-1, 0))
        if mix in ("tensor_attribute", "float_attribute") and self.training:  # a running statistic
            if mix == "tensor_attribute":
                self.statistic = 0.5 * self.statistic + 0.5 * h.detach().mean((0, 1))
            else:
                self.scale = float(h.detach().abs().max())
        if mix == "buffer_every_50_forwards" and self.training:
            self.seen += 1
            if int(self.seen) % 50 == 0:
                self.running_mean.copy_(h.detach().mean((0, 1)))
        if mix == "stash_and_count":  # data-independent or not a statistic: allowed
            self.stash = h  # an activation kept for an auxiliary loss (part of this forward's graph)
            self.scale += 1.0
        return self._head((h - 10 * self.statistic - 10 * self.running_mean) / self.scale + self.hidden(h))

    def _head(self, h):
        return {"logits": self.head(torch.tanh(h).mean(1))}


def _cross_entropy(outputs, labels, inputs):
    return F.cross_entropy(outputs["logits"], labels, reduction="none")


def _rows() -> list[dict]:
    """8 rows of lengths 8, 7, 6 (cycling); the first made of SPECIAL and of length 5, the last of length 4:
    the probed pair (first, last) is in order by length, and there are 3+ padded rows only in the batch."""
    rows = classification_data(8).to_list()
    for i, row in enumerate(rows):
        row["attention_mask"] = [1] * (8 - i % 3) + [0] * (i % 3)
    rows[0] = dict(rows[0], input_ids=[2] + [SPECIAL] * 7, labels=0, attention_mask=[1] * 5 + [0] * 3)
    rows[-1] = dict(rows[-1], attention_mask=[1] * 4 + [0] * 4)
    return rows


def _trainer(model, rows, output_dir, **overrides):
    args = one_sgd_step_args(output_dir, len(rows), CLIP, LR, remove_unused_columns=False, **overrides)
    return DPTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        per_example_loss_fn=_cross_entropy,
    )


def _update(mix, rows, output_dir) -> torch.Tensor:
    """``theta_0 - theta_1`` of one DP-SGD step at sigma 0 with every example in the batch (q = 1)."""
    model = _Attack(mix)
    before = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0 and delta >= 1/N warn, rightly
        _trainer(model, rows, output_dir).train()
    return before - torch.cat([p.detach().double().flatten() for p in model.parameters()])


@pytest.mark.parametrize("mix", [None, *MOVES])
def test_without_the_rows_check_these_moves_break_the_clip_bound(tmp_path, monkeypatch, mix):
    # Replace-one neighbours (q = 1): example 0's label flips. Before rows.py, only the pair probe ran, and
    # these models trained: one example moved the update by ~1.34x 2 C lr / B. The same model without the
    # move stays within the bound (the measurement is sound).
    monkeypatch.setattr(ROWS_CHECK, lambda *args: True)
    rows = _rows()
    neighbour = [dict(rows[0], labels=1), *rows[1:]]
    moved = (_update(mix, rows, tmp_path / "a") - _update(mix, neighbour, tmp_path / "b")).norm()
    ratio = float(moved) / (2 * CLIP * LR / len(rows))
    print(f"{mix}: {ratio:.3f}x the bound")
    if mix is None:
        assert ratio <= 1 + 1e-4
    else:
        assert ratio > 1.2


@pytest.mark.parametrize("path", ["ghost", "materialize", "opacus"])
@pytest.mark.parametrize("mix", MOVES)
def test_a_move_the_probed_pair_does_not_show_is_refused_before_any_step(tmp_path, mix, path):
    model = _Attack(mix, opacus=path == "opacus")
    mode = {} if path == "opacus" else {"per_sample_gradient_mode": path}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _trainer(model, _rows(), tmp_path, **mode)
    assert (trainer.fast_clipping is None) == (path == "opacus")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=ROWS_REFUSAL) as refused:
        trainer.train()
    assert "Do not mix batch rows inside forward" in str(refused.value)
    assert trainer.accountant.steps == 0 and model.training
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)


@pytest.mark.parametrize("mix", ["tensor_attribute", "float_attribute"])
def test_a_running_statistic_in_a_plain_attribute_is_refused(tmp_path, mix):
    # Not in state_dict, but the next step's forward reads it: example j moves every later clipped gradient.
    model = _Attack(mix)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _trainer(model, _rows(), tmp_path)
    with pytest.raises(
        ValueError, match=rf"{BUFFER_REFUSAL}\(s\) {'statistic' if 'tensor' in mix else 'scale'}"
    ):
        trainer.train()
    assert trainer.accountant.steps == 0
    assert model.statistic is not None  # (refused: what the probes' forwards wrote is never trained on)


def test_a_stash_of_activations_and_a_counter_in_attributes_train(tmp_path):
    trainer = DPTrainer(
        model=_Attack("stash_and_count"),
        args=dp_args(tmp_path, max_steps=2, per_device_train_batch_size=8, remove_unused_columns=False),
        train_dataset=datasets.Dataset.from_list(_rows() * 4),
        per_example_loss_fn=_cross_entropy,
    )
    trainer.train()
    assert trainer.accountant.steps == 2 and trainer._gradients_checked


def test_every_two_rows_are_told_apart_by_some_pass():
    for size in (2, 3, 8, 20, 70):
        weights = weight_patterns(size) > 0
        assert weights.shape[0] <= 2 + size.bit_length()
        for j, k in itertools.permutations(range(size), 2):
            assert bool((weights[:, k] & ~weights[:, j]).any()), (size, j, k)


@pytest.mark.parametrize("path", ["ghost", "opacus"])
def test_the_rows_check_in_an_own_loop(path):
    model = _Attack(None, opacus=path == "opacus").train()
    clipping = attach_fast_clipping(model) if path == "ghost" else attach_grad_sample(model)
    params = [p for p in model.parameters() if p.requires_grad]
    batch = datasets.Dataset.from_list(_rows()).with_format("torch")[:]
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}

    def losses(model, inputs):
        return F.cross_entropy(
            model(**inputs)["logits"], batch["labels"][: len(inputs["input_ids"])], reduction="none"
        )

    state = torch.get_rng_state()
    assert check_examples_keep_their_rows(losses, model, inputs, contextlib.nullcontext, params, clipping)
    assert torch.equal(torch.get_rng_state(), state) and model.training
    assert all(p.grad is None for p in params)
    assert clipping.enabled if path == "ghost" else clipping.hooks_enabled
    one = {k: v[:1] for k, v in inputs.items()}
    assert not check_examples_keep_their_rows(losses, model, one, contextlib.nullcontext, params, clipping)
    model.mix = "sort_by_length"
    with pytest.raises(ValueError, match=ROWS_REFUSAL):
        check_examples_keep_their_rows(losses, model, inputs, contextlib.nullcontext, params, clipping)
    assert all(p.grad is None for p in params)


class _StartMixing(TrainerCallback):
    def on_step_end(self, args, state, control, model=None, **kwargs):
        model.mix = "flip_above_two_rows"  # e.g. a "batch-aware" layer switched on after a warm-up


@pytest.mark.xfail(
    strict=True,
    reason="once-per-run probes: a model that starts moving rows (or updating a statistic) after the probes "
    "ran is not seen; catching it needs a check on every step (m extra passes each), not a small fix",
)
@pytest.mark.parametrize("late", ["rows_after_step_one", "buffer_every_50_forwards"])
def test_what_starts_after_the_probes_ran_is_not_seen(tmp_path, late):
    model = _Attack(None if late == "rows_after_step_one" else late)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPTrainer(
            model=model,
            args=dp_args(tmp_path, max_steps=8, per_device_train_batch_size=8, remove_unused_columns=False),
            train_dataset=datasets.Dataset.from_list(_rows() * 8),
            per_example_loss_fn=_cross_entropy,
            callbacks=[_StartMixing()] if late == "rows_after_step_one" else None,
        )
    with pytest.raises(ValueError):
        trainer.train()
