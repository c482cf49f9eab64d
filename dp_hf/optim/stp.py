"""Scale-then-privatize (Ganesh, McMahan & Thakurta, Algorithm 8): Adam clipped in Adam's own geometry.

The privatizer of ALGORITHMS.md §1 runs in the geometry ``c = 0``, ``s = s_t`` taken from Adam's
bias-corrected second moment of step ``t-1``; the user's clip norm ``C`` is fixed::

    u_t   = sqrt(vhat_{t-1}) + gamma_s                      (u_1: none yet, s_1 = 1)
    w_i   = g_i / s_t ;   wbar_i = w_i * min(1, C / ||w_i||)
    gtilde = s_t * (sum_i wbar_i + N(0, sigma^2 C^2 I)) / B

followed by the ordinary Adam (or AdamW) update on ``gtilde``. Two forms of ``s_t``:

``scale_mode="rms"`` (the default; a deviation from the paper, see below)::

    uhat = u_t / RMS(u_t)                 RMS over ALL trainable coordinates together
    s_t  = (uhat + scale_floor) / RMS(uhat + scale_floor)          so RMS(s_t) = 1

``scale_mode="raw"`` (the paper's Algorithm 8 and ALGORITHMS.md §2 exactly): ``s_t = u_t``.

Why the raw form stalls with ordinary clip norms
-------------------------------------------------
Write ``rho_t^2 = ||wtilde_t||^2 / d`` for the mean square per coordinate of the released
gradient in the ``w`` coordinates. When the examples are clipped (``||g_i / s_t|| > C``, the usual
case), ``wbar_i = C w_i / ||w_i||`` does not depend on the overall magnitude of ``s_t``, so neither
does ``rho_t``: ``rho_t^2 ~ (sigma C / B)^2 + ||mean_i wbar_i||^2 / d``. But ``gtilde = s_t * wtilde``
does, and ``s_{t+1}`` is computed from it: with ``s_t^2 ~ vhat_{t-1}`` the bias-corrected average
gives, while ``t << 1 / (1 - beta2)``::

    vhat_t ~ ((t - 1) vhat_{t-1} + s_t^2 wtilde_t^2) / t  =  vhat_{t-1} (1 - (1 - rho^2) / t)
    =>  vhat_t ~ t^-(1 - rho^2),   s_t ~ t^-(1 - rho^2)/2

and, for ``t >> 1 / (1 - beta2)``, a factor ``beta2 + (1 - beta2) rho^2`` per step: the scale decays
(``rho < 1``) or grows (``rho > 1``) without bound, and is stationary only at ``rho ~ 1``, i.e.
``C ~ B / sigma`` in the noise-dominated regime. Adam's step ``|mhat| / sqrt(vhat)`` then shrinks to
about ``rho`` times DP-Adam's (``~ 0.23 = sqrt((1 - beta1) / (1 + beta1))`` on noise): measured on the
digits ViT at ``sigma = 2.6, B = 256, C = 1`` (``rho ~ 0.01``), the mean of ``s`` fell from 0.0026 at
step 10 to 0.0011 at step 60 (``t^-1/2``) and the update over the learning rate from 1.0 to 0.003, against
0.23 for DP-AdamW; the model stays near chance whatever the learning rate. The paper's Section 4.3.1
analysis assumes the unclipped regime (``gtilde = g + s sigma C / B xi``, stationary for
``sigma C / B < 1``); but at its fixed point ``s ~ sqrt(E g^2)`` the scaled norm is
``||g_i / s|| ~ sqrt(d)``, so "unclipped" needs ``C >~ sqrt(d)`` and hence ``B >~ sigma sqrt(d)``
(about 700 for a 69K-parameter model at ``sigma = 2.6``) -- not ordinary settings.

The fix and why it is principled
--------------------------------
``scale_mode="rms"`` fixes the overall scale of the geometry and lets Adam's statistics choose only
its shape: ``RMS(s_t) = 1`` at every step, as at ``t = 1`` (``s_1 = 1``), so the magnitude of
``gtilde`` no longer feeds back into the next ``s``. It changes neither the shape the paper argues
for (``s`` proportional to ``sqrt(vhat)``; in Section 4.3.1 only proportionality matters) nor
Adam's update, and it gives ``C`` the meaning it has for DP-Adam: at the shape's fixed point
``s_j ~ |g_j|``, ``||g / s|| = ||g||`` exactly when ``RMS(s) = 1``. The noise in ``gtilde`` has
per-coordinate std ``s_j sigma C / B`` with ``sum_j s_j^2 = d``: DP-Adam's total noise power,
redistributed along Adam's geometry.

``scale_floor`` (``lambda``, default ``0.3``) is the relative form of ``gamma_s``: under pure noise
``E[wtilde_j^2]`` is the same for every coordinate, so the shape is neutral and keeps the random
shape of the first, noise-dominated steps (``s_2`` is ``|gtilde_1|``, a single draw) for about
``1 / ((1 - beta2) SNR)`` steps. Coordinates where that draw was near zero would then get
``w_ij = g_ij / s_j`` huge, dominate ``||w_i||``, and clip every example through them (digits ViT,
validation accuracy at the best lr, epsilon 1 / 8: 0.18 / 0.73 with ``scale_floor = 0``, 0.67 / 0.86 with
0.3, 0.66 / 0.85 with 10; docs/optimizers.md). The floor
bounds ``s_j >= lambda / (1 + lambda)`` (since ``RMS(uhat + lambda) <= 1 + lambda``), hence
``||g / s|| <= (1 + 1 / lambda) ||g||``; ``lambda -> inf`` is DP-Adam's isotropic geometry.
Being relative, it is invariant to the scale of the loss, which the absolute ``gamma_s`` is not.

Privacy: ``s_t`` is a function of ``vhat_{t-1}`` (Adam's state, built from earlier privatized
``gtilde`` only) and public constants; the RMS is over that same state, so the normalization is
post-processing and costs nothing. ``C`` is fixed, every ``wbar_i`` has norm ``<= C`` in the ``w``
coordinates, the noise there is ``N(0, sigma^2 C^2 I)`` added once, and ``gtilde = s_t * wtilde`` is
the privatizer's own output: the Gaussian mechanism with sensitivity ``C`` (add/remove), so the
accountant's ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), T)`` holds unchanged: DP-SGD's cost
with the same ``(q, sigma, T)``, in both forms.

Hyperparameters: ``lr`` as DP-Adam's (1e-3 to 3e-2; the step has DP-Adam's size in the ``rms``
form), ``C`` as DP-Adam's (``1`` as in the papers); ``gamma_s`` (absolute, default ``1e-8``, the
``eps`` of jax_privacy's ``scale_then_privatize``) hardly matters in the ``rms`` form. In the ``raw``
form ``C`` must be re-tuned near ``B / sigma`` and ``gamma_s`` tuned with it (the paper tunes lr,
``gamma_s`` and ``C``); the constructor warns when ``C`` is far from that regime. Unlike
jax_privacy (raw ``nu``, so ``1 / eps`` at the first step), both forms use the bias-corrected
``vhat_{t-1}`` and ``s_1 = 1`` (ALGORITHMS.md).

On bench/fidelity.py (test metric, 3 seeds, lr chosen on validation): the ``rms`` form ties DP-AdamW
on the digits ViT (0.657 / 0.784 / 0.874 accuracy at epsilon 1 / 3 / 8, DP-AdamW 0.645 / 0.788 / 0.869)
and beats DP-Adam on the synthetic masked LM at every epsilon (in all 9 paired runs); the ``raw``
form stays at chance on digits with ``C = 1`` (0.10-0.12) and reaches 0.17 / 0.48 / 0.76 with
``C = B / sigma``.
"""

from __future__ import annotations

import math
import warnings

import torch

from dp_hf.optim._params import step_values
from dp_hf.optim.adam import DPAdam, DPAdamW
from dp_hf.privatizer import Geometry
from dp_hf.validation import check_positive_finite

SCALE_MODES = ("rms", "raw")
#: Default ``scale_floor`` of the ``rms`` form (see the module docstring).
DEFAULT_SCALE_FLOOR = 0.3


def check_gamma_s(gamma_s: float) -> float:
    """``gamma_s`` keeps the scale ``s`` strictly positive: it must be > 0."""
    return check_positive_finite(
        "gamma_s", gamma_s, "the stability constant of the clipping geometry, s = sqrt(vhat) + gamma_s"
    )


def check_scale_mode(scale_mode: str, scale_floor: float | None) -> tuple[str, float]:
    """Validate ``scale_mode`` / ``scale_floor``; returns them with the floor's default filled in."""
    if scale_mode not in SCALE_MODES:
        raise ValueError(
            f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}: 'rms' normalizes the clipping "
            "geometry to RMS 1 (default), 'raw' is the paper's s = sqrt(vhat) + gamma_s."
        )
    if scale_mode == "raw":
        if scale_floor not in (None, 0, 0.0):
            raise ValueError(
                f"scale_floor={scale_floor!r} applies to scale_mode='rms' only; the raw form has gamma_s."
            )
        return scale_mode, 0.0
    if scale_floor is None:
        return scale_mode, DEFAULT_SCALE_FLOOR
    if (
        not isinstance(scale_floor, (int, float))
        or isinstance(scale_floor, bool)
        or not math.isfinite(scale_floor)
        or scale_floor < 0
    ):
        raise ValueError(
            f"scale_floor must be a finite number >= 0 (the relative floor of the normalized scale), "
            f"got {scale_floor!r}."
        )
    return scale_mode, float(scale_floor)


def raw_scale_drift(noise_multiplier: float, max_grad_norm: float, expected_batch_size: float, numel: int):
    """``(rho_max, sigma C / B)`` for the raw form: ``rho_max^2 = (sigma C / B)^2 + C^2 / d``.

    ``rho_max`` bounds the per-coordinate RMS of the released gradient in the scaled coordinates
    when examples are clipped; the raw scale decays like ``t^-(1 - rho^2)/2`` for ``rho < 1`` and
    grows for ``rho > 1`` (module docstring).
    """
    noise = noise_multiplier * max_grad_norm / expected_batch_size
    return math.sqrt(noise**2 + max_grad_norm**2 / max(numel, 1)), noise


class ScaleThenPrivatize:
    """Scale-then-privatize as a wrapper: put it before any Adam-family rule (DP-Adam, DP-AdamW, -BC).

    It replaces only the clipping geometry (``c = 0``, ``s_t`` from the rule's own ``vhat_{t-1}``);
    the update rule, its state and its hyperparameters are the wrapped class's, so
    ``scale_then_privatize(DPAdamBC)`` combines bias correction with scale-then-privatize, and the
    decoupled weight decay of DP-AdamW is the usual group option. Keyword arguments: ``gamma_s``,
    ``scale_mode``, ``scale_floor`` (see :class:`DPAdamSTP`); everything else goes to the rule.
    """

    identity_geometry = False  # clips g / s_t: needs per-example gradients, not only norms

    def __init__(
        self,
        params,
        *args,
        gamma_s: float = 1e-8,
        scale_mode: str = "rms",
        scale_floor: float | None = None,
        **kwargs,
    ) -> None:
        gamma_s = check_gamma_s(gamma_s)
        self.scale_mode, self.scale_floor = check_scale_mode(scale_mode, scale_floor)
        kwargs["extra_defaults"] = dict(kwargs.pop("extra_defaults", None) or {}, gamma_s=gamma_s)
        super().__init__(params, *args, **kwargs)
        if self.scale_mode == "raw":
            self._warn_raw_drift()

    def add_param_group(self, param_group: dict) -> None:
        # A group's own gamma_s too (torch checks none; gamma_s <= 0 lets the scale s reach 0 or below).
        check_gamma_s({**self.defaults, **param_group}["gamma_s"])
        super().add_param_group(param_group)

    def _warn_raw_drift(self) -> None:
        clip, sigma = self.max_grad_norm, self.noise_multiplier
        if self.disable_dp or not math.isfinite(clip):
            return  # no clipping: the unclipped regime of the paper's analysis
        numel = sum(p.numel() for p in self.trainable_params())
        rho_max, noise = raw_scale_drift(sigma, clip, self.expected_batch_size, numel)
        balanced = self.expected_batch_size / sigma if sigma > 0 else math.inf
        if rho_max < 0.5:
            warnings.warn(
                f"scale-then-privatize with scale_mode='raw': the released gradient has a per-coordinate RMS "
                f"of at most {rho_max:.3g} in the scaled coordinates (sigma*C/B = {noise:.3g}, C/sqrt(d) = "
                f"{clip / math.sqrt(max(numel, 1)):.3g}), so the clipping scale s = sqrt(vhat) + gamma_s "
                f"shrinks step after step (about t^-{(1 - rho_max**2) / 2:.2f}) and the Adam step with it: "
                f"training stalls. Use the default scale_mode='rms', or a clip norm near B/sigma = "
                f"{balanced:.3g}.",
                UserWarning,
                stacklevel=3,
            )
        elif noise > 2.0:
            warnings.warn(
                f"scale-then-privatize with scale_mode='raw': sigma*C/B = {noise:.3g} > 1, so the clipping "
                f"scale s = sqrt(vhat) + gamma_s grows step after step (the noise feeds the next scale). Use "
                f"the default scale_mode='rms', or a clip norm near B/sigma = {balanced:.3g}.",
                UserWarning,
                stacklevel=3,
            )

    def raw_scales(self, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """``u = sqrt(v_{t-1} / (1 - beta2^{t-1})) + gamma_s`` per tensor (``None``: not stepped yet), in three
        multi-tensor ops (one host read of the steps)."""
        group_of = {p: group for group in self.param_groups for p in group["params"]}
        states = [self.state.get(p) for p in params]  # .get: no state entries for params never stepped
        held = [k for k, state in enumerate(states) if state]
        steps = dict(zip(held, step_values([states[k]["step"] for k in held])))
        stepped = [k for k in held if steps[k] != 0]  # the others: identity, s_1 = 1
        scales: list[torch.Tensor | None] = [None] * len(params)
        if stepped:
            groups = [group_of[params[k]] for k in stepped]
            divisors = [1 - group["betas"][1] ** steps[k] for k, group in zip(stepped, groups)]
            vhats = torch._foreach_div([states[k]["exp_avg_sq"] for k in stepped], divisors)
            torch._foreach_sqrt_(vhats)
            torch._foreach_add_(vhats, [group["gamma_s"] for group in groups])
            for k, u in zip(stepped, vhats):
                scales[k] = u
        return scales

    def geometry(self, params: list[torch.Tensor]) -> Geometry:
        """``c = 0``; ``s = u`` (raw) or ``u`` normalized to RMS 1 with the relative floor (rms)."""
        scales = self.raw_scales(params)
        if self.scale_mode == "rms":
            scales = normalize_scales(scales, self.scale_floor)
        return Geometry(max_grad_norm=self.max_grad_norm, scale=scales)


def normalize_scales(scales: list[torch.Tensor | None], floor: float) -> list[torch.Tensor | None]:
    """``(u / RMS(u) + floor) / RMS(u / RMS(u) + floor)``, one RMS over every non-``None`` tensor.

    ``None`` entries (tensors not stepped yet, ``s = 1``) stay ``None`` and do not enter the RMS.
    Both sums (``sum u^2``, ``sum u``: its 1-norm, ``u > 0``) are two multi-tensor norms per tensor
    (float64 output; CUDA's kernel accumulates float32 within a tensor, a ~1e-6 relative change of the
    scales, which are post-processing of private state) summed over the tensors in float64; with
    ``u >= gamma_s > 0`` the result is strictly positive and finite.
    """
    live = [u for u in scales if u is not None]
    if not live:
        return scales
    device = live[0].device
    numel = sum(u.numel() for u in live)
    # sum u^2 and sum u (= the 1-norm: u > 0) per tensor in float64, two multi-tensor reductions
    norms = [torch._foreach_norm(live, order, dtype=torch.float64) for order in (2, 1)]
    two_norms, total = (torch.stack([n.to(device) for n in per_tensor]) for per_tensor in norms)
    rms = (two_norms.square().sum() / numel).sqrt()
    mean_hat = total.sum() / (numel * rms)  # mean of uhat = u / rms; RMS(uhat) = 1
    rms_floored = (1.0 + 2.0 * floor * mean_hat + floor * floor).sqrt()
    normalized = []  # (u / rms + floor) / rms_floored, three multi-tensor ops per device
    for members in _by_device(live).values():
        out = torch._foreach_div(members, rms.to(members[0].device).float())
        torch._foreach_add_(out, floor)
        torch._foreach_div_(out, rms_floored.to(members[0].device).float())
        normalized.extend(zip(members, out))
    by_input = {id(u): out for u, out in normalized}
    return [None if u is None else by_input[id(u)] for u in scales]


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups


def scale_then_privatize(rule: type[DPAdam]) -> type[DPAdam]:
    """``rule`` (an Adam-family DP optimizer class) with scale-then-privatize clipping."""
    if not (isinstance(rule, type) and issubclass(rule, DPAdam)):
        raise TypeError(f"scale_then_privatize needs an Adam-family dp_hf optimizer class, got {rule!r}.")
    if issubclass(rule, ScaleThenPrivatize):
        return rule
    return type(f"{rule.__name__}STP", (ScaleThenPrivatize, rule), {"__module__": rule.__module__})


class DPAdamSTP(ScaleThenPrivatize, DPAdam):
    """DP-Adam with scale-then-privatize clipping (normalized geometry by default).

    Args:
        lr, betas, eps, weight_decay: as ``torch.optim.Adam`` (``eps`` is the update's; the geometry
            uses ``gamma_s``). ``lr``: DP-Adam's range (1e-3 to 3e-2 on the benchmark).
        gamma_s: stability constant of ``u = sqrt(vhat_{t-1}) + gamma_s`` (absolute, default ``1e-8``).
        scale_mode: ``"rms"`` (default): ``s`` is ``u`` normalized to RMS 1 over all trainable
            coordinates, with the relative floor ``scale_floor``; ``C`` then has DP-Adam's meaning.
            ``"raw"``: ``s = u``, the paper's Algorithm 8 (ALGORITHMS.md §2); it learns only with
            ``C`` near ``B / sigma`` (see the module docstring), and warns otherwise.
        scale_floor: ``rms`` form only: ``s = (u / RMS(u) + scale_floor) / RMS(...)``, which bounds
            ``s >= scale_floor / (1 + scale_floor)`` (default ``0.3``; ``0`` disables the floor,
            large values approach DP-Adam's isotropic clipping).
        noise_multiplier, max_grad_norm, expected_batch_size, ...: see
            :class:`~dp_hf.optim.base.DPOptimizer` (``max_grad_norm`` bounds the norm in the
            scaled geometry: ``1`` as for DP-Adam in the ``rms`` form).

    The deviation from ALGORITHMS.md (the ``rms`` default) is post-processing of privatized state:
    the privacy cost is unchanged (module docstring).
    """


class DPAdamWSTP(ScaleThenPrivatize, DPAdamW):
    """DP-AdamW with scale-then-privatize clipping (decoupled weight decay, default ``0.01``)."""
