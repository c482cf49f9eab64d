"""Per-example gradients as sums of outer products, and the kernels that read them without forming them.

A layer call records, per example ``i``, ``G_i = sum_t rows_{i,t} (x) cols_{i,t}`` (:class:`Outer`):
for a Linear weight ``rows`` are the output gradients and ``cols`` the inputs (``T`` positions:
tokens, patches); for an embedding ``rows`` are token ids (one-hot rows). The kernels compute, in
chunks of examples bounded by a byte budget and in the dtype asked for (float32, or float64 for the
examples redone after an overflow), what clipping needs from such factors:

* Frobenius inner products ``<X_i, Y_i>`` from the two Gram matrices (:func:`outer_inner`; the
  ghost norm is :func:`outer_sq_norm`), also against a dense ``D_i`` (:func:`dense_outer_inner`);
* per (example, distinct token) row sums of embedding factors (:func:`ids_rows`);
* the book-keeping sum ``sum_i f_i G_i = (f * rows)^T cols`` (:func:`outer_weighted_sum`);
* ``G_i`` itself for a chunk of examples (:func:`outer_materialize`).

Factors in bf16 on CUDA (a bf16 layer's, see :mod:`dp_hf.per_example.ghost.tensor_cores`) are
multiplied on tensor cores with float32 accumulation and output when float32 is asked for
(:func:`on_tensor_cores`); the error bound that the clip factor then absorbs is stated there.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dp_hf.per_example.ghost.grams import U_TENSOR_CORES, GramCache, gamma, gram_product_error, tensor_key
from dp_hf.privatizer import mask_batch  # the privatizer's rule: 0 * inf is NaN, so where(), not a product

__all__ = [
    "GramCache",
    "Outer",
    "ScaledFactors",
    "as_dtype",
    "batch_broadcast",
    "batched_matmul",
    "bf16_split",
    "chunks",
    "dense_outer_inner",
    "gram_underflow_risk",
    "ids_rows",
    "ids_sq_norms",
    "mask_batch",
    "on_device",
    "on_tensor_cores",
    "outer_abs_materialize",
    "outer_inner",
    "outer_materialize",
    "outer_sq_norm",
    "outer_weighted_sum",
    "row_gram",
    "tensor_key",
]


@dataclass
class Outer:
    """A per-example gradient of a 2-D view ``[R, C]`` of a parameter: ``G_i = sum_t rows_{i,t} (x) cols_{i,t}``.

    ``rows`` is ``[B, T, R]``, or ``[B, T]`` integer ids standing for one-hot rows (embeddings:
    ``R`` = vocabulary size); ``cols`` is ``[B, T, C]``. Both stay in the model's dtype until used.
    """

    rows: torch.Tensor
    cols: torch.Tensor
    num_rows: int
    rows_are_ids: bool = False

    @property
    def batch_size(self) -> int:
        return int(self.cols.shape[0])

    @functools.cached_property
    def keys(self) -> tuple[tuple, tuple]:
        """``(tensor_key(rows), tensor_key(cols))``, taken once: a clipping pass asks ~6 times per outer
        (the factors are never replaced on an outer; a new outer is made instead)."""
        return tensor_key(self.rows), tensor_key(self.cols)


def on_tensor_cores(o: Outer) -> bool:
    """Whether ``o``'s float32 products run as bf16 GEMMs with float32 accumulation and output (CUDA only)."""
    return (
        not o.rows_are_ids
        and o.rows.dtype == torch.bfloat16
        and o.cols.dtype == torch.bfloat16
        and o.cols.is_cuda
    )


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the dispatcher round trip (an ``aten::to`` per call) when it is already."""
    return t if t.dtype == dtype else t.to(dtype)


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t.to(device)`` without the dispatcher round trip when it is already there."""
    return t if t.device == device else t.to(device)


def batched_matmul(
    x: torch.Tensor,
    y: torch.Tensor,
    dtype: torch.dtype,
    tensor_cores: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ y`` (``bmm``) in ``dtype``, written in ``out`` if given. ``tensor_cores``: bf16 CUDA operands
    asked for float32 stay bf16 (exact products, float32 sums and output, on tensor cores). Only a caller
    whose result is covered by the tensor-core bound (ghost/tensor_cores.py), or whose result is itself
    what is clipped and summed, may ask: the accumulation truncates, and an uncovered product could push
    an example past C."""
    if tensor_cores and dtype == torch.float32 and x.dtype == y.dtype == torch.bfloat16 and x.is_cuda:
        return torch.bmm(x, y, out_dtype=torch.float32, out=out)
    return torch.bmm(as_dtype(x, dtype), as_dtype(y, dtype), out=out)


#: Squares formed at a time by :func:`example_sq_norms` on the CPU (of a tensor it may not overwrite).
SQUARES_CHUNK_BYTES = 1 << 22


def example_sq_norms(x: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
    """``||x_i||^2`` over all dimensions but the first, ``[B]`` in ``x``'s dtype; ``overwrite``: ``x`` may be
    squared in place.

    On the CPU, ``torch.linalg.vector_norm`` adds each SIMD lane's squares one after another (relative
    error up to ~``n u``: 4096 before 2^22 - 1 ones lost 2.5% of the squared norm, an example then
    clipped to 1.013 C), while ``sum()`` adds by cascade (~``u log n``): there the squares are summed, in
    chunks of examples when ``x`` is not ours (no transient of its size). On CUDA both are one float32
    reduction kernel, and ``vector_norm`` reads ``x`` once, where squaring writes and reads it again.
    """
    if x.dim() == 1:  # one entry per example (dim=() would reduce over everything)
        x = x.unsqueeze(1)
    dims = tuple(range(1, x.dim()))  # no reshape: one fewer op
    if x.device.type != "cpu":
        return torch.linalg.vector_norm(x, dim=dims).square()
    if overwrite:
        return x.pow_(2).sum(dim=dims)
    step = max(1, SQUARES_CHUNK_BYTES // max(1, x[0].numel() * x.element_size()))
    parts = [x[start : start + step].square().sum(dim=dims) for start in range(0, x.shape[0], step)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def chunks(batch: int, bytes_per_example: int, budget: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of examples whose transient buffers fit ``budget`` bytes."""
    step = max(1, budget // max(1, bytes_per_example))
    return [(start, min(batch, start + step)) for start in range(0, batch, step)]


# The norm helpers below take the dtype of their arithmetic: float32 for the whole batch, float64 to
# redo the few examples whose float32 result overflowed (see dp_hf.per_example.ghost.norms). Products
# of two float32 numbers are exact in float64 and no sum of them can overflow it.


def _rows_of(t: torch.Tensor, span: tuple[int, int] | None) -> torch.Tensor:
    """The examples ``[start, stop)`` of ``t`` (``None``: all of them, without a slicing op)."""
    return t if span is None else t[span[0] : span[1]]


def row_gram(
    x: Outer,
    y: Outer,
    span: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
    tensor_cores: bool = False,
) -> torch.Tensor:
    """``[n, Tx, Ty]`` inner products of the row factors of ``x`` and ``y`` for the examples ``span``
    (``[start, stop)``; ``None``: all), one-hot rows allowed; ``tensor_cores``: see :func:`batched_matmul`."""
    if x.rows_are_ids and y.rows_are_ids:
        return (_rows_of(x.rows, span)[:, :, None] == _rows_of(y.rows, span)[:, None, :]).to(dtype)
    if x.rows_are_ids:  # <onehot(id_s), r_t> = r_t[id_s]
        dense = as_dtype(_rows_of(y.rows, span), dtype)  # [n, Ty, R]
        ids = _rows_of(x.rows, span)  # [n, Tx]
        return dense.gather(2, ids[:, None, :].expand(-1, dense.shape[1], -1)).transpose(1, 2)
    if y.rows_are_ids:
        return row_gram(y, x, span, dtype).transpose(1, 2)
    return batched_matmul(_rows_of(x.rows, span), _rows_of(y.rows, span).transpose(1, 2), dtype, tensor_cores)


def outer_inner(
    x: Outer, y: Outer, budget: int, dtype: torch.dtype = torch.float32, grams: GramCache | None = None
) -> torch.Tensor:
    """``<X_i, Y_i>_F = sum_{s,t} <rows^x_s, rows^y_t> <cols^x_s, cols^y_t>`` for every example, ``[B]``.

    On tensor cores (both factors bf16, CUDA, float32 asked for) the Grams are float32 from bf16
    GEMMs and their Frobenius product is summed in float64, its products' rounding counted in the
    first-order error (:func:`~dp_hf.per_example.ghost.grams.gram_product_error`). ``grams``
    (one clipping pass's :class:`GramCache`) shares a cols Gram between layers and, for a float32
    ghost norm (``x is y``) of the whole batch, keeps its two Grams' diagonal maxima.
    """
    batch, tx, ty = x.batch_size, x.cols.shape[1], y.cols.shape[1]
    if tx == 1 and ty == 1 and not (x.rows_are_ids or y.rows_are_ids):
        rows = (as_dtype(x.rows, dtype) * as_dtype(y.rows, dtype)).sum(dim=(1, 2))
        cols = (as_dtype(x.cols, dtype) * as_dtype(y.cols, dtype)).sum(dim=(1, 2))
        if grams is not None and x is y and dtype == torch.float32:  # one position: these are the diagonals
            grams.witness(x.rows, rows[:, None, None])
            grams.witness(x.cols, cols[:, None, None])
        return rows * cols
    tensor_cores = dtype == torch.float32 and on_tensor_cores(x) and on_tensor_cores(y)
    per_entry = 3 * dtype.itemsize  # live per Gram entry: the two Grams and their product
    spans = chunks(batch, per_entry * tx * ty, budget)
    if len(spans) == 1:  # the whole batch at once (the usual case): no output buffer, no slices
        out, error = _frobenius(x, y, None, dtype, grams, tensor_cores)
    else:
        out = torch.empty(batch, dtype=dtype, device=x.cols.device)
        error = torch.empty(batch, dtype=torch.float64, device=x.cols.device) if tensor_cores else None
        for span in spans:
            out[span[0] : span[1]], part = _frobenius(x, y, span, dtype, grams, tensor_cores)
            if error is not None:
                error[span[0] : span[1]] = part
    if error is not None and grams is not None:
        grams.errors[(x.keys, y.keys)] = error
    return out


def _frobenius(
    x: Outer,
    y: Outer,
    span: tuple[int, int] | None,
    dtype: torch.dtype,
    grams: GramCache | None,
    tensor_cores: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sum_{s,t} <rows^x_s, rows^y_t> <cols^x_s, cols^y_t>`` for the examples ``span`` (see :func:`outer_inner`),
    and on tensor cores its first-order error (float64, :func:`~dp_hf.per_example.ghost.grams.gram_product_error`)."""
    # A pair with a factor off tensor cores (an embedding's use of a tied tensor against its head's) is
    # multiplied in float32 throughout: the bound covers the tensor-core outers' own products only.
    key = (x.keys[1], y.keys[1], span, dtype, tensor_cores) if grams is not None else None
    cols = grams.latest.get(key) if key is not None else None
    if cols is None:
        cols = batched_matmul(
            _rows_of(x.cols, span), _rows_of(y.cols, span).transpose(1, 2), dtype, tensor_cores
        )
        if key is not None:  # only the latest: layers sharing an input come one after another
            grams.latest.clear()
            grams.latest[key] = cols
    rows = row_gram(x, y, span, dtype, tensor_cores)
    if grams is not None and x is y and span is None and dtype == torch.float32 and not x.rows_are_ids:
        grams.witness(x.rows, rows)
        grams.witness(x.cols, cols)
    if tensor_cores:  # summed in float64, and the bound's first-order terms (kept by a pass's cache)
        factor_norms = (grams if grams is not None else GramCache()).factor_norms
        norms = tuple(_rows_of(factor_norms(f), span) for f in (x.rows, y.rows, x.cols, y.cols))
        gammas = (gamma(x.rows.shape[-1], U_TENSOR_CORES), gamma(x.cols.shape[-1], U_TENSOR_CORES))
        value, error = gram_product_error(rows, cols, norms, gammas)
        return value.float(), error
    return (rows * cols).sum(dim=(1, 2)), None


def ids_rows(
    outers: Sequence[Outer], dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (example, distinct id) row sums of one-hot outers: ``(example, id, r)`` with ``r`` ``[U, C]``.

    ``r_{i,u} = sum_{t: id_{i,t} = u} cols_{i,t}`` over every outer (several calls of the same
    embedding concatenate), which are exactly the non-zero rows of ``G_i``.
    """
    ids = outers[0].rows if len(outers) == 1 else torch.cat([o.rows for o in outers], dim=1)  # [B, T]
    cols = outers[0].cols if len(outers) == 1 else torch.cat([o.cols for o in outers], dim=1)  # [B, T, C]
    batch, num_rows = ids.shape[0], outers[0].num_rows
    keys = (torch.arange(batch, device=ids.device)[:, None] * num_rows + ids).reshape(-1)
    unique, inverse = torch.unique(keys, return_inverse=True)
    rows = torch.zeros(unique.shape[0], cols.shape[-1], dtype=dtype, device=cols.device)
    rows.index_add_(0, inverse, as_dtype(cols.reshape(-1, cols.shape[-1]), dtype))
    return unique // num_rows, unique % num_rows, rows


def batch_broadcast(ids: torch.Tensor) -> bool:
    """Whether every example's ids are the same memory (``[1, T]`` position or token-type ids expanded)."""
    return ids.dim() == 2 and ids.stride(0) == 0


def ids_sq_norms(outers: Sequence[Outer], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``||G_i||_F^2`` of one-hot outers (the uses of one embedding), cross terms included, ``[B]``.

    Ids shared by every example (:func:`batch_broadcast`: BERT's position and token-type ids) need
    no search over ``B T`` keys: each position ``t`` adds its ``cols`` to the row of the first
    position with the same id (a ``[T, T]`` comparison), and the norm is that of the ``[B, T, C]``
    sums. Otherwise :func:`ids_rows`.
    """
    if all(batch_broadcast(o.rows) for o in outers):
        ids = outers[0].rows[0] if len(outers) == 1 else torch.cat([o.rows[0] for o in outers])  # [T]
        cols = outers[0].cols if len(outers) == 1 else torch.cat([o.cols for o in outers], dim=1)
        first = (ids[:, None] == ids[None, :]).to(torch.uint8).argmax(dim=1)  # argmax: the first maximum
        rows = torch.zeros(cols.shape, dtype=dtype, device=cols.device)
        rows.index_add_(1, first, as_dtype(cols, dtype))
        return example_sq_norms(rows, overwrite=True)  # a fresh buffer of ours
    example, _, rows = ids_rows(outers, dtype)  # cross terms included by summing rows first
    out = torch.zeros(outers[0].batch_size, dtype=dtype, device=rows.device)
    return out.index_add_(0, example, rows.pow(2).sum(dim=1))


def outer_sq_norm(
    o: Outer, budget: int, dtype: torch.dtype = torch.float32, grams: GramCache | None = None
) -> torch.Tensor:
    """``||G_i||_F^2`` for every example (the ghost norm), ``[B]``; ``grams``: see :func:`outer_inner`."""
    if o.rows_are_ids:
        return ids_sq_norms([o], dtype)
    return outer_inner(o, o, budget, dtype, grams)


def dense_outer_inner(
    dense: torch.Tensor, o: Outer, budget: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``<D_i, sum_t rows_t (x) cols_t> = sum_t rows_t^T D_i cols_t``, ``[B]``."""
    batch, num_rows = o.batch_size, o.num_rows
    d = dense.reshape(batch, num_rows, -1).to(dtype)
    if o.rows_are_ids:  # D_i[id_t] . cols_t
        picked = d.gather(1, o.rows[:, :, None].expand(-1, -1, d.shape[2]))
        return (picked * o.cols.to(dtype)).sum(dim=(1, 2))
    out = torch.empty(batch, dtype=dtype, device=d.device)
    itemsize = dtype.itemsize
    for start, stop in chunks(batch, itemsize * num_rows * o.cols.shape[1], budget):
        dc = torch.bmm(d[start:stop], o.cols[start:stop].to(dtype).transpose(1, 2))  # [n, R, T]
        out[start:stop] = (dc * o.rows[start:stop].to(dtype).transpose(1, 2)).sum(dim=(1, 2))
    return out


def _max_abs(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` per example (over every dimension but the first; NaN propagates), exact.

    One reduction on CUDA; on CPU ``max(amax, -amin)``, two reductions without a temporary (exact:
    negation is), since the CPU kernels of ``aminmax`` and of the infinity norm are ~10x slower, and
    ``abs().amax()`` was slower in a training step too (its temporary: +20% at tiny BERT's 64k-256k
    elements per factor, 2x at 4M). Reducing the dimensions in place needs no copy of a strided factor.
    """
    dims = tuple(range(1, x.dim()))
    if x.is_cuda:
        return torch.linalg.vector_norm(x, ord=math.inf, dim=dims)
    return torch.maximum(x.amax(dim=dims), x.amin(dim=dims).neg_())


def gram_underflow_risk(
    outers: Sequence[Outer], diagonal_maxima: dict[tuple, torch.Tensor] | None = None
) -> torch.Tensor | None:
    """``[B]`` bool: examples whose float32 Gram products of one of ``outers`` may lose part of ``||G_i||^2``.

    The ghost norm multiplies two Gram matrices. If one factor is tiny (``max |rows_i|`` or
    ``max |cols_i|`` below ``2^-50``: its Gram entries are then near or below float32's normal
    range, down to denormals with a few bits or 0) while the other is huge, ``G_i`` itself can
    still be large: the float32 norm would be too small, and the example under-clipped. Such
    examples (with ``max |rows_i| max |cols_i| > 2^-40``, below which ``G_i`` is negligible) are
    redone in float64. Overflow needs no such test: it leaves inf or NaN. One-hot rows (embeddings)
    only square their cols, which cannot hide a large ``G_i``.

    **Witnesses first.** ``diagonal_maxima`` (:class:`GramCache`) holds, per factor ``x`` of width
    ``W``, the float32 ``d_i = max_t ||x_{i,t}||^2`` that the norms' Grams already computed. If every
    factor of every outer has ``d_i >= W 2^-96`` for every example, no factor is tiny and ``None`` is
    returned without reading the factors (one host read). Rounding can only inflate ``d_i`` by the
    sum's ``(1 + gamma_W)`` and ``2^-150`` per rounded-up denormal product (flushing to zero and
    TF32's input rounding, ``2^-10`` relative, stay within the margin), so for the ``t`` attaining it,
    ``||x_{i,t}||^2 >= d_i / (1 + gamma_W) - W 2^-150 > W 2^-98`` when ``W <= 2^23`` (``gamma_W <= 1``),
    and ``max_c x_{i,t,c}^2 >= ||x_{i,t}||^2 / W > 2^-98``: ``max |x_i| > 2^-49``. A NaN ``d_i`` fails
    the comparison. Otherwise (or without witnesses) the exact per-example maxima decide, one batched
    comparison for all outers.
    """
    factors: dict[tuple, torch.Tensor] = {}  # q, k and v share their input: each factor once
    pairs = []
    for o in outers:
        if o.rows_are_ids:
            continue
        keys = o.keys
        factors.update(zip(keys, (o.rows, o.cols)))
        pairs.append(keys)
    if not pairs:
        return None
    if diagonal_maxima is not None and _witnesses_clear(factors, diagonal_maxima):
        return None
    maxima = {key: _max_abs(factor) for key, factor in factors.items()}
    device = next(iter(maxima.values())).device
    # maxima are exact in float32; [outers, B] each
    rows = torch.stack([on_device(maxima[r], device) for r, _ in pairs]).double()
    cols = torch.stack([on_device(maxima[c], device) for _, c in pairs]).double()
    risk = (torch.minimum(rows, cols) < 2.0**-50) & (rows * cols > 2.0**-40)
    return risk.any(dim=0)


def _witnesses_clear(factors: dict[tuple, torch.Tensor], diagonal_maxima: dict[tuple, torch.Tensor]) -> bool:
    """Whether every factor has a Gram-diagonal witness showing ``max |x_i| > 2^-49`` for all examples."""
    if any(key not in diagonal_maxima or factor.shape[-1] > 2**23 for key, factor in factors.items()):
        return False
    device = next(iter(diagonal_maxima.values())).device
    witnessed = torch.stack([on_device(diagonal_maxima[key], device) for key in factors])  # [F, B]
    # Made on the host and copied without waiting (a tensor made from a list on a GPU is a copy that
    # waits for the device: one more wait per clipping pass).
    floors = torch.tensor([factor.shape[-1] * 2.0**-96 for factor in factors.values()])
    floors = floors.to(device, non_blocking=True)
    return bool((witnessed >= floors[:, None].to(witnessed.dtype)).all())


class ScaledFactors:
    """``f * x`` of the factors that several outers of one pass share (attention's q, k and v read one
    input), formed once for the pass's factors ``f`` and ``keep`` (see :func:`outer_weighted_sum`).
    Only the latest is held: the layers sharing an input come one after another."""

    def __init__(self, outers: Sequence[Outer]) -> None:
        seen: set[tuple] = set()
        self.shared: set[tuple] = set()
        for o in outers:
            if not o.rows_are_ids:
                for key in o.keys:
                    (self.shared if key in seen else seen).add(key)
        self.scaled: dict[tuple, torch.Tensor] = {}

    def get(self, key: tuple, x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        if key not in self.scaled:
            self.scaled.clear()
            self.scaled[key] = x * f
        return self.scaled[key]


def outer_weighted_sum(
    o: Outer,
    factors: torch.Tensor,
    keep: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    tensor_cores: bool = False,
    shared: ScaledFactors | None = None,
) -> torch.Tensor:
    """``sum_i f_i G_i = (f * rows)^T cols`` over all ``B T`` positions, ``[R, C]`` in ``dtype``.

    ``keep`` (``[B]`` bool, given when some examples are left out) zeroes their rows *and* cols
    first: ``f_i = 0`` alone would leave ``0 * inf = NaN`` in the product. ``tensor_cores``: the
    caller's clip factors absorb the two-term bf16 split's deviation (ghost/tensor_cores.py), so a
    bf16 CUDA outer may take that path; otherwise it is multiplied in ``dtype``. ``shared``: the
    pass's :class:`ScaledFactors` (the same ``factors`` and ``keep`` for every call), which scales a
    factor other outers share once for all of them.
    """
    if tensor_cores and dtype == torch.float32 and on_tensor_cores(o):
        return _tensor_core_weighted_sum(o, factors, keep)
    factors = as_dtype(factors, dtype)
    cols = as_dtype(o.cols, dtype)
    if keep is not None:
        cols = mask_batch(cols, keep)
    width = cols.shape[-1]
    out_shape = (o.num_rows, width)
    if o.rows_are_ids and batch_broadcast(o.rows):  # the same ids for all: sum over the batch first
        per_position = (factors @ cols.reshape(cols.shape[0], -1)).view(-1, width)  # [T, C], one GEMV
        return torch.zeros(out_shape, dtype=dtype, device=cols.device).index_add_(0, o.rows[0], per_position)
    f = factors.view(-1, 1, 1)
    if o.rows_are_ids:
        weighted = (cols * f).reshape(-1, width)
        return torch.zeros(out_shape, dtype=dtype, device=cols.device).index_add_(
            0, o.rows.reshape(-1), weighted
        )
    rows = as_dtype(o.rows, dtype)
    if keep is not None:
        rows = mask_batch(rows, keep)
    # Scale the factor whose product is cheaper: one shared with other outers (scaled once for all),
    # else a strided one (the product is contiguous, so the GEMM needs no copy of it), else the
    # narrower one. f_i multiplies either side of (x) alike.
    keys = o.keys if shared is not None else ()
    if keys and keys[1] in shared.shared:
        cols = shared.get(keys[1], cols, f)
    elif keys and keys[0] in shared.shared:
        rows = shared.get(keys[0], rows, f)
    elif _scale_rows(rows, cols):
        rows = rows * f
    else:
        cols = cols * f
    return rows.reshape(-1, rows.shape[-1]).transpose(0, 1) @ cols.reshape(-1, width)


def _scale_rows(rows: torch.Tensor, cols: torch.Tensor) -> bool:
    if rows.is_contiguous() != cols.is_contiguous():
        return not rows.is_contiguous()
    return rows.shape[-1] <= cols.shape[-1]


def _tensor_core_weighted_sum(o: Outer, factors: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``(f * rows)^T cols``, the narrower factor times ``f`` split into two bf16 operands ``hi + lo``
    (:func:`bf16_split`; either side: the bound is symmetric) against the other, exact bf16 factor: two
    tensor-core GEMMs, float32 output."""
    rows, cols = o.rows, o.cols
    if keep is not None:
        rows, cols = mask_batch(rows, keep), mask_batch(cols, keep)
    scale_rows = rows.shape[-1] <= cols.shape[-1]
    narrow, exact = (rows, cols) if scale_rows else (cols, rows)
    hi, neg_lo = bf16_split(narrow, factors.float()[:, None, None])
    hi, neg_lo, exact = (t.reshape(-1, t.shape[-1]) for t in (hi, neg_lo, exact))
    if scale_rows:
        out = torch.mm(hi.t(), exact, out_dtype=torch.float32)
        return out.sub_(torch.mm(neg_lo.t(), exact, out_dtype=torch.float32))
    out = torch.mm(exact.t(), hi, out_dtype=torch.float32)
    return out.sub_(torch.mm(exact.t(), neg_lo, out_dtype=torch.float32))


def bf16_split(x: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, -lo)``, bf16, with ``hi + lo = f x`` within ``2^-17`` relative per entry (the book-keeping split):
    each operand is one kernel that computes in float32 and rounds its output: ``hi = bf16(f x)``, and
    ``-lo = bf16(hi - f x)`` (``addcmul``; ``f x`` is the same float32 product, and ``hi - f x`` is exact in
    float32, so ``-lo`` is the remainder rounded once, as ``bf16(f x - hi)`` negated). No float32 copy."""
    bf16 = dict(dtype=torch.bfloat16, device=x.device)
    hi = torch.mul(x, f, out=torch.empty(x.shape, **bf16))
    return hi, torch.addcmul(hi, x, f, value=-1, out=torch.empty(x.shape, **bf16))


def outer_materialize(
    o: Outer, start: int, stop: int, dtype: torch.dtype = torch.float32, tensor_cores: bool = False
) -> torch.Tensor:
    """``G_i`` for examples ``[start, stop)``: ``[n, R, C]``, in ``dtype`` arithmetic; ``tensor_cores``: a bf16
    CUDA outer's on tensor cores, for a caller whose norm absorbs the error (:func:`outer_abs_materialize`)."""
    if o.rows_are_ids:
        cols = o.cols[start:stop].to(dtype)
        n, _, width = cols.shape
        out = torch.zeros(n * o.num_rows, width, dtype=dtype, device=cols.device)
        offsets = torch.arange(n, device=cols.device)[:, None] * o.num_rows
        out.index_add_(0, (offsets + o.rows[start:stop]).reshape(-1), cols.reshape(-1, width))
        return out.view(n, o.num_rows, width)
    return batched_matmul(o.rows[start:stop].transpose(1, 2), o.cols[start:stop], dtype, tensor_cores)


def outer_abs_materialize(o: Outer, start: int, stop: int) -> torch.Tensor:
    """``A_i = sum_t |rows_{i,t}| (x) |cols_{i,t}|`` for examples ``[start, stop)`` of a tensor-core outer, on
    tensor cores (``[n, R, C]`` float32): ``|G^_i - G_i| <= g_T(4u) A_i`` entrywise for the tensor-core ``G^_i``,
    ``|D_i| <= eta f_i A_i`` for its share of the book-keeping sum, and the computed ``A^_i >= (1 - g_T) A_i``
    (nonnegative terms: truncation and rounding lose at most ``g_T`` of them)."""
    rows, cols = o.rows[start:stop].abs(), o.cols[start:stop].abs()  # exact in bf16
    return batched_matmul(rows.transpose(1, 2), cols, torch.float32, tensor_cores=True)
