"""Book-keeping sums of equal-shape bf16 layers on tensor cores, a few kernels per group of layers.

On a GPU the clipping pass of a bf16 transformer is bound by the host: each Linear weight's clipped sum
``sum_i f_i G_i`` by the two-term split (:func:`~dp_hf.per_example.ghost.kernels.outer_weighted_sum`,
``tensor_cores``) costs ~12 ATen calls and 5 kernel launches, while its GEMM is small (BERT-base at B64
L128: ~34 ms of kernels in an 85 ms step). A transformer's weights come in few shapes (BERT-base: 48 of
768 x 768, 12 of 3072 x 768, 12 of 768 x 3072), so the layers whose factors have the same shapes are summed
together (:func:`grouped_tensor_core_sums`)::

    narrow = stack_k(narrow factor of layer k)            [L, B, T, W]   (the narrower of rows and cols)
    hi     = bf16(f * narrow) ;  -lo = bf16(hi - f * narrow)          (one kernel each, as per layer)
    exact  = stack_k(other factor of layer k)             [L, B, T, W']
    S_k    = hi_k^T exact_k - (-lo_k)^T exact_k           (two batched tensor-core GEMMs, float32 output)

Each ``S_k`` has exactly the per-layer arithmetic (the same bf16 operands, float32 accumulation over the
``B T`` positions), so the split's bound (``|S_k - sum_i f_i G_i| <= eta sum_i f_i A_i`` entrywise,
:mod:`~dp_hf.per_example.ghost.tensor_cores`) holds unchanged: only the GEMMs' blocking may differ.
Groups are cut into chunks whose stacked buffers fit the pass's byte budget.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dp_hf.per_example.ghost.kernels import bf16_split, on_device, on_tensor_cores
from dp_hf.per_example.ghost.records import ParamRecord

__all__ = ["grouped_tensor_core_sums"]


def _group_key(record: ParamRecord | None) -> tuple | None:
    """The factors' shapes and device of a record that is one tensor-core outer (a bf16 CUDA Linear-like weight
    used once), else ``None``."""
    if record is None or record.dense is not None or len(record.outers) != 1:
        return None
    o = record.outers[0]
    if not on_tensor_cores(o):
        return None
    return tuple(o.rows.shape), tuple(o.cols.shape), o.cols.device


def grouped_tensor_core_sums(
    records: Sequence[ParamRecord | None],
    factors: torch.Tensor,
    keep: torch.Tensor | None,
    budget: int,
) -> dict[int, torch.Tensor]:
    """``sum_i f_i G_i`` (float32, the parameter's shape) of every record that is one tensor-core outer and
    shares its factors' shapes with another, keyed by its index in ``records``; the others are left to the
    per-layer path. ``keep`` (``[B]`` bool) masks dropped examples' rows out of both factors, as the per-layer
    path does. Each sum is a view of its chunk's ``[L, R, C]`` output, a fresh buffer of this function's.
    """
    groups: dict[tuple, list[int]] = {}
    for k, record in enumerate(records):
        key = _group_key(record)
        if key is not None:
            groups.setdefault(key, []).append(k)
    sums: dict[int, torch.Tensor] = {}
    for (rows_shape, cols_shape, device), members in groups.items():
        if len(members) < 2:
            continue
        batch, positions, num_rows = rows_shape
        num_cols = cols_shape[2]
        scale_rows = num_rows <= num_cols  # (the per-layer path's choice: the narrower factor is split)
        narrow, wide = (num_rows, num_cols) if scale_rows else (num_cols, num_rows)
        # Per layer, the transients: the stacked narrow factor, hi and -lo, the stacked other factor (bf16);
        # not the [R, C] output, which the per-layer path makes too.
        per_layer = 2 * batch * positions * (3 * narrow + wide)
        size = max(1, budget // per_layer)
        f = on_device(factors, device).float()[None, :, None, None]
        mask = None if keep is None else on_device(keep, device)[None, :, None, None]
        for start in range(0, len(members), size):
            part = members[start : start + size]
            outers = [records[k].outers[0] for k in part]
            rows = torch.stack([o.rows for o in outers])
            cols = torch.stack([o.cols for o in outers])
            if mask is not None:
                rows, cols = torch.where(mask, rows, 0.0), torch.where(mask, cols, 0.0)
            short, other = (rows, cols) if scale_rows else (cols, rows)
            hi, neg_lo = bf16_split(short, f)  # (the per-layer path's split, of the stacked factors)
            count = len(part)
            hi, neg_lo = hi.view(count, -1, narrow), neg_lo.view(count, -1, narrow)
            other = other.view(count, -1, wide)
            if scale_rows:  # [L, R, C] = hi^T cols - (-lo)^T cols
                out = torch.bmm(hi.transpose(1, 2), other, out_dtype=torch.float32)
                out.sub_(torch.bmm(neg_lo.transpose(1, 2), other, out_dtype=torch.float32))
            else:  # [L, R, C] = rows^T hi - rows^T (-lo)
                out = torch.bmm(other.transpose(1, 2), hi, out_dtype=torch.float32)
                out.sub_(torch.bmm(other.transpose(1, 2), neg_lo, out_dtype=torch.float32))
            for j, k in enumerate(part):
                sums[k] = out[j].view(records[k].param.shape)
    return sums
