"""float32 working copies of parameters, so every rule computes in float32.

Optimizer state is kept in float32 whatever the parameter dtype: a bf16 moment
estimate loses most of the small updates DP noise averaging relies on.
"""

from __future__ import annotations

import torch


class FP32Params:
    """``tensors`` are the parameters themselves when float32, else float32 copies;
    :meth:`write_back` copies the copies into the low-precision parameters."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.tensors = [p.data if p.dtype == torch.float32 else p.data.float() for p in params]

    def write_back(self) -> None:
        for p, t in zip(self.params, self.tensors):
            if t is not p.data:
                p.data.copy_(t)
