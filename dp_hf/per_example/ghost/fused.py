"""Materialized norms without materializing: one Triton kernel per layer for a geometry's per-example norms.

A geometry ``(c, s)`` (DP-MacAdam, scale-then-privatize) needs ``||(G_i - c) / s||^2`` of every example's
gradient ``G_i = sum_t rows_{i,t} (x) cols_{i,t}`` of a Linear-like weight (``[R, C]``). The torch path
(:func:`~dp_hf.per_example.ghost.norms.geometry_sq_norms`) writes ``G_i`` for a chunk of examples, shifts,
scales and reduces it, and for bf16 factors on tensor cores does the same with ``A_i = sum_t |rows_{i,t}| (x)
|cols_{i,t}|``: about 44 bytes of memory traffic per entry of ``G_i`` (~300 GB a step for BERT-base at B64,
on an H100 189 ms of the step's 248). This kernel computes, for every example ``i`` and one launch per
layer::

    sq_i    = sum_{r,c} ((G_i[r,c] - c[r,c]) / s[r,c])^2      (the norm the clip factor uses)
    ident_i = sum_{r,c} G_i[r,c]^2                           (the cancellation guard's ||G_i||^2)
    abs_i   = sum_{r,c} (A_i[r,c] / s[r,c])^2                (bf16: the tensor-core slack's ||A_i / s||^2)

Each program owns one ``[BLOCK_R, BLOCK_C]`` tile of the weight and a group of examples: it loads its tile
of ``c`` and ``s`` once, and for each example accumulates the tile of ``G_i`` (and ``A_i``) in registers
over the ``T`` positions (``tl.dot``), squares and reduces it, and writes one float32 partial sum per
(example, tile). ``G_i`` never reaches memory; the partials are summed per example in float64 (a
deterministic order: no atomics).

Arithmetic, and why the torch path's bounds still hold:

* float32 factors: ``tl.dot(..., input_precision="ieee")``, full float32 products and sums, as the torch
  path's matmuls under :func:`~dp_hf.precision.ieee_float32_matmuls` (never TF32);
* bf16 factors: bf16 products (exact in float32) accumulated in float32 by the tensor cores, the same
  ``mma`` instructions as cuBLAS's bf16 GEMMs with float32 output: ``|G^_i - G_i| <= g_T(4u) A_i``
  entrywise and ``A^_i >= (1 - g_T) A_i``, the model of :mod:`~dp_hf.per_example.ghost.tensor_cores`
  that the caller's slack absorbs. Both ``G^_i`` and ``A^_i`` come from the same loads;
* the squares of one tile (``BLOCK_R * BLOCK_C`` non-negative terms) are reduced by a tree in float32
  (relative error ``<= log2(n) u``, below the torch reduction's), the tiles in float64;
* an overflow (``inf``, ``inf - inf``) gives a non-finite ``sq_i``, which the caller redoes in float64
  through the torch path, as before.

Used on CUDA when Triton is installed (``DP_HF_FUSED_NORMS=0`` turns it off). The first launch of each
kind (dtype, shift, scale) is compared with the torch path on that call's examples; a mismatch warns and
falls back to the torch path for the rest of the process, so a miscompiled kernel costs speed, never the
clip bound. On a CPU the kernel runs only in Triton's interpreter (``TRITON_INTERPRET=1``), for tests.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from dp_hf.per_example.ghost.grams import U32, U_TENSOR_CORES, gamma
from dp_hf.per_example.ghost.kernels import on_tensor_cores
from dp_hf.per_example.ghost.records import ParamRecord
from dp_hf.per_example.ghost.tensor_cores import tensor_core_slack

__all__ = [
    "FUSED_NORMS_ENV",
    "fused_enabled",
    "fused_geometry_sq_norms",
    "fused_outer_norms",
    "fused_supports",
]

#: Set to ``0`` to use the torch path on CUDA too (benchmarks compare the two).
FUSED_NORMS_ENV = "DP_HF_FUSED_NORMS"

_BLOCK_R = 64
_BLOCK_C = 64
_BLOCK_T = 32
#: Examples per program: enough programs for a small layer (a 768 x 768 weight has 144 tiles) to fill a GPU,
#: few enough that each loads its tile of ``c`` and ``s`` for many examples.
_EXAMPLES_PER_PROGRAM = 8

#: Examples of the first launch of each kind compared with the torch path.
_CROSS_CHECK_EXAMPLES = 2

_checked: set[tuple] = set()
_disabled: list[str] = []  # why the kernel was turned off in this process (empty: on)


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # an import error of any kind: the torch path
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fused_enabled(device: torch.device) -> bool:
    """Whether geometry norms on ``device`` run the fused kernel: CUDA (or Triton's interpreter, which tests set)
    with Triton importable, ``DP_HF_FUSED_NORMS`` not ``0``, and no failed cross-check in this process."""
    if os.environ.get(FUSED_NORMS_ENV, "1") == "0" or _disabled:
        return False
    if device.type != "cuda" and not _interpreting():
        return False
    return _triton_available()


def fused_supports(rows: torch.Tensor, cols: torch.Tensor) -> bool:
    """Whether an outer's factors (``[B, T, R]`` and ``[B, T, C]``, not ids) fit the kernel: float32 or bf16, one
    dtype, one device."""
    return (
        rows.dim() == 3
        and cols.dim() == 3
        and rows.dtype == cols.dtype
        and rows.dtype in (torch.float32, torch.bfloat16)
        and rows.device == cols.device
        and rows.shape[:2] == cols.shape[:2]
    )


@functools.cache
def _kernel(interpret: bool):
    """The jitted kernel, built on first use (importing dp_hf does not import Triton); ``interpret`` keys the
    cache, since Triton picks its interpreter when a function is jitted."""
    import triton

    from dp_hf.per_example.ghost import fused_kernel

    del interpret
    return triton.jit(fused_kernel.geometry_norms_kernel)


def _launch(
    rows: torch.Tensor,
    cols: torch.Tensor,
    shift: torch.Tensor | None,
    scale: torch.Tensor | None,
    absolute: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    batch, positions, num_rows = rows.shape
    num_cols = cols.shape[2]
    tiles = -(-num_rows // _BLOCK_R) * -(-num_cols // _BLOCK_C)
    partials = torch.empty(3 if absolute else 2, batch, tiles, dtype=torch.float32, device=cols.device)
    shift = shift.reshape(num_rows, num_cols).float().contiguous() if shift is not None else None
    scale = scale.reshape(num_rows, num_cols).float().contiguous() if scale is not None else None
    grid = (tiles, -(-batch // _EXAMPLES_PER_PROGRAM))
    _kernel(_interpreting())[grid](
        rows, cols, shift if shift is not None else partials, scale if scale is not None else partials, partials,
        batch, positions, num_rows, num_cols, tiles,
        *rows.stride(), *cols.stride(),
        HAS_SHIFT=shift is not None, HAS_SCALE=scale is not None, ABS=absolute,
        UPCAST=_interpreting() and rows.dtype == torch.bfloat16,
        EXAMPLES=_EXAMPLES_PER_PROGRAM, BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C, BLOCK_T=_BLOCK_T,
    )  # fmt: skip
    sums = partials.double().sum(dim=2)
    return sums[0].float(), sums[1].float(), sums[2] if absolute else None


def _reference(
    rows: torch.Tensor,
    cols: torch.Tensor,
    shift: torch.Tensor | None,
    scale: torch.Tensor | None,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The three sums from ``G_i`` and ``A_i`` formed by ``mm`` in float32 (the cross-check), and the
    magnitude ``||(A_i + |c|) / s||^2`` that bounds how far two float32 evaluations of them may differ.

    One example at a time, in place: three ``[R, C]`` float32 buffers at most (540 MB for a 4096 x 11008
    weight), once per process."""
    shape = (rows.shape[2], cols.shape[2])
    c = shift.reshape(shape).float() if shift is not None else None
    s = scale.reshape(shape).float() if scale is not None else None
    out = torch.zeros(4, rows.shape[0], dtype=torch.float64, device=rows.device)
    for i in range(rows.shape[0]):
        g = rows[i].t().float() @ cols[i].float()
        a = rows[i].t().abs().float() @ cols[i].abs().float()
        out[1, i] = g.square().sum()
        if c is not None:
            g.sub_(c)
        if s is not None:
            g.div_(s)
            a.div_(s)
        out[0, i], out[2, i] = g.square().sum(), a.square().sum()
        del g
        size = a if c is None else a.add_(c.abs() / s if s is not None else c.abs())
        out[3, i] = size.square().sum()
    return (out[0].float(), out[1].float(), out[2]), out[3]


def _cross_check(
    result: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    rows: torch.Tensor,
    cols: torch.Tensor,
    shift: torch.Tensor | None,
    scale: torch.Tensor | None,
) -> str | None:
    """``None`` if the first examples' sums agree with :func:`_reference` within twice what two float32 (or
    tensor-core) evaluations may differ by, else what differs.

    Each entry of ``G_i`` is off by at most ``g_T A_i`` in either evaluation (``u`` per float32 operation, ``4 u``
    on tensor cores), so ``|sq - sq'| <= (4 g_T + 4 g_T^2) ||(A_i + |c|) / s||^2`` plus the reductions'
    ``g_n`` of the sums; the tolerance is 8 ``g_T`` times the magnitude, plus ``1e-6`` of it for the reductions.
    A lost tile or example, or a misread stride, is off by far more at the sizes the kernel runs."""
    n = min(rows.shape[0], _CROSS_CHECK_EXAMPLES)
    sums, magnitude = _reference(rows[:n], cols[:n], shift, scale)
    unit = U_TENSOR_CORES if rows.dtype == torch.bfloat16 else U32
    tolerance = (8 * gamma(rows.shape[1], unit) + 1e-6) * magnitude + 1e-30
    for name, got, want in zip(("sq", "ident", "abs"), result, sums):
        if got is None:
            continue
        got, want = got[:n].double(), want.double()
        bad = ((got - want).abs() > tolerance) & torch.isfinite(want)
        if bool(bad.any()):
            return f"{name} {got.tolist()} against {want.tolist()}, tolerance {tolerance.tolist()}"
    return None


def fused_outer_norms(
    rows: torch.Tensor,
    cols: torch.Tensor,
    shift: torch.Tensor | None,
    scale: torch.Tensor | None,
    *,
    absolute: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``(sq, ident, abs)`` of the module docstring for every example of the outer ``(rows, cols)``: ``[B]``
    float32, float32, and float64 (``None`` unless ``absolute``), or ``None`` if the kernel is off (the
    caller then takes the torch path). ``shift`` and ``scale`` have ``R * C`` entries (``None``: 0 and 1).

    The first call of each kind in a process is checked against the torch path on its first examples
    (:func:`_cross_check`); a mismatch warns, turns the kernel off and returns ``None``."""
    if not fused_enabled(cols.device):
        return None
    kind = (rows.dtype, shift is not None, scale is not None, absolute, cols.device.type)
    if kind in _checked:
        return _launch(rows, cols, shift, scale, absolute)
    try:  # the first launch of its kind compiles: a Triton or driver that cannot build it is not the user's error
        result = _launch(rows, cols, shift, scale, absolute)
    except Exception as error:  # noqa: BLE001 - any failure to build or run it: the torch path instead
        return _turn_off(f"{type(error).__name__}: {error}", "failed on its first launch")
    mismatch = _cross_check(result, rows, cols, shift, scale)
    if mismatch is not None:
        return _turn_off(mismatch, "disagreed with the torch path on its first launch")
    _checked.add(kind)
    return result


def _turn_off(detail: str, what: str) -> None:
    """Warn once, and use the torch path for the rest of the process (the same norms, slower)."""
    _disabled.append(detail)
    warnings.warn(
        f"dp_hf's fused geometry-norm kernel {what} ({detail[:2000]}); using the torch path for the rest of "
        "this process (slower, same clipping). Please report this with your GPU, torch and triton versions.",
        RuntimeWarning,
        stacklevel=4,
    )


def fused_geometry_sq_norms(
    record: ParamRecord,
    shift: torch.Tensor | None,
    scale: torch.Tensor | None,
    identity: list[torch.Tensor] | None,
) -> torch.Tensor | None:
    """:func:`~dp_hf.per_example.ghost.norms.geometry_sq_norms` (float32) of a record that is one outer of
    factors (a Linear-like weight used once), by the kernel; ``None`` (nothing appended to ``identity``) when
    the record has another form or the kernel is off.

    bf16 factors on CUDA (tensor cores) return ``(||(G^_i - c) / s|| + slack_i)^2`` with ``slack_i`` the
    :func:`~dp_hf.per_example.ghost.tensor_cores.tensor_core_slack` of ``||A^_i / s||``, as the torch path does.
    """
    if record.dense is not None or len(record.outers) != 1:
        return None
    o = record.outers[0]
    if o.rows_are_ids or not fused_supports(o.rows, o.cols):
        return None
    tensor_cores = on_tensor_cores(o)
    result = fused_outer_norms(o.rows, o.cols, shift, scale, absolute=tensor_cores)
    if result is None:
        return None
    sq, ident, absolute = result
    if identity is not None:
        identity.append(ident)
    if absolute is None:
        return sq
    slack = absolute.sqrt() * tensor_core_slack(o.cols.shape[1])
    return (sq.double().sqrt() + slack).square().float()
