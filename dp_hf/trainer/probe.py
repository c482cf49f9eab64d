"""A black-box check, once per run, that each example's loss depends on that example only.

The clip bound limits one example's influence on the step only if every other example's gradient is
unchanged when it is added or removed. A loss that looks at the rest of its batch breaks that while
every row is still clipped: one divided by the batch's token count (a realized batch size in a
denominator), in-batch negatives (contrastive losses), batch statistics, routing with an expert
capacity. Such a coupling is often in a user's ``per_example_loss_fn``, where no structural check
can see it. :func:`check_losses_are_per_example` computes the first micro-batch's losses, and the
losses of its first and last examples alone (the same padded rows, sliced), with the model in eval
mode (no dropout) and without gradients, and refuses to train when they differ.

It catches gross couplings, not every one: the tolerance (5% relative, 0.05 absolute) leaves room
for a bf16 model's batch-size-dependent kernels; and it does not run on packed micro-batches
(padding-free SFT, whose examples are segments of one row). Structural checks cover the rest
(BatchNorm, NEFTune, label smoothing, ... are refused).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from dp_hf.batches import batch_size_of, split_microbatch, take_examples
from dp_hf.per_example.errors import PerSampleGradientError

__all__ = [
    "LOSS_PROBE_ATOL",
    "LOSS_PROBE_RTOL",
    "check_layers_follow_the_batch",
    "check_losses_are_per_example",
]

#: How far an example's loss alone may be from its loss in the micro-batch (float noise of batched
#: kernels, bf16 included), relative and absolute.
LOSS_PROBE_RTOL = 0.05
LOSS_PROBE_ATOL = 0.05


@torch.no_grad()
def check_losses_are_per_example(
    compute_losses: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
    model: nn.Module,
    inputs: Mapping[str, Any],
    context: Callable[[], Any],
) -> bool:
    """Raise ``ValueError`` if an example's loss changes when the rest of its micro-batch is removed.

    ``compute_losses(model, inputs) -> [b]`` is the trainer's per-example loss; ``context()`` its
    forward's context manager (autocast). Returns False, having checked nothing, for a micro-batch
    of fewer than two examples or whose compared losses are all non-finite (the caller tries the
    next one); True once checked.
    """
    size = batch_size_of(inputs)
    if size < 2:
        return False
    was_training = model.training
    model.eval()
    try:
        with context():
            together = compute_losses(model, dict(inputs)).float()
            rows = split_microbatch(inputs, 1)
            picks = (0, size - 1)
            alone = torch.cat([compute_losses(model, rows[i]).float().reshape(1) for i in picks])
    finally:
        model.train(was_training)
    together = together[list(picks)]
    close = torch.isclose(alone, together, rtol=LOSS_PROBE_RTOL, atol=LOSS_PROBE_ATOL, equal_nan=True)
    if bool(close.all()) and not bool((torch.isfinite(alone) & torch.isfinite(together)).any()):
        return False  # only non-finite losses, equal but telling nothing: check the next micro-batch
    if not bool(close.all()):
        shown = ", ".join(
            f"example {i}: {float(t):.6g} in its micro-batch of {size}, {float(a):.6g} alone"
            for i, t, a in zip(picks, together.tolist(), alone.tolist())
        )
        raise ValueError(
            f"the per-example losses depend on the other examples of their batch ({shown}; model in eval "
            "mode, same padded rows). Then one example changes the others' clipped gradients too, and the "
            "clip bound no longer bounds its influence. Typical causes: a loss divided by the batch's token "
            "count or size, in-batch negatives, batch statistics, MoE routing with an expert capacity. Make "
            "each example's loss a function of that example alone (per_example_loss_fn)."
        )
    return True


def check_layers_follow_the_batch(
    compute_losses: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
    model: nn.Module,
    inputs: Mapping[str, Any],
    context: Callable[[], Any],
    discard: Callable[[], None],
) -> None:
    """Refuse a hooked layer whose input's first dimension is not the batch, before the first backward.

    The per-example hooks take row ``i`` of each hooked layer's input for example ``i``, and refuse
    an input whose first dimension differs from the batch size. A tensor without a batch dimension
    whose first dimension happens to equal the batch size (T5's and MPNet's relative position bias
    ``[T, T]`` when the padded length ``T`` equals the micro-batch size) would pass that check and be
    clipped as examples. So the forward pass (train mode, gradients and hooks on, as in training) runs
    once on 1 and once on 2 rows of this micro-batch: a dimension that does not follow the batch size
    cannot equal both. ``discard()`` then drops what the hooks kept; the random state is restored, so
    dropout draws as if the probe had not run.
    """
    size = batch_size_of(inputs)
    pick = [0, min(1, size - 1)]  # a micro-batch of one: its example twice
    devices = [
        d for d in {t.device for t in inputs.values() if isinstance(t, torch.Tensor)} if d.type == "cuda"
    ]
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), context():
            for rows in (pick[:1], pick):
                compute_losses(model, take_examples(inputs, rows))
    except PerSampleGradientError as error:
        raise PerSampleGradientError(
            f"{error} (Found by running the first micro-batch's first examples alone and in pairs: the layer's "
            "input does not follow the batch size.)"
        ) from error
    finally:
        discard()
