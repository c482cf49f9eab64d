"""DP-Adam and DP-AdamW: ``torch.optim.Adam`` / ``AdamW`` applied to ``gtilde``.

Post-processing of the privatized gradient (ALGORITHMS.md §2)::

    m = beta1 m + (1 - beta1) gtilde        v = beta2 v + (1 - beta2) gtilde^2
    mhat = m / (1 - beta1^t)                vhat = v / (1 - beta2^t)
    theta *= 1 - lr wd                       (AdamW only; Adam adds wd*theta to gtilde)
    theta -= lr * mhat / (sqrt(vhat) + eps)

With ``sigma = 0`` and ``C = inf`` these equal torch's optimizers step for step.
The Adam variants of dp_hf (``-bc``, scale-then-privatize) subclass
:class:`DPAdam` and override :meth:`DPAdam.denominators` or ``geometry``.
"""

from __future__ import annotations

import math

import torch

from dp_hf.optim._params import FP32Params, advance_steps
from dp_hf.optim.base import DPOptimizer


def check_adam_hyperparameters(betas, eps: float, weight_decay: float, eps_may_be_zero: bool = False) -> None:
    """Validate Adam's hyperparameters, showing the bad value (``eps`` > 0: with 0 a coordinate whose released
    gradient is exactly 0 gives 0 / 0, a NaN weight; ``eps_may_be_zero`` for rules that never read it)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}.")
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta!r} (must be in [0, 1)).")
    if not (0.0 <= eps if eps_may_be_zero else 0.0 < eps) or not math.isfinite(eps):
        floor = ">= 0" if eps_may_be_zero else "> 0"
        raise ValueError(f"Invalid epsilon value: {eps!r} (must be a finite number {floor}).")
    if not 0.0 <= weight_decay or not math.isfinite(weight_decay):
        raise ValueError(f"Invalid weight_decay value: {weight_decay!r} (must be a finite number >= 0).")


class DPAdam(DPOptimizer):
    """DP-Adam: Adam on the privatized gradient (L2 weight decay added to ``gtilde``).

    Args:
        lr, betas, eps, weight_decay: as ``torch.optim.Adam``.
        decoupled_weight_decay: decay the weights directly (``theta *= 1 - lr wd``, AdamW) instead of
            adding ``wd * theta`` to ``gtilde``; ``None`` keeps the class's default (False here, True
            for :class:`DPAdamW`). As ``torch.optim.Adam(decoupled_weight_decay=...)``, it is a group
            option, so every Adam-family rule (-BC, scale-then-privatize) gets it without a subclass.
        noise_multiplier, max_grad_norm, expected_batch_size, ...: see
            :class:`~dp_hf.optim.base.DPOptimizer`.

    Tuning (docs/optimizers.md): under DP noise the step per coordinate is about ``0.23 lr`` whatever ``C``;
    papers 1e-3 to 2e-3, the benchmark selected 1e-2 to 3e-2 (few, noisy steps). ``C = 1``.
    """

    #: The default of ``decoupled_weight_decay`` for this class.
    decoupled_weight_decay = False
    #: Whether the rule's denominator reads ``eps`` (then it must be > 0; DP-AdamBC's has none).
    uses_eps = True

    def add_param_group(self, param_group: dict) -> None:
        # Every group, with its own overrides: torch checks none of Adam's values (group betas (0.9, 1.5)
        # gave NaN weights), and __init__ saw only the defaults.
        group = {**self.defaults, **param_group}  # checked before it is added: a refused group is not kept
        check_adam_hyperparameters(
            group["betas"], group["eps"], group["weight_decay"], eps_may_be_zero=not self.uses_eps
        )
        super().add_param_group(param_group)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        decoupled_weight_decay: bool | None = None,
        extra_defaults: dict | None = None,
        **dp_kwargs,
    ) -> None:
        check_adam_hyperparameters(betas, eps, weight_decay, eps_may_be_zero=not self.uses_eps)
        if decoupled_weight_decay is None:
            decoupled_weight_decay = type(self).decoupled_weight_decay
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=bool(decoupled_weight_decay),
            **(extra_defaults or {}),
        )
        super().__init__(params, defaults, **dp_kwargs)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:  # lazy, as in torch
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return state

    def denominators(
        self, group: dict, params: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], steps: list[float]
    ):
        """``sqrt(vhat) + eps = sqrt(v) / sqrt(1 - beta2^t) + eps`` per tensor (torch's single-tensor order)."""
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        if steps.count(steps[0]) == len(steps):  # one scalar for the group: the usual case
            torch._foreach_div_(denoms, math.sqrt(1 - group["betas"][1] ** steps[0]))
        else:
            torch._foreach_div_(denoms, [math.sqrt(1 - group["betas"][1] ** t) for t in steps])
        torch._foreach_add_(denoms, group["eps"])
        return denoms

    def update(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            if params:
                self.adam_step(group, params, [self.privatized_grad(p) for p in params])

    def adam_step(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """One Adam step of ``params`` on ``grads`` (shared by the Adam variants).

        Multi-tensor (``torch._foreach_*``) over the group; the bias corrections and the step size
        ``lr / (1 - beta1^t)`` are computed once per group when every tensor is at the same step.
        """
        beta1, beta2 = group["betas"]
        lr, weight_decay = group["lr"], group["weight_decay"]
        states = [self._state(p) for p in params]
        step = advance_steps([state["step"] for state in states])
        if self._fused_step(group, params, grads, states, step):
            return
        weights = FP32Params(params)
        steps = [step] * len(params) if isinstance(step, float) else step
        exp_avgs = [state["exp_avg"] for state in states]
        exp_avg_sqs = [state["exp_avg_sq"] for state in states]
        if weight_decay != 0:
            if group.get("decoupled_weight_decay", self.decoupled_weight_decay):
                torch._foreach_mul_(weights.tensors, 1 - lr * weight_decay)
            else:
                grads = torch._foreach_add(grads, weights.tensors, alpha=weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denoms = self.denominators(group, params, exp_avg_sqs, steps)
        if isinstance(step, float):
            torch._foreach_addcdiv_(weights.tensors, exp_avgs, denoms, value=-lr / (1 - beta1**step))
        else:
            torch._foreach_addcdiv_(weights.tensors, exp_avgs, denoms, [-lr / (1 - beta1**t) for t in steps])
        weights.write_back()

    def _fused_step(
        self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict], step
    ) -> bool:
        """torch's fused Adam/AdamW kernel (``torch._fused_adam(w)_``, what ``fused=True`` runs) where it
        applies, else False. The same update in one kernel instead of ~8 multi-tensor passes (the plain
        Trainer's default optimizer is this kernel): contiguous float32 parameters and gradients on one
        CPU or CUDA device, one step count, and the plain Adam denominator (the -BC variants override
        :meth:`denominators`)."""
        fused = _FUSED.get(bool(group.get("decoupled_weight_decay", self.decoupled_weight_decay)))
        device = params[0].device
        if (
            fused is None
            or type(self).denominators is not DPAdam.denominators
            or not isinstance(step, float)
            or device.type not in ("cpu", "cuda")
            or any(p.dtype != torch.float32 or p.device != device or not p.is_contiguous() for p in params)
            or any(g.dtype != torch.float32 or not g.is_contiguous() for g in grads)
        ):
            return False
        beta1, beta2 = group["betas"]
        # The kernel reads the step (already advanced) from a tensor on the parameters' device.
        steps = [torch.full((), step, dtype=torch.float32, device=device)] * len(params)
        fused(
            [p.data for p in params],
            grads,
            [state["exp_avg"] for state in states],
            [state["exp_avg_sq"] for state in states],
            [],
            steps,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=False,
            maximize=False,
        )
        return True


# decoupled weight decay -> torch's fused kernel (absent from builds without it: then multi-tensor ops)
_FUSED = {
    flag: kernel
    for flag, kernel in (
        (True, getattr(torch, "_fused_adamw_", None)),
        (False, getattr(torch, "_fused_adam_", None)),
    )
    if kernel is not None
}


class DPAdamW(DPAdam):
    """DP-AdamW: AdamW on the privatized gradient (decoupled weight decay, default 0.01 as in torch)."""

    decoupled_weight_decay = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **kw,
    ):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kw)
