"""The real FFT of a PLD's probabilities, kept to raise it to many powers (epsilon after every step).

A T-fold self-composition is ``irfft(rfft(p, n) ** T, n)``. A run that asks for epsilon every few
steps raises the same spectrum to T, T + 1, ...: this object caches what does not depend on T (the
spectrum, its complex log) and skips the frequencies whose power underflows to zero anyway.
"""

from __future__ import annotations

import numpy as np
import scipy.fft

# exp(x) == 0.0 in float64 for x < -745.2: a power whose log has a real part below this is exactly 0
UNDERFLOW_LOG = -750.0
LOG_POWER_FROM = 100  # dp_accounting's numpy ** below this exponent; exp(T log z) from it on


class Spectrum:
    """``rfft(probs, length)``, with :meth:`power` computing ``spectrum ** exponent`` as before it
    (``values ** exponent`` below ``LOG_POWER_FROM``, else ``exp(exponent * log(values))``: what C's
    ``cpow`` computes, without numpy's per-element call into it)."""

    __slots__ = ("length", "values", "_log", "_neg_reach", "_zeros")

    def __init__(self, probs: np.ndarray, length: int) -> None:
        self.length = length
        self.values = scipy.fft.rfft(probs, length)
        self._log: np.ndarray | None = None
        self._neg_reach: np.ndarray | None = None
        self._zeros: np.ndarray | None = None

    def power(self, exponent: int) -> np.ndarray:
        """``values ** exponent`` (a new array).

        From ``LOG_POWER_FROM`` on: ``exp(exponent * log z)`` with ``log z`` computed once, and only up
        to the last frequency whose power can be non-zero. With ``reach_k = max_{j >= k} Re log z_j``,
        from the first ``k`` with ``exponent * reach_k < UNDERFLOW_LOG`` on, every ``|z_j| ** exponent``
        underflows: those entries are the zeros the full computation gives (for a PMF of a few hundred
        steps, most of the spectrum).
        """
        if exponent < LOG_POWER_FROM:
            return self.values**exponent
        if self._log is None:
            with np.errstate(all="ignore"):  # log 0 = -inf: those entries are set to 0 below
                self._log = np.log(self.values)
            # -reach_k: non-decreasing, so that searchsorted finds the cutoff
            self._neg_reach = -np.maximum.accumulate(self._log.real[::-1])[::-1]
            self._zeros = np.flatnonzero(self.values == 0)
        # first k with exponent * max_{j >= k} Re log z_j < UNDERFLOW_LOG
        cutoff = int(np.searchsorted(self._neg_reach, -UNDERFLOW_LOG / exponent, side="right"))
        powered = np.zeros_like(self.values)
        kept = powered[:cutoff]
        with np.errstate(all="ignore"):
            np.multiply(self._log[:cutoff], exponent, out=kept)
            np.exp(kept, out=kept)
        powered[self._zeros[self._zeros < cutoff]] = 0  # numpy: 0 ** n = 0 for n > 0
        return powered
