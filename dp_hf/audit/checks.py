"""The white-box audit's two direct checks besides the epsilon bound: the noise level and the canary signal.

Both read the release in the clipping coordinates ``z_t = (gtilde_t - c) / s * B / C`` of
:mod:`dp_hf.audit.whitebox`, where a correct implementation adds ``N(0, sigma^2)`` noise, independent
over coordinates and steps, and each included, sampled canary adds exactly its unit direction ``u_j``.
Each check's false-alarm rate (the probability that a correct implementation fails it) is at most
``1e-6`` per audit, by the union bound over the tests below; neither needs the one-run bound's
looseness, so each catches what the bound alone cannot at a few hundred canaries.

**Noise** (:func:`noise_check`), on ``n`` probe coordinates (touched by no example) over ``T`` steps:

* the pooled level ``sigmahat^2 = sum_{t,i} z_t[i]^2 / (n T)``: with noise of std ``sigma >= sigma_claimed``,
  ``n T sigmahat^2 / sigma^2`` is ``chi^2_{n T}``, so ``P[sigmahat / sigma_claimed < tau] <= alpha / 2`` for
  the **tolerance** ``tau = sqrt(chi2.ppf(alpha / 2, n T) / (n T))`` (``alpha = NOISE_FALSE_ALARM``; 0.989
  for ``n = 1024, T = 100``, 0.894 for one step: a noise multiplier 0.8 of the claim fails at every ``T``);
* each step's level, and each difference of two consecutive steps over ``sqrt 2`` (noise reused across
  steps cancels there), against the floor ``f = sqrt(chi2.ppf(alpha / (4 T), n) / n)``: at most ``2 T``
  tests at ``alpha / (4 T)`` each, ``alpha / 2`` in all. This catches noise missing in a few steps,
  which barely moves the pooled level.

The reported ratio is ``min(pooled, tau * weakest_step / f)``: the run's measured over claimed noise
multiplier, unless a step falls below its own floor; the audit fails when it is below ``tau``.

**Canary signal** (:func:`signal_limit`): the mean ``Sbar`` of ``z_t . u_j`` over the ``N`` pairs
(step, canary) in which an included canary was sampled. A correct implementation clips the canary (norm
``A C``) to ``C`` and the flat norm over all tensors, so each term is ``1 + N(0, sigma^2)`` and
``Sbar ~ N(1, sigma^2 / N)``. With ``sigma_up = sigmahat sqrt(n T / chi2.ppf(alpha / 2, n T))`` (above the
true ``sigma`` except with probability ``alpha / 2``), the **limit** is
``1 + Phi^{-1}(1 - alpha / 2) sigma_up / sqrt(N) + SIGNAL_SLACK``, exceeded by a correct implementation
with probability at most ``alpha``. ``SIGNAL_SLACK`` (1e-3) covers float32 rounding of an unnoised release.
Clipping to ``2 C``, or each of ``k`` tensors separately to ``C`` (``sqrt k C`` for a canary spread over
``k`` tensors), gives ``Sbar = 2``: with ``sigma = 10`` and ``N = 25,000`` the limit is about 1.31.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import chi2, norm

__all__ = [
    "NOISE_FALSE_ALARM",
    "SIGNAL_FALSE_ALARM",
    "SIGNAL_SLACK",
    "NoiseCheck",
    "noise_check",
    "noise_tolerance",
    "signal_limit",
]

#: Probability that correct noise fails :func:`noise_check` (per audit).
NOISE_FALSE_ALARM = 1e-6
#: Probability that a correct implementation's canary signal exceeds :func:`signal_limit` (per audit).
SIGNAL_FALSE_ALARM = 1e-6
#: Added to the signal limit for float32 rounding (the release of a noiseless run is exact to ~1e-6).
SIGNAL_SLACK = 1e-3


@dataclass(frozen=True)
class NoiseCheck:
    """Outcome of :func:`noise_check`; ``ratio is None`` when no noise multiplier was claimed."""

    ratio: float | None  # measured / claimed, or the weakest step's relative to its floor (see module)
    tolerance: float  # tau: the ratio a correct implementation stays above except w.p. NOISE_FALSE_ALARM
    pooled: float  # sigmahat, the noise level of the whole run (absolute, in the clipping coordinates)

    @property
    def passed(self) -> bool:
        return self.ratio is None or self.ratio >= self.tolerance


def _chi_quantile(dof: int, p: float) -> float:
    """``sqrt(chi2.ppf(p, dof) / dof)``: the level ``sigmahat / sigma`` that the root mean square of ``dof``
    values of noise ``N(0, sigma^2)`` falls below with probability ``p``."""
    return math.sqrt(chi2.ppf(p, dof) / dof)


def noise_tolerance(num_probes: int, steps: int, false_alarm: float = NOISE_FALSE_ALARM) -> float:
    """``tau = sqrt(chi2.ppf(false_alarm / 2, n T) / (n T))``, the pooled check's threshold (module docstring)."""
    return _chi_quantile(num_probes * steps, false_alarm / 2)


def noise_check(
    probe_noise: np.ndarray, claimed_sigma: float | None, false_alarm: float = NOISE_FALSE_ALARM
) -> NoiseCheck:
    """Check ``[steps, probes]`` release values on the probes against ``claimed_sigma`` (module docstring)."""
    steps, n = probe_noise.shape
    tau = noise_tolerance(n, steps, false_alarm)
    pooled = float(np.sqrt(np.mean(probe_noise**2)))
    if claimed_sigma is None or not claimed_sigma > 0:
        return NoiseCheck(None, tau, pooled)
    levels = np.sqrt(np.mean(probe_noise**2, axis=1))
    differences = np.sqrt(np.mean(np.diff(probe_noise, axis=0) ** 2, axis=1)) / math.sqrt(2)
    floor = _chi_quantile(n, false_alarm / (4 * steps))
    weakest = min(float(levels.min()), float(differences.min()) if len(differences) else math.inf)
    ratio = min(pooled, tau * weakest / floor) / claimed_sigma
    return NoiseCheck(float(ratio), tau, pooled)


def signal_limit(
    count: int, sigma_hat: float, num_noise_samples: int, false_alarm: float = SIGNAL_FALSE_ALARM
) -> float | None:
    """The largest mean canary signal a correct implementation gives except w.p. ``false_alarm``.

    ``count``: sampled inclusions ``N``; ``sigma_hat``: the pooled noise level measured on
    ``num_noise_samples = n T`` probe values. None when no included canary was ever sampled.
    """
    if count < 1:
        return None
    sigma_up = sigma_hat / _chi_quantile(num_noise_samples, false_alarm / 2)
    return 1.0 + float(norm.isf(false_alarm / 2)) * sigma_up / math.sqrt(count) + SIGNAL_SLACK
