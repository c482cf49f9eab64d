"""Ghost norms and book-keeping sums on tensor cores for bf16 layers, with a proven bound on their error.

Under ``torch.autocast(bfloat16)`` (``bf16=True``) or in a bf16 model, a Linear layer computes in
bf16: its output gradient ``g`` is bf16 and its input is used as ``bf16(x)``. The layer's own weight
gradient is ``g^T bf16(x)``, so the per-example gradient is ``G_i = sum_t g_{i,t} (x) bf16(x_{i,t})``,
with every factor exactly representable in bf16. On CUDA, this module keeps those factors in bf16
and lets the kernels multiply them on tensor cores with float32 accumulation and output
(``torch.bmm(..., out_dtype=torch.float32)``): products of bf16 numbers are exact in float32, so the
only error is float32 accumulation, the same kind as the float32 path's. Instead of hoping it is
small, the clip factor is computed from a norm inflated by a bound on it, so that every example's
contribution to the released sum is still at most ``C``.

The bound, per example ``i`` (``S_k = sum_t ||rows_t|| ||cols_t||`` for each tensor-core outer
``k`` of a tensor, ``E = sum_tensors (sum_k S_k)^2``, ``u = 2^-24``, ``g_n(u) = n u / (1 - n u)``):

* **Tensor-core accumulation.** Tensor cores do not round to nearest: they add a block of ``k``
  products to the accumulator by aligning all ``k + 1`` addends to the largest one's exponent with
  truncation and truncating the normalized result (Fasi, Higham, Mikaitis, Pranesh 2021, "Numerical
  behavior of NVIDIA tensor cores"; ``k`` is 4-16 and not documented). Each truncation errs by less
  than ``2u`` times the largest addend, so a block of ``m`` products errs by at most ``(m + 1) 2u``
  times the magnitudes it adds, and a length-``K`` dot product, in ``ceil(K / k) <= K`` blocks, by at
  most ``(K + ceil(K / k)) 2u <= 4 K u`` times ``sum |products|``: ``g_K(4u)``, whatever ``k`` (also
  above round-to-nearest's ``g_K(u)``, and cuBLAS's split-K reductions are partial sums of the same).
* **Gram matrices.** Each entry ``<a_s, a_t>`` is a length-``K`` dot product of exact products
  accumulated on tensor cores: error ``<= g_K(4u) sum_k |a_sk a_tk| <= g_K(4u) ||a_s|| ||a_t||``. The
  Frobenius product of two such Grams is then summed in float64 (exact products, negligible rounding),
  and ``|<Ga^, Gb^> - <Ga, Gb>| <= ((1 + g_K(4u))^2 - 1) (sum_t ||a_t|| ||b_t||)^2``. Cross terms
  between the uses of a tied tensor add up to ``(sum_k S_k)^2``; the float32 sums over a tensor's terms
  (round to nearest) add ``g_m(u)``. So a tensor's ``||G_i||^2`` is within ``delta_t (sum_k S_k)^2`` of
  its computed part, ``delta_t = (1 + g_K(4u))^2 (1 + g_m(u)) - 1`` with its own widest ``K`` and its
  ``m``; the parts are summed in float64, so ``||G_i||^2 <= n^_i + D_i``, ``D_i = sum_t delta_t
  (sum_k S_k)^2`` (one wide tensor, GPT-2's 50,257-word LM head, does not widen every other's bound).
* **From the Grams themselves.** ``delta_t (sum_k S_k)^2`` takes every Gram entry at its worst. The
  error of ``<R^, C^>`` is at most ``g_r n_r^T |C^| n_r + g_c n_c^T |R^| n_c + g_r g_c S^2``, with each
  Gram's own width and the other Gram's computed entries (:mod:`~dp_hf.per_example.ghost.grams`): the
  clipping pass takes these terms from the Grams it formed, and each tensor's term in ``D_i`` is the
  smaller of the two bounds (:func:`rounding_bound`).
* **Book-keeping sum.** ``sum_i f_i G_i = (f * rows)^T cols`` needs ``f_i rows`` as a GEMM operand:
  it is formed in float32 (relative error ``u``) and split as ``hi + lo``, two bf16 operands
  (``|f rows - hi - lo| <= 2^-17 |f rows|``: for ``x`` in ``[2^e, 2^(e+1))``, ``|x - hi| <= 2^(e-8)``
  and ``lo`` rounds that remainder to within ``2^(e-17)``; measured up to ``1.996 * 2^-18``), each
  multiplied by the exact bf16 ``cols`` on tensor cores. Example ``i``'s term is thus ``f_i G_i + D_i``
  with ``||D_i|| <= eta f_i sqrt(E_i)``, ``eta = 2^-17 + 2u``. (Float32 accumulation across examples is the float32 path's rounding
  of the sum, not a per-example change.)
* **Clip factor.** ``nu_i = sqrt(n^_i + 2 D_i) + 2 eta sqrt(E_i)`` and ``f_i = min(1, C / nu_i)``:
  ``||f_i G_i + D_i|| <= f_i (||G_i|| + eta sqrt(E_i)) <= f_i nu_i <= C``. The factors 2 are slack for
  the rounding of ``E`` and ``D`` themselves: their position norms are float32 norms or tensor-core Gram
  diagonals (low by at most ``g_K(4u)``, ~1% for a 32,000-word head), and carry a term for float32's
  underflow (``2^-76``-size entries had norm 0, which left ``E = 0`` and no inflation at all).
* **Cancellation.** A float32 norm far below ``E`` (or below :func:`cancellation_threshold` on any path)
  may be mostly rounding error: such examples are redone in float64.

``delta_t`` is a worst-case bound (``~1.5e-3`` for ``K = 3072``); ``E_i / ||G_i||^2`` is at most the
number of positions ``T``. A token-level loss (a causal LM) makes the positions' gradients nearly
orthogonal, and ``E_i / ||G_i||^2`` approaches ``T``: the Gram-free bound cost GPT-2-medium at
``T = 512`` half of its clip norm; with the Grams' own terms, 4.5% (BERT-base: 0.2% -> 0.08%;
emulated, bench/RESULTS.md). Accumulation in float32 inside cuBLAS (compute type float32,
float32 output) is assumed, with reduced-precision reductions disallowed for the pass
(:func:`dp_hf.precision.ieee_float32_matmuls`); ``tests/test_gpu.py`` checks the bound against float64 per-example
gradients on random and adversarial inputs.

Only bf16 factors on CUDA take this path (``out_dtype`` is a CUDA kernel); float32 layers, CPU
runs and float16 keep the float32 arithmetic bit for bit. So do the products the bound does not
cover: the cross term of a tied tensor's embedding use (one-hot rows, not a tensor-core outer) with
its head's (:func:`~dp_hf.per_example.ghost.kernels.batched_matmul` takes tensor cores only when asked).
A geometry's materialized norms have a bound of their own, at the norm level
(:func:`~dp_hf.per_example.ghost.norms.geometry_sq_norms`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dp_hf.per_example.ghost.grams import U32, U_TENSOR_CORES, GramCache, gamma, position_norms
from dp_hf.per_example.ghost.kernels import Outer, on_device, on_tensor_cores
from dp_hf.per_example.ghost.records import ParamRecord

__all__ = [
    "CANCELLATION_GUARD",
    "ETA",
    "U_TENSOR_CORES",
    "RoundingBound",
    "first_order_terms",
    "gamma",
    "cancellation_threshold",
    "GUARD_MARGIN",
    "rounding_rate",
    "model_precision_records",
    "position_norms",
    "rounding_bound",
    "second_order",
    "tensor_core_slack",
    "tensor_delta",
]

#: ``|f rows - hi - lo| / |f rows|`` after the two-term bf16 split, plus float32's own rounding.
ETA = 2.0**-17 + 2 * U32


def _as_model_precision(o: Outer) -> Outer:
    # A bf16 layer used bf16(x): the autocast cast is round-to-nearest, as .to() is.
    if (
        o.rows_are_ids
        or not o.rows.is_cuda
        or o.rows.dtype != torch.bfloat16
        or o.cols.dtype == torch.bfloat16
    ):
        return o
    return Outer(o.rows, o.cols.to(torch.bfloat16), o.num_rows, o.rows_are_ids)


def model_precision_records(records: Sequence[ParamRecord | None]) -> list[ParamRecord | None]:
    """``records`` with every bf16 CUDA outer's ``cols`` rounded to bf16, as the layer itself used them."""
    out: list[ParamRecord | None] = []
    for record in records:
        if record is None or not record.outers:
            out.append(record)
            continue
        outers = [_as_model_precision(o) for o in record.outers]
        if all(new is old for new, old in zip(outers, record.outers)):
            out.append(record)
        else:
            out.append(ParamRecord(record.param, record.dense, outers, record.dense_sq_norms))
    return out


class RoundingBound:
    """A micro-batch's ``E_i`` (``mass``) and ``D_i`` (``gram_error``, :func:`rounding_bound`), ``[B]`` float64;
    ``delta`` is the largest ``delta_t`` (for reports)."""

    def __init__(self, mass: torch.Tensor, gram_error: torch.Tensor, delta: float) -> None:
        self.mass = mass
        self.gram_error = gram_error
        self.delta = delta

    def inflate(self, sq_norms: torch.Tensor) -> torch.Tensor:
        """``nu_i = sqrt(n^_i + 2 D_i) + 2 eta sqrt(E_i)``: a norm no smaller than the true ``||G_i||``
        plus the book-keeping sum's deviation (see the module docstring)."""
        return (sq_norms + 2 * self.gram_error).sqrt() + 2 * ETA * self.mass.sqrt()


def _position_norm_sum(o: Outer, grams: GramCache) -> torch.Tensor:
    """``S_i = sum_t ||rows_{i,t}|| ||cols_{i,t}||``, ``[B]`` float32 (one-hot id rows have norm 1): taken
    from ``grams`` where a bank of the pass's ghost norms computed it from its Grams' diagonals, else from
    the factors' position norms (a factor several outers share, q, k and v's input, once)."""
    banked = grams.norm_sums.get(o.keys)
    if banked is not None:
        return banked
    cols = grams.factor_norms(o.cols)  # float32 products and sums: an overflow gives inf (a float64 redo)
    return cols.sum(dim=1) if o.rows_are_ids else torch.linalg.vecdot(grams.factor_norms(o.rows), cols)


def _masses(
    records: Sequence[ParamRecord | None],
    use,
    device: torch.device,
    batch: int | None = None,
    grams: GramCache | None = None,
) -> tuple[torch.Tensor, list[tuple[ParamRecord, list[Outer]]]] | None:
    """``(sum_k S_k)^2`` of each tensor with outers ``use(o)`` selects, ``[tensors, B]`` float64, and those
    tensors' records and selected outers (None: no outer).

    With ``batch``, tensors with an outer of another first dimension (segments) are left out.
    ``grams``: the pass's :class:`~dp_hf.per_example.ghost.grams.GramCache`, with the ``S_k`` its banks took
    and the position norms an earlier call took (:func:`cancellation_threshold` and :func:`rounding_bound` share them)."""
    per_tensor, selected = [], []
    grams = GramCache() if grams is None else grams
    for record in records:
        outers = [o for o in record.outers if use(o)] if record is not None else []
        if not outers or (batch is not None and any(o.cols.shape[0] != batch for o in outers)):
            continue
        sums = [_position_norm_sum(o, grams) for o in outers]
        total = sums[0] if len(sums) == 1 else torch.stack(sums).sum(dim=0)  # not sum(): no 0 + S copy
        per_tensor.append(total if total.device == device else total.to(device))
        selected.append((record, outers))
    if not per_tensor:
        return None
    return torch.stack(per_tensor).double().square(), selected  # a few launches for all tensors


#: The floor of the cancellation guard: a float32 norm below ``CANCELLATION_GUARD`` times the mass is redone.
CANCELLATION_GUARD = 2.0**-20

#: A float32 norm is trusted only where it is at least ``GUARD_MARGIN`` times its worst-case rounding error.
GUARD_MARGIN = 4.0


def rounding_rate(outers: Sequence[Outer], ghost: bool) -> float:
    """``e_t``: a tensor's float32 ``||G_i||^2`` from ``outers`` is within ``e_t (sum_k S_k)^2`` of the exact one.

    ``ghost``: from Grams, each entry a length-``K`` float32 dot product within ``g_K ||x_s|| ||x_t||`` (one-hot
    id rows' Gram is exact), then float32 products summed in float64: ``g_r + g_c + g_r g_c + 2u``. Else
    ``G_i`` formed over ``T`` positions, each entry within ``g_T sum_t |rows_t| |cols_t|``, so its norm within
    ``g_T S``: ``2 g_T + g_T^2``. One-hot rows may take either way. 0 for tensor-core outers: their norms
    are inflated by a proven bound instead (:func:`rounding_bound`)."""
    if any(on_tensor_cores(o) for o in outers):
        return 0.0
    g_t = _positions_gamma(outers)
    materialized = 2 * g_t + g_t * g_t
    if not ghost:
        return materialized
    g_c = gamma(max(o.cols.shape[-1] for o in outers))
    g_r = max((gamma(o.rows.shape[-1]) for o in outers if not o.rows_are_ids), default=0.0)
    gram = g_r + g_c + g_r * g_c + 2 * U32
    return max(gram, materialized) if any(o.rows_are_ids for o in outers) else gram


def _positions_gamma(outers: Sequence[Outer]) -> float:
    """``g_T`` of the longest sum over positions that forms ``G_i`` from ``outers`` (0 on tensor cores: the
    proven bound covers their rounding)."""
    return 0.0 if any(on_tensor_cores(o) for o in outers) else gamma(max(o.cols.shape[1] for o in outers))


def cancellation_threshold(
    records: Sequence[ParamRecord | None],
    batch: int,
    device: torch.device,
    grams: GramCache | None = None,
    ghost: bool = True,
    scales: Sequence[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(sum_t max(CANCELLATION_GUARD, GUARD_MARGIN e_t) M_t, w)``, ``[B]`` float64, ``M_t = (sum_k S_k)^2`` over every
    outer of tensor ``t`` (:func:`rounding_rate`'s ``e_t``): a float32 norm below it may be mostly rounding error,
    and :func:`~dp_hf.per_example.ghost.norms.clipped_sum` redoes it in float64 (``ghost``: the norm from
    Grams; else ``G_i`` materialized, the identity norm of the tensors with outers).

    ``||G_i||^2 <= M_t`` per tensor. Positions whose gradients cancel (``+-8192 e0 + e1``: Gram entries
    ``+-2^26 + 1`` round to ``+-2^26``, a norm of exactly 0 though ``||G_i|| = 256``; ``(2^28, 16, -2^28)``
    in ``G_i``'s sum over positions), widths whose small entries a large one absorbs (a Gram entry
    ``3.6e7 + 127 * 1.96``: 2.8 C released under the former guard of ``2^-20`` of the mass alone), and
    Gram products that flush to 0 (factors ``2^60``, ``2^-76``) leave such norms; a trusted one errs by at
    most ``1 / GUARD_MARGIN`` of its square (first order: ``<= 1.12 C`` released). Segmented micro-batches
    (outers whose first dimension is not the batch) are not covered. ``grams``: the pass's Gram cache.

    ``scales`` (materialized, aligned with ``records``): ``w`` is the threshold of the norm in
    ``w`` coordinates, ``(2 GUARD_MARGIN)^2 sum_t (g_T S_t / min s_t)^2``: ``G^_i`` errs by at most ``g_T S_t``,
    so ``w_i = (G_i - c) / s`` by ``g_T S_t / min s_t``, which a shift near ``G_i`` or a small scale where the
    positions cancel (``s = 2^-20`` there, a decoy elsewhere) makes large against ``||w_i||``; above it, the
    norm errs by at most 1/8 (``<= 1.125 C``). ``None`` for ghost norms (the identity geometry).
    """
    masses = _masses(records, lambda o: True, device, batch, grams)
    if masses is None:
        return None
    squares, selected = masses
    rates = [max(CANCELLATION_GUARD, GUARD_MARGIN * rounding_rate(outers, ghost)) for _, outers in selected]
    weights = torch.tensor(rates, dtype=torch.float64).to(squares.device, non_blocking=True)
    if scales is None:
        return weights @ squares, None
    index = {id(record): k for k, record in enumerate(records) if record is not None}
    rates, mins = [], []  # (2 GUARD_MARGIN g_T)^2 and min s_t per tensor: one copy, no host read
    for record, outers in selected:
        scale = scales[index[id(record)]]
        rates.append((2 * GUARD_MARGIN * _positions_gamma(outers)) ** 2)
        mins.append(None if scale is None else on_device(scale.min(), squares.device).double())
    w_weights = torch.tensor(rates, dtype=torch.float64).to(squares.device, non_blocking=True)
    if any(m is not None for m in mins):
        one = torch.ones((), dtype=torch.float64, device=squares.device)
        w_weights = w_weights / torch.stack([one if m is None else m for m in mins]).square()
    return weights @ squares, w_weights @ squares


def rounding_bound(
    records: Sequence[ParamRecord | None], batch: int, device: torch.device, grams: GramCache | None = None
) -> RoundingBound | None:
    """The bound for the tensor-core outers of ``records`` (``None`` when none takes that path); ``grams``:
    as for :func:`cancellation_threshold`.

    A tensor's term is the smaller of two bounds: ``delta_t (sum_k S_k)^2`` (:func:`tensor_delta`), and
    where the pass's Grams left the first-order error of every product of its outers in ``grams.errors``
    (:mod:`~dp_hf.per_example.ghost.grams`), their sum plus ``c_t (sum_k S_k)^2`` for the second-order
    and float32 terms (:func:`second_order`)."""
    grams = GramCache() if grams is None else grams
    masses = _masses(records, on_tensor_cores, device, grams=grams)
    if masses is None:
        return None
    squares, selected = masses
    deltas = [tensor_delta(record, outers) for record, outers in selected]
    firsts = [first_order_terms(outers, grams.errors) for _, outers in selected]
    # [delta_t, c_t] per tensor, one copy; a tensor without first-order terms (a one-position layer)
    # takes its Gram-free term on both sides of the minimum.
    constants = [
        [delta, 0.0 if first is None else second_order(*entry)]
        for delta, first, entry in zip(deltas, firsts, selected)
    ]
    weights = torch.tensor(constants, dtype=torch.float64).to(squares.device, non_blocking=True)
    gram_free = weights[:, :1] * squares
    tighter = torch.stack(
        [gram_free[t] if first is None else on_device(first, device) for t, first in enumerate(firsts)]
    ).addcmul_(weights[:, 1:], squares)
    error = torch.minimum(gram_free, tighter)
    return RoundingBound(squares.sum(dim=0), error.sum(dim=0), max(deltas))


def first_order_terms(outers: Sequence[Outer], errors: dict[tuple, torch.Tensor]) -> torch.Tensor | None:
    """``sum_{x,y} e_xy`` over the ordered pairs of ``outers`` (a cross term counts twice), or None when
    some product's first-order error is not in ``errors``."""
    total = None
    for k, x in enumerate(outers):
        for y in outers[k:]:
            e = errors.get((x.keys, y.keys))
            if e is None:
                return None
            e = e if y is x else 2 * e
            total = e if total is None else total + e
    return total


def second_order(record: ParamRecord, outers: Sequence[Outer]) -> float:
    """``c_t = g_r g_c + g_(m+1)(u) (1 + g_r) (1 + g_c)``: with the first-order errors, a tensor's bound is
    their sum plus ``c_t (sum_k S_k)^2``: ``<E_R, E_C>`` of each product, and the float32 rounding of its
    ``m = uses^2 + 2`` terms and of their conversion from float64 (each at most ``(1 + g_r)(1 + g_c) S_x S_y``);
    ``g_r``, ``g_c`` the widest rows' and cols' contractions."""
    g_r = gamma(max(o.rows.shape[-1] for o in outers), U_TENSOR_CORES)
    g_c = gamma(max(o.cols.shape[-1] for o in outers), U_TENSOR_CORES)
    uses = len(record.outers) + (record.dense is not None)
    return g_r * g_c + gamma(uses * uses + 3) * (1 + g_r) * (1 + g_c)


def tensor_delta(record: ParamRecord, outers: Sequence[Outer]) -> float:
    """``delta_t = (1 + g_K(4u))^2 (1 + g_m(u)) - 1`` of a tensor whose tensor-core outers are ``outers``:
    ``K`` their widest Gram contraction, ``m = uses^2 + 2`` the float32 terms of its norm."""
    longest = max(max(o.rows.shape[-1], o.cols.shape[-1]) for o in outers)
    uses = len(record.outers) + (record.dense is not None)
    delta = (1 + gamma(longest, U_TENSOR_CORES)) ** 2 * (1 + gamma(uses * uses + 2)) - 1
    if not math.isfinite(delta):  # pragma: no cover - gamma raises first
        raise ValueError("no rounding bound")
    return delta


def tensor_core_slack(positions: int) -> float:
    """``2 (g_T(4u) + eta) / (1 - g_T(4u))``: per unit of ``||A^_i / s||`` (:func:`~dp_hf.per_example.ghost.
    kernels.outer_abs_materialize`), what a bf16 outer on tensor cores may add to ``||(G_i - c) / s||``
    beyond its computed norm: the error of ``G^_i`` (``g_T A_i``) and the book-keeping split's deviation
    (``eta f_i A_i``), with ``A_i <= A^_i / (1 - g_T)``; the factor 2 is slack for the float32 rounding of
    ``||A^_i / s||`` itself."""
    g = gamma(positions, U_TENSOR_CORES)
    return 2 * (g + ETA) / (1 - g)
