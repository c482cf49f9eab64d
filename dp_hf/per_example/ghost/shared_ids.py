"""Per-example gradients of an embedding looked up with ids shared by every example, kept dense.

Broadcast ids (a stride-0 expand over the batch: T5's relative-bias buckets, ``[B, q k]`` with ``q k`` up to
``~262k`` positions and 32 buckets; BERT's token-type ids) have ``G_i = sum_t onehot(id_t) (x) g_{i,t}`` with
the same ``id_t`` for every example: the row ``u`` of ``G_i`` is ``sum_{t: id_t = u} g_{i,t}``. One
``index_add`` over the positions forms all ``B`` of them, ``[B, R, C]`` float32, in ``O(B T C)`` time and
``B R C`` floats; the factored record keeps ``B T C`` and its ghost norm compares every pair of positions
(``[T, T]``: 275 GB at ``T = 262k``). So beyond :data:`PAIRWISE_POSITIONS` positions, when ``R <= T``, the
recorder keeps this dense ``G_i`` instead (:func:`shared_ids_dense`), which every norm and sum path takes as
it is (as a bias's): exact, as the sum only regroups each example's own rows. Shorter lookups stay factored
(a cheap ``[T, T]``; BERT's position and token-type records then share their cols' Gram).
"""

from __future__ import annotations

import torch

from dp_hf.per_example.ghost.kernels import as_dtype, batch_broadcast

__all__ = ["PAIRWISE_POSITIONS", "shared_ids_dense", "takes_shared_ids_dense"]

#: Positions up to which shared ids stay factored (their ghost norm's ``[T, T]`` comparison: 1M entries).
PAIRWISE_POSITIONS = 1024


def takes_shared_ids_dense(ids: torch.Tensor, num_rows: int) -> bool:
    """Whether ``[B, T]`` ids are shared by every example (stride 0), ``T > PAIRWISE_POSITIONS`` and ``G_i``
    (``R`` rows) is no larger than the factors (``T`` rows)."""
    positions = ids.shape[1]
    return batch_broadcast(ids) and positions > PAIRWISE_POSITIONS and num_rows <= positions


def shared_ids_dense(ids: torch.Tensor, grad: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``G_i`` of every example, ``[B, R, C]`` float32, from shared ``[B, T]`` ids and ``[B, T, C]`` backprops:
    row ``u`` of ``G_i`` is ``sum_{t: id_t = u} grad_{i,t}`` (float32 sums)."""
    batch, _, width = grad.shape
    out = torch.zeros(batch, num_rows, width, dtype=torch.float32, device=grad.device)
    return out.index_add_(1, ids[0], as_dtype(grad, torch.float32))
