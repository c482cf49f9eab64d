"""Privacy accounting for DP-SGD-style training with Poisson sampling.

One optimizer step samples every example independently with probability
``q`` (Poisson sampling), sums the clipped per-example gradients (L2 norm
``<= C``) and adds ``N(0, sigma^2 C^2 I)``. For one example (add/remove
adjacency) a step is the Poisson-subsampled Gaussian mechanism with noise
multiplier ``sigma``, and ``T`` steps are its ``T``-fold adaptive composition::

    M_T = SelfComposed(PoissonSampled(q, Gaussian(sigma)), T)

The run is ``(epsilon, delta)``-DP for ``epsilon(delta) = min{eps : H_{e^eps}(M_T) <= delta}``,
where ``H_a(P || Q) = sup_S P(S) - a Q(S)`` is the hockey-stick divergence
between the output distributions on neighbouring datasets (both directions).
Runs whose ``(sigma, q)`` change over time compose the pieces:
``Composed(M^(1)_{T_1}, M^(2)_{T_2}, ...)``.

Two accountants of Google's ``dp_accounting`` library compute ``epsilon(delta)``:

* ``"pld"`` (default): privacy loss distributions with the "connect the dots"
  discretisation (Doroshenko et al., PETS 2022), composed by FFT. The result is
  a valid (pessimistic) upper bound; the grid is chosen per run (see
  ``_pld_grid``) so that it is within about 0.1% of the converged value.
* ``"rdp"``: Renyi DP of orders ``alpha`` in dp_accounting's default set,
  converted to ``(epsilon, delta)``. Faster but looser: a larger epsilon for the
  same run.

Speed. Both give dp_accounting's numbers (RDP bit for bit; PLD within ~1e-9 relative, the tests
allow 1e-8: its T-fold self-composition uses the real-input FFT of the real probabilities where
dp_accounting uses the complex one, half the work, the same convolution up to rounding) at a fraction
of its cost: the code below replicates its arithmetic with the slow parts vectorised, one step's
PLD / RDP cached per ``(sigma, q, grid)`` and a PLD's two PMFs (remove, add) processed in two
threads. Epsilon after one more step of a run costs one power and one inverse FFT of the cached
spectrum (~15-50 ms at the 1e-4 grid, instead of rebuilding the PLD in 0.5-1 s), and a trainer can
have it computed ahead on a worker thread (:meth:`PrivacyAccountant.prefetch_epsilon_after`).
Searches (calibration, step budgets) locate their threshold with a few secant steps before
bisecting (``_ThresholdSearch``), with the same result. A run whose PLD would need more than
``PLD_MAX_POINTS`` grid points (a very large epsilon) is refused with :class:`PLDTooLargeError`
instead of taking minutes and gigabytes; RDP handles such runs.
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from dp_hf import validation
from dp_hf.accounting.constants import (
    ACCOUNTANTS,
    MAX_NOISE_MULTIPLIER,
    PLD_MAX_POINTS,
    PLD_OVER_RDP_NOISE,
    PLD_VALUE_DISCRETIZATION_INTERVAL,
    History,
)
from dp_hf.accounting.epsilon import (
    checked_entry,
    checked_history,
    clear_caches,
    epsilon_of_history,
    merged_history,
    prefetch,
    with_entry,
)
from dp_hf.accounting.pld import PLDTooLargeError  # noqa: F401
from dp_hf.accounting.search import (
    ThresholdSearch,
    calibration_error,
    search_stages,
    sigma_epsilon,
    smallest_passing,
)


class _DropRdpConvergenceNotes(logging.Filter):
    # dp_accounting's RDP accountant logs a warning for every Renyi order whose series does not converge
    # and then (conservatively) drops that order; during a calibration that is hundreds of lines of noise.
    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


logging.getLogger("absl").addFilter(_DropRdpConvergenceNotes())


__all__ = [
    "ACCOUNTANTS",
    "PLD_MAX_POINTS",
    "PLD_VALUE_DISCRETIZATION_INTERVAL",
    "PLDTooLargeError",
    "PrivacyAccountant",
    "accounting_library_version",
    "calibrate_noise_multiplier",
    "check_accountant",
    "clear_caches",
    "compute_epsilon",
    "steps_within_budget",
]


def accounting_library_version(accountant: str = "pld") -> str:
    """Name and version of the library behind ``accountant``, e.g. ``"dp-accounting 0.6.0"``."""
    if accountant == "prv":
        return f"opacus {importlib.metadata.version('opacus')}"
    return f"dp-accounting {importlib.metadata.version('dp-accounting')}"


def check_accountant(accountant: Any) -> str:
    """Check an accountant name: ``"pld"``, ``"rdp"`` or ``"prv"``."""
    if accountant not in ACCOUNTANTS:
        raise ValueError(
            f"accountant must be 'pld', 'rdp' or 'prv', got {accountant!r}. Use 'pld' (tight, the default), "
            "'rdp' (faster, looser) or 'prv' (Opacus's PRV upper bound)."
        )
    return accountant


def compute_epsilon(
    sample_rate: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    accountant: str = "pld",
) -> float:
    """Epsilon of ``T = steps`` Poisson-subsampled Gaussian steps at the given ``delta``.

    Returns ``epsilon(delta)`` of ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), T)``
    with ``q = sample_rate`` and ``sigma = noise_multiplier`` (noise std ``sigma * C``).
    ``sigma = 0`` gives ``inf`` (no privacy) and ``T = 0`` gives ``0.0``.
    Raises :class:`PLDTooLargeError` (a ``ValueError``) where the PLD would exceed
    ``PLD_MAX_POINTS`` grid points.
    """
    entry = checked_entry(noise_multiplier, sample_rate, steps, "steps", allow_zero_steps=True)
    return epsilon_of_history(check_accountant(accountant), (entry,), validation.check_delta(delta), 1.0)


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "pld",
    tolerance: float = 1e-3,
) -> float:
    """Smallest noise multiplier, up to ``tolerance``, that meets the privacy budget.

    Solves ``sigma* = min{sigma : epsilon(q, sigma, T, delta) <= target_epsilon}``.
    Epsilon decreases monotonically in ``sigma``, so bisection on a bracket with
    ``epsilon(lo) > target >= epsilon(hi)`` converges. The returned ``hi`` satisfies
    ``compute_epsilon(sample_rate, hi, steps, delta, accountant) <= target_epsilon``
    and ``0 <= hi - sigma* <= tolerance``. For ``"pld"`` the search is staged:
    RDP (cheap, looser) gives the first guess, a coarse PLD grid narrows it and the
    accounting grid settles it, so few slow evaluations are needed. Each stage first
    locates its threshold with a few secant steps, which answer most of the bisection's
    questions without evaluating (see ``ThresholdSearch``); the answer is the same.
    With ``steps = 0`` nothing is released and ``0.0`` is returned.

    Raises ``ValueError`` when the budget needs more than ``1e6`` noise, or (``"pld"``) so
    little noise that the privacy loss distribution would exceed ``PLD_MAX_POINTS`` grid
    points (epsilon in the hundreds or more): use ``accountant="rdp"`` there.
    """
    target_epsilon = validation.check_epsilon(target_epsilon, "target_epsilon")
    delta = validation.check_delta(delta)
    _, sample_rate, steps = checked_entry(0.0, sample_rate, steps, "steps", allow_zero_steps=True)
    accountant = check_accountant(accountant)
    tolerance = validation.check_epsilon(tolerance, "tolerance")
    if steps == 0:
        return 0.0

    # Every stage over-estimates epsilon (all are upper bounds), hence sigma: the smallest
    # answer so far is the best guess to start the next stage from. The last stage decides.
    guess, first_step, best, slope = 1.0, 0.5, math.inf, None
    stages = search_stages(accountant)
    for stage, (accountant_name, grid_coarsening, next_relative_step) in enumerate(stages):
        search = ThresholdSearch(
            sigma_epsilon(accountant_name, grid_coarsening, delta, sample_rate, steps),
            target_epsilon,
            decreasing=True,
            always_passes_above=MAX_NOISE_MULTIPLIER,
            integral=False,
            slope=slope,
        )
        try:
            if stage < len(stages) - 1:  # cheap stages: locate the threshold (and the slope) first
                if accountant_name == "rdp":  # a few ms an evaluation: narrow it well
                    search.sharpen(guess, width=tolerance / 256)
                else:  # the coarse PLD grid, ~10x that: start where PLD usually is, narrow to what's asked
                    search.sharpen(PLD_OVER_RDP_NOISE * guess, width=tolerance / 4)
            sigma = smallest_passing(search.passes, guess, first_step, tolerance)
        except PLDTooLargeError as err:
            raise calibration_error(
                err, target_epsilon, delta, sample_rate, steps, min(best, guess)
            ) from None
        if sigma > MAX_NOISE_MULTIPLIER:
            raise ValueError(
                f"target_epsilon = {target_epsilon!r} cannot be met with a noise multiplier <= "
                f"{MAX_NOISE_MULTIPLIER:g} (delta = {delta!r}, sample_rate = {sample_rate!r}, "
                f"steps = {steps!r}). Raise target_epsilon or delta, or lower sample_rate or steps."
            )
        slope = search.slope() or slope
        best = min(best, sigma)
        guess, first_step = best, max(tolerance, next_relative_step * best)
    return sigma


def steps_within_budget(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    noise_multiplier: float,
    accountant: str = "pld",
    max_steps: int = 10_000_000,
    history: Sequence[Sequence[float]] = (),
    guess: int | None = None,
) -> int:
    """Largest total step count ``T <= max_steps`` whose epsilon stays within ``target_epsilon``.

    Without ``history``: the largest ``T`` with ``epsilon(q, sigma, T, delta) <= target_epsilon``
    (0 when even one step exceeds the budget, e.g. ``sigma = 0``). With ``history`` (the
    ``[[sigma, q, num_steps], ...]`` of :attr:`PrivacyAccountant.history`, ``P`` steps in all):
    the largest ``T >= P`` such that the history followed by ``T - P`` steps of ``(sigma, q)``
    stays within the budget, exactly as ``PrivacyAccountant.epsilon_after(T - P, sigma, q, delta)``
    counts it; ``P`` when not one more step fits (or ``P >= max_steps``). ``guess`` (e.g. the
    planned total the noise was calibrated for) is checked first: two evaluations when right.

    Epsilon is non-decreasing in ``T``, so the answer is a threshold: located with RDP (cheap),
    then settled on the accounting grid by bisection whose questions are mostly answered by a
    few aimed evaluations (see ``ThresholdSearch``); the result is exact either way.
    """
    target_epsilon = validation.check_epsilon(target_epsilon, "target_epsilon")
    delta = validation.check_delta(delta)
    sigma, sample_rate, _ = checked_entry(noise_multiplier, sample_rate, 1, "steps")
    accountant = check_accountant(accountant)
    max_steps = validation.check_positive_int("max_steps", max_steps)
    prior = merged_history(checked_history(history))
    if guess is not None:
        guess = validation.check_positive_int("guess", guess)
    prior_steps = sum(num_steps for _, _, num_steps in prior)
    if prior_steps >= max_steps:
        return prior_steps
    room = max_steps - prior_steps

    def exceeds_after(accountant_name: str, grid_coarsening: float) -> ThresholdSearch:
        def epsilon_at(extra_steps: int) -> float:
            history = with_entry(prior, (sigma, sample_rate, extra_steps))
            return epsilon_of_history(accountant_name, history, delta, grid_coarsening)

        return ThresholdSearch(epsilon_at, target_epsilon, False, always_passes_above=room, integral=True)

    # RDP (cheap: T * one cached RDP vector) locates the answer and the slope of log epsilon in
    # log T; then the accounting grid settles it, its evaluations aimed with that slope (the
    # coarse PLD stage of the calibration does not pay off here: T changes, the PLD does not).
    stages = [stage for stage in search_stages(accountant) if stage[1] == 1.0]
    searches = [exceeds_after(name, coarsening) for name, coarsening, _ in stages]
    start = 1 if guess is None else min(max(1, guess - prior_steps), room)
    first_step, slope = 1, None
    for stage, (search, (_, _, next_relative_step)) in enumerate(zip(searches, stages)):
        search.prior_slope = slope
        if stage < len(stages) - 1:
            search.sharpen(start, width=1)
        elif guess is not None and 1 <= guess - prior_steps < room:
            extra = guess - prior_steps  # the planned total: usually the answer, two evaluations
            if not search.passes(extra) and search.passes(extra + 1):
                return guess
        # Every stage over-estimates epsilon, hence under-estimates the steps: the largest answer
        # so far is the best start for the next stage. The last stage decides (exactly: its answer
        # does not depend on where it starts).
        first_exceeding = smallest_passing(search.passes, start, first_step, 1)
        slope = search.slope() or slope
        start = max(start, first_exceeding)
        first_step = max(1, int(next_relative_step * start))
    return prior_steps + first_exceeding - 1


class PrivacyAccountant:
    """Running privacy ledger of a training run.

    The history is a compact list of ``[noise_multiplier, sample_rate, num_steps]``
    entries; consecutive steps with the same ``(sigma, q)`` are merged into one
    entry. ``get_epsilon(delta)`` composes all entries,
    ``Composed_i SelfComposed(PoissonSampled(q_i, Gaussian(sigma_i)), T_i)``,
    and is cached per (history, delta), so asking again is free. After one more
    step it reuses the cached one-step PLD (and the composed earlier entries), so
    asking every step is cheap (tens of milliseconds with ``"pld"``).

    >>> acct = PrivacyAccountant()
    >>> acct.step(noise_multiplier=1.0, sample_rate=256 / 60000, num_steps=1171)
    >>> round(acct.get_epsilon(1e-5), 2)
    0.78
    """

    def __init__(self, accountant: str = "pld") -> None:
        self._accountant = check_accountant(accountant)
        self._history: list[list] = []

    @property
    def mechanism(self) -> str:
        """Accountant name: ``"pld"``, ``"rdp"`` or ``"prv"``."""
        return self._accountant

    @property
    def history(self) -> list[list]:
        """Copy of the ``[noise_multiplier, sample_rate, num_steps]`` entries, oldest first."""
        return [list(entry) for entry in self._history]

    @property
    def steps(self) -> int:
        """Total number of recorded steps."""
        return sum(num_steps for _, _, num_steps in self._history)

    def step(self, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Record ``num_steps`` steps with noise multiplier ``sigma`` and sampling rate ``q``."""
        self._append(*checked_entry(noise_multiplier, sample_rate, num_steps, "num_steps"))

    def get_epsilon(self, delta: float) -> float:
        """Epsilon of everything recorded so far at the given ``delta`` (0.0 before any step)."""
        return epsilon_of_history(
            self._accountant, self._frozen_history(), validation.check_delta(delta), 1.0
        )

    def epsilon_after(
        self, extra_steps: int, noise_multiplier: float, sample_rate: float, delta: float
    ) -> float:
        """Epsilon if ``extra_steps`` more steps with ``(sigma, q)`` were taken; records nothing.

        For budget stops: stop before the step for which
        ``epsilon_after(1, sigma, q, delta) > target_epsilon``.
        """
        extra = checked_entry(
            noise_multiplier, sample_rate, extra_steps, "extra_steps", allow_zero_steps=True
        )
        history = with_entry(self._frozen_history(), extra)
        return epsilon_of_history(self._accountant, history, validation.check_delta(delta), 1.0)

    def prefetch_epsilon_after(
        self, extra_steps: int, noise_multiplier: float, sample_rate: float, delta: float
    ) -> concurrent.futures.Future:
        """Start computing :meth:`epsilon_after` on a worker thread; returns its future.

        A later :meth:`get_epsilon` (once the steps are taken) or :meth:`epsilon_after` asking for the
        same history takes the result, waiting for it if it is not ready: ``DPTrainer`` asks for the
        next log line's epsilon when it writes one, so that the computation overlaps training.
        """
        extra = checked_entry(
            noise_multiplier, sample_rate, extra_steps, "extra_steps", allow_zero_steps=True
        )
        history = with_entry(self._frozen_history(), extra)
        return prefetch(self._accountant, history, validation.check_delta(delta))

    def state_dict(self) -> dict:
        """JSON-serialisable state: ``{"accountant": name, "history": [[sigma, q, steps], ...]}``."""
        return {"accountant": self._accountant, "history": self.history}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state produced by :meth:`state_dict` (validated; replaces the current state)."""
        if not isinstance(state_dict, Mapping) or not {"accountant", "history"} <= state_dict.keys():
            raise ValueError(
                "state_dict must be a mapping with keys 'accountant' and 'history', got "
                f"{state_dict!r}. Pass the dict returned by PrivacyAccountant.state_dict()."
            )
        accountant = check_accountant(state_dict["accountant"])
        entries = checked_history(state_dict["history"])
        self._accountant, self._history = accountant, []
        for entry in entries:
            self._append(*entry)

    def __repr__(self) -> str:
        return (
            f"PrivacyAccountant(accountant={self._accountant!r}, steps={self.steps}, "
            f"history_entries={len(self._history)})"
        )

    def _append(self, sigma: float, sample_rate: float, num_steps: int) -> None:
        if self._history and self._history[-1][:2] == [sigma, sample_rate]:
            self._history[-1][2] += num_steps
        else:
            self._history.append([sigma, sample_rate, num_steps])

    def _frozen_history(self) -> History:
        return tuple((sigma, sample_rate, num_steps) for sigma, sample_rate, num_steps in self._history)
