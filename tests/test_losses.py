"""Per-example token losses (dp_hf.losses, dp_hf.sft): the values of transformers' own loss, example by example,
and no more [b, T, V] float32 copies of the logits than that loss makes.

The causal-LM shift is applied to the labels (as transformers' ``ForCausalLMLoss``), not to the logits: the slice
``logits[:, :-1]`` is not contiguous, so flattening it copied the whole logits once more at the forward's peak
(GPT-2-medium, B 16, L 512: 1.6 GB in float32). Both tests below fail on that code (two copies; the values agree).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dp_hf.losses import per_example_loss

B, T, V = 3, 7, 11


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :3] = -100  # a prompt not trained on
    labels[1, 4] = -100  # a hole
    labels[2, 1:] = -100  # nothing to predict: loss 0
    return logits, labels


def reference(logits: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` / ``ForTokenClassification`` loss of each example alone (mean over its
    labelled tokens; 0 where none)."""
    losses = []
    for row_logits, row_labels in zip(logits, labels):
        if task == "causal_lm":
            row_logits, row_labels = row_logits[:-1], row_labels[1:]
        keep = row_labels != -100
        losses.append(
            F.cross_entropy(row_logits[keep], row_labels[keep]) if keep.any() else torch.tensor(0.0)
        )
    return torch.stack(losses)


def sft_mean(logits: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    pytest.importorskip("trl")
    from dp_hf.sft import sft_per_example_losses

    losses, nll, mask = sft_per_example_losses(logits, labels, reduction="mean")
    assert nll.shape == mask.shape == (B, T - 1)  # the predictions' positions, as before
    return losses


LOSSES = {
    "causal_lm": lambda logits, labels: per_example_loss(logits, labels, "causal_lm"),
    "token": lambda logits, labels: per_example_loss(logits, labels, "token"),
    "sft": lambda logits, labels: sft_mean(logits, labels, "causal_lm"),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_per_example_token_losses_are_transformers_loss_of_each_example(name):
    logits, labels = batch()
    task = "token" if name == "token" else "causal_lm"
    losses = LOSSES[name](logits, labels)
    torch.testing.assert_close(losses, reference(logits, labels, task), rtol=1e-6, atol=1e-6)
    assert losses[2] == 0 if task == "causal_lm" else losses[2] > 0


class _LogitsSizedAllocations(TorchDispatchMode):
    """How many tensors of at least ``numel`` elements ops allocate (views and in-place results excluded)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.count += t.numel() >= self.numel
        return out


@pytest.mark.parametrize("name", list(LOSSES))
def test_a_token_loss_allocates_one_logits_sized_tensor(name):
    """float32 logits in: only log_softmax's output is as large (cross_entropy saves it for backward)."""
    logits, labels = batch()
    counter = _LogitsSizedAllocations((B * (T - 1)) * V)
    with counter:
        LOSSES[name](logits, labels)
    assert counter.count == 1, counter.count
