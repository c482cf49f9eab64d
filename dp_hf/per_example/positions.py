"""Learned position embeddings (OPT's, BART's and their copies): recognising them, and routing their lookup.

``OPTLearnedPositionalEmbedding``, ``BartLearnedPositionalEmbedding`` (mBART, MVP, PLBart, TrOCR,
PP-FormulaNet) and ``BioGptLearnedPositionalEmbedding`` are ``nn.Embedding`` subclasses whose forward
computes position ids from its inputs (OPT, BioGPT: per example, from the attention mask's cumsum, so
left/right padding is followed; BART: ``arange(T).expand(B, -1)``, or the given ``position_ids``
unsqueezed to ``[1, T]``) and returns ``super().forward(position_ids + self.offset)``: one lookup of the
layer's own weight. Its per-example gradient is then the embedding rule's, provided the ids are
batch-first, which the recording lookup checks as for any embedding (``[1, T]`` ids are expanded).

:func:`is_learned_position_embedding` accepts a class only if its forward, without docstring, comments
and annotations, is one of :data:`LEARNED_POSITION_FORWARDS` (read from its source, as the scaled word
embeddings are: a changed forward is refused, not guessed at). :func:`route_lookup` runs that forward
(its own id computation, not a copy) under a ``TorchFunctionMode`` that hands its one ``F.embedding``
of the layer's weight to the recording lookup, and checks that the forward returned exactly that
lookup's output. The Blenderbot/LED/BigBird-Pegasus variants look up 1-D ``[T]`` ids broadcast over
the batch (no batch dimension to attribute rows to): not recognised, they stay refused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dp_hf.per_example.errors import PerSampleGradientError
from dp_hf.per_example.known_code import normalized_source

__all__ = ["LEARNED_POSITION_FORWARDS", "check_position_ids", "is_learned_position_embedding", "route_lookup"]

#: The forwards (``ast.unparse`` without docstring and annotations) of the learned position embeddings
#: whose ids are batch-first: OPT's and BioGPT's (from the attention mask), BART's family (from the shape).
LEARNED_POSITION_FORWARDS = frozenset(
    {
        "def forward(self, attention_mask, past_key_values_length=0, position_ids=None):\n"
        "    if position_ids is None:\n"
        "        position_ids = torch.cumsum(attention_mask, dim=1)\n"
        "        position_ids = (position_ids * attention_mask - 1).long()\n"
        "        position_ids = position_ids[:, past_key_values_length:]\n"
        "    return super().forward(position_ids + self.offset)",
        "def forward(self, input_ids, past_key_values_length=0, position_ids=None):\n"
        "    if position_ids is None:\n"
        "        bsz, seq_len = input_ids.shape[:2]\n"
        "        position_ids = torch.arange(past_key_values_length, past_key_values_length + seq_len, "
        "dtype=torch.long, device=self.weight.device).expand(bsz, -1)\n"
        "    else:\n"
        "        position_ids = position_ids.unsqueeze(0)\n"
        "    return super().forward(position_ids + self.offset)",
    }
)


def is_learned_position_embedding(module: nn.Module) -> bool:
    """An ``nn.Embedding`` subclass whose forward is one of :data:`LEARNED_POSITION_FORWARDS`, with an
    integer ``offset``: it computes batch-first ids and looks them up once in its own weight."""
    kind = type(module)
    return (
        isinstance(module, nn.Embedding)
        and kind.forward is not nn.Embedding.forward
        and type(getattr(module, "offset", None)) is int
        and normalized_source(kind.forward) in LEARNED_POSITION_FORWARDS
    )


class _RoutedLookup(TorchFunctionMode):
    """Hands every ``F.embedding`` of ``weight`` to ``lookup(ids)``; other torch calls run as they are."""

    def __init__(self, weight: torch.Tensor, lookup: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.weight, self.lookup = weight, lookup
        self.outputs: list[torch.Tensor] = []
        self.versions: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding and len(args) >= 2 and args[1] is self.weight:
            output = self.lookup(args[0])
            self.outputs.append(output)
            self.versions.append(output._version)  # an in-place edit after the lookup bumps it
            return output
        return func(*args, **kwargs)


def route_lookup(
    module: nn.Module, args: tuple, kwargs: dict, lookup: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``type(module).forward(module, *args, **kwargs)`` with its lookup of ``module.weight`` done by ``lookup``.

    Safety: the forward is a recognised one (:func:`is_learned_position_embedding`), so it computes the
    ids from its inputs and looks them up once; the routed lookup is the only use of the weight whose
    gradient reaches it (no other op receives it), and the forward's result must be that lookup's
    output, unedited (its version counter unchanged: a class in the ``super()`` chain could otherwise add
    other rows to it in place and return the same tensor), so what the recording sees is exactly what the model adds to its hidden states.
    """
    mode = _RoutedLookup(module.weight, lookup)
    with mode:
        output = type(module).forward(module, *args, **kwargs)
    if len(mode.outputs) != 1 or output is not mode.outputs[0] or output._version != mode.versions[0]:
        raise PerSampleGradientError(
            f"{type(module).__name__} (dp_hf.per_example.positions) looked up its weight "
            f"{len(mode.outputs)} times, returned something else than the lookup, or edited the lookup in "
            "place (e.g. a mixin's forward in its super() chain): its forward is not the recognised one. "
            "Freeze it (requires_grad=False on its weight)."
        )
    return output


def check_position_ids(module: nn.Module, ids: torch.Tensor) -> None:
    """Refuse position ids that are not ``[B, T]`` (after a ``[1, T]`` was expanded): BART's forward unsqueezes
    given ``position_ids``, so ``[B, T]`` ones would become ``[1, B, T]``, and rows would not be examples."""
    if ids.dim() != 2:
        raise PerSampleGradientError(
            f"{type(module).__name__} (dp_hf.per_example.positions) looked up position ids of shape "
            f"{tuple(ids.shape)}; per-example gradients need [batch, length] ids. Pass 1-D position_ids (or "
            "none) to this model, or freeze the position embedding (requires_grad=False)."
        )
