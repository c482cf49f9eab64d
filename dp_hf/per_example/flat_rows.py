"""Flattened token rows: a ``[B*T, ...]`` layer input whose rows ``i*T .. (i+1)*T - 1`` are example ``i``'s.

OPT's decoder layer runs its MLP on ``hidden_states.reshape(-1, H)``: ``final_layer_norm``, ``fc1``, an
activation and ``fc2`` see ``[B*T, H]`` rows, not a batch-first tensor. Their per-example gradients are
exact if each example's rows are one contiguous block of ``N / B`` rows, in order: the layer can then be
recorded on the input viewed as ``[B, N / B, ...]`` (:func:`per_example_rows`). A leading dimension that
is merely a multiple of ``B`` proves nothing (MoE experts receive data-dependent subsets of tokens), so
exactly three provenances are accepted, each checked on every call:

1. **A row-major reshape of a batch-first tensor**: the input is a contiguous view (``x._base``) of a
   contiguous tensor whose leading dimension is ``B``, starting where it starts and covering all of it.
   Then ``x``'s elements are the base's in row-major order, so row ``r`` lies in example
   ``r // (N / B)``'s block (``N`` a multiple of ``B``). A gather, an index or a transpose copies (no
   ``_base``); a slice or a partial view does not cover its base: refused.
2. **The output of a hooked row-wise layer (Linear, Conv1D, LayerNorm) fed such rows**: its row ``r``
   is a function of input row ``r`` alone; the replaced forward marks its autograd node
   (:func:`mark_per_example_rows`) with the batch size, the forward pass and the shape.
3. **Unary elementwise ops of (2)** (ReLU, GELU, SiLU, tanh, sigmoid, dropout, ...,
   :data:`ROW_WISE_UNARY`): the input's ``grad_fn`` chain, one input edge per node, ends at a marked node,
   and the shape is the marked one. A binary op (a product with another tensor, a matmul), a view or an
   in-place edit puts another node in between: refused.

As for any batch-first layer input, (1) trusts that a leading dimension equal to ``B`` is the batch;
the first-step probes (alone vs. in pairs) back this up.
"""

from __future__ import annotations

import torch

__all__ = ["ROW_WISE_UNARY", "mark_per_example_rows", "per_example_rows"]

#: Autograd nodes of elementwise ops with one tensor input: output row ``r`` depends on input row ``r`` only.
ROW_WISE_UNARY = frozenset(
    {
        "ReluBackward0",
        "GeluBackward0",
        "SiluBackward0",
        "TanhBackward0",
        "SigmoidBackward0",
        "EluBackward0",
        "LeakyReluBackward0",
        "HardtanhBackward0",
        "HardswishBackward0",
        "HardsigmoidBackward0",
        "MishBackward0",
        "SoftplusBackward0",
        "NativeDropoutBackward0",
    }
)

_MARK = "dp_hf.per_example_rows"


def per_example_rows(x: torch.Tensor, batch_size: int, forward_id: int) -> torch.Tensor | None:
    """``x`` (``[N, ...]``, ``N != B``) viewed as ``[B, N / B, ...]`` if its rows are verified to be flattened
    batch rows of the current forward pass (module docstring: provenances 1-3), else None."""
    rows = x.shape[0]
    if x.dim() < 2 or batch_size < 1 or rows == batch_size or rows % batch_size:
        return None
    if not (_reshapes_batch_first(x, batch_size) or _follows_marked_rows(x, batch_size, forward_id)):
        return None
    return x.view(batch_size, rows // batch_size, *x.shape[1:])


def mark_per_example_rows(output: torch.Tensor, batch_size: int, forward_id: int) -> None:
    """Mark ``output`` (a hooked row-wise layer's output on flattened batch rows) as flattened batch rows.

    The mark is on its autograd node, which belongs to this output alone: an in-place edit or any later op
    gives the tensor another node, unmarked. Without a node (no gradient) nothing is marked."""
    node = output.grad_fn
    if node is not None and output.output_nr == 0:
        node.metadata[_MARK] = (batch_size, forward_id, tuple(output.shape))


def _reshapes_batch_first(x: torch.Tensor, batch_size: int) -> bool:
    """Provenance 1: ``x`` is a contiguous view covering a contiguous ``[B, ...]`` tensor from its start."""
    base = x._base
    return (
        base is not None
        and base.dim() >= 1
        and base.shape[0] == batch_size
        and base.dtype == x.dtype
        and base.numel() == x.numel()
        and base.storage_offset() == x.storage_offset()
        and base.is_contiguous()
        and x.is_contiguous()
    )


def _follows_marked_rows(x: torch.Tensor, batch_size: int, forward_id: int) -> bool:
    """Provenances 2 and 3: a marked output, through unary elementwise nodes only (first output each)."""
    node, output_nr = x.grad_fn, x.output_nr
    while node is not None and output_nr == 0 and node.name() in ROW_WISE_UNARY:
        edges = node.next_functions
        if len(edges) != 1:
            return False
        node, output_nr = edges[0]
    if node is None or output_nr != 0:
        return False
    return node.metadata.get(_MARK) == (batch_size, forward_id, tuple(x.shape))
