"""The clipping pass's byte budget: its default follows the device, and the chunking never changes a result."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_bert_classifier, tiny_text_batch

from dp_hf.per_example import attach_fast_clipping
from dp_hf.per_example.ghost.clipping import default_chunk_bytes
from dp_hf.privatizer import Geometry


def test_default_chunk_bytes_follow_the_device():
    assert default_chunk_bytes(torch.device("cpu")) == 16 * 2**20
    assert default_chunk_bytes(torch.device("cuda", 0)) == 256 * 2**20


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_the_default_budget_is_used_and_chunking_changes_nothing(mode, monkeypatch):
    """The pass gets the device's default when none is given, and the norms and clipped sums of one example per
    chunk equal those of one chunk for the whole batch (a geometry in materialize mode)."""
    from dp_hf.per_example.ghost import norms

    budgets = []
    clipped_sum = norms.clipped_sum

    def recording(*args, budget, **kwargs):
        budgets.append(budget)
        return clipped_sum(*args, budget=budget, **kwargs)

    monkeypatch.setattr(norms, "clipped_sum", recording)
    batch = tiny_text_batch(batch_size=6)
    results = []
    for chunk_bytes in (None, 1, 1 << 30):
        model = tiny_bert_classifier()
        params = [p for p in model.parameters() if p.requires_grad]
        generator = torch.Generator().manual_seed(0)
        geometry = Geometry(0.5)
        if mode == "materialize":
            shift = [0.01 * torch.randn(p.shape, generator=generator) for p in params]
            geometry = Geometry(
                0.5, shift=shift, scale=[torch.rand(p.shape, generator=generator) + 0.5 for p in params]
            )
        clipping = attach_fast_clipping(model, mode=mode, chunk_bytes=chunk_bytes)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="sum").backward()
        sums, norms_ = clipping.clipped_sum(params, geometry)
        clipping.remove()
        results.append((torch.cat([s.flatten() for s in sums]), norms_))
    assert budgets == [16 * 2**20, 1, 1 << 30]
    for sums, norms_ in results[1:]:
        torch.testing.assert_close(norms_, results[0][1], rtol=1e-6, atol=0)
        torch.testing.assert_close(sums, results[0][0], rtol=1e-5, atol=1e-7)
