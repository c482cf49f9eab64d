from __future__ import annotations

import json
import math
import re

import dp_accounting
import pytest

from dp_hf import accounting
from dp_hf.accounting import (
    PrivacyAccountant,
    accounting_library_version,
    calibrate_noise_multiplier,
    compute_epsilon,
    steps_within_budget,
)

DELTA = 1e-5
MNIST_Q, MNIST_T = 256 / 60000, 1171  # B = 256, N = 60,000, 5 epochs
CIFAR_Q, CIFAR_T = 512 / 50000, 488  # B = 512, N = 50,000, 5 epochs

# Check values at delta = 1e-5: (q, T, sigma, DP-MacAdam paper's epsilon, converged PLD epsilon).
# The converged values were computed with dp_accounting's PLD on a 10x finer grid (1e-5) than ours;
# dp-accounting 0.4.3 gives the same numbers. The paper's epsilons are 0.2% to 2% HIGHER than the
# converged PLD values: its table is a slightly looser upper bound (Opacus' PRV accountant's
# eps_upper, for one, lands within 0.75% of it), so ours must be below the paper's and close to it.
CHECK_VALUES = [
    (MNIST_Q, MNIST_T, 0.5, 7.49, 7.4714),
    (MNIST_Q, MNIST_T, 0.8, 1.46, 1.4452),
    (MNIST_Q, MNIST_T, 1.0, 0.80, 0.7837),
    (CIFAR_Q, CIFAR_T, 0.5, 10.40, 10.3718),
    (CIFAR_Q, CIFAR_T, 1.1, 1.11, 1.0981),
    (CIFAR_Q, CIFAR_T, 1.5, 0.66, 0.6504),
]
CHECK_IDS = [f"q={q:.5f}-T={t}-sigma={s}" for q, t, s, _, _ in CHECK_VALUES]

# Our PLD epsilon against dp_accounting's PLDAccountant: the same arithmetic except the self-composition's
# real-input FFT (dp_accounting: complex), whose rounding moves epsilon by ~1e-9 (relative).
PLD_RTOL = 1e-8

# A cheap configuration for everything that is not about the paper's numbers.
Q, T = 0.01, 200


@pytest.mark.parametrize(("q", "steps", "sigma", "paper", "converged"), CHECK_VALUES, ids=CHECK_IDS)
def test_check_values(q, steps, sigma, paper, converged):
    epsilon = compute_epsilon(q, sigma, steps, DELTA)
    assert epsilon == pytest.approx(converged, rel=1e-3)
    assert epsilon <= paper
    assert epsilon == pytest.approx(paper, rel=0.025)


@pytest.mark.parametrize(("q", "steps", "sigma", "paper", "converged"), CHECK_VALUES, ids=CHECK_IDS)
def test_check_values_agree_with_opacus_prv(q, steps, sigma, paper, converged):
    """An independent accountant agrees: Opacus' PRV upper estimate (its eps_error is 0.01)."""
    prv = pytest.importorskip("opacus.accountants").PRVAccountant()
    prv.history = [(sigma, q, steps)]
    assert compute_epsilon(q, sigma, steps, DELTA) == pytest.approx(prv.get_epsilon(DELTA), abs=0.02)


@pytest.mark.parametrize(("q", "steps", "sigma", "paper", "converged"), CHECK_VALUES, ids=CHECK_IDS)
def test_prv_accountant_reproduces_the_paper_within_one_percent(q, steps, sigma, paper, converged):
    """accountant="prv" (Opacus's PRV upper bound) gives the paper's table values within 1%."""
    epsilon = compute_epsilon(q, sigma, steps, DELTA, accountant="prv")
    assert epsilon == pytest.approx(paper, rel=0.01)
    assert epsilon >= converged  # an upper bound of the converged PLD value


def test_prv_accountant_is_stateful_and_calibrates():
    accountant = PrivacyAccountant("prv")
    accountant.step(1.0, MNIST_Q, num_steps=MNIST_T)
    assert accountant.get_epsilon(DELTA) == pytest.approx(
        compute_epsilon(MNIST_Q, 1.0, MNIST_T, DELTA, "prv")
    )
    sigma = calibrate_noise_multiplier(1.0, DELTA, MNIST_Q, MNIST_T, accountant="prv")
    assert compute_epsilon(MNIST_Q, sigma, MNIST_T, DELTA, accountant="prv") <= 1.0


@pytest.mark.parametrize("sigma", [0.8, 1.2, 2.0])
def test_rdp_is_looser_than_pld(sigma):
    pld = compute_epsilon(Q, sigma, T, DELTA, accountant="pld")
    rdp = compute_epsilon(Q, sigma, T, DELTA, accountant="rdp")
    assert rdp >= pld > 0


def test_small_sampling_rate_gets_a_finer_grid():
    """q = 1e-4, sigma = 4: one step's privacy loss spreads over ~2.5e-5 nats, less than dp_accounting's
    default grid (1e-4), which overstates epsilon as 0.0399. Reference: grids of 1/10 to 1/100 of it."""
    epsilon = compute_epsilon(1e-4, 4.0, 100_000, DELTA)
    assert epsilon == pytest.approx(0.02136, rel=0.005)
    assert epsilon < compute_epsilon(1e-4, 4.0, 100_000, DELTA, accountant="rdp")


def test_matches_dp_accounting_directly():
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(0.9)), T
    )
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(event)
    assert compute_epsilon(Q, 0.9, T, DELTA, accountant="rdp") == pytest.approx(rdp.get_epsilon(DELTA))


def test_zero_noise_is_infinite_and_zero_steps_is_free():
    assert compute_epsilon(Q, 0.0, T, DELTA) == math.inf
    assert compute_epsilon(Q, 0.0, T, DELTA, accountant="rdp") == math.inf
    assert compute_epsilon(Q, 1.0, 0, DELTA) == 0.0
    assert compute_epsilon(Q, 0.0, 0, DELTA) == 0.0


def test_epsilon_grows_with_steps_and_sample_rate_and_shrinks_with_noise():
    base = compute_epsilon(Q, 1.0, T, DELTA)
    assert compute_epsilon(Q, 1.0, 2 * T, DELTA) > base
    assert compute_epsilon(2 * Q, 1.0, T, DELTA) > base
    assert compute_epsilon(Q, 1.5, T, DELTA) < base


@pytest.mark.parametrize(
    ("target", "q", "steps", "accountant"),
    [
        (1.0, MNIST_Q, MNIST_T, "pld"),
        (1.0, Q, T, "pld"),
        (0.5, Q, T, "pld"),
        (1.0, Q, T, "rdp"),
    ],
)
def test_calibrate_round_trip(target, q, steps, accountant):
    tolerance = 1e-3
    sigma = calibrate_noise_multiplier(target, DELTA, q, steps, accountant=accountant, tolerance=tolerance)
    epsilon = compute_epsilon(q, sigma, steps, DELTA, accountant=accountant)
    assert epsilon <= target
    assert epsilon == pytest.approx(target, rel=0.01)
    # Minimal up to the tolerance: a tolerance less noise breaks the budget.
    assert compute_epsilon(q, sigma - tolerance, steps, DELTA, accountant=accountant) > target


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("target", [0.001, 0.005])
def test_calibrating_a_tiny_target_gives_a_sigma_not_an_overflow(target, accountant):
    """Near-flat epsilon(sigma) made the secant search aim at exp(> 709): OverflowError (an audit, with
    target 0.001, q 0.01, 100 steps), then an RDP evaluation at sigma ~ 1e304. The aimed points stay
    finite and the evaluations at most at the noise limit: a sigma that meets the target, or the usual
    error. (RDP at sigma ~1e4 here gives epsilon 0 by dp_accounting's KL bound, below its orders' floor.)"""
    sigma = calibrate_noise_multiplier(target, 1e-5, 0.01, 100, accountant=accountant)
    assert 0 < sigma <= accounting.MAX_NOISE_MULTIPLIER
    assert compute_epsilon(0.01, sigma, 100, 1e-5, accountant=accountant) <= target


@pytest.mark.parametrize(
    ("value", "shown", "up"),
    [
        (2.221927, "2.222", True),  # a log line showed 2.2219 (nearest) for 2.221927 (an audit)
        (1.99812432, "1.999", True),  # the card showed 1.998
        (2.0, "2", True),
        (9.99961, "10", True),
        (0.923338623, "0.9233", False),
        (1234567.0, "1.235e+06", True),
        (math.inf, "inf", True),
    ],
)
def test_shown_privacy_figures_round_toward_less_privacy(value, shown, up):
    from dp_hf.accounting.display import epsilon_up, significant

    assert significant(value, 4, up=up) == shown
    rng = __import__("random").Random(0)
    for _ in range(2000):  # any value: shown up is >= it, down is <= it, within one unit of the last digit
        x = 10 ** rng.uniform(-8, 6)
        assert x <= float(significant(x, 4)) <= x * (1 + 1e-3)
        assert x * (1 - 1e-3) <= float(significant(x, 6, up=False)) <= x
        assert x <= epsilon_up(x, 4) <= x + 1e-4
    assert epsilon_up(2.221927, 4) == 2.222 and epsilon_up(2.0, 4) == 2.0


def test_a_log_lines_epsilon_as_the_trainer_prints_it_is_never_less_than_spent():
    """transformers' ProgressCallback and PrinterCallback print every logged float as ``f"{v:.4g}"``, rounded
    to nearest: an epsilon rounded up to 4 decimals (7.9961 for 7.99601) was shown as 7.996."""
    from dp_hf.accounting.display import epsilon_for_logs

    assert f"{epsilon_for_logs(7.99601):.4g}" == "7.997"
    assert f"{epsilon_for_logs(12.3412):.4g}" == "12.35" and epsilon_for_logs(2.0) == 2.0
    rng = __import__("random").Random(1)
    for _ in range(5000):
        x = 10 ** rng.uniform(-6, 5)
        logged = epsilon_for_logs(x)
        assert x <= logged <= x * (1 + 1e-3) and x <= float(f"{logged:.4g}")
    assert epsilon_for_logs(math.inf) == math.inf and epsilon_for_logs(0.0) == 0.0


def test_calibrate_pld_needs_less_noise_than_rdp():
    pld = calibrate_noise_multiplier(1.0, DELTA, Q, T, accountant="pld")  # cached by the round trip
    rdp = calibrate_noise_multiplier(1.0, DELTA, Q, T, accountant="rdp")
    assert pld < rdp


def test_calibrate_zero_steps_needs_no_noise():
    assert calibrate_noise_multiplier(1.0, DELTA, Q, 0) == 0.0


def test_steps_within_budget_is_the_last_step_under_budget():
    steps = steps_within_budget(1.0, DELTA, Q, 1.5)
    assert compute_epsilon(Q, 1.5, steps, DELTA) <= 1.0 < compute_epsilon(Q, 1.5, steps + 1, DELTA)


def test_steps_within_budget_edges():
    assert steps_within_budget(2.0, DELTA, Q, 0.0) == 0
    assert steps_within_budget(100.0, DELTA, Q, 5.0, max_steps=50) == 50
    assert steps_within_budget(1.0, DELTA, Q, 1.5, accountant="rdp") < steps_within_budget(1.0, DELTA, Q, 1.5)


def test_stateful_accountant_equals_compute_epsilon():
    accountant = PrivacyAccountant()
    for _ in range(T):
        accountant.step(noise_multiplier=1.0, sample_rate=Q)
    assert accountant.steps == T
    assert accountant.history == [[1.0, Q, T]]  # consecutive steps are merged
    assert accountant.get_epsilon(DELTA) == compute_epsilon(Q, 1.0, T, DELTA)


def test_empty_accountant_has_spent_nothing():
    accountant = PrivacyAccountant("rdp")
    assert accountant.steps == 0
    assert accountant.get_epsilon(DELTA) == 0.0
    assert accountant.mechanism == "rdp"


def test_history_merges_only_consecutive_equal_entries():
    accountant = PrivacyAccountant()
    accountant.step(1.0, Q, num_steps=10)
    accountant.step(1.0, Q, num_steps=5)
    accountant.step(2.0, Q, num_steps=3)
    accountant.step(1.0, Q)
    accountant.step(1.0, 2 * Q)
    assert accountant.history == [[1.0, Q, 15], [2.0, Q, 3], [1.0, Q, 1], [1.0, 2 * Q, 1]]
    assert accountant.steps == 20


def test_get_epsilon_is_cached():
    accountant = PrivacyAccountant()
    accountant.step(1.3, Q, num_steps=123)
    first = accountant.get_epsilon(DELTA)
    hits = accounting.epsilon.epsilon_of_history.cache_info().hits
    assert accountant.get_epsilon(DELTA) == first
    assert accounting.epsilon.epsilon_of_history.cache_info().hits == hits + 1


@pytest.mark.parametrize("name", ["pld", "rdp"])
def test_mixed_history_equals_direct_composition(name):
    sigma_low, sigma_high, steps_low, steps_high = 1.0, 2.0, 60, 140
    accountant = PrivacyAccountant(name)
    accountant.step(sigma_low, Q, num_steps=steps_low)
    accountant.step(sigma_high, Q, num_steps=steps_high)
    mixed = accountant.get_epsilon(DELTA)

    total = steps_low + steps_high
    assert (
        compute_epsilon(Q, sigma_high, total, DELTA, name)
        < mixed
        < compute_epsilon(Q, sigma_low, total, DELTA, name)
    )

    grid = accounting.PLD_VALUE_DISCRETIZATION_INTERVAL  # one step's loss spreads much wider here
    direct = (
        dp_accounting.pld.PLDAccountant(value_discretization_interval=grid)
        if name == "pld"
        else dp_accounting.rdp.RdpAccountant()
    )
    for sigma, steps in [(sigma_low, steps_low), (sigma_high, steps_high)]:
        direct.compose(
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(sigma)), steps
            )
        )
    assert mixed == pytest.approx(direct.get_epsilon(DELTA), rel=1e-9)


def test_epsilon_after_predicts_without_recording():
    accountant = PrivacyAccountant()
    accountant.step(1.0, Q, num_steps=100)
    predicted = accountant.epsilon_after(50, 1.0, Q, DELTA)
    predicted_other = accountant.epsilon_after(50, 2.0, Q, DELTA)
    assert accountant.steps == 100  # nothing recorded
    assert accountant.epsilon_after(0, 1.0, Q, DELTA) == accountant.get_epsilon(DELTA)
    accountant.step(1.0, Q, num_steps=50)
    assert accountant.get_epsilon(DELTA) == predicted == compute_epsilon(Q, 1.0, 150, DELTA)
    assert accountant.get_epsilon(DELTA) > predicted_other


def test_state_dict_round_trip_through_json():
    accountant = PrivacyAccountant("rdp")
    accountant.step(1.0, Q, num_steps=70)
    accountant.step(1.4, Q / 2, num_steps=30)
    state = accountant.state_dict()
    assert state == {"accountant": "rdp", "history": [[1.0, Q, 70], [1.4, Q / 2, 30]]}

    restored = PrivacyAccountant()  # pld; load_state_dict switches to the stored accountant
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.mechanism == "rdp"
    assert restored.history == accountant.history
    assert restored.get_epsilon(DELTA) == accountant.get_epsilon(DELTA)

    state["history"].append([9.0, 0.5, 1])  # the state dict is a copy
    assert restored.steps == accountant.steps == 100


def test_repr_and_version():
    accountant = PrivacyAccountant()
    accountant.step(1.0, Q, num_steps=3)
    assert repr(accountant) == "PrivacyAccountant(accountant='pld', steps=3, history_entries=1)"
    assert re.fullmatch(r"dp-accounting \d+\.\d+(\.\d+)?\S*", accounting_library_version())


def _bad_calls():
    """(call, bad value) pairs: each call must raise ValueError mentioning repr(bad value)."""
    acct = PrivacyAccountant()
    yield (lambda: compute_epsilon(0.0, 1.0, T, DELTA)), 0.0
    yield (lambda: compute_epsilon(1.5, 1.0, T, DELTA)), 1.5
    yield (lambda: compute_epsilon(Q, -1.0, T, DELTA)), -1.0
    yield (lambda: compute_epsilon(Q, math.nan, T, DELTA)), math.nan
    yield (lambda: compute_epsilon(Q, 1.0, -5, DELTA)), -5
    yield (lambda: compute_epsilon(Q, 1.0, 2.5, DELTA)), 2.5
    yield (lambda: compute_epsilon(Q, 1.0, T, 0.0)), 0.0
    yield (lambda: compute_epsilon(Q, 1.0, T, 1.0)), 1.0
    yield (lambda: compute_epsilon(Q, 1.0, T, DELTA, accountant="moments")), "moments"
    yield (lambda: calibrate_noise_multiplier(-1.0, DELTA, Q, T)), -1.0
    yield (lambda: calibrate_noise_multiplier(math.inf, DELTA, Q, T)), math.inf
    yield (lambda: calibrate_noise_multiplier(1.0, 2.0, Q, T)), 2.0
    yield (lambda: calibrate_noise_multiplier(1.0, DELTA, Q, T, tolerance=0.0)), 0.0
    yield (lambda: calibrate_noise_multiplier(1.0, DELTA, Q, T, accountant="RDP")), "RDP"
    yield (lambda: steps_within_budget(0.0, DELTA, Q, 1.0)), 0.0
    yield (lambda: steps_within_budget(1.0, DELTA, Q, 1.0, max_steps=0)), 0
    yield (lambda: PrivacyAccountant("gdp")), "gdp"
    yield (lambda: acct.step(-0.5, Q)), -0.5
    yield (lambda: acct.step(1.0, 0.0)), 0.0
    yield (lambda: acct.step(1.0, Q, num_steps=0)), 0
    yield (lambda: acct.get_epsilon(-1e-5)), -1e-5
    yield (lambda: acct.epsilon_after(-1, 1.0, Q, DELTA)), -1
    yield (lambda: acct.load_state_dict({"accountant": "moments", "history": []})), "moments"
    yield (lambda: acct.load_state_dict({"history": []})), {"history": []}
    yield (lambda: acct.load_state_dict({"accountant": "pld", "history": [[1.0, Q]]})), [1.0, Q]
    yield (lambda: acct.load_state_dict({"accountant": "pld", "history": [[1.0, 2.0, 3]]})), 2.0


BAD_CALLS = list(_bad_calls())


@pytest.mark.parametrize(("call", "bad_value"), BAD_CALLS, ids=[str(i) for i in range(len(BAD_CALLS))])
def test_bad_input_raises_value_error_showing_the_value(call, bad_value):
    with pytest.raises(ValueError) as info:
        call()
    assert repr(bad_value) in str(info.value)


def test_failed_load_keeps_the_previous_state():
    accountant = PrivacyAccountant()
    accountant.step(1.0, Q, num_steps=5)
    with pytest.raises(ValueError):
        accountant.load_state_dict({"accountant": "rdp", "history": [[1.0, Q, 5], [-1.0, Q, 5]]})
    assert accountant.history == [[1.0, Q, 5]] and accountant.mechanism == "pld"


# --- fast paths: same numbers as dp_accounting, much faster ---------------------------------------------

# (history, grid coarsening): single entries across regimes, q = 1 (symmetric PLD), a coarse search
# grid, mixed histories, and tiny PLDs (<= 1000 points, which dp_accounting keeps sparse).
FAST_PATH_CASES = [
    (((1.0, Q, T),), 1.0),
    (((0.7, MNIST_Q, 250),), 1.0),
    (((1.3, Q, 1),), 1.0),
    (((2.0, 0.2, 3000),), 1.0),
    (((1.0, 1.0, 10),), 1.0),
    (((4.0, 1e-4, 100_000),), 1.0),
    (((1.0, Q, T),), 10.0),
    (((1.0, Q, 60), (2.0, Q, 140)), 1.0),
    (((1.0, Q, 60), (1.5, 2 * Q, 40), (1.0, Q, 7)), 1.0),
    (((20.0, 1e-3, 3),), 10.0),
]


@pytest.mark.parametrize(
    ("history", "coarsening"), FAST_PATH_CASES, ids=[str(i) for i in range(len(FAST_PATH_CASES))]
)
def test_fast_pld_equals_dp_accounting(history, coarsening):
    """The cached, vectorised composition gives PLDAccountant's epsilon (to the real-input FFT's rounding)."""
    grid = coarsening * accounting.pld.pld_grid(history)
    reference = accounting.pld.reference_pld_epsilon(history, DELTA, grid)
    assert accounting.pld.pld_epsilon(history, DELTA, grid) == pytest.approx(reference, rel=PLD_RTOL)
    assert accounting.epsilon.epsilon_of_history("pld", history, DELTA, coarsening) == pytest.approx(
        reference, rel=PLD_RTOL
    )


@pytest.mark.parametrize(
    ("sigma", "q", "grid"), [(1.0, Q, 1e-4), (0.6, MNIST_Q, 3e-4), (1.0, 1.0, 1e-3), (3.0, 1e-3, 1e-3)]
)
def test_one_step_pld_equals_dp_accounting(sigma, q, grid):
    from dp_accounting.pld import privacy_loss_distribution

    reference = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=sigma, value_discretization_interval=grid, sampling_prob=q
    )
    remove, add = accounting.pld.one_step_pld(sigma, q, grid)
    for mine, theirs in [(remove, reference._pmf_remove), (add or remove, reference._pmf_add)]:
        theirs = theirs.to_dense_pmf()
        assert mine.lower == theirs._lower_loss
        assert mine.infinity_mass == pytest.approx(theirs._infinity_mass, rel=1e-12, abs=1e-300)
        assert mine.probs == pytest.approx(theirs._probs, rel=1e-12, abs=1e-18)


@pytest.mark.parametrize(
    ("sigma", "q"),
    [(1.0, Q), (0.5, MNIST_Q), (30.0, 0.2), (0.3, 0.5), (2.0, 1.0), (1e4, 1e-3), (1e-3, 1e-3), (0.2, 0.999)]
    + [(0.05, 1e-6), (8.0, 0.9)],
)
def test_one_step_rdp_equals_dp_accounting(sigma, q):
    """All orders at once (tables of terms, accumulated log-sums) against dp_accounting's loop per order,
    including orders whose series does not converge (tiny sigma: inf, the order is excluded)."""
    orders = accounting.constants.RDP_ORDERS
    reference = dp_accounting.rdp.rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(
        q, sigma, orders
    )
    assert accounting.rdp.one_step_rdp(sigma, q) == pytest.approx(reference, rel=1e-12)


def test_epsilon_every_step_uses_the_cached_step_and_matches_the_reference():
    accountant = PrivacyAccountant()
    accounting.pld.one_step_pld.cache_clear()
    for step, record in [(1, 1), (98, 97), (99, 1), (100, 1), (101, 1)]:
        accountant.step(1.0, Q, num_steps=record)
        epsilon = accountant.get_epsilon(DELTA)
        history = ((1.0, Q, step),)  # the power switches from repeated squaring to exp(T log z) at 100
        reference = accounting.pld.reference_pld_epsilon(history, DELTA, accounting.pld.pld_grid(history))
        assert epsilon == pytest.approx(reference, rel=PLD_RTOL)
    assert accounting.pld.one_step_pld.cache_info().misses == 1  # one PLD build for all the queries


def test_cache_follows_sigma_and_q_changes_mid_history():
    """A new (sigma, q) gets its own one-step PLD, and a finer grid when its loss spreads less."""
    accountant = PrivacyAccountant()
    phases = [(2.0, Q, 30), (2.0, Q, 20), (6.0, 2e-3, 25), (2.0, Q / 4, 25)]
    history = []
    for sigma, q, steps in phases:
        accountant.step(sigma, q, num_steps=steps)
        if history and history[-1][:2] == (sigma, q):
            history[-1] = (sigma, q, history[-1][2] + steps)
        else:
            history.append((sigma, q, steps))
        grid = accounting.pld.pld_grid(tuple(history))
        reference = accounting.pld.reference_pld_epsilon(tuple(history), DELTA, grid)
        assert accountant.get_epsilon(DELTA) == pytest.approx(reference, rel=PLD_RTOL)
    assert accounting.pld.pld_grid(tuple(history)) < accounting.pld.pld_grid(
        tuple(history[:1])
    )  # sigma = 6 refines it


def test_state_dict_round_trip_keeps_the_pld_epsilon():
    accountant = PrivacyAccountant()
    accountant.step(1.0, Q, num_steps=70)
    accountant.step(1.4, Q / 2, num_steps=30)
    restored = PrivacyAccountant("rdp")
    restored.load_state_dict(json.loads(json.dumps(accountant.state_dict())))
    accounting.epsilon.epsilon_of_history.cache_clear()
    assert restored.get_epsilon(DELTA) == accountant.get_epsilon(DELTA)
    restored.step(1.4, Q / 2)
    accountant.step(1.4, Q / 2)
    assert (
        restored.get_epsilon(DELTA)
        == accountant.get_epsilon(DELTA)
        == accountant.epsilon_after(0, 1.0, Q, DELTA)
    )


def _bisection_calibration(target, delta, q, steps, accountant="pld", tolerance=1e-3):
    """The calibration as it was: the same stages, plain bisection (every question evaluated)."""
    guess, first_step, best = 1.0, 0.5, math.inf
    for name, coarsening, next_relative_step in accounting.search.search_stages(accountant):

        def meets_budget(sigma, name=name, coarsening=coarsening):
            if sigma > accounting.constants.MAX_NOISE_MULTIPLIER:
                return True
            return (
                accounting.epsilon.epsilon_of_history(name, ((sigma, q, steps),), delta, coarsening) <= target
            )

        sigma = accounting.search.smallest_passing(meets_budget, guess, first_step, tolerance)
        best = min(best, sigma)
        guess, first_step = best, max(tolerance, next_relative_step * best)
    return sigma


@pytest.mark.parametrize(
    ("target", "delta", "q", "steps", "accountant"),
    [
        (1.0, DELTA, MNIST_Q, MNIST_T, "pld"),
        (8.0, DELTA, Q, 1000, "pld"),
        (3.0, 1e-4, 0.2, 50, "pld"),
        (1.0, 1e-3, 1e-3, 100_000, "pld"),
        (2.0, DELTA, 0.05, 300, "rdp"),
        (1.0, DELTA, Q, T, "prv"),
    ],
)
def test_calibration_gives_the_same_sigma_as_plain_bisection(target, delta, q, steps, accountant):
    expected = _bisection_calibration(target, delta, q, steps, accountant)
    assert calibrate_noise_multiplier(target, delta, q, steps, accountant=accountant) == expected


def test_threshold_search_answers_like_bisection_with_fewer_evaluations():
    calls = []

    def epsilon_at(sigma):
        calls.append(sigma)
        return 3.0 / sigma**1.5 + 0.01 * math.sin(40 * sigma) / sigma**2  # monotone, not a power law

    for target in (0.2, 1.0, 7.5):
        expected = accounting.search.smallest_passing(lambda s, t=target: epsilon_at(s) <= t, 1.0, 0.5, 1e-3)
        plain_calls, calls[:] = len(calls), []
        for sharpen in (True, False):  # the cheap stages sharpen first; the last one only aims
            search = accounting.search.ThresholdSearch(epsilon_at, target, True, 1e6, integral=False)
            if sharpen:
                search.sharpen(1.0, width=1e-3 / 256)
            assert accounting.search.smallest_passing(search.passes, 1.0, 0.5, 1e-3) == expected
            assert len(calls) < plain_calls
            calls.clear()


def test_steps_within_budget_continues_a_history_like_epsilon_after():
    accountant = PrivacyAccountant()
    accountant.step(2.0, Q, num_steps=40)
    accountant.step(1.5, Q, num_steps=25)
    target = 1.0
    total = steps_within_budget(target, DELTA, Q, 1.5, history=accountant.history)
    extra = total - accountant.steps
    assert extra > 0
    assert (
        accountant.epsilon_after(extra, 1.5, Q, DELTA)
        <= target
        < accountant.epsilon_after(extra + 1, 1.5, Q, DELTA)
    )
    assert steps_within_budget(target, DELTA, Q, 1.5, history=accountant.history, guess=total) == total
    assert steps_within_budget(target, DELTA, Q, 1.5, history=accountant.history, guess=3 * total) == total
    # Spent: not one more step fits; the cap counts the total.
    spent = accountant.get_epsilon(DELTA)
    assert steps_within_budget(spent, DELTA, Q, 1.5, history=accountant.history) == accountant.steps
    assert steps_within_budget(target, DELTA, Q, 1.5, history=accountant.history, max_steps=70) == 70
    assert (
        steps_within_budget(target, DELTA, Q, 1.5, history=accountant.history, max_steps=50)
        == accountant.steps
    )


@pytest.mark.parametrize("name", ["rdp", "pld"])
def test_steps_within_budget_matches_a_linear_scan(name):
    target, sigma = 2.0, 1.2
    total = steps_within_budget(target, DELTA, Q, sigma, accountant=name)
    epsilons = [compute_epsilon(Q, sigma, t, DELTA, name) for t in range(total - 3, total + 4)]
    assert [e <= target for e in epsilons] == [True] * 4 + [False] * 3


# --- huge budgets: refused quickly, with the value and the fix ------------------------------------------


@pytest.mark.parametrize("target", [1e6, 1000.0])
def test_huge_target_epsilon_is_refused_with_the_fix(target):
    with pytest.raises(ValueError) as info:
        calibrate_noise_multiplier(target, DELTA, Q, 1000)
    message = str(info.value)
    assert repr(target) in message and "accountant='rdp'" in message and "PLD_MAX_POINTS" in message
    sigma = calibrate_noise_multiplier(target, DELTA, Q, 1000, accountant="rdp")  # the suggested fix works
    assert compute_epsilon(Q, sigma, 1000, DELTA, accountant="rdp") <= target


def test_pld_larger_than_the_limit_is_refused_before_it_is_built(monkeypatch):
    monkeypatch.setattr(accounting.constants, "PLD_MAX_POINTS", 20_000)
    accounting.epsilon.epsilon_of_history.cache_clear()
    accounting.pld.one_step_pld.cache_clear()
    with pytest.raises(accounting.PLDTooLargeError) as info:
        compute_epsilon(Q, 1.0, T, DELTA)  # one step alone needs ~56,000 points at the 1e-4 grid
    assert "PLD_MAX_POINTS" in str(info.value) and "accountant='rdp'" in str(info.value)
    assert info.value.points > 20_000
    assert accounting.pld.one_step_pld.cache_info().misses == 0  # refused before building anything
    assert isinstance(info.value, ValueError)
    assert compute_epsilon(Q, 1.0, T, DELTA, accountant="rdp") > 0  # RDP is unaffected
    with pytest.raises(ValueError, match="PLD_MAX_POINTS"):
        calibrate_noise_multiplier(1.0, DELTA, Q, T)
    accounting.epsilon.epsilon_of_history.cache_clear()


def test_concurrent_sides_give_the_same_bits_as_in_turn(monkeypatch):
    """The remove and add PMFs are built, composed and scanned in two threads: the same arithmetic."""
    history = ((0.9, 1e-3, 300), (1.3, 5e-3, 200))
    grid = accounting.pld.pld_grid(history)
    assert accounting.pld.one_step_points(0.9, 1e-3, grid) >= accounting.pld.CONCURRENT_MIN_POINTS

    def fresh_epsilon() -> float:
        accounting.pld.one_step_pld.cache_clear()
        accounting.pld.composed_pld.cache_clear()
        return accounting.pld.pld_epsilon(history, DELTA, grid)

    concurrent = fresh_epsilon()
    monkeypatch.setattr(accounting.pld, "CONCURRENT_MIN_POINTS", math.inf)
    assert fresh_epsilon() == concurrent
    reference = accounting.pld.reference_pld_epsilon(history, DELTA, grid)
    assert concurrent == pytest.approx(reference, rel=PLD_RTOL)


@pytest.mark.parametrize("failing_side", ["remove", "add"])
def test_a_failing_side_raises_and_leaves_no_work_behind(failing_side):
    finished = []

    def side(name):
        def run():
            if name == failing_side:
                raise SideFailedError(name)
            finished.append(name)
            return name

        return run

    with pytest.raises(SideFailedError, match=failing_side):
        accounting.pld.both_sides(side("remove"), side("add"), points=1 << 30)
    assert finished == ["add" if failing_side == "remove" else "remove"]  # the other side ran to its end
    assert accounting.pld.both_sides(side("x"), side("y"), points=1 << 30) == ("x", "y")  # worker free


class SideFailedError(RuntimeError):
    pass


def test_pld_epsilon_works_in_a_forked_child():
    """A child forked after the side worker started gets its own (the inherited one has no thread)."""
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    history = ((0.9, 1e-3, 300),)
    grid = accounting.pld.pld_grid(history)
    expected = accounting.pld.pld_epsilon(history, DELTA, grid)  # starts the worker in the parent
    accounting.pld.one_step_pld.cache_clear()
    with multiprocessing.get_context("fork").Pool(1) as pool:
        result = pool.apply_async(accounting.pld.pld_epsilon, (history, DELTA, grid))
        assert result.get(timeout=120) == expected


def test_clear_caches_makes_the_next_queries_compute_afresh():
    # What bench/bench_trainer.py calls before each run, so that a run's calibration and log lines' epsilons
    # are computed as a user's single run computes them, not taken from an earlier run's cache.
    accounting.calibrate_noise_multiplier(8.0, 1e-5, 0.01, 50)
    accountant = accounting.PrivacyAccountant()
    accountant.step(1.0, 0.01)
    accountant.get_epsilon(1e-5)
    assert accounting.epsilon.epsilon_of_history.cache_info().currsize > 0
    assert accounting.pld.one_step_pld.cache_info().currsize > 0
    accounting.clear_caches()
    assert accounting.epsilon.epsilon_of_history.cache_info().currsize == 0
    assert accounting.pld.one_step_pld.cache_info().currsize == 0
