"""The threshold searches of calibration and step budgets: a few aimed evaluations, then bisection,
with exactly plain bisection's answer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

from dp_hf.accounting import constants
from dp_hf.accounting.constants import MONOTONE_GUARD, SEARCH_GRID_COARSENING
from dp_hf.accounting.epsilon import epsilon_of_history
from dp_hf.accounting.pld import PLDTooLargeError


def search_stages(accountant: str) -> list[tuple[str, float, float]]:
    """Stages of a search, cheapest first, exact last: ``(accountant, grid_coarsening, next_relative_step)``.

    RDP is typically 10-20% off the PLD answer, the coarse PLD grid a few percent; the
    next stage walks from this stage's answer in steps that start at that relative size.
    """
    if accountant == "rdp":
        return [("rdp", 1.0, 0.0)]
    if accountant == "prv":
        return [("rdp", 1.0, 0.02), ("prv", 1.0, 0.0)]
    return [("rdp", 1.0, 0.02), ("pld", SEARCH_GRID_COARSENING, 0.005), ("pld", 1.0, 0.0)]


class ThresholdSearch:
    """The monotone predicate of a search, ``passes(x)``: false below a threshold ``x*``, true from it on.

    ``passes(x)`` is ``epsilon(x) <= target`` for a noise multiplier ``x`` (epsilon decreasing) and
    ``epsilon(x) > target`` for a step count ``x`` (epsilon increasing); true without evaluating above
    ``always_passes_above``. Every evaluation is remembered, and so is the bracket it implies,
    ``fail_max < x* <= pass_min``: a query outside it is answered without evaluating.

    :func:`smallest_passing` asks ~10-20 questions (a walk, then a bisection), most of them far from
    the threshold. Evaluations are placed where they settle many questions at once: :meth:`sharpen`
    narrows the bracket by the secant method on ``log epsilon`` against ``log x`` (smooth and nearly
    linear) before the questions are asked; and a question that the bracket does not settle is
    settled by evaluating, instead of the question's point, a point between it and the estimated
    threshold, just on its side (when one fails, so do all points below it). The search returns
    the same point as with every question evaluated, with a third to a half of the evaluations.
    It relies on the predicate being monotone, as the bisection does, but only beyond
    ``MONOTONE_GUARD`` (relative): questions closer than that to an evaluated point are evaluated.
    ``slope``: a prior ``d log epsilon / d log x`` (e.g. the previous stage's), else -1 / +1.
    """

    def __init__(
        self,
        epsilon_at: Callable[[Any], float],
        target: float,
        decreasing: bool,
        always_passes_above: float,
        integral: bool,
        slope: float | None = None,
    ) -> None:
        self._epsilon_at, self._target = epsilon_at, target
        self._decreasing, self._limit, self._integral = decreasing, always_passes_above, integral
        self._default_slope = -1.0 if decreasing else 1.0
        self.prior_slope = slope
        self.fail_max, self.pass_min = -math.inf, math.inf
        self.evaluated: dict[Any, float] = {}

    def epsilon(self, x: Any) -> float:
        """Evaluate (or recall) epsilon at ``x`` and tighten the bracket."""
        if x not in self.evaluated:
            epsilon = self._epsilon_at(x)
            self.evaluated[x] = epsilon
            if self._passes_value(epsilon):
                self.pass_min = min(self.pass_min, x)
            else:
                self.fail_max = max(self.fail_max, x)
        return self.evaluated[x]

    def passes(self, x: Any) -> bool:
        settled = self._settled(x)
        for _ in range(2):  # aimed evaluations, each settling x or sharpening the estimate
            if settled is not None:
                return settled
            point = self._aimed_point(x)
            if point is None:
                break
            try:
                self.epsilon(min(point, self._limit))  # (beyond the limit every point passes)
            except PLDTooLargeError:
                break
            settled = self._settled(x)
        return settled if settled is not None else self._passes_value(self.epsilon(x))

    def _settled(self, x: Any) -> bool | None:
        """The verdict at ``x`` if the bracket implies it (or it was evaluated), else None."""
        if x > self._limit:
            return True
        if x in self.evaluated:
            return self._passes_value(self.evaluated[x])
        guard = 0 if self._integral else MONOTONE_GUARD * x
        if x >= self.pass_min + guard:
            return True
        if x <= self.fail_max - guard:
            return False
        return None

    def _aimed_point(self, x: Any) -> Any:
        """A point on ``x``'s side of the estimated threshold, between the two, next to the threshold.

        The estimate is a secant step from the evaluation closest to the target (in log epsilon); it
        is trusted to within a tenth of that step (a hundredth once the step is small: secant steps
        converge superlinearly), and the point is placed that far from it, on ``x``'s side. None
        when ``x`` itself is that close (then ``x`` is evaluated).
        """
        log_target = math.log(self._target)
        finite = [
            (math.log(p), math.log(e) - log_target) for p, e in self.evaluated.items() if 0 < e < math.inf
        ]
        if not finite:
            return None
        finite.sort(key=lambda point: abs(point[1]))
        u, y = finite[0]
        slope, trust = self.prior_slope or self._default_slope, 0.1
        if len(finite) > 1 and finite[1][0] != u and finite[1][1] != y:
            secant = (y - finite[1][1]) / (u - finite[1][0])
            if secant * self._default_slope > 0:
                # a secant step's error is ~ the product of the two points' distances to the threshold
                slope, trust = secant, min(0.1, max(0.01, 10 * abs(y / secant)))
        estimate = math.exp(min(u - y / slope, 700.0))  # a near-flat slope aims far: stay finite
        guard = 0 if self._integral else 2 * MONOTONE_GUARD * estimate
        margin = max(trust * abs(estimate - math.exp(u)), guard)
        if x < estimate - margin:
            point = estimate - margin
            point = math.floor(point) if self._integral else point
        elif x > estimate + margin:
            point = estimate + margin
            point = math.ceil(point) if self._integral else point
        else:
            return None
        if point == x or point in self.evaluated or not (max(self.fail_max, 0) < point < self.pass_min):
            return None
        return point

    def _passes_value(self, epsilon: float) -> bool:
        return epsilon <= self._target if self._decreasing else epsilon > self._target

    def slope(self) -> float | None:
        """``d log epsilon / d log x`` across the bracket, when both ends were evaluated (finite)."""
        ends = (self.fail_max, self.pass_min)
        if (
            not all(x in self.evaluated and 0 < self.evaluated[x] < math.inf for x in ends)
            or ends[0] == ends[1]
        ):
            return None
        (x_0, x_1), (e_0, e_1) = ends, (self.evaluated[ends[0]], self.evaluated[ends[1]])
        return (math.log(e_1) - math.log(e_0)) / (math.log(x_1) - math.log(x_0))

    def sharpen(self, start: Any, width: float, max_evaluations: int = 12) -> None:
        """Evaluate near the threshold until ``pass_min - fail_max <= width`` (or give up quietly).

        Secant steps on ``y = log epsilon - log target`` against ``u = log x`` from ``start`` (the first
        with the prior slope, e.g. the previous stage's, else -1 / +1). Once a step is shorter than a
        quarter of ``width`` the current point is that close to the threshold, and the next point
        goes just across it, closing the bracket. Non-finite epsilons (0 or inf) halve or double
        ``x``; steps leaving the bracket bisect it; without a bracket a step is at most a factor 20.
        """
        log_target = math.log(self._target)
        default_slope, slope = self._default_slope, self.prior_slope
        x, previous = self._point(math.log(start)), None
        for _ in range(max_evaluations):
            try:
                epsilon = self.epsilon(x)
            except PLDTooLargeError:
                return  # the search itself decides whether this matters
            if self.pass_min - self.fail_max <= width:
                return
            u = math.log(x)
            away = -1.0 if self.passes(x) else 1.0  # towards the threshold
            if not 0 < epsilon < math.inf:
                new_u = u + away * math.log(2.0)
            else:
                y = math.log(epsilon) - log_target
                s = slope if slope is not None else default_slope
                if previous is not None and previous[0] != u and previous[1] != y:
                    secant = (y - previous[1]) / (u - previous[0])
                    if secant * default_slope > 0:  # else: not monotone there (noise); keep s
                        s = secant
                step = -y / s
                if previous is None and slope is not None:  # a slope of the previous stage: be careful
                    step = min(max(step, -0.25), 0.25)
                previous = (u, y)
                new_u = u + step
                if abs(math.exp(min(new_u, 700.0)) - x) < width / 4:  # x is within width / 4 of the threshold
                    across = x + away * (1 if self._integral else width / 2)
                    if across <= (1 if self._integral else 0):
                        return  # nothing below x to look at
                    new_u = math.log(across)
            lo, hi = self.fail_max, self.pass_min
            if lo > 0 and hi < math.inf:
                if not math.log(lo) < new_u < math.log(hi):
                    new_u = 0.5 * (math.log(lo) + math.log(hi))
            else:
                new_u = min(max(new_u, u - 3.0), u + 3.0)
            new_x = self._point(new_u)
            if new_x in self.evaluated:
                new_x = self._unevaluated_inside(new_x)
                if new_x is None:
                    return
            x = new_x

    def _point(self, u: float) -> Any:
        x = min(math.exp(min(u, 700.0)), self._limit)
        return max(1, round(x)) if self._integral else x

    def _unevaluated_inside(self, x: Any) -> Any:
        """An integer strictly inside the bracket next to ``x`` (for integral searches), or None."""
        if not self._integral:
            return None
        for candidate in (x + 1, x - 1):
            if max(self.fail_max, 0) < candidate < self.pass_min and candidate not in self.evaluated:
                return candidate
        return None


def calibration_error(
    err: PLDTooLargeError,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    estimate: float,
) -> ValueError:
    rdp_sigma = None
    from dp_hf.accounting import calibrate_noise_multiplier  # the public entry point (imports this module)

    with contextlib.suppress(ValueError):
        rdp_sigma = calibrate_noise_multiplier(target_epsilon, delta, sample_rate, steps, accountant="rdp")
    rdp_hint = f"; it gives noise multiplier {rdp_sigma:.6g}" if rdp_sigma is not None else ""
    return ValueError(
        f"target_epsilon = {target_epsilon!r} is out of the PLD accountant's range (sample_rate = "
        f"{sample_rate!r}, steps = {steps!r}, delta = {delta!r}): it needs a noise multiplier below "
        f"{estimate:.4g}, where the privacy loss distribution would need ~{err.points:,} grid points "
        f"(limit PLD_MAX_POINTS = {constants.PLD_MAX_POINTS:,}; time and memory grow with epsilon). Use "
        f"accountant='rdp' (dp-hf: --accountant rdp{rdp_hint}) or a smaller target_epsilon."
    )


def sigma_epsilon(
    accountant: str, grid_coarsening: float, delta: float, sample_rate: float, steps: int
) -> Callable[[float], float]:
    """``sigma -> epsilon(q, sigma, T, delta)`` with the given accountant and grid."""

    def epsilon_at(sigma: float) -> float:
        return epsilon_of_history(accountant, ((sigma, sample_rate, steps),), delta, grid_coarsening)

    return epsilon_at


def smallest_passing(passes: Callable[[Any], bool], guess: Any, first_step: Any, tolerance: Any) -> Any:
    """Smallest ``x > 0`` with ``passes(x)``, up to ``tolerance``, for a monotone predicate.

    ``passes`` must be false at 0 and stay true once true. Walks from ``guess`` in
    steps that double (``first_step``, ``2 first_step``, ...) until a failing
    ``lo`` and a passing ``hi`` bracket the threshold, then bisects to
    ``hi - lo <= tolerance`` and returns ``hi``. Integers in, integers out.
    """
    integral = isinstance(guess, int)
    step = first_step
    if passes(guess):
        hi = guess
        lo = max(hi - step, 0)
        while lo > 0 and passes(lo):
            hi, step = lo, 2 * step
            lo = max(hi - step, 0)
    else:
        lo = guess
        hi = lo + step
        while not passes(hi):
            lo, step = hi, 2 * step
            hi = lo + step
    while hi - lo > tolerance:
        mid = (lo + hi) // 2 if integral else 0.5 * (lo + hi)
        lo, hi = (lo, mid) if passes(mid) else (mid, hi)
    return hi
