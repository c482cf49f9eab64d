"""`AuditReport`: the outcome of a privacy audit, its plain-text summary, and its lines on the privacy card."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "AuditReport",
    "PrivacyAuditError",
    "PrivacyAuditWarning",
    "audit_card_lines",
]

PAPER = "Steinke, Nasr & Jagielski, Privacy Auditing with One (1) Training Run, NeurIPS 2023"


class PrivacyAuditWarning(UserWarning):
    """Issued when an audit's empirical lower bound on epsilon exceeds the claimed epsilon."""


class PrivacyAuditError(RuntimeError):
    """Raised by :meth:`AuditReport.raise_if_failed` (and ``raise_on_failure=True``) on a failed audit."""

    def __init__(self, report: AuditReport) -> None:
        super().__init__(report.summary)
        self.report = report


@dataclass
class AuditReport:
    """The result of :func:`dp_hf.audit.audit_optimizer` or :func:`dp_hf.audit.audit_trainer`.

    Attributes:
        epsilon_lower_bound: the empirical lower bound on epsilon at ``delta``, valid with probability
            ``>= confidence``.
        claimed_epsilon: the epsilon the run claims (from the accountant), at the same ``delta``.
        passed: ``epsilon_lower_bound <= claimed_epsilon`` and, for the white-box audit, the noise
            measured on the release at least ``noise_tolerance`` of the claimed one and the canary signal
            at most ``canary_signal_limit``. A pass is **not** a proof of privacy.
        conclusive: whether this audit could have failed at all: ``claimed_epsilon`` below
            ``max_epsilon_lower_bound`` and every check run (``unchecked`` empty). An inconclusive audit
            reports "INCONCLUSIVE", not "PASSED".
        delta, confidence: the ``delta`` of both epsilons, and the audit's confidence.
        num_canaries, num_included: canaries, and how many were actually included (each w.p. 1/2).
        num_guesses, num_correct: ``r`` and ``v`` of the best guess set (``r = k+ + k-``).
        num_positive_guesses, num_negative_guesses: ``k+`` ("included") and ``k-`` ("excluded") guesses.
        correct_positive, correct_negative: correct guesses among each.
        max_epsilon_lower_bound: the largest bound these canaries could have given (all guesses right):
            claims above it cannot be refuted by this audit at all.
        method: ``"white-box gradient canaries"`` or ``"input-space canaries"``.
        score: how canaries were scored (``"likelihood"``, ``"sum"``, ``"loss"``, ``"gradient"``).
        details: the mechanism audited and the audit's settings (JSON-serialisable).
        measured_noise_ratio: white-box: measured over claimed noise multiplier (or the weakest step's
            level relative to its floor, see :mod:`dp_hf.audit.checks`); None when not checked.
        noise_tolerance: white-box: the ratio a correct implementation stays above except with
            probability 1e-6 (a chi-square quantile for the probe count and steps).
        canary_signal, canary_signal_limit: white-box: the mean release along included, sampled canaries
            in units of ``C`` (1 for a correct clip to ``C``), and the most a correct one gives except with
            probability 1e-6; above it the clip bound is exceeded.
        unchecked: checks that could not run (reasons); a passing audit with any is INCONCLUSIVE.
    """

    epsilon_lower_bound: float
    claimed_epsilon: float
    delta: float
    confidence: float
    num_canaries: int
    num_included: int
    num_guesses: int
    num_correct: int
    num_positive_guesses: int
    num_negative_guesses: int
    correct_positive: int
    correct_negative: int
    max_epsilon_lower_bound: float
    method: str
    score: str
    details: dict[str, Any] = field(default_factory=dict)
    measured_noise_ratio: float | None = None
    noise_tolerance: float | None = None
    canary_signal: float | None = None
    canary_signal_limit: float | None = None
    unchecked: list[str] = field(default_factory=list)
    passed: bool = field(init=False)
    conclusive: bool = field(init=False)

    def __post_init__(self) -> None:
        self.passed = bool(self.bound_ok and self.noise_ok and self.signal_ok)
        self.conclusive = bool(
            not self.passed or (self.claimed_epsilon < self.max_epsilon_lower_bound and not self.unchecked)
        )

    @property
    def bound_ok(self) -> bool:
        return bool(self.epsilon_lower_bound <= self.claimed_epsilon)

    @property
    def noise_ok(self) -> bool:
        if self.measured_noise_ratio is None or self.noise_tolerance is None:
            return True
        return bool(self.measured_noise_ratio >= self.noise_tolerance)

    @property
    def signal_ok(self) -> bool:
        if self.canary_signal is None or self.canary_signal_limit is None:
            return True
        return bool(self.canary_signal <= self.canary_signal_limit)

    # ------------------------------------------------------------------ text
    @property
    def summary(self) -> str:
        """A plain-text account of the audit: verdict, numbers, and what they mean."""
        conf = f"{100 * self.confidence:g}%"
        what = self.details.get("target") or ""
        head = f"Privacy audit ({self.method}, one run; {PAPER})" + (f" of {what}" if what else "")
        bound = _fmt(self.epsilon_lower_bound, up=False)
        claim = _fmt(self.claimed_epsilon)
        if self.passed and not self.conclusive:
            reasons = list(self.unchecked)
            if self.claimed_epsilon >= self.max_epsilon_lower_bound:
                reasons.insert(
                    0,
                    f"the claimed epsilon {claim} is at or above epsilon >= "
                    f"{_fmt(self.max_epsilon_lower_bound)}, the most these {self.num_canaries} canaries can show, "
                    "so this audit could not have failed",
                )
            verdict = (
                f"INCONCLUSIVE: {'; '.join(reasons)} (empirical lower bound {bound} at {conf} confidence, "
                f"delta = {self.delta:g})."
            )
            if self.claimed_epsilon >= self.max_epsilon_lower_bound:
                verdict += " Audit a smaller claim (fewer steps, more noise) or use more canaries."
        elif self.passed:
            verdict = (
                f"PASSED: empirical lower bound epsilon >= {bound} at {conf} confidence does not exceed the "
                f"claimed epsilon {claim} (delta = {self.delta:g})."
            )
        else:
            verdict = "FAILED: " + " Also: ".join(self._failures())
        setup = self.details.get("setup_text")
        lines = [
            head,
            verdict,
            f"{self.num_canaries} canaries ({self.num_included} included, each with probability 1/2)"
            + (f"; {setup}" if setup else "")
            + ".",
            f"Guesses: {self.num_guesses} ({self.num_positive_guesses} 'included' on the highest "
            f"{self.score} scores, {self.num_negative_guesses} 'excluded' on the lowest), "
            f"{self.num_correct} correct ({self.correct_positive} + {self.correct_negative}).",
            f"With {self.num_canaries} canaries no audit can show more than epsilon >= "
            f"{_fmt(self.max_epsilon_lower_bound)} at this confidence and delta.",
        ]
        if self.passed:
            lines.append(
                "A pass is not a proof of privacy: the bound is a lower bound, and one-run audits are "
                "loose (typically well below the claim even for an exact implementation)."
            )
        return "\n".join(lines)

    def _failures(self) -> list[str]:
        from dp_hf.audit.checks import NOISE_FALSE_ALARM, SIGNAL_FALSE_ALARM

        conf = f"{100 * self.confidence:g}%"
        failures = []
        if not self.bound_ok:
            failures.append(
                f"empirical lower bound epsilon >= {_fmt(self.epsilon_lower_bound, up=False)} at {conf} confidence EXCEEDS "
                f"the claimed epsilon {_fmt(self.claimed_epsilon)} (delta = {self.delta:g}). Unless this is the "
                f"1-in-{_one_in(self.confidence)} chance the bound allows, the implementation is less private "
                "than its accounting says."
            )
        if not self.noise_ok:
            failures.append(
                f"the noise measured on the released gradients is {self.measured_noise_ratio:.3g} of the "
                f"claimed noise multiplier (at least {self.noise_tolerance:.3g} expected, which correct noise "
                f"misses with probability {NOISE_FALSE_ALARM:g}): the implementation adds less noise than its "
                "accounting says."
            )
        if not self.signal_ok:
            count = self.details.get("canary_signal_count")
            failures.append(
                f"the clip bound is exceeded: the release along the canaries (norm "
                f"{self.details.get('canary_norm', 'A')} C each, clipped to C by a correct implementation) is "
                f"{self.canary_signal:.3g} C on average over {count} sampled inclusions, above the "
                f"{self.canary_signal_limit:.3g} C that clipping to C gives except with probability "
                f"{SIGNAL_FALSE_ALARM:g}: one example moves the release by more than the clip norm (clipping "
                "per tensor instead of over all tensors together, at a larger norm than claimed, or not at all)"
                + (
                    "; this check assumes correct noise, which the check above refuted."
                    if not self.noise_ok
                    else "."
                )
            )
        return failures

    def __str__(self) -> str:
        return self.summary

    def raise_if_failed(self) -> AuditReport:
        """Raise :class:`PrivacyAuditError` when the audit failed; return ``self`` otherwise."""
        if not self.passed:
            raise PrivacyAuditError(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable content (infinite numbers become ``None``), with ``summary``."""
        out = asdict(self)
        out["summary"] = self.summary
        return _jsonable(out)


def report_from_guesses(
    result: Any,
    *,
    claimed_epsilon: float,
    delta: float,
    confidence: float,
    included: Any,
    method: str,
    score: str,
    details: dict[str, Any],
    measured_noise_ratio: float | None = None,
    noise_tolerance: float | None = None,
    canary_signal: float | None = None,
    canary_signal_limit: float | None = None,
    unchecked: list[str] | None = None,
) -> AuditReport:
    """The :class:`AuditReport` of a scored audit (``result`` from :func:`dp_hf.audit.bound.score_guesses`)."""
    return AuditReport(
        epsilon_lower_bound=float(result.epsilon),
        claimed_epsilon=float(claimed_epsilon),
        delta=float(delta),
        confidence=float(confidence),
        num_canaries=len(included),
        num_included=int(included.sum()),
        num_guesses=result.num_guesses,
        num_correct=result.num_correct,
        num_positive_guesses=result.positive,
        num_negative_guesses=result.negative,
        correct_positive=result.correct_positive,
        correct_negative=result.correct_negative,
        max_epsilon_lower_bound=result.ceiling,
        method=method,
        score=score,
        details=details,
        measured_noise_ratio=measured_noise_ratio,
        noise_tolerance=noise_tolerance,
        canary_signal=canary_signal,
        canary_signal_limit=canary_signal_limit,
        unchecked=list(unchecked or []),
    )


def audit_card_lines(audit: Mapping[str, Any], epsilon: float | None = None) -> list[str]:
    """Markdown lines for a model card's Privacy section, from :meth:`AuditReport.to_dict`; ``epsilon``: the
    model's epsilon now (a model trained on after the audit is more than the audit saw: said so)."""
    conf = f"{100 * audit['confidence']:g}%"
    conclusive = audit.get("conclusive", True)
    verdict = ("passed" if conclusive else "was inconclusive") if audit["passed"] else "**FAILED**"
    bound = _fmt(audit["epsilon_lower_bound"], up=False)
    claim = _fmt(audit["claimed_epsilon"])
    lines = [
        "### Empirical privacy audit",
        "",
        f"A one-run privacy audit ({audit['method']}, {audit['num_canaries']} canaries, scored by "
        f"{audit['score']}; {PAPER}) {verdict}: the empirical lower bound is **epsilon >= {bound}** at "
        f"{conf} confidence, against the claimed epsilon {claim} (delta = {audit['delta']:g}); "
        f"{audit['num_correct']} of {audit['num_guesses']} membership guesses were correct.",
        "",
    ]
    if epsilon is not None and audit["claimed_epsilon"] is not None and epsilon > audit["claimed_epsilon"]:
        lines += [
            f"> The audit ran when epsilon was {claim}; this model was trained further (epsilon {_fmt(epsilon)} "
            "now): the audit does not cover the later steps.",
            "",
        ]
    verdict_line = (audit.get("summary") or "").splitlines()[1:2]
    if verdict_line and (not audit["passed"] or not conclusive):  # why it failed, or what did not run
        lines += [f"> {verdict_line[0]}", ""]
    if audit["passed"]:
        lines += [
            "The audit can only refute a privacy claim, never prove one: a lower bound below the claim is "
            "what a correct implementation gives, and also what a leaky one that the canaries did not "
            f"expose gives. With {audit['num_canaries']} canaries it could not have shown more than epsilon "
            f">= {_fmt(audit['max_epsilon_lower_bound'])}.",
            "",
        ]
    else:
        lines += [
            "> **Warning:** the measured leakage exceeds the stated guarantee; the epsilon above should not "
            "be relied on until the cause is found.",
            "",
        ]
    return lines


def _fmt(value: float | None, up: bool = True) -> str:
    """A claimed epsilon rounded up, a lower bound (``up=False``) down: neither shown more favourable than it is
    (``.3g`` showed a claim of 1.2435 as 1.24)."""
    from dp_hf.accounting.display import significant  # (here: dp_hf.accounting loads dp_accounting)

    if value is None or (isinstance(value, float) and math.isinf(value)):
        return "inf"
    return significant(value, 3, up=up)


def _one_in(confidence: float) -> str:
    return f"{1.0 / (1.0 - confidence):.0f}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _jsonable(value.item())
    return value
