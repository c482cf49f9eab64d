"""``dp-hf audit``: the white-box one-run audit of a dp_hf optimizer from the command line.

::

    dp-hf audit --optimizer dp-sgd --noise-multiplier 10.86 --sample-rate 0.5 --steps 100 \\
                [--canaries 1000] [--delta 1e-5] [--claimed-epsilon E] [--clip-norm 1]
                [--dimension D] [--ordinary 64] [--score likelihood|sum] [--seed 0]
                [--noise-seed 1] [--confidence 0.95] [--optimizer-kwargs JSON] [--json]

Without ``--claimed-epsilon`` the claim is the accountant's epsilon for
``(noise multiplier, sample rate, steps, delta)``. Prints the audit's summary (or its JSON with
``--json``); the exit status is 0 when the audit passes, 1 when it fails (the lower bound exceeds the
claim, too little noise was measured, or the clip bound is exceeded) and :data:`INCONCLUSIVE` (3) when
it is inconclusive (the claim is above what it can show, or a check could not run); 2 is argparse's,
for a bad command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["INCONCLUSIVE", "add_parser", "main", "run_audit"]

#: Exit status of an inconclusive audit (2 is argparse's usage error).
INCONCLUSIVE = 3


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``audit`` subcommand on an ``argparse`` subparsers object (``dp-hf``'s)."""
    sub = subparsers.add_parser(
        "audit",
        help="empirical lower bound on epsilon of a DP optimizer (one-run audit)",
        description="One-run white-box privacy audit (Steinke, Nasr & Jagielski 2023) of a dp_hf optimizer "
        "with gradient canaries: prints an empirical lower bound on epsilon. Exit status: 0 passed, 1 "
        "failed (the bound exceeds the claim, too little noise was measured, or the clip bound is exceeded), "
        "3 inconclusive (the claim is above what the audit can show, or a check could not run).",
    )
    add_arguments(sub)
    sub.set_defaults(handler=run_audit, parser=sub)
    return sub


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the ``audit`` command."""
    parser.add_argument(
        "--optimizer", default="dp-sgd", help="optimizer name (dp_hf.optim.OPTIMIZERS; dp-sgd)"
    )
    parser.add_argument("--noise-multiplier", type=float, required=True, metavar="SIGMA")
    parser.add_argument("--sample-rate", type=float, required=True, metavar="Q")
    parser.add_argument("--steps", type=int, required=True, metavar="T")
    parser.add_argument("--canaries", type=int, default=1000, metavar="M", help="number of canaries (1000)")
    parser.add_argument("--delta", type=float, default=1e-5, help="delta of the claim and the bound (1e-5)")
    parser.add_argument(
        "--claimed-epsilon",
        type=float,
        default=None,
        metavar="EPS",
        help="the claim to test (default: the accountant's epsilon for sigma, q, T, delta)",
    )
    parser.add_argument("--accountant", default="pld", choices=("pld", "rdp", "prv"))
    parser.add_argument(
        "--clip-norm",
        type=float,
        default=1.0,
        metavar="C",
        help="max_grad_norm (1; DP-MacAdam clips to 1 in its own geometry)",
    )
    parser.add_argument("--dimension", type=int, default=None, metavar="D", help="coordinates (4 M + 1280)")
    parser.add_argument("--ordinary", type=int, default=64, metavar="N", help="ordinary examples (64)")
    parser.add_argument("--score", default="likelihood", choices=("likelihood", "sum"))
    parser.add_argument("--seed", type=int, default=0, help="canary inclusion and sampling seed (0)")
    parser.add_argument("--noise-seed", type=int, default=None, help="the optimizer's noise seed")
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument(
        "--optimizer-kwargs",
        default="{}",
        metavar="JSON",
        help="extra optimizer arguments, e.g. '{\"lr\": 0.1}'",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run_audit(args: argparse.Namespace) -> int:
    """Run the audit described by parsed ``args``; returns 0 (passed), 1 (failed) or :data:`INCONCLUSIVE`."""
    import warnings

    from dp_hf.accounting import compute_epsilon
    from dp_hf.audit.whitebox import audit_optimizer
    from dp_hf.optim import create_dp_optimizer, get_optimizer_class

    try:
        extra = json.loads(args.optimizer_kwargs)
    except json.JSONDecodeError as err:
        raise ValueError(f"--optimizer-kwargs is not valid JSON: {err}") from None
    if not isinstance(extra, dict):
        raise ValueError("--optimizer-kwargs must be a JSON object")
    cls = get_optimizer_class(args.optimizer)
    claim = args.claimed_epsilon
    if claim is None:
        claim = compute_epsilon(
            args.sample_rate, args.noise_multiplier, args.steps, args.delta, args.accountant
        )
    expected_batch = args.sample_rate * (args.canaries / 2 + args.ordinary)
    kwargs = dict(noise_multiplier=args.noise_multiplier, expected_batch_size=expected_batch, **extra)
    if args.noise_seed is not None:
        kwargs["noise_seed"] = args.noise_seed
    if not getattr(cls, "adaptive_clipping", False):
        kwargs.setdefault("max_grad_norm", args.clip_norm)

    def make(params):
        return create_dp_optimizer(args.optimizer, params, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the verdict is printed below
        report = audit_optimizer(
            make,
            claimed_epsilon=claim,
            delta=args.delta,
            sample_rate=args.sample_rate,
            steps=args.steps,
            num_canaries=args.canaries,
            dimension=args.dimension,
            seed=args.seed,
            confidence=args.confidence,
            num_ordinary=args.ordinary,
            score=args.score,
        )
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(report.summary)
    return (0 if report.conclusive else INCONCLUSIVE) if report.passed else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dp_hf.audit ...`` (the same options as ``dp-hf audit``)."""
    parser = argparse.ArgumentParser(
        prog="python -m dp_hf.audit", description="One-run privacy audit of a dp_hf optimizer."
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_audit(args)
    except ValueError as err:
        parser.error(str(err))
    return 2  # unreachable: parser.error exits
