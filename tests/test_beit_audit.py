"""Audit of BEiT's two fast-path rules: the layer scale (dp_hf.per_example.ghost.layer_scale) and the patch-embedding
rule of ``BeitEmbeddings`` (dp_hf.per_example.samplers), attacked black-box.

Each attack is measured against one example at a time through the model (float64 autograd): the per-example
norms the fast path (ghost, materialize) or dp_hf's Opacus hooks produce must be the loop's, or the step must be
refused. Attacks that hold: masked image modeling (mask token), absolute positions interpolated to larger and
non-square images, a layer called twice in one forward (shared across depth), lambdas tied across layers,
frozen attention and MLP (the lambdas' operand needs no gradient), drop path (each example its own draw),
a lambda used outside its layer (refused), the relative position bias tables (refused). The hole found: a deep
copy of a hooked model kept a copy of the clipping in its layers' forwards (every train-mode forward of the copy
raised, and a clipping attached to the copy was refused).
"""

from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from test_module_zoo_sensitivity import CLIP, clipped_alone, clipped_sum
from torch import nn
from transformers.models.beit import modeling_beit

from dp_hf.per_example import PerSampleGradientError, attach_fast_clipping, attach_grad_sample
from dp_hf.per_example.ghost import unsupported_modules
from dp_hf.privatizer import Geometry

BATCH = 4
SMALL = dict(image_size=16, num_channels=3, num_labels=3, patch_size=4, hidden_size=16, num_hidden_layers=2)
SMALL.update(num_attention_heads=2, intermediate_size=24, layer_scale_init_value=0.1, drop_path_rate=0.0)


def tiny(model_cls=tf.BeitForImageClassification, **overrides) -> nn.Module:
    torch.manual_seed(0)
    model = model_cls(tf.BeitConfig(**{**SMALL, "vocab_size": 5, **overrides}))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():  # raw parameters away from their init (zeros, ones): a wrong rule cannot hide
        for name, p in model.named_parameters():
            if "lambda" in name or "token" in name or "position_embeddings" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=generator))
    return model.train()


def inputs(height=16, width=16, masked=False) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH, 3, height, width, generator=generator)
    batch = dict(pixel_values=x, labels=torch.randint(0, 3, (BATCH,), generator=generator))
    if masked:
        batch["bool_masked_pos"] = torch.rand(BATCH, (height // 4) * (width // 4), generator=generator) < 0.5
    return batch


def per_example_losses(model, batch):
    arguments = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**arguments).logits
    if logits.dim() == 3:  # masked image modeling: every position's logits
        return logits.square().flatten(1).sum(1)
    return F.cross_entropy(logits, batch["labels"], reduction="none")


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def loop_norms(model, batch) -> torch.Tensor:
    model = copy.deepcopy(model).double()
    norms = []
    for i in range(BATCH):
        one = {k: v[i : i + 1].double() if v.is_floating_point() else v[i : i + 1] for k, v in batch.items()}
        grads = torch.autograd.grad(per_example_losses(model, one).sum(), trainable(model), allow_unused=True)
        norms.append(torch.sqrt(sum(g.square().sum() for g in grads if g is not None)))
    return torch.stack(norms)


def hooked_norms(model, batch, mode) -> torch.Tensor:
    if mode == "opacus":
        attach_grad_sample(model)
        per_example_losses(model, batch).sum().backward()
        return torch.sqrt(sum(p.grad_sample.double().flatten(1).square().sum(1) for p in trainable(model)))
    clipping = attach_fast_clipping(model, mode=mode)
    try:
        per_example_losses(model, batch).sum().backward()
        return clipping.clipped_sum(trainable(model), Geometry(float("inf")))[1].double()
    finally:
        clipping.remove()


def check(model, batch, mode):
    expected = loop_norms(model, batch)
    torch.testing.assert_close(hooked_norms(model, batch, mode), expected, rtol=1e-5, atol=1e-7)


def frozen_lambdas(model):
    for name, p in model.named_parameters():
        if "lambda" in name:  # Opacus's hooks have no rule for the layer scale
            p.requires_grad_(False)
    return model


EMBEDDINGS = {
    "masked-image-modeling": (dict(use_mask_token=True), dict(masked=True)),
    "masked-absolute-positions-non-square": (
        dict(use_mask_token=True, use_absolute_position_embeddings=True),
        dict(masked=True, width=24),
    ),
    "absolute-positions-larger-image": (
        dict(use_absolute_position_embeddings=True),
        dict(height=32, width=32),
    ),
    "absolute-positions-non-square": (dict(use_absolute_position_embeddings=True), dict(width=24)),
}


@pytest.mark.parametrize("mode", ["ghost", "materialize", "opacus"])
@pytest.mark.parametrize("name", list(EMBEDDINGS))
def test_beit_embeddings_are_exact_on_every_path(name, mode):
    config, shape = EMBEDDINGS[name]
    masked = shape.get("masked", False)
    model = tiny(tf.BeitForMaskedImageModeling if masked else tf.BeitForImageClassification, **config)
    check(frozen_lambdas(model) if mode == "opacus" else model, inputs(**shape), mode)


def shared_across_depth():
    model = tiny()
    model.beit.layers[1] = model.beit.layers[0]  # one layer called twice in one forward
    return model


def tied_lambdas():
    model = tiny()
    model.beit.layers[1].lambda_1 = model.beit.layers[0].lambda_1
    return model


def frozen_branches():
    model = tiny()
    for name, p in model.named_parameters():
        p.requires_grad_("lambda" in name)  # the lambdas' operand needs no gradient
    return model


LAYER_SCALE = {"shared-across-depth": shared_across_depth, "tied": tied_lambdas, "frozen": frozen_branches}


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("name", list(LAYER_SCALE))
def test_layer_scale_attacks_are_exact(name, mode):
    model = LAYER_SCALE[name]()
    assert unsupported_modules(model) == []
    check(model, inputs(), mode)


class LambdaInTheHead(nn.Module):
    """Layer 0's ``lambda_1`` also used in the head, outside its layer's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.beit = tiny()

    def forward(self, pixel_values):
        logits = self.beit(pixel_values=pixel_values).logits
        lam = self.beit.beit.layers[0].lambda_1
        return SimpleNamespace(logits=logits + pixel_values.flatten(1)[:, :3] * lam[:3])


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_a_lambda_used_outside_its_layer_is_refused(mode):
    with pytest.raises(PerSampleGradientError, match="outside the hooked modules"):
        hooked_norms(LambdaInTheHead(), inputs(), mode)


@pytest.mark.parametrize(
    "config", [dict(use_relative_position_bias=True), dict(use_shared_relative_position_bias=True)]
)
def test_trainable_relative_position_bias_tables_are_refused(config):
    problems = unsupported_modules(tiny(**config))
    assert problems and all(kind == "BeitRelativePositionBias" for _, kind, _ in problems)


def keyed_drop_path(self, hidden_states):
    """BEiT's drop path with each example's draw a function of its own row (the same in the loop and the batch)."""
    if self.drop_prob == 0.0 or not self.training:
        return hidden_states
    key = (hidden_states.detach().flatten(1).sum(1) * 1e3).floor().remainder(3) != 0
    keep = key.to(hidden_states.dtype).view(-1, *[1] * (hidden_states.dim() - 1))
    return hidden_states / (1 - self.drop_prob) * keep


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_drop_path_is_exact(mode, monkeypatch):
    monkeypatch.setattr(modeling_beit.BeitDropPath, "forward", keyed_drop_path)
    check(tiny(drop_path_rate=0.5), inputs(), mode)


class Classifier(nn.Module):
    """BEiT-base's layout (relative position bias, frozen here; drop path) on the sensitivity rows' ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.beit = tiny(use_relative_position_bias=True, drop_path_rate=0.3)
        for name, p in self.beit.named_parameters():
            p.requires_grad_("relative_position_bias_table" not in name)

    def forward(self, x, labels=None):
        return {"logits": self.beit(pixel_values=x).logits}


def test_dp_trainer_with_drop_path_moves_by_at_most_one_clipped_gradient(tmp_path, monkeypatch):
    monkeypatch.setattr(modeling_beit.BeitDropPath, "forward", keyed_drop_path)  # draws coupled across runs
    assert unsupported_modules(Classifier()) == []
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(9, 3, 16, 16, generator=generator), torch.randint(0, 3, (9,), generator=generator)
    data = [{"x": x[i], "labels": y[i]} for i in range(9)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s_without = clipped_sum(Classifier, data[:8], tmp_path / "without")
        s_with = clipped_sum(Classifier, [data[8], *data[:8]], tmp_path / "with")
    assert (s_with - s_without).norm().item() / CLIP <= 1 + 1e-4
    clipped = [clipped_alone(Classifier, row) for row in data]
    torch.testing.assert_close(s_with, torch.stack(clipped).sum(0), rtol=0, atol=2e-5 * CLIP)


def test_a_deep_copy_of_a_hooked_model_is_not_hooked():
    model = tiny()
    clipping = attach_fast_clipping(model, mode="materialize")
    copied = copy.deepcopy(model)
    clipping.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())
    # A plain train-mode step of the copy: its layers run their class's forward (it raised before: the copy's
    # layers recorded into a copy of the clipping, outside any forward pass of it).
    per_example_losses(copied, inputs()).sum().backward()
    expected = torch.autograd.grad(per_example_losses(model, inputs()).sum(), trainable(model))
    for p, g in zip(trainable(copied), expected):
        torch.testing.assert_close(p.grad, g)
