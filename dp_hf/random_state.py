"""The global random generators a forward pass may draw from, kept and seeded together.

Probes and checks that run a model's forward outside training (the trainer's once-per-run probes, the
own-loop batch-dimension probe, the ranks' dataset comparison) must leave training's random streams as
they were, and two of their forwards must draw alike. Hugging Face models draw from torch (dropout), and
some from NumPy or Python's ``random`` (wav2vec2's SpecAugment spans, layer drops): all three are kept by
:func:`random_state_kept` and seeded by :func:`seed_every_generator`.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence

import numpy as np
import torch

__all__ = ["random_state_kept", "seed_every_generator"]


@contextlib.contextmanager
def random_state_kept(devices: Sequence[torch.device | int]) -> Iterator[None]:
    """Restore on exit torch's generators (CPU and ``devices``), NumPy's and Python's global ones."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def seed_every_generator(devices: Sequence[torch.device | int], seed: int) -> None:
    """Seed torch's CPU generator and those of ``devices``, NumPy's and Python's global generators with
    ``seed`` (inside :func:`random_state_kept`): two forwards of the same shapes then draw the same numbers,
    whichever library a model draws them from."""
    torch.random.default_generator.manual_seed(seed)
    for device in devices:
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
