"""A black-box check, once per run, that no buffer the model updates in its forward depends on the data.

DP covers what is computed from the privatized gradients: the trained parameters and anything derived
from them. A buffer that the forward pass updates from its input (a running mean or variance written as
tensor ops, a feature histogram, a cache of seen tokens) is a function of the training examples without
noise, and it is released with the model: in every checkpoint's and the final ``state_dict``, and in the
model's outputs whenever forward reads it. BatchNorm and InstanceNorm with running statistics are refused
by type (:mod:`dp_hf.per_example.validate`); a buffer of the user's own code cannot be seen from the module
tree. :func:`check_buffers_ignore_the_data` runs the forward pass twice from the same buffer values, on
two different examples of a micro-batch (one row each, the same random draws), and refuses the run if any
buffer ends up different: then its value depends on which example it saw. Buffers updated in a way that
does not depend on the data (a step counter, a cache derived from the weights) end up equal and pass.
Every buffer gets its value back afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from dp_hf.batches import batch_size_of, cuda_devices, take_examples
from dp_hf.random_state import random_state_kept, seed_every_generator

__all__ = ["check_buffers_ignore_the_data"]

#: The seed both forwards start from (their random draws then coincide).
_SEED = 0xB0FF


def _buffers(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """``name -> (owning module, attribute, tensor)`` of every buffer, read now (a forward may replace one)."""
    out = {}
    for module_name, module in model.named_modules():
        for attribute, tensor in module._buffers.items():  # noqa: SLF001 - registered buffers, None included
            if tensor is not None:
                out[f"{module_name}.{attribute}" if module_name else attribute] = (module, attribute, tensor)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(torch.isnan(a), torch.isnan(b))) and bool(
            torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
        )
    return bool(torch.equal(a, b))


@torch.no_grad()
def check_buffers_ignore_the_data(
    compute_losses: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
    model: nn.Module,
    inputs: Mapping[str, Any],
    context: Callable[[], Any],
) -> bool:
    """Raise ``ValueError`` if a buffer's value after a forward pass depends on the example it saw.

    ``compute_losses(model, inputs)`` is the trainer's per-example loss forward, ``context()`` its context
    manager; ``model``'s modules are in the modes training uses. Returns False, having checked nothing, for a
    micro-batch of fewer than two examples (the caller tries the next one), True once checked. Cost: two
    forward passes of one row and three copies of the buffers, once per run.
    """
    size = batch_size_of(inputs)
    if size < 2:
        return False
    start = _buffers(model)
    if not start:
        return True
    saved = {name: tensor.clone() for name, (_, _, tensor) in start.items()}
    after: list[dict[str, torch.Tensor]] = []
    devices = cuda_devices(inputs.values())
    try:
        with random_state_kept(devices):
            for row in (0, size - 1):
                seed_every_generator(devices, _SEED)
                with context():
                    compute_losses(model, take_examples(inputs, [row]))
                after.append({name: tensor.clone() for name, (_, _, tensor) in _buffers(model).items()})
                _restore(start, saved)
    finally:
        _restore(start, saved)
    first, last = after
    differing = [
        name
        for name in start
        if (first.get(name) is None) != (last.get(name) is None)
        or (name in first and name in last and not _same(first[name], last[name]))
    ]
    if differing:
        shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
        raise ValueError(
            f"the model's forward pass updates buffer(s) {shown} from its input: after one forward from the same "
            f"values, they differ between the micro-batch's first and last examples. A buffer is released with the "
            "model (every checkpoint, the final state_dict, and the outputs wherever forward reads it) without "
            "noise, so its value would tell which examples were trained on; differential privacy covers the "
            "parameters only. Compute such statistics from public data, make them trainable parameters, or stop "
            "updating them during training (e.g. only when not self.training)."
        )
    return True


def _restore(start: dict[str, tuple[nn.Module, str, torch.Tensor]], saved: dict[str, torch.Tensor]) -> None:
    """Every buffer present at the start back to its value (and its tensor, where a forward replaced it).
    Buffers a forward created are left as they are (a lazily built cache), and not compared."""
    for module, attribute, tensor in start.values():
        if module._buffers.get(attribute) is not tensor:  # noqa: SLF001 - replaced: put the original back
            module._buffers[attribute] = tensor  # noqa: SLF001
    for name, (_, _, tensor) in start.items():
        tensor.copy_(saved[name])
