"""Secret randomness of a DP run: the seeds kept out of the arguments that trackers read, and the global
random generators reseeded from a secret when DP training starts.

**Seeds.** ``noise_seed`` and ``sampling_seed`` let anyone who knows them regenerate the noise or the
batches. :class:`SecretSeedsMixin` keeps them out of every serialized form of the arguments, and when a
trainer takes the arguments (:meth:`SecretSeedsMixin.hide_secret_seeds`) it moves them out of the
object's fields altogether: the fields then hold a placeholder (``"<NOISE_SEED>"``), and the values sit
in a table of this module keyed by the arguments object, which is neither a dataclass field nor in its
``__dict__``. Experiment trackers read the arguments in many ways (``to_dict``, ``to_sanitized_dict``,
ClearML's ``getattr`` over ``dataclasses.fields``, ``vars``); none of them finds the seeds. The trainer
reads them with :meth:`SecretSeedsMixin.secret_seed`.

**Global generators.** The Trainer seeds torch, numpy and ``random`` with the public ``args.seed``, and
dropout masks (and a collator's random masking) are drawn from them by row position: with the seed
known, replacing one example changes every other example's mask in a way the adversary can compute,
beyond the clip bound. :func:`reseed_global_generators` reseeds them from a secret when DP training
starts, and :func:`seed_worker` gives each loader worker a full 64-bit secret seed (transformers'
``seed_worker`` keeps 32 bits).
"""

from __future__ import annotations

import hashlib
import random
import weakref
from typing import Any

import numpy as np
import torch

__all__ = ["SecretSeedsMixin", "derive_seed", "reseed_global_generators", "seed_worker"]

#: id(arguments) -> {field: value} of the seeds moved out of that arguments object (dropped with it).
_HIDDEN: dict[int, dict[str, Any]] = {}


def _placeholder(name: str) -> str:
    return f"<{name.upper()}>"


class SecretSeedsMixin:
    """Keeps the secret seeds of a ``TrainingArguments`` subclass out of everything it serializes.

    Known seeds let anyone regenerate the noise or the batches, which voids the guarantee. They never
    leave the process: pickles (``training_args.bin``, uploaded by ``push_to_hub``) drop them, and every
    text form (``to_dict`` / ``to_json_string`` / ``to_sanitized_dict``, which TensorBoard, W&B, MLflow...
    log when ``report_to`` is set; ``str`` and ``repr``) shows a placeholder. Once a trainer took the
    arguments (:meth:`hide_secret_seeds`), the fields themselves hold the placeholder.
    """

    SECRET_FIELDS = ("noise_seed", "sampling_seed")

    def hide_secret_seeds(self) -> None:
        """Move the secret seeds out of the fields, which then hold a placeholder (``"<NOISE_SEED>"``).

        Called by a DP trainer when it takes the arguments, before any callback reads them. The values
        stay readable with :meth:`secret_seed` (for another trainer built with the same arguments too);
        a seed assigned to the field later replaces the hidden one at the next call.
        """
        for name in self.SECRET_FIELDS:
            value = getattr(self, name)
            if value == _placeholder(name):
                self.secret_seed(name)  # refused here when these arguments never held the seed
            if value is None or value == _placeholder(name):
                continue
            if id(self) not in _HIDDEN:
                _HIDDEN[id(self)] = {}
                weakref.finalize(self, _HIDDEN.pop, id(self), None)
            _HIDDEN[id(self)][name] = value
            setattr(self, name, _placeholder(name))

    def secret_seed(self, name: str) -> Any:
        """The value of the secret seed ``name`` (``None`` when not fixed), hidden or not."""
        value = getattr(self, name)
        if value != _placeholder(name):
            return value
        hidden = _HIDDEN.get(id(self), {})
        if name not in hidden:
            raise ValueError(
                f"{name}={value!r} is the placeholder that hides a secret seed, but these arguments never held "
                f"the seed (they were copied or rebuilt from a serialized form). Set {name} to the seed, or "
                "to None for a fresh one from OS entropy."
            )
        return hidden[name]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for secret in ("hub_token", *self.SECRET_FIELDS):
            if state.get(secret) is not None:
                state[secret] = None
        return state

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        for secret in self.SECRET_FIELDS:
            if d.get(secret) is not None:
                d[secret] = _placeholder(secret)
        return d

    def __str__(self) -> str:
        # TrainingArguments.__str__ lists dataclasses.asdict(self), seeds included.
        text = super().__str__()
        for secret in self.SECRET_FIELDS:
            value = getattr(self, secret)
            if value is not None:
                text = text.replace(f"\n{secret}={value!r},", f"\n{secret}={_placeholder(secret)},")
        return text

    __repr__ = __str__


def derive_seed(secret: int, *labels: Any, bits: int = 64) -> int:
    """A ``bits``-bit seed from ``secret`` and ``labels`` (SHA-256: it reveals nothing of ``secret``)."""
    text = "\x1f".join(["dp_hf", str(int(secret)), *map(str, labels)])
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest, "big") >> (256 - bits)


def reseed_global_generators(secret: int, *labels: Any) -> None:
    """Seed torch (CPU and every accelerator), numpy's and Python's global generators from ``secret``.

    Each from its own derivation, with the most bits it takes: 64 for torch, 128 for numpy, 256 for
    ``random``. A loader iterator made afterwards draws its workers' base seed from torch's.
    """
    _seed_random_and_numpy(secret, "", *labels)
    torch_seed = derive_seed(secret, "torch", *labels)
    torch.manual_seed(torch_seed)  # every device type torch knows (CUDA included)
    torch.cuda.manual_seed_all(torch_seed)  # a no-op without CUDA


def seed_worker(worker_id: int) -> None:
    """A loader worker's ``worker_init_fn``: its generators from torch's 64-bit worker seed.

    PyTorch seeds worker ``k``'s torch generator with ``base + k``, ``base`` drawn from the main
    process's (secret) torch generator; transformers' ``seed_worker`` would reseed every generator with
    that seed modulo 2^32 (32 secret bits). Distinct per rank: each rank's generator has its own seed.
    """
    _seed_random_and_numpy(torch.initial_seed(), "worker-")


def _seed_random_and_numpy(secret: int, prefix: str, *labels: Any) -> None:
    """Python's ``random`` (256 bits) and numpy's global generator (128 bits) from ``secret``."""
    random.seed(derive_seed(secret, f"{prefix}random", *labels, bits=256))
    numpy_seed = derive_seed(secret, f"{prefix}numpy", *labels, bits=128)
    np.random.seed([(numpy_seed >> (32 * i)) & 0xFFFFFFFF for i in range(4)])
