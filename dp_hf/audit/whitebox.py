"""White-box one-run audit of a DP optimizer with Dirac gradient canaries (:func:`audit_optimizer`).

The optimizer is run for ``steps`` steps on a synthetic parameter vector of ``d`` coordinates, fed
per-example gradients through its real path (``p.grad_sample`` -> ``clip_and_accumulate()`` per
micro-batch -> ``step()``, with its own privatizer, noise generator, geometry and update rule).
The examples:

* ``m`` **canaries**. Canary ``j`` owns coordinate ``j``; it is included in the data with probability
  1/2, independently (the one-run design). Its per-example gradient is a *Dirac in the optimizer's
  clipping geometry*: ``w = A C e_j`` with ``A = canary_norm >= 1``, i.e. the raw gradient
  ``g = c + s * (A C e_j)`` for the step's geometry ``(c, s, C)`` (identity for DP-SGD and the Adam
  family, so simply ``g = A C e_j``). Its norm in that geometry is ``A C >= C``: a worst case, which a
  correct privatizer clips to exactly ``C``.
* ``num_ordinary`` **ordinary examples**, always included, with fixed random gradients on their own
  coordinates and norms from ``0.4 C`` to ``4.5 C`` (some clipped, some not), as in a real batch.
* **probe** coordinates that no example touches: they carry only the noise, and give each step's
  noise level.

Every example, canary or not, is Poisson-sampled at ``sample_rate`` at every step, as in training.

What is observed is the optimizer's **release**: the privatized gradient ``gtilde`` of each step, read
from the privatizer's output (``optimizer.privatizer.release`` is wrapped on this optimizer instance
for the audit; the class is not changed). Everything after it (Adam moments, bias corrections,
MicroAdam's top-k and error feedback, weight decay) is post-processing of ``gtilde`` and cannot leak
more. ``gtilde`` is mapped back to the clipping coordinates, ``z_t = (gtilde - c) / s * B / C``, where
each included, sampled canary adds exactly 1 to its coordinate and the noise has standard deviation
``sigma``. A canary's score is either

* ``"likelihood"`` (default): ``sum_t log(1 - q + q exp((z_t[j] - 1/2) / sigmahat_t^2))``, the
  log-likelihood ratio "included" vs "excluded" of the Poisson-subsampled Gaussian mechanism the
  accounting assumes, with ``sigmahat_t`` the noise level measured on the probes at step ``t``; or
* ``"sum"``: ``sum_t z_t[j]``, the canary's coordinate of the sum of released gradients (the paper's
  white-box score).

Both are equivalent for large sample rates; at small ones the likelihood ratio is much stronger (a
canary is sampled in few steps and the sum accumulates the noise of all the others), and it uses the
noise level each step actually released, which exposes an implementation whose noise does not match
the accounting in some steps (e.g. divided by the realized instead of the expected batch).

Guesses and the bound: :func:`dp_hf.audit.bound.score_guesses`.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dp_hf.audit.bound import score_guesses
from dp_hf.audit.report import AuditReport, PrivacyAuditError, PrivacyAuditWarning, report_from_guesses

logger = logging.getLogger(__name__)

__all__ = ["audit_optimizer"]

SCORES = ("likelihood", "sum")

# Noise-only coordinates used to measure each step's noise level, and coordinates of the ordinary
# examples, when ``dimension`` is not given.
_DEFAULT_PROBES = 256
_DEFAULT_ORDINARY_COORDS = 256


class _ReleaseTap:
    """Records what ``optimizer.privatizer.release`` returns (``gtilde``) and the geometry it used (flat).

    Installed as an instance attribute shadowing the bound method, and removed on exit: the optimizer's
    class and every other instance are untouched.
    """

    def __init__(self, optimizer) -> None:
        privatizer = getattr(optimizer, "privatizer", None)
        if privatizer is None or not callable(getattr(privatizer, "release", None)):
            raise TypeError(
                f"{type(optimizer).__name__} has no privatizer with a release() method: audit_optimizer "
                "audits dp_hf DP optimizers (dp_hf.optim), whose step() releases gtilde through "
                "optimizer.privatizer.release(params, geometry)."
            )
        self.privatizer = privatizer
        self.records: list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, float]]] = []

    def __enter__(self) -> _ReleaseTap:
        original = self.privatizer.release

        def release(params, geometry):
            out = original(params, geometry)
            flat = torch.cat([o.detach().reshape(-1).to(torch.float64).cpu() for o in out])
            # Copy the geometry now: its tensors may be optimizer state that update() changes in place.
            self.records.append((flat, _flat_geometry(geometry, [p.shape for p in params])))
            return out

        self.privatizer.release = release
        return self

    def __exit__(self, *exc_info) -> None:
        self.privatizer.__dict__.pop("release", None)

    def pop(self) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, float]]:
        if len(self.records) != 1:
            raise RuntimeError(
                f"optimizer.step() released {len(self.records)} times through its privatizer (expected "
                "once per step): it does not privatize through dp_hf's Privatizer, so it cannot be audited "
                "by reading the release."
            )
        return self.records.pop()


def _flat_geometry(geometry, shapes) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(c, s, C)`` of a :class:`~dp_hf.privatizer.Geometry` as flat float64 vectors."""
    shifts, scales = [], []
    for k, shape in enumerate(shapes):
        n = math.prod(shape)
        shift = geometry.shift[k] if geometry.shift is not None else None
        scale = geometry.scale[k] if geometry.scale is not None else None
        shifts.append(
            torch.zeros(n, dtype=torch.float64)
            if shift is None
            else shift.detach().reshape(-1).to(torch.float64).cpu()
        )
        scales.append(
            torch.ones(n, dtype=torch.float64)
            if scale is None
            else scale.detach().reshape(-1).to(torch.float64).cpu()
        )
    return torch.cat(shifts), torch.cat(scales), float(geometry.max_grad_norm)


def _per_example_gradients(geometry, shapes, d, canary_columns, ordinary_rows, canary_norm) -> torch.Tensor:
    """``[b, d]`` float32 raw gradients ``g = c + s * w``: sampled canaries first, then ordinary examples.

    ``w`` is ``canary_norm * C`` on each canary's own coordinate, and the ordinary examples' fixed
    vectors times ``C``, all in the clipping coordinates of ``geometry``.
    """
    clip = float(geometry.max_grad_norm)
    unit = clip if math.isfinite(clip) else 1.0
    num_canaries = canary_columns.shape[0]
    w = torch.empty((num_canaries + ordinary_rows.shape[0], d), dtype=torch.float32)
    w[:num_canaries].zero_()
    w[torch.arange(num_canaries), canary_columns] = canary_norm * unit
    torch.mul(ordinary_rows, unit, out=w[num_canaries:])
    identity = all(x is None for x in (geometry.scale or [])) and all(
        x is None for x in (geometry.shift or [])
    )
    if identity:
        return w
    c, s, _ = _flat_geometry(geometry, shapes)
    return torch.addcmul(c.float(), s.float(), w)


def _shapes_for(dimension: int) -> list[tuple[int, ...]]:
    # Two tensors (a matrix and a vector) so that the flat norm over all trainable tensors is exercised.
    cols = 8
    rows = (dimension // 2) // cols
    if rows == 0:
        return [(dimension,)]
    return [(rows, cols), (dimension - rows * cols,)]


def _check_positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def audit_optimizer(
    make_optimizer: Callable[[list[torch.nn.Parameter]], Any],
    *,
    claimed_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    num_canaries: int,
    dimension: int | None = None,
    seed: int = 0,
    confidence: float = 0.95,
    num_ordinary: int = 64,
    canary_norm: float = 10.0,
    score: str = "likelihood",
    guesses="auto",
    microbatch_size: int = 256,
    device: str | torch.device = "cpu",
    raise_on_failure: bool = False,
) -> AuditReport:
    """One-run white-box audit of a DP optimizer: an empirical lower bound on its epsilon.

    Args:
        make_optimizer: ``make_optimizer(params) -> optimizer``, any dp_hf DP optimizer built on the
            given parameters with the noise multiplier, clip norm and expected batch size under audit,
            e.g. ``lambda p: create_dp_optimizer("dp-sgd", p, noise_multiplier=sigma,
            max_grad_norm=1.0, expected_batch_size=B, noise_seed=1)``. Any positive ``B`` is a valid
            choice (it only rescales the release); ``sample_rate * (num_canaries / 2 + num_ordinary)``
            is the audit's actual expected batch.
        claimed_epsilon: the epsilon the accounting claims for ``(sigma, sample_rate, steps)`` at
            ``delta``, e.g. ``dp_hf.accounting.compute_epsilon(sample_rate, sigma, steps, delta)``.
        delta: the ``delta`` of the claim and of the bound.
        sample_rate: Poisson sampling rate ``q`` of every example at every step.
        steps: number of optimizer steps ``T``.
        num_canaries: ``m``; more canaries allow larger bounds (see ``max_epsilon_lower_bound`` of
            the report) and cost ``O(m)`` coordinates.
        dimension: total number of trainable coordinates ``d >= num_canaries + 2``; by default
            ``num_canaries + 512``. Coordinates beyond the canaries' are split between probes (noise
            only) and the ordinary examples.
        seed: canary inclusion, Poisson sampling and the ordinary gradients. (The optimizer's noise
            comes from its own generator: give it a ``noise_seed`` for a reproducible audit.)
        confidence: confidence of the lower bound (default 95%).
        num_ordinary: ordinary examples mixed in (always included).
        canary_norm: ``A``, the canaries' norm in units of ``C`` in the clipping geometry (>= 1). A
            correct privatizer clips them to ``C``; a large ``A`` exposes missing clipping.
        score: ``"likelihood"`` (default) or ``"sum"`` (see the module docstring).
        guesses: ``"auto"`` or a fixed ``(num_positive, num_negative)``; see
            :func:`dp_hf.audit.bound.score_guesses`.
        microbatch_size: examples per ``clip_and_accumulate()`` call.
        device: where the parameters live (the optimizer runs there).
        raise_on_failure: raise :class:`PrivacyAuditError` instead of only warning when the lower
            bound exceeds the claim.

    Returns:
        An :class:`AuditReport`; a failed audit also issues a :class:`PrivacyAuditWarning`.
    """
    m = _check_positive_int("num_canaries", num_canaries, 2)
    steps = _check_positive_int("steps", steps)
    num_ordinary = _check_positive_int("num_ordinary", num_ordinary, 0)
    microbatch_size = _check_positive_int("microbatch_size", microbatch_size)
    if not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}.")
    if not canary_norm >= 1 or not math.isfinite(canary_norm):
        raise ValueError(
            f"canary_norm must be a finite number >= 1 (canaries must reach the clip norm), got {canary_norm!r}."
        )
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}.")
    if not claimed_epsilon >= 0:
        raise ValueError(f"claimed_epsilon must be >= 0 (inf allowed), got {claimed_epsilon!r}.")
    q = float(sample_rate)

    # ---- layout: canary coordinates, probes, ordinary-example coordinates (a seeded permutation)
    if dimension is None:
        d = m + _DEFAULT_PROBES + (_DEFAULT_ORDINARY_COORDS if num_ordinary else 0)
    else:
        d = _check_positive_int("dimension", dimension, m + 2)
    extra = d - m
    n_probe = extra if num_ordinary == 0 else max(1, extra // 2)
    n_ord_coords = extra - n_probe
    if num_ordinary and n_ord_coords < 1:
        raise ValueError(f"dimension={d} leaves no coordinate for the ordinary examples; raise it.")
    rng = np.random.default_rng(seed)
    perm = rng.permutation(d)
    canary_coords = perm[:m]
    probe_coords = perm[m : m + n_probe]
    ord_coords = perm[m + n_probe :]
    included = rng.random(m) < 0.5

    gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
    ord_w = torch.zeros((num_ordinary, d), dtype=torch.float32)
    if num_ordinary:
        directions = torch.randn((num_ordinary, n_ord_coords), generator=gen)
        directions /= directions.norm(dim=1, keepdim=True).clamp_min(1e-12)
        norms = torch.exp(torch.empty(num_ordinary).uniform_(-0.9, 1.5, generator=gen))
        ord_w[:, torch.as_tensor(ord_coords)] = directions * norms[:, None]  # in units of C

    # ---- the optimizer on fresh parameters
    shapes = _shapes_for(d)
    params = [
        torch.nn.Parameter((0.01 * torch.randn(shape, generator=gen)).to(device=device)) for shape in shapes
    ]
    optimizer = make_optimizer(params)
    tap = _ReleaseTap(optimizer)  # refuses optimizers that do not release through a dp_hf privatizer
    trainable = optimizer.trainable_params()
    if len(trainable) != len(params) or any(a is not b for a, b in zip(trainable, params)):
        raise ValueError(
            "make_optimizer(params) must build the optimizer on exactly the parameters it is given "
            "(all trainable, in that order)."
        )
    expected_batch = float(optimizer.privatizer.expected_batch_size)
    claimed_sigma = float(getattr(optimizer, "noise_multiplier", float("nan")))

    canary_t = torch.as_tensor(canary_coords)
    scores = np.zeros(m, dtype=np.float64)
    sigma_hats = np.empty(steps)
    probe_noise = np.empty((steps, len(probe_coords)))  # each step's noise on the probes, in units of C / B
    log_1mq = math.log1p(-q) if q < 1 else -math.inf
    log_q = math.log(q)
    batch_sizes = np.empty(steps, dtype=np.int64)
    start = time.perf_counter()
    with tap:
        for t in range(steps):
            sampled_canaries = np.flatnonzero(included & (rng.random(m) < q))
            sampled_ordinary = np.flatnonzero(rng.random(num_ordinary) < q) if num_ordinary else []
            b = len(sampled_canaries) + len(sampled_ordinary)
            batch_sizes[t] = b
            if b:
                geometry = optimizer.geometry(params)
                g = _per_example_gradients(
                    geometry,
                    shapes,
                    d,
                    canary_t[torch.as_tensor(sampled_canaries, dtype=torch.long)],
                    ord_w[torch.as_tensor(sampled_ordinary, dtype=torch.long)],
                    canary_norm,
                )
                for lo in range(0, b, microbatch_size):
                    chunk = g[lo : lo + microbatch_size].to(device)
                    offset = 0
                    for p, shape in zip(params, shapes):
                        n = math.prod(shape)
                        p.grad_sample = chunk[:, offset : offset + n].reshape(-1, *shape)
                        offset += n
                    optimizer.clip_and_accumulate()
            optimizer.step()
            optimizer.zero_grad()
            gtilde, (c, s, clip) = tap.pop()
            unit = expected_batch / clip if math.isfinite(clip) and clip > 0 else expected_batch
            z = ((gtilde - c) / s * unit).numpy()
            probe_noise[t] = z[probe_coords]
            sigma_hat = float(np.sqrt(np.mean(probe_noise[t] ** 2)))
            sigma_hats[t] = sigma_hat
            zc = z[canary_coords]
            if score == "sum":
                scores += zc
            else:
                var = max(sigma_hat, 1e-12) ** 2
                scores += np.logaddexp(log_1mq, log_q + (zc - 0.5) / var) if q < 1 else (zc - 0.5) / var
    elapsed = time.perf_counter() - start

    result = score_guesses(scores, included, delta, confidence, guesses, seed=seed)
    name = getattr(optimizer, "audit_name", None) or type(optimizer).__name__
    details = {
        "target": f"optimizer {name}",
        "optimizer": name,
        "noise_multiplier": claimed_sigma,
        "max_grad_norm": float(getattr(optimizer, "max_grad_norm", float("nan"))),
        "expected_batch_size": expected_batch,
        "sample_rate": q,
        "steps": steps,
        "dimension": d,
        "num_probe_coordinates": n_probe,
        "num_ordinary": num_ordinary,
        "canary_norm": float(canary_norm),
        "mean_realized_batch": float(batch_sizes.mean()),
        "measured_noise_multiplier": float(np.median(sigma_hats)),
        "guess_candidates": [list(c) for c in result.candidates],
        "seconds": round(elapsed, 3),
        "setup_text": (
            f"{steps} steps of {name} at sample rate {q:g} (noise multiplier {claimed_sigma:g} claimed, "
            f"{float(np.median(sigma_hats)):.3g} measured on the release), {num_ordinary} ordinary examples, "
            f"{d} coordinates"
        ),
    }
    report = report_from_guesses(
        result,
        claimed_epsilon=float(claimed_epsilon),
        delta=float(delta),
        confidence=confidence,
        included=included,
        method="white-box gradient canaries",
        score=score,
        details=details,
        measured_noise_ratio=measured_noise_ratio(probe_noise, claimed_sigma),
    )
    _announce(report, raise_on_failure)
    return report


#: Probability that correct noise makes :func:`measured_noise_ratio` report a shortfall (per audit).
NOISE_FALSE_ALARM = 1e-6


def measured_noise_ratio(probe_noise: np.ndarray, claimed_sigma: float) -> float | None:
    """Measured over claimed noise multiplier, ``[steps, probes]`` noise in units of ``C / B``; None for no claim.

    The median step's level, unless some step, or the difference of two consecutive steps, carries less: a
    step's mean square over ``n`` probes is ``sigma^2 chi^2_n / n``, so below the ``NOISE_FALSE_ALARM /
    (2 steps)`` quantile ``f`` of that it is a shortfall, reported as its level over ``f`` (correct noise
    reaches it with probability at most ``NOISE_FALSE_ALARM``). The median alone missed noise skipped on a
    third of the steps, and a generator reseeded before every release (the same noise each step: a
    difference of two releases had none) read 1.00 (an audit).
    """
    if not claimed_sigma > 0:
        return None
    steps, n = probe_noise.shape
    levels = np.sqrt(np.mean(probe_noise**2, axis=1)) / claimed_sigma
    differences = np.sqrt(np.mean(np.diff(probe_noise, axis=0) ** 2, axis=1)) / (math.sqrt(2) * claimed_sigma)
    from scipy.stats import chi2

    floor = math.sqrt(chi2.ppf(NOISE_FALSE_ALARM / (2 * steps), n) / n)
    worst = min(float(levels.min()), float(differences.min()) if len(differences) else math.inf)
    return min(float(np.median(levels)), worst / floor)


def _announce(report: AuditReport, raise_on_failure: bool) -> None:
    if report.passed:
        (logger.info if report.conclusive else logger.warning)("%s", report.summary)
        return
    if raise_on_failure:
        raise PrivacyAuditError(report)
    warnings.warn(report.summary, PrivacyAuditWarning, stacklevel=3)
