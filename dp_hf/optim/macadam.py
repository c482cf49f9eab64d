"""DP-MacAdam and DP-MacAdam-BC (Tasnim, Sankar & Kosut, Algorithm 1 and Sec. III-D).

One set of moment estimates drives both AdaClip-style coordinate-wise adaptive
clipping and Adam's update. The privatizer runs in the geometry
``c = mhat_{t-1}`` (``0`` at ``t = 1``), ``s = b_{t-1}``, ``C = 1`` (fixed: the
geometry sets the scale), so the noise in ``gtilde`` has per-coordinate variance
``b_{t-1}^2 sigma^2 / B^2``. Then, coordinate-wise (ALGORITHMS.md §2)::

    m = beta1 m + (1 - beta1) gtilde ;  v = beta2 v + (1 - beta2) gtilde^2
    mhat = m / (1 - beta1^t) ;          vhat = v / (1 - beta2^t)
    theta -= lr * mhat / (sqrt(vhat) + gamma)
    u = (gtilde - mhat)^2                                  # mhat of THIS step
    s = beta1 s + (1 - beta1) u
    kappa = 2 (beta1 - beta1^t) / (1 + beta1)
    shat = clamp(s / kappa - b_{t-1}^2 sigma^2 / B^2, h1, h2)
    b_t = shat^(1/4) * (sum_j shat_j^(1/2))^(1/2)          # j over ALL d trainable coordinates

with ``m = v = s = 0`` and ``b_0 = (1/d) 1``. At ``t = 1`` one sample has no
variance (``kappa_1 = 0``, ``u_1 = 0``): ``s_1 = 0`` and ``b_1 = b_0``. With
``h1 > 0`` every ``b_t`` is positive and finite, so every value stays finite.

DP-MacAdam-BC replaces the parameter update by DP-AdamBC's::

    theta -= lr * mhat / sqrt(max(vhat - Phi, gamma'))

The paper (Sec. III-D) uses ``Phi = (sigma / B)^2`` (``bc_phi="paper"``, the
default); ``bc_phi="per_coordinate"`` uses ``Phi = b_{t-1}^2 sigma^2 / B^2``, the
actual noise variance of ``gtilde``.

Defaults: ``h1 = 1e-9``, ``h2 = 1e-6`` are the paper's MNIST-MLP values
(Table I; its CIFAR-10 CNN uses ``h1 = 5e-5``, ``h2 = 1.0``); ``gamma = 1e-8``;
``betas = (0.9, 0.999)``.

State per trainable tensor: ``step``, ``exp_avg`` (m), ``exp_avg_sq`` (v),
``var_avg`` (s) and ``clip_scale`` (b), all float32. ``b`` is coupled across
tensors by the global sum, so :meth:`DPMacAdam.update` processes all param
groups together.

Privacy: ``mhat_{t-1}`` and ``b_{t-1}`` are functions of earlier privatized
gradients and public constants (post-processing), and every transformed example
has norm ``<= 1`` with noise ``N(0, sigma^2)`` on the sum: DP-SGD's cost with the
same ``(q, sigma, T)``.
"""

from __future__ import annotations

import math

import torch

from dp_hf.optim._params import FP32Params, advance_steps, step_values
from dp_hf.optim.adam import check_adam_hyperparameters
from dp_hf.optim.adambc import check_gamma_prime
from dp_hf.optim.base import DPOptimizer
from dp_hf.privatizer import Geometry
from dp_hf.validation import check_positive_finite

BC_PHI_CHOICES = ("paper", "per_coordinate")


def _check_macadam_group(group: dict) -> None:
    """DP-MacAdam's hyperparameters of one group (or the defaults), showing the bad value."""
    check_adam_hyperparameters(group["betas"], 0.0, 0.0, eps_may_be_zero=True)  # (betas only)
    h1 = check_positive_finite("h1", group["h1"], "lower clamp of the variance estimate")
    h2 = check_positive_finite("h2", group["h2"], "upper clamp of the variance estimate")
    if h1 > h2:
        raise ValueError(f"h1 must be <= h2, got h1={h1!r} > h2={h2!r}.")
    if "gamma_prime" in group:  # DP-MacAdam-BC's floor of the corrected second moment
        check_gamma_prime(group["gamma_prime"])
    gamma = group.get("gamma", 0.0)
    if not isinstance(gamma, (int, float)) or not gamma >= 0 or not math.isfinite(gamma):
        raise ValueError(
            f"gamma (the update's stability constant) must be a finite number >= 0, got {gamma!r}."
        )


class DPMacAdam(DPOptimizer):
    """DP-MacAdam: adaptive centered/scaled clipping with Adam momentum, ``C = 1``.

    Args:
        lr: learning rate ``eta``.
        betas: ``(beta1, beta2)``; ``beta1`` also drives the variance EMA ``s``.
        gamma: stability constant of the update ``mhat / (sqrt(vhat) + gamma)``.
        h1, h2: clamp of the variance estimate ``shat`` (``0 < h1 <= h2``).
        max_grad_norm: must be left out (or ``1``): the geometry fixes ``C = 1``.
        noise_multiplier, expected_batch_size, noise_seed, generator, secure_mode,
            distributed: see :class:`~dp_hf.optim.base.DPOptimizer`.

    Tuning (docs/optimizers.md): ``h1``/``h2`` clamp the variance estimate: the paper's MLP used (1e-9, 1e-6),
    its CNN and the demo (5e-5, 1.0); lr 1e-3 (paper) to 1e-2 (benchmark). Weak at very high noise (sigma ~ 6).
    """

    identity_geometry = False  # clips (g - mhat) / b: needs per-example gradients, not only norms
    adaptive_clipping = True  # C = 1 in the adaptive geometry: the user's clip norm does not apply

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        gamma: float = 1e-8,
        h1: float = 1e-9,
        h2: float = 1e-6,
        **dp_kwargs,
    ) -> None:
        self._init_macadam(params, dict(lr=lr, betas=betas, gamma=gamma, h1=h1, h2=h2), dp_kwargs)

    def _init_macadam(self, params, defaults: dict, dp_kwargs: dict) -> None:
        """Validation shared with :class:`DPMacAdamBC`, then the base constructor with ``C = 1``."""
        max_grad_norm = dp_kwargs.pop("max_grad_norm", None)
        if max_grad_norm is not None and max_grad_norm != 1:
            raise ValueError(
                f"DP-MacAdam fixes the clip norm C = 1 (its adaptive geometry sets the scale); got "
                f"max_grad_norm={max_grad_norm!r}. Leave it out."
            )
        _check_macadam_group(defaults)
        defaults["betas"] = tuple(defaults["betas"])
        for key in ("h1", "h2", "gamma"):
            if key in defaults:
                defaults[key] = float(defaults[key])
        super().__init__(params, defaults, max_grad_norm=1.0, **dp_kwargs)

    def add_param_group(self, param_group: dict) -> None:
        # A group's own betas, h1, h2 or gamma are checked too (h1 = NaN made every example's norm NaN: all
        # dropped; h1 = 0 clipped every example to almost nothing), before the group is added.
        _check_macadam_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ state
    def _group_of(self) -> dict[torch.Tensor, dict]:
        return {p: group for group in self.param_groups for p in group["params"]}

    def _state(self, p: torch.Tensor, num_coords: int) -> dict:
        state = self.state[p]
        if not state:  # lazy, as in torch; b_0 = 1/d needs d, the total trainable size
            zeros = dict(dtype=torch.float32, device=p.device)
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros(p.shape, **zeros)
            state["exp_avg_sq"] = torch.zeros(p.shape, **zeros)
            state["var_avg"] = torch.zeros(p.shape, **zeros)
            state["clip_scale"] = torch.full(p.shape, 1.0 / num_coords, **zeros)
        return state

    def geometry(self, params: list[torch.Tensor]) -> Geometry:
        """``c = mhat_{t-1}`` (``0`` at ``t = 1``), ``s = b_{t-1}``, ``C = 1``."""
        num_coords = sum(p.numel() for p in params)
        group_of = self._group_of()
        states = [self._state(p, num_coords) for p in params]
        # The shifts in one multi-tensor division.
        steps = step_values([state["step"] for state in states])
        started = [k for k, step in enumerate(steps) if step != 0]
        shifts: list[torch.Tensor | None] = [None] * len(params)
        if started:
            divisors = [1 - group_of[params[k]]["betas"][0] ** steps[k] for k in started]
            mhats = torch._foreach_div([states[k]["exp_avg"] for k in started], divisors)
            for k, mhat in zip(started, mhats):
                shifts[k] = mhat
        scales = [state["clip_scale"] for state in states]
        return Geometry(max_grad_norm=1.0, shift=shifts, scale=scales)

    # ------------------------------------------------------------------ rule
    def denominators(
        self, group: dict, vhats: list[torch.Tensor], prev_scales: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``sqrt(vhat) + gamma`` per tensor (DP-MacAdam-BC overrides it); may overwrite ``vhats``."""
        torch._foreach_sqrt_(vhats)
        torch._foreach_add_(vhats, group["gamma"])
        return vhats

    def update(self) -> None:
        noise_var_unit = (self.noise_multiplier / self.expected_batch_size) ** 2  # sigma^2 / B^2 (C = 1)
        params_all = self.trainable_params()
        num_coords = sum(p.numel() for p in params_all)
        pending_scales, pending_roots = [], []  # b and sqrt(shat) of tensors refreshed after the global sum
        for group in self.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            states = [self._state(p, num_coords) for p in params]
            step = advance_steps([state["step"] for state in states])
            steps = [step] * len(params) if isinstance(step, float) else step
            grads = [self.privatized_grad(p) for p in params]
            exp_avgs = [s["exp_avg"] for s in states]
            exp_avg_sqs = [s["exp_avg_sq"] for s in states]
            prev_scales = [s["clip_scale"] for s in states]  # b_{t-1}: updated in place only at the end

            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
            mhats = torch._foreach_div(exp_avgs, [1 - beta1**t for t in steps])
            vhats = torch._foreach_div(exp_avg_sqs, [1 - beta2**t for t in steps])

            weights = FP32Params(params)
            denoms = self.denominators(group, vhats, prev_scales)
            torch._foreach_addcdiv_(weights.tensors, mhats, denoms, value=-group["lr"])
            weights.write_back()

            # Variance estimate and next scale. At t = 1, u_1 = 0 and kappa_1 = 0: s_1 = 0, b_1 = b_0.
            later = [k for k, t in enumerate(steps) if t > 1]
            if not later:
                continue
            var_avgs = [states[k]["var_avg"] for k in later]
            b_prev = [prev_scales[k] for k in later]
            deviations = torch._foreach_sub([grads[k] for k in later], [mhats[k] for k in later])
            torch._foreach_mul_(var_avgs, beta1)  # s = beta1 s + (1 - beta1) (gtilde - mhat_t)^2
            torch._foreach_addcmul_(var_avgs, deviations, deviations, value=1 - beta1)
            kappas = [2 * (beta1 - beta1 ** steps[k]) / (1 + beta1) for k in later]
            shats = torch._foreach_div(var_avgs, kappas)
            torch._foreach_addcmul_(shats, b_prev, b_prev, value=-noise_var_unit)
            torch._foreach_clamp_min_(shats, group["h1"])
            torch._foreach_clamp_max_(shats, group["h2"])
            torch._foreach_sqrt_(shats)
            pending_scales += b_prev
            pending_roots += shats
        if pending_roots:
            # sum_j shat_j^(1/2) over ALL coordinates (every group): b couples every trainable tensor.
            # The roots are >= 0, so each tensor's sum is its L1 norm (one foreach call).
            device = pending_roots[0].device
            total = torch.stack([n.to(device) for n in torch._foreach_norm(pending_roots, ord=1)]).sum()
            # b = shat^(1/4) * (sum_j shat_j^(1/2))^(1/2), with shat^(1/4) = sqrt(sqrt(shat)).
            torch._foreach_sqrt_(pending_roots)
            torch._foreach_mul_(pending_roots, total.sqrt())
            torch._foreach_copy_(pending_scales, pending_roots)


class DPMacAdamBC(DPMacAdam):
    """DP-MacAdam-BC: DP-MacAdam with the update ``mhat / sqrt(max(vhat - Phi, gamma'))``.

    Args:
        lr, betas, h1, h2: as :class:`DPMacAdam`.
        gamma_prime: ``gamma'``, floor of the corrected second moment (> 0); the
            rule has no ``gamma``/``eps``.
        bc_phi: ``"paper"`` (default): ``Phi = (sigma / B)^2`` as in the paper,
            Sec. III-D; ``"per_coordinate"``: ``Phi = b_{t-1}^2 sigma^2 / B^2``,
            the actual per-coordinate noise variance of ``gtilde``.
        noise_multiplier, expected_batch_size, ...: see :class:`DPMacAdam`.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        h1: float = 1e-9,
        h2: float = 1e-6,
        gamma_prime: float = 1e-8,
        bc_phi: str = "paper",
        **dp_kwargs,
    ) -> None:
        gamma_prime = check_gamma_prime(gamma_prime)
        if bc_phi not in BC_PHI_CHOICES:
            raise ValueError(f"bc_phi must be one of {BC_PHI_CHOICES}, got {bc_phi!r}.")
        defaults = dict(lr=lr, betas=betas, h1=h1, h2=h2, gamma_prime=gamma_prime, bc_phi=bc_phi)
        self._init_macadam(params, defaults, dp_kwargs)

    def denominators(
        self, group: dict, vhats: list[torch.Tensor], prev_scales: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``sqrt(max(vhat - Phi, gamma'))`` per tensor (overwrites ``vhats``, which are temporaries)."""
        noise_var_unit = (self.noise_multiplier / self.expected_batch_size) ** 2
        vcorr = vhats
        if noise_var_unit != 0:
            if group["bc_phi"] == "paper":
                torch._foreach_sub_(vcorr, noise_var_unit)
            else:
                torch._foreach_addcmul_(vcorr, prev_scales, prev_scales, value=-noise_var_unit)
        torch._foreach_clamp_min_(vcorr, group["gamma_prime"])
        torch._foreach_sqrt_(vcorr)
        return vcorr
