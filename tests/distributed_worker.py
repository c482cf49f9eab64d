"""One rank of the 2-process data-parallel runs of tests/test_distributed.py.

Launched by the tests (never collected by pytest: the file name does not start with ``test_``)::

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed_worker.py optimizers OUT
    ACCELERATE_USE_CPU=true accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml \\
        tests/distributed_worker.py trainer OUT

Every rank writes its results under ``OUT`` (files suffixed with the rank) and the pytest process
compares them with each other and with single-process references computed by the same functions
(:func:`train_plain_loop`, :func:`trainer_args`) in the pytest process. Each scenario asserts first
that it really runs as 2 ranks of one process group: accelerate can silently start one process, or
two independent ones.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tiny_models, when run as a script

from tiny_models import TINY_SEQ_LEN, TINY_VOCAB_SIZE, tiny_bert_classifier  # noqa: E402

from dp_hf.distributed import check_same_dataset, flat_parameters, unwrap_ddp  # noqa: E402
from dp_hf.grad_sample import attach_grad_sample  # noqa: E402
from dp_hf.losses import infer_task, per_example_loss  # noqa: E402
from dp_hf.optim import create_dp_optimizer  # noqa: E402
from dp_hf.sampling import STEP_TAG_KEY, PoissonBatchSampler  # noqa: E402

WORLD_SIZE = 2
COLLECTIVE_TIMEOUT = timedelta(seconds=120)

# ----------------------------------------------------------------------------- plain optimizer loop
# Optimizers whose 2-process runs must match the 1-process run; their rule hyperparameters (small
# blocks and window for DP-MicroAdam so that its top-k, quantized error feedback and ring window
# are all exercised on tiny tensors).
PLAIN_OPTIMIZERS: dict[str, dict[str, Any]] = {
    "dp-adamw": dict(lr=1e-2, weight_decay=0.05, max_grad_norm=1.0),
    "dp-macadam": dict(lr=1e-2, h1=1e-9, h2=1e-5),
    "dp-microadam": dict(
        lr=1e-2, weight_decay=0.05, density=0.1, window=3, block_size=16, quant_block=24, max_grad_norm=1.0
    ),
}
PLAIN_N = 64
PLAIN_EXPECTED_BATCH = 6
PLAIN_STEPS = 8
# A seed whose logical batches include a step where rank 1's share is empty and one where both
# shares are (the test checks that it does, with the sampler's own draws).
PLAIN_SAMPLING_SEED = 368  # logical batches of sizes [7, 6, 0, 7, 1, 2, 9, 3]
PLAIN_NOISE = 1.0


def token_data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids whose label is carried by the token range (as in test_trainer)."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=generator)
    half = TINY_VOCAB_SIZE // 2
    ids = torch.randint(1, half, (n, TINY_SEQ_LEN), generator=generator) + (half - 1) * labels.view(-1, 1)
    return ids, labels


def plain_sampler(world_size: int = 1, rank: int = 0, num_micro_batches: int = 1) -> PoissonBatchSampler:
    return PoissonBatchSampler(
        dataset_size=PLAIN_N,
        sample_rate=PLAIN_EXPECTED_BATCH / PLAIN_N,
        steps_per_epoch=PLAIN_STEPS,
        num_micro_batches=num_micro_batches,
        num_replicas=world_size,
        rank=rank,
        seed=PLAIN_SAMPLING_SEED,
    )


def tensor_digest(tensor: torch.Tensor) -> str:
    """Bit-exact fingerprint of a tensor (its dtype, shape and bytes)."""
    data = tensor.detach().cpu().contiguous()
    header = f"{data.dtype}{tuple(data.shape)}".encode()
    return hashlib.sha256(header + data.view(torch.uint8).numpy().tobytes()).hexdigest()


def optimizer_state_tensors(optimizer) -> dict[str, torch.Tensor]:
    """Per-parameter state tensors by ``"<param index>.<key>"`` (the DP noise generator left out:
    only rank 0 draws noise, so its generator state legitimately differs)."""
    state = optimizer.state_dict()["state"]
    return {
        f"{index}.{key}": value.detach().cpu().clone()
        for index, entries in state.items()
        if index != "dp"
        for key, value in entries.items()
        if isinstance(value, torch.Tensor)
    }


def rank_micro_batches(world_size: int, rank: int, num_micro_batches: int) -> list[list[list[int]]]:
    """Per logical step, this rank's micro-batches, as the Poisson sampler gives them."""
    pieces = list(iter(plain_sampler(world_size, rank, num_micro_batches)))
    return [pieces[i : i + num_micro_batches] for i in range(0, len(pieces), num_micro_batches)]


def emulated_rank_micro_batches(world_size: int) -> list[list[list[int]]]:
    """Per logical step, on ONE process, the whole logical batch as ``world_size`` micro-batches:
    rank r's share ``selected[r::world_size]`` in rank order.

    Accumulating these computes ``S_0 + S_1``, the very float operations of the 2-rank all-reduce of
    the ranks' clipped sums ``S_r`` (each computed over the same examples in the same order), so the
    1-process run is bit-identical to the 2-process one. Any other split of the same logical batch
    changes only the float rounding of the sum; but DP-MicroAdam's 4-bit rounding and top-k and
    Adam's division by ``sqrt(v)`` turn such last-bit differences into visible ones.
    """
    return [
        [selected[r::world_size].tolist() for r in range(world_size)]
        for selected in plain_sampler().logical_batches()
    ]


def train_plain_loop(
    name: str,
    noise_multiplier: float,
    micro_batches: list[list[list[int]]],
    accelerator=None,
) -> dict[str, Any]:
    """Train tiny BERT with a DP optimizer used directly (attach_grad_sample, no Trainer).

    ``micro_batches[t]``: the index lists this process clips at logical step ``t`` (possibly
    empty), each clipped right after its backward pass; then ``step()``, on every rank, even with
    nothing to clip. With ``accelerator`` the model and optimizer are prepared by it (DDP wrapper,
    accelerate's optimizer wrapper), as a user script under ``accelerate launch`` would.
    """
    model = tiny_bert_classifier(seed=0, num_labels=2)
    attach_grad_sample(model)
    task = infer_task(model)
    kwargs = dict(PLAIN_OPTIMIZERS[name])
    optimizer = create_dp_optimizer(
        name,
        model.parameters(),
        noise_multiplier=noise_multiplier,
        expected_batch_size=PLAIN_EXPECTED_BATCH,
        noise_seed=1234,
        **kwargs,
    )
    dp_optimizer = optimizer
    if accelerator is not None:
        model, optimizer = accelerator.prepare(model, optimizer)
    ids, labels = token_data(PLAIN_N)
    step_digests = []
    for step_micro_batches in micro_batches:
        for indices in step_micro_batches:
            if not indices:  # an empty share: nothing to clip, but this rank still joins step()
                continue
            # The module inside DDP: DDP must never all-reduce the unclipped gradients.
            logits = unwrap_ddp(model)(input_ids=ids[indices]).logits
            per_example_loss(logits, labels[indices], task, model).sum().backward()
            dp_optimizer.clip_and_accumulate()
        optimizer.step()
        optimizer.zero_grad()
        step_digests.append(tensor_digest(flat_parameters(unwrap_ddp(model))))
    return {
        "params": {n: p.detach().cpu().clone() for n, p in unwrap_ddp(model).named_parameters()},
        "state": optimizer_state_tensors(dp_optimizer),
        "step_digests": step_digests,
        "dp_steps": dp_optimizer.dp_step,
    }


NOISE_SIGMA = 2.0
NOISE_CLIP = 0.5
NOISE_EXPECTED_BATCH = 4
NOISE_STEPS = 4


def measure_noise(rank: int) -> dict[str, Any]:
    """The privatized gradient's noise: std of ``p.grad`` after ``step()`` over many coordinates.

    Steps alternate between no data at all (zero clipped sum: ``p.grad`` is pure noise) and a
    little data per rank (clipped sum of norm <= count * C spread over 2^17 coordinates, negligible
    against noise of std sigma * C per coordinate). Expected: ``sigma * C / B``, whatever the
    number of ranks.
    """
    torch.manual_seed(0)
    layer = torch.nn.Linear(512, 256, bias=False)
    attach_grad_sample(layer)
    optimizer = create_dp_optimizer(
        "dp-sgd",
        layer.parameters(),
        lr=0.0,
        noise_multiplier=NOISE_SIGMA,
        max_grad_norm=NOISE_CLIP,
        expected_batch_size=NOISE_EXPECTED_BATCH,
    )
    inputs = torch.randn(4, 512, generator=torch.Generator().manual_seed(rank))
    grads, digests = [], []
    for step in range(NOISE_STEPS):
        if step % 2 == 1:
            layer(inputs).sum(dim=1).sum().backward()
        optimizer.step()
        grads.append(layer.weight.grad.detach().clone())
        digests.append(tensor_digest(layer.weight.grad))
        optimizer.zero_grad()
    return {"std": torch.stack(grads).std().item(), "grad_digests": digests}


def run_optimizers(out: Path) -> None:
    """All plain-loop scenarios on this rank, under an accelerate-prepared DDP model."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    # A collective left unmatched fails after COLLECTIVE_TIMEOUT instead of hanging the test.
    accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=COLLECTIVE_TIMEOUT)])
    world_size, rank = accelerator.num_processes, accelerator.process_index
    assert dist.is_initialized() and dist.get_world_size() == WORLD_SIZE == world_size, (
        f"expected one process group of {WORLD_SIZE} ranks, got num_processes={world_size}, "
        f"initialized={dist.is_initialized()}"
    )
    results: dict[str, Any] = {"world_size": world_size, "rank": rank}
    for name in PLAIN_OPTIMIZERS:
        # Noise 0: this rank's share in one piece (see emulated_rank_micro_batches for why).
        exact = rank_micro_batches(world_size, rank, num_micro_batches=1)
        results[f"{name}/exact"] = train_plain_loop(name, 0.0, exact, accelerator=accelerator)
        # With noise: two micro-batches per rank per step, each clipped after its backward pass.
        noisy = rank_micro_batches(world_size, rank, num_micro_batches=2)
        results[f"{name}/noisy"] = train_plain_loop(name, PLAIN_NOISE, noisy, accelerator=accelerator)
    results["noise"] = measure_noise(rank)
    results["mixed_steps"] = release_mixed_steps(rank)
    torch.save(results, out / f"optimizers_rank{rank}.pt")


def release_mixed_steps(rank: int) -> dict[str, Any]:
    """Optimizers at different DP steps on the two ranks (rank 0's restored to step 3 from a checkpoint that
    rank 1 never loaded): their release would sum two Poisson steps' shares. Refused on both ranks alike,
    before the update."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4, bias=False)
    attach_grad_sample(layer)
    optimizer = create_dp_optimizer(
        "dp-sgd", layer.parameters(), lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4
    )
    optimizer.state["dp"]["step"] = 3 if rank == 0 else 0
    before = layer.weight.detach().clone()
    layer(torch.randn(2, 8)).sum().backward()
    error = _error_of(optimizer.step)
    return {"error": error, "unchanged": bool(torch.equal(before, layer.weight))}


# ----------------------------------------------------------------------------- DPTrainer
TRAINER_N = 64


def trainer_dataset(n: int = TRAINER_N):
    import datasets

    ids, labels = token_data(n, seed=1)
    return datasets.Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": [[1] * TINY_SEQ_LEN] * n, "labels": labels.tolist()}
    )


def image_dataset(n: int = 8):
    """Rows with a decoded ``PIL.Image`` (a ``datasets.Image`` column), as image datasets load."""
    import datasets
    import numpy as np

    pixels = np.random.default_rng(0).integers(0, 256, (n, 4, 4, 3), dtype=np.uint8)
    return datasets.Dataset.from_dict({"img": list(pixels), "label": list(range(n))}).cast_column(
        "img", datasets.Image()
    )


def trainer_args(output_dir: str, **overrides):
    """DPTrainingArguments shared by the 2-process runs and their 1-process references."""
    from dp_hf import DPTrainingArguments

    defaults = dict(
        output_dir=output_dir,
        learning_rate=1e-2,
        per_sample_max_grad_norm=1.0,
        logging_steps=2,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_timeout=int(COLLECTIVE_TIMEOUT.total_seconds()),
    )
    defaults.update(overrides)
    return DPTrainingArguments(**defaults)


# The equality run (noise 0, fixed sampling seed): the per-rank batch halves the 1-process one, so
# the expected logical batch (8 of 64) is the same. Seed 33 gives logical batches of sizes
# [4, 7, 3, 12, 5, 12, 6, 11 | 8, 1] (the epoch ends after 8): at the third step rank 1 has one
# empty micro-batch, at the tenth nothing at all. Token counting is on: the Trainer gathers the
# count over ranks after every micro-batch, empty ones included.
EXACT_RUN = dict(
    gradient_accumulation_steps=2,
    max_steps=10,
    noise_multiplier=0.0,
    sampling_seed=33,
    # DP-SGD: a rule linear in gtilde keeps the float rounding of a differently ordered clipped sum
    # at rounding level (the adaptive rules are compared bit for bit by the plain-loop runs).
    dp_optimizer="dp-sgd",
    learning_rate=0.1,
    dp_optimizer_kwargs={"momentum": 0.9},
    include_num_input_tokens_seen="all",
    # Per-example gradients formed layer by layer (the private run uses ghost clipping; the plain
    # loop covers Opacus's hooks).
    per_sample_gradient_mode="materialize",
)
EXACT_PER_DEVICE_2PROC = 2
# The private run: calibrated noise, sampling and noise seeds from OS entropy (the sampling seed
# must be shared by rank 0), one example per physical micro-batch so that empty micro-batches are
# common, and token counting on (a gather over ranks after every micro-batch).
PRIVATE_RUN = dict(
    gradient_accumulation_steps=2,
    max_steps=8,
    target_epsilon=4.0,
    accountant="rdp",
    dp_optimizer="dp-microadam",
    dp_optimizer_kwargs={"density": 0.1, "window": 3, "block_size": 16, "quant_block": 24},
    include_num_input_tokens_seen="all",
    per_sample_gradient_mode="ghost",
)
PRIVATE_PER_DEVICE_2PROC = 1


def _trainer_class():
    from transformers import TrainerCallback

    from dp_hf import DPTrainer

    class DigestCallback(TrainerCallback):
        """Fingerprints the parameters after every optimizer step."""

        def __init__(self) -> None:
            self.trainer = None
            self.digests: list[str] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.digests.append(tensor_digest(flat_parameters(self.trainer.model)))

    class CountingDPTrainer(DPTrainer):
        """Counts this rank's empty and non-empty micro-batches."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.micro_batches = {"empty": 0, "non_empty": 0}
            self.trained_indices: list[int] = []
            self.digest_callback = DigestCallback()
            self.digest_callback.trainer = self
            self.add_callback(self.digest_callback)

        def training_step(self, model, inputs, num_items_in_batch=None):
            examples = [key for key in inputs if key != STEP_TAG_KEY]  # the step tag travels with every batch
            self.micro_batches["empty" if not examples else "non_empty"] += 1
            if "idx" in inputs:  # a dataset with its example indices: record them, keep them from the model
                self.trained_indices.extend(inputs.pop("idx").tolist())
            return super().training_step(model, inputs, num_items_in_batch)

    return CountingDPTrainer


def run_trainer(out: Path) -> None:
    """DPTrainer end to end on 2 ranks: the noise-0 run and the private run."""
    trainer_cls = _trainer_class()
    data = trainer_dataset()
    results: dict[str, Any] = {}
    for label, run, per_device in (
        ("exact", EXACT_RUN, EXACT_PER_DEVICE_2PROC),
        ("private", PRIVATE_RUN, PRIVATE_PER_DEVICE_2PROC),
    ):
        args = trainer_args(str(out / label), per_device_train_batch_size=per_device, **run)
        trainer = trainer_cls(model=tiny_bert_classifier(seed=0, num_labels=2), args=args, train_dataset=data)
        assert (
            args.world_size == WORLD_SIZE and dist.is_initialized() and dist.get_world_size() == WORLD_SIZE
        ), f"expected one process group of {WORLD_SIZE} ranks, got args.world_size={args.world_size}"
        rank = args.process_index
        trainer.train()
        epsilon, delta = trainer.privacy_spent()
        results[label] = {
            "world_size": args.world_size,
            "rank": rank,
            "ddp_wrapped": type(trainer.model_wrapped).__name__,
            "per_sample_gradient_mode": trainer.per_sample_gradient_mode,
            "global_step": trainer.state.global_step,
            "accountant_steps": trainer.accountant.steps,
            "optimizer_steps": trainer.dp_optimizer.dp_step,
            "epsilon": epsilon,
            "delta": delta,
            "noise_multiplier": trainer.noise_multiplier,
            "sample_rate": trainer.sample_rate,
            "expected_batch_size": args.expected_batch_size,
            "sampling_seed": trainer.sampler.seed,
            "micro_batches": trainer.micro_batches,
            "num_input_tokens_seen": trainer.state.num_input_tokens_seen,
            "step_digests": trainer.digest_callback.digests,
            "logged_epsilons": [e["epsilon"] for e in trainer.state.log_history if "epsilon" in e],
        }
        params = {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}
        torch.save(params, out / f"trainer_{label}_params_rank{rank}.pt")
    results["agreement"] = run_agreement(out, trainer_cls)
    results["plan_agreement"] = run_plan_agreement(out, trainer_cls)
    results["progress_agreement"] = run_progress_agreement(out, trainer_cls)
    with open(out / f"trainer_rank{rank}.json", "w") as handle:
        json.dump(results, handle, indent=1)


def _error_of(build) -> str | None:
    try:
        build()
    except (ValueError, RuntimeError) as error:
        return str(error)
    return None


class _Unreadable(torch.utils.data.Dataset):
    """``rows``, except that reading the last row fails when ``broken``."""

    def __init__(self, rows, broken: bool):
        self.rows, self.broken = rows, broken

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        if self.broken and index == len(self.rows) - 1:
            raise OSError("shard file missing")
        return self.rows[index]


def run_agreement(out: Path, trainer_cls) -> dict[str, Any]:
    """What the ranks must share: the dataset, and an epoch of shuffled batches without repeats."""
    rank, data = dist.get_rank(), trainer_dataset()
    private = dict(per_device_train_batch_size=2, max_steps=1, noise_multiplier=1.0)
    found: dict[str, Any] = {}
    for label, dataset in (
        ("rank_shuffled", data.shuffle(seed=rank)),
        ("rank_shard", data.shard(WORLD_SIZE, rank)),
    ):
        args = trainer_args(str(out / label), **private)
        found[label] = _error_of(
            lambda a=args, d=dataset: trainer_cls(model=tiny_bert_classifier(), args=a, train_dataset=d)
        )
    # Rank 1 permutes every row but the evenly spread ones, which alone were compared: the randomly
    # drawn rows (the agreed sampling seed picks them) must catch it.
    spread = {(k * (len(data) - 1)) // 15 for k in range(16)}
    moved = [i for i in range(len(data)) if i not in spread]
    order = [
        i if i in spread or rank == 0 else moved[len(moved) - 1 - moved.index(i)] for i in range(len(data))
    ]
    args = trainer_args(str(out / "spread_rows_kept"), **private)
    found["spread_rows_kept"] = _error_of(
        lambda: trainer_cls(model=tiny_bert_classifier(), args=args, train_dataset=data.select(order))
    )
    # A row that only rank 1 cannot read: both ranks must refuse (not rank 0 wait in the collective).
    args = trainer_args(str(out / "rank_unreadable"), **private)
    found["rank_unreadable"] = _error_of(
        lambda: trainer_cls(
            model=tiny_bert_classifier(), args=args, train_dataset=_Unreadable(data, rank == 1)
        )
    )
    # Rank 1 reorders its rows in place after the trainer was built (which compared them): train() compares
    # them again before the first step (an audit trained two examples on both ranks: 2.00x the bound).
    rows = _Unreadable(list(data), broken=False)
    args = trainer_args(str(out / "reordered_after_init"), **private)
    trainer = trainer_cls(model=tiny_bert_classifier(), args=args, train_dataset=rows)
    if rank == 1:
        rows.rows.reverse()
    found["reordered_after_init"] = _error_of(trainer.train)
    # A random on-the-fly transform (the DeiT recipe's crops), with the ranks' random streams apart: the rows
    # are read under one seed on every rank, and reading them leaves the random state as it was.
    torch.manual_seed(100 + rank)
    noisy = data.with_transform(lambda batch: {**batch, "noise": torch.rand(len(batch["labels"])).tolist()})
    before = torch.get_rng_state()
    found["random_transform"] = _error_of(lambda: check_same_dataset(noisy, seed=5))
    found["random_state_kept"] = bool(torch.equal(before, torch.get_rng_state()))
    # The same image dataset on both ranks is the same: the digest read PIL images' reprs (their addresses).
    found["same_images"] = _error_of(lambda: check_same_dataset(image_dataset()))
    # 68 examples in batches of 4 on 2 ranks: accelerate would complete the last batches with the epoch's
    # first examples (trained twice) unless the remainder is dropped.
    indexed = trainer_dataset(68).map(lambda _, i: {"idx": i}, with_indices=True)
    shuffled = dict(
        poisson_sampling=False,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        noise_multiplier=1.0,
        remove_unused_columns=False,
    )
    args = trainer_args(str(out / "shuffled"), **shuffled)
    found["shuffled"] = _error_of(
        lambda: trainer_cls(model=tiny_bert_classifier(), args=args, train_dataset=indexed)
    )
    trainer = trainer_cls(
        model=tiny_bert_classifier(),
        args=trainer_args(str(out / "shuffled_drop_last"), dataloader_drop_last=True, **shuffled),
        train_dataset=indexed,
    )
    trainer.train()
    found["shuffled_drop_last"] = {
        "trained_indices": trainer.trained_indices,
        "planned_steps": trainer.planned_steps,
        "global_step": trainer.state.global_step,
    }
    return found


def run_plan_agreement(out: Path, trainer_cls) -> dict[str, Any]:
    """Privacy settings that differ between ranks, and a hand-built optimizer that does not reduce over them."""
    rank, data = dist.get_rank(), trainer_dataset()
    base = dict(per_device_train_batch_size=2, max_steps=1, noise_multiplier=1.0)
    per_rank = {
        # 2 vs 4 examples per device: examples trained on both ranks or neither in a step.
        "batch": dict(per_device_train_batch_size=2 if rank == 0 else 4),
        # C = 0.01 on rank 0, 1 on rank 1: one example moved rank 0's update 91.6x its bound.
        "clip": dict(per_sample_max_grad_norm=0.01 if rank == 0 else 1.0),
        # The same target, another delta: sigma differs only after calibration.
        "calibrated": dict(
            noise_multiplier=None,
            target_epsilon=4.0,
            accountant="rdp",
            target_delta=1e-3 if rank == 0 else 1e-4,
        ),
        # DP off on rank 1 only: it skipped the dataset and plan comparisons, and rank 0 waited in them.
        "disable_dp": dict(disable_dp=rank == 1),
        # Only rank 1's plan fails (its batch exceeds the dataset): rank 0 must refuse too, not wait.
        "rank_fails": dict(per_device_train_batch_size=2 if rank == 0 else 64),
    }
    found: dict[str, Any] = {}
    for label, overrides in per_rank.items():
        args = trainer_args(str(out / f"plan_{label}"), **{**base, **overrides})
        found[label] = _error_of(
            lambda a=args: trainer_cls(model=tiny_bert_classifier(), args=a, train_dataset=data)
        )
    # Rank 1 froze a tensor that rank 0 trains: the flat all-reduce would sum mismatched coordinates.
    model = tiny_bert_classifier()
    if rank == 1:
        model.classifier.bias.requires_grad_(False)
    args = trainer_args(str(out / "plan_trainable"), **base)
    found["trainable"] = _error_of(lambda: trainer_cls(model=model, args=args, train_dataset=data))
    # A DP optimizer built by hand with distributed=False: each rank would release its own share, with
    # its own noise, and no all-reduce. It matches sigma and B, so only the new check refuses it.
    model = tiny_bert_classifier()
    args = trainer_args(str(out / "plan_local_optimizer"), **base)
    optimizer = create_dp_optimizer(
        "dp-sgd",
        [p for p in model.parameters() if p.requires_grad],
        lr=0.1,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=args.expected_batch_size,
        distributed=False,
    )
    trainer = trainer_cls(model=model, args=args, train_dataset=data, optimizers=(optimizer, None))
    found["local_optimizer"] = _error_of(trainer.train)
    found["local_optimizer_steps"] = optimizer.dp_step
    return found


def run_progress_agreement(out: Path, trainer_cls) -> dict[str, Any]:
    """Ranks resuming from different points: rank 0 from a checkpoint, rank 1 afresh (an audit: rank 0's share
    of step 3 and rank 1's of step 0 were released together, and steps 0-2 trained again on rank 1)."""
    rank, data = dist.get_rank(), trainer_dataset()
    args = trainer_args(
        str(out / "progress"),
        per_device_train_batch_size=2,
        max_steps=4,
        noise_multiplier=1.0,
        sampling_seed=7,
        noise_seed=8,
        save_strategy="steps",
        save_steps=2,
    )
    trainer_cls(model=tiny_bert_classifier(), args=args, train_dataset=data).train()
    checkpoint = str(out / "progress" / "checkpoint-2")
    mixed = trainer_cls(model=tiny_bert_classifier(), args=args, train_dataset=data)
    found: dict[str, Any] = {
        "mixed_resume": _error_of(
            lambda: mixed.train(resume_from_checkpoint=checkpoint if rank == 0 else None)
        ),
        "mixed_resume_steps": mixed.accountant.steps,
    }
    # Every rank from the same checkpoint: allowed, and it takes the two remaining steps.
    same = trainer_cls(model=tiny_bert_classifier(), args=args, train_dataset=data)
    found["same_resume"] = _error_of(lambda: same.train(resume_from_checkpoint=checkpoint))
    found["same_resume_steps"] = same.accountant.steps
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=("optimizers", "trainer"))
    parser.add_argument("out", type=Path)
    options = parser.parse_args(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # two ranks share the CI machine's cores
    if options.scenario == "optimizers":
        run_optimizers(options.out)
    else:
        run_trainer(options.out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
