"""White-box one-run audit of a DP optimizer with gradient canaries (:func:`audit_optimizer`).

The optimizer is run for ``steps`` steps on synthetic parameters of ``d`` coordinates in ``k =
canary_tensors`` tensors (default 4; a matrix and vectors), fed per-example gradients through its real
path (``p.grad_sample`` -> ``clip_and_accumulate()`` per micro-batch -> ``step()``, with its own
privatizer, noise generator, geometry and update rule). The examples:

* ``m`` **canaries**, each included in the data with probability 1/2, independently (the one-run
  design). Canary ``j`` owns one coordinate in *each* of the ``k`` tensors, ``i_{j,1}, ..., i_{j,k}``
  (disjoint between canaries), and its direction is ``u_j = (e_{i_{j,1}} + ... + e_{i_{j,k}}) / sqrt(k)``,
  a unit vector spread equally over the tensors. Its per-example gradient is ``w = A C u_j`` *in the
  optimizer's clipping geometry* (``A = canary_norm >= 1``), i.e. the raw gradient ``g = c + s * w`` for
  the step's geometry ``(c, s, C)`` (identity for DP-SGD and the Adam family: ``g = A C u_j``). Its flat
  norm over all tensors is ``A C >= C``: a worst case, which a correct privatizer clips to exactly
  ``C u_j``. Why spread: an implementation that clips each tensor separately to ``C`` lets each of the
  ``k`` pieces (norm ``A C / sqrt(k)`` each) through at ``C``, a contribution ``sqrt(k) C u_j`` (2 C for
  ``k = 4``); a canary on one coordinate lives in one tensor, where per-tensor and flat clipping agree,
  so such a leak (the sensitivity of any model with ``k`` tensors grows to ``sqrt(k) C``) went unseen.
* ``num_ordinary`` **ordinary examples**, always included, with fixed random gradients on their own
  coordinates (spread over all tensors) and norms from ``0.4 C`` to ``4.5 C`` (some clipped, some not).
* **probe** coordinates (spread over all tensors) that no example touches: they carry only the noise,
  and give each step's noise level.

Every example, canary or not, is Poisson-sampled at ``sample_rate`` at every step, as in training.

What is observed is the optimizer's **release**: the privatized gradient ``gtilde`` of each step, read
from the privatizer's output (``optimizer.privatizer.release`` is wrapped on this optimizer instance
for the audit; the class is not changed). Everything after it (Adam moments, bias corrections,
MicroAdam's top-k and error feedback, weight decay) is post-processing of ``gtilde`` and cannot leak
more. ``gtilde`` is mapped back to the clipping coordinates, ``z_t = (gtilde - c) / s * B / C``, in which
a correct implementation adds ``u_j`` for each included, sampled canary and isotropic noise
``N(0, sigma^2 I)``. Along a canary's direction, ``y_t[j] = z_t . u_j = (z_t[i_{j,1}] + ... +
z_t[i_{j,k}]) / sqrt(k)`` is then ``1`` (when sampled) plus ``N(0, sigma^2)``, independent over canaries
(orthonormal directions) and steps: exactly the one-dimensional mechanism the accounting assumes. A
canary's score is either

* ``"likelihood"`` (default): ``sum_t log(1 - q + q exp((y_t[j] - 1/2) / sigmahat_t^2))``, the
  log-likelihood ratio "included" vs "excluded" of the Poisson-subsampled Gaussian mechanism, with
  ``sigmahat_t`` the noise level measured on the probes at step ``t``; or
* ``"sum"``: ``sum_t y_t[j]``, the canary's component of the sum of released gradients (the paper's
  white-box score).

Both are equivalent for large sample rates; at small ones the likelihood ratio is much stronger (a
canary is sampled in few steps and the sum accumulates the noise of all the others), and it uses the
noise level each step actually released, which exposes an implementation whose noise does not match
the accounting in some steps (e.g. divided by the realized instead of the expected batch).

Besides the bound (:func:`dp_hf.audit.bound.score_guesses`), two direct checks with false-alarm rate
``1e-6`` each (:mod:`dp_hf.audit.checks`): the **noise** on the probes against the claimed noise
multiplier (a chi-square quantile for ``n`` probes and ``T`` steps instead of a fixed tolerance), and
the **canary signal**, the mean of ``y_t[j]`` over included, sampled canaries, which must be 1 (clipped
to ``C``) up to its noise: clipping at ``2 C``, per tensor, or not at all shows above it even where a
one-run bound at a few hundred canaries stays below the claim. The claimed noise multiplier is
``noise_multiplier`` if given, else ``optimizer.noise_multiplier``, else
``optimizer.privatizer.noise_multiplier``; with none the noise check does not run and the report says
so (INCONCLUSIVE, never PASSED).
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
from dp_hf.audit.checks import noise_check, signal_limit
from dp_hf.audit.report import AuditReport, PrivacyAuditError, PrivacyAuditWarning, report_from_guesses

logger = logging.getLogger(__name__)

__all__ = ["audit_optimizer"]

SCORES = ("likelihood", "sum")

# Noise-only coordinates used to measure each step's noise level, and coordinates of the ordinary
# examples, when ``dimension`` is not given. 1024 probes put the noise tolerance at 0.89 for a single
# step and 0.99 for 100 (dp_hf.audit.checks).
_DEFAULT_PROBES = 1024
_DEFAULT_ORDINARY_COORDS = 256
#: Tensors of the synthetic parameters, each canary spread over all of them (the module docstring).
DEFAULT_CANARY_TENSORS = 4


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

        def release(params, geometry, **kwargs):  # (step=: the DP step, checked across ranks)
            out = original(params, geometry, **kwargs)
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

    ``w`` is ``canary_norm * C * u_j`` for each canary (``canary_columns``: ``[canaries, k]``, its ``k``
    coordinates, each ``canary_norm * C / sqrt(k)``), and the ordinary examples' fixed vectors times
    ``C``, all in the clipping coordinates of ``geometry``.
    """
    clip = float(geometry.max_grad_norm)
    unit = clip if math.isfinite(clip) else 1.0
    num_canaries, spread = canary_columns.shape
    w = torch.empty((num_canaries + ordinary_rows.shape[0], d), dtype=torch.float32)
    w[:num_canaries].zero_()
    w[torch.arange(num_canaries).unsqueeze(1), canary_columns] = canary_norm * unit / math.sqrt(spread)
    torch.mul(ordinary_rows, unit, out=w[num_canaries:])
    identity = all(x is None for x in (geometry.scale or [])) and all(
        x is None for x in (geometry.shift or [])
    )
    if identity:
        return w
    c, s, _ = _flat_geometry(geometry, shapes)
    return torch.addcmul(c.float(), s.float(), w)


def _shapes_for(dimension: int, num_tensors: int = DEFAULT_CANARY_TENSORS) -> list[tuple[int, ...]]:
    """``num_tensors`` shapes, ``dimension`` coordinates in all, each at least ``dimension // num_tensors``.

    Alternately a matrix (8 columns where the size allows) and a vector, so that per-example gradients of
    several ranks and the flat norm over all trainable tensors are exercised.
    """
    base = dimension // num_tensors
    if base < 1:
        raise ValueError(f"dimension={dimension} is too small for {num_tensors} tensors.")
    sizes = [base] * (num_tensors - 1) + [dimension - base * (num_tensors - 1)]
    shapes: list[tuple[int, ...]] = []
    for k, n in enumerate(sizes):
        cols = math.gcd(n, 8)
        shapes.append((n // cols, cols) if k % 2 == 0 else (n,))
    return shapes


def _layout(rng, shapes, m, n_probe):
    """Seeded coordinates: ``[m, k]`` canary coordinates (one per tensor each), probes, ordinary ones."""
    canaries, rest, offset = [], [], 0
    for shape in shapes:
        n = math.prod(shape)
        perm = offset + rng.permutation(n)
        canaries.append(perm[:m])
        rest.append(perm[m:])
        offset += n
    rest = rng.permutation(np.concatenate(rest))
    return np.stack(canaries, axis=1), rest[:n_probe], rest[n_probe:]


def _claimed_noise_multiplier(optimizer, given) -> tuple[float | None, str]:
    """The noise multiplier the accounting used, and where it was read; ``(None, "none")`` if unknown."""
    candidates = (
        ("argument", lambda: given),
        ("optimizer", lambda: getattr(optimizer, "noise_multiplier", None)),
        ("privatizer", lambda: getattr(optimizer.privatizer, "noise_multiplier", None)),
    )
    for source, read in candidates:
        value = read()
        if isinstance(value, (int, float, np.floating)) and not isinstance(value, bool):
            if math.isfinite(value) and value >= 0:
                return float(value), source
    return None, "none"


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
    noise_multiplier: float | None = None,
    canary_tensors: int = DEFAULT_CANARY_TENSORS,
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
        dimension: total number of trainable coordinates ``d >= canary_tensors * num_canaries + 2``; by
            default ``canary_tensors * num_canaries + 1024 + 256`` (1024 probes, 256 coordinates for the
            ordinary examples). A given ``d``'s coordinates beyond the canaries' are split evenly
            between probes (noise only) and the ordinary examples (all probes without ordinary examples).
        seed: canary inclusion, Poisson sampling and the ordinary gradients. (The optimizer's noise
            comes from its own generator: give it a ``noise_seed`` for a reproducible audit.)
        confidence: confidence of the lower bound (default 95%).
        num_ordinary: ordinary examples mixed in (always included).
        canary_norm: ``A``, the canaries' norm in units of ``C`` in the clipping geometry (>= 1). A
            correct privatizer clips them to ``C``; a large ``A`` exposes missing or loose clipping.
        score: ``"likelihood"`` (default) or ``"sum"`` (see the module docstring).
        guesses: ``"auto"`` or a fixed ``(num_positive, num_negative)``; see
            :func:`dp_hf.audit.bound.score_guesses`.
        microbatch_size: examples per ``clip_and_accumulate()`` call.
        device: where the parameters live (the optimizer runs there).
        raise_on_failure: raise :class:`PrivacyAuditError` instead of only warning when the audit fails.
        noise_multiplier: the noise multiplier the claim was computed for (default: the optimizer's
            ``noise_multiplier``, else its privatizer's). Without any, the noise check cannot run and a
            passing audit is reported INCONCLUSIVE.
        canary_tensors: ``k >= 2``, the number of synthetic parameter tensors; each canary is spread over
            all of them (see the module docstring: this is what exposes per-tensor clipping).

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
    if noise_multiplier is not None and not (0 <= noise_multiplier < math.inf):
        raise ValueError(f"noise_multiplier must be a finite number >= 0 or None, got {noise_multiplier!r}.")
    k = _check_positive_int("canary_tensors", canary_tensors, 2)
    q = float(sample_rate)

    # ---- layout: k tensors; canary coordinates (one per tensor each), probes, ordinary-example coordinates
    if dimension is None:
        n_probe = _DEFAULT_PROBES
        d = k * m + n_probe + (_DEFAULT_ORDINARY_COORDS if num_ordinary else 0)
    else:
        d = _check_positive_int("dimension", dimension, k * m + 2)
        n_probe = d - k * m if num_ordinary == 0 else max(1, (d - k * m) // 2)
    if num_ordinary and d - k * m - n_probe < 1:
        raise ValueError(f"dimension={d} leaves no coordinate for the ordinary examples; raise it.")
    rng = np.random.default_rng(seed)
    shapes = _shapes_for(d, k)
    canary_coords, probe_coords, ord_coords = _layout(rng, shapes, m, n_probe)
    n_ord_coords = len(ord_coords)
    included = rng.random(m) < 0.5

    gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
    ord_w = torch.zeros((num_ordinary, d), dtype=torch.float32)
    if num_ordinary:
        directions = torch.randn((num_ordinary, n_ord_coords), generator=gen)
        directions /= directions.norm(dim=1, keepdim=True).clamp_min(1e-12)
        norms = torch.exp(torch.empty(num_ordinary).uniform_(-0.9, 1.5, generator=gen))
        ord_w[:, torch.as_tensor(ord_coords)] = directions * norms[:, None]  # in units of C

    # ---- the optimizer on fresh parameters
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
    claimed_sigma, sigma_source = _claimed_noise_multiplier(optimizer, noise_multiplier)

    canary_t = torch.as_tensor(canary_coords)
    scores = np.zeros(m, dtype=np.float64)
    sigma_hats = np.empty(steps)
    probe_noise = np.empty((steps, len(probe_coords)))  # each step's noise on the probes, in units of C / B
    log_1mq = math.log1p(-q) if q < 1 else -math.inf
    log_q = math.log(q)
    batch_sizes = np.empty(steps, dtype=np.int64)
    signal_sum, signal_count = 0.0, 0  # y_t[j] over included, sampled canaries (the clip check)
    clipped = True  # every step had a finite clip norm (else there is no clip bound to check)
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
            clipped = clipped and math.isfinite(clip) and clip > 0
            unit = expected_batch / clip if math.isfinite(clip) and clip > 0 else expected_batch
            z = ((gtilde - c) / s * unit).numpy()
            probe_noise[t] = z[probe_coords]
            sigma_hat = float(np.sqrt(np.mean(probe_noise[t] ** 2)))
            sigma_hats[t] = sigma_hat
            zc = z[canary_coords].sum(axis=1) / math.sqrt(k)  # y_t[j] = z_t . u_j
            signal_sum += float(zc[sampled_canaries].sum())
            signal_count += len(sampled_canaries)
            if score == "sum":
                scores += zc
            else:
                var = max(sigma_hat, 1e-12) ** 2
                scores += np.logaddexp(log_1mq, log_q + (zc - 0.5) / var) if q < 1 else (zc - 0.5) / var
    elapsed = time.perf_counter() - start

    result = score_guesses(scores, included, delta, confidence, guesses, seed=seed)
    noise = noise_check(probe_noise, claimed_sigma)
    signal = signal_sum / signal_count if signal_count else None
    limit = signal_limit(signal_count, noise.pooled, probe_noise.size) if clipped else None
    unchecked = []
    if claimed_sigma is None:
        unchecked.append(
            "the noise check did not run: the optimizer reports no noise multiplier (neither "
            "optimizer.noise_multiplier nor optimizer.privatizer.noise_multiplier; pass noise_multiplier= "
            "to audit_optimizer), so noise below the claim would go unnoticed"
        )
    if not clipped:
        unchecked.append("the clip check did not run: the clip norm is infinite (no clipping)")
    elif limit is None:
        unchecked.append("the clip check did not run: no included canary was ever sampled")
    name = getattr(optimizer, "audit_name", None) or type(optimizer).__name__
    claimed_text = "no" if claimed_sigma is None else f"{claimed_sigma:g}"
    details = {
        "target": f"optimizer {name}",
        "optimizer": name,
        "noise_multiplier": claimed_sigma,
        "noise_multiplier_source": sigma_source,
        "max_grad_norm": float(getattr(optimizer, "max_grad_norm", float("nan"))),
        "expected_batch_size": expected_batch,
        "sample_rate": q,
        "steps": steps,
        "dimension": d,
        "shapes": [list(shape) for shape in shapes],
        "canary_tensors": k,
        "num_probe_coordinates": n_probe,
        "num_ordinary": num_ordinary,
        "canary_norm": float(canary_norm),
        "mean_realized_batch": float(batch_sizes.mean()),
        "measured_noise_multiplier": noise.pooled,
        "median_step_noise_multiplier": float(np.median(sigma_hats)),
        "canary_signal_count": signal_count,
        "guess_candidates": [list(c) for c in result.candidates],
        "seconds": round(elapsed, 3),
        "setup_text": (
            f"{steps} steps of {name} at sample rate {q:g} (noise multiplier {claimed_text} claimed, "
            f"{noise.pooled:.3g} measured on the release), {num_ordinary} ordinary examples, {d} coordinates "
            f"in {k} tensors (each canary spread over all {k})"
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
        measured_noise_ratio=noise.ratio,
        noise_tolerance=noise.tolerance,
        canary_signal=signal,
        canary_signal_limit=limit,
        unchecked=unchecked,
    )
    _announce(report, raise_on_failure)
    return report


def _announce(report: AuditReport, raise_on_failure: bool) -> None:
    if report.passed:
        (logger.info if report.conclusive else logger.warning)("%s", report.summary)
        return
    if raise_on_failure:
        raise PrivacyAuditError(report)
    warnings.warn(report.summary, PrivacyAuditWarning, stacklevel=3)
