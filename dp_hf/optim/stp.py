"""Scale-then-privatize (Ganesh, McMahan & Thakurta, Algorithm 8): Adam clipped in Adam's own geometry.

The privatizer's geometry at step ``t`` comes from Adam's bias-corrected second
moment of step ``t-1`` (ALGORITHMS.md §1-2)::

    s_t = sqrt(vhat_{t-1}) + gamma_s        (s_1 = 1: no estimate yet)
    c_t = 0

    w_i    = g_i / s_t ;   wbar_i = w_i * min(1, C / ||w_i||)
    gtilde = s_t * (sum_i wbar_i + N(0, sigma^2 C^2 I)) / B

followed by the ordinary Adam (or AdamW) update on ``gtilde``. The clip norm
bounds ``||g_i / s_t||``, not ``||g_i||``: ``C`` must be re-tuned. Coordinates
with a large second moment are shrunk before the norm is taken, so they are
clipped less and receive proportionally more noise (``s_t`` times the noise of
the scaled space): noise follows the geometry Adam divides by.

``gamma_s`` is the stability constant of the clipping geometry, separate from
Adam's ``eps``. Its default ``1e-8`` is the default ``eps`` of jax_privacy's
``scale_then_privatize`` (the reference implementation; it is a hyperparameter
to tune: a large value makes the geometry isotropic again, a tiny one puts
almost no noise on coordinates that never had gradient). Unlike jax_privacy,
which uses the raw ``nu`` and so ``1 / eps`` at the first step, this follows
ALGORITHMS.md: bias-corrected ``vhat_{t-1}`` and ``s_1 = 1``.

Privacy: ``s_t`` depends only on earlier privatized gradients (post-processing),
so the cost is DP-SGD's with the same ``(q, sigma, T)``.
"""

from __future__ import annotations

import torch

from dp_hf.optim.adam import DPAdam, DPAdamW
from dp_hf.privatizer import Geometry
from dp_hf.validation import check_positive_finite


def check_gamma_s(gamma_s: float) -> float:
    """``gamma_s`` keeps the scale ``s`` strictly positive: it must be > 0."""
    return check_positive_finite(
        "gamma_s", gamma_s, "the stability constant of the clipping geometry, s = sqrt(vhat) + gamma_s"
    )


class DPAdamSTP(DPAdam):
    """DP-Adam with scale-then-privatize clipping.

    Args:
        lr, betas, eps, weight_decay: as ``torch.optim.Adam`` (``eps`` is the
            update's; the geometry uses ``gamma_s``).
        gamma_s: stability constant of the clipping scale ``sqrt(vhat_{t-1}) + gamma_s``.
        noise_multiplier, max_grad_norm, expected_batch_size, ...: see
            :class:`~dp_hf.optim.base.DPOptimizer` (``max_grad_norm`` bounds the
            norm in the scaled geometry).
    """

    identity_geometry = False  # clips g / s_t: needs per-example gradients, not only norms

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        gamma_s: float = 1e-8,
        **dp_kwargs,
    ) -> None:
        gamma_s = check_gamma_s(gamma_s)
        extra = dict(dp_kwargs.pop("extra_defaults", None) or {}, gamma_s=gamma_s)
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, extra_defaults=extra, **dp_kwargs
        )

    def geometry(self, params: list[torch.Tensor]) -> Geometry:
        """``c = 0``, ``s = sqrt(v_{t-1} / (1 - beta2^{t-1})) + gamma_s`` (``s = 1`` before any step)."""
        group_of = {p: group for group in self.param_groups for p in group["params"]}
        scales: list[torch.Tensor | None] = []
        for p in params:
            state = self.state.get(p)  # .get: do not create state entries for params never stepped
            step = float(state["step"]) if state else 0.0
            if step == 0:
                scales.append(None)  # identity: s_1 = 1
                continue
            group = group_of[p]
            vhat = state["exp_avg_sq"] / (1 - group["betas"][1] ** step)
            scales.append(vhat.sqrt_().add_(group["gamma_s"]))
        return Geometry(max_grad_norm=self.max_grad_norm, scale=scales)


class DPAdamWSTP(DPAdamSTP, DPAdamW):
    """DP-AdamW with scale-then-privatize clipping (decoupled weight decay, default ``0.01``)."""

    decoupled_weight_decay = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        gamma_s: float = 1e-8,
        **dp_kwargs,
    ) -> None:
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, gamma_s=gamma_s, **dp_kwargs
        )
