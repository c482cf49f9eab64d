"""Per-example norms and clipped sums from the records of one backward pass (:func:`clipped_sum`).

* identity geometry (ghost): ``||G_i||^2`` from the factors, with every cross term between the
  uses of a tied tensor (:func:`identity_sq_norms`);
* any geometry (materialize): ``||(G_i - c) / s||^2``, forming ``G_i`` layer by layer in chunks
  bounded by ``budget`` bytes, sparse for embeddings (:func:`geometry_sq_norms`);
* the clipped sum by book-keeping, ``sum_i f_i G_i`` without a second backward
  (:func:`weighted_sum`), mapped to the ``w`` coordinates by :func:`to_w_sum`.

Norms are computed in float32 and summed over the tensors in float64; an example whose float32
norm is not a finite non-negative number, or whose Gram products may underflow, is redone in
float64 (norm and share of the sum). The factors are :func:`~dp_hf.privatizer.clip_factors`'s.
bf16 layers on CUDA run on tensor cores and clip with a norm inflated by the bound of
:mod:`~dp_hf.per_example.ghost.tensor_cores`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dp_hf.per_example.ghost.kernels import (
    chunks,
    dense_outer_inner,
    gram_underflow_risk,
    ids_rows,
    mask_batch,
    outer_inner,
    outer_materialize,
    outer_sq_norm,
    outer_weighted_sum,
)
from dp_hf.per_example.ghost.records import ParamRecord
from dp_hf.per_example.ghost.tensor_cores import model_precision_records, rounding_bound
from dp_hf.privatizer import Geometry, clip_factors

__all__ = [
    "clipped_sum",
    "geometry_sq_norms",
    "geometry_terms",
    "identity_sq_norms",
    "materialize",
    "sq_norms",
    "to_w_sum",
    "weighted_sum",
]


def geometry_terms(geometry: Geometry, k: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(c_k, s_k)`` of tensor ``k`` (``None``: the identity for that tensor)."""
    shift = geometry.shift[k] if geometry.shift is not None else None
    scale = geometry.scale[k] if geometry.scale is not None else None
    return shift, scale


def identity_sq_norms(
    record: ParamRecord,
    batch: int,
    budget: int,
    dtype: torch.dtype = torch.float32,
    grams: dict | None = None,
) -> torch.Tensor:
    """``||G_i||^2`` with every cross term between the uses of a (tied) parameter; ``grams`` shares the
    cols Grams of layers fed the same input (:func:`~dp_hf.per_example.ghost.kernels.outer_inner`)."""
    if record.dense_sq_norms is not None and dtype == torch.float32 and not record.outers:
        return record.dense_sq_norms  # a bias, a norm layer's weight: taken when recorded
    sq = torch.zeros(batch, dtype=dtype, device=record.param.device)
    if record.dense_sq_norms is not None and dtype == torch.float32:
        sq += record.dense_sq_norms
    elif record.dense is not None:
        sq += torch.linalg.vector_norm(record.dense.reshape(batch, -1).to(dtype), dim=1).square()
    outers = record.outers
    if outers and all(o.rows_are_ids for o in outers):
        example, _, rows = ids_rows(outers, dtype)  # cross terms included by summing rows first
        sq.index_add_(0, example, rows.pow(2).sum(dim=1))
        if record.dense is not None:
            sq += 2 * sum(dense_outer_inner(record.dense, o, budget, dtype) for o in outers)
        return sq
    for k, o in enumerate(outers):
        sq += outer_sq_norm(o, budget, dtype, grams)
        if record.dense is not None:
            sq += 2 * dense_outer_inner(record.dense, o, budget, dtype)
        for other in outers[k + 1 :]:
            sq += 2 * outer_inner(o, other, budget, dtype)
    return sq


def geometry_sq_norms(
    record: ParamRecord | None,
    p: torch.Tensor,
    shift: torch.Tensor | None,
    scale: torch.Tensor | None,
    batch: int,
    budget: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``||(G_i - c) / s||^2``, forming ``G_i`` layer by layer in chunks (sparse for embeddings).

    Embeddings use ``||(G_i - c)/s||^2 = ||c/s||^2 + sum_{u in ids(i)} (||(r_{i,u} - c_u)/s_u||^2 -
    ||c_u/s_u||^2)``; a tensor without a record (no gradient) contributes ``||c/s||^2``.
    """
    c = shift.to(dtype) if shift is not None else None
    s = scale.to(dtype) if scale is not None else None
    sq = torch.zeros(batch, dtype=dtype, device=p.device)
    if c is not None:  # ||c / s||^2: what an example with G_i = 0 contributes
        base = c / s if s is not None else c
        base_sq = base.pow(2).sum()
    else:
        base, base_sq = None, None
    if record is None:
        return sq + base_sq if base_sq is not None else sq
    if record.dense is None and record.outers and all(o.rows_are_ids for o in record.outers):
        example, ids, rows = ids_rows(record.outers, dtype)
        shape = record.matrix_shape
        c_rows = c.reshape(shape)[ids] if c is not None else None
        s_rows = s.reshape(shape)[ids] if s is not None else None
        w = rows if c_rows is None else rows - c_rows
        if s_rows is not None:
            w = w / s_rows
        correction = w.pow(2).sum(dim=1)
        if base is not None:
            correction -= base.reshape(shape)[ids].pow(2).sum(dim=1)
            sq += base_sq
        return sq.index_add_(0, example, correction)
    itemsize = torch.empty((), dtype=dtype).element_size()
    for start, stop in chunks(batch, 3 * itemsize * p.numel(), budget):
        g = materialize(record, start, stop, dtype)  # [n, *p.shape]
        if c is not None:
            g = g - c
        if s is not None:
            g = g / s
        sq[start:stop] += g.reshape(stop - start, -1).pow(2).sum(dim=1)
    return sq


def materialize(
    record: ParamRecord, start: int, stop: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``G_i`` for examples ``[start, stop)``: ``[n, *param.shape]``."""
    shape = record.param.shape
    total = record.dense[start:stop].to(dtype, copy=True) if record.dense is not None else None
    for o in record.outers:
        g = outer_materialize(o, start, stop, dtype).view(stop - start, *shape)
        total = g if total is None else total.add_(g)
    return total


def sq_norms(
    records: Sequence[ParamRecord | None],
    params: Sequence[torch.Tensor],
    geometry: Geometry,
    *,
    ghost: bool,
    batch: int,
    device: torch.device,
    budget: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``||w_i||^2`` over every tensor of ``params``, ``[batch]`` float64, computed in ``dtype``.

    The per-tensor parts are stacked and summed in float64 at once (one reduction, not one addition
    per tensor: this runs for every layer of every micro-batch).
    """
    parts, grams = [], {}  # grams: the cols Grams of this pass, shared by layers with the same input
    for k, (p, record) in enumerate(zip(params, records)):
        if ghost:
            if record is not None:
                parts.append(identity_sq_norms(record, batch, budget, dtype, grams))
        else:
            shift, scale = geometry_terms(geometry, k)
            parts.append(geometry_sq_norms(record, p, shift, scale, batch, budget, dtype))
    if not parts:
        return torch.zeros(batch, dtype=torch.float64, device=device)
    return torch.stack([part.to(device) for part in parts]).to(torch.float64).sum(dim=0)


def weighted_sum(
    record: ParamRecord,
    factors: torch.Tensor,
    keep: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    tensor_cores: bool = False,
) -> torch.Tensor:
    """``sum_i f_i G_i`` (book-keeping: no per-example gradient for the outers), in ``dtype``.

    ``keep`` (given when some examples are left out) masks the others out: a dropped example's
    recorded tensors may hold inf/NaN, and ``0 * inf`` is NaN. ``tensor_cores``: the factors came
    from norms inflated by :mod:`~dp_hf.per_example.ghost.tensor_cores`'s bound (ghost mode only).
    """
    shape = record.param.shape
    total = None
    if record.dense is not None:
        dense = record.dense.to(dtype)
        dense = dense if keep is None else mask_batch(dense, keep)
        total = (factors.to(dtype) @ dense.reshape(dense.shape[0], -1)).view(shape)  # one GEMV
    for o in record.outers:
        part = outer_weighted_sum(o, factors, keep, dtype, tensor_cores).view(shape)
        total = part if total is None else total.add_(part)
    return total


def small_dense_sums(
    records: Sequence[ParamRecord | None], factors: torch.Tensor, keep: torch.Tensor | None
) -> dict[int, torch.Tensor]:
    """``sum_i f_i G_i`` (float32) of the records that are small dense ``G_i`` only (biases, norm
    layers' weights: ~half of a transformer's tensors), keyed by their index in ``records``.

    Concatenated per device into ``[B, sum n]`` blocks of at most ``SMALL_DENSE_GROUP_BYTES``, each
    summed by one GEMV: a few kernels instead of ~5 per tensor (on a GPU, ~120 tensors of BERT-base
    were ~600 launches per micro-batch). ``keep`` masks dropped examples out, as in :func:`weighted_sum`.
    """
    groups: dict[torch.device, list[list[int]]] = {}
    used: dict[torch.device, int] = {}  # bytes in each device's last group
    for k, record in enumerate(records):
        if record is None or record.outers or record.dense is None or record.dense.dtype != torch.float32:
            continue
        size = record.dense.numel() * 4
        if size > SMALL_DENSE_BYTES:
            continue
        device = record.dense.device
        device_groups = groups.setdefault(device, [[]])
        if used.get(device, 0) + size > SMALL_DENSE_GROUP_BYTES:
            device_groups.append([])
            used[device] = 0
        device_groups[-1].append(k)
        used[device] = used.get(device, 0) + size
    sums: dict[int, torch.Tensor] = {}
    for device, device_groups in groups.items():
        f = factors.to(device, torch.float32)
        for members in device_groups:
            batch = records[members[0]].dense.shape[0]
            blocks = [records[k].dense.reshape(batch, -1) for k in members]
            flat = torch.cat(blocks, dim=1)
            if keep is not None:
                flat = mask_batch(flat, keep.to(device))
            totals = (f @ flat).split([block.shape[1] for block in blocks])
            for k, total in zip(members, totals):
                sums[k] = total.view(records[k].param.shape)
    return sums


SMALL_DENSE_BYTES = 1 << 20  # a record's dense G (all examples) up to this size is summed in a group
SMALL_DENSE_GROUP_BYTES = 16 << 20  # the transient concatenation of one group


def to_w_sum(
    total: torch.Tensor, total_factor: torch.Tensor, shift: torch.Tensor | None, scale: torch.Tensor | None
) -> torch.Tensor:
    """``sum_i f_i (G_i - c) / s = (sum_i f_i G_i - (sum_i f_i) c) / s``."""
    if shift is not None:
        total = total - total_factor.to(total.device) * shift.float()
    if scale is not None:
        total = total / scale.float()
    return total


def clipped_sum(
    records: Sequence[ParamRecord | None],
    params: Sequence[torch.Tensor],
    geometry: Geometry,
    *,
    ghost: bool,
    batch: int,
    device: torch.device,
    budget: int,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(sums, norms)`` like :func:`~dp_hf.privatizer.clip_and_sum`, from ``records`` (aligned with ``params``).

    ``ghost``: identity-geometry norms from the factors (the caller checked the geometry).
    ``norms`` (float32, on ``device``) are the per-example norms ``||w_i||`` before clipping (for bf16
    layers on CUDA: the inflated norms the factors were computed from, never below the true ones).
    """
    if ghost:  # materialized norms in a geometry keep the float32 arithmetic (the bound assumes s = 1)
        records = model_precision_records(records)
    bound = rounding_bound(records, batch, device) if ghost else None
    norms_of = {"params": params, "geometry": geometry, "ghost": ghost, "device": device, "budget": budget}
    sq = sq_norms(records, batch=batch, dtype=torch.float32, **norms_of)
    redo = ~torch.isfinite(sq) | (sq < 0)  # overflow (inf, inf - inf) or cancellation below 0
    if ghost:
        risk = gram_underflow_risk([o for record in records if record is not None for o in record.outers])
        if risk is not None:
            redo |= risk.to(device)
    rows, subset = None, None
    if redo.any():
        rows = redo.nonzero().squeeze(1)
        subset = [r.select(rows.to(r.param.device)) if r is not None else None for r in records]
        sq[rows] = sq_norms(subset, batch=rows.shape[0], dtype=torch.float64, **norms_of)
    norms = sq.sqrt() if bound is None else bound.inflate(sq)  # NaN where still negative: dropped
    factors = clip_factors(norms, geometry.max_grad_norm)
    keep = factors > 0
    fast = keep if rows is None else keep.index_fill(0, rows, False)  # float32 book-keeping
    fast = None if fast.all() else fast
    total_factor = factors.sum()
    grouped = small_dense_sums(records, factors, fast)
    sums = []
    for k, (p, record) in enumerate(zip(params, records)):
        if record is None:
            total = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        else:
            f = factors.to(p.device)
            total = grouped.get(k)
            if total is None:
                # Tensor-core sums only where the clip factors absorbed their bound (ghost mode): the
                # materialized norms of a geometry are not inflated, and its deviation would be scaled by 1/s.
                total = weighted_sum(
                    record, f, fast.to(p.device) if fast is not None else None, tensor_cores=bound is not None
                )
            if rows is not None:  # the redone examples' share, in float64 (<= C each: representable)
                index = rows.to(p.device)
                part = weighted_sum(subset[k], f[index], keep.to(p.device)[index], torch.float64)
                total = total.add_(part.float())
        sums.append(to_w_sum(total, total_factor, *geometry_terms(geometry, k)))
    return sums, norms.float()
