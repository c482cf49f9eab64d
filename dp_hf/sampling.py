"""Poisson sampling of logical batches, split into bounded physical micro-batches.

The accounting of :mod:`dp_hf.accounting` assumes that every example joins each
logical batch independently with probability ``q`` (Poisson sampling). Shuffled
fixed-size batches, the usual ``DataLoader`` behaviour, do not give that
guarantee: their privacy is overstated by the Poisson accountant.

:class:`PoissonBatchSampler` is a ``batch_sampler`` for ``torch.utils.data.DataLoader``.
For each logical step it draws one Bernoulli(``q``) mask over the whole dataset
(identically on every data-parallel rank: the generator is seeded by
``(seed, epoch)``), gives rank ``r`` every ``world_size``-th selected index, and
yields that share as ``num_micro_batches`` consecutive index lists (possibly
empty). A logical batch is therefore always exactly ``num_micro_batches``
loader items, which is what the Hugging Face Trainer's gradient accumulation
expects; :func:`split_microbatch` bounds the memory of an unusually large draw,
as Opacus's ``BatchMemoryManager`` does.
"""

from __future__ import annotations

import secrets
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import Sampler

from dp_hf.distributed import agree_on_seed, world_size
from dp_hf.validation import check_positive_int, check_sample_rate

SHUFFLED_SAMPLING_WARNING = (
    "Training with shuffled fixed-size batches instead of Poisson sampling: the reported epsilon is computed "
    "for Poisson sampling and overstates the privacy of shuffled batches (Chua et al. 2024, 'How private are "
    "DP-SGD implementations?'). Keep poisson_sampling=True for a guarantee that holds."
)


def warn_shuffled_sampling() -> None:
    warnings.warn(SHUFFLED_SAMPLING_WARNING, UserWarning, stacklevel=3)


class PoissonBatchSampler(Sampler[list[int]]):
    """Poisson-sampled logical batches, as micro-batches of this rank's share.

    Args:
        dataset_size: ``N``.
        sample_rate: ``q``; the expected logical batch (all ranks) is ``q * N``.
        steps_per_epoch: logical steps per epoch; default ``round(1 / q)`` (each
            example is seen once per epoch in expectation).
        num_micro_batches: loader items per logical step (gradient accumulation steps).
        num_replicas, rank: data-parallel world size and this process's rank.
        seed: seed of the sampling generator, the same on every rank; ``None`` draws
            one from OS entropy (the batch composition must stay secret for the
            amplification by sampling), on rank 0 when ``num_replicas > 1``, shared
            with the other ranks through ``torch.distributed`` (so every rank must
            construct the sampler then).
    """

    def __init__(
        self,
        dataset_size: int,
        sample_rate: float,
        steps_per_epoch: int | None = None,
        num_micro_batches: int = 1,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int | None = None,
    ) -> None:
        self.dataset_size = check_positive_int("dataset_size", dataset_size)
        self.sample_rate = check_sample_rate(sample_rate)
        if steps_per_epoch is None:
            steps_per_epoch = max(1, round(1.0 / self.sample_rate))
        self.steps_per_epoch = check_positive_int("steps_per_epoch", steps_per_epoch)
        self.num_micro_batches = check_positive_int("num_micro_batches", num_micro_batches)
        self.num_replicas = check_positive_int("num_replicas", num_replicas)
        if not 0 <= rank < self.num_replicas:
            raise ValueError(f"rank must be in [0, {self.num_replicas}), got {rank!r}.")
        self.rank = rank
        self.seed = _sampling_seed(seed, self.num_replicas)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the draws of epoch ``epoch`` (the Trainer calls this before each epoch)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.steps_per_epoch * self.num_micro_batches

    def logical_batches(self) -> Iterator[torch.Tensor]:
        """All selected indices (every rank's) of each logical step of the current epoch."""
        generator = torch.Generator()
        generator.manual_seed((self.seed * 1_000_003 + self.epoch) % (2**63))
        for _ in range(self.steps_per_epoch):
            mask = torch.rand(self.dataset_size, generator=generator) < self.sample_rate
            yield mask.nonzero().squeeze(1)

    def __iter__(self) -> Iterator[list[int]]:
        for selected in self.logical_batches():
            share = selected[self.rank :: self.num_replicas]
            for chunk in torch.tensor_split(share, self.num_micro_batches):
                yield chunk.tolist()

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])


def _sampling_seed(seed: int | None, num_replicas: int) -> int:
    # Every rank must draw the same masks: only then is the union of the ranks' shares a Poisson
    # sample. A seed drawn from OS entropy on each rank would silently give each rank its own mask.
    if seed is not None:
        return int(seed)
    if num_replicas == 1:
        return secrets.randbits(62)
    if world_size() == num_replicas:
        return agree_on_seed(None, "the sampling seed")
    raise ValueError(
        f"num_replicas={num_replicas} but no torch.distributed process group of that size is initialized, so "
        "the replicas cannot share a seed drawn from OS entropy; pass the same secret seed= to every replica."
    )


def batch_size_of(batch: Mapping[str, Any]) -> int:
    """Number of examples in a collated batch (its first tensor's leading dimension)."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ValueError(f"cannot tell the batch size of a batch with keys {sorted(batch)}: no tensor in it.")


def split_microbatch(batch: Mapping[str, Any], max_size: int) -> list[dict[str, Any]]:
    """Split a collated batch into pieces of at most ``max_size`` examples (memory bound)."""
    size = batch_size_of(batch)
    if size <= max_size:
        return [dict(batch)]
    pieces = []
    for start in range(0, size, max_size):
        piece = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size:
                piece[key] = value[start : start + max_size]
            else:
                piece[key] = value
        pieces.append(piece)
    return pieces


class EmptyBatchCollator:
    """Wraps a collator so that an empty micro-batch becomes ``{}`` instead of an error.

    Empty micro-batches are normal under Poisson sampling; the logical step still
    happens (pure noise), so they must flow through the loader.
    """

    def __init__(self, collator) -> None:
        self.collator = collator

    def __call__(self, features: list) -> dict:
        if len(features) == 0:
            return {}
        return self.collator(features)


def _rows_match(row: torch.Tensor, single: torch.Tensor) -> bool:
    """``row`` (from a batch, maybe padded longer) holds ``single`` right- or left-aligned."""
    if row.shape == single.shape:
        return torch.equal(row, single)
    if row.dim() != single.dim() or any(r < s for r, s in zip(row.shape, single.shape)):
        return False
    head = row[tuple(slice(0, s) for s in single.shape)]
    tail = row[tuple(slice(r - s, r) for r, s in zip(row.shape, single.shape))]
    return torch.equal(head, single) or torch.equal(tail, single)


def check_collator_is_per_example(collator, features: list) -> None:
    """Refuse a collator whose output row for one example depends on the other examples.

    Per-example clipping bounds one example's influence only if its inputs and labels are its
    own: a collator that normalizes by batch statistics or mixes examples (mixup, cutmix)
    breaks the guarantee. Probe: collate the examples together and one by one, and compare
    each row (right- or left-padded). Random collators (masked-LM masking) cannot be probed
    this way and are skipped, as are collators that fail on the probe.
    """
    if len(features) < 2:
        return
    rng_state = torch.get_rng_state()
    try:
        torch.manual_seed(0)
        joint = collator(features)
        torch.manual_seed(0)
        if not _same_batch(joint, collator(features)):
            return  # random collator: a different draw per call, nothing to compare
        for index, feature in enumerate(features):
            torch.manual_seed(0)
            single = collator([feature])
            for key, value in single.items():
                other = joint.get(key) if isinstance(joint, Mapping) else None
                if (
                    not isinstance(value, torch.Tensor)
                    or not isinstance(other, torch.Tensor)
                    or value.dim() == 0
                ):
                    continue
                if not _rows_match(other[index], value[0]):
                    raise ValueError(
                        f"the data collator {type(collator).__name__} mixes examples: field {key!r} of example "
                        f"{index} differs when it is collated with other examples. Per-example clipping then "
                        "does not bound one example's influence. Use a collator that only pads/stacks (and do "
                        "batch-level augmentation such as mixup without DP, or per example)."
                    )
    except ValueError:
        raise
    except Exception:  # noqa: BLE001 - a collator that cannot be probed on these examples is not refused
        return
    finally:
        torch.set_rng_state(rng_state)


def _same_batch(a, b) -> bool:
    if not isinstance(a, Mapping) or not isinstance(b, Mapping) or a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or not torch.equal(x, y):
                return False
    return True
