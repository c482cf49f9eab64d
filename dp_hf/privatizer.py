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

An example whose norm is not a finite number (inf/NaN entries in its gradient)
gets the factor 0 instead of ``min(1, C / ||w_i||)``, and is masked out of the
sum: see :func:`clip_factors`, the one clipping rule of every path.

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
from dp_hf.precision import ieee_float32_matmuls


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


#: Smallest positive normal float32. A clip factor below it would be a denormal number, rounded to
#: a few significant bits (up to a factor 2 too large): such an example is dropped instead.
_TINY32 = torch.finfo(torch.float32).tiny


def clip_factors(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """The per-example clip factors ``f_i = min(1, C / ||w_i||)``: the one clipping rule of every path.

    :func:`clip_and_sum` (Opacus hooks, hence every data-parallel rank before the all-reduce of the
    clipped sums) and :meth:`dp_hf.per_example.ghost.FastClipping.clipped_sum` (ghost and layer-wise
    materialization) both call this function. ``norms`` may be float64 (the squared norms are
    accumulated in float64 so that finite float32 gradients never overflow); the rule is evaluated
    in float64 and the factors are returned in float32.

    An example whose norm is not a finite number gets ``f_i = 0``: it is **dropped**. A NaN norm
    (``inf - inf`` in a Gram product, NaN entries in its gradient) and an infinite one (inf entries,
    or a norm beyond float64) both mean that the example's gradient is not a usable number, and
    ``NaN > C`` being False must never let such an example through with ``f_i = 1``. So is an
    example whose factor would be below float32's normal range (a norm above ``~8.5e37 C``): that
    factor would be a denormal with a few bits of precision, which could scale the example to more
    than ``C``.

    Dropping is DP-safe: the clipping map only has to send each example's gradient to a vector of
    norm at most ``C`` using nothing but that example. A dropped example contributes the zero
    vector (norm ``0 <= C``), and whether it is dropped depends on its own gradient alone, so adding
    or removing one example still changes the clipped sum by at most ``C``. The weighted sums
    (here and in :mod:`dp_hf.per_example.ghost`) mask dropped examples out before summing, since ``0 * inf``
    and ``0 * NaN`` are NaN.

    ``C = inf`` (no clipping, for sigma = 0 checks) keeps every finite example with ``f_i = 1``.
    """
    n = norms.detach().double()
    clip = float(max_grad_norm)
    factors = torch.where(n > clip, clip / n, 1.0)  # min(1, C / ||w||); n = 0 and C = inf give 1
    factors = torch.where(torch.isfinite(n), factors, 0.0).float()
    return torch.where(factors >= _TINY32, factors, 0.0)


def mask_batch(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``x`` (batch-first) with the rows of dropped examples set to 0 (``where``, not a product)."""
    return torch.where(keep.view(-1, *([1] * (x.dim() - 1))), x, 0.0)


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
        coordinates) and the ``[b]`` per-example norms ``||w_i||`` before clipping
        (float32: a norm beyond float32's range reads ``inf``; NaN for a gradient
        with NaN entries).

    The factors are :func:`clip_factors`'s: an example whose ``w_i`` has inf/NaN
    entries is dropped (contributes exactly 0). The squared norms are summed in
    float64; a tensor's float32 sum of squares that overflows (entries ~1e20) is
    recomputed in float64 for the examples concerned, so a finite gradient is
    clipped to ``C``, never dropped for overflowing.
    """
    reference = next(g for g in grad_samples if g is not None)
    batch, device = reference.shape[0], reference.device
    w = []
    sq_norms = torch.zeros(batch, dtype=torch.float64, device=device)
    for k, g in enumerate(grad_samples):
        if g is None:
            g = torch.zeros((batch, *shapes[k]), dtype=torch.float32, device=device)
        g = g.float()
        shifted = geometry.shift is not None and geometry.shift[k] is not None
        if shifted:
            g = g - geometry.shift[k].float().unsqueeze(0)
        if geometry.scale is not None and geometry.scale[k] is not None:
            scale = geometry.scale[k].float().unsqueeze(0)
            # In place once g is a new tensor of ours (never the caller's p.grad_sample).
            g = g.div_(scale) if shifted else g / scale
        w.append(g)
        sq_norms += g.reshape(batch, -1).pow(2).sum(dim=1).to(sq_norms.device, torch.float64)
    overflowed = ~torch.isfinite(sq_norms)
    if overflowed.any():  # float32 squares overflow beyond ~1.8e19: redo those examples in float64
        rows = overflowed.nonzero().squeeze(1)
        exact = torch.zeros(rows.shape[0], dtype=torch.float64, device=device)
        for wk in w:
            picked = wk.index_select(0, rows.to(wk.device)).reshape(rows.shape[0], -1)
            exact += picked.double().pow(2).sum(dim=1).to(device)
        sq_norms[rows] = exact
    norms = sq_norms.sqrt()
    factors = clip_factors(norms, geometry.max_grad_norm)
    keep = factors > 0
    if not keep.all():  # 0 * inf = NaN: take dropped examples out of the sum instead of weighting them
        w = [mask_batch(wk, keep.to(wk.device)) for wk in w]
    with ieee_float32_matmuls():  # at TF32 the product would round w_i: a contribution above C
        sums = [torch.einsum("i,i...->...", factors.to(wk.device), wk) for wk in w]
    return sums, norms.float()


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
        self.rank_steps = RankSteps()

    @property
    def distributed(self) -> bool:
        if self._distributed is not None:
            return self._distributed
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _add(self, sums: Sequence[torch.Tensor], owned: bool = False) -> None:
        if self._sums is None:  # the first micro-batch: keep its sums (``owned``: nobody else holds them)
            self._sums = list(sums) if owned else [s.clone() for s in sums]
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
                "buffer). Use dp_hf.per_example.attach_grad_sample to attach per-sample hooks, which materializes such ids."
            )
        sums, norms = clip_and_sum(batches, geometry, shapes)
        self._add(sums)
        self.num_examples += int(norms.shape[0])
        self.num_microbatches += 1
        return norms

    def accumulate_clipped_sum(
        self, clipped_sums: Sequence[torch.Tensor], num_examples: int, owned: bool = False
    ) -> None:
        """Add a clipped sum computed elsewhere (e.g. by ghost clipping) in the ``w`` coordinates.

        ``owned=True``: the caller hands the tensors over (it keeps no reference), so the first
        micro-batch's may become the running sum without a copy.
        """
        self._add([s.float() for s in clipped_sums], owned=owned)
        self.num_examples += int(num_examples)
        self.num_microbatches += 1

    def release(
        self, params: Sequence[torch.Tensor], geometry: Geometry, step: int | None = None
    ) -> list[torch.Tensor]:
        """Noise the accumulated sum once, divide by ``B``, map back; reset.

        An empty logical batch (nothing accumulated) still releases pure noise:
        skipping it would reveal that the batch was empty. ``step``: the DP step released (the
        optimizer's count); under data parallelism every rank's must be the same, checked by the
        all-reduce itself (see :class:`RankSteps`).
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
        # Multi-tensor throughout: one flat noise draw per (device, dtype) and _foreach ops, so the
        # release costs a few kernels whatever the number of tensors (issue 16). The sums are added
        # into the fresh noise (the same floating-point additions), whose flat buffers then hold the
        # released tensors: the division is one op per buffer (a CPU's _foreach ops loop over tensors).
        flats: list[torch.Tensor] = []
        if add_noise_here and sums:
            noise, flats = self.noise_source.normal_like_flat(sums, std)
            torch._foreach_add_(noise, sums)
            sums = noise
        if self.distributed:
            self.rank_steps.check_pending()
            summed_steps = _all_reduce_sum(sums, step)
            if summed_steps is not None:
                self.rank_steps.check(summed_steps, step)
        out = list(sums)
        if flats:
            for flat in flats:
                flat.div_(self.expected_batch_size)
        elif out:
            torch._foreach_div_(out, self.expected_batch_size)
        for factors, op in ((geometry.scale, torch._foreach_mul_), (geometry.shift, torch._foreach_add_)):
            picked = [k for k in range(len(out)) if factors is not None and factors[k] is not None]
            if picked:  # s * wtilde first, then + c
                op([out[k] for k in picked], [factors[k].float() for k in picked])
        self._sums = None
        self.num_examples = 0
        self.num_microbatches = 0
        return out

    def reset(self) -> None:
        """Drop what was accumulated (e.g. when a logical step is abandoned)."""
        self._sums = None
        self.num_examples = 0
        self.num_microbatches = 0


def _all_reduce_sum(tensors: list[torch.Tensor], step: int | None = None) -> torch.Tensor | None:
    """Sum ``tensors`` over the ranks in place; with a ``step``, its slots (:func:`step_slots`) travel in the
    same buffer (the sums are float32, as the slots) and their sum is returned."""
    # One flat buffer: one collective per step instead of one per tensor; one multi-tensor copy back.
    if not tensors:
        return None
    parts = [t.reshape(-1) for t in tensors]
    if step is not None:
        parts.append(step_slots(step, dist.get_rank(), dist.get_world_size(), tensors[0].device))
    flat = torch.cat(parts)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    total = sum(t.numel() for t in tensors)
    views = [chunk.view_as(t) for chunk, t in zip(flat[:total].split([t.numel() for t in tensors]), tensors)]
    torch._foreach_copy_(tensors, views)
    return None if step is None else flat[total:]


#: A DP step travels as two float32 numbers of this many bits each (exact: float32 has 24).
_STEP_BITS = 23


def step_slots(step: int, rank: int, world_size: int, device: torch.device) -> torch.Tensor:
    """``[2 world_size]`` float32 zeros but this rank's two slots, the high and low bits of ``step``: summed
    over the ranks, slot pair ``r`` holds rank ``r``'s step exactly (below ``2**46`` steps)."""
    slots = torch.zeros(2 * world_size, dtype=torch.float32, device=device)
    slots[2 * rank].fill_(step >> _STEP_BITS)  # (fill_ with a Python number: no host-device copy)
    slots[2 * rank + 1].fill_(step & ((1 << _STEP_BITS) - 1))
    return slots


class RankSteps:
    """Refuses a release that summed different DP steps of different ranks, on every rank alike.

    Each release all-reduces the ranks' shares of one Poisson step; a rank at another step (resumed from
    another checkpoint, or stepping its optimizer more often) would mix two steps' samples in one release:
    an example in both shares counts twice. The train-start comparison of the ranks' positions
    (:func:`~dp_hf.distributed.check_same_progress`) refuses that before training; this checks every
    release. Off CUDA before the update is applied; on CUDA the summed steps are copied to the host
    without waiting and checked at the next release (reading them at once would stall the device every
    step), so there the first mixed release is refused one release later.
    """

    def __init__(self) -> None:
        self._pending: tuple[torch.Tensor, torch.cuda.Event, int] | None = None

    def check(self, summed: torch.Tensor, step: int) -> None:
        if summed.device.type != "cuda":
            _refuse_mixed_steps(summed.tolist(), step, applied=False)
            return
        host = torch.empty(summed.shape, dtype=summed.dtype, pin_memory=True)
        host.copy_(summed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (host, event, step)

    def check_pending(self) -> None:
        """The previous release's check, where it was left for later (CUDA)."""
        if self._pending is not None:
            host, event, step = self._pending
            self._pending = None
            event.synchronize()
            _refuse_mixed_steps(host.tolist(), step, applied=True)


def _refuse_mixed_steps(summed: list[float], step: int, applied: bool) -> None:
    steps = [(int(summed[2 * r]) << _STEP_BITS) + int(summed[2 * r + 1]) for r in range(len(summed) // 2)]
    if len(set(steps)) == 1:
        return
    ranks = ", ".join(f"rank {r}: step {s}" for r, s in enumerate(steps))
    raise RuntimeError(
        f"the ranks released different DP steps in one all-reduce ({ranks}; this rank: {step}): the released sum "
        "mixes two Poisson steps' samples, where an example in both counts twice. The ranks are at different "
        "points of the run: resumed from different checkpoints, or one rank stepped its optimizer more often. "
        + ("That update was applied; do not use this model. " if applied else "No update was applied. ")
        + "Restart every rank from the same checkpoint."
    )
