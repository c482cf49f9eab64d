"""Where the Gaussian noise comes from.

A :class:`NoiseSource` draws ``N(0, std^2)`` tensors. Two modes:

* **seeded** (default): one ``torch.Generator`` whose state is part of every
  checkpoint, so that a resumed run draws exactly the noise an uninterrupted run
  would. The seed defaults to fresh OS entropy (``secrets``), never to the
  Trainer's public ``seed``: noise an adversary can reproduce protects nothing.
  Anyone holding a checkpoint can replay the noise, so checkpoints are secrets.
* **secure** (``secure_mode=True``): every draw uses a generator freshly seeded
  from the operating system's CSPRNG and its state is never saved, and each
  sample is the average of four Gaussian draws rescaled to the same variance
  (``(z1 + z2 + z3 + z4) / 2``), the mitigation Opacus uses against
  floating-point attacks on the Gaussian mechanism (Mironov 2012; Holohan et al.
  2021). Runs are then not reproducible and a resume continues with new noise.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import secrets
import warnings
from collections.abc import Sequence

import torch

#: CPU draws of at least this many elements are drawn ahead (see :meth:`NoiseSource.draw_ahead`).
PREFETCH_MIN_NUMEL = 1 << 16


@functools.cache
def _noise_worker() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dp_hf-noise")


# A forked child inherits the executor but not its thread (and NoiseSource discards a parent's draw).
os.register_at_fork(after_in_child=_noise_worker.cache_clear)


class NoiseSource:
    """Gaussian noise for the privatizer.

    Args:
        seed: seed of the generator; ``None`` draws one from OS entropy.
        secure_mode: see the module docstring.
        device: device of the generator (the parameters' device).
        generator: use this generator instead of creating one (its state is still
            saved and restored with the optimizer).
    """

    def __init__(
        self,
        seed: int | None = None,
        secure_mode: bool = False,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if generator is not None and secure_mode:
            raise ValueError(
                "secure_mode=True draws fresh OS entropy for every step, so a user generator "
                f"({generator!r}) cannot be used with it; pass one or the other."
            )
        if seed is not None and secure_mode:
            raise ValueError(f"secure_mode=True never uses a fixed seed (got seed={seed!r}); drop the seed.")
        self.secure_mode = bool(secure_mode)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if generator is not None:
            self.generator = generator
            self.device = generator.device
        elif self.secure_mode:
            self.generator = None
        else:
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(seed if seed is not None else secrets.randbits(63))
        self.num_draws = 0
        self._warned_device = False
        # Only a generator of our own (a user's may be shared), seeded, on the CPU (a GPU draws fast).
        self._prefetches = generator is None and not self.secure_mode and self.device.type == "cpu"
        self._pending: tuple | None = None  # (size, std, future, generator state before it, pid)
        self._last: tuple[tuple[int, ...], float] | None = None  # (size, std) of the latest draw

    def normal(self, shape: torch.Size | tuple[int, ...], std: float, device: torch.device) -> torch.Tensor:
        """One tensor of i.i.d. ``N(0, std^2)`` in float32, on ``device`` (one ``torch.normal`` call).

        In secure mode each entry is ``(z1 + z2 + z3 + z4) / 2`` from a freshly seeded generator
        (four calls into the same buffer).
        """
        self.num_draws += 1
        size = tuple(shape)
        if self.secure_mode:
            gen = torch.Generator(device=device)
            gen.manual_seed(secrets.randbits(63))
            total = torch.normal(0.0, std, size=size, generator=gen, device=device)
            scratch = torch.empty_like(total)  # the three other draws reuse one buffer
            for _ in range(3):
                total.add_(torch.normal(0.0, std, size=size, generator=gen, out=scratch))
            return total.div_(2.0)
        sample = self._take_prefetched(size, std)
        if sample is None:
            sample = torch.normal(0.0, std, size=size, generator=self.generator, device=self.generator.device)
        self._last = (size, std)
        if sample.device.type != torch.device(device).type and not self._warned_device:
            self._warned_device = True
            warnings.warn(
                f"the DP noise for parameters on {device} is drawn on {self.generator.device} and copied every "
                f"step ({math.prod(size)} Gaussians): the optimizer was built before the model moved (its first "
                "parameter's device picks the generator's). Build the optimizer after model.to(device) / "
                "accelerator's device placement, or pass generator=torch.Generator(device=...).",
                UserWarning,
                stacklevel=4,
            )
        return sample.to(device, non_blocking=True)

    # Drawing ahead. Drawing ~10^6 Gaussians takes a CPU core several milliseconds, and the noise does
    # not depend on the data: the next step's draw (same size and std, as every step asks) can run on a
    # worker thread while the model computes. The stream is unchanged: a draw is the next one of the
    # generator whenever it is made; a draw ahead that is not asked for is undone (the generator state
    # from before it is restored), and a checkpoint holds the state from before any pending draw.

    def draw_ahead(self) -> None:
        """Start the next draw (the latest one's size and std) on a worker thread, on a CPU.

        The optimizer calls this at the end of its step, so that the draw overlaps the next forward
        and backward passes; started earlier, it would compete for the cores with the optimizer's
        own multi-threaded update (a 2-core machine then ran DP-MicroAdam's step 1.3x slower).
        A no-op for a user's generator, secure mode, accelerators, small draws, or one already pending.
        """
        if not self._prefetches or self._pending is not None or self._last is None:
            return
        size, std = self._last
        if math.prod(size) < PREFETCH_MIN_NUMEL:
            return
        state = self.generator.get_state()
        future = _noise_worker().submit(
            torch.normal, 0.0, std, size=size, generator=self.generator, device=self.generator.device
        )
        self._pending = (size, std, future, state, os.getpid())

    def _take_prefetched(self, size: tuple[int, ...] | None, std: float | None) -> torch.Tensor | None:
        """The prefetched draw if it is the one asked for; else None, with the generator as before it
        (``size=None``: drop any pending draw)."""
        if self._pending is None:
            return None
        pending_size, pending_std, future, state, pid = self._pending
        self._pending = None
        if pid == os.getpid():  # a forked child has no worker thread: never wait on its future
            sample = future.result()
            if size is not None and (pending_size, pending_std) == (size, std):
                return sample
        self.generator.set_state(state)
        return None

    def _generator_state(self) -> torch.Tensor:
        return self._pending[3] if self._pending is not None else self.generator.get_state()

    def normal_like(self, tensors: Sequence[torch.Tensor], std: float) -> list[torch.Tensor]:
        """i.i.d. ``N(0, std^2)`` float32 noise shaped like each of ``tensors``, multi-tensor.

        The tensors are grouped by ``(device, dtype)`` in order of first appearance; each group's noise
        is ONE :meth:`normal` draw of the group's total size into a flat buffer, returned as views
        (``[z_1 | z_2 | ...]`` in the order of ``tensors``). One draw per group instead of one per
        tensor: a step costs a handful of kernels whatever the tensor count. The seeded stream is
        therefore that of one flat draw per group (not of per-tensor draws); its generator state
        still fully determines it, so a resumed run draws what an uninterrupted one would.
        """
        return self.normal_like_flat(tensors, std)[0]

    def normal_like_flat(
        self, tensors: Sequence[torch.Tensor], std: float
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`normal_like`'s views and the flat buffers they tile (one per group, new tensors of
        the caller's): a caller may work on a whole buffer at once instead of tensor by tensor."""
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for k, t in enumerate(tensors):
            groups.setdefault((t.device, t.dtype), []).append(k)
        out: list[torch.Tensor | None] = [None] * len(tensors)
        flats = []
        for (device, _), members in groups.items():
            numels = [tensors[k].numel() for k in members]
            flat = self.normal((sum(numels),), std, device)
            flats.append(flat)
            for k, chunk in zip(members, flat.split(numels)):
                out[k] = chunk.view(tensors[k].shape)
        return out, flats

    def state_dict(self) -> dict:
        state = {"secure_mode": self.secure_mode, "num_draws": self.num_draws}
        if self.generator is not None:
            state["generator_state"] = self._generator_state()
        return state

    def reseed(self) -> None:
        """Re-seed the generator from fresh OS entropy (dropping any draw made ahead): after loading an earlier
        state whose steps will be released again otherwise (other batches, other weights, other settings), so
        that the two releases of a step do not share their noise. A no-op in secure mode (fresh every draw)."""
        if self.generator is None:
            return
        self._take_prefetched(None, None)
        self.generator.manual_seed(secrets.randbits(63))

    def load_state_dict(self, state: dict) -> None:
        if bool(state["secure_mode"]) != self.secure_mode:
            raise ValueError(
                f"checkpoint noise source has secure_mode={state['secure_mode']!r} but this optimizer has "
                f"secure_mode={self.secure_mode!r}; resume with the same setting."
            )
        self.num_draws = int(state["num_draws"])
        if self.generator is not None:
            self._take_prefetched(None, None)  # wait for a pending draw and drop it
        if self.generator is not None and "generator_state" in state:
            # Accelerate may have moved the ByteTensor to the GPU; generators take CPU state.
            self.generator.set_state(state["generator_state"].detach().cpu())
