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

A statistic need not be a registered buffer: ``self.running_mean = 0.9 * self.running_mean + 0.1 *
h.detach().mean(0)`` on a plain tensor attribute (or ``self.scale = float(h.abs().max())``) is not in
``state_dict``, but the forward reads it at the next step, so one example moves every later example's
clipped gradient (and the released model's outputs) outside the clip bound and without noise. So a
module's plain attributes are compared too (:func:`_state`): tensors outside any autograd graph (a stash
of this forward's activations for an auxiliary loss has a ``grad_fn`` and is not a statistic) and
Python ``int``/``float`` numbers; like buffers, each gets its value back, and those a forward creates are
not compared.
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


def _state(model: nn.Module) -> dict[str, tuple[dict[str, Any], str, Any]]:
    """``name -> (owning dict, attribute, value)`` of every buffer and plain statistic attribute (a tensor
    outside any graph, not a parameter; an int or float), read now (a forward may replace one). The owning
    dict is the module's ``_buffers`` or its ``__dict__``."""
    out = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for attribute, tensor in module._buffers.items():  # noqa: SLF001 - registered buffers, None included
            if tensor is not None:
                out[prefix + attribute] = (module._buffers, attribute, tensor)  # noqa: SLF001
        for attribute, value in vars(module).items():
            tensor = isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if (tensor and value.grad_fn is None) or number:
                out[prefix + attribute] = (vars(module), attribute, value)
    return out


def _same(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return type(a) is type(b) and (a == b or (a != a and b != b))  # (NaN equals NaN)
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
    start = _state(model)
    if not start:
        return True
    saved = {name: _copy(value) for name, (_, _, value) in start.items()}
    after: list[dict[str, Any]] = []
    devices = cuda_devices(inputs.values())
    try:
        with random_state_kept(devices):
            for row in (0, size - 1):
                seed_every_generator(devices, _SEED)
                with context():
                    compute_losses(model, take_examples(inputs, [row]))
                after.append({name: _copy(value) for name, (_, _, value) in _state(model).items()})
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
            "updating them during training (e.g. only when not self.training). A plain tensor or number attribute "
            "of a module counts too: the next step's forward reads it, outside the clip bound."
        )
    return True


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _restore(start: dict[str, tuple[dict[str, Any], str, Any]], saved: dict[str, Any]) -> None:
    """Every buffer and attribute present at the start back to its value (and its tensor, where a forward
    replaced it). Those a forward created are left as they are (a lazily built cache), and not compared."""
    for owner, attribute, value in start.values():
        if owner.get(attribute) is not value:  # replaced: put the original back
            owner[attribute] = value
    for name, (_, _, value) in start.items():
        if isinstance(value, torch.Tensor):
            value.copy_(saved[name])
