"""BEiT's and Data2VecVision's layer scale on the fast path (dp_hf.per_example.ghost.layer_scale).

Every parameter trainable (Data2VecVision's ``cls_token`` aside; BEiT's embeddings' ``cls_token`` and absolute position embeddings take the patch-embedding
rule, dp_hf.per_example.samplers; BEiT always interpolates them, so a non-square image is a row): the per-example gradients of the lambdas, as recorded, and the per-example norms and
clipped sums of all tensors, equal one example at a time through the model (float64 autograd), in ghost and
materialize modes and in MacAdam-like geometry; DPTrainer's update moves by at most one clipped gradient per
example. A changed forward is not recognised; mutations of the rule (a batch-summed record, a missed use, a
lambda used twice) fail.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from test_module_zoo_sensitivity import CLIP, clipped_alone, clipped_sum
from torch import nn

from dp_hf.per_example import PerSampleGradientError, attach_fast_clipping
from dp_hf.per_example.ghost import layer_scale, records, unsupported_modules
from dp_hf.privatizer import Geometry, clip_factors

BATCH = 4
SMALL = dict(image_size=16, num_channels=3, num_labels=3, patch_size=4, hidden_size=16, num_hidden_layers=2)
SMALL.update(num_attention_heads=2, intermediate_size=24, layer_scale_init_value=0.1, drop_path_rate=0.0)


def tiny(model_cls, config_cls, seed: int = 0, **overrides) -> nn.Module:
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**SMALL, **overrides}))
    generator = torch.Generator().manual_seed(seed + 7)
    for name, p in model.named_parameters():
        if "lambda" in name:  # away from their init, so that a wrong rule cannot hide
            with torch.no_grad():
                p.copy_(0.5 + torch.rand(p.shape, generator=generator))
    return model


def frozen_cls(model: nn.Module) -> nn.Module:
    model.get_submodule("data2vec_vision.embeddings").cls_token.requires_grad_(False)
    return model


MODELS = {
    "beit": lambda: tiny(tf.BeitForImageClassification, tf.BeitConfig),
    # (Its embeddings return a tuple, which the patch-embedding rule does not take: cls_token frozen.)
    "data2vec-vision": lambda: frozen_cls(
        tiny(tf.Data2VecVisionForImageClassification, tf.Data2VecVisionConfig)
    ),
    "beit-absolute-positions": lambda: tiny(
        tf.BeitForImageClassification, tf.BeitConfig, use_absolute_position_embeddings=True
    ),
    # A 16 x 20 image (4 x 5 patches): BEiT interpolates its 4 x 4 grid of position embeddings.
    "beit-absolute-positions-non-square": lambda: tiny(
        tf.BeitForImageClassification, tf.BeitConfig, use_absolute_position_embeddings=True
    ),
}
WIDTH = {"beit-absolute-positions-non-square": 20}
_width = {"width": 16}


def batch():
    generator = torch.Generator().manual_seed(3)
    return torch.randn(BATCH, 3, 16, _width["width"], generator=generator), torch.randint(
        0, 3, (BATCH,), generator=generator
    )


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def losses(model, pixels, labels):
    return F.cross_entropy(model(pixel_values=pixels).logits, labels, reduction="none")


def loop_reference(model):
    model = copy.deepcopy(model).double()
    pixels, labels = batch()
    rows = []
    for i in range(BATCH):
        loss = losses(model, pixels[i : i + 1].double(), labels[i : i + 1]).sum()
        rows.append(torch.autograd.grad(loss, trainable(model)))
    return [torch.stack(row) for row in zip(*rows)]


def reference_clipped_sum(grads, clip, shift=None, scale=None):
    n = len(grads)
    w = [
        (g - (0 if c is None else c.double())) / (1 if s is None else s.double())
        for g, c, s in zip(grads, shift or [None] * n, scale or [None] * n)
    ]
    norms = torch.sqrt(sum(x.flatten(1).square().sum(1) for x in w))
    factors = clip_factors(norms, clip).double()
    return [torch.einsum("b,b...->...", factors, x) for x in w], norms


def fast(model, geometry, **options):
    clipping = attach_fast_clipping(model, **options)
    try:
        pixels, labels = batch()
        losses(model, pixels, labels).sum().backward()
        params = trainable(model)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        recorded = clipping.recorder.records
        lambdas = {
            k: recorded[id(p)].dense.clone()
            for k, (n, p) in enumerate(named)
            if id(p) in recorded and "lambda" in n
        }
        sums, norms = clipping.clipped_sum(params, geometry)
        return sums, norms, lambdas
    finally:
        clipping.remove()


def check(model, geometry_of, **options):
    grads = loop_reference(model)
    _, unclipped = reference_clipped_sum(grads, float("inf"))
    clip = float(unclipped.median())
    shift, scale = geometry_of(grads)
    expected_sums, expected_norms = reference_clipped_sum(grads, clip, shift, scale)
    sums, norms, lambdas = fast(model, Geometry(clip, shift, scale), **options)
    assert len(lambdas) == 4  # 2 layers x (lambda_1, lambda_2)
    for k, dense in lambdas.items():
        torch.testing.assert_close(dense.double(), grads[k], rtol=1e-4, atol=1e-6, msg=f"lambda #{k}")
    torch.testing.assert_close(norms.double(), expected_norms, rtol=2e-5, atol=1e-7)
    for k, (a, b) in enumerate(zip(sums, expected_sums)):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-5 * float(b.abs().max()), msg=f"#{k}")


def identity(grads):
    return None, None


def macadam_like(grads):
    generator = torch.Generator().manual_seed(0)
    shapes = [g.shape[1:] for g in grads]
    shift = [0.01 * torch.randn(s, generator=generator) if k % 3 else None for k, s in enumerate(shapes)]
    scale = [torch.rand(s, generator=generator) + 0.5 if k % 2 else None for k, s in enumerate(shapes)]
    return shift, scale


@pytest.mark.parametrize(
    "mode, strategy, geometry",
    [("ghost", "auto", identity), ("ghost", "ghost", identity), ("materialize", "materialize", macadam_like)],
)
@pytest.mark.parametrize("name", list(MODELS))
def test_full_fine_tuning_matches_a_one_example_loop(name, mode, strategy, geometry, monkeypatch):
    model = MODELS[name]()
    assert unsupported_modules(model) == []
    assert name == "data2vec-vision" or all(p.requires_grad for p in model.parameters())
    monkeypatch.setitem(_width, "width", WIDTH.get(name, 16))
    check(model, geometry, mode=mode, layer_strategy=strategy)
    assert all("forward" not in m.__dict__ for m in model.modules())  # adapters removed with the hooks


def test_a_record_summed_over_the_batch_fails(monkeypatch):
    original = records.LayerRecorder.record_scale

    def mixed(self, module, param, forward_id, grad, direction, segments=None):
        original(self, module, param, forward_id, grad, direction, segments)
        record = self.records[id(param)]  # every example given the batch's mean: the sum (.grad) is kept
        record.dense = record.dense.mean(0, keepdim=True).expand_as(record.dense).clone()

    monkeypatch.setattr(records.LayerRecorder, "record_scale", mixed)
    with pytest.raises(AssertionError):
        check(MODELS["beit"](), identity, mode="ghost")


def test_a_missed_use_is_refused(monkeypatch):
    original = layer_scale._RecordingForward.record

    def skip_second(self, name, param, y, output):
        if name != "lambda_2":
            original(self, name, param, y, output)

    monkeypatch.setattr(layer_scale._RecordingForward, "record", skip_second)
    with pytest.raises(PerSampleGradientError, match="received a gradient outside the hooked modules"):
        check(MODELS["beit"](), identity, mode="materialize")


class TwiceScaledLayer(tf.models.beit.modeling_beit.BeitLayer):
    def forward(
        self, hidden_states, attention_mask=None, interpolate_pos_encoding=False, resolution=None, **kw
    ):
        out = super().forward(hidden_states, attention_mask, interpolate_pos_encoding, resolution, **kw)
        return out + 0 * (self.lambda_1 * hidden_states)


def twice_scaled() -> nn.Module:
    model = MODELS["beit"]()
    model.beit.layers[0].__class__ = TwiceScaledLayer
    return model


def test_a_changed_forward_is_not_recognised():
    problems = unsupported_modules(twice_scaled())
    assert [(path, kind) for path, kind, _ in problems] == [("beit.layers.0", "TwiceScaledLayer")]
    plain = MODELS["beit"]()
    plain.beit.layers[1].forward = plain.beit.layers[1].forward  # an instance override
    assert [path for path, _, _ in unsupported_modules(plain)] == ["beit.layers.1"]


def test_a_second_use_is_refused_even_if_the_forward_were_recognised(monkeypatch):
    digest = layer_scale.forward_digest(TwiceScaledLayer)
    monkeypatch.setattr(layer_scale, "KNOWN_FORWARDS", layer_scale.KNOWN_FORWARDS | {digest})
    model = twice_scaled()
    assert unsupported_modules(model) == []
    with pytest.raises(PerSampleGradientError, match="layer_scale"):
        fast(model, Geometry(1.0))


def test_a_lambda_used_outside_a_product_is_refused(monkeypatch):
    monkeypatch.setattr(layer_scale, "_PRODUCTS", frozenset({torch.Tensor.add}))
    with pytest.raises(PerSampleGradientError, match="other than as one operand of a product"):
        fast(MODELS["beit"](), Geometry(1.0))


class Classifier(nn.Module):
    """BEiT taking the sensitivity rows' ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.beit = MODELS["beit"]()

    def forward(self, x, labels=None):
        return {"logits": self.beit(pixel_values=x).logits}


@pytest.mark.parametrize("mode", ["auto", "materialize"])
def test_dp_trainer_moves_by_at_most_one_clipped_gradient(mode, tmp_path):
    assert unsupported_modules(Classifier()) == []
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(9, 3, 16, 16, generator=generator), torch.randint(0, 3, (9,), generator=generator)
    data = [{"x": x[i], "labels": y[i]} for i in range(9)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s_without = clipped_sum(Classifier, data[:8], tmp_path / "without", per_sample_gradient_mode=mode)
        s_with = clipped_sum(
            Classifier, [data[8], *data[:8]], tmp_path / "with", per_sample_gradient_mode=mode
        )
    clipped = [clipped_alone(Classifier, row) for row in data]
    assert (s_with - s_without).norm().item() / CLIP <= 1 + 1e-4
    for s, examples in ((s_without, range(8)), (s_with, range(9))):
        expected = torch.stack([clipped[i] for i in examples]).sum(0)
        torch.testing.assert_close(s, expected, rtol=0, atol=2e-5 * CLIP)
