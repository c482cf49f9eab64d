"""Per-example norms and clipped sums from the records of one backward pass (:func:`clipped_sum`).

* identity geometry (ghost): ``||G_i||^2`` from the factors, with every cross term between the
  uses of a tied tensor (:func:`identity_sq_norms`); the single-outer layers' all at once
  (:mod:`~dp_hf.per_example.ghost.banks`);
* any geometry (materialize): ``||(G_i - c) / s||^2``, forming ``G_i`` layer by layer in chunks
  bounded by ``budget`` bytes, sparse for embeddings (:func:`geometry_sq_norms`);
* the clipped sum by book-keeping, ``sum_i f_i G_i`` without a second backward
  (:func:`weighted_sum`), mapped to the ``w`` coordinates by :func:`to_w_sums`.

Norms are computed in float32 and summed over the tensors in float64 (small dense records, biases
and norm layers' weights, in float32 per group of them: :func:`small_dense_groups`); an example whose float32
norm is not a finite non-negative number, may be mostly rounding error (ghost or materialized:
:func:`~dp_hf.per_example.ghost.tensor_cores.cancellation_threshold`) or whose Gram products may underflow
is redone in float64 (norm and share of the sum). The factors are :func:`~dp_hf.privatizer.clip_factors`'s.
bf16 layers on CUDA run on tensor cores and clip with a norm inflated by the bound of
:mod:`~dp_hf.per_example.ghost.tensor_cores` (ghost), or by a slack at the norm level (a geometry's
materialized norms, :func:`geometry_sq_norms`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dp_hf.per_example.ghost.banks import bankable, banked_sq_norms
from dp_hf.per_example.ghost.fused import fused_geometry_sq_norms
from dp_hf.per_example.ghost.grouped import grouped_tensor_core_sums
from dp_hf.per_example.ghost.kernels import (
    GramCache,
    ScaledFactors,
    as_dtype,
    chunks,
    dense_outer_inner,
    example_sq_norms,
    gram_underflow_risk,
    ids_rows,
    ids_sq_norms,
    mask_batch,
    on_device,
    on_tensor_cores,
    outer_abs_materialize,
    outer_inner,
    outer_materialize,
    outer_sq_norm,
    outer_weighted_sum,
)
from dp_hf.per_example.ghost.records import SMALL_DENSE_BYTES, ParamRecord
from dp_hf.per_example.ghost.tensor_cores import (
    cancellation_threshold,
    model_precision_records,
    rounding_bound,
    tensor_core_slack,
)
from dp_hf.privatizer import Geometry, clip_factors

__all__ = [
    "clipped_sum",
    "geometry_sq_norms",
    "geometry_terms",
    "identity_sq_norms",
    "materialize",
    "sq_norms",
    "to_w_sums",
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
    grams: GramCache | None = None,
) -> torch.Tensor:
    """``||G_i||^2`` with every cross term between the uses of a (tied) parameter; ``grams``: the pass's
    :class:`~dp_hf.per_example.ghost.grams.GramCache` (see :func:`~dp_hf.per_example.ghost.kernels.outer_inner`)."""
    if record.dense_sq_norms is not None and dtype == torch.float32 and not record.outers:
        return record.dense_sq_norms  # a large dense G_i: taken when recorded
    parts = []  # summed left to right
    if record.dense_sq_norms is not None and dtype == torch.float32:
        parts.append(record.dense_sq_norms)
    elif record.dense is not None:
        parts.append(example_sq_norms(record.dense.to(dtype)))
    outers = record.outers
    if outers and all(o.rows_are_ids for o in outers):
        parts.append(ids_sq_norms(outers, dtype))  # cross terms included by summing rows first
        if record.dense is not None:
            parts.extend(2 * dense_outer_inner(record.dense, o, budget, dtype) for o in outers)
    else:
        for k, o in enumerate(outers):
            parts.append(outer_sq_norm(o, budget, dtype, grams))
            if record.dense is not None:
                parts.append(2 * dense_outer_inner(record.dense, o, budget, dtype))
            parts.extend(2 * outer_inner(o, other, budget, dtype) for other in outers[k + 1 :])
    if not parts:
        return torch.zeros(batch, dtype=dtype, device=record.param.device)
    total = parts[0]  # every part is in dtype (the recorded float32 norms only when dtype is float32)
    for part in parts[1:]:
        total = total + part
    return total


def geometry_sq_norms(
    record: ParamRecord | None,
    p: torch.Tensor,
    shift: torch.Tensor | None,
    scale: torch.Tensor | None,
    batch: int,
    budget: int,
    dtype: torch.dtype = torch.float32,
    identity: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``||(G_i - c) / s||^2``, forming ``G_i`` layer by layer in chunks (sparse for embeddings); ``identity``:
    gets ``||G_i||^2`` as formed, for a record with outers (the cancellation guard's, ``clipped_sum``).

    Embeddings use ``||(G_i - c)/s||^2 = ||c/s||^2 + sum_{u in ids(i)} (||(r_{i,u} - c_u)/s_u||^2 -
    ||c_u/s_u||^2)``; a tensor without a record (no gradient) contributes ``||c/s||^2``. The subtraction
    cancels where ``c/s`` sits on the example's rows (``||c_u|| = 1e5``, ``||r_{i,u} - c_u|| = 2 C``: a float32
    norm of 0, the example released unclipped), so the rows' ``||c_u/s_u||^2`` (float32 sums of squares) are
    combined in float64, which keeps ``~1e-16 ||c/s||^2``.

    bf16 outers on CUDA (float32 asked for) form ``G^_i`` on tensor cores, and ``A^_i = sum_t |rows_t| (x)
    |cols_t|`` too: ``|G^_i - G_i| <= g_T(4u) A_i`` entrywise, and their share of the book-keeping sum
    deviates from ``f_i G_i`` by at most ``eta f_i A_i`` entrywise (the bf16 split,
    :mod:`~dp_hf.per_example.ghost.tensor_cores`), so example ``i``'s contribution in w coordinates,
    ``(f_i (G_i - c) + D_i) / s``, has norm at most ``f_i (||(G^_i - c) / s|| + (g_T + eta) ||A_i / s||)``. The
    tensor's part is ``(||(G^_i - c) / s|| + slack_i)^2`` with ``slack_i`` per outer :func:`tensor_core_slack`
    times ``||A^_i / s||`` (~1e-4 of the norm at ``T = 32``; orthogonal positions raise ``||A_i|| / ||G_i||``
    to ``~sqrt(T)``). Two tensor-core GEMMs per chunk instead of one float32 GEMM without them.
    """
    c = shift.to(dtype) if shift is not None else None
    s = scale.to(dtype) if scale is not None else None
    if record is None:  # no gradient: every example contributes ||c / s||^2
        sq = torch.zeros(batch, dtype=dtype, device=p.device)
        return sq if c is None else sq.add_(_base_row_sq(c, s, 1).sum().to(dtype))
    if record.dense is None and record.outers and all(o.rows_are_ids for o in record.outers):
        example, ids, rows = ids_rows(record.outers, dtype)
        shape = record.matrix_shape
        w = rows if c is None else rows - c.reshape(shape)[ids]
        if s is not None:
            w = w / s.reshape(shape)[ids]
        correction = w.pow(2).sum(dim=1).double()
        sq = torch.zeros(batch, dtype=torch.float64, device=p.device)
        if identity is not None:  # (the identity geometry: the rows' own squares, read only below)
            row_sq = correction if w is rows else rows.pow(2).sum(1).double()
            identity.append(torch.zeros_like(sq).index_add_(0, example, row_sq))
        if c is not None:  # what an example with G_i = 0 contributes, less its rows' part of it
            base_rows = _base_row_sq(c, s, shape[0])
            correction -= base_rows[ids]
            sq += base_rows.sum()
        return sq.index_add_(0, example, correction).to(dtype)
    if dtype == torch.float32:  # one outer of factors: on CUDA one kernel, G_i never in memory (fused.py)
        fused = fused_geometry_sq_norms(record, c, s, identity)
        if fused is not None:
            return fused
    itemsize = dtype.itemsize
    fast = [o for o in record.outers if on_tensor_cores(o)] if dtype == torch.float32 else []
    sq_parts, slack_parts, ident = [], [], []  # per chunk of examples (usually one: no buffer, no slice)
    plain, guarded = c is None and s is None, identity is not None and bool(record.outers)
    for start, stop in chunks(batch, (3 + bool(fast)) * itemsize * p.numel(), budget):
        # A fresh [n, *p.shape] buffer of this function's own: shifted and scaled in place (the same
        # roundings as out of place, without more buffers of its size per chunk), then its norms.
        g = materialize(record, start, stop, dtype, tensor_cores=bool(fast))
        if guarded and not plain:  # the guard's ||G_i||^2: one read, no temporary (a lane order is harmless)
            ident.append(torch.linalg.vector_norm(g.view(stop - start, -1), dim=1).square())
        if c is not None:
            g.sub_(c)
        if s is not None:
            g.div_(s)
        sq_parts.append(example_sq_norms(g, overwrite=True))
        del g
        slack = None
        for o in fast:
            a = outer_abs_materialize(o, start, stop).view(stop - start, *p.shape)
            if s is not None:
                a.div_(s)
            norm = torch.linalg.vector_norm(a.reshape(stop - start, -1), dim=1, dtype=torch.float64)
            term = norm.mul_(tensor_core_slack(o.cols.shape[1]))
            slack = term if slack is None else slack.add_(term)
        slack_parts.append(slack)
    sq = sq_parts[0] if len(sq_parts) == 1 else torch.cat(sq_parts)
    if guarded:
        identity.append(sq if plain else torch.cat(ident))
    if not fast:
        return sq
    slack = slack_parts[0] if len(slack_parts) == 1 else torch.cat(slack_parts)
    # ||w_i|| <= the computed norm + slack_i, and the sum's deviation is within it too: the tensor's part
    # is the square of their sum (float32 as every part; an inf or NaN norm is redone in float64).
    return (sq.double().sqrt() + slack).square().to(dtype)


def _base_row_sq(c: torch.Tensor, s: torch.Tensor | None, rows: int) -> torch.Tensor:
    """``||c_u / s_u||^2`` of each of ``c``'s ``rows`` rows, ``[rows]`` float64 (float32 sums of squares)."""
    return ((c / s).square_() if s is not None else c.square()).reshape(rows, -1).sum(dim=1).double()


def materialize(
    record: ParamRecord, start: int, stop: int, dtype: torch.dtype = torch.float32, tensor_cores: bool = False
) -> torch.Tensor:
    """``G_i`` for examples ``[start, stop)``: ``[n, *param.shape]``, a new tensor (the caller may modify it);
    ``tensor_cores``: bf16 CUDA outers on tensor cores (:func:`geometry_sq_norms` absorbs their error)."""
    shape = record.param.shape
    total = record.dense[start:stop].to(dtype, copy=True) if record.dense is not None else None
    for o in record.outers:
        g = outer_materialize(o, start, stop, dtype, tensor_cores).view(stop - start, *shape)
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
    groups: Sequence[DenseGroup] = (),
    grams: GramCache | None = None,
    identity: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``||w_i||^2`` over every tensor of ``params``, ``[batch]`` float64, computed in ``dtype``.

    The per-tensor parts are stacked and summed in float64 at once (one reduction, not one addition
    per tensor: this runs for every layer of every micro-batch). ``groups``: small dense records whose
    squared norms are taken together (in a geometry, of ``(G_i - c) / s``), a few kernels per group.
    ``grams``: where the pass keeps what its Grams share (a fresh one if ``None``). ``identity``: gets the
    materialized ``||G_i||^2`` of each tensor with outers (:func:`geometry_sq_norms`).
    """
    parts = []
    grams = GramCache() if grams is None else grams
    grouped = set()
    for group in groups:
        w = group.in_geometry()  # (ghost: the identity, flat itself)
        parts.append(torch.linalg.vecdot(w, w))  # sum over the group's tensors
        grouped.update(group.members)
    banked = {}  # single-outer float32 ghost norms, a few kernels for all of them (banks.py)
    if ghost and dtype == torch.float32:
        members = [
            k
            for k, record in enumerate(records)
            if record is not None and k not in grouped and bankable(record)
        ]
        banked = dict(zip(members, banked_sq_norms([records[k].outers[0] for k in members], budget, grams)))
    for k, (p, record) in enumerate(zip(params, records)):
        if ghost:
            if k in banked:
                parts.append(banked[k])
            elif record is not None and k not in grouped:
                parts.append(identity_sq_norms(record, batch, budget, dtype, grams))
        elif k not in grouped:
            shift, scale = geometry_terms(geometry, k)
            parts.append(geometry_sq_norms(record, p, shift, scale, batch, budget, dtype, identity))
    if not parts:
        return torch.zeros(batch, dtype=torch.float64, device=device)
    return torch.stack([on_device(part, device) for part in parts]).to(torch.float64).sum(dim=0)


def weighted_sum(
    record: ParamRecord,
    factors: torch.Tensor,
    keep: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    tensor_cores: bool = False,
    shared: ScaledFactors | None = None,
) -> torch.Tensor:
    """``sum_i f_i G_i`` (book-keeping: no per-example gradient for the outers), in ``dtype``.

    ``keep`` (given when some examples are left out) masks the others out: a dropped example's
    recorded tensors may hold inf/NaN, and ``0 * inf`` is NaN. ``tensor_cores``: the factors came
    from norms inflated by :mod:`~dp_hf.per_example.ghost.tensor_cores`'s bound (ghost mode only).
    ``shared``: see :func:`~dp_hf.per_example.ghost.kernels.outer_weighted_sum`.
    """
    shape = record.param.shape
    total = None
    if record.dense is not None:
        dense = record.dense.to(dtype)
        dense = dense if keep is None else mask_batch(dense, keep)
        total = (factors.to(dtype) @ dense.reshape(dense.shape[0], -1)).view(shape)  # one GEMV
    for o in record.outers:
        part = outer_weighted_sum(o, factors, keep, dtype, tensor_cores, shared).view(shape)
        total = part if total is None else total.add_(part)
    return total


@dataclass
class DenseGroup:
    """Small dense-only records (biases, norm layers' weights: ~half of a transformer's tensors) of one
    device: ``members`` (indices into the records), ``flat``, their ``G_i`` side by side, ``[B, sum n]``,
    ``sizes``, each member's entries per example, and ``shift`` and ``scale``, the members' geometry terms
    side by side as in ``flat`` (``[sum n]`` float32; ``None`` where no member has one, a member without
    one taking the identity)."""

    members: list[int]
    flat: torch.Tensor
    sizes: list[int]
    shift: torch.Tensor | None = None
    scale: torch.Tensor | None = None

    def in_geometry(self) -> torch.Tensor:
        """``(G_i - c) / s`` of the members side by side, ``[B, sum n]`` (``flat`` itself in the identity):
        the per-tensor path's elementwise arithmetic, in a few kernels for the group."""
        w = self.flat if self.shift is None else self.flat - self.shift
        if self.scale is not None:
            w = w / self.scale if w is self.flat else w.div_(self.scale)
        return w


def _side_by_side(
    terms: Sequence[torch.Tensor | None], sizes: Sequence[int], identity: float, device: torch.device
) -> torch.Tensor | None:
    """``terms`` flattened and concatenated (float32), ``identity`` for a ``None`` one; ``None`` if all are."""
    if all(t is None for t in terms):
        return None
    parts = [
        as_dtype(t.reshape(-1), torch.float32) if t is not None else torch.full((n,), identity, device=device)
        for t, n in zip(terms, sizes)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


SMALL_DENSE_GROUP_BYTES = 16 << 20  # the transient concatenation of one group


def small_dense_groups(records: Sequence[ParamRecord | None], geometry: Geometry) -> list[DenseGroup]:
    """The float32 dense-only records of at most ``SMALL_DENSE_BYTES``, concatenated per device in
    groups of at most ``SMALL_DENSE_GROUP_BYTES`` (the transient copies), with ``geometry``'s terms.

    Their norms (in any geometry) and clipped sums are then a few kernels per group instead of ~5 per
    tensor, ~10 in a geometry (on a GPU, ~120 tensors of BERT-base were ~600 launches per micro-batch,
    ~1600 for DP-MacAdam's).
    """
    by_device: dict[torch.device, list[list[int]]] = {}
    used: dict[torch.device, int] = {}  # bytes in each device's last group
    for k, record in enumerate(records):
        if record is None or record.outers or record.dense is None or record.dense.dtype != torch.float32:
            continue
        size = record.dense.numel() * 4
        if size > SMALL_DENSE_BYTES:
            continue
        device = record.dense.device
        device_groups = by_device.setdefault(device, [[]])
        if used.get(device, 0) + size > SMALL_DENSE_GROUP_BYTES:
            device_groups.append([])
            used[device] = 0
        device_groups[-1].append(k)
        used[device] = used.get(device, 0) + size
    groups = []
    for device_groups in by_device.values():
        for members in device_groups:
            batch = records[members[0]].dense.shape[0]
            blocks = [_as_rows(records[k].dense, batch) for k in members]
            flat = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
            sizes = [block.shape[1] for block in blocks]
            terms = [geometry_terms(geometry, k) for k in members]
            shift, scale = (
                _side_by_side([t[j] for t in terms], sizes, identity, flat.device)
                for j, identity in ((0, 0.0), (1, 1.0))
            )
            groups.append(DenseGroup(members, flat, sizes, shift, scale))
    return groups


def _as_rows(dense: torch.Tensor, batch: int) -> torch.Tensor:
    return dense if dense.dim() == 2 else dense.reshape(batch, -1)


def small_dense_sums(
    records: Sequence[ParamRecord | None],
    groups: Sequence[DenseGroup],
    factors: torch.Tensor,
    keep: torch.Tensor | None,
) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
    """``sum_i f_i G_i`` (float32) of the records of ``groups``, keyed by their index in ``records``, and
    per group the buffer they are views of (``[sum n]``): one GEMV per group. ``keep`` masks dropped
    examples out, as in :func:`weighted_sum`."""
    sums: dict[int, torch.Tensor] = {}
    buffers = []
    for group in groups:
        flat = group.flat
        f = as_dtype(on_device(factors, flat.device), torch.float32)
        if keep is not None:
            flat = mask_batch(flat, on_device(keep, flat.device))
        buffers.append(f @ flat)
        for k, total in zip(group.members, buffers[-1].split(group.sizes)):
            shape = records[k].param.shape
            sums[k] = total if total.shape == shape else total.view(shape)
    return sums, buffers


def to_w_sums(
    totals: Sequence[torch.Tensor],
    total_factor: torch.Tensor,
    shifts: Sequence[torch.Tensor | None],
    scales: Sequence[torch.Tensor | None],
) -> None:
    """``sum_i f_i (G_i - c) / s = (sum_i f_i G_i - (sum_i f_i) c) / s`` of each of ``totals``, in place (fresh
    float32 sums of :func:`clipped_sum`'s own): per device, one multi-tensor product and subtraction for
    the shifted ones and one division for the scaled ones, not three kernels per tensor."""
    by_device: dict[torch.device, tuple[list, list, list, list]] = {}
    for total, shift, scale in zip(totals, shifts, scales):
        shifted, cs, scaled, ss = by_device.setdefault(total.device, ([], [], [], []))
        if shift is not None:
            shifted.append(total)
            cs.append(as_dtype(shift, torch.float32))
        if scale is not None:
            scaled.append(total)
            ss.append(as_dtype(scale, torch.float32))
    for device, (shifted, cs, scaled, ss) in by_device.items():
        if shifted:
            torch._foreach_sub_(shifted, torch._foreach_mul(cs, total_factor.to(device)))
        if scaled:
            torch._foreach_div_(scaled, ss)


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
    if ghost:  # (a geometry's materialized norms bound the products the outers hold: geometry_sq_norms)
        records = model_precision_records(records)
    norms_of = {"params": params, "geometry": geometry, "ghost": ghost, "device": device, "budget": budget}
    groups, grams = small_dense_groups(records, geometry), GramCache()
    identity: list[torch.Tensor] = []  # materialized: ||G_i||^2 of the tensors with outers
    sq = sq_norms(
        records, batch=batch, dtype=torch.float32, groups=groups, grams=grams, identity=identity, **norms_of
    )
    bound = rounding_bound(records, batch, device, grams) if ghost else None  # after: the banks' S_k
    redo = ~torch.isfinite(sq) | (sq < 0)  # overflow (inf, inf - inf) or cancellation below 0
    outers = [o for record in records if record is not None for o in record.outers]
    if ghost:
        risk = gram_underflow_risk(outers, grams.diagonal_maxima)
        if risk is not None:
            redo |= on_device(risk, device)
    # Cancellation (a norm of exactly 0), absorbed entries and hidden underflow; materialized: in G_i's space.
    guard_scales = None if ghost else [geometry_terms(geometry, k)[1] for k in range(len(params))]
    thresholds = cancellation_threshold(records, batch, device, grams, ghost, guard_scales)
    if thresholds is not None:  # (sq is float64)
        identity_sq = sq if ghost else torch.stack([on_device(x, device) for x in identity]).double().sum(0)
        redo |= identity_sq < thresholds[0]
        if thresholds[1] is not None:  # materialized, in w coordinates
            redo |= sq < thresholds[1]
    norms = sq.sqrt() if bound is None else bound.inflate(sq)  # NaN where still negative: dropped
    factors = clip_factors(norms, geometry.max_grad_norm)
    keep = factors > 0
    # The examples the float32 book-keeping sums: kept and not redone. A redo changes its own rows only,
    # so they are known before it, and one host read answers both questions (one wait on a GPU).
    fast = keep & ~redo
    any_redo, all_fast = torch.stack([redo.any(), fast.all()]).tolist()
    rows, subset = None, None
    if any_redo:
        rows = redo.nonzero().squeeze(1)
        subset = [r.select(rows.to(r.param.device)) if r is not None else None for r in records]
        sq[rows] = sq_norms(subset, batch=rows.shape[0], dtype=torch.float64, **norms_of)
        # redone in float64, sums too: no tensor-core error to absorb (NaN where still negative: dropped)
        norms[rows] = sq[rows].to(norms.dtype).sqrt()
        factors = clip_factors(norms, geometry.max_grad_norm)
        keep = factors > 0
    fast = None if all_fast else fast
    total_factor = factors.sum()
    grouped, buffers = small_dense_sums(records, groups, factors, fast)
    tensor_core = grouped_tensor_core_sums(records, factors, fast, budget)  # equal-shape bf16 layers at once
    shared = ScaledFactors(outers)
    sums = []
    for k, (p, record) in enumerate(zip(params, records)):
        if record is None:
            total = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        else:
            f = on_device(factors, p.device)
            total = grouped[k] if k in grouped else tensor_core.get(k)
            if total is None:
                # Every tensor-core outer's norm absorbed the split's deviation: ghost mode's rounding
                # bound, or a geometry's slack in w coordinates (geometry_sq_norms).
                total = weighted_sum(
                    record,
                    f,
                    on_device(fast, p.device) if fast is not None else None,
                    tensor_cores=True,
                    shared=shared,
                )
            if rows is not None:  # the redone examples' share, in float64 (<= C each: representable)
                index = rows.to(p.device)
                part = weighted_sum(subset[k], f[index], keep.to(p.device)[index], torch.float64)
                total = total.add_(part.float())
        sums.append(total)
    # To w coordinates, all at once: each grouped record's sum is a view of its group's buffer.
    unmapped = [k for k in range(len(params)) if k not in grouped]
    terms = [geometry_terms(geometry, k) for k in unmapped] + [(g.shift, g.scale) for g in groups]
    shifts, scales = [shift for shift, _ in terms], [scale for _, scale in terms]
    to_w_sums([sums[k] for k in unmapped] + buffers, total_factor, shifts, scales)
    return sums, norms.float()
