"""The one-run audit's statistics (Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run",
NeurIPS 2023): from ``v`` correct guesses out of ``r`` about ``m`` canaries to a lower bound on epsilon.

Setting. Each of ``m`` canaries is included in the training data independently with probability 1/2
(``S_i`` uniform in ``{-1, +1}``). After the run, an auditor guesses ``T_i`` in ``{-1, 0, +1}`` for each
canary (``0``: abstain), ``r`` non-abstaining guesses in all, and counts the correct ones, ``W``.

Theorem (the paper's main result for approximate DP, as computed by its Appendix D). If the training run
is ``(eps, delta)``-DP with respect to each canary's inclusion, then for every ``v``::

    P[W >= v]  <=  beta + 2 m delta alpha ,
    beta  = P[Binomial(r, p) >= v],                  p = e^eps / (1 + e^eps)
    alpha = max_{i = 1..v}  P[v - i <= Binomial(r, p) < v] / i

(``p`` is the accuracy of ``eps``-DP randomized response, the best a pure ``eps``-DP guesser can do on
each canary.) :func:`p_value` is the right-hand side. An observed ``v`` whose p-value under
``(eps, delta)`` is below ``1 - confidence`` rejects "the run is ``(eps, delta)``-DP" at that
confidence; :func:`epsilon_lower_bound` is the largest ``eps`` rejected (found, as in the paper, by
doubling then bisection on ``eps``). The guarantee is one-sided and needs nothing from the training
algorithm beyond the DP claim being tested: a bound above the claim refutes the claim (with probability
of error ``<= 1 - confidence``); a bound below it proves nothing.

Checks against the paper's printed numbers (``tests/test_audit.py``): ``m = 1000, r = 100, v = 75,
delta = 1e-4`` at 95% gives ``0.673`` (Appendix D); ``m = 10^5, r = 1510, v = 1439, delta = 1e-5``
gives ``2.675`` (Section 7).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import special

__all__ = [
    "GuessResult",
    "epsilon_lower_bound",
    "max_epsilon_lower_bound",
    "p_value",
    "score_guesses",
]

# Upper end of the epsilon search: beyond this, e^eps / (1 + e^eps) is 1 in float64.
_EPS_CEILING = 64.0
_BISECTION_STEPS = 60


def _check_counts(num_canaries: int, num_guesses: int, num_correct: int) -> tuple[int, int, int]:
    values = []
    for name, value in (
        ("num_canaries", num_canaries),
        ("num_guesses", num_guesses),
        ("num_correct", num_correct),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {value!r}.")
        values.append(int(value))
    m, r, v = values
    if not 0 <= v <= r <= m or m < 1:
        raise ValueError(
            f"need 0 <= num_correct <= num_guesses <= num_canaries and num_canaries >= 1, got "
            f"num_correct={v}, num_guesses={r}, num_canaries={m}."
        )
    return m, r, v


def _check_delta(delta: float) -> float:
    if not isinstance(delta, (int, float)) or isinstance(delta, bool) or not 0 <= delta < 1:
        raise ValueError(f"delta must be a number in [0, 1), got {delta!r}.")
    return float(delta)


def _check_confidence(confidence: float) -> float:
    if not isinstance(confidence, (int, float)) or isinstance(confidence, bool) or not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), e.g. 0.95, got {confidence!r}.")
    return float(confidence)


def p_value(num_canaries: int, num_guesses: int, num_correct: int, epsilon: float, delta: float) -> float:
    """Upper bound on ``P[W >= num_correct]`` for any ``(epsilon, delta)``-DP run (the theorem above).

    Args:
        num_canaries: ``m``, canaries each included independently with probability 1/2.
        num_guesses: ``r``, guesses made (abstentions excluded).
        num_correct: ``v``, correct guesses.
        epsilon, delta: the DP claim under test (the null hypothesis).
    """
    m, r, v = _check_counts(num_canaries, num_guesses, num_correct)
    delta = _check_delta(delta)
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}.")
    p = 1.0 / (1.0 + math.exp(-epsilon)) if epsilon < 700 else 1.0
    beta = float(special.bdtrc(v - 1, r, p)) if v > 0 else 1.0  # P[Binomial(r, p) >= v]
    if delta == 0 or v == 0:
        return min(1.0, beta)
    # P[v - i <= Binomial < v] for i = 1..v is the cumulative sum of the pmf at v-1, v-2, ..., 0.
    alpha = float(np.max(np.cumsum(_binom_pmf(np.arange(v - 1, -1, -1), r, p)) / np.arange(1, v + 1)))
    return min(1.0, beta + 2.0 * m * delta * alpha)


def _binom_pmf(k: np.ndarray, n: int, p: float) -> np.ndarray:
    # scipy.stats.binom.pmf without its per-call overhead (the bisections call this thousands of times).
    log_pmf = (
        special.gammaln(n + 1)
        - special.gammaln(k + 1)
        - special.gammaln(n - k + 1)
        + special.xlogy(k, p)
        + special.xlog1py(n - k, -p)
    )
    return np.exp(log_pmf)


def epsilon_lower_bound(
    num_canaries: int, num_guesses: int, num_correct: int, delta: float, confidence: float = 0.95
) -> float:
    """Largest ``epsilon`` that ``num_correct`` correct guesses out of ``num_guesses`` reject.

    With probability at least ``confidence`` (over the canaries' random inclusion and the run's own
    randomness) the value returned is at most the true epsilon of the run at ``delta``. Returns ``0.0``
    when not even ``epsilon = 0`` is rejected, and ``inf`` when every ``epsilon`` up to 64 is (possible
    only with ``delta = 0``, since the ``delta`` term caps the bound otherwise).
    """
    m, r, v = _check_counts(num_canaries, num_guesses, num_correct)
    delta = _check_delta(delta)
    level = 1.0 - _check_confidence(confidence)
    if p_value(m, r, v, 0.0, delta) >= level:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < level:
        lo, hi = hi, 2.0 * hi
        if hi > _EPS_CEILING:
            return math.inf if p_value(m, r, v, _EPS_CEILING, delta) < level else lo
    for _ in range(_BISECTION_STEPS):  # invariant: p(lo) < level <= p(hi)
        mid = 0.5 * (lo + hi)
        if p_value(m, r, v, mid, delta) < level:
            lo = mid
        else:
            hi = mid
    return lo


def max_epsilon_lower_bound(
    num_canaries: int, delta: float, confidence: float = 0.95, num_guesses: int | None = None
) -> float:
    """The largest bound an audit with ``num_canaries`` can give: every one of ``num_guesses`` correct.

    With ``num_guesses=None`` the best ``r <= num_canaries`` is searched. This is the ceiling of the
    method: a claim above it can never be refuted by ``num_canaries`` canaries, however leaky the run.
    """
    if num_guesses is not None:
        return epsilon_lower_bound(num_canaries, num_guesses, num_guesses, delta, confidence)
    candidates = sorted({max(1, int(round(num_canaries * f))) for f in np.geomspace(1e-3, 1.0, 40)})
    return max(epsilon_lower_bound(num_canaries, r, r, delta, confidence) for r in candidates)


@dataclass(frozen=True)
class GuessResult:
    """The guesses that gave the best bound, and every candidate tried: ``(k+, k-, correct, epsilon)``."""

    positive: int
    negative: int
    correct_positive: int
    correct_negative: int
    epsilon: float
    candidates: list[tuple[int, int, int, float]] = field(default_factory=list)
    #: the bound perfectly separating scores would give with these candidates (the audit's ceiling)
    ceiling: float = math.inf

    @property
    def num_guesses(self) -> int:
        return self.positive + self.negative

    @property
    def num_correct(self) -> int:
        return self.correct_positive + self.correct_negative


# Default guess counts: fractions of m guessed "in" (highest scores) and "out" (lowest scores).
_LADDER = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


def _candidate_guesses(m: int, guesses) -> list[tuple[int, int]]:
    if isinstance(guesses, str):
        if guesses != "auto":
            raise ValueError(f"guesses must be 'auto' or (num_positive, num_negative), got {guesses!r}.")
        ks = sorted({max(1, int(m * f)) for f in _LADDER})
        pairs = [(k, k) for k in ks if 2 * k <= m] + [(k, 0) for k in ks]
        return sorted(set(pairs))
    if isinstance(guesses, Sequence) and len(guesses) == 2:
        k_pos, k_neg = (int(g) for g in guesses)
        if k_pos < 0 or k_neg < 0 or k_pos + k_neg > m or k_pos + k_neg == 0:
            raise ValueError(
                f"guesses=(num_positive, num_negative) must be >= 0, not both 0, and sum to <= "
                f"num_canaries={m}, got {guesses!r}."
            )
        return [(k_pos, k_neg)]
    raise ValueError(f"guesses must be 'auto' or (num_positive, num_negative), got {guesses!r}.")


def score_guesses(
    scores: np.ndarray,
    included: np.ndarray,
    delta: float,
    confidence: float = 0.95,
    guesses="auto",
    seed: int = 0,
) -> GuessResult:
    """Guess "in" for the highest scores and "out" for the lowest, and bound epsilon.

    Args:
        scores: ``[m]``, higher means "more likely included".
        included: ``[m]`` booleans, the truth.
        delta, confidence: as :func:`epsilon_lower_bound`.
        guesses: ``(num_positive, num_negative)`` fixed in advance, or ``"auto"``: try the
            symmetric counts ``k = k+ = k-`` and the positive-only counts ``(k, 0)`` for ``k`` in
            ``{1, 2, 5, 10, 20, 30, 50}%`` of ``m``, and keep the best bound **at the Bonferroni-corrected
            confidence** ``1 - (1 - confidence) / number_of_candidates``, so that choosing the best
            candidate after seeing the scores keeps the stated confidence.
        seed: ties in ``scores`` are broken by a random permutation drawn from it.
    """
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    if scores.ndim != 1 or scores.shape != included.shape:
        raise ValueError(
            f"scores and included must be 1-D of the same length, got {scores.shape}, {included.shape}."
        )
    if not np.all(np.isfinite(scores)):
        # +-inf are meaningful (certain in/out); NaN is not.
        if np.any(np.isnan(scores)):
            raise ValueError("scores contain NaN.")
    m = scores.shape[0]
    candidates = _candidate_guesses(m, guesses)
    level = _check_confidence(confidence)
    corrected = 1.0 - (1.0 - level) / len(candidates)
    tie_break = np.random.default_rng(seed).permutation(m)
    order = np.lexsort((tie_break, -scores))  # descending score, random among ties
    sorted_in = included[order]
    best = None
    tried = []
    for k_pos, k_neg in candidates:
        correct_pos = int(sorted_in[:k_pos].sum())
        correct_neg = int((~sorted_in[m - k_neg :]).sum()) if k_neg else 0
        eps = epsilon_lower_bound(m, k_pos + k_neg, correct_pos + correct_neg, delta, corrected)
        tried.append((k_pos, k_neg, correct_pos + correct_neg, eps))
        if best is None or eps > best[4]:
            best = (k_pos, k_neg, correct_pos, correct_neg, eps)
    ceiling = _ceiling(m, int(included.sum()), tuple(candidates), delta, corrected)
    return GuessResult(*best, candidates=tried, ceiling=ceiling)


@functools.lru_cache(maxsize=256)
def _ceiling(
    m: int, num_in: int, candidates: tuple[tuple[int, int], ...], delta: float, confidence: float
) -> float:
    # The bound perfectly separating scores would give: every guess right that can be right.
    return max(
        epsilon_lower_bound(m, kp + kn, min(kp, num_in) + min(kn, m - num_in), delta, confidence)
        for kp, kn in candidates
    )
