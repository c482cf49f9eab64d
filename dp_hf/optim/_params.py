"""float32 working copies of parameters, so every rule computes in float32; multi-tensor helpers.

Optimizer state is kept in float32 whatever the parameter dtype: a bf16 moment
estimate loses most of the small updates DP noise averaging relies on.
"""

from __future__ import annotations

import torch


class FP32Params:
    """``tensors`` are the parameters themselves when float32, else float32 copies;
    :meth:`write_back` copies the copies into the low-precision parameters.

    The copies are views of one flat float32 buffer per call, filled and written back with one
    multi-tensor copy each (not one kernel per tensor).
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.tensors = [p.data for p in params]
        self._low = [k for k, p in enumerate(params) if p.dtype != torch.float32]
        if not self._low:
            return
        by_device: dict[torch.device, list[int]] = {}
        for k in self._low:
            by_device.setdefault(params[k].device, []).append(k)
        for device, members in by_device.items():
            numels = [params[k].numel() for k in members]
            flat = torch.empty(sum(numels), dtype=torch.float32, device=device)
            copies = [chunk.view(params[k].shape) for k, chunk in zip(members, flat.split(numels))]
            torch._foreach_copy_(copies, [params[k].data for k in members])
            for k, copy in zip(members, copies):
                self.tensors[k] = copy

    def write_back(self) -> None:
        if self._low:
            torch._foreach_copy_(
                [self.params[k].data for k in self._low], [self.tensors[k] for k in self._low]
            )


def advance_steps(steps: list[torch.Tensor]) -> float | list[float]:
    """Add 1 to every ``state["step"]`` tensor (torch's layout: one scalar tensor per parameter).

    Returns the new step ``t`` as one float when all are equal (the usual case: then every per-step
    scalar, bias corrections and step size, is computed once per group), else the list of them.
    Two multi-tensor ops and one host read, instead of an increment and a ``float()`` per tensor.
    """
    if not steps:
        return []
    torch._foreach_add_(steps, 1)
    values = step_values(steps)
    return values[0] if values.count(values[0]) == len(values) else values


def step_values(steps: list[torch.Tensor]) -> list[float]:
    """The ``state["step"]`` tensors' values in one host read (not a ``float()`` per tensor)."""
    if len(steps) > 1:
        return torch.stack(steps).tolist()
    return [float(step) for step in steps]
