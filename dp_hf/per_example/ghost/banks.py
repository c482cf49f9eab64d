"""Ghost norms of many layers at once: a few kernels per clipping pass instead of ~8 per layer.

Each layer's ghost norm ``||G_i||^2 = <R_i R_i^T, C_i C_i^T>_F`` (``R``, ``C``: the ``[B, T, w]``
row and column factors of an :class:`~dp_hf.per_example.ghost.kernels.Outer`) took two Gram GEMMs,
two diagonal maxima (the underflow test's witnesses), a product and a sum, each with its Python
around it: ~8 kernel launches per layer, ~600 for BERT-base. On a GPU the pass is bound by those
launches, and on a CPU at small shapes by the per-op overhead. Here, in one *wave* of layers:

* one Gram GEMM per distinct factor (q, k and v share their input), as before;
* the Grams written into one bank ``[2 n, B, T, T]`` (the n rows' Grams, then the n cols'), per
  positions ``T``: one reduction gives every factor's Gram-diagonal maxima, and one product and
  one sum every layer's norm.

Every entry is computed as :func:`~dp_hf.per_example.ghost.kernels.outer_sq_norm` computes it (the
same Gram products, in float32, or bf16 tensor-core GEMMs with float32 output and a float64
Frobenius sum), so the norms are the same bits, and the tensor-core rounding bound, the float64
redo of non-finite norms and the underflow test apply unchanged. A wave's transient buffers (the
Grams, the bank, the product) stay within the clipping pass's byte budget; an outer that would be
alone in its wave, or does not fit the budget, takes the per-layer path. On a 2-core CPU (tiny
BERT, B 28, T 16, 12 layers) the norms took 2.2 ms instead of 2.8.

**Embeddings** (one-hot rows, ``G_i = sum_t e_{id_t} (x) c_t``) join the bank where their Gram is
cheap (:func:`bankable`): the rows' Gram is the equality of the ids, ``[id_s = id_t]``, exact in
float32, and the cols' Gram is a float32 GEMM, so ``||G_i||^2 = sum_{s,t} [id_s = id_t] <c_s, c_t>``.
This is the norm the per-layer path computes (summing each id's cols first, then squaring) up to
float32 rounding, not bit for bit. Overflow and cancellation below 0 are redone in float64 as for
any ghost norm; underflow cannot hide a large ``G_i``, the rows' Gram holding only 0 and 1. BERT's
position and token-type embeddings share their cols (one Gram for both), and on CUDA the bank
avoids the per-layer path's ``torch.unique`` for per-example ids, which waits for the device.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from dp_hf.per_example.ghost.grams import U_TENSOR_CORES, GramCache, gamma, gram_product_error
from dp_hf.per_example.ghost.kernels import (
    Outer,
    as_dtype,
    batch_broadcast,
    batched_matmul,
    on_tensor_cores,
    outer_sq_norm,
    row_gram,
)
from dp_hf.per_example.ghost.records import ParamRecord

__all__ = ["banked_sq_norms", "bankable"]


#: Longest sequence whose embedding norms a bank takes on any device. An embedding's Gram costs
#: ``B T^2 C`` against ``~B T C`` for its per-layer path (``ids_sq_norms``: a search over the ``B T``
#: ids, or a ``[T, T]`` comparison for ids shared by the batch), whose constant is large: on 2 CPU
#: cores the Gram was faster up to ``T = 32`` (C 128-1024) and slower from ``T = 64``. Beyond it, on
#: CUDA, the bank still takes ids that differ between examples: their per-layer search
#: (``torch.unique``) waits for the device.
MAX_ID_POSITIONS = 32


def bankable(record: ParamRecord) -> bool:
    """Whether a record's float32 ghost norm is one a bank can take: no dense part and a single outer
    of more than one position (one position is a product of two dot products already); an embedding's
    (one-hot rows) for at most :data:`MAX_ID_POSITIONS` positions, or on CUDA for per-example ids."""
    if record.dense is not None or len(record.outers) != 1:
        return False
    o = record.outers[0]
    positions = o.cols.shape[1]
    if positions <= 1:
        return False
    if o.rows_are_ids:
        return positions <= MAX_ID_POSITIONS or (o.cols.is_cuda and not batch_broadcast(o.rows))
    return True


def _new_bytes(o: Outer, seen: set[tuple]) -> int:
    """Transient bytes ``o`` adds to a wave: its two float32 Grams in the bank and their float32 product
    (on tensor cores, :func:`~dp_hf.per_example.ghost.grams.gram_product_error`'s one buffer at a time),
    plus what the Gram of a factor not yet seen takes before the GEMM writes it in the bank (one-hot
    rows' equality and its float32 copy; a factor cast to float32). Those are freed after each write:
    counting them per outer overstates a wave's peak a little, never understates it. And per position,
    32 bytes: its factors' float32 position norms and the bound's products of them."""
    batch, positions = o.cols.shape[0], o.cols.shape[1]
    gram = batch * positions * positions  # entries of one [B, T, T] Gram
    temporary = 0
    for side in ("rows", "cols"):
        if _gram_key(o, side) in seen:
            continue
        if side == "rows" and o.rows_are_ids:
            temporary += gram * 5  # bool equality, then float32
        else:
            factor = o.rows if side == "rows" else o.cols
            cast = factor.dtype != torch.float32 and (o.rows_are_ids or not on_tensor_cores(o))
            temporary += factor.numel() * 4 if cast else 0
    return gram * 12 + batch * positions * 32 + temporary


def _gram_key(o: Outer, side: str) -> tuple:
    """Which Gram ``o``'s factor ``side`` has: its :func:`tensor_key`, tagged for an embedding's cols
    (multiplied in float32, whatever their dtype, so never shared with a tensor-core Gram)."""
    key = o.keys[0] if side == "rows" else o.keys[1]
    return (key, "embedding") if o.rows_are_ids and side == "cols" else key


def _write_gram(out: torch.Tensor, o: Outer, side: str) -> None:
    """The ``[B, T, T]`` float32 Gram of ``o``'s factor ``side``, written into ``out`` (a row of the bank) by
    the GEMM itself: as :func:`~dp_hf.per_example.ghost.kernels.row_gram` computes the rows' (on tensor
    cores for a tensor-core outer: the bound covers its Grams, and its bank is summed in float64); an
    embedding's cols in float32, as its per-layer path sums them. One-hot rows' Gram (the equality of
    their ids, exact) is copied there."""
    if side == "rows" and o.rows_are_ids:
        out.copy_(row_gram(o, o))
        return
    factor = o.rows if side == "rows" else o.cols
    tensor_cores = on_tensor_cores(o) and not o.rows_are_ids
    if not tensor_cores:
        factor = as_dtype(factor, torch.float32)  # once for both operands
    batched_matmul(factor, factor.transpose(1, 2), torch.float32, tensor_cores, out=out)


def banked_sq_norms(outers: Sequence[Outer], budget: int, grams: GramCache) -> list[torch.Tensor]:
    """``||G_i||^2`` (float32 ``[B]``) of each of ``outers`` (of :func:`bankable` records, same batch), in waves
    of at most ``budget`` transient bytes; records every factor's Gram-diagonal maxima in ``grams``."""
    results: list[torch.Tensor | None] = [None] * len(outers)
    wave: list[int] = []
    seen: set[tuple] = set()
    used = 0

    def flush() -> None:
        nonlocal used
        if len(wave) == 1:  # alone: no stacking to gain, only copies to pay
            results[wave[0]] = outer_sq_norm(outers[wave[0]], budget, torch.float32, grams)
        elif wave:
            for k, sq in zip(wave, _wave_sq_norms([outers[k] for k in wave], grams)):
                results[k] = sq
        wave.clear()
        seen.clear()
        used = 0

    for k, o in enumerate(outers):
        cost = _new_bytes(o, seen)
        if used + cost > budget:
            flush()
            cost = _new_bytes(o, seen)
        if cost > budget:  # too large alone: the per-layer path splits it into chunks of examples
            results[k] = outer_sq_norm(o, budget, torch.float32, grams)
            continue
        wave.append(k)
        seen.update((_gram_key(o, "rows"), _gram_key(o, "cols")))
        used += cost
    flush()
    return results


def _wave_sq_norms(outers: Sequence[Outer], grams: GramCache) -> list[torch.Tensor]:
    """The norms of one wave: one bank per (positions, device, tensor cores)."""
    results: list[torch.Tensor | None] = [None] * len(outers)
    banks: dict[tuple, list[int]] = defaultdict(list)
    for k, o in enumerate(outers):
        banks[(o.cols.shape[1], o.cols.device, on_tensor_cores(o))].append(k)
    for (positions, device, tensor_cores), members in banks.items():
        # The rows' Grams, then the cols', in the members' order: [2 n, B, T, T], each written in its
        # row of the bank (no stacking copy of them all). One Gram per distinct factor (q, k, v share
        # an input): a shared factor's is copied to its other rows rather than gathered by an index
        # tensor (a host-to-device copy, which would synchronise a GPU stream).
        batch = outers[members[0]].cols.shape[0]
        bank = torch.empty(2 * len(members), batch, positions, positions, dtype=torch.float32, device=device)
        rows = bank.unbind(0)  # the rows' views, one op
        row_of: dict[tuple, int] = {}
        keys = []
        for side in ("rows", "cols"):
            for k in members:
                key, row = _gram_key(outers[k], side), len(keys)
                if key in row_of:
                    rows[row].copy_(rows[row_of[key]])
                else:
                    _write_gram(rows[row], outers[k], side)
                    row_of[key] = row
                keys.append(key)
        width = max(max(outers[k].rows.shape[-1], outers[k].cols.shape[-1]) for k in members)
        # Every factor's Gram-diagonal maxima, one reduction; every member's sum of position-norm products.
        norms = grams.witness_bank(keys, bank, [outers[k] for k in members], width)
        n = len(members)
        left, right = bank[:n], bank[n:]
        if tensor_cores:  # summed in float64, with the bound's first-order terms, as outer_inner does
            widths = [(outers[k].rows.shape[-1], outers[k].cols.shape[-1]) for k in members]
            g = torch.tensor(
                [[gamma(w, U_TENSOR_CORES) for w in pair] for pair in widths], dtype=torch.float64
            )
            g = g.to(device, non_blocking=True)  # [n, 2]: each member's rows' and cols' g_K(4u)
            rows_norms, cols_norms = norms[:n], norms[n:]
            value, error = gram_product_error(
                left, right, (rows_norms, rows_norms, cols_norms, cols_norms), (g[:, :1], g[:, 1:])
            )
            sq = value.float()
            for k, e in zip(members, error.unbind(0)):
                grams.errors[(outers[k].keys, outers[k].keys)] = e
        else:
            sq = (left * right).sum(dim=(2, 3))
        for k, value in zip(members, sq.unbind(0)):
            results[k] = value
    return results
