"""Data-parallel DP training: what every rank must agree on, and what is refused.

Under ``accelerate launch`` (or ``torchrun``) with several processes, one
logical DP step is spread over the ranks:

* **Sampling.** Every rank draws the *same* Bernoulli(``q``) mask over the whole
  dataset and takes every ``world_size``-th selected index
  (:class:`dp_hf.sampling.PoissonBatchSampler`), so the union of the ranks'
  shares is one Poisson sample and the accounting is the single-process one.
  That needs one sampling seed on all ranks: :func:`agree_on_seed` draws it on
  rank 0 and shares it (a seed drawn from OS entropy on each rank would give
  every rank its own mask, and the union would not be a Poisson sample).
* **Clipping and noise.** Each rank clips its own examples; the
  :class:`~dp_hf.privatizer.Privatizer` all-reduces the clipped sums, and rank 0
  alone adds the noise, before the reduction, so it enters once. Every rank then
  holds the same ``gtilde`` and, the update rules being deterministic, ends each
  step with the same parameters and optimizer state.
* **No DDP gradient reduction.** DDP all-reduces the *unclipped* gradients in
  backward, and runs collectives inside ``forward`` (buffer broadcast) that a
  rank with an empty Poisson micro-batch would never enter. DP code calls the
  module inside the DDP wrapper (:func:`unwrap_ddp`): DDP then never expects its
  gradient hooks, so nothing is reduced but the privatizer's clipped sum, and
  ``p.grad`` (unclipped) is discarded by the optimizer anyway. The wrapper's
  construction still broadcasts rank 0's initial parameters.
* **Sharded training** (FSDP, DeepSpeed, Megatron-LM) is refused
  (:func:`check_data_parallel_only`): those engines reduce, shard and step
  gradients themselves, bypassing per-example clipping.

Using a DP optimizer outside :class:`dp_hf.DPTrainer` under data parallelism::

    model.to(accelerator.device)                      # first: the noise is drawn on the parameters' device
    optimizer = DPAdamW(model.parameters(), ...)
    attach_grad_sample(model)                         # per-example gradient hooks, before prepare
    model, optimizer = accelerator.prepare(model, optimizer)
    for indices in sampler:                           # PoissonBatchSampler(..., num_replicas, rank, seed)
        if indices:                                   # an empty share still takes part in step()
            losses = per_example_losses(unwrap_ddp(model), indices)
            losses.sum().backward()
        optimizer.step()                              # every rank, once per logical step
        optimizer.zero_grad()

Every rank must call ``optimizer.step()`` the same number of times: the
all-reduce happens there. Every rank must also start from the same parameters:
``accelerator.prepare`` (DDP) broadcasts rank 0's; without it, build the model
identically on every rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dp_hf.random_state import random_state_kept, seed_every_generator

__all__ = [
    "agree_on_seed",
    "check_data_parallel_only",
    "check_launched_processes_joined",
    "check_same_dataset",
    "check_same_plan",
    "check_same_progress",
    "check_same_setting",
    "dataset_digest",
    "flat_parameters",
    "is_distributed",
    "rank",
    "unwrap_ddp",
    "world_size",
]

# accelerate's DistributedType values that DP training cannot run under, and why.
_UNSUPPORTED = {
    "FSDP": (
        "FSDP shards the parameters and reduce-scatters the summed gradients itself, so per-example gradients "
        "cannot be clipped"
    ),
    "DEEPSPEED": (
        "DeepSpeed reduces, (optionally) shards and steps the summed gradients itself, bypassing per-example "
        "clipping and the DP optimizer"
    ),
    "MEGATRON_LM": (
        "Megatron-LM splits the model across ranks and reduces the summed gradients itself, bypassing "
        "per-example clipping"
    ),
}
# The environment variables `accelerate launch` sets from an accelerate config file.
_ENV_FLAGS = {
    "ACCELERATE_USE_FSDP": "FSDP",
    "ACCELERATE_USE_DEEPSPEED": "DEEPSPEED",
    "ACCELERATE_USE_MEGATRON_LM": "MEGATRON_LM",
}


def is_distributed() -> bool:
    """True when a ``torch.distributed`` process group of more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Number of ranks of the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def agree_on_seed(seed: int | None, name: str = "seed") -> int:
    """One seed held identically by every rank.

    ``seed=None`` draws a fresh seed from OS entropy on rank 0 and gives it to
    every rank; a given seed is checked to be the same on every rank (a seed
    that depends on the rank, e.g. ``seed + rank``, would give each rank its own
    Poisson mask). Without a process group of more than one rank this is just
    ``seed`` or a fresh draw. Collective: every rank must call it.

    Raises:
        ValueError: on every rank, when the ranks were given different seeds.
    """
    candidate = secrets.randbits(62)
    local = None if seed is None else int(seed)
    if not is_distributed():
        return candidate if local is None else local
    # One all_gather serves both cases: everyone sees every given seed (to check that they agree)
    # and rank 0's candidate (to share when none was given). Every rank decides the same way, so an
    # error is raised on all ranks together instead of leaving some waiting in a later collective.
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (local, candidate))
    given = [entry[0] for entry in gathered]
    if any(value != given[0] for value in given):
        raise ValueError(
            f"{name} differs across the {len(given)} ranks ({given}): every rank must draw the same Poisson "
            f"mask, so pass the same {name} on every rank (or None, to share one drawn on rank 0)."
        )
    return gathered[0][1] if given[0] is None else given[0]


def check_same_setting(name: str, value: Any) -> None:
    """Refuse, on every rank, a setting that differs between ranks (collective: every rank calls it).

    For a setting that decides which collectives a rank runs next (``disable_dp`` skips the dataset and
    plan comparisons): compared first, so that all ranks refuse instead of some waiting in a collective
    the others never join (one rank with ``disable_dp=True`` hung its peer).
    """
    if not is_distributed():
        return
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    if any(other != gathered[0] for other in gathered):
        values = ", ".join(f"rank {index}: {other!r}" for index, other in enumerate(gathered))
        raise ValueError(
            f"{name} differs across the {len(gathered)} ranks ({values}): launch every process with the same "
            "arguments."
        )


#: Rows of the training set compared across ranks: spread evenly, and drawn at random.
SPREAD_ROWS, RANDOM_ROWS = 16, 240


def dataset_digest(dataset: Any, seed: int | None = None) -> str:
    """SHA-256 of :data:`SPREAD_ROWS` rows of ``dataset`` spread evenly from the first to the last and
    :data:`RANDOM_ROWS` drawn with ``seed`` (a secret one: which rows are read is not known), read under one
    random state (random transforms read alike, training's streams untouched). Raises what reading raises."""
    size = len(dataset)
    indices = {(k * (size - 1)) // (SPREAD_ROWS - 1) for k in range(SPREAD_ROWS)} if size else set()
    if size and seed is not None:
        generator = torch.Generator().manual_seed(seed % 2**63)
        indices.update(torch.randint(0, size, (RANDOM_ROWS,), generator=generator).tolist())
    digest = hashlib.sha256()
    with _same_random_state():  # random transforms (set_transform crops) read alike on every rank
        for index in sorted(indices):
            _digest_value(digest, dataset[index])
    return digest.hexdigest()


def check_same_dataset(dataset: Any, seed: int | None = None) -> None:
    """Refuse, on every rank, training sets that differ between ranks (collective: every rank calls it).

    The sampler draws one Poisson mask over indices ``0..N-1`` and splits it between ranks, so index
    ``i`` must be the same example everywhere: a dataset shuffled with a rank-dependent seed trains
    one example on two ranks in a step (2C of influence), and a per-rank shard is accounted with the
    wrong ``N``. Compared: ``N`` and a digest of :data:`SPREAD_ROWS` rows spread evenly from the first
    to the last, plus :data:`RANDOM_ROWS` drawn with ``seed`` (the same on every rank: pass the agreed
    sampling seed, so that which rows are compared changes from run to run). A permutation that moves
    a fraction f of the rows is then missed with probability about ``(1 - f) ** 256`` (f = 2%: 0.6%).
    A rank that cannot read its rows says so to the others, so that all refuse together instead of
    waiting in the collective.
    """
    if not is_distributed() or dataset is None or not hasattr(dataset, "__len__"):
        return
    size = len(dataset)
    digest, failure = None, None
    try:
        digest = dataset_digest(dataset, seed)
    except Exception as error:  # noqa: BLE001 - every rank must reach the collective below
        failure = f"{type(error).__name__}: {error}"
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (size, digest, failure))
    failed = [f"rank {rank}: {entry[2]}" for rank, entry in enumerate(gathered) if entry[2] is not None]
    if failed:
        raise RuntimeError(
            "reading training rows to compare the dataset across ranks failed on "
            + "; ".join(failed)
            + ". Every rank must be able to read every row of the same dataset."
        )
    if any(entry != gathered[0] for entry in gathered):
        sizes = [entry[0] for entry in gathered]
        raise ValueError(
            f"the training dataset differs across the {len(gathered)} ranks (sizes {sizes}; "
            f"{'same' if len(set(sizes)) == 1 else 'different'} sizes, rows differ). Every rank must hold the same "
            "dataset in the same order: DPTrainer's sampler splits each Poisson batch between the ranks. Do not "
            "shard it or shuffle it per rank."
        )


def check_same_plan(fields: Mapping[str, Any] | None, failure: BaseException | None = None) -> None:
    """Refuse, on every rank, privacy settings that differ between ranks (collective: every rank calls it).

    ``fields`` are this rank's settings that the mechanism depends on (batch, q, sigma, C, optimizer,
    steps, accountant, delta); they must be equal on every rank. With 2 examples per device on one rank
    and 4 on another, examples were trained on both ranks or on neither; with C = 0.01 on rank 0 and 1
    on rank 1, one example moved the released update 91.6 times rank 0's bound. ``failure``: this rank
    could not make its plan (it passes ``None`` fields); the others refuse too instead of waiting in a
    later collective, and the caller re-raises its own error. Secrets (seeds) must not be in ``fields``.
    """
    if not is_distributed():
        return
    local = None if fields is None else {name: _comparable(value) for name, value in fields.items()}
    reason = None if failure is None else f"{type(failure).__name__}: {failure}"
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (local, reason))
    failed = [f"rank {rank}: {entry[1]}" for rank, entry in enumerate(gathered) if entry[1] is not None]
    if failed:
        if failure is not None:
            return  # the caller raises its own error
        raise RuntimeError("the privacy plan could not be made on " + "; ".join(failed) + ".")
    details = _differences([entry[0] for entry in gathered])
    if details:
        raise ValueError(
            f"the privacy settings differ across the {len(gathered)} ranks: {details}. One DP step is one Poisson "
            "sample split between the ranks, clipped to one C and noised once for one sigma, and the accountant "
            "counts that mechanism: launch every process with the same arguments (the same script, command "
            "line and config; no per-rank batch sizes or clip norms)."
        )


def check_same_progress(fields: Mapping[str, Any]) -> None:
    """Refuse, on every rank, ranks that are at different points of one run (collective: every rank calls it).

    Each release all-reduces the ranks' shares of one Poisson step. A rank that resumed from another
    checkpoint than its peers (or started afresh while they resumed) sums its share of one step with
    their shares of another: an example in both counts twice in one release, the steps before the
    checkpoint are trained again, and the ranks' accountants disagree (an audit: steps 3 and 0 released
    together, 6 vs 3 steps counted). ``fields``: this rank's position (steps counted, optimizer step,
    Trainer step, resuming, a digest of the secret sampling seed; no secret itself).
    """
    if not is_distributed():
        return
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {name: _comparable(value) for name, value in fields.items()})
    details = _differences(gathered)
    if details:
        raise ValueError(
            f"the ranks are at different points of the run: {details}. Each DP step sums every rank's share of one "
            "Poisson sample, so a rank that resumed from another checkpoint (or started afresh while the others "
            "resumed) would mix two steps' samples in one release and train steps again that were already "
            "counted. Resume every rank from the same checkpoint (pass the same resume_from_checkpoint on every "
            "process, on storage every node reads), or start every rank afresh."
        )


def _differences(per_rank: list[Mapping[str, Any]]) -> str:
    """``"name (rank 0: a, rank 1: b); ..."`` for the fields whose values differ between ranks ("" if none)."""
    names = list(dict.fromkeys(name for fields in per_rank for name in fields))
    differing = [
        name for name in names if any(fields.get(name) != per_rank[0].get(name) for fields in per_rank)
    ]
    return "; ".join(
        f"{name} ("
        + ", ".join(f"rank {rank}: {fields.get(name)!r}" for rank, fields in enumerate(per_rank))
        + ")"
        for name in differing
    )


def _comparable(value: Any) -> Any:
    """``value`` as plain data that pickles and compares alike on every rank (``repr`` for anything else)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(key): _comparable(item) for key, item in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_comparable(item) for item in value]
    return repr(value)


@contextlib.contextmanager
def _same_random_state() -> Iterator[None]:
    """Seed torch's, numpy's and Python's generators alike on every rank, and restore them afterwards.

    A dataset with a random on-the-fly transform (``set_transform`` with random crops) then gives every
    rank the same rows, and reading them leaves the training's random streams as they were.
    """
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with random_state_kept(cuda):
        seed_every_generator(cuda, 0)
        yield


def _digest_value(digest: Any, value: Any) -> None:
    """Add ``value``'s content to ``digest``: the same on every rank for the same data (``repr`` of an image
    or an arbitrary object holds its memory address), different for different data."""
    if isinstance(value, Mapping):
        for key in sorted(value, key=str):
            digest.update(repr(key).encode())
            _digest_value(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__}{len(value)}".encode())
        for item in value:
            _digest_value(digest, item)
    elif isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif hasattr(value, "tobytes") and callable(value.tobytes):  # numpy arrays, PIL images
        digest.update(f"{type(value).__name__}{getattr(value, 'shape', getattr(value, 'size', ''))}".encode())
        digest.update(value.tobytes())
    else:
        digest.update(repr(value).encode())


def check_launched_processes_joined(trainer_world_size: int) -> None:
    """Refuse a process that a multi-process launcher started but that trains alone.

    ``torchrun`` (and ``accelerate launch`` through it) sets ``WORLD_SIZE`` for every process it starts.
    If the Trainer then sees a world of one (on a machine without GPUs, accelerate's multi-GPU launcher
    without ``use_cpu``), every process runs its own training with its own Poisson masks and noise, and
    each model's privacy claim ignores the others, which saw the same data.
    """
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1 and trainer_world_size == 1:
        raise ValueError(
            f"this process was launched as one of WORLD_SIZE={launched} processes, but the Trainer sees a world "
            "of 1 process (no process group): each process would train its own model on the same data, and "
            "each privacy claim would ignore the others. On a machine without GPUs, set use_cpu=True in the "
            "training arguments or ACCELERATE_USE_CPU=true in the environment (see "
            "recipes/accelerate_configs/cpu_2proc.yaml); or launch a single process."
        )


def trainer_model(trainer: Any) -> nn.Module:
    """A Trainer's model without accelerate's wrappers (DDP, compilation)."""
    accelerator = getattr(trainer, "accelerator", None)
    return accelerator.unwrap_model(trainer.model) if accelerator is not None else trainer.model


def unwrap_ddp(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (any other module unchanged).

    DP forward/backward passes go through this module so that DDP never all-reduces
    unclipped gradients and never runs a collective inside ``forward`` (see the
    module docstring).
    """
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module
    return model


def check_data_parallel_only(distributed_type: Any = None) -> None:
    """Refuse sharded/engine-managed training: FSDP, DeepSpeed, Megatron-LM.

    Args:
        distributed_type: accelerate's ``DistributedType`` (or its string value),
            e.g. ``trainer.accelerator.distributed_type``. The ``ACCELERATE_USE_*``
            environment variables that ``accelerate launch`` sets from a config
            file are checked as well, so the error comes before accelerate or the
            Trainer act on them.

    Raises:
        ValueError: naming the engine, why DP cannot run under it, and what to use.
    """
    requested = []
    if distributed_type is not None:
        requested.append(
            (str(getattr(distributed_type, "value", distributed_type)).upper(), "accelerate state")
        )
    for variable, engine in _ENV_FLAGS.items():
        if os.environ.get(variable, "false").strip().lower() in ("1", "true", "yes", "y", "on"):
            requested.append((engine, f"{variable}=true (accelerate config)"))
    for engine, source in requested:
        if engine in _UNSUPPORTED:
            raise ValueError(
                f"{engine} is not supported by dp_hf (requested by {source}): {_UNSUPPORTED[engine]}. Use plain "
                "data parallelism instead: an accelerate config with distributed_type: MULTI_GPU (e.g. "
                "recipes/accelerate_configs/multi_gpu.yaml), or torchrun."
            )


def flat_parameters(module: nn.Module) -> torch.Tensor:
    """All parameters of ``module`` as one detached float32 CPU vector (for cross-rank checks)."""
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in module.parameters()])
