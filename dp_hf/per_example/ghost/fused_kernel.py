"""The Triton source of :mod:`~dp_hf.per_example.ghost.fused`'s kernel (imported only when it is first used).

The function is jitted by :func:`~dp_hf.per_example.ghost.fused._kernel`, not here: Triton chooses between
compiling and interpreting when a function is jitted, and its interpreter patches ``tl`` in this module's
globals.
"""

from __future__ import annotations

import triton.language as tl

__all__ = ["geometry_norms_kernel"]


def geometry_norms_kernel(
    rows_ptr, cols_ptr, shift_ptr, scale_ptr, out_ptr,
    batch, positions, num_rows, num_cols, num_tiles,
    stride_rb, stride_rt, stride_rr, stride_cb, stride_ct, stride_cc,
    HAS_SHIFT: tl.constexpr, HAS_SCALE: tl.constexpr, ABS: tl.constexpr,
    UPCAST: tl.constexpr, EXAMPLES: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    tiles_c = tl.cdiv(num_cols, BLOCK_C)
    r = (tile // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = (tile % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = (r[:, None] < num_rows) & (c[None, :] < num_cols)
    offsets = r[:, None] * num_cols + c[None, :]
    # Outside the weight: shift 0 and scale 1, so that the zero products there add 0.
    if HAS_SHIFT:
        shift = tl.load(shift_ptr + offsets, mask=inside, other=0.0)
    else:
        shift = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + offsets, mask=inside, other=1.0)
    else:
        scale = tl.full((BLOCK_R, BLOCK_C), 1.0, dtype=tl.float32)
    t = tl.arange(0, BLOCK_T)
    first = tl.program_id(1) * EXAMPLES
    for k in range(EXAMPLES):
        i = first + k
        if i < batch:
            row_base = rows_ptr + i.to(tl.int64) * stride_rb
            col_base = cols_ptr + i.to(tl.int64) * stride_cb
            g = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
            a = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
            for t0 in range(0, positions, BLOCK_T):
                tt = t0 + t
                lhs = tl.load(
                    row_base + tt[None, :] * stride_rt + r[:, None] * stride_rr,
                    mask=(r[:, None] < num_rows) & (tt[None, :] < positions),
                    other=0.0,
                )  # [BLOCK_R, BLOCK_T]: rows_{i,t} transposed
                rhs = tl.load(
                    col_base + tt[:, None] * stride_ct + c[None, :] * stride_cc,
                    mask=(tt[:, None] < positions) & (c[None, :] < num_cols),
                    other=0.0,
                )  # [BLOCK_T, BLOCK_C]
                # Triton's interpreter multiplies bf16 operands as their bits: it takes exact float32 copies.
                if UPCAST:
                    lhs, rhs = lhs.to(tl.float32), rhs.to(tl.float32)
                g = tl.dot(lhs, rhs, g, input_precision="ieee")
                if ABS:
                    a = tl.dot(tl.abs(lhs), tl.abs(rhs), a, input_precision="ieee")
            w = g
            if HAS_SHIFT:
                w = w - shift
            if HAS_SCALE:
                w = w / scale
            out = out_ptr + i * num_tiles + tile
            tl.store(out, tl.sum(tl.sum(w * w, axis=1), axis=0))
            tl.store(out + batch * num_tiles, tl.sum(tl.sum(g * g, axis=1), axis=0))
            if ABS:
                x = a
                if HAS_SCALE:
                    x = x / scale
                tl.store(out + 2 * batch * num_tiles, tl.sum(tl.sum(x * x, axis=1), axis=0))
