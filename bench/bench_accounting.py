"""Privacy accounting speed: epsilon every step, noise calibration, and huge budgets.

Prints three markdown tables for one implementation of ``dp_hf.accounting`` (this checkout's, or an
older one given with ``--module-file``, e.g. ``git show HEAD~1:dp_hf/accounting.py > /tmp/old.py``),
so that before/after runs can be compared line by line:

1. ``PrivacyAccountant.get_epsilon(1e-5)`` after each ``step(sigma=1, q=0.01)`` for ``T = 1..200``
   (what ``DPTrainer`` would do to show epsilon in the progress bar): first call, median / p90 / max
   of the later ones, total.
2. ``calibrate_noise_multiplier`` at several ``(epsilon, delta, q, T)`` (PLD accountant), each from
   cold caches (fastest of ``--repeats`` runs): sigma (full precision, to compare implementations)
   and wall time; then the budget
   stop that ``DPTrainer.__init__`` computes next (largest total steps within the budget, the
   planned ``T`` tried first): together, the accounting part of the trainer's construction.
3. ``DPTrainer(...)`` construction (tiny BERT, data made in the process) at the same settings, each in a
   fresh process, with ``target_epsilon``, ``target_delta``, the batch and dataset size giving ``q`` and
   ``max_steps = T``: the first construction in the process (what a user's script waits for, lazy
   imports included) and a second one (caches cleared), with the plan's sigma and the time to import
   ``dp_hf`` before it.
4. ``dp-hf noise --target-epsilon E --sample-rate 0.01 --steps 1000 --delta 1e-5`` (PLD) for huge
   ``E`` (and ``E = 1`` for the baseline), each in a fresh process under a memory cap (``RLIMIT_AS``, ``--memory-cap-gib``) and a
   timeout: outcome, wall time and peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss`` of that
   process).

Times are wall-clock seconds (``time.perf_counter``) of one run on a shared machine: treat them as
indicative (see bench/RESULTS.md). Example::

    python bench/bench_accounting.py
    git show HEAD:dp_hf/accounting.py > /tmp/accounting_before.py
    python bench/bench_accounting.py --module-file /tmp/accounting_before.py
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from types import ModuleType

# (target_epsilon, delta, sample_rate, steps): ordinary settings (1 <= epsilon <= 10, q in [1e-3, 0.2],
# T <= 1e5, delta 1e-5..1e-3) including the slow corners (small q and T with epsilon = 10: small sigma).
CALIBRATION_SETTINGS = [
    (1.0, 1e-5, 256 / 60000, 1171),  # MNIST, B = 256, 5 epochs
    (1.0, 1e-5, 0.01, 200),
    (3.0, 1e-4, 0.01, 10_000),
    (8.0, 1e-5, 0.01, 1000),
    (1.0, 1e-5, 1e-3, 100_000),
    (10.0, 1e-5, 1e-3, 1000),
    (10.0, 1e-3, 1e-3, 10),
    (1.0, 1e-5, 0.2, 1000),
    (10.0, 1e-3, 0.2, 100_000),
]
# (expected batch, dataset size) giving each setting's q exactly, for the construction table
CONSTRUCTION_DATA = {256 / 60000: (256, 60000), 0.01: (10, 1000), 1e-3: (10, 10000), 0.2: (20, 100)}
HUGE_EPSILONS = [1.0, 1000.0, 1e6]  # 1: an ordinary run, for the process's baseline time and RSS


def load_accounting(module_file: str | None) -> ModuleType:
    """``dp_hf.accounting``, or the module in ``module_file`` installed under that name."""
    import dp_hf  # noqa: F401  (the package, so that the replacement is found as its submodule)

    if module_file is None:
        import dp_hf.accounting as accounting

        return accounting
    spec = importlib.util.spec_from_file_location("dp_hf.accounting", module_file)
    accounting = importlib.util.module_from_spec(spec)
    sys.modules["dp_hf.accounting"] = accounting
    spec.loader.exec_module(accounting)
    return accounting


def clear_caches(accounting: ModuleType) -> None:
    # The package and its submodules (dp_hf.accounting.pld caches one-step PLDs, .epsilon whole
    # histories): clearing only the package's own names left those warm between "cold" repeats.
    modules = [accounting] + [
        module
        for name, module in list(sys.modules.items())
        if module is not None and name.startswith(accounting.__name__ + ".")
    ]
    for module in modules:
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


def epsilon_every_step(accounting: ModuleType, steps: int) -> dict:
    clear_caches(accounting)
    accountant = accounting.PrivacyAccountant("pld")
    times = []
    for _ in range(steps):
        accountant.step(1.0, 0.01)
        start = time.perf_counter()
        epsilon = accountant.get_epsilon(1e-5)
        times.append(time.perf_counter() - start)
    later = sorted(times[1:])
    return {
        "steps": steps,
        "first_s": times[0],
        "median_s": statistics.median(later),
        "p90_s": later[int(0.9 * (len(later) - 1))],
        "max_s": later[-1],
        "total_s": sum(times),
        "epsilon": epsilon,
    }


def budget_steps(
    accounting: ModuleType, target: float, delta: float, q: float, sigma: float, planned: int
) -> int:
    """What ``DPTrainer._steps_within_budget`` computes right after calibrating (no steps taken yet)."""
    if "guess" in inspect.signature(accounting.steps_within_budget).parameters:
        return accounting.steps_within_budget(target, delta, q, sigma, history=[], guess=planned)

    def within(total: int) -> bool:  # the trainer's own search, as it was
        return accounting.compute_epsilon(q, sigma, total, delta) <= target

    low = 0
    if not within(1):
        return 0
    if within(planned) and not within(planned + 1):
        return planned
    high = planned
    while within(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if within(mid) else (low, mid)
    return low


def calibration_row(accounting: ModuleType, setting: tuple, repeats: int) -> dict:
    """Fastest of ``repeats`` cold runs (all give the same numbers)."""
    target, delta, q, steps = setting
    calibrate_s = total_s = math.inf
    for _ in range(repeats):
        clear_caches(accounting)
        start = time.perf_counter()
        sigma = accounting.calibrate_noise_multiplier(target, delta, q, steps)
        calibrate_s = min(calibrate_s, time.perf_counter() - start)
        budget = budget_steps(accounting, target, delta, q, sigma, steps)
        total_s = min(total_s, time.perf_counter() - start)
    return {
        "target_epsilon": target,
        "delta": delta,
        "sample_rate": q,
        "steps": steps,
        "sigma": sigma,
        "calibrate_s": calibrate_s,
        "budget_steps": budget,
        "with_budget_s": total_s,
    }


def run_noise_child(args: argparse.Namespace) -> None:
    """Child process: ``dp-hf noise`` with the chosen accounting module; prints one JSON line."""
    cap = int(args.memory_cap_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    load_accounting(args.module_file)
    from dp_hf.cli import main

    argv = ["noise", "--target-epsilon", repr(args.child_noise), "--sample-rate", "0.01", "--steps", "1000"]
    argv += ["--delta", "1e-5", "--json"]
    start = time.perf_counter()
    outcome = "?"
    try:
        main(argv)
        outcome = "answered"
    except SystemExit as err:
        outcome = "refused (usage error)" if err.code == 2 else f"exit {err.code}"
    except MemoryError:
        outcome = f"MemoryError at the {args.memory_cap_gib:g} GiB cap"
    seconds = time.perf_counter() - start
    maxrss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"outcome": outcome, "seconds": seconds, "maxrss_mib": maxrss_mib}), flush=True)


def noise_row(args: argparse.Namespace, epsilon: float) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child-noise", repr(epsilon)]
    command += ["--memory-cap-gib", str(args.memory_cap_gib)]
    if args.module_file:
        command += ["--module-file", args.module_file]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.noise_timeout)
    except subprocess.TimeoutExpired:
        return {
            "epsilon": epsilon,
            "outcome": f"killed after the {args.noise_timeout} s timeout",
            "seconds": None,
        }
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    row = {"epsilon": epsilon, "outcome": f"crashed (status {done.returncode})", "seconds": None}
    if lines:
        row.update(json.loads(lines[-1]))
        answer = [json.loads(line) for line in lines[:-1] if "noise_multiplier" in line]
        if answer:
            row["outcome"] = (
                f"sigma = {answer[0]['noise_multiplier']:.4f}, epsilon = {answer[0]['epsilon']:.6g}"
            )
    elif done.returncode < 0:
        row["outcome"] = f"killed by signal {-done.returncode} (memory cap {args.memory_cap_gib:g} GiB?)"
    stderr = [line for line in done.stderr.splitlines() if "error:" in line]
    if stderr:
        row["message"] = stderr[-1].split("error:", 1)[1].strip()
    row.setdefault("seconds", time.perf_counter() - start)
    return row


def run_construction_child(setting: str) -> None:
    """Child process: import dp_hf, then construct a DPTrainer twice; prints one JSON line."""
    start = time.perf_counter()
    import datasets
    from transformers import BertConfig, BertForSequenceClassification

    from dp_hf import DPTrainer, DPTrainingArguments

    import_s = time.perf_counter() - start
    target, delta, q, steps = json.loads(setting)
    batch, size = CONSTRUCTION_DATA[q]
    data = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * size, "labels": [0] * size})
    config = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    seconds, sigma = [], None
    for _ in range(2):
        clear_caches(load_accounting(None))
        model = BertForSequenceClassification(config)
        args = DPTrainingArguments(
            output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench_accounting_construction"),
            per_device_train_batch_size=batch,
            max_steps=steps,
            target_epsilon=target,
            target_delta=delta,
            per_sample_max_grad_norm=1.0,
            report_to=[],
        )
        begin = time.perf_counter()
        trainer = DPTrainer(model=model, args=args, train_dataset=data)
        seconds.append(time.perf_counter() - begin)
        plan = trainer.plan
        assert (plan.sample_rate, plan.planned_steps) == (q, steps), (plan.sample_rate, plan.planned_steps)
        sigma = plan.noise_multiplier
    print(json.dumps({"import_s": import_s, "first_s": seconds[0], "second_s": seconds[1], "sigma": sigma}))


def construction_row(setting: tuple) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child-construction", json.dumps(setting)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"construction child failed for {setting}:\n{done.stderr[-3000:]}")
    return dict(zip(("target_epsilon", "delta", "sample_rate", "steps"), setting)) | json.loads(lines[-1])


def fmt(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "n/a"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--module-file", help="an accounting.py to load as dp_hf.accounting (default: this one)"
    )
    parser.add_argument("--steps", type=int, default=200, help="epsilon-every-step run length (default 200)")
    parser.add_argument("--repeats", type=int, default=1, help="calibrations: fastest of this many cold runs")
    parser.add_argument("--noise-timeout", type=int, default=600, help="seconds per dp-hf noise run")
    parser.add_argument("--memory-cap-gib", type=float, default=8.0, help="RLIMIT_AS of dp-hf noise runs")
    parser.add_argument(
        "--skip", default="", help="comma-separated parts to skip: steps,calibrate,construction,noise"
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--child-noise", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--child-construction", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_noise is not None:
        run_noise_child(args)
        return
    if args.child_construction is not None:
        run_construction_child(args.child_construction)
        return

    accounting = load_accounting(args.module_file)
    skip = set(filter(None, args.skip.split(",")))
    import dp_accounting  # noqa: F401
    import numpy
    import scipy

    label = args.module_file or "dp_hf/accounting.py (this checkout)"
    print(f"# accounting module: {label}")
    print(
        f"# {platform.machine()} {platform.processor() or ''} python {platform.python_version()} "
        f"numpy {numpy.__version__} scipy {scipy.__version__} {accounting.accounting_library_version()} "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} loadavg {os.getloadavg()[0]:.2f}"
    )
    results: dict = {"module": label}

    if "steps" not in skip:
        row = epsilon_every_step(accounting, args.steps)
        results["epsilon_every_step"] = row
        print(f"\n## get_epsilon(1e-5) after each step(sigma=1, q=0.01), T = 1..{args.steps}\n")
        print("| first call | median | p90 | max | total | epsilon at T |")
        print("|---|---|---|---|---|---|")
        print(
            f"| {fmt(row['first_s'])} | {fmt(row['median_s'])} | {fmt(row['p90_s'])} | {fmt(row['max_s'])} "
            f"| {fmt(row['total_s'])} | {row['epsilon']:.6f} |",
            flush=True,
        )

    if "calibrate" not in skip:
        print(
            f"\n## calibrate_noise_multiplier (pld), then the trainer's budget stop (best of {args.repeats})\n"
        )
        print("| epsilon | delta | q | T | sigma | calibrate | + budget steps | budget steps |")
        print("|---|---|---|---|---|---|---|---|")
        rows = []
        for setting in CALIBRATION_SETTINGS:
            row = calibration_row(accounting, setting, args.repeats)
            rows.append(row)
            print(
                f"| {row['target_epsilon']:g} | {row['delta']:g} | {row['sample_rate']:.6g} | {row['steps']} "
                f"| {row['sigma']!r} | {fmt(row['calibrate_s'])} | {fmt(row['with_budget_s'])} "
                f"| {row['budget_steps']} |",
                flush=True,
            )
        results["calibration"] = rows

    if "construction" not in skip:
        print(
            "\n## DPTrainer construction (tiny BERT; target_epsilon, max_steps = T), each in a fresh process\n"
        )
        print("| epsilon | delta | q | T | sigma | import dp_hf | first construction | second |")
        print("|---|---|---|---|---|---|---|---|")
        rows = []
        for setting in CALIBRATION_SETTINGS:
            row = construction_row(setting)
            rows.append(row)
            print(
                f"| {row['target_epsilon']:g} | {row['delta']:g} | {row['sample_rate']:.6g} | {row['steps']} "
                f"| {row['sigma']!r} | {fmt(row['import_s'])} | {fmt(row['first_s'])} | {fmt(row['second_s'])} |",
                flush=True,
            )
        results["construction"] = rows

    if "noise" not in skip:
        print(
            f"\n## dp-hf noise --target-epsilon E --sample-rate 0.01 --steps 1000 --delta 1e-5 (pld; "
            f"memory cap {args.memory_cap_gib:g} GiB, timeout {args.noise_timeout} s)\n"
        )
        print("| E | outcome | wall time | peak RSS |")
        print("|---|---|---|---|")
        rows = []
        for epsilon in HUGE_EPSILONS:
            row = noise_row(args, epsilon)
            rows.append(row)
            rss = f"{row['maxrss_mib']:.0f} MiB" if "maxrss_mib" in row else "n/a"
            print(f"| {epsilon:g} | {row['outcome']} | {fmt(row['seconds'])} | {rss} |", flush=True)
        for row in rows:
            if "message" in row:
                print(f"\nE = {row['epsilon']:g}: {row['message']}")
        results["noise"] = rows

    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
