"""DP-AdamBC (Tang et al.) and DP-AdamW-BC (Chooi et al.): Adam with the DP noise removed from ``vhat``.

The privatized gradient ``gtilde`` carries Gaussian noise of per-coordinate
variance ``Phi = (sigma C / B)^2``, which inflates Adam's second moment by the
same constant. The bias-corrected rule subtracts it (ALGORITHMS.md §2)::

    m = beta1 m + (1 - beta1) gtilde          v = beta2 v + (1 - beta2) gtilde^2
    mhat = m / (1 - beta1^t)                  vhat = v / (1 - beta2^t)
    vcorr = max(vhat - Phi, gamma')
    theta -= lr * (mhat / sqrt(vcorr) + wd * theta)      # wd: AdamW-BC only (decoupled)

There is no ``eps``: ``gamma'`` (default ``1e-8``) is the only floor, so the
largest per-coordinate step is ``lr * |mhat| / sqrt(gamma')``. ``Phi`` depends
only on public quantities (``sigma``, ``C``, ``B``): no privacy cost. Privatizer
geometry: ``c = 0``, ``s = 1``, the user's ``C``.

Both are :class:`~dp_hf.optim.adam.DPAdam` / :class:`~dp_hf.optim.adam.DPAdamW`
with :meth:`DPAdamBC.denominators` replaced; everything else (state layout,
foreach update, weight decay) is the parent's.
"""

from __future__ import annotations

import torch

from dp_hf.optim.adam import DPAdam, DPAdamW
from dp_hf.validation import check_positive_finite


def check_gamma_prime(gamma_prime: float) -> float:
    """``gamma'`` floors a variance under a square root in a denominator: it must be > 0."""
    return check_positive_finite("gamma_prime", gamma_prime, "the floor of the bias-corrected second moment")


class DPAdamBC(DPAdam):
    """DP-AdamBC: DP-Adam whose denominator is ``sqrt(max(vhat - (sigma C / B)^2, gamma'))``.

    Args:
        lr, betas: as ``torch.optim.Adam``.
        weight_decay: L2 penalty added to ``gtilde`` as in ``torch.optim.Adam``
            (DP-AdamBC proper has ``0``, the default).
        gamma_prime: ``gamma'``, floor of the corrected second moment (> 0).
        noise_multiplier, max_grad_norm, expected_batch_size, ...: see
            :class:`~dp_hf.optim.base.DPOptimizer`.

    No ``eps`` is accepted: the rule has none.

    Tuning (docs/optimizers.md): without ``eps`` the step can reach ``lr |mhat| / sqrt(gamma')``: keep ``lr``
    about 10x below DP-Adam's (papers 1e-4 to 4e-4); ``gamma'`` is the one floor (default 1e-8).
    """

    uses_eps = False
    #: Keywords the parents take that this rule does not (DPTrainer passes its adam_epsilon only where taken).
    keywords_not_taken = frozenset({"eps"})

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        gamma_prime: float = 1e-8,
        **dp_kwargs,
    ) -> None:
        if "eps" in dp_kwargs:
            raise TypeError(
                f"{type(self).__name__} has no eps (got eps={dp_kwargs['eps']!r}): gamma_prime is the floor of its "
                "corrected second moment. Pass gamma_prime instead."
            )
        gamma_prime = check_gamma_prime(gamma_prime)
        extra = dict(dp_kwargs.pop("extra_defaults", None) or {}, gamma_prime=gamma_prime)
        # eps=0 keeps the parent's validation and group layout; the denominators below never read it.
        super().__init__(
            params, lr=lr, betas=betas, eps=0.0, weight_decay=weight_decay, extra_defaults=extra, **dp_kwargs
        )

    def add_param_group(self, param_group: dict) -> None:
        # A group's own gamma_prime too (torch checks none; gamma_prime <= 0 lets a denominator reach 0).
        check_gamma_prime({**self.defaults, **param_group}["gamma_prime"])
        super().add_param_group(param_group)

    @property
    def noise_variance(self) -> float:
        """``Phi = (sigma C / B)^2``, the per-coordinate variance of the noise in ``gtilde``."""
        if self.noise_multiplier == 0:
            return 0.0  # also when C = inf (non-private check runs): 0 * inf is not 0 in floats
        return (self.noise_multiplier * self.max_grad_norm / self.expected_batch_size) ** 2

    def denominators(
        self, group: dict, params: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], steps: list[float]
    ):
        """``sqrt(max(v / (1 - beta2^t) - Phi, gamma'))`` per tensor (no ``eps``)."""
        beta2 = group["betas"][1]
        vcorr = torch._foreach_div(exp_avg_sqs, [1 - beta2**t for t in steps])
        phi = self.noise_variance
        if phi != 0:
            torch._foreach_sub_(vcorr, phi)
        torch._foreach_clamp_min_(vcorr, group["gamma_prime"])
        torch._foreach_sqrt_(vcorr)
        return vcorr


class DPAdamWBC(DPAdamBC, DPAdamW):
    """DP-AdamW-BC: :class:`DPAdamBC` with AdamW's decoupled weight decay (default ``0.01``).

    ``theta *= 1 - lr wd`` before the bias-corrected step, i.e.
    ``theta -= lr * (mhat / sqrt(vcorr) + wd * theta)`` with ``theta`` of step ``t-1``.
    """

    decoupled_weight_decay = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 1e-2,
        gamma_prime: float = 1e-8,
        **dp_kwargs,
    ) -> None:
        super().__init__(
            params, lr=lr, betas=betas, weight_decay=weight_decay, gamma_prime=gamma_prime, **dp_kwargs
        )
