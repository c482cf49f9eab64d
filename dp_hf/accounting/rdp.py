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

    The same arithmetic in the same order, bit for bit, with every order's series computed at once:
    the terms elementwise by numpy, the running log-sums by ``np.logaddexp.accumulate`` (the same
    operations as dp_accounting's ``_log_add``, in the same order).
    """
    rdp = np.empty(len(RDP_ORDERS))
    integral = np.array([float(alpha).is_integer() for alpha in RDP_ORDERS]) & np.isfinite(RDP_ORDERS)
    fractional = ~integral & np.isfinite(RDP_ORDERS)
    rdp[~(integral | fractional)] = np.inf
    q = sample_rate
    if sigma == 0:
        rdp[:] = np.inf
    elif q == 1.0:
        rdp[integral | fractional] = RDP_ORDERS[integral | fractional] / (2 * sigma**2)
    else:
        alphas = RDP_ORDERS[integral].astype(np.int64)
        rdp[integral] = log_a_int(q, sigma, alphas) / (alphas - 1)
        alphas = RDP_ORDERS[fractional]
        rdp[fractional] = log_a_frac(q, sigma, alphas) / (alphas - 1)
    rdp.flags.writeable = False
    return rdp


def log_comb(n: Any, k: np.ndarray) -> np.ndarray:
    """``rdp_privacy_accountant._log_comb(n, k)``, elementwise."""
    return scipy.special.gammaln(n + 1) - scipy.special.gammaln(k + 1) - scipy.special.gammaln(n - k + 1)


def log_a_int(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """``rdp_privacy_accountant._compute_log_a_int``: ``log A_alpha`` for integer orders ``alphas``.

    Orders of similar size share a table: row ``r`` holds order ``alpha_r``'s terms ``i = 0..alpha_r``
    (and terms past its end, ignored); ``log_a = _log_add(log_a, term)`` from ``-inf`` over them is
    the accumulate's entry ``alpha_r``.
    """
    log_a = np.empty(len(alphas))
    sizes = np.ceil(np.log2(alphas + 1)).astype(int)  # tables of 2**size terms
    for size in np.unique(sizes):
        rows = np.flatnonzero(sizes == size)
        column = alphas[rows, None]
        i = np.arange(int(column.max()) + 1)
        with np.errstate(invalid="ignore", divide="ignore"):  # the terms past a row's end
            log_coef = log_comb(column, i) + i * math.log(q) + (column - i) * math.log1p(-q)
            terms = log_coef + (i * i - i) / (2 * (sigma**2))
            sums = np.logaddexp.accumulate(terms, axis=1)
        log_a[rows] = sums[np.arange(len(rows)), column[:, 0]]
    return log_a


MAX_STEPS_LOG_A_FRAC = 1000  # rdp_privacy_accountant's


def log_a_frac(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """``rdp_privacy_accountant._compute_log_a_frac``: ``log A_alpha`` for fractional orders ``alphas``.

    dp_accounting sums two series term by term and stops at the first term where both decrease and
    are below ``total - 30`` (``inf``, "failed to converge", after 1000 terms). Here the terms of all
    orders still running come in chunks (32, 128, ... terms), their running sums by accumulate, and
    each order stops at the first term of its chunk where the same rule holds: the same values.
    """
    result = np.full(len(alphas), math.inf)
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    log1mq, log_q = math.log1p(-q), math.log(q)
    running = np.arange(len(alphas))  # the orders not yet stopped
    log_a0 = log_a1 = last_s0 = last_s1 = np.full(len(alphas), -math.inf)
    start, chunk = 0, 32
    while start < MAX_STEPS_LOG_A_FRAC and len(running):
        i = np.arange(start, min(start + chunk, MAX_STEPS_LOG_A_FRAC))
        alpha = alphas[running, None]
        log_coef = log_comb(alpha, i)
        j = alpha - i
        log_t0 = log_coef + i * log_q + j * log1mq
        log_t1 = log_coef + j * log_q + i * log1mq
        log_e0 = math.log(0.5) + log_erfc((i - z0) / (math.sqrt(2) * sigma))
        log_e1 = math.log(0.5) + log_erfc((z0 - j) / (math.sqrt(2) * sigma))
        log_s0 = log_t0 + (i * i - i) / (2 * (sigma**2)) + log_e0
        log_s1 = log_t1 + (j * j - j) / (2 * (sigma**2)) + log_e1
        log_a0s = np.logaddexp.accumulate(np.concatenate((log_a0[:, None], log_s0), axis=1), axis=1)[:, 1:]
        log_a1s = np.logaddexp.accumulate(np.concatenate((log_a1[:, None], log_s1), axis=1), axis=1)[:, 1:]
        totals = np.logaddexp(log_a0s, log_a1s)
        larger = np.where(log_s1 > log_s0, log_s1, log_s0)  # builtin max(log_s0, log_s1)
        stops = (
            (log_s0 < np.concatenate((last_s0[:, None], log_s0[:, :-1]), axis=1))
            & (log_s1 < np.concatenate((last_s1[:, None], log_s1[:, :-1]), axis=1))
            & (larger < totals - 30)
        )
        stopped = stops.any(axis=1)
        first = np.argmax(stops, axis=1)
        result[running[stopped]] = totals[stopped, first[stopped]]
        going = ~stopped
        running = running[going]
        log_a0, log_a1 = log_a0s[going, -1], log_a1s[going, -1]
        last_s0, last_s1 = log_s0[going, -1], log_s1[going, -1]
        start, chunk = start + chunk, 4 * chunk
    return result  # inf where dp_accounting "failed to converge": the order is excluded


def log_erfc(x: np.ndarray) -> np.ndarray:
    """``rdp_privacy_accountant._log_erfc``."""
    return math.log(2) + scipy.special.log_ndtr(-x * 2**0.5)
