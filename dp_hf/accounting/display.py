"""Privacy figures as people read them: rounded so that a shown figure never claims more privacy.

A displayed epsilon is rounded **up** (a log line's 2.2219 for 2.221927 understated it). Figures a reader
recomputes epsilon from are rounded the way that makes the recomputed epsilon no smaller: the noise
multiplier down, the sample rate up (a card's sigma 0.923339 for 0.923338623 gave 1.9060051 against the
accounted 1.9060061).
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

__all__ = ["LOG_DIGITS", "delta_text", "epsilon_for_logs", "epsilon_up", "shown", "significant"]

#: Significant digits the Trainer shows of a logged float: transformers' ProgressCallback and PrinterCallback
#: print every float of a log line as ``f"{v:.4g}"`` (rounded to nearest).
LOG_DIGITS = 4


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


def shown(value: float, digits: int, up: bool) -> str:
    """``value`` as ``f"{value:.{digits}g}"`` shows it when that is exactly ``value`` (a delta of 1e-05), else
    rounded up (``up``: delta, q) or down (sigma) to ``digits`` significant digits: a plan's
    "delta 1.25e-05" for 1.2549e-05 paired a smaller delta with the epsilon than was spent."""
    text = f"{value:.{digits}g}"
    if not math.isfinite(value) or float(text) == value:
        return text
    return significant(value, digits, up=up)


def delta_text(delta: float) -> str:
    """A delta next to an epsilon: as given when it prints exactly in 6 digits, else rounded up."""
    return shown(delta, 6, up=True)


def epsilon_for_logs(epsilon: float) -> float:
    """The epsilon a log line carries: rounded up to :data:`LOG_DIGITS` significant digits, so that the
    Trainer's own ``.4g`` display of it (rounded to nearest) is that figure and never less than spent.

    Rounded up to 4 *decimals* instead (7.9961 for 7.99601), the progress bar's log line showed 7.996. The
    float is the one nearest the rounded decimal, or ``epsilon`` itself if that one were below it.
    """
    if not math.isfinite(epsilon) or epsilon == 0:
        return epsilon
    return max(float(significant(epsilon, LOG_DIGITS)), epsilon)
