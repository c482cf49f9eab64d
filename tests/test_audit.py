"""Privacy auditing (dp_hf.audit): the one-run bound against the paper, the white-box audit of every
optimizer (correct ones pass with power, sabotaged ones fail), the input-space audit of a DPTrainer run,
the report, and the command line."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import datasets
import numpy as np
import pytest
import torch
from dp_training import SEQ, VOCAB, bert_classifier, classification_data, dp_args
from scipy import stats

from dp_hf import DPTrainer
from dp_hf.accounting import compute_epsilon
from dp_hf.audit import (
    AuditReport,
    PrivacyAuditError,
    PrivacyAuditWarning,
    audit_card_lines,
    audit_optimizer,
    audit_trainer,
    epsilon_lower_bound,
    label_flip_canaries,
    main,
    max_epsilon_lower_bound,
    p_value,
    score_guesses,
)
from dp_hf.audit import checks as audit_checks
from dp_hf.optim import OPTIMIZERS, create_dp_optimizer, get_optimizer_class
from dp_hf.privatizer import Privatizer, clip_and_sum

DELTA = 1e-5
NAMES = sorted(OPTIMIZERS)


# ----------------------------------------------------------------------------------------------- bound


def _reference_p_value(m, r, v, eps, delta):
    # The paper's Appendix D computation, written independently with scipy.stats (loop, no vectorization).
    q = 1 / (1 + math.exp(-eps))
    beta = stats.binom.sf(v - 1, r, q)
    alpha, total = 0.0, 0.0
    for i in range(1, v + 1):
        total += stats.binom.pmf(v - i, r, q)
        alpha = max(alpha, total / i)
    return min(1.0, beta + alpha * delta * 2 * m)


def test_bound_reproduces_the_papers_printed_values():
    # Appendix D: m = 1000 canaries, r = 100 guesses, v = 75 correct, delta = 1e-4, 95% -> 0.673.
    assert epsilon_lower_bound(1000, 100, 75, 1e-4, 0.95) == pytest.approx(0.673, abs=5e-4)
    # Section 7 (white-box, m = 10^5): r = 1510, v = 1439, delta = 1e-5 -> 2.675 (printed truncated).
    assert 2.675 <= epsilon_lower_bound(100_000, 1510, 1439, 1e-5, 0.95) < 2.677


@pytest.mark.parametrize(
    "m,r,v,eps,delta",
    [
        (1000, 100, 75, 0.6, 1e-4),
        (50, 40, 33, 1.3, 1e-3),
        (10_000, 500, 480, 3.0, 1e-5),
        (20, 20, 0, 0.5, 1e-5),
    ],
)
def test_p_value_matches_the_papers_algorithm(m, r, v, eps, delta):
    assert p_value(m, r, v, eps, delta) == pytest.approx(_reference_p_value(m, r, v, eps, delta), rel=1e-9)


def test_bound_closed_form_without_delta_and_monotonicity():
    # delta = 0, all r guesses correct: P[W >= r] = p^r, so the bound is logit(0.05^(1/r)).
    for r in (10, 100, 1000):
        a = 0.05 ** (1 / r)
        assert epsilon_lower_bound(r, r, r, 0.0) == pytest.approx(math.log(a / (1 - a)), rel=1e-9)
    assert epsilon_lower_bound(100, 100, 50, 1e-5) == 0.0  # chance accuracy proves nothing
    assert epsilon_lower_bound(1000, 200, 180, 1e-5) > epsilon_lower_bound(1000, 200, 160, 1e-5)
    assert epsilon_lower_bound(1000, 200, 180, 1e-5, 0.99) < epsilon_lower_bound(1000, 200, 180, 1e-5, 0.9)
    # delta caps the bound: more canaries at the same guesses cost 2 m delta.
    assert epsilon_lower_bound(10**5, 200, 200, 1e-5) < epsilon_lower_bound(1000, 200, 200, 1e-5)
    assert max_epsilon_lower_bound(10_000, DELTA) > max_epsilon_lower_bound(1000, DELTA) > 5.0
    with pytest.raises(ValueError, match="num_correct"):
        epsilon_lower_bound(10, 5, 6, 1e-5)
    with pytest.raises(ValueError, match="confidence"):
        epsilon_lower_bound(10, 5, 5, 1e-5, confidence=1.0)


def test_bound_is_valid_and_has_power_on_randomized_response():
    # An exactly eps0-DP mechanism per canary (randomized response): the 95% bound may exceed eps0 in at
    # most ~5% of runs (the theorem), and with 2000 canaries it should get a good part of the way to eps0.
    eps0, m, trials = 1.0, 2000, 100
    rng = np.random.default_rng(0)
    keep = 1 / (1 + math.exp(-eps0))
    bounds = []
    for _ in range(trials):
        included = rng.random(m) < 0.5
        guess = np.where(rng.random(m) < keep, included, ~included)
        bounds.append(epsilon_lower_bound(m, m, int((guess == included).sum()), DELTA))
    bounds = np.array(bounds)
    assert (bounds > eps0).mean() <= 0.05
    assert np.median(bounds) > 0.6 * eps0


def test_score_guesses_is_bonferroni_corrected_and_finds_separation():
    rng = np.random.default_rng(1)
    included = rng.random(1000) < 0.5
    perfect = score_guesses(included.astype(float), included, DELTA)
    assert perfect.num_correct == perfect.num_guesses and perfect.epsilon == pytest.approx(perfect.ceiling)
    fixed = score_guesses(included.astype(float), included, DELTA, guesses=(100, 100))
    assert fixed.num_guesses == 200 and fixed.epsilon == epsilon_lower_bound(1000, 200, 200, DELTA)
    # "auto" pays for choosing among its candidates after the fact: at the same counts it is lower.
    auto_at_200 = [c for c in perfect.candidates if c[0] == c[1] == 100][0]
    assert auto_at_200[3] < fixed.epsilon
    noise = score_guesses(rng.normal(size=1000), included, DELTA)
    assert noise.epsilon == 0.0


# --------------------------------------------------------------------------------- white-box audits

# Regime A: sample rate 1/2, 100 steps, sigma = 10: claimed epsilon ~2.0. A correct optimizer gives a
# positive bound (the audit has power) below the claim; sigma/10 or no clipping push it far above.
Q_A, T_A, SIGMA_A = 0.5, 100, 10.0
# Regime B: tiny expected batch (B = q * m / 2 = 0.6, claimed epsilon ~0.5): where dividing the noise
# by the realized batch (>= 1 whenever anything was sampled) instead of the expected one matters.
M_B, Q_B, T_B, SIGMA_B = 300, 4e-3, 500, 1.0


@pytest.fixture(scope="module")
def claims():
    return {
        "A": compute_epsilon(Q_A, SIGMA_A, T_A, DELTA),
        "B": compute_epsilon(Q_B, SIGMA_B, T_B, DELTA),
    }


class _ScaledNoisePrivatizer(Privatizer):
    """Releases with ``noise_multiplier * noise_factor()`` while the optimizer (and its accounting) says sigma."""

    def noise_factor(self) -> float:
        raise NotImplementedError

    def release(self, params, geometry, **kwargs):
        saved = self.noise_multiplier
        self.noise_multiplier = saved * self.noise_factor()
        try:
            return super().release(params, geometry, **kwargs)
        finally:
            self.noise_multiplier = saved


class _LowNoisePrivatizer(_ScaledNoisePrivatizer):
    """Adds sigma/10."""

    def noise_factor(self) -> float:
        return 0.1


class _NoClipPrivatizer(Privatizer):
    """Clipping disabled (C = inf) while the noise is still sigma * C of the claimed C."""

    def accumulate(self, grad_samples, geometry, shapes=None):
        return super().accumulate(grad_samples, dataclasses.replace(geometry, max_grad_norm=math.inf), shapes)


class _RealizedBatchPrivatizer(_ScaledNoisePrivatizer):
    """Divides the noise by the realized batch size (at least 1) instead of the expected one."""

    def noise_factor(self) -> float:
        return self.expected_batch_size / max(self.num_examples, 1)


class _NoiseSkippedPrivatizer(_ScaledNoisePrivatizer):
    """No noise on every third release (the median step's noise is still the claimed one)."""

    def noise_factor(self) -> float:
        self.releases = getattr(self, "releases", 0) + 1
        return 0.0 if self.releases % 3 == 0 else 1.0


class _NoiseReusedPrivatizer(Privatizer):
    """The noise generator reseeded before every release: every step adds the same noise."""

    def release(self, params, geometry, **kwargs):
        self.noise_source.generator.manual_seed(7)
        return super().release(params, geometry, **kwargs)


class _SlightlyLowNoisePrivatizer(_ScaledNoisePrivatizer):
    """Adds 0.8 sigma."""

    def noise_factor(self) -> float:
        return 0.8


class _PerTensorClipPrivatizer(Privatizer):
    """Clips each parameter tensor separately to C instead of the flat norm over all of them: an example
    then moves the sum by up to sqrt(#tensors) C."""

    def accumulate(self, grad_samples, geometry, shapes=None):
        sums = []
        for k, g in enumerate(grad_samples):
            scale = None if geometry.scale is None else [geometry.scale[k]]
            shift = None if geometry.shift is None else [geometry.shift[k]]
            part, norms = clip_and_sum([g], dataclasses.replace(geometry, shift=shift, scale=scale))
            sums += part
        self.accumulate_clipped_sum(sums, int(norms.shape[0]))
        return norms


class _DoubleClipPrivatizer(Privatizer):
    """Clips to 2 C while the noise is sigma * C."""

    def accumulate(self, grad_samples, geometry, shapes=None):
        doubled = dataclasses.replace(geometry, max_grad_norm=2 * geometry.max_grad_norm)
        return super().accumulate(grad_samples, doubled, shapes)


SABOTAGE = {
    "low-noise": _LowNoisePrivatizer,
    "no-clip": _NoClipPrivatizer,
    "realized-batch": _RealizedBatchPrivatizer,
    "noise-skipped": _NoiseSkippedPrivatizer,
    "noise-reused": _NoiseReusedPrivatizer,
    "noise-0.8": _SlightlyLowNoisePrivatizer,
    "per-tensor-clip": _PerTensorClipPrivatizer,
    "clip-2C": _DoubleClipPrivatizer,
}


def _factory(name, sigma, expected_batch, sabotage=None, noise_seed=1):
    def make(params):
        kwargs = dict(
            noise_multiplier=sigma, expected_batch_size=expected_batch, noise_seed=noise_seed, lr=1e-2
        )
        if not getattr(get_optimizer_class(name), "adaptive_clipping", False):  # MacAdam fixes C = 1
            kwargs["max_grad_norm"] = 1.0
        optimizer = create_dp_optimizer(name, params, **kwargs)
        if sabotage is not None:
            optimizer.privatizer.__class__ = SABOTAGE[sabotage]  # same state, sabotaged behaviour
        return optimizer

    return make


def _audit_a(name, claim, sabotage=None, noise_seed=1, make=None, **kwargs):
    return audit_optimizer(
        make or _factory(name, SIGMA_A, Q_A * (1000 / 2 + 64), sabotage, noise_seed),
        claimed_epsilon=claim,
        delta=DELTA,
        sample_rate=Q_A,
        steps=T_A,
        num_canaries=1000,
        **kwargs,
    )


def _audit_b(name, claim, sabotage=None, noise_seed=1, **kwargs):
    return audit_optimizer(
        _factory(name, SIGMA_B, Q_B * M_B / 2, sabotage, noise_seed),
        claimed_epsilon=claim,
        delta=DELTA,
        sample_rate=Q_B,
        steps=T_B,
        num_canaries=M_B,
        num_ordinary=0,
        **kwargs,
    )


@pytest.fixture(scope="module")
def sgd_reference(claims):
    return _audit_a("dp-sgd", claims["A"])


@pytest.mark.parametrize("name", NAMES)
def test_correct_optimizer_passes_and_the_audit_has_power(name, claims, sgd_reference):
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyAuditWarning)
        report = _audit_a(name, claims["A"])
    assert report.passed
    _assert_no_false_alarm(report)
    assert 0.3 < report.epsilon_lower_bound <= report.claimed_epsilon == claims["A"]
    # 68-100% of the guesses are right for noise seeds 1-8 (with the guess count chosen from the scores)
    assert report.num_correct > 0.65 * report.num_guesses
    # The noise level measured on the release is the claimed one...
    assert report.details["measured_noise_multiplier"] == pytest.approx(SIGMA_A, rel=0.05)
    # ...and in its own clipping geometry every optimizer releases what DP-SGD releases (same noise seed):
    # the Dirac canaries and the scores live in the clipping coordinates, where the geometry is isometric.
    assert report.num_correct == pytest.approx(sgd_reference.num_correct, abs=2)


@pytest.mark.parametrize("sabotage", ["low-noise", "no-clip"])
@pytest.mark.parametrize("name", NAMES)
def test_sabotaged_optimizer_fails(name, sabotage, claims):
    with pytest.warns(PrivacyAuditWarning, match="FAILED"):
        report = _audit_a(name, claims["A"], sabotage)
    assert not report.passed
    assert report.epsilon_lower_bound > 1.5 * claims["A"]


@pytest.mark.parametrize("name", NAMES)
def test_noise_divided_by_the_realized_batch_fails(name, claims):
    correct = _audit_b(name, claims["B"])
    assert correct.passed
    _assert_no_false_alarm(correct)
    with pytest.warns(PrivacyAuditWarning):
        report = _audit_b(name, claims["B"], "realized-batch")
    assert not report.passed
    assert report.epsilon_lower_bound > 3 * claims["B"]
    # The release is less noisy than claimed in every step (B = 0.6 < realized batch, clamped to >= 1).
    assert report.details["measured_noise_multiplier"] < 0.7 * SIGMA_B


@pytest.mark.parametrize("sabotage", ["noise-skipped", "noise-reused"])
def test_noise_missing_in_some_steps_or_repeated_fails_also_above_what_canaries_show(sabotage, claims):
    """The noise check took the median step: noise skipped on a third of the steps read 0.98 of the claim,
    and a generator reseeded before every release (a difference of two releases has no noise) read 1.00
    with a lower bound of 0 (an audit). With a claim above what the canaries can show that was INCONCLUSIVE
    or PASSED; each step, and each difference of two steps, is now checked against its chi-square floor."""
    with pytest.warns(PrivacyAuditWarning, match="FAILED: the noise measured"):
        report = _audit_a("dp-sgd", 8.0, sabotage)
    assert not report.passed and report.conclusive
    assert report.measured_noise_ratio < 0.1


# Sabotages the audit missed before its canaries were spread over the tensors and its noise and clip
# checks were derived from their statistics. Measured on the old code (regime A, claim 2.02, the same for
# dp-sgd, dp-adamw, dp-macadam and dp-microadam): per-tensor clipping PASSED (bound 0.86: every canary lived
# in one tensor), noise 0.8 sigma PASSED (bound 0.98, measured ratio 0.80 against a fixed tolerance of
# 0.75), clipping at 2 C PASSED (bound 1.52: one-run looseness).
CHECKED = ["dp-sgd", "dp-adamw", "dp-macadam", "dp-microadam"]
NEW_SABOTAGE_ROWS = [
    # sabotage, message, (expected canary signal or None, expected noise ratio or None)
    ("per-tensor-clip", "the clip bound is exceeded", (2.0, None)),  # sqrt(4 tensors) C per canary
    ("clip-2C", "the clip bound is exceeded", (2.0, None)),
    ("noise-0.8", "the noise measured on the released gradients is 0.8", (None, 0.8)),
]


@pytest.mark.parametrize("sabotage,message,expected", NEW_SABOTAGE_ROWS)
@pytest.mark.parametrize("name", CHECKED)
def test_sabotage_below_the_bound_fails_the_direct_checks(name, sabotage, message, expected, claims):
    with pytest.warns(PrivacyAuditWarning, match=message):
        report = _audit_a(name, claims["A"], sabotage)
    assert not report.passed and report.conclusive
    signal, noise = expected
    if signal is not None:
        assert (
            report.canary_signal == pytest.approx(signal, abs=0.15)
            and report.canary_signal > report.canary_signal_limit
        )
        assert report.noise_ok and report.canary_signal_limit < 1.4
    else:
        assert report.measured_noise_ratio == pytest.approx(noise, abs=0.02)
        assert report.measured_noise_ratio < report.noise_tolerance
        assert report.signal_ok and report.noise_tolerance > 0.98


@pytest.mark.parametrize("sabotage", ["per-tensor-clip", "clip-2C"])
def test_clip_check_catches_loose_clipping_with_few_canaries(sabotage, claims):
    """300 canaries sampled ~300 times in all: a one-run bound is far from catching a doubled sensitivity,
    the mean signal along the canaries (2 against a limit of ~1.3) is not."""
    assert _audit_b("dp-sgd", claims["B"]).passed
    with pytest.warns(PrivacyAuditWarning, match="the clip bound is exceeded"):
        report = _audit_b("dp-sgd", claims["B"], sabotage)
    assert report.canary_signal > report.canary_signal_limit and report.details["canary_signal_count"] < 500


def _honest_audits(names, seeds):
    for name in names:
        for seed in seeds:
            for regime in ("A", "B"):
                audit = _audit_a if regime == "A" else _audit_b
                with warnings.catch_warnings():
                    warnings.simplefilter("error", PrivacyAuditWarning)
                    yield name, seed, regime, audit(name, 100.0, noise_seed=100 + seed, seed=seed)


def _assert_no_false_alarm(report):
    assert report.passed and report.noise_ok and report.signal_ok and not report.unchecked
    # Not at the edge: the statistics sit well inside their 1e-6 limits.
    assert report.measured_noise_ratio > report.noise_tolerance + 0.3 * (1 - report.noise_tolerance)
    signal_sd = report.details["measured_noise_multiplier"] / math.sqrt(report.details["canary_signal_count"])
    assert abs(report.canary_signal - 1) < 4 * signal_sd


@pytest.mark.slow
def test_correct_optimizers_raise_no_false_alarm_over_many_seeds():
    """Every correct optimizer, in both regimes, for 10 seeds (canaries, sampling and noise); the fast tests
    check the same for all optimizers at one seed per regime (test_correct_optimizer_passes_and_the_audit_has_power
    and test_noise_divided_by_the_realized_batch_fails)."""
    for *_, report in _honest_audits(CHECKED, range(10)):
        _assert_no_false_alarm(report)


def test_noise_and_signal_checks_respect_their_false_alarm_rate():
    """The checks' false-alarm rates, run at alpha = 0.1 (instead of 1e-6) to be measurable: correct noise
    (and more noise than claimed) fails at most alpha of the time, and close to it, not vacuously less."""
    alpha, trials, n, steps, sigma, count = 0.1, 3000, 64, 5, 2.0, 40
    rng = np.random.default_rng(0)
    noise_fails = over_fails = signal_fails = 0
    for _ in range(trials):
        probes = rng.normal(0.0, sigma, (steps, n))
        check = audit_checks.noise_check(probes, sigma, alpha)
        noise_fails += not check.passed
        over_fails += not audit_checks.noise_check(1.1 * probes, sigma, alpha).passed
        signal = 1 + rng.normal(0.0, sigma, count).mean()
        signal_fails += signal > audit_checks.signal_limit(count, check.pooled, probes.size, alpha)
    margin = 3 * math.sqrt(alpha / trials)
    assert (
        alpha / 4 < noise_fails / trials < alpha + margin
    )  # pooled alpha/2, steps and differences <= alpha/2
    assert over_fails / trials < alpha / 10
    assert alpha / 10 < signal_fails / trials < alpha + margin
    # At the audit's defaults (1024 probes) 0.8 sigma fails from a single step on; 0.95 sigma by 100 steps.
    assert audit_checks.noise_tolerance(1024, 1) > 0.85 and audit_checks.noise_tolerance(1024, 100) > 0.98
    assert audit_checks.signal_limit(0, 1.0, 100) is None


class _SigmaHidingPrivatizer:
    """Forwards to a dp_hf privatizer but hides its noise multiplier: an optimizer that reports none."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        if name == "noise_multiplier":
            raise AttributeError(name)
        return getattr(self.inner, name)


def test_noise_check_without_a_claimed_noise_multiplier(claims):
    """The noise check compared with ``optimizer.noise_multiplier`` or skipped it silently: an optimizer
    reporting none PASSED with 0.8 sigma (measured before the change). It now falls back to the privatizer's,
    takes ``noise_multiplier=``, and with neither says INCONCLUSIVE, naming the check that did not run."""

    def make(sabotage, hide_optimizer=False, hide_privatizer=False):
        def build(params):
            optimizer = _factory("dp-sgd", SIGMA_A, Q_A * (1000 / 2 + 64), sabotage)(params)
            if hide_optimizer:
                optimizer.__class__ = type("NoSigmaDPSGD", (type(optimizer),), {"noise_multiplier": None})
            if hide_privatizer:
                optimizer.privatizer = _SigmaHidingPrivatizer(optimizer.privatizer)
            return optimizer

        return build

    with pytest.warns(PrivacyAuditWarning, match="noise measured on the released gradients is 0.8"):
        fallback = _audit_a("dp-sgd", claims["A"], make=make("noise-0.8", hide_optimizer=True))
    assert fallback.details["noise_multiplier_source"] == "privatizer" and not fallback.passed

    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyAuditWarning)
        blind = _audit_a("dp-sgd", claims["A"], make=make("noise-0.8", hide_privatizer=True))
    assert blind.passed and not blind.conclusive and blind.measured_noise_ratio is None
    assert blind.summary.splitlines()[1].startswith("INCONCLUSIVE: the noise check did not run")
    assert "PASSED" not in blind.summary and blind.details["noise_multiplier_source"] == "none"
    assert json.loads(json.dumps(blind.to_dict()))["details"]["noise_multiplier"] is None
    assert any("noise check did not run" in line for line in audit_card_lines(blind.to_dict()))

    with pytest.warns(PrivacyAuditWarning, match="noise measured on the released gradients is 0.8"):
        given = _audit_a(
            "dp-sgd", claims["A"], make=make("noise-0.8", hide_privatizer=True), noise_multiplier=SIGMA_A
        )
    assert given.details["noise_multiplier_source"] == "argument"
    honest = _audit_a("dp-sgd", claims["A"], make=make(None, hide_privatizer=True), noise_multiplier=SIGMA_A)
    assert honest.passed and honest.conclusive


def test_sum_score_passes_correct_and_fails_sabotage(claims):
    report = _audit_a("dp-sgd", claims["A"], score="sum")
    assert report.passed and report.epsilon_lower_bound > 0.3
    # At sample rate 1/2 the paper's sum and the likelihood ratio rank canaries almost the same way: as
    # many right guesses among the same 100 + 100 (within 4 for noise seeds 1-8). The automatic guess
    # counts may differ between the two scores, so the reports' own counts are not compared.
    fixed = {"guesses": (100, 100)}
    by_sum = _audit_a("dp-sgd", claims["A"], score="sum", **fixed).num_correct
    assert by_sum == pytest.approx(_audit_a("dp-sgd", claims["A"], **fixed).num_correct, abs=6)
    with pytest.warns(PrivacyAuditWarning):
        assert not _audit_a("dp-sgd", claims["A"], "low-noise", score="sum").passed


def test_the_card_rounds_the_claim_up_and_the_bound_down_and_says_when_training_went_on(sgd_reference):
    """The claim 1.2435 was shown as 1.24 (.3g, to nearest: below what was spent); the lower bound is shown
    rounded down; a model trained on after its audit says that the audit does not cover the later steps."""
    report = dataclasses.replace(sgd_reference, claimed_epsilon=1.2435, epsilon_lower_bound=0.77771)
    text = "\n".join(audit_card_lines(report.to_dict()))
    assert "the claimed epsilon 1.25 " in text and "epsilon >= 0.777**" in text
    assert "the claimed epsilon 1.25 " in report.summary and "epsilon >= 0.777 " in report.summary
    assert "trained further" not in text
    assert "trained further" not in "\n".join(audit_card_lines(report.to_dict(), epsilon=1.2435))
    later = "\n".join(audit_card_lines(report.to_dict(), epsilon=2.5))
    assert "The audit ran when epsilon was 1.25; this model was trained further (epsilon 2.5 now)" in later


def test_report_summary_dict_card_and_raising(claims, sgd_reference):
    report = sgd_reference
    assert isinstance(report, AuditReport)
    assert "PASSED" in report.summary and "not a proof" in report.summary
    assert report.num_guesses == report.num_positive_guesses + report.num_negative_guesses
    assert report.num_correct == report.correct_positive + report.correct_negative
    assert 0 < report.num_included < report.num_canaries == 1000
    assert report.epsilon_lower_bound < report.max_epsilon_lower_bound < 6
    data = json.loads(json.dumps(report.to_dict()))
    assert data["passed"] is True and data["epsilon_lower_bound"] == report.epsilon_lower_bound
    assert data["details"]["optimizer"] == "DPSGD" and data["summary"] == report.summary
    assert any("epsilon >=" in line for line in audit_card_lines(data))
    assert report.raise_if_failed() is report

    failed = dataclasses.replace(report, epsilon_lower_bound=report.claimed_epsilon + 1)
    assert not failed.passed and "FAILED" in failed.summary
    assert any("Warning" in line for line in audit_card_lines(failed.to_dict()))
    with pytest.raises(PrivacyAuditError, match="EXCEEDS"):
        failed.raise_if_failed()
    with pytest.raises(PrivacyAuditError):
        audit_optimizer(
            _factory("dp-sgd", 1.0, 1.0),
            claimed_epsilon=0.01,
            delta=DELTA,
            sample_rate=0.5,
            steps=10,
            num_canaries=200,
            raise_on_failure=True,
        )


def test_audit_optimizer_rejects_bad_input():
    def plain_sgd(params):
        return torch.optim.SGD(params, lr=0.1)

    common = dict(claimed_epsilon=1.0, delta=DELTA, sample_rate=0.5, steps=2, num_canaries=10)
    with pytest.raises(TypeError, match="privatizer"):
        audit_optimizer(plain_sgd, **common)
    with pytest.raises(ValueError, match="exactly the parameters"):
        audit_optimizer(
            lambda p: _factory("dp-sgd", 1.0, 1.0)([torch.nn.Parameter(torch.zeros(3))]), **common
        )
    with pytest.raises(ValueError, match="canary_norm"):
        audit_optimizer(_factory("dp-sgd", 1.0, 1.0), canary_norm=0.5, **common)
    with pytest.raises(ValueError, match="sample_rate"):
        audit_optimizer(_factory("dp-sgd", 1.0, 1.0), **{**common, "sample_rate": 0.0})
    with pytest.raises(ValueError, match="dimension"):
        audit_optimizer(_factory("dp-sgd", 1.0, 1.0), dimension=5, **common)


def test_a_claim_above_what_the_canaries_can_show_is_inconclusive_not_passed(capsys):
    """1,000 canaries cannot show more than ~4.5: a claim of 8 "PASSED", also with clipping removed. It
    is INCONCLUSIVE now, and clipping removed fails the canary-signal check whatever the claim."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inconclusive is not a failure: no PrivacyAuditWarning
        report = _audit_a("dp-sgd", 8.0)
    assert report.passed and not report.conclusive
    assert report.summary.splitlines()[1].startswith("INCONCLUSIVE") and "PASSED" not in report.summary
    assert "was inconclusive" in "\n".join(audit_card_lines(report.to_dict()))
    with pytest.warns(PrivacyAuditWarning, match="FAILED: the clip bound is exceeded"):
        unclipped = _audit_a("dp-sgd", 8.0, "no-clip")
    assert (
        not unclipped.passed
        and unclipped.conclusive
        and unclipped.canary_signal == pytest.approx(10, rel=0.05)
    )
    # The white-box audit also measures the noise: a tenth of the claimed sigma fails whatever the claim.
    with pytest.warns(PrivacyAuditWarning, match="noise measured on the released gradients is 0.1"):
        low = _audit_a("dp-sgd", 8.0, "low-noise")
    assert not low.passed and low.conclusive and low.epsilon_lower_bound <= 8.0
    argv = ["--optimizer", "dp-sgd", "--noise-multiplier", "10", "--sample-rate", "0.5", "--steps", "20"]
    assert main([*argv, "--canaries", "300", "--claimed-epsilon", "8"]) == 3  # not argparse's 2
    assert "INCONCLUSIVE" in capsys.readouterr().out


def test_cli_exit_status(capsys):
    argv = [
        "--optimizer",
        "dp-adamw",
        "--noise-multiplier",
        "10",
        "--sample-rate",
        "0.5",
        "--steps",
        "20",
        "--canaries",
        "300",
        "--noise-seed",
        "1",
    ]
    assert main(argv) == 0
    assert "PASSED" in capsys.readouterr().out
    argv[argv.index("10")] = "2"  # weakly private: epsilon >= 0.5 or so, far above a claim of 0.01
    assert main([*argv, "--claimed-epsilon", "0.01", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] is False and data["details"]["optimizer"] == "DPAdamW"


# ------------------------------------------------------------------------------ input-space audit

NUM_LABELS = 10


def _bert(vocab_size):
    return bert_classifier(vocab_size=vocab_size, num_hidden_layers=1, num_labels=NUM_LABELS)


def _token_canaries(m, seed=5):
    """Canary j: a token no other example has (id VOCAB + j) on a neutral template, and a label (2..9)
    that the ordinary data (labels 0/1) never uses: fitted only if trained on.

    The token also takes the first position, whose hidden state the classifier pools: behind a [CLS]
    token, whether a one-layer model learned to route the canary's token to it depended on the batches
    drawn (an unnoised run was caught for 2 of 5 sampling seeds; with the token first, for 5 of 5)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((m, SEQ), 4)
    ids[:, 0:4] = (VOCAB + torch.arange(m)).view(-1, 1)
    labels = torch.randint(2, NUM_LABELS, (m,), generator=g)
    return datasets.Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": [[1] * SEQ] * m, "labels": labels.tolist()}
    )


class _NoNoiseTrainer(DPTrainer):
    """Accounts for its noise multiplier but the privatizer adds none."""

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        optimizer.privatizer.noise_multiplier = 0.0
        return optimizer


def _trainer_audit(tmp_path, sigma, trainer_cls=DPTrainer, m=200):
    def make(dataset):
        args = dp_args(
            tmp_path,
            per_device_train_batch_size=64,
            gradient_accumulation_steps=1,
            num_train_epochs=30,
            noise_multiplier=sigma,
            learning_rate=1e-2,
            dp_optimizer="dp-adamw",
            logging_steps=10_000,
            accountant="rdp",
            target_delta=DELTA,
        )
        return trainer_cls(model=_bert(VOCAB + m), args=args, train_dataset=dataset)

    return audit_trainer(make, classification_data(256), _token_canaries(m))


@pytest.mark.slow
def test_trainer_audit_passes_with_power_and_catches_missing_noise(tmp_path):
    weak = _trainer_audit(tmp_path / "weak", sigma=0.5)  # epsilon ~100: weakly private
    assert weak.passed and weak.epsilon_lower_bound > 0.1
    assert weak.method == "input-space canaries" and weak.details["steps"] > 0
    with pytest.warns(PrivacyAuditWarning):
        broken = _trainer_audit(tmp_path / "broken", sigma=8.0, trainer_cls=_NoNoiseTrainer)  # claims ~1.2
    assert broken.claimed_epsilon < 2
    assert not broken.passed and broken.epsilon_lower_bound > broken.claimed_epsilon


def test_label_flip_canaries_change_every_label():
    data = classification_data(64)
    canaries = label_flip_canaries(data, 20, num_labels=2, seed=3)
    assert len(canaries) == 20 and canaries.features == data.features
    originals = {tuple(x["input_ids"]): x["labels"] for x in data}
    assert all(originals[tuple(c["input_ids"])] != c["labels"] for c in canaries)


def test_privacy_card_carries_an_audit_that_was_run(tmp_path, sgd_reference):
    from dp_hf.card import build_privacy_report, render_card

    trainer = DPTrainer(
        model=bert_classifier(), args=dp_args(tmp_path, max_steps=1), train_dataset=classification_data(64)
    )
    assert build_privacy_report(trainer)["audit"] is None
    trainer.audit_report = sgd_reference
    report = json.loads(json.dumps(build_privacy_report(trainer)))
    assert report["audit"]["epsilon_lower_bound"] == sgd_reference.epsilon_lower_bound
    card = render_card(report)
    assert any(line in card for line in audit_card_lines(report["audit"]) if line)
