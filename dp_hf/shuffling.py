"""Shuffled batches (``poisson_sampling=False``) in an order drawn from the secret sampling seed.

The Trainer's own shuffle is a function of public values: its ``RandomSampler`` draws from torch's
global generator, which the Trainer seeds with ``args.seed``, and accelerate replaces it with a
``SeedableRandomSampler`` seeded by ``args.data_seed`` (else that same initial seed) plus the epoch.
Both seeds are in the logged training arguments. Anyone who reads them can recompute which examples
share every step. Then shuffling amplifies nothing, and the privacy of an example is that of the
unsampled Gaussian mechanism at each of its steps, far weaker than the (already optimistic) epsilon
reported for shuffled batches.

:class:`SecretShuffleSampler` draws each epoch's permutation from the secret sampling seed (the one
the Poisson sampler uses: OS entropy by default, the same on every rank) and the epoch. It is not a
``RandomSampler`` on purpose: accelerate would swap a ``RandomSampler`` for its own, publicly seeded one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch.utils.data import Sampler

from dp_hf.sampling import mix_seed
from dp_hf.validation import check_positive_int

__all__ = ["SecretShuffleSampler"]


class SecretShuffleSampler(Sampler[int]):
    """A uniformly random permutation of ``range(dataset_size)`` per epoch, from ``(seed, epoch)``.

    The Trainer (through accelerate's loader) calls :meth:`set_epoch` before each epoch; every rank
    holding the same ``seed`` iterates the same permutation, which accelerate then shards. Its state
    (seed, epoch) is saved in checkpoints, so that a resumed run skips exactly the batches it trained.
    """

    def __init__(self, dataset_size: int, seed: int) -> None:
        self.dataset_size = check_positive_int("dataset_size", dataset_size)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.dataset_size

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch))
        yield from torch.randperm(self.dataset_size, generator=generator).tolist()

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
