"""Epsilon after every step: the cached spectrum (its power, its reuse) against the plain computation."""

from __future__ import annotations

import multiprocessing
import threading

import numpy as np
import pytest
import scipy.fft

from dp_hf import accounting
from dp_hf.accounting import PrivacyAccountant
from dp_hf.accounting.spectrum import LOG_POWER_FROM, Spectrum

DELTA = 1e-5


def plain_power(values: np.ndarray, exponent: int) -> np.ndarray:
    """What the composition computed before the cache: ``exp(T log z)`` on every frequency."""
    if exponent < LOG_POWER_FROM:
        return values**exponent
    with np.errstate(all="ignore"):
        powered = np.exp(exponent * np.log(values))
    powered[values == 0] = 0
    return powered


@pytest.mark.parametrize("exponent", [1, 7, 99, 100, 101, 2_000, 100_000])
def test_power_equals_the_plain_power_on_every_frequency(exponent):
    """Skipping the frequencies that underflow (and caching the log) changes no value: the skipped ones
    are zeros in the plain computation too; exact zeros of the spectrum stay zeros."""
    remove, add = accounting.pld.one_step_pld(1.0, 0.01, 1e-4)
    for probs in (remove.probs, add.probs, np.array([0.5, 0.5])):  # the last: an exact zero
        length = scipy.fft.next_fast_len(2 * len(probs))
        spectrum = Spectrum(probs, length)
        expected = plain_power(spectrum.values, exponent)
        if len(probs) == 2:
            assert spectrum.values[2] == 0
        elif exponent >= 2_000:  # the skip is real: most of a PLD's spectrum underflows
            assert np.count_nonzero(expected) < len(expected) / 10
        for _ in range(2):  # the second call uses the cached log
            np.testing.assert_array_equal(spectrum.power(exponent), expected)


def test_epsilon_every_few_steps_reuses_the_spectrum_and_matches_the_reference(monkeypatch):
    """A run asking for epsilon every 5 steps to T = 400 (crossing the switch to exp(T log z) at 100):
    each answer equals PLDAccountant's on the whole history, and the forward FFT of one step's PMFs is
    computed a handful of times, not on every query."""
    sigma, sample_rate = 0.8, 0.01
    accounting.pld.one_step_pld.cache_clear()
    accounting.epsilon.epsilon_of_history.cache_clear()
    forward_ffts = []
    rfft = scipy.fft.rfft

    def counting_rfft(*args, **kwargs):
        forward_ffts.append(len(args[0]))
        return rfft(*args, **kwargs)

    monkeypatch.setattr(scipy.fft, "rfft", counting_rfft)
    accountant = PrivacyAccountant()
    queries = 0
    for step in range(1, 401):
        accountant.step(sigma, sample_rate)
        if step % 5 and step not in (99, 101):
            continue
        epsilon = accountant.get_epsilon(DELTA)
        queries += 1
        if step in (5, 100, 101, 255, 400):
            history = ((sigma, sample_rate, step),)
            grid = accounting.pld.pld_grid(history)
            with monkeypatch.context() as unpatched:
                unpatched.setattr(scipy.fft, "rfft", rfft)
                reference = accounting.pld.reference_pld_epsilon(history, DELTA, grid)
            assert epsilon == pytest.approx(reference, rel=1e-8), step
    assert queries == 82
    assert 2 <= len(forward_ffts) <= 12, forward_ffts  # two PMFs, a few rungs of FFT lengths
    # the FFT length depends on the history only: the same bits as from cold caches
    accounting.pld.one_step_pld.cache_clear()
    accounting.epsilon.epsilon_of_history.cache_clear()
    assert PrivacyAccountant().epsilon_after(400, sigma, sample_rate, DELTA) == epsilon


def test_large_spectra_are_not_kept(monkeypatch):
    """Above ``FFT_CACHE_MAX_LENGTH`` the spectrum is dropped after use (memory): the answer is the same."""
    remove, _ = accounting.pld.one_step_pld(1.0, 0.01, 1e-4)
    pmf = accounting.pld.Pmf(remove.lower, remove.probs.copy(), remove.infinity_mass)
    kept = pmf.self_composed(150)
    monkeypatch.setattr(accounting.pld, "FFT_CACHE_MAX_LENGTH", 1)
    fresh = accounting.pld.Pmf(remove.lower, remove.probs.copy(), remove.infinity_mass)
    dropped = fresh.self_composed(150)
    assert fresh._spectrum is None and pmf._spectrum is not None
    assert dropped.lower == kept.lower
    np.testing.assert_array_equal(dropped.probs, kept.probs)


# --- epsilon computed ahead on the accounting's worker thread ------------------------------------


def spy_on_computations(monkeypatch) -> list[str]:
    """Names of the threads that compute an epsilon (``epsilon._epsilon``), in order."""
    threads = []
    compute = accounting.epsilon._epsilon

    def spy(*args):
        threads.append(threading.current_thread().name)
        return compute(*args)

    monkeypatch.setattr(accounting.epsilon, "_epsilon", spy)
    return threads


def test_prefetched_epsilon_is_taken_by_the_later_query(monkeypatch):
    """The value computed ahead is the one get_epsilon returns once the steps are taken, and it is not
    computed a second time; a query for another history computes its own (exact) value."""
    accounting.epsilon.epsilon_of_history.cache_clear()
    threads = spy_on_computations(monkeypatch)
    accountant = PrivacyAccountant()
    accountant.step(0.8, 0.01, num_steps=40)
    future = accountant.prefetch_epsilon_after(20, 0.8, 0.01, DELTA)
    other = accountant.get_epsilon(DELTA)  # T = 40: computed here, after the worker's (lock)
    accountant.step(0.8, 0.01, num_steps=20)
    epsilon = accountant.get_epsilon(DELTA)
    assert future.result() == epsilon
    assert sorted(threads) == ["MainThread", "dp_hf-epsilon_0"]  # T = 40 here, T = 60 on the worker
    accounting.epsilon.epsilon_of_history.cache_clear()
    monkeypatch.undo()
    reference = accounting.pld.reference_pld_epsilon(((0.8, 0.01, 60),), DELTA, 1e-4)
    assert epsilon == pytest.approx(reference, rel=1e-8)
    assert other == accounting.epsilon.epsilon_of_history("pld", ((0.8, 0.01, 40),), DELTA, 1.0)


def test_queries_while_prefetches_run_get_the_sequential_values():
    """Prefetches of several histories and queries of others in the main thread at the same time (the
    shared one-step PLDs and spectra are used one computation at a time): every value equals the one
    computed alone, afterwards, from cold caches."""
    accounting.epsilon.epsilon_of_history.cache_clear()
    histories = [((0.7, 0.01, steps),) for steps in (30, 45, 60, 75, 90, 105)]
    futures = [accounting.epsilon.prefetch("pld", h, DELTA) for h in histories[::2]]
    mains = [accounting.epsilon.epsilon_of_history("pld", h, DELTA, 1.0) for h in histories[1::2]]
    concurrent = [f.result() for f in futures] + mains
    accounting.epsilon.epsilon_of_history.cache_clear()
    accounting.pld.one_step_pld.cache_clear()
    alone = [
        accounting.epsilon.epsilon_of_history("pld", h, DELTA, 1.0) for h in histories[::2] + histories[1::2]
    ]
    assert concurrent == alone


def test_a_forked_child_computes_while_the_parent_prefetches():
    """A child forked while the worker holds the computation lock gets fresh locks and no dead worker
    (it would otherwise wait forever)."""
    accounting.epsilon.epsilon_of_history.cache_clear()
    accounting.pld.one_step_pld.cache_clear()
    future = accounting.epsilon.prefetch("pld", ((0.6, 0.004, 500),), DELTA)  # ~0.2 s of work
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(
        target=lambda: results.put(PrivacyAccountant().epsilon_after(10, 1.0, 0.01, DELTA))
    )
    child.daemon = True  # never left waiting for at exit
    child.start()
    child.join(timeout=120)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0, "the forked child did not finish"
    assert results.get(timeout=5) == pytest.approx(
        accounting.epsilon.epsilon_of_history("pld", ((1.0, 0.01, 10),), DELTA, 1.0)
    )
    assert future.result() > 0
