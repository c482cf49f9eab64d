"""How close does the one-run audit get to the claimed epsilon? DP-SGD, white-box Dirac canaries.

For each setting ``(q, T)`` and each target epsilon, ``sigma`` is calibrated with the PLD accountant
(``delta = 1e-5``), then :func:`dp_hf.audit.audit_optimizer` runs the real ``DPSGD`` (clip ->
accumulate -> step, its own noise) with ``m`` canaries for several seeds (canary inclusion, sampling
and the optimizer's noise seed all change with the seed). Reported per row: the claimed epsilon, the
95% lower bounds (mean, min, max over seeds), their ratio to the claim, the same audit on the
*idealized* mechanism (the Poisson-subsampled Gaussian the accountant describes, simulated per
canary in numpy: what an exact implementation must give, up to the seeds), and the ceiling (the
bound perfectly separated scores would give with these canaries and the default guess candidates).

It also prints the two values of the paper (Steinke, Nasr & Jagielski 2023) that the bound must
reproduce, and the largest bound reachable with ``m`` canaries.

    python bench/bench_audit.py --canaries 1000 10000 --seeds 3 --out bench/results/audit-cpu
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
import warnings

import numpy as np
import torch

from dp_hf.accounting import calibrate_noise_multiplier, compute_epsilon
from dp_hf.audit import audit_optimizer, epsilon_lower_bound, max_epsilon_lower_bound, score_guesses
from dp_hf.optim import create_dp_optimizer

DELTA = 1e-5
NUM_ORDINARY = 64
# (sample rate, steps): a few large batches, and many small ones.
SETTINGS = ((0.5, 100), (0.01, 1000))
TARGETS = (1.0, 2.0, 4.0, 8.0)


def idealized_bound(m: int, q: float, steps: int, sigma: float, seed: int, score: str) -> float:
    """The audit on the exact mechanism: per canary, T Poisson(q)-sampled unit contributions + N(0, sigma^2)."""
    rng = np.random.default_rng(10_000 + seed)
    included = rng.random(m) < 0.5
    scores = np.zeros(m)
    log_1mq, log_q = (math.log1p(-q) if q < 1 else -math.inf), math.log(q)
    for _ in range(steps):
        z = (included & (rng.random(m) < q)) + rng.normal(0.0, sigma, m)
        if score == "sum":
            scores += z
        else:
            scores += np.logaddexp(log_1mq, log_q + (z - 0.5) / sigma**2)
    return score_guesses(scores, included, DELTA, seed=seed).epsilon


def real_bound(m: int, q: float, steps: int, sigma: float, seed: int, score: str):
    def make(params):
        return create_dp_optimizer(
            "dp-sgd",
            params,
            lr=0.1,
            noise_multiplier=sigma,
            max_grad_norm=1.0,
            expected_batch_size=q * (m / 2 + NUM_ORDINARY),
            noise_seed=1000 + seed,
        )

    claim = compute_epsilon(q, sigma, steps, DELTA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return audit_optimizer(
            make,
            claimed_epsilon=claim,
            delta=DELTA,
            sample_rate=q,
            steps=steps,
            num_canaries=m,
            seed=seed,
            num_ordinary=NUM_ORDINARY,
            score=score,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--canaries", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--targets", type=float, nargs="+", default=list(TARGETS))
    parser.add_argument("--score", default="likelihood", choices=("likelihood", "sum"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    lines = [
        "Bound check (the paper's printed values): "
        f"m=1000, r=100, v=75, delta=1e-4 -> {epsilon_lower_bound(1000, 100, 75, 1e-4):.4f} (paper 0.673); "
        f"m=1e5, r=1510, v=1439, delta=1e-5 -> {epsilon_lower_bound(100_000, 1510, 1439, 1e-5):.4f} "
        "(paper 2.675)",
        "Largest bound reachable (all guesses right, best r), delta=1e-5, 95%: "
        + ", ".join(f"m={m}: {max_epsilon_lower_bound(m, DELTA):.2f}" for m in (100, 1000, 10_000, 100_000)),
        "",
        f"DP-SGD, white-box Dirac canaries, score={args.score}, delta={DELTA:g}, 95% confidence, "
        f"{args.seeds} seeds, {NUM_ORDINARY} ordinary examples",
        "",
        "| q | T | sigma | claimed eps | m | lower bound mean [min, max] | mean / claim | idealized mean "
        "| ceiling | s/run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    rows = []
    for q, steps in SETTINGS:
        for target in args.targets:
            sigma = calibrate_noise_multiplier(target, DELTA, q, steps, tolerance=1e-3)
            claim = compute_epsilon(q, sigma, steps, DELTA)
            for m in args.canaries:
                bounds, ideal, seconds, ceiling = [], [], [], None
                for seed in range(args.seeds):
                    start = time.perf_counter()
                    report = real_bound(m, q, steps, sigma, seed, args.score)
                    seconds.append(time.perf_counter() - start)
                    bounds.append(report.epsilon_lower_bound)
                    ceiling = report.max_epsilon_lower_bound
                    ideal.append(idealized_bound(m, q, steps, sigma, seed, args.score))
                row = dict(
                    q=q,
                    steps=steps,
                    sigma=sigma,
                    claimed_epsilon=claim,
                    canaries=m,
                    bounds=bounds,
                    idealized=ideal,
                    ceiling=ceiling,
                    seconds=seconds,
                )
                rows.append(row)
                mean = float(np.mean(bounds))
                line = (
                    f"| {q:g} | {steps} | {sigma:.3f} | {claim:.2f} | {m} | {mean:.2f} [{min(bounds):.2f}, "
                    f"{max(bounds):.2f}] | {mean / claim:.2f} | {np.mean(ideal):.2f} | {ceiling:.2f} | "
                    f"{np.mean(seconds):.1f} |"
                )
                lines.append(line)
                print(line, flush=True)
    if args.out:
        meta = dict(
            torch=torch.__version__,
            machine=platform.machine(),
            processor=platform.processor(),
            threads=args.threads,
            score=args.score,
            delta=DELTA,
        )
        with open(args.out + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
