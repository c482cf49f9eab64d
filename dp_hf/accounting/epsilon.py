"""Epsilon of a training history for each accountant (the cached dispatcher), the DP event of a history,
and the history helpers (validation, merging).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

from dp_hf import validation
from dp_hf.accounting.constants import History
from dp_hf.accounting.pld import PLDTooLargeError, pld_epsilon, pld_grid
from dp_hf.accounting.rdp import rdp_epsilon


@functools.lru_cache(maxsize=1024)
def epsilon_of_history(
    accountant: str, history: History, delta: float, grid_coarsening: float = 1.0
) -> float:
    """Epsilon of a validated history. Cached: the same run is often asked about repeatedly.

    Callers pass ``grid_coarsening`` explicitly (``1.0``): ``lru_cache`` keys ``f(a, b, c)`` and
    ``f(a, b, c, 1.0)`` apart, and the trainer's epsilon after the planned steps should be the
    calibration's own, cached evaluation.

    ``grid_coarsening`` multiplies the PLD grid (searches use a coarse first pass).
    Raises :class:`PLDTooLargeError` where the PLD would exceed ``PLD_MAX_POINTS`` grid points.
    """
    history = tuple(entry for entry in history if entry[2] > 0)
    if not history:
        return 0.0
    if any(sigma == 0.0 for sigma, _, _ in history):
        return math.inf  # a noiseless sum can reveal an example exactly
    if accountant == "prv":
        return prv_epsilon(history, delta)
    if accountant == "rdp":
        return rdp_epsilon(history, delta)
    grid = grid_coarsening * pld_grid(history)
    try:
        return pld_epsilon(history, delta, grid, scale=grid_coarsening)
    except PLDTooLargeError as err:
        raise PLDTooLargeError(
            f"{err} The epsilon of this run is very large (RDP: epsilon = {rdp_epsilon(history, delta):.6g} "
            f"at delta = {delta!r}). Use accountant='rdp' (dp-hf: --accountant rdp) for such runs, or more "
            "noise / fewer steps.",
            points=err.points,
        ) from None


def prv_epsilon(history: History, delta: float) -> float:
    """Opacus's privacy-random-variable accountant (Gopi et al. 2021): the upper bound of its
    epsilon interval (``eps_error=0.01``). Slightly looser than the converged PLD value; it is
    what reproduces the DP-MacAdam paper's tables within 1% (the PLD values are 0.2-2% lower)."""
    from opacus.accountants import PRVAccountant

    engine = PRVAccountant()
    engine.history = [(sigma, sample_rate, num_steps) for sigma, sample_rate, num_steps in history]
    return float(engine.get_epsilon(delta))


def with_entry(history: History, entry: tuple[float, float, int]) -> History:
    """``history`` plus ``entry``, merged into the last entry when ``(sigma, q)`` match."""
    if history and history[-1][:2] == entry[:2]:
        sigma, sample_rate, num_steps = history[-1]
        return history[:-1] + ((sigma, sample_rate, num_steps + entry[2]),)
    return history + (entry,)


def merged_history(entries: Sequence[tuple[float, float, int]]) -> History:
    """Entries with consecutive equal ``(sigma, q)`` merged, as ``PrivacyAccountant.step`` records them."""
    history: History = ()
    for entry in entries:
        history = with_entry(history, entry)
    return history


def checked_entry(
    noise_multiplier: Any, sample_rate: Any, steps: Any, steps_name: str, allow_zero_steps: bool = False
) -> tuple[float, float, int]:
    """Validate one ``(sigma, q, T)`` triple; returns it as ``(float, float, int)``."""
    check_steps = validation.check_non_negative_int if allow_zero_steps else validation.check_positive_int
    return (
        validation.check_noise_multiplier(noise_multiplier),
        validation.check_sample_rate(sample_rate),
        check_steps(steps_name, steps),
    )


def checked_history(history: Any) -> list[tuple[float, float, int]]:
    """Validate a ``[[sigma, q, num_steps], ...]`` history as stored by ``state_dict``."""
    fix = (
        "Pass the 'history' list of PrivacyAccountant.state_dict(): "
        "[[noise_multiplier, sample_rate, num_steps], ...]."
    )
    if not isinstance(history, Sequence) or isinstance(history, (str, bytes)):
        raise ValueError(f"history must be a list of entries, got {history!r}. {fix}")
    for entry in history:
        if not isinstance(entry, Sequence) or isinstance(entry, (str, bytes)) or len(entry) != 3:
            raise ValueError(f"history entry must be a list of 3 numbers, got {entry!r}. {fix}")
    return [checked_entry(*entry, "num_steps") for entry in history]
