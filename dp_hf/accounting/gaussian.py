"""One step's privacy loss of the Poisson-subsampled Gaussian mechanism on a grid: dp_accounting's
``GaussianPrivacyLoss`` (pessimistic, sensitivity 1) with its per-point loop vectorised.

:func:`gaussian_deltas` gives the hockey-stick divergences ``delta(epsilon)`` at the grid's losses from
which :func:`dp_hf.accounting.pld.one_step_pmf` builds the connect-the-dots PMF.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import scipy.special
from dp_accounting.pld import privacy_loss_mechanism

LOG_MASS_TRUNCATION_BOUND = -50.0  # from_gaussian_mechanism's default


def gaussian_loss(sigma: float, sample_rate: float, adjacency: Any) -> Any:
    return privacy_loss_mechanism.GaussianPrivacyLoss(
        sigma,
        sensitivity=1,
        pessimistic_estimate=True,
        log_mass_truncation_bound=LOG_MASS_TRUNCATION_BOUND,
        sampling_prob=sample_rate,
        adjacency_type=adjacency,
    )


def rounded_range(loss: Any, grid: float) -> tuple[int, int, int]:
    """``(rounded_lower, rounded_upper, points)`` of the connect-the-dots grid of a privacy loss."""
    bounds = loss.connect_dots_bounds()
    rounded_upper = math.ceil(bounds.epsilon_upper / grid)
    rounded_lower = math.floor(bounds.epsilon_lower / grid)
    return rounded_lower, rounded_upper, rounded_upper - rounded_lower + 1


def gaussian_deltas(
    loss: Any, epsilons: np.ndarray, sigma: float, sample_rate: float, adjacency: Any
) -> np.ndarray | None:
    """``GaussianPrivacyLoss.get_delta_for_epsilon(epsilons)`` (sensitivity 1), vectorised.

    The inverse privacy loss is the same chain of numpy operations as dp_accounting's scalar
    ``inverse_privacy_loss`` (``common.log_a_times_exp_b_plus_c``); ``None`` where that code would
    raise (the caller then runs it).
    """
    q = sample_rate
    deltas = np.zeros_like(epsilons, dtype=float)
    if q == 1.0:
        inverse = np.full_like(epsilons, True, dtype=bool)
    elif adjacency == privacy_loss_mechanism.AdjacencyType.ADD:
        inverse = epsilons < -math.log1p(-q)
    else:
        inverse = epsilons > math.log1p(-q)
        deltas[~inverse] = -np.expm1(epsilons[~inverse])
    losses = epsilons[inverse]
    if q == 1.0:
        x = -0.5 - losses * sigma**2
    else:
        add = adjacency == privacy_loss_mechanism.AdjacencyType.ADD
        limit = -math.log(1 - q) if add else math.log(1 - q)
        distance = np.abs(limit - losses)
        close = (losses == limit) | (distance <= abs(1e-9 * limit)) | (distance <= np.abs(1e-9 * losses))
        if np.any(~close & ((losses > limit) if add else (losses <= limit))):
            return None
        # log(a exp(b) + c) with a = 1/q, b = +-loss, c = 1 - 1/q (< 0): _log_sub(b + log a, log(-c))
        b = -losses if add else losses
        a, c = 1 / q, 1 - 1 / q
        shifted = b + np.log(a)
        log_minus_c = np.log(-c)
        if np.any(~close & (b != 0) & (log_minus_c >= shifted)):
            return None
        with np.errstate(invalid="ignore", divide="ignore"):
            without_subsampling = shifted + np.log1p(-np.exp(log_minus_c - shifted))
        without_subsampling[b == 0] = np.log(a + c)
        if add:
            without_subsampling = -without_subsampling
            x = 1 + (-0.5 - without_subsampling * sigma**2)
            x[close] = -math.inf
        else:
            x = -0.5 - without_subsampling * sigma**2
            x[close] = math.inf
    deltas[inverse] = mu_upper_cdf(x, sigma, q, adjacency) - np.exp(
        losses + mu_lower_log_cdf_of(x, sigma, q, adjacency)
    )
    return np.clip(deltas, 0, 1)


# GaussianPrivacyLoss.mu_upper_cdf / mu_lower_log_cdf (sensitivity 1) with the normal CDF of
# scipy.stats.norm(scale=sigma) called as the special functions it evaluates, without its overhead.


def mu_upper_cdf(x: np.ndarray, sigma: float, q: float, adjacency: Any) -> np.ndarray:
    if adjacency == privacy_loss_mechanism.AdjacencyType.ADD:
        return scipy.special.ndtr(x / sigma)
    if q == 1.0:
        return scipy.special.ndtr(np.add(x, 1) / sigma)
    return (1 - q) * scipy.special.ndtr(x / sigma) + q * scipy.special.ndtr(np.add(x, 1) / sigma)


def mu_lower_log_cdf_of(x: np.ndarray, sigma: float, q: float, adjacency: Any) -> np.ndarray:
    if adjacency == privacy_loss_mechanism.AdjacencyType.REMOVE:
        return scipy.special.log_ndtr(x / sigma)
    if q == 1.0:
        return scipy.special.log_ndtr(np.add(x, -1) / sigma)
    return np.logaddexp(
        np.log1p(-q) + scipy.special.log_ndtr(x / sigma),
        np.log(q) + scipy.special.log_ndtr(np.add(x, -1) / sigma),
    )
