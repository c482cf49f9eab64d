"""What one clipping pass shares between its Gram matrices, and the data-dependent part of the tensor-core bound.

:class:`GramCache` holds, keyed by :func:`tensor_key`, what the ghost norms of one pass compute once
(a shared cols Gram, diagonal maxima, position norms) and, for tensor-core Grams, each Frobenius
product's first-order error bound (:func:`gram_product_error`).

**The first-order bound.** For two outers ``x``, ``y`` of a tensor (``x = y`` for a ghost norm) the
Frobenius product ``<X_i, Y_i> = <R, C>`` of their rows' Gram ``R = rows_x rows_y^T`` and cols' Gram
``C = cols_x cols_y^T`` is computed from tensor-core Grams ``R^ = R + E_R``, ``C^ = C + E_C``, with
``|E_R[s,t]| <= g_r ||rows_{x,s}|| ||rows_{y,t}||`` and ``|E_C[s,t]| <= g_c ||cols_{x,s}|| ||cols_{y,t}||``
(``g_r = g_{K_r}(4u)``, ``g_c = g_{K_c}(4u)`` for contraction widths ``K_r``, ``K_c``;
:mod:`~dp_hf.per_example.ghost.tensor_cores`). Since ``<R^, C^> - <R, C> = <E_R, C^> + <R^, E_C> - <E_R, E_C>``,

    ``|<R^, C^> - <R, C>| <= g_r n_rx^T |C^| n_ry + g_c n_cx^T |R^| n_cy + g_r g_c S_x S_y``

(``n``: position norms, ``S = sum_t ||rows_t|| ||cols_t||``), every term computable from the Grams
the norm already formed. The Gram-free bound takes ``|C^[s,t]|`` at its worst, ``n_cx,s n_cy,t``:
``~(g_r + g_c) S_x S_y``. With a token-level loss (a causal LM) the positions' output gradients are
nearly orthogonal, so their Gram is nearly diagonal and its term shrinks by up to ``T``; the
activations' Gram stays dense, and its term weighs by the gradients' width only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from dp_hf.per_example.ghost.kernels import Outer

__all__ = [
    "U_TENSOR_CORES",
    "GramCache",
    "gamma",
    "gram_product_error",
    "position_norms",
    "tensor_key",
    "underflow_margin",
]

U32 = 2.0**-24  # float32's unit roundoff
#: Per-product unit of a tensor-core dot product's error bound: truncated alignment and normalization
#: in blocks of any size (:mod:`~dp_hf.per_example.ghost.tensor_cores`), against float32 round-to-nearest's ``u``.
U_TENSOR_CORES = 4 * U32


def gamma(n: int, unit: float = U32) -> float:
    """``g_n = n u / (1 - n u)``: the relative error bound of ``n`` float32 operations (Higham), each erring
    by at most ``unit`` relative (``u``: round to nearest; :data:`U_TENSOR_CORES`: a tensor-core dot product)."""
    nu = n * unit
    if nu >= 0.5:
        raise ValueError(f"a float32 accumulation of length {n} has no useful error bound")
    return nu / (1 - nu)


def tensor_key(t: torch.Tensor) -> tuple:
    """Identifies a tensor's values while every recorded tensor is alive (one clipping pass): the
    same memory, read the same way. Layers that take the same input (q, k and v) share its key."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def underflow_margin(width: int) -> float:
    """``2^-63 sqrt(W)``: what a float32 norm of ``W`` entries may lose to squares below ``2^-126``,
    which flush to zero (at most ``W 2^-126`` of the squared norm; ``sqrt(a + b) <= sqrt(a) + sqrt(b)``)."""
    return 2.0**-63 * math.sqrt(width)


def position_norms(x: torch.Tensor) -> torch.Tensor:
    """An upper bound on ``||x_{i,t}||``, ``[B, T]`` float32: the float32 norm plus ``2^-63 sqrt(W)``.

    Float32 squares below ``2^-126`` flush to zero (a position of ``2^-76`` entries has norm 0 in
    float32); they add at most ``W 2^-126`` to a squared norm, hence the term. Squares above float32's
    range give inf, which sends the example to float64.
    """
    return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).add_(underflow_margin(x.shape[-1]))


#: What a float32 operation whose result falls below the normal range may lose, absolutely: its
#: subnormal rounding, or the whole result where a GPU kernel flushes subnormals to zero.
FLUSH = 2.0**-126


def _weighted_abs_sum(gram: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """An upper bound on ``W = sum_{s,t} |gram[..., s, t]| left[..., s] right[..., t]``, ``[...]`` float64.

    ``|gram| @ right`` then the dot product with ``left``, in float32: sums of ``Tx + Ty`` nonnegative
    terms, low by at most ``g_(Tx+Ty)(u)`` relative, and by ``FLUSH`` per operation whose result falls
    below float32's normal range (``2 Ty`` in each ``y_s``, then weighed by ``left_s``, and ``2 Tx``
    in the dot product), which the returned value adds back."""
    tx, ty = gram.shape[-2:]
    computed = torch.linalg.vecdot(torch.matmul(gram.abs(), right.unsqueeze(-1)).squeeze(-1), left)
    flushed = FLUSH * (2 * ty * left.sum(dim=-1, dtype=torch.float64) + 2 * tx)
    return (computed.double() + flushed) * (1 + 2 * gamma(tx + ty))


def gram_product_error(
    rows: torch.Tensor,
    cols: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    gammas: tuple[torch.Tensor | float, torch.Tensor | float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``<R^, C^>`` and its first-order error (module docstring), both ``[...]`` float64, from float32 Grams
    ``rows`` and ``cols`` ``[..., Tx, Ty]`` and position norms ``norms = (n_rx, n_ry, n_cx, n_cy)``;
    ``gammas = (g_r, g_c)`` broadcast against the leading dimensions.

    The products ``R^_st C^_st`` are float32 (each within ``u`` relative, or ``FLUSH`` below the normal
    range), summed in float64: their error is at most ``u sum |R^| |C^| + Tx Ty FLUSH``, and
    ``|C^_st| <= (1 + g_c) n_cx,s n_cy,t``, so it joins the ``|R^|`` term as ``u (1 + g_c)``. The error is
    ``(g_c + u (1 + g_c)) W_c + g_r W_r + Tx Ty FLUSH``, ``W_c = n_cx^T |R^| n_cy`` and ``W_r = n_rx^T |C^| n_ry``
    (:func:`_weighted_abs_sum`). Float32 throughout, one buffer of the Grams' size at a time: on a GPU,
    ~40 bytes of traffic per Gram entry, against ~110 for float64 copies."""
    n_rx, n_ry, n_cx, n_cy = norms
    g_r, g_c = gammas
    tx, ty = rows.shape[-2:]
    value = torch.sum(rows * cols, dim=(-2, -1), dtype=torch.float64)
    error = (g_c + U32 * (1 + g_c)) * _weighted_abs_sum(rows, n_cx, n_cy)
    error = error.add_(g_r * _weighted_abs_sum(cols, n_rx, n_ry))
    return value, error.add_(tx * ty * FLUSH)


class GramCache:
    """What one clipping pass computes once, keyed by :func:`tensor_key`: the latest cols Gram
    (consecutive layers fed the same input, attention's q, k and v, compute it once; only one is
    held); per factor of a ghost norm, the per-example maximum of its Gram's diagonal,
    ``max_t ||x_{i,t}||^2`` (the underflow test's witness, ``kernels.gram_underflow_risk``); per
    banked outer (keyed by its rows' and cols' keys), ``S_i = sum_t ||rows_{i,t}|| ||cols_{i,t}||``
    from its two Grams' diagonals (:meth:`witness_bank`), which the cancellation guard and the
    tensor-core bound need and would otherwise take two more reductions of the factors each; the
    position norms of the other outers' factors, taken once (:meth:`factor_norms`); and per pair of
    tensor-core outers (keyed by their keys), the first-order error of their Frobenius product
    (``errors``, :func:`gram_product_error`)."""

    def __init__(self) -> None:
        self.latest: dict[tuple, torch.Tensor] = {}
        self.diagonal_maxima: dict[tuple, torch.Tensor] = {}
        self.norm_sums: dict[tuple, torch.Tensor] = {}
        self.position_norms: dict[tuple, torch.Tensor] = {}
        self.errors: dict[tuple, torch.Tensor] = {}

    def factor_norms(self, x: torch.Tensor) -> torch.Tensor:
        """:func:`position_norms` of ``x``, taken once per pass (q, k and v share their input's)."""
        key = tensor_key(x)
        if key not in self.position_norms:
            self.position_norms[key] = position_norms(x)
        return self.position_norms[key]

    def witness(self, factor: torch.Tensor, gram: torch.Tensor) -> None:
        """Keep ``max_t`` of the diagonal of ``factor``'s float32 Gram ``[B, T, T]`` (its per-position
        squared norms); a shared factor's once."""
        key = tensor_key(factor)
        if key not in self.diagonal_maxima:
            self.diagonal_maxima[key] = gram.diagonal(dim1=1, dim2=2).amax(dim=1)

    def witness_bank(
        self, keys: Sequence[tuple], bank: torch.Tensor, outers: Sequence[Outer] = (), width: int = 1
    ) -> torch.Tensor | None:
        """:meth:`witness` for a bank ``[N, B, T, T]`` of float32 Grams at once (``keys[n]``: the
        :func:`tensor_key` of ``bank[n]``'s factor): one reduction for all of them.

        ``outers`` (``n``: the bank holds their rows' Grams, then their cols'): also keep each one's
        ``S_i = sum_t (sqrt(diag_rows) + m) (sqrt(diag_cols) + m)``, ``m`` the :func:`underflow_margin`
        of ``width`` (the widest factor), and return the position norms ``[2 n, B, T]`` they took. The
        diagonals are float32 sums of the same squares a float32 norm of each position adds up (exact
        products, bf16 ones on tensor cores), so ``S_i`` bounds ``sum_t ||rows_{i,t}|| ||cols_{i,t}||``
        as :func:`position_norms` does.
        """
        diagonals = bank.diagonal(dim1=2, dim2=3)
        for key, maxima in zip(keys, diagonals.amax(dim=2).unbind(0)):
            self.diagonal_maxima.setdefault(key, maxima)
        if not outers:
            return None
        n = len(outers)
        norms = diagonals.sqrt().add_(underflow_margin(width))  # [2 n, B, T]
        sums = torch.linalg.vecdot(norms[:n], norms[n:])  # [n, B]
        for o, value in zip(outers, sums.unbind(0)):
            self.norm_sums.setdefault(o.keys, value)
        return norms
