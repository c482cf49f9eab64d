"""Privacy loss distributions: dp_accounting's "connect the dots" PLD replicated with the slow parts
vectorised, one step's PLD cached, compositions by FFT powers, and a size limit (:class:`PLDTooLargeError`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import dp_accounting
import numpy as np
import scipy.fft
import scipy.signal
import scipy.special
from dp_accounting.pld import pld_pmf, pld_privacy_accountant, privacy_loss_mechanism

from dp_hf.accounting import constants
from dp_hf.accounting.constants import (
    PLD_GRID_PER_STEP_SPREAD,
    PLD_VALUE_DISCRETIZATION_INTERVAL,
    History,
)
from dp_hf.accounting.gaussian import gaussian_deltas, gaussian_loss, rounded_range
from dp_hf.accounting.spectrum import Spectrum


def pld_grid(history: History) -> float:
    """PLD grid spacing for a history: ``min(1e-4, 0.1 * min_i s_i)`` nats.

    ``s = q sqrt(exp(1/sigma^2) - 1)`` is the standard deviation of one step's privacy
    loss ``log(1 - q + q exp((2x - 1) / (2 sigma^2)))``, ``x ~ N(0, sigma^2)``, to first
    order in ``q``. Measured (q from 1e-4 to 1e-2, sigma from 1 to 4, T up to 6e5): a
    tenth of it is within 0.1% of a 10x finer grid, and costs at most a few seconds.
    """
    spread = min(q * math.sqrt(math.expm1(min(1.0 / sigma**2, 50.0))) for sigma, q, _ in history)
    return min(PLD_VALUE_DISCRETIZATION_INTERVAL, PLD_GRID_PER_STEP_SPREAD * spread)


# --- fast PLD composition ----------------------------------------------------------------------------
#
# dp_accounting's PLDAccountant rebuilds one step's PLD for every query, with a Python loop over its grid
# points (0.2-1 s at the 1e-4 grid), and scans the composed PLD in Python for epsilon. The functions below
# perform the same arithmetic in the same order with the slow parts vectorised or cached:
#
# * one step's PLD (pessimistic connect-the-dots, Gaussian noise truncated at log mass -50), cached per
#   (sigma, q, grid): the hockey-stick divergences at the grid points come from one vectorised pass of the
#   same formulas as ``GaussianPrivacyLoss.get_delta_for_epsilon`` (which loops over the points;
#   :mod:`dp_hf.accounting.gaussian`);
# * its T-fold self-composition (FFT power, Chernoff tail bounds for a 1e-15 tail): the log-MGFs behind the
#   bounds and the FFT of one step (:class:`~dp_hf.accounting.spectrum.Spectrum`, at lengths on a fixed
#   ladder that consecutive T share) are cached, so T -> T + 1 costs one power (of the frequencies that
#   do not underflow) and one inverse FFT; the FFT is the real-input one (dp_accounting: complex), half
#   the work, and its length may exceed dp_accounting's (the same convolution on the kept support);
# * the composition of the entries of a history (FFT convolution, 1e-15 tail truncation), with the
#   composed prefix of a multi-entry history cached;
# * epsilon(delta): the same sequential sums as dp_accounting's scan, with numpy.
#
# ``reference_pld_epsilon`` (PLDAccountant itself) is the reference: the real-input FFT's rounding puts
# epsilon within ~1e-9 of it (relative; everything else is the same arithmetic), and the tests check
# 1e-8. Tiny PLDs (<= 1000 points, which dp_accounting keeps sparse) go to the reference, which is fast
# for them.

TAIL_MASS_TRUNCATION = 1e-15  # dp_accounting's default for self_compose and compose
SPARSE_PMF_SIZE = 1000  # dp_accounting keeps PMFs of at most this many points sparse (pld_pmf.create_pmf)
EPSILON_SCAN_CHUNK = 1 << 16
LOG_MGF_ERROR = 1e-12  # bound on |approximate_log_mgfs - scipy.special.logsumexp| (actual: ~1e-14)
FFT_CACHE_MAX_LENGTH = 1 << 20  # cache one step's spectrum (and its log) only up to this length (8 MiB each)
SPECTRUM_RUNG_GROWTH_PERCENT = 110  # FFT lengths: len(probs) grown by 10% at a time (Pmf._spectrum_for)
CONCURRENT_MIN_POINTS = 1 << 15  # below this, a thread hand-off costs more than it saves

_Result = TypeVar("_Result")


@functools.cache
def _side_worker() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=_WORKER_NAME)


_WORKER_NAME = "dp_hf-pld-side"
# A forked child inherits the executor but not its thread: it would wait forever on its first task.
os.register_at_fork(after_in_child=_side_worker.cache_clear)


def both_sides(
    remove: Callable[[], _Result], add: Callable[[], _Result] | None, points: int
) -> tuple[_Result, _Result | None]:
    """``(remove(), add())``, the two run concurrently when the PMFs have ``points`` or more points.

    A PLD is two PMFs (remove and add adjacency) that are built, composed and scanned independently,
    almost entirely inside numpy, scipy.special and scipy.fft calls that release the GIL: on two
    cores the pair takes ~0.55-0.75 of the time of running them in turn, with the same arithmetic
    (so the same bits). ``add`` is None for a symmetric PLD. Sequential inside the worker itself.
    """
    if add is None:
        return remove(), None
    if points < CONCURRENT_MIN_POINTS or threading.current_thread().name.startswith(_WORKER_NAME):
        return remove(), add()
    pending = _side_worker().submit(add)
    try:
        first = remove()
    finally:
        concurrent.futures.wait([pending])  # never leave the worker running on a failure here
    return first, pending.result()


class PLDTooLargeError(ValueError):
    """The PLD accountant would need more than ``PLD_MAX_POINTS`` grid points (time and memory)."""

    def __init__(self, message: str, points: int) -> None:
        super().__init__(message)
        self.points = points


class Pmf:
    """Dense PLD probability mass function: mass ``probs[i]`` at loss ``(lower + i) * grid``, plus mass
    ``infinity_mass`` at +infinity (dp_accounting's ``DensePLDPmf``), with caches for self-composition."""

    __slots__ = ("lower", "probs", "infinity_mass", "_log_mgfs", "_exact_log_mgfs", "_spectrum")

    def __init__(self, lower: int, probs: np.ndarray, infinity_mass: float) -> None:
        self.lower, self.probs, self.infinity_mass = lower, probs, infinity_mass
        self._log_mgfs: np.ndarray | None = None
        self._exact_log_mgfs: dict[int, float] = {}
        self._spectrum: Spectrum | None = None

    def self_composed(self, num_times: int, scale: float = 1.0) -> Pmf:
        """``DensePLDPmf.self_compose(num_times)`` (``common.self_convolve``), with cached log-MGFs and FFT.

        dp_accounting raises the complex FFT of the probabilities to the power ``T``; the probabilities are
        real, so the real-input FFT (half the spectrum, half the work) gives the same convolution up to
        rounding: epsilon within ~1e-9 (relative) of dp_accounting's, against a discretisation error
        of ~1e-3.
        """
        lower_bound, upper_bound = self._self_convolve_bounds(num_times)
        output_length = upper_bound - lower_bound + 1
        needed = max(output_length, len(self.probs))
        check_points(scipy.fft.next_fast_len(needed), f"{num_times} self-composed steps", scale)
        spectrum = self._spectrum_for(needed)
        fast_length = spectrum.length
        if fast_length > FFT_CACHE_MAX_LENGTH:
            self._spectrum = None  # too large to keep (memory)
        convolution = scipy.fft.irfft(spectrum.power(num_times), fast_length)
        # np.roll(convolution, -lower_bound)[:output_length], without rolling all of it
        start = lower_bound % fast_length
        wrapped = start + output_length - fast_length
        probs = (
            convolution[start : start + output_length].copy()
            if wrapped <= 0
            else np.concatenate((convolution[start:], convolution[:wrapped]))
        )
        infinity_mass = TAIL_MASS_TRUNCATION - math.expm1(num_times * math.log1p(-self.infinity_mass))
        return Pmf(self.lower * num_times + lower_bound, probs, infinity_mass)

    def _self_convolve_bounds(self, num_times: int) -> tuple[int, int]:
        """``common.compute_self_convolve_bounds(probs, num_times, 1e-15)``: Chernoff bounds on the support.

        Its 40 log-MGFs ``log sum_i p_i exp(i k / size)``, ``k = +-1..20``, depend on the PMF only and are
        computed once, in one vectorised pass (``approximate_log_mgfs``) accurate to ~1e-14 instead
        of 40 ``scipy.special.logsumexp`` calls. A bound only enters through ``ceil``/``floor``: where
        the approximation could change the integer, scipy's value is used, so the bounds are the same.
        """
        size = len(self.probs)
        orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / size
        if self._log_mgfs is None:
            self._log_mgfs = approximate_log_mgfs(self.probs)
        upper_bound, lower_bound = (size - 1) * num_times, 0
        for index, order in enumerate(orders):
            bound = (num_times * self._log_mgfs[index] + math.log(2 / TAIL_MASS_TRUNCATION)) / order
            margin = num_times / abs(order) * LOG_MGF_ERROR + 1e-9
            if not math.isfinite(bound) or abs(bound - round(bound)) <= margin:
                log_mgf = self._exact_log_mgfs.get(index)
                if log_mgf is None:
                    log_mgf = scipy.special.logsumexp(np.arange(size) * order, b=self.probs)
                    self._exact_log_mgfs[index] = log_mgf
                bound = (num_times * log_mgf + math.log(2 / TAIL_MASS_TRUNCATION)) / order
            if not math.isfinite(bound):
                continue
            if order > 0:
                upper_bound = min(upper_bound, math.ceil(bound))
            if order < 0:
                lower_bound = max(lower_bound, math.floor(bound))
        return lower_bound, upper_bound

    def _spectrum_for(self, needed: int) -> Spectrum:
        """The spectrum (cached) for a self-composition that needs an FFT of ``needed`` points or more.

        dp_accounting takes ``next_fast_len(needed)``. Any length >= ``needed`` gives the same circular
        convolution on the kept support (only the 1e-15 truncated tail wraps elsewhere), so the lengths
        are rungs of a fixed ladder, ``next_fast_len`` of ``len(probs)`` grown by 10% at a time: the
        support grows by up to a few hundred points per step, so epsilon after one more step finds
        the spectrum (and its log) of its rung cached, with no forward FFT and no complex log (each
        about a third of the time). The rung depends on ``needed`` only, never on earlier queries,
        so every epsilon is a function of its history alone (the same bits in any order of queries).
        """
        rung = len(self.probs)
        while rung < needed:
            rung = (rung * SPECTRUM_RUNG_GROWTH_PERCENT + 99) // 100  # integers: the same rungs everywhere
        length = scipy.fft.next_fast_len(rung)
        if self._spectrum is None or self._spectrum.length != length:
            self._spectrum = Spectrum(self.probs, length)
        return self._spectrum

    def composed_with(self, other: Pmf, scale: float = 1.0) -> Pmf:
        """``DensePLDPmf.compose(other, tail_mass_truncation=1e-15)`` (pessimistic truncation)."""
        check_points(
            len(self.probs) + len(other.probs) - 1, "the composition of the history's entries", scale
        )
        probs = scipy.signal.fftconvolve(self.probs, other.probs)
        infinity_mass = self.infinity_mass + other.infinity_mass - self.infinity_mass * other.infinity_mass
        # pld_pmf._truncate_tails(probs, 1e-15, pessimistic_estimate=True)
        threshold = TAIL_MASS_TRUNCATION / 2
        left = prefix_within(probs, threshold)
        right = max(len(probs) - prefix_within(np.flip(probs), threshold), left + 1)
        left_mass, right_mass = np.sum(probs[:left]), np.sum(probs[right:])
        truncated = probs[left:right]
        truncated[0] += left_mass
        return Pmf(self.lower + other.lower + left, truncated, infinity_mass + right_mass)

    def epsilon(self, delta: float, grid: float) -> float:
        """``DensePLDPmf.get_epsilon_for_delta`` (``pld_pmf._get_epsilon_for_delta``), vectorised.

        Scans the losses from the top, ``loss_0 = upper``, ``loss_{j+1} = loss_j - grid`` (as
        ``itertools.count`` makes them), accumulating ``mass_upper += p`` and
        ``mass_lower += exp(-loss) p`` sequentially (``np.cumsum`` is sequential too), in chunks.
        """
        if self.infinity_mass > delta:
            return math.inf
        probs = self.probs
        mass_upper, mass_lower = self.infinity_mass, 0.0
        loss = (self.lower + len(probs) - 1) * grid
        end = len(probs)
        # work buffers reused across chunks (fresh arrays this large would each be page-faulted in)
        size = min(EPSILON_SCAN_CHUNK, end)
        losses_buffer, uppers_buffer, lowers_buffer = np.empty(size), np.empty(size + 1), np.empty(size + 1)
        while end > 0:
            start = max(0, end - EPSILON_SCAN_CHUNK)
            chunk = probs[start:end][::-1]
            losses, uppers, lowers = (
                losses_buffer[: len(chunk)],
                uppers_buffer[: len(chunk) + 1],
                lowers_buffer[: len(chunk) + 1],
            )
            losses.fill(-grid)
            losses[0] = loss
            np.cumsum(losses, out=losses)
            uppers[0], uppers[1:] = mass_upper, chunk
            np.cumsum(uppers, out=uppers)
            lowers[0] = mass_lower
            np.negative(losses, out=lowers[1:])
            np.exp(lowers[1:], out=lowers[1:])
            np.multiply(lowers[1:], chunk, out=lowers[1:])
            np.cumsum(lowers, out=lowers)
            # neither a stop nor an infinite epsilon before the upper mass reaches delta (not monotone:
            # the FFT leaves tiny negative probabilities)
            if uppers.max() < delta:
                mass_upper, mass_lower = uppers[-1], lowers[-1]
                loss = losses[-1] + -grid
                end = start
                continue
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                stops = (
                    (uppers[:-1] > delta)
                    & (lowers[:-1] > 0)
                    & (np.log((uppers[:-1] - delta) / lowers[:-1]) >= losses)
                )
            infinite = (uppers[1:] >= delta) & (lowers[1:] == 0)
            stop = int(np.argmax(stops)) if stops.any() else len(chunk)
            first_infinite = int(np.argmax(infinite)) if infinite.any() else len(chunk)
            if first_infinite < stop:
                return max(0.0, float(losses[first_infinite]))
            if stop < len(chunk):
                mass_upper, mass_lower = uppers[stop], lowers[stop]
                break
            mass_upper, mass_lower = uppers[-1], lowers[-1]
            loss = losses[-1] + -grid
            end = start
        if mass_upper <= mass_lower + delta:
            return 0.0
        with np.errstate(over="ignore"):  # as dp_accounting: an overflow is an infinite epsilon
            return math.log((mass_upper - delta) / mass_lower)


# A PLD: (PMF for "remove", PMF for "add"); the second is None when both are the same (q = 1).
Pld = tuple[Pmf, "Pmf | None"]
IDENTITY_PLD: Pld = (Pmf(0, np.array([1]), 0), None)  # privacy_loss_distribution.identity(), densified


def approximate_log_mgfs(probs: np.ndarray) -> np.ndarray:
    """``logsumexp(arange(size) * order, b=probs)`` for ``order = k / size``, ``k = -20..-1, 1..20``.

    ``sum_i p_i exp(i k / size)`` is summed as ``sum_i p_i r_i^k`` with ``r_i = exp((i - i_0) / size) <= 1``
    (``i_0 = 0`` for ``k < 0``, ``size - 1`` for ``k > 0``), the powers by repeated multiplication:
    each term within ~20 ulp, so the log within ~1e-14 (``LOG_MGF_ERROR`` allows 100 times that).
    """
    size = len(probs)
    index = np.arange(size)
    log_mgfs = np.full(40, -math.inf)
    for start, ratio, positions in (
        (0, np.exp(-index / size), range(19, -1, -1)),  # k = -1, ..., -20
        (size - 1, np.exp((index - (size - 1)) / size), range(20, 40)),  # k = 1, ..., 20
    ):
        terms = probs
        for k, position in enumerate(positions, start=1):
            terms = terms * ratio
            total = float(np.sum(terms))
            if total > 0:
                log_mgfs[position] = math.log(total) + start * k / size
    return log_mgfs


def prefix_within(values: np.ndarray, threshold: float) -> int:
    """Length of the longest prefix of ``values`` whose running sum stays ``<= threshold`` (summed
    sequentially, as ``pld_pmf._truncate_tails`` does), looking at a growing window only."""
    total, start, window = 0.0, 0, 256
    while start < len(values):
        sums = np.cumsum(np.concatenate(([total], values[start : start + window])))[1:]
        over = sums > threshold
        if over.any():
            return start + int(np.argmax(over))
        total, start, window = sums[-1], start + window, 4 * window
    return len(values)


def check_points(points: int, what: str, scale: float = 1.0) -> None:
    """Refuse more than ``PLD_MAX_POINTS`` points; ``scale`` > 1 on a coarse search grid (the accounting
    grid will need ``scale`` times as many: no use searching where it cannot follow)."""
    if points * scale > constants.PLD_MAX_POINTS:  # read at call time: tests lower it
        needed = round(points * scale)
        raise PLDTooLargeError(
            f"The PLD accountant would need {needed:,} grid points for {what} (limit PLD_MAX_POINTS = "
            f"{constants.PLD_MAX_POINTS:,}): its time and memory grow with the spread of the privacy loss, i.e. "
            "with epsilon.",
            points=needed,
        )


def pld_epsilon(history: History, delta: float, grid: float, scale: float = 1.0) -> float:
    """``reference_pld_epsilon(history, delta, grid)``, fast: cached one-step PLDs and prefixes.

    ``scale``: see ``check_points`` (the grid coarsening of a search stage).
    """
    for sigma, sample_rate, _ in history:
        what = f"one step (noise multiplier {sigma!r}, sample rate {sample_rate!r})"
        check_points(one_step_points(sigma, sample_rate, grid), what, scale)
    steps = [one_step_pld(sigma, sample_rate, grid) for sigma, sample_rate, _ in history]
    if any(is_sparse(step, num_steps) for step, (_, _, num_steps) in zip(steps, history)):
        return reference_pld_epsilon(history, delta, grid)
    prefix = composed_pld(history[:-1], grid, scale) if len(history) > 1 else IDENTITY_PLD
    pld = compose_plds(prefix, self_compose_pld(steps[-1], history[-1][2], scale), scale)
    remove, add = pld
    epsilons = both_sides(
        lambda: remove.epsilon(delta, grid),
        None if add is None else lambda: add.epsilon(delta, grid),
        len(remove.probs),
    )
    return epsilons[0] if epsilons[1] is None else max(epsilons)


@functools.lru_cache(maxsize=2)
def composed_pld(history: History, grid: float, scale: float) -> Pld:
    """The composed PLD of a whole (non-empty) history; cached for the prefixes of multi-entry histories."""
    prefix = composed_pld(history[:-1], grid, scale) if len(history) > 1 else IDENTITY_PLD
    sigma, sample_rate, num_steps = history[-1]
    step = one_step_pld(sigma, sample_rate, grid)
    return compose_plds(prefix, self_compose_pld(step, num_steps, scale), scale)


def self_compose_pld(pld: Pld, num_steps: int, scale: float) -> Pld:
    remove, add = pld
    return both_sides(
        lambda: remove.self_composed(num_steps, scale),
        None if add is None else lambda: add.self_composed(num_steps, scale),
        len(remove.probs),
    )


def compose_plds(first: Pld, second: Pld, scale: float) -> Pld:
    """``PrivacyLossDistribution.compose``: add-PMFs only when either PLD is asymmetric."""
    add = None
    if first[1] is not None or second[1] is not None:
        add_first, add_second = first[1] or first[0], second[1] or second[0]

        def add() -> Pmf:
            return add_first.composed_with(add_second, scale)

    return both_sides(
        lambda: first[0].composed_with(second[0], scale), add, len(first[0].probs) + len(second[0].probs)
    )


def is_sparse(pld: Pld, num_steps: int) -> bool:
    """Whether dp_accounting keeps the ``num_steps``-fold composition sparse (its tiny-PLD path)."""
    for pmf in pld:
        if pmf is not None:
            size = len(pmf.probs)
            if size == 1 or (
                size <= SPARSE_PMF_SIZE and num_steps < 10 and size**num_steps <= SPARSE_PMF_SIZE
            ):
                return True
    return False


@functools.lru_cache(maxsize=4)  # up to 2 x PLD_MAX_POINTS floats each
def one_step_pld(sigma: float, sample_rate: float, grid: float) -> Pld:
    """``from_gaussian_mechanism(sigma, value_discretization_interval=grid, sampling_prob=q)``."""
    adjacency = privacy_loss_mechanism.AdjacencyType
    return both_sides(
        lambda: one_step_pmf(sigma, sample_rate, grid, adjacency.REMOVE),
        None if sample_rate == 1.0 else lambda: one_step_pmf(sigma, sample_rate, grid, adjacency.ADD),
        one_step_points(sigma, sample_rate, grid),
    )


@functools.lru_cache(maxsize=64)
def one_step_points(sigma: float, sample_rate: float, grid: float) -> int:
    """Grid points of one step's PLD (the larger of its two PMFs), without building it."""
    adjacencies = [privacy_loss_mechanism.AdjacencyType.REMOVE, privacy_loss_mechanism.AdjacencyType.ADD]
    return max(rounded_range(gaussian_loss(sigma, sample_rate, a), grid)[2] for a in adjacencies)


def one_step_pmf(sigma: float, sample_rate: float, grid: float, adjacency: Any) -> Pmf:
    """``_create_pld_pmf_from_monotone_privacy_loss(GaussianPrivacyLoss(...), use_connect_dots=True)``."""
    loss = gaussian_loss(sigma, sample_rate, adjacency)
    rounded_lower, rounded_upper, points = rounded_range(loss, grid)
    check_points(points, f"one step (noise multiplier {sigma!r}, sample rate {sample_rate!r})")
    epsilons = np.arange(rounded_lower, rounded_upper + 1) * grid
    deltas = gaussian_deltas(loss, epsilons, sigma, sample_rate, adjacency)
    if deltas is None:  # an edge case of dp_accounting's scalar code: let it decide (or raise)
        deltas = loss.get_delta_for_epsilon(epsilons)
    return connect_dots_pmf(grid, rounded_lower, rounded_upper, deltas)


def connect_dots_pmf(grid: float, rounded_lower: int, rounded_upper: int, deltas: np.ndarray) -> Pmf:
    """``pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap``, returned dense."""
    deltas = np.asarray(deltas, dtype=np.float64)
    if rounded_lower == rounded_upper:
        return Pmf(rounded_lower, np.array([1 - deltas[0]]), deltas[0])
    if np.any(deltas < 0) or np.any(deltas > 1) or np.any(np.diff(deltas) > 1e-12):
        # dp_accounting's own checks raise the proper error
        pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(grid, rounded_lower, rounded_upper, deltas)
    deltas = np.minimum.accumulate(deltas)
    delta_diffs = np.diff(deltas)
    probs = np.zeros_like(deltas)
    probs[0] = 1 - deltas[0] + delta_diffs[0] / math.expm1(grid)
    probs[1:-1] = (delta_diffs[1:] - delta_diffs[:-1] * math.exp(grid)) / math.expm1(grid)
    probs[-1] = delta_diffs[-1] / math.expm1(-grid)
    return Pmf(rounded_lower, np.maximum(0.0, probs), deltas[-1])


def dp_event(history: History) -> dp_accounting.DpEvent:
    """``Composed(SelfComposed(PoissonSampled(q_i, Gaussian(sigma_i)), T_i) for each entry i)``."""
    return dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(sigma)),
                num_steps,
            )
            for sigma, sample_rate, num_steps in history
        ]
    )


def reference_pld_epsilon(history: History, delta: float, grid: float) -> float:
    """dp_accounting's ``PLDAccountant`` on the whole history: the slow reference the fast path replicates."""
    engine = pld_privacy_accountant.PLDAccountant(value_discretization_interval=grid)
    engine.compose(dp_event(history))
    return float(engine.get_epsilon(delta))
