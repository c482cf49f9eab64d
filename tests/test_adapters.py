"""The replacement methods the hooks set on module instances (dp_hf.per_example.adapters), one row per family:
T5's relative bias, BEiT's layer scale, Swin's window attention.

A deep copy of a hooked model is not hooked: every copied adapter has no owner (it kept a copy of the whole
recording engine before: T5's copied a FastClipping through its bound ``recording``), the copy trains as the plain
model, attaching to the copy replaces the copied adapters with its own, and removing the hooks leaves no adapter.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn

from dp_hf.per_example import attach_fast_clipping
from dp_hf.per_example.adapters import InstanceAdapter
from tests.test_layer_scale import tiny as tiny_beit
from tests.test_relative_attention_bias import batch_of, tiny_t5
from tests.test_relative_attention_bias import losses as t5_losses
from tests.test_swin import images, tiny_swin


def beit_losses(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(
        model(pixel_values=batch["pixel_values"]).logits, batch["labels"], reduction="none"
    )


def swin_losses(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(
        model(pixel_values=batch["pixel_values"]).logits, batch["labels"], reduction="none"
    )


def beit_batch() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "pixel_values": torch.randn(3, 3, 16, 16, generator=g),
        "labels": torch.randint(0, 3, (3,), generator=g),
    }


FAMILIES = {  # (model, batch, losses, how many adapters)
    "t5-relative-bias": (
        tiny_t5,
        lambda: batch_of("lm"),
        t5_losses,
        2,
    ),  # encoder's and decoder's first layer
    "beit-layer-scale": (
        lambda: tiny_beit(tf.BeitForImageClassification, tf.BeitConfig),
        beit_batch,
        beit_losses,
        2,
    ),
    "swin-window-attention": (lambda: tiny_swin(True), lambda: images(3), swin_losses, 4),
}


def adapters_of(model: nn.Module) -> list[InstanceAdapter]:
    return [v for m in model.modules() for v in m.__dict__.values() if isinstance(v, InstanceAdapter)]


def trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_deep_copy_of_a_hooked_model_is_not_hooked_and_can_be_hooked_again(family):
    make, make_batch, losses, count = FAMILIES[family]
    model, batch = make(), make_batch()
    clipping = attach_fast_clipping(model, probe_batch_dimensions=False)
    hooked = adapters_of(model)
    assert len(hooked) == count and all(a.owner is not None for a in hooked)
    copied = copy.deepcopy(model)
    copies = adapters_of(copied)
    assert len(copies) == count and all(a.owner is None for a in copies)
    losses(copied, batch).sum().backward()  # the class's methods: plain autograd
    reference = make()
    expected = torch.autograd.grad(losses(reference, batch).sum(), trainable(reference))
    for p, g in zip(trainable(copied), expected):
        torch.testing.assert_close(p.grad, g)
    clipping.remove()
    assert adapters_of(model) == []
    second = attach_fast_clipping(copied, probe_batch_dimensions=False)
    again = adapters_of(copied)
    assert len(again) == count and all(a.owner is not None for a in again)
    second.remove()
    assert adapters_of(copied) == []
