"""Privacy figures as people read them: rounded so that a shown figure never claims more privacy.

A displayed epsilon is rounded **up** (a log line's 2.2219 for 2.221927 understated it). Figures a reader
recomputes epsilon from are rounded the way that makes the recomputed epsilon no smaller: the noise
multiplier down, the sample rate up (a card's sigma 0.923339 for 0.923338623 gave 1.9060051 against the
accounted 1.9060061).
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

__all__ = ["epsilon_up", "significant"]


def epsilon_up(epsilon: float, decimals: int) -> float:
    """``epsilon`` rounded up to ``decimals`` decimal places (``inf`` and NaN as they are)."""
    if not math.isfinite(epsilon):
        return epsilon
    rounded = Decimal(epsilon).quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_CEILING)
    return max(float(rounded), epsilon)  # (the float nearest the decimal may sit an ulp below it)


def significant(value: float, digits: int, up: bool = True) -> str:
    """``value`` to ``digits`` significant digits, rounded up (``up``) or down, as ``format(value, "g")`` shows it.

    ``f"{value:.{digits}g}"`` rounds to nearest. Zero, ``inf`` and NaN are shown as they are.
    """
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    exact = Decimal(value)
    quantum = Decimal(1).scaleb(exact.adjusted() - digits + 1)
    rounded = exact.quantize(quantum, rounding=ROUND_CEILING if up else ROUND_FLOOR)
    # `rounded` has at most `digits` significant digits, so "g" shows exactly them (the float nearest it
    # rounds back to them).
    return f"{float(rounded):.{digits}g}"
