"""Epsilon of a training history for each accountant (the cached dispatcher), the DP event of a history,
and the history helpers (validation, merging).
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import threading
from collections.abc import Sequence
from typing import Any

from dp_hf import validation
from dp_hf.accounting.constants import History
from dp_hf.accounting.pld import (
    PLDTooLargeError,
    composed_pld,
    one_step_pld,
    one_step_points,
    pld_epsilon,
    pld_grid,
)
from dp_hf.accounting.rdp import one_step_rdp, rdp_epsilon


@functools.lru_cache(maxsize=1024)
def epsilon_of_history(
    accountant: str, history: History, delta: float, grid_coarsening: float = 1.0
) -> float:
    """Epsilon of a validated history. Cached: the same run is often asked about repeatedly.

    Callers pass ``grid_coarsening`` explicitly (``1.0``): ``lru_cache`` keys ``f(a, b, c)`` and
    ``f(a, b, c, 1.0)`` apart, and the trainer's epsilon after the planned steps should be the
    calibration's own, cached evaluation.

    ``grid_coarsening`` multiplies the PLD grid (searches use a coarse first pass). A value that
    :func:`prefetch` started computing is taken from its worker (waiting for it if needed).
    Raises :class:`PLDTooLargeError` where the PLD would exceed ``PLD_MAX_POINTS`` grid points.
    """
    key = (accountant, history, delta, grid_coarsening)
    if not threading.current_thread().name.startswith(_WORKER_NAME):
        with _state.lock:
            future = _state.pending.pop(key, None)
        if future is not None:
            return future.result()
    return _locked_epsilon(*key)


def clear_caches() -> None:
    """Forget every epsilon, PLD and RDP this process has cached: the next queries compute as a fresh
    process would (a benchmark of a user's single run must not reuse an earlier run's calibration)."""
    for cached in (epsilon_of_history, composed_pld, one_step_pld, one_step_points, one_step_rdp):
        cached.cache_clear()


def prefetch(accountant: str, history: History, delta: float) -> concurrent.futures.Future:
    """Start computing ``epsilon_of_history(accountant, history, delta, 1.0)`` on a worker thread.

    For a value needed soon (the next log line's epsilon): the computation (tens of milliseconds
    for a PLD at the 1e-4 grid) then overlaps training instead of pausing it, and the later call of
    :func:`epsilon_of_history` takes its result. The same function computes it, so the value is the
    same. The result is also available from the returned future.
    """
    key = (accountant, history, delta, 1.0)
    with _state.lock:
        future = _state.pending.get(key)
        if future is None:
            future = _state.worker().submit(_prefetched, key)
            _state.pending[key] = future
    return future


def _prefetched(key: tuple) -> float:
    """The worker's task: the value as :func:`epsilon_of_history` gives it (a cached one is not
    recomputed, a new one is cached), then no longer pending (the cache has it)."""
    try:
        return epsilon_of_history(*key)
    finally:
        with _state.lock:
            _state.pending.pop(key, None)


_WORKER_NAME = "dp_hf-epsilon"


class _PrefetchState:
    """The prefetch worker, its pending results, and the lock that serializes the computations (the
    cached one-step PLDs and their spectra are shared, and not safe to use from two threads at once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards ``pending``
        self.compute = threading.Lock()  # one epsilon computation at a time, in any thread
        self.pending: dict[tuple, concurrent.futures.Future] = {}
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None

    def worker(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._worker is None:  # started on first use (called under ``lock``)
            self._worker = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=_WORKER_NAME
            )
        return self._worker


_state = _PrefetchState()


def _reset_after_fork() -> None:
    # A forked child has no worker thread (its futures would never finish), and a lock held by a
    # thread of the parent at the fork would stay locked forever.
    global _state
    _state = _PrefetchState()


os.register_at_fork(after_in_child=_reset_after_fork)


def _locked_epsilon(accountant: str, history: History, delta: float, grid_coarsening: float) -> float:
    with _state.compute:
        return _epsilon(accountant, history, delta, grid_coarsening)


def _epsilon(accountant: str, history: History, delta: float, grid_coarsening: float) -> float:
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
