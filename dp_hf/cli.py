"""The ``dp-hf`` command line.

Subcommands::

    dp-hf epsilon --noise-multiplier S [--delta D] (--sample-rate Q | --batch-size B --dataset-size N)
                  (--steps T | --epochs E) [--accountant pld|rdp] [--json]
    dp-hf noise   --target-epsilon E [--delta D] (same sampling and length options)
    dp-hf card    OUTPUT_DIR [--write]   (implemented in dp_hf.card)
    dp-hf audit   --noise-multiplier S --sample-rate Q --steps T [--optimizer NAME] [--canaries M]
                  [--delta D] [--claimed-epsilon E] [--json]   (implemented in dp_hf.audit.cli)

Derived quantities: ``q = B / N`` and, for ``--epochs E``, ``T = ceil(E * round(N / B))``
(``round(1 / q)`` without ``N``): the step count :class:`dp_hf.DPTrainer` takes, computed by the
same function (:func:`dp_hf.plan.planned_steps`), so a planned noise multiplier meets its budget
in training. ``B`` is the expected logical batch over all processes
(``per_device_train_batch_size * gradient_accumulation_steps * num_processes``). Without
``--delta``, ``delta = validation.default_delta(N)`` (``1/(10 N)`` rounded down
to one significant digit). Bad input prints a message on stderr and exits
with status 2, as argparse does.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from dp_hf import __version__, accounting, plan, validation
from dp_hf.accounting.display import delta_text, significant
from dp_hf.card.cli import add_card_arguments

PROG = "dp-hf"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dp-hf``; returns the exit status (errors raise ``SystemExit(2)``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args) or 0
    except ValueError as err:
        args.parser.error(str(err))  # prints usage and the message on stderr, exits with status 2
    return 2  # unreachable: parser.error exits


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``dp-hf`` with all its subcommands."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Differentially private fine-tuning of Hugging Face models: privacy accounting tools.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"{PROG} {__version__} ({accounting.accounting_library_version()})",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_epsilon_parser(subparsers)
    _add_noise_parser(subparsers)
    _add_card_parser(subparsers)
    from dp_hf.audit.cli import add_parser as _add_audit_parser  # light: torch loads only when it runs

    _add_audit_parser(subparsers)
    return parser


# --- epsilon ---------------------------------------------------------------------------------------


def _add_epsilon_parser(subparsers: Any) -> None:
    sub = subparsers.add_parser(
        "epsilon",
        help="privacy loss epsilon of a DP-SGD run",
        description="Compute epsilon of T Poisson-sampled Gaussian steps: "
        "SelfComposed(PoissonSampled(q, Gaussian(sigma)), T).",
    )
    sub.add_argument(
        "--noise-multiplier", type=float, required=True, metavar="SIGMA", help="noise std / clip norm"
    )
    _add_run_arguments(sub)
    sub.set_defaults(handler=_run_epsilon, parser=sub)


def _run_epsilon(args: argparse.Namespace) -> int:
    validation.check_noise_multiplier(args.noise_multiplier, "--noise-multiplier")
    run = _resolve_run(args)
    epsilon = accounting.compute_epsilon(
        run["sample_rate"], args.noise_multiplier, run["steps"], run["delta"], args.accountant
    )
    result = {"epsilon": epsilon, "noise_multiplier": args.noise_multiplier, **run}
    if args.json:
        _print_json(result, args.accountant)
    else:
        print(f"epsilon = {_fmt(epsilon)} at delta = {delta_text(run['delta'])} {_describe_run(args, run)}")
    return 0


# --- noise -----------------------------------------------------------------------------------------


def _add_noise_parser(subparsers: Any) -> None:
    sub = subparsers.add_parser(
        "noise",
        help="smallest noise multiplier that meets a privacy budget",
        description="Calibrate the noise multiplier sigma: the smallest sigma (to 1e-3, printed "
        "rounded up to 4 decimals) with epsilon(q, sigma, T, delta) <= target epsilon.",
    )
    sub.add_argument("--target-epsilon", type=float, required=True, metavar="EPS", help="privacy budget")
    _add_run_arguments(sub)
    sub.set_defaults(handler=_run_noise, parser=sub)


def _run_noise(args: argparse.Namespace) -> int:
    validation.check_epsilon(args.target_epsilon, "--target-epsilon")
    run = _resolve_run(args)
    sigma = accounting.calibrate_noise_multiplier(
        args.target_epsilon, run["delta"], run["sample_rate"], run["steps"], args.accountant
    )
    sigma = math.ceil(sigma * 1e4) / 1e4  # rounded up, so the printed value still meets the budget
    epsilon = accounting.compute_epsilon(
        run["sample_rate"], sigma, run["steps"], run["delta"], args.accountant
    )
    result = {"noise_multiplier": sigma, "target_epsilon": args.target_epsilon, "epsilon": epsilon, **run}
    if args.json:
        _print_json(result, args.accountant)
    else:
        print(
            f"noise multiplier = {sigma:.4f} gives epsilon = {_fmt(epsilon)} <= {args.target_epsilon:g} "
            f"at delta = {delta_text(run['delta'])} {_describe_run(args, run)}"
        )
    return 0


# --- card (implemented in dp_hf.card) ----------------------------------------------------------------


def _add_card_parser(subparsers: Any) -> None:
    """Register ``dp-hf card OUTPUT_DIR [--write]`` (implemented by ``dp_hf.card.main_card(args)``,
    imported lazily: it pulls heavy dependencies)."""
    sub = subparsers.add_parser(
        "card",
        help="write a privacy model card for a training output directory",
        description="Render the privacy model card of a dp_hf training run from its privacy.json.",
    )
    add_card_arguments(sub)  # the one declaration, shared with `python -m dp_hf.card`
    sub.set_defaults(handler=_run_card, parser=sub)


def _run_card(args: argparse.Namespace) -> int:
    try:
        card = importlib.import_module("dp_hf.card")
    except ModuleNotFoundError as err:
        if err.name != "dp_hf.card":
            raise  # a dependency of dp_hf.card is missing: show the real cause
        args.parser.error(
            "the model-card generator (module dp_hf.card) is not available in this installation"
        )
    return card.main_card(args) or 0


# --- shared options and helpers ----------------------------------------------------------------------


def _add_run_arguments(sub: argparse.ArgumentParser) -> None:
    """Options describing the run: delta, sampling (q or B and N), length (T or epochs), accountant."""
    sub.add_argument(
        "--delta",
        type=float,
        help="failure probability; default with --dataset-size: 1/(10 N) rounded down to one significant digit",
    )
    sampling = sub.add_mutually_exclusive_group(required=True)
    sampling.add_argument("--sample-rate", type=float, metavar="Q", help="Poisson sampling rate q")
    sampling.add_argument(
        "--batch-size",
        type=int,
        metavar="B",
        help="expected logical batch over all processes: per-device batch x accumulation x processes (q = B / N)",
    )
    sub.add_argument("--dataset-size", type=int, metavar="N", help="number of training examples")
    length = sub.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=int, metavar="T", help="number of optimizer steps")
    length.add_argument(
        "--epochs",
        type=float,
        metavar="E",
        help="epochs as DPTrainer counts them (T = ceil(E * round(N / B)))",
    )
    sub.add_argument("--accountant", choices=accounting.ACCOUNTANTS, default="pld", help="default: pld")
    sub.add_argument("--json", action="store_true", help="print one JSON object instead of a sentence")


def _resolve_run(args: argparse.Namespace) -> dict:
    """Validate the run options and derive ``sample_rate``, ``steps`` and ``delta``.

    ``q = B / N``; for epochs, ``T`` is :func:`dp_hf.plan.planned_steps`, the count DPTrainer takes.
    """
    dataset_size = None
    if args.dataset_size is not None:
        dataset_size = validation.check_positive_int("--dataset-size", args.dataset_size)

    if args.batch_size is not None:
        batch_size = validation.check_positive_int("--batch-size", args.batch_size)
        if dataset_size is None:
            raise ValueError("--batch-size needs --dataset-size (q = batch size / dataset size)")
        if batch_size > dataset_size:
            raise ValueError(
                f"--batch-size {batch_size!r} is larger than --dataset-size {dataset_size!r}; "
                "the expected batch size must be at most the dataset size"
            )
        sample_rate = batch_size / dataset_size
        epoch_steps = plan.steps_per_epoch(dataset_size=dataset_size, expected_batch_size=batch_size)
    else:
        sample_rate = validation.check_sample_rate(args.sample_rate, "--sample-rate")
        epoch_steps = plan.steps_per_epoch(sample_rate=sample_rate)

    if args.steps is not None:
        steps = validation.check_non_negative_int("--steps", args.steps)
    else:
        epochs = args.epochs
        if not (math.isfinite(epochs) and epochs > 0):
            raise ValueError(f"--epochs must be positive and finite, got {epochs!r}")
        steps = plan.planned_steps(epoch_steps, num_train_epochs=epochs)

    delta_is_default = args.delta is None
    if delta_is_default:
        if dataset_size is None:
            raise ValueError(
                "--delta is required unless --dataset-size is given (then it defaults to 1/(10 N), rounded down to one significant digit)"
            )
        delta = validation.default_delta(dataset_size)
        _note(
            f"--delta not given: using delta = {delta_text(delta)} (1/(10 N) rounded down, N = {dataset_size})"
        )
    else:
        delta = validation.check_delta(args.delta, "--delta")
        if dataset_size is not None:
            _report_warnings(validation.warn_if_delta_too_large, delta, dataset_size)

    return {
        "sample_rate": sample_rate,
        "steps": steps,
        "delta": delta,
        "delta_is_default": delta_is_default,
        "dataset_size": dataset_size,
        "batch_size": args.batch_size,
        "epochs": args.epochs,
    }


def _describe_run(args: argparse.Namespace, run: dict) -> str:
    """``(accountant pld; sigma ..., q = ... (= B/N), T = ... (= ceil(E * round(N / B))))``."""
    rate = f"q = {run['sample_rate']:.6g}"
    if args.batch_size is not None:
        rate += f" (= {args.batch_size}/{run['dataset_size']})"
    length = f"T = {run['steps']}"
    if args.epochs is not None:
        per_epoch = "round(N / B)" if args.batch_size is not None else "round(1 / q)"
        length += f" (= ceil({args.epochs:g} epochs * {per_epoch}), as DPTrainer counts them)"
    sigma = f"noise multiplier {args.noise_multiplier:g}, " if hasattr(args, "noise_multiplier") else ""
    return f"({args.accountant} accountant; {sigma}{rate}, {length})"


def _print_json(result: dict, accountant: str) -> None:
    """One JSON object; an infinite epsilon (sigma = 0: no privacy) is written as null."""
    result = {
        key: (None if isinstance(value, float) and math.isinf(value) else value)
        for key, value in result.items()
    }
    result.update(accountant=accountant, accounting_library=accounting.accounting_library_version(accountant))
    print(json.dumps(result, sort_keys=True))


def _fmt(epsilon: float) -> str:
    return "inf (no privacy: noise multiplier 0)" if math.isinf(epsilon) else significant(epsilon, 5)


def _note(message: str) -> None:
    print(f"{PROG}: note: {message}", file=sys.stderr)


def _report_warnings(function: Any, *args: Any) -> None:
    """Call ``function(*args)`` and print its warnings as ``dp-hf: warning: ...`` lines on stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        function(*args)
    for warning in caught:
        print(f"{PROG}: warning: {warning.message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
