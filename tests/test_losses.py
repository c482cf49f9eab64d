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


def _qa_losses(outputs, labels, inputs) -> torch.Tensor:
    """Question answering's loss per example: the mean of its start and end cross entropies."""
    assert labels is None  # the batch has no 'labels': the positions are read from the inputs
    start = F.cross_entropy(outputs.start_logits, inputs["start_positions"], reduction="none")
    end = F.cross_entropy(outputs.end_logits, inputs["end_positions"], reduction="none")
    return (start + end) / 2


def test_a_head_without_labels_trains_with_its_own_loss_function(tmp_path):
    """Question answering (start_positions/end_positions, no 'labels'): the error asked for a
    per_example_loss_fn, and with one given the step still refused the batch for its missing 'labels' (a
    newcomer's finding). One DP-SGD step at sigma 0 moves by at most 2 C lr / B when one example is
    replaced (the sensitivity tests' black-box measurement)."""
    import datasets
    from transformers import BertForQuestionAnswering

    from dp_hf import DPTrainer
    from tests.dp_training import one_sgd_step_args
    from tests.tiny_models import TINY_SEQ_LEN, TINY_VOCAB_SIZE, tiny_bert_config

    n, clip, lr = 8, 0.01, 1.0
    g = torch.Generator().manual_seed(0)
    pool = {
        "input_ids": torch.randint(3, TINY_VOCAB_SIZE, (n + 1, TINY_SEQ_LEN), generator=g).tolist(),
        "start_positions": torch.randint(0, TINY_SEQ_LEN, (n + 1,), generator=g).tolist(),
        "end_positions": torch.randint(0, TINY_SEQ_LEN, (n + 1,), generator=g).tolist(),
    }

    def update(rows: list[int], name: str) -> torch.Tensor:
        torch.manual_seed(0)
        model = BertForQuestionAnswering(tiny_bert_config(num_labels=2))  # (start, end)
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        data = datasets.Dataset.from_dict({k: [v[i] for i in rows] for k, v in pool.items()})
        # sample_rate 1: every example in the one step, so the two runs differ in exactly one example
        args = one_sgd_step_args(tmp_path / name, batch_size=n, clip=clip, lr=lr)
        trainer = DPTrainer(model=model, args=args, train_dataset=data, per_example_loss_fn=_qa_losses)
        trainer.train()
        return before - torch.cat([p.detach().flatten() for p in trainer.model.parameters()])

    first, second = update(list(range(n)), "a"), update([n, *range(1, n)], "b")
    ratio = float((first - second).norm()) / (2 * clip * lr / n)
    assert 0.0 < ratio <= 1.0 + 1e-5, ratio
