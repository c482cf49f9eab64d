"""Private training without the Trainer: the demo's ViT on the digits, in a plain PyTorch loop.

What :class:`dp_hf.DPTrainer` does for you, written out with dp_hf's pieces:

1. plan: the sampling rate ``q = B / N``, the step count, and the noise multiplier calibrated so that
   those Poisson-sampled steps spend ``target_epsilon`` (:mod:`dp_hf.plan`, :mod:`dp_hf.accounting`);
2. per-example gradient hooks on the model (:func:`dp_hf.per_example.attach_grad_sample`);
3. Poisson batches from a secret seed (:class:`dp_hf.sampling.PoissonBatchSampler`; ``set_epoch``
   before every epoch), empty ones included: an empty batch still takes its step, noise alone, or its
   emptiness would show. :class:`dp_hf.loader.PoissonDataLoader` tells the optimizer which Poisson step
   each micro-batch belongs to (``--micro_batches``: a step in several loader items);
4. the loss differentiated is the SUM of per-example losses. Never the batch mean (``model(...).loss``):
   dividing by the realized batch size lets one example change every other example's gradient;
5. ``optimizer.step()`` clips; after a Poisson step's last micro-batch it adds the noise once, divides by
   the *expected* batch and updates, and the accountant bound to the loader counts the step;
   ``budget_guard`` refuses a step past the budget;
6. a checkpoint holds the model, the optimizer (its noise generator and DP step count), the accountant
   and the sampler (the next step it has not drawn): a resumed run continues as if it never stopped
   (with loader workers, steps they drew ahead and were never trained are skipped, never replayed).

Usage (from the repository root)::

    python -m recipes.own_loop                                # 15 epochs, epsilon 8, ~10-20 s on a CPU
    python -m recipes.own_loop --max_steps 40 --checkpoint /tmp/own_loop.pt    # stop and save
    python -m recipes.own_loop --resume /tmp/own_loop.pt                       # go on to the end
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from dp_hf.accounting import PrivacyAccountant, calibrate_noise_multiplier, steps_within_budget
from dp_hf.accounting.display import epsilon_up
from dp_hf.loader import PoissonDataLoader
from dp_hf.losses import per_example_loss
from dp_hf.optim import create_dp_optimizer
from dp_hf.per_example import attach_grad_sample
from dp_hf.plan import planned_steps, steps_per_epoch
from dp_hf.sampling import PoissonBatchSampler
from recipes.demo import DemoArguments, build_model, digits_splits


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp_optimizer", default="dp-adamw")
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--expected_batch_size", type=int, default=256)
    parser.add_argument("--micro_batches", type=int, default=1, help="loader items per Poisson step (memory)")
    parser.add_argument("--num_train_epochs", type=int, default=15)
    parser.add_argument("--per_sample_max_grad_norm", type=float, default=1.0)
    parser.add_argument("--target_epsilon", type=float, default=8.0)
    parser.add_argument("--target_delta", type=float, default=1e-5)
    parser.add_argument("--max_steps", type=int, default=None, help="stop (and save) after this many steps")
    parser.add_argument("--checkpoint", default=None, help="where to save the run's state when it stops")
    parser.add_argument("--resume", default=None, help="a --checkpoint file to go on from")
    # Secret by default (OS entropy, and saved in checkpoints only); set them only to reproduce a run.
    parser.add_argument("--sampling_seed", type=int, default=None)
    parser.add_argument("--noise_seed", type=int, default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(1)  # fastest for this tiny model on a shared CPU (see recipes.demo)
    torch.manual_seed(0)  # the initial weights (public)
    train_set, test_set = digits_splits(test_fraction=0.2, seed=0)

    # 1. The plan, fixed before training.
    n = len(train_set)
    sample_rate = args.expected_batch_size / n
    epoch_steps = steps_per_epoch(dataset_size=n, expected_batch_size=args.expected_batch_size)
    total_steps = planned_steps(epoch_steps, num_train_epochs=args.num_train_epochs)
    sigma = calibrate_noise_multiplier(args.target_epsilon, args.target_delta, sample_rate, total_steps)

    # 2-3. Hooks, optimizer, accountant, sampler.
    model = build_model(DemoArguments()).train()
    hooks = attach_grad_sample(model)
    optimizer = create_dp_optimizer(
        args.dp_optimizer,
        model.parameters(),
        lr=args.learning_rate,
        noise_multiplier=sigma,
        max_grad_norm=args.per_sample_max_grad_norm,
        expected_batch_size=args.expected_batch_size,
        noise_seed=args.noise_seed,
    )
    accountant = PrivacyAccountant("pld")
    sampler = PoissonBatchSampler(
        n,
        sample_rate,
        steps_per_epoch=epoch_steps,
        num_micro_batches=args.micro_batches,
        seed=args.sampling_seed,
    )
    if args.resume:  # 6. everything that a step changes
        state = torch.load(args.resume, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        accountant.load_state_dict(state["accountant"])
        sampler.load_state_dict(state["sampler"])
    # The optimizer learns the Poisson step of each micro-batch (it releases after the step's last one and
    # refuses a batch of another step while one is unreleased); the accountant counts each release.
    loader = PoissonDataLoader(train_set, sampler, optimizer, accountant=accountant)
    # The most steps within the budget: those taken (the accountant's history), then steps of (sigma, q).
    budget_steps = steps_within_budget(
        args.target_epsilon,
        args.target_delta,
        sample_rate,
        sigma,
        history=accountant.history,
        guess=total_steps,
    )
    if budget_steps <= accountant.steps:
        raise SystemExit(
            f"the privacy budget (epsilon {args.target_epsilon}) is spent: {accountant.steps} steps taken, "
            f"epsilon {epsilon_up(accountant.get_epsilon(args.target_delta), 3):.3f}; not one more step fits."
        )
    optimizer.budget_guard = lambda: accountant.steps < budget_steps  # step() refuses a step past it

    stop_at = min(total_steps, args.max_steps or total_steps, budget_steps)
    for epoch in range(sampler.epoch, args.num_train_epochs):
        if accountant.steps >= stop_at:
            break
        sampler.set_epoch(epoch)
        for batch in loader:
            if batch:  # 4. one loss per example, summed
                logits = model(pixel_values=batch["pixel_values"]).logits
                per_example_loss(logits, batch["labels"], "single_label_classification").sum().backward()
            optimizer.step()  # 5. clip; after a step's last micro-batch: noise once, / expected batch, update
            optimizer.zero_grad()
            if accountant.steps >= stop_at:
                break  # before the loader draws another batch: the checkpoint resumes at the next step
    if args.checkpoint:
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "accountant": accountant.state_dict(),
            "sampler": sampler.state_dict(),
        }
        torch.save(state, args.checkpoint)  # holds the seeds: keep it as secret as the data

    hooks.disable_hooks()
    model.eval()
    with torch.no_grad():
        test = default_collate(list(test_set))
        accuracy = float(
            (model(pixel_values=test["pixel_values"]).logits.argmax(-1) == test["labels"]).float().mean()
        )
    epsilon = accountant.get_epsilon(args.target_delta) if accountant.steps else 0.0
    summary = {
        "steps": accountant.steps,
        "planned_steps": total_steps,
        "noise_multiplier": sigma,
        "sample_rate": sample_rate,
        "epsilon": epsilon,
        "delta": args.target_delta,
        "test_accuracy": accuracy,
        "parameters": torch.cat([p.detach().flatten() for p in model.parameters()]),
    }
    print(
        f"own loop ({args.dp_optimizer}): {accountant.steps}/{total_steps} steps, test accuracy {accuracy:.4f}, "
        f"epsilon {epsilon_up(epsilon, 3):.3f} (target {args.target_epsilon}, delta {args.target_delta:g}, sigma {sigma:.4f}) "
        f"in {time.perf_counter() - start:.0f} s",
        flush=True,
    )
    assert math.isfinite(epsilon) and epsilon <= args.target_epsilon + 1e-9
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
