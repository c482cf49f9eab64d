"""A black-box check, once per run, that each example's loss depends on that example only.

The clip bound limits one example's influence on the step only if every other example's gradient is
unchanged when it is added or removed. A loss that looks at the rest of its batch breaks that while
every row is still clipped: one divided by the batch's token count (a realized batch size in a
denominator), in-batch negatives (contrastive losses), batch statistics, routing with an expert
capacity. Such a coupling is often in a user's ``per_example_loss_fn``, where no structural check
can see it. :func:`check_losses_are_per_example` runs two comparisons, without gradients:

* in eval mode (no dropout), the first micro-batch's losses against the losses of its first and last
  examples alone (the same padded rows, sliced): a loss that depends on the batch's size;
* in the modes training runs in (train mode), an example's loss in the micro-batch against its loss
  in a micro-batch of the same shape whose other rows are all copies of it. A layer that looks at the
  batch only in train mode (batch centering without BatchNorm's class, an MoE router's train-only
  expert capacity) is a no-op in eval mode and would pass the first comparison. Dropout modules are
  switched to eval for this pass, and both forwards draw the same random numbers (same seed, same
  shapes), so other train-mode randomness (attention dropout, layer drop, router jitter) falls at the
  same positions and an honest model's example gets the same loss in both.

The random state is restored afterwards: training draws as if the probe had not run.

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
from torch.nn.modules.dropout import _DropoutNd

from dp_hf.batches import batch_size_of, cuda_devices, split_microbatch, take_examples
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


#: The seed both train-mode forwards of the loss probe start from (their random draws then coincide).
_PROBE_SEED = 0x5EED


@torch.no_grad()
def check_losses_are_per_example(
    compute_losses: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
    model: nn.Module,
    inputs: Mapping[str, Any],
    context: Callable[[], Any],
) -> bool:
    """Raise ``ValueError`` if an example's loss changes when the rest of its micro-batch changes.

    ``compute_losses(model, inputs) -> [b]`` is the trainer's per-example loss; ``context()`` its
    forward's context manager (autocast). ``model``'s modules are in the modes training uses; each
    gets its mode back. Returns False, having checked nothing, for a micro-batch of fewer than two
    examples or whose compared losses are all non-finite (the caller tries the next one); True once
    checked.
    """
    size = batch_size_of(inputs)
    if size < 2:
        return False
    modes = [(module, module.training) for module in model.modules()]
    picks = (0, size - 1)
    try:
        model.eval()
        with context():
            together = compute_losses(model, dict(inputs)).float()[list(picks)]
            rows = split_microbatch(inputs, 1)
            alone = torch.cat([compute_losses(model, rows[i]).float().reshape(1) for i in picks])
        for module, training in modes:
            module.training = training and not isinstance(module, _DropoutNd)
        # The example compared in train mode: one whose loss is finite, if any.
        row = (
            picks[0]
            if bool(torch.isfinite(together[0])) or not bool(torch.isfinite(together[1]))
            else picks[1]
        )
        in_batch = _seeded_loss(compute_losses, model, dict(inputs), row, context)
        among_copies = _seeded_loss(compute_losses, model, take_examples(inputs, [row] * size), row, context)
    finally:
        for module, training in modes:
            module.training = training
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
    if not bool(
        torch.isclose(among_copies, in_batch, rtol=LOSS_PROBE_RTOL, atol=LOSS_PROBE_ATOL, equal_nan=True)
    ):
        raise ValueError(
            f"in train mode the per-example losses depend on the other examples of their batch (example {row}: "
            f"{float(in_batch):.6g} in its micro-batch of {size}, {float(among_copies):.6g} in a micro-batch of "
            f"{size} copies of itself; dropout off, same random draws; in eval mode it does not). Some layer looks "
            "at the whole batch only when training (batch centering or normalization written as tensor ops, an "
            "MoE router's train-only expert capacity or token dropping, ...), so one example changes the others' "
            "clipped gradients and the clip bound no longer bounds its influence. Make every layer act on each "
            "example alone in train mode too (e.g. no capacity limit, or LayerNorm/GroupNorm for batch "
            "statistics)."
        )
    return True


def _seeded_loss(
    compute_losses: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
    model: nn.Module,
    inputs: dict[str, Any],
    row: int,
    context: Callable[[], Any],
) -> torch.Tensor:
    """Example ``row``'s loss, from a forward whose random draws start at :data:`_PROBE_SEED`.

    The random state is restored afterwards. Two batches of the same shapes then draw the same
    numbers at the same positions (dropout masks, layer drop), so an example's own draws do not depend
    on what the other rows hold.
    """
    devices = cuda_devices(inputs.values())
    with torch.random.fork_rng(devices=devices):
        torch.random.default_generator.manual_seed(_PROBE_SEED)
        for device in devices:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(_PROBE_SEED)
        with context():
            return compute_losses(model, inputs).float()[row]


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
    devices = cuda_devices(inputs.values())
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
