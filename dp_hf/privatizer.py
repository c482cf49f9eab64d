"""The one privatizer every dp_hf optimizer uses (ALGORITHMS.md, section 1).

Given per-example gradients ``g_i`` (all trainable tensors of example ``i``
together) and a geometry ``(c, s, C)`` supplied by the optimizer from its state
at step ``t-1``::

    w_i      = (g_i - c) / s
    wbar_i   = w_i * min(1, C / ||w_i||_2)          # one flat norm over all tensors
    wtilde   = (sum_i wbar_i + N(0, sigma^2 C^2 I)) / B
    gtilde   = s * wtilde + c

``B`` is the **expected** logical batch size. Dividing by the realized Poisson
batch size would make the output depend on it, and it is not protected.

A logical batch may arrive in several physical micro-batches:
:meth:`Privatizer.accumulate` clips one micro-batch and adds it to a running sum;
:meth:`Privatizer.release` adds the noise once, divides, maps back and resets.
Under data parallelism the clipped sums of all ranks are summed (``all_reduce``)
and the noise is added by rank 0 only, before the reduction, so it enters the
global sum exactly once and every rank ends with the same ``gtilde``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dp_hf.noise import NoiseSource


@dataclass
class Geometry:
    """The clipping geometry of one logical step.

    ``shift``/``scale`` are lists aligned with the trainable parameters (``None``
    means the identity: ``c = 0`` or ``s = 1`` for every tensor). ``scale`` must be
    strictly positive. They must depend only on earlier privatized outputs.
    """

    max_grad_norm: float
    shift: Sequence[torch.Tensor] | None = None
    scale: Sequence[torch.Tensor] | None = None


def _as_batch(grad_sample: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    # Opacus stores a list when backward ran several times before the grads were consumed.
    if isinstance(grad_sample, (list, tuple)):
        return torch.cat(list(grad_sample), dim=0)
    return grad_sample


def clip_and_sum(
    grad_samples: Sequence[torch.Tensor | None],
    geometry: Geometry,
    shapes: Sequence[torch.Size] | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Clip every example in the geometry and sum over the batch.

    Args:
        grad_samples: per trainable tensor, ``[b, *shape]`` per-example gradients
            (any float dtype; the arithmetic is float32). ``None`` marks a tensor
            that got no gradient in this pass: ``g_i = 0`` for every example
            (``w_i = -c/s`` then, which still counts in the norm).
        geometry: the step's ``(c, s, C)``.
        shapes: the tensors' shapes, needed only where an entry is ``None``.

    Returns:
        ``(sums, norms)``: per tensor ``sum_i wbar_i`` (float32, in the ``w``
        coordinates) and the ``[b]`` per-example norms ``||w_i||`` before clipping.
    """
    reference = next(g for g in grad_samples if g is not None)
    batch, device = reference.shape[0], reference.device
    w = []
    sq_norms = torch.zeros(batch, dtype=torch.float32, device=device)
    for k, g in enumerate(grad_samples):
        if g is None:
            g = torch.zeros((batch, *shapes[k]), dtype=torch.float32, device=device)
        g = g.float()
        if geometry.shift is not None and geometry.shift[k] is not None:
            g = g - geometry.shift[k].float().unsqueeze(0)
        if geometry.scale is not None and geometry.scale[k] is not None:
            g = g / geometry.scale[k].float().unsqueeze(0)
        w.append(g)
        sq_norms += g.reshape(batch, -1).pow(2).sum(dim=1).to(sq_norms.device)
    norms = sq_norms.sqrt()
    clip = geometry.max_grad_norm
    # min(1, C / ||w||) exactly; the where() avoids 0/0 and makes C = inf a no-op.
    factors = torch.where(norms > clip, clip / norms.clamp_min(torch.finfo(torch.float32).tiny), 1.0)
    sums = [torch.einsum("i,i...->...", factors.to(wk.device), wk) for wk in w]
    return sums, norms


class Privatizer:
    """Clip-and-accumulate over micro-batches, then noise once per logical step.

    Args:
        noise_multiplier: ``sigma``; the noise std on the clipped sum is ``sigma * C``.
        expected_batch_size: ``B = q * N`` (global, over all data-parallel ranks).
        noise_source: where the Gaussian noise comes from.
        distributed: sum the clipped sums over ``torch.distributed`` ranks;
            ``None`` detects an initialized process group of size > 1.
    """

    def __init__(
        self,
        noise_multiplier: float,
        expected_batch_size: float,
        noise_source: NoiseSource,
        distributed: bool | None = None,
    ) -> None:
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = float(expected_batch_size)
        self.noise_source = noise_source
        self._distributed = distributed
        self._sums: list[torch.Tensor] | None = None
        self.num_examples = 0  # realized count, for logging only: it never enters the math
        self.num_microbatches = 0

    @property
    def distributed(self) -> bool:
        if self._distributed is not None:
            return self._distributed
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _add(self, sums: Sequence[torch.Tensor]) -> None:
        if self._sums is None:
            self._sums = [s.clone() for s in sums]
        else:
            torch._foreach_add_(self._sums, list(sums))

    def accumulate(
        self,
        grad_samples: Sequence[torch.Tensor | list[torch.Tensor] | None],
        geometry: Geometry,
        shapes: Sequence[torch.Size] | None = None,
    ) -> torch.Tensor:
        """Clip one micro-batch of per-example gradients and add it to the running sum.

        Returns the per-example norms before clipping (for diagnostics).
        """
        batches = [None if g is None else _as_batch(g) for g in grad_samples]
        sizes = {int(g.shape[0]) for g in batches if g is not None}
        if len(sizes) != 1:
            raise RuntimeError(
                f"per-example gradients disagree on the batch size across parameters ({sorted(sizes)}): "
                "some module computed a gradient summed over examples (e.g. a broadcast [1, L] position_ids "
                "buffer). Use dp_hf.grad_sample to attach per-sample hooks, which materializes such ids."
            )
        sums, norms = clip_and_sum(batches, geometry, shapes)
        self._add(sums)
        self.num_examples += int(norms.shape[0])
        self.num_microbatches += 1
        return norms

    def accumulate_clipped_sum(self, clipped_sums: Sequence[torch.Tensor], num_examples: int) -> None:
        """Add a clipped sum computed elsewhere (e.g. by ghost clipping) in the ``w`` coordinates."""
        self._add([s.float() for s in clipped_sums])
        self.num_examples += int(num_examples)
        self.num_microbatches += 1

    def release(self, params: Sequence[torch.Tensor], geometry: Geometry) -> list[torch.Tensor]:
        """Noise the accumulated sum once, divide by ``B``, map back; reset.

        An empty logical batch (nothing accumulated) still releases pure noise:
        skipping it would reveal that the batch was empty.
        """
        if self._sums is None:
            sums = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]
        else:
            sums = self._sums
        std = self.noise_multiplier * geometry.max_grad_norm
        if std > 0 and not math.isfinite(std):
            raise ValueError(
                f"noise std sigma*C = {self.noise_multiplier!r} * {geometry.max_grad_norm!r} is not finite: "
                "an infinite clip norm only makes sense with noise_multiplier=0."
            )
        add_noise_here = std > 0 and (not self.distributed or dist.get_rank() == 0)
        if add_noise_here:
            for s in sums:
                s.add_(self.noise_source.normal(s.shape, std, s.device))
        if self.distributed:
            _all_reduce_sum(sums)
        out = []
        for k, s in enumerate(sums):
            s = s.div_(self.expected_batch_size)
            if geometry.scale is not None and geometry.scale[k] is not None:
                s = s.mul_(geometry.scale[k].float())
            if geometry.shift is not None and geometry.shift[k] is not None:
                s = s.add_(geometry.shift[k].float())
            out.append(s)
        self._sums = None
        self.num_examples = 0
        self.num_microbatches = 0
        return out

    def reset(self) -> None:
        """Drop what was accumulated (e.g. when a logical step is abandoned)."""
        self._sums = None
        self.num_examples = 0
        self.num_microbatches = 0


def _all_reduce_sum(tensors: list[torch.Tensor]) -> None:
    # One flat buffer: one collective per step instead of one per tensor.
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
