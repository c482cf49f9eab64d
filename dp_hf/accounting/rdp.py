"""Renyi DP of the Poisson-subsampled Gaussian: dp_accounting's arithmetic, vectorised, one step cached."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import scipy.fft
import scipy.signal
import scipy.special
from dp_accounting.rdp import rdp_privacy_accountant

from dp_hf.accounting.constants import RDP_ORDERS, History


def rdp_epsilon(history: History, delta: float) -> float:
    """dp_accounting's ``RdpAccountant`` (default orders), with one step's RDP vector cached per ``(sigma, q)``.

    RDP composes additively: ``rdp = sum_i T_i rdp_1(sigma_i, q_i)``, accumulated in history order
    exactly as ``RdpAccountant.compose`` does, so the result is identical.
    """
    rdp = np.zeros_like(RDP_ORDERS, dtype=np.float64)
    for sigma, sample_rate, num_steps in history:
        rdp += num_steps * one_step_rdp(sigma, sample_rate)
    return float(rdp_privacy_accountant.compute_epsilon(RDP_ORDERS, rdp, delta)[0])


@functools.lru_cache(maxsize=256)
def one_step_rdp(sigma: float, sample_rate: float) -> np.ndarray:
    """``rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(q, sigma, orders)``, faster.

    The same arithmetic in the same order (bit-identical; see ``log_a_int`` and ``log_a_frac``),
    with the terms of each order's series computed by numpy and only the running log-sums in Python.
    """
    rdp = np.array([rdp_of_order(sample_rate, sigma, order) for order in RDP_ORDERS])
    rdp.flags.writeable = False
    return rdp


def rdp_of_order(q: float, sigma: float, alpha: float) -> float:
    if np.isinf(alpha) or sigma == 0:
        return np.inf
    if q == 1.0:
        return alpha / (2 * sigma**2)
    if float(alpha).is_integer():
        return log_a_int(q, sigma, int(alpha)) / (alpha - 1)
    return log_a_frac(q, sigma, alpha) / (alpha - 1)


def log_add(log_x: float, log_y: float) -> float:
    """``rdp_privacy_accountant._log_add``: ``log(exp(log_x) + exp(log_y))`` (``min``/``max`` spelled out)."""
    a = log_y if log_y < log_x else log_x
    b = log_y if log_y > log_x else log_x
    if a == -math.inf:
        return b
    return math.log1p(math.exp(a - b)) + b


def log_comb(n: Any, k: np.ndarray) -> np.ndarray:
    """``rdp_privacy_accountant._log_comb(n, k)`` for an array of ``k``."""
    return scipy.special.gammaln(n + 1) - scipy.special.gammaln(k + 1) - scipy.special.gammaln(n - k + 1)


def log_a_int(q: float, sigma: float, alpha: int) -> float:
    """``rdp_privacy_accountant._compute_log_a_int``: ``log A_alpha`` for integer ``alpha``."""
    i = np.arange(alpha + 1)
    log_coef = log_comb(alpha, i) + i * math.log(q) + (alpha - i) * math.log1p(-q)
    terms = (log_coef + (i * i - i) / (2 * (sigma**2))).tolist()
    log_a = -math.inf
    for term in terms:  # log_a = log_add(log_a, term), inlined
        low = term if term < log_a else log_a
        high = term if term > log_a else log_a
        log_a = high if low == -math.inf else math.log1p(math.exp(low - high)) + high
    return log_a


MAX_STEPS_LOG_A_FRAC = 1000  # rdp_privacy_accountant's


def log_a_frac(q: float, sigma: float, alpha: float) -> float:
    """``rdp_privacy_accountant._compute_log_a_frac``: ``log A_alpha`` for fractional ``alpha``."""
    log_a0, log_a1 = -math.inf, -math.inf
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    log1mq, log_q = math.log1p(-q), math.log(q)
    last_s0 = last_s1 = -math.inf
    start, chunk = 0, 32
    while start < MAX_STEPS_LOG_A_FRAC:
        i = np.arange(start, min(start + chunk, MAX_STEPS_LOG_A_FRAC))
        log_coef = log_comb(alpha, i)
        j = alpha - i
        log_t0 = log_coef + i * log_q + j * log1mq
        log_t1 = log_coef + j * log_q + i * log1mq
        log_e0 = math.log(0.5) + log_erfc((i - z0) / (math.sqrt(2) * sigma))
        log_e1 = math.log(0.5) + log_erfc((z0 - j) / (math.sqrt(2) * sigma))
        log_s0s = (log_t0 + (i * i - i) / (2 * (sigma**2)) + log_e0).tolist()
        log_s1s = (log_t1 + (j * j - j) / (2 * (sigma**2)) + log_e1).tolist()
        for log_s0, log_s1 in zip(log_s0s, log_s1s):
            log_a0 = log_add(log_a0, log_s0)
            log_a1 = log_add(log_a1, log_s1)
            total = log_add(log_a0, log_a1)
            if log_s0 < last_s0 and log_s1 < last_s1 and max(log_s0, log_s1) < total - 30:
                return total
            last_s0, last_s1 = log_s0, log_s1
        start, chunk = start + chunk, 4 * chunk
    return math.inf  # dp_accounting: "failed to converge", the order is excluded


def log_erfc(x: np.ndarray) -> np.ndarray:
    """``rdp_privacy_accountant._log_erfc``."""
    return math.log(2) + scipy.special.log_ndtr(-x * 2**0.5)
