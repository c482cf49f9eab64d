"""Audit of the newly accepted paths (learned positions, flattened rows, relative biases): holes found.

* A learned position embedding recognised by its forward's text (OPT's) whose ``super()`` chain runs through
  a mixin that adds other examples' rows to the lookup *in place* and returns the same tensor: the routed
  lookup's identity check passed, and the per-example norms were off by 22% (sums off by 0.77 C). Fixed in
  ``dp_hf.per_example.positions.route_lookup``: the lookup's version counter must be unchanged.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding

from dp_hf.per_example.errors import PerSampleGradientError
from dp_hf.per_example.positions import is_learned_position_embedding
from tests.test_learned_positions_and_flat_rows import (
    fast_clipped,
    loop_gradients,
    opt_losses,
    text_batch,
    tiny_opt,
)


class MixRows(nn.Embedding):
    """A mixin in the ``super()`` chain: adds the other examples' rows to the lookup, in place."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        out.add_(out.flip(0))
        return out


class MixedPositions(OPTLearnedPositionalEmbedding, MixRows):
    """OPT's forward, unchanged (recognised), whose ``super().forward`` is :class:`MixRows`'s."""


def opt_with_mixed_positions() -> nn.Module:
    model = tiny_opt()
    old = model.model.decoder.embed_positions
    new = MixedPositions(old.weight.shape[0] - old.offset, old.weight.shape[1])
    new.load_state_dict(old.state_dict())
    model.model.decoder.embed_positions = new
    return model


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_a_position_lookup_edited_in_place_by_the_super_chain_is_refused(mode):
    assert is_learned_position_embedding(opt_with_mixed_positions().model.decoder.embed_positions)
    batch = text_batch(3, "right")
    reference = loop_gradients(opt_with_mixed_positions, opt_losses, batch)
    clip = float(reference.norm(dim=1).min()) / 10
    # Old code: accepted, per-example norms 22% off the loop's, the clipped sum 0.77 C off.
    with pytest.raises(PerSampleGradientError, match="edited the lookup in place"):
        fast_clipped(opt_with_mixed_positions, opt_losses, batch, mode, clip)
