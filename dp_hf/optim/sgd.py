"""DP-SGD: ``theta -= lr * gtilde``, with ``torch.optim.SGD``'s momentum options.

Privatizer geometry: ``c = 0``, ``s = 1``, the user's ``C`` (ALGORITHMS.md §2).
With ``sigma = 0`` and ``C = inf`` this is ``torch.optim.SGD`` step for step.
"""

from __future__ import annotations

import torch

from dp_hf.optim._params import FP32Params
from dp_hf.optim.base import DPOptimizer


class DPSGD(DPOptimizer):
    """DP-SGD (Abadi et al. 2016) on Poisson-sampled logical batches.

    Args:
        lr, momentum, dampening, weight_decay, nesterov: as ``torch.optim.SGD``.
        noise_multiplier, max_grad_norm, expected_batch_size, ...: see
            :class:`~dp_hf.optim.base.DPOptimizer`.

    Tuning (docs/optimizers.md): the step is proportional to ``gtilde``, so ``lr`` depends on ``C``, ``B``,
    sigma and the model: the papers used 0.1 (MNIST MLP, B 256) to 4.0 (CIFAR WRN, B 4096); the digits
    benchmark selected 0.3-3. The default ``lr=1e-3`` (torch's) is far too small for DP training.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        **dp_kwargs,
    ) -> None:
        if not 0.0 <= momentum:
            raise ValueError(f"Invalid momentum value: {momentum!r} (must be >= 0).")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay!r} (must be >= 0).")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(
                f"Nesterov momentum requires momentum > 0 and dampening = 0 (got momentum={momentum!r}, "
                f"dampening={dampening!r})."
            )
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov
        )
        super().__init__(params, defaults, **dp_kwargs)

    def update(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            if not params:
                continue
            weights = FP32Params(params)
            grads = [self.privatized_grad(p) for p in params]
            if group["weight_decay"] != 0:
                grads = torch._foreach_add(grads, weights.tensors, alpha=group["weight_decay"])
            momentum = group["momentum"]
            if momentum != 0:
                bufs = []
                for p, g in zip(params, grads):
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = g.clone()
                    else:
                        buf.mul_(momentum).add_(g, alpha=1 - group["dampening"])
                    bufs.append(buf)
                grads = torch._foreach_add(grads, bufs, alpha=momentum) if group["nesterov"] else bufs
            torch._foreach_add_(weights.tensors, grads, alpha=-group["lr"])
            weights.write_back()
