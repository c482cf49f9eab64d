"""Audit of Swin's per-example relative position bias tables (dp_hf.per_example.swin) and BEiT's layer scale
(dp_hf.per_example.ghost.layer_scale), on configurations tests/test_swin.py, tests/test_layer_scale.py and
tests/test_beit_audit.py do not cover.

Every configuration is either exact or refused before a step. Exact: the fast path's per-example norms and
clipped sums, in ghost mode and in materialize mode under a shifted and scaled (MacAdam-like) geometry, equal one
example at a time through the model (float64 autograd), and in DPTrainer one example added to a sigma-0 DP-SGD
step moves the update by at most C. Refused: with a clear error naming the part and the fix.

Swin, exact: one window per image (``nW = 1``: batch-first rows, no provenance needed), three stages with 1, 2 and
4 heads, one table tied between three blocks, one bias module shared by two attentions, only the tables trainable
(one window; tied; ``ws = 5``, 625 factored shared-id positions; tables with rows no window uses, their ``-c/s`` in
the geometry), SwinBackbone (``always_partition``, padded maps), SwinForMaskedImageModeling, frozen absolute
positions interpolated to a non-square image, bf16 autocast, and Donut-Swin / Swinv2 with their own attention's
output frozen (their flattened windows are verified rows). Refused: a bias module in eval mode under a training
attention (own loop), the reverse, trainable absolute positions, Swinv2's logit scale, Donut-Swin's tables,
Donut-Swin's attention output on window rows, and an attention function other than transformers' own (one
registered in ``ALL_ATTENTION_FUNCTIONS`` under "sdpa" or "eager", or the known text bound to another
``eager_attention_forward``): the replacement computed Swin's eager attention regardless, so the per-example
gradients were another model's (the hole this audit fixed: 5% off the norms, 16% off the clipped sum for an
attention output times 3, with no error; DPTrainer's probe caught x3, not x1.05). A deep copy of a hooked Swin is
not hooked (its attention forwards held a deep copy of the whole clipping).

BEiT, exact: mean pooling, frozen per-layer relative bias interpolated to a 24 x 20 image, a frozen shared relative
bias, no layer scale (``layer_scale_init_value`` 0 or negative), one lambda frozen, only the lambdas of one kind
and the head, Data2VecVision with mean pooling, an attention mask, BeitBackbone. Refused: ``lambda_1`` tied to
``lambda_2`` (two uses), a lambda tied to a LayerNorm weight (in its layer or the next), trainable shared relative
bias, Data2VecVision's cls token, BeitForSemanticSegmentation (BatchNorm), trainable lambdas on Opacus's hooks.

Mutations checked to make these tests fail: the table's per-example lookup averaged over the batch (the
only-tables cases; with every tensor trainable the tables' share of these tiny models' gradients is ~1e-6), a
layer-scale record averaged over the batch, the attention-function check removed, the adapter's ``__getstate__``
removed.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import datasets
import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.swin import modeling_swin
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from dp_hf import DPTrainer
from dp_hf.per_example import attach_fast_clipping, attach_grad_sample
from dp_hf.per_example.errors import PerSampleGradientError, UnsupportedModuleError
from dp_hf.privatizer import Geometry, clip_factors
from tests.dp_training import one_sgd_step_args

LABELS = 3


# -- the reference: one example at a time, float64 ------------------------------------------------------------


def trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def loop_gradients(model: nn.Module, batch: dict, loss, double: bool = True, autocast: bool = False):
    """Per trainable tensor, ``[B, *shape]`` float64: each example alone through a copy of ``model``."""
    model = copy.deepcopy(model)
    if double:
        model = model.double()
    rows = []
    for i in range(batch["labels"].shape[0]):
        one = {k: v[i : i + 1] for k, v in batch.items()}
        if double:
            one = {k: v.double() if v.is_floating_point() else v for k, v in one.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            total = loss(model, one).sum()
        grads = torch.autograd.grad(total, trainable(model), allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for g, p in zip(grads, trainable(model))])
    return [torch.stack(row).double() for row in zip(*rows)]


def macadam_like(grads: list[torch.Tensor]):
    """A shift near the mean gradient on two tensors in three, a scale in [0.5, 1.5) on every other one: both on
    each tensor's own scale (a tiny table's gradient is not drowned by a fixed shift)."""
    generator = torch.Generator().manual_seed(0)
    shift = [
        None
        if k % 3 == 1
        else (0.3 * g.mean(0) + 0.1 * g.abs().mean() * torch.randn(g.shape[1:], generator=generator)).float()
        for k, g in enumerate(grads)
    ]
    scale = [
        torch.rand(g.shape[1:], generator=generator) + 0.5 if k % 2 == 0 else None
        for k, g in enumerate(grads)
    ]
    return shift, scale


def reference(grads, clip, shift, scale):
    n = len(grads)
    w = [
        (g - (0 if c is None else c.double())) / (1 if s is None else s.double())
        for g, c, s in zip(grads, shift or [None] * n, scale or [None] * n)
    ]
    norms = torch.sqrt(sum(x.flatten(1).square().sum(1) for x in w))
    factors = clip_factors(norms, clip).double()
    return [torch.einsum("b,b...->...", factors, x) for x in w], norms


def fast(model, batch, loss, mode, geometry, autocast=False):
    clipping = attach_fast_clipping(model, mode=mode)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            total = loss(model, batch).sum()
        total.backward()
        sums, norms = clipping.clipped_sum(trainable(model), geometry)
    finally:
        clipping.remove()
    return [s.double() for s in sums], norms.double()


GEOMETRIES = {"ghost": ("ghost", False), "materialize-macadam": ("materialize", True)}


def check_exact(make, batch, loss, geometry: str, rtol=1e-4, autocast=False) -> None:
    mode, shifted = GEOMETRIES[geometry]
    model = make()
    grads = loop_gradients(model, batch, loss, double=not autocast, autocast=autocast)
    _, unclipped = reference(grads, float("inf"), None, None)
    clip = float(unclipped.median())  # some examples clipped, some not
    shift, scale = macadam_like(grads) if shifted else (None, None)
    expected_sum, expected_norms = reference(grads, clip, shift, scale)
    hooked = make()
    got_sum, got_norms = fast(hooked, batch, loss, mode, Geometry(clip, shift, scale), autocast=autocast)
    torch.testing.assert_close(got_norms, expected_norms, rtol=rtol, atol=0)
    total = torch.sqrt(sum(e.square().sum() for e in expected_sum))
    for k, (got, expected) in enumerate(zip(got_sum, expected_sum)):  # each tensor nearly on its own scale
        assert (got - expected).norm() <= rtol * (expected.norm() + 0.01 * total), f"tensor #{k}"
    assert all("forward" not in m.__dict__ for m in hooked.modules())  # adapters removed with the hooks


def check_refused(make, batch, loss, mode, error, match) -> None:
    model = make()
    with pytest.raises(error, match=match):
        clipping = attach_fast_clipping(model, mode=mode)
        try:
            loss(model, batch).sum().backward()
            clipping.clipped_sum(trainable(model), Geometry(1.0))
        finally:
            clipping.remove()


# -- Swin ------------------------------------------------------------------------------------------------------

SWIN = dict(image_size=10, patch_size=2, num_channels=3, embed_dim=8, depths=[2, 2], num_heads=[1, 2])
SWIN.update(window_size=2, num_labels=LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def tiny_swin(model_cls=tf.SwinForImageClassification, config_cls=tf.SwinConfig, freeze=(), **overrides):
    """Every parameter trainable but those whose name contains one of ``freeze``; raw tensors (tables, position
    embeddings, mask token) away from their zero init."""
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**SWIN, "drop_path_rate": 0.0, **overrides})).train()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in ("relative_position_bias_table", "position_embeddings", "mask_token")):
                p.copy_(torch.randn(p.shape, generator=generator))
            p.requires_grad_(not any(s in name for s in freeze))
    return model


def images(n: int = 3, height: int = 10, width: int | None = None, seed: int = 0, masked: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    batch = {
        "pixel_values": torch.randn(n, 3, height, width or height, generator=generator),
        "labels": torch.randint(0, LABELS, (n,), generator=generator),
    }
    if masked:
        batch["bool_masked_pos"] = torch.rand(n, masked, generator=generator) < 0.5
    return batch


def classify(model, batch, **kwargs):
    arguments = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**arguments, **kwargs)
    logits = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    if logits.dim() == 2 and logits.shape[-1] == LABELS:
        return F.cross_entropy(logits, batch["labels"], reduction="none")
    return logits.square().flatten(1).sum(1)


def reconstruct(model, batch):
    return (
        model(pixel_values=batch["pixel_values"], bool_masked_pos=batch["bool_masked_pos"])
        .reconstruction.square()
        .flatten(1)
        .sum(1)
    )


def feature_maps(model, batch):
    maps = model(pixel_values=batch["pixel_values"]).feature_maps
    return sum((k + 1) * f.square().flatten(1).sum(1) for k, f in enumerate(maps))


def interpolated(model, batch):
    return classify(model, batch, interpolate_pos_encoding=True)


def bias_modules(model, kind="SwinRelativePositionBias"):
    return [m for m in model.modules() if type(m).__name__ == kind]


def tied_tables():
    model = tiny_swin(image_size=16, num_heads=[2, 2])
    first, second = model.swin.encoder.layers
    table = first.blocks[0].attention.relative_position_bias.relative_position_bias_table
    first.blocks[1].attention.relative_position_bias.relative_position_bias_table = table
    second.blocks[1].attention.relative_position_bias.relative_position_bias_table = table
    return model


def shared_bias_module():
    model = tiny_swin()
    blocks = model.swin.encoder.layers[0].blocks
    blocks[1].attention.relative_position_bias = blocks[0].attention.relative_position_bias
    return model


def only_tables(model):
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("relative_position_bias_table"))
    return model


def tables_with_unused_rows():
    """Three table rows no window position reads: their ``G_i`` is 0, their ``w_i`` is ``-c/s``."""
    model = tiny_swin()
    for bias in bias_modules(model):
        table = bias.relative_position_bias_table.detach()
        bias.relative_position_bias_table = nn.Parameter(torch.cat([table, torch.randn(3, table.shape[1])]))
    return only_tables(model)


def backbone():
    config = dict(out_features=["stage1", "stage2"], image_size=16)
    return tiny_swin(tf.SwinBackbone, **config)


SWIN_EXACT = {
    # 8 x 8 pixels, patches of 2: a 4 x 4 grid, one window of 4 (no shift)
    "one-window": (lambda: tiny_swin(image_size=8, window_size=4, depths=[2], num_heads=[2]), images(height=8), classify),
    "one-window-only-tables": (lambda: only_tables(tiny_swin(image_size=8, window_size=4, depths=[2], num_heads=[2])), images(height=8), classify),
    "three-stages-1-2-4-heads": (lambda: tiny_swin(image_size=16, depths=[2, 2, 2], num_heads=[1, 2, 4]), images(height=16), classify),
    "table-tied-between-three-blocks": (tied_tables, images(height=16), classify),
    "table-tied-between-three-blocks-only-tables": (lambda: only_tables(tied_tables()), images(height=16), classify),
    "bias-module-shared-by-two-attentions": (shared_bias_module, images(), classify),
    "only-tables-ws5-factored": (lambda: only_tables(tiny_swin(image_size=20, window_size=5, depths=[2], num_heads=[2])), images(height=20), classify),
    "only-tables-with-unused-rows": (tables_with_unused_rows, images(), classify),
    "backbone-padded-always-partition": (backbone, images(height=10), feature_maps),
    "masked-image-modeling": (lambda: tiny_swin(tf.SwinForMaskedImageModeling, freeze=("mask_token",), image_size=8, encoder_stride=4), images(height=8, masked=16), reconstruct),
    "frozen-absolute-positions-interpolated-10x14": (lambda: tiny_swin(use_absolute_embeddings=True, freeze=("position_embeddings",)), images(height=10, width=14), interpolated),
    "donut-swin-tables-and-attention-output-frozen": (lambda: tiny_swin(tf.DonutSwinForImageClassification, tf.DonutSwinConfig, freeze=("relative_position_bias_table", "attention.output")), images(), classify),
    "swinv2-logit-scale-cpb-and-attention-output-frozen": (lambda: tiny_swin(tf.Swinv2ForImageClassification, tf.Swinv2Config, freeze=("logit_scale", "continuous_position_bias_mlp", "attention.output")), images(), classify),
}  # fmt: skip


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("name", list(SWIN_EXACT))
def test_swin_configurations_match_a_one_example_loop(name, geometry):
    make, batch, loss = SWIN_EXACT[name]
    check_exact(make, batch, loss, geometry)


def test_swin_under_bf16_autocast_matches_a_one_example_loop():
    """The same autocast in the loop (float32 reference): rounding only, far below a table summed over the batch."""
    check_exact(tiny_swin, images(), classify, "ghost", rtol=3e-2, autocast=True)


def in_eval(kind):
    def make():
        model = tiny_swin()
        for module in model.modules():
            if type(module).__name__ == kind:
                module.eval()
        return model

    return make


def attention_in_eval():
    model = in_eval("SwinAttention")()
    for bias in bias_modules(model):
        bias.train()
    return model


OUTSIDE = "received a gradient outside the hooked modules"
SWIN_REFUSED = {
    # own loop: the class's lookup runs (the bias module does not record), its .grad is refused
    "bias-module-in-eval": (in_eval("SwinRelativePositionBias"), PerSampleGradientError, OUTSIDE),
    "attention-in-eval-bias-in-train": (attention_in_eval, PerSampleGradientError, "looked up outside the per-example window attention"),
    "trainable-absolute-positions": (lambda: tiny_swin(use_absolute_embeddings=True), UnsupportedModuleError, r"SwinEmbeddings"),
    "swinv2": (lambda: tiny_swin(tf.Swinv2ForImageClassification, tf.Swinv2Config), UnsupportedModuleError, r"Swinv2SelfAttention\): no fast per-example rule for this module type \(its trainable tensors: [^)]*logit_scale"),
    "swinv2-logit-scale-frozen": (lambda: tiny_swin(tf.Swinv2ForImageClassification, tf.Swinv2Config, freeze=("logit_scale",)), PerSampleGradientError, r"attention.output.dense \(Linear\) received an input with leading"),
    "donut-swin-trainable-tables": (lambda: tiny_swin(tf.DonutSwinForImageClassification, tf.DonutSwinConfig), UnsupportedModuleError, r"DonutSwinSelfAttention\): no fast per-example rule for this module type \(its trainable tensors: [^)]*relative_position_bias_table"),
    "donut-swin-frozen-tables": (lambda: tiny_swin(tf.DonutSwinForImageClassification, tf.DonutSwinConfig, freeze=("relative_position_bias_table",)), PerSampleGradientError, r"attention.output.dense \(Linear\) received an input with leading"),
}  # fmt: skip


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("name", list(SWIN_REFUSED))
def test_swin_configurations_without_a_rule_are_refused(name, mode):
    make, error, match = SWIN_REFUSED[name]
    check_refused(make, images(), classify, mode, error, match)


def tripled_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Swin's eager attention, its output times 3: what a function registered in the interface computes."""
    output, weights = modeling_swin.eager_attention_forward(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )
    return 3 * output, weights


def eager_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What :class:`OtherEagerAttention`'s text calls by this name: not Swin's eager attention."""
    return tripled_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


class OtherEagerAttention(modeling_swin.SwinAttention):
    """SwinAttention's forward, to the token, in a module where ``eager_attention_forward`` is another function."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        relative_position_bias = self.relative_position_bias()
        if attention_mask is not None:
            num_windows = attention_mask.shape[0]
            batch_size = input_shape[0] // num_windows
            seq_len = input_shape[1]
            attention_mask = (
                attention_mask.unsqueeze(1)
                .unsqueeze(0)
                .expand(batch_size, -1, -1, -1, -1)
                .reshape(-1, 1, seq_len, seq_len)
            )
            combined_mask = relative_position_bias + attention_mask
        else:
            combined_mask = relative_position_bias
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            combined_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return (attn_output, attn_weights)


def other_attention_function(how: str, tables: bool, monkeypatch):
    """A Swin whose attention computes something else than the replacement would: a function registered in
    ``ALL_ATTENTION_FUNCTIONS`` under its implementation's name, or the known text bound to another eager."""
    implementation = "eager" if how in ("registered-eager", "other-eager-global") else "sdpa"
    model = tiny_swin(freeze=() if tables else ("relative_position_bias_table",))
    model.config._attn_implementation = implementation
    if how.startswith("registered"):
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, implementation, tripled_attention)
    else:
        for module in model.modules():
            if type(module) is modeling_swin.SwinAttention:
                module.__class__ = OtherEagerAttention
    return model


@pytest.mark.parametrize("tables", [True, False], ids=["trainable-tables", "frozen-tables"])
@pytest.mark.parametrize("how", ["registered-sdpa", "registered-eager", "other-eager-global"])
def test_an_attention_function_other_than_transformers_own_is_refused(how, tables, monkeypatch):
    """The replacement computes Swin's eager attention; the class's forward calls what the interface and its
    globals give. Before, another function ran only in the hooks-off forward and the replacement's per-example
    gradients were another model's, with no error in an own loop (``tripled_attention``: norms 5% off, the
    clipped sum 16%; DPTrainer's attribution probe refused x3 but trained an output times 1.05)."""
    model = other_attention_function(how, tables, monkeypatch)
    match = "SwinRelativePositionBias" if tables else r"o_proj \(Linear\) received an input with leading"
    refused = (PerSampleGradientError, UnsupportedModuleError)
    check_refused(lambda: model, images(), classify, "ghost", refused, match)


def test_a_deep_copy_of_a_hooked_swin_is_not_hooked():
    """The copy's attention runs the class's forward and holds no copy of the clipping; a later attach installs
    a fresh adapter in place of the copied one."""
    model = tiny_swin(freeze=("relative_position_bias_table",))
    clipping = attach_fast_clipping(model)
    copied = copy.deepcopy(model)
    clipping.remove()
    adapters = [m.__dict__["forward"] for m in copied.modules() if type(m).__name__ == "SwinAttention"]
    assert len(adapters) == 4 and all(adapter.owner is None for adapter in adapters)
    classify(copied, images()).sum().backward()
    expected = torch.autograd.grad(classify(model, images()).sum(), trainable(model))
    for p, g in zip(trainable(copied), expected):
        torch.testing.assert_close(p.grad, g)


# -- BEiT and Data2VecVision -----------------------------------------------------------------------------------

BEIT = dict(
    image_size=16, num_channels=3, num_labels=LABELS, patch_size=4, hidden_size=16, num_hidden_layers=2
)
BEIT.update(num_attention_heads=2, intermediate_size=24, layer_scale_init_value=0.1, drop_path_rate=0.0)


def tiny_beit(
    model_cls=tf.BeitForImageClassification, config_cls=tf.BeitConfig, freeze=(), only=None, **overrides
):
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**BEIT, **overrides})).train()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(
                s in name for s in ("lambda", "token", "position_embeddings", "relative_position_bias_table")
            ):
                p.copy_(0.5 + torch.rand(p.shape, generator=generator))
            p.requires_grad_(
                not any(s in name for s in freeze) and (only is None or any(s in name for s in only))
            )
    return model


def beit_images(height=16, width=16, mask=False) -> dict:
    batch = images(4, height, width, seed=3)
    if mask:  # an attention mask over the cls token and 16 patches, the cls token always kept
        keep = torch.rand(4, 17, generator=torch.Generator().manual_seed(9)) < 0.7
        batch["attention_mask"] = keep.index_fill(1, torch.tensor([0]), True).long()
    return batch


D2V = dict(model_cls=tf.Data2VecVisionForImageClassification, config_cls=tf.Data2VecVisionConfig)
TABLES = "relative_position_bias_table"

BEIT_EXACT = {
    "mean-pooling": (lambda: tiny_beit(use_mean_pooling=True), beit_images(), classify),
    "frozen-relative-bias-interpolated-24x20": (lambda: tiny_beit(use_relative_position_bias=True, freeze=(TABLES,)), beit_images(24, 20), interpolated),
    "frozen-shared-relative-bias": (lambda: tiny_beit(use_shared_relative_position_bias=True, freeze=(TABLES,)), beit_images(), classify),
    "no-layer-scale-zero-init": (lambda: tiny_beit(layer_scale_init_value=0.0), beit_images(), classify),
    "no-layer-scale-negative-init": (lambda: tiny_beit(layer_scale_init_value=-0.1), beit_images(), classify),
    "lambda-1-frozen": (lambda: tiny_beit(freeze=("lambda_1",)), beit_images(), classify),
    "only-lambda-2-and-head": (lambda: tiny_beit(only=("lambda_2", "classifier")), beit_images(), classify),
    "data2vec-mean-pooling-frozen-relative-bias": (lambda: tiny_beit(**D2V, use_mean_pooling=True, use_relative_position_bias=True, freeze=("cls_token", TABLES)), beit_images(), classify),
    # Refused until its embeddings (BEiT's, returning (embeddings, (h, w))) joined the ViT/BEiT rule.
    "data2vec-trainable-cls-token": (lambda: tiny_beit(**D2V), beit_images(), classify),
    "attention-mask": (tiny_beit, beit_images(mask=True), classify),
    "backbone-absolute-positions": (lambda: tiny_beit(tf.BeitBackbone, out_indices=[1, 2], add_fpn=False, use_absolute_position_embeddings=True), beit_images(), feature_maps),
}  # fmt: skip


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("name", list(BEIT_EXACT))
def test_beit_configurations_match_a_one_example_loop(name, geometry):
    make, batch, loss = BEIT_EXACT[name]
    check_exact(make, batch, loss, geometry)


def tie(target: str, source: str):
    def make():
        model = tiny_beit()
        owner, attribute = target.rsplit(".", 1)
        setattr(model.get_submodule(owner), attribute, model.get_parameter(source))
        return model

    return make


SEGMENTATION = dict(
    out_indices=[0, 1, 2, 3], num_hidden_layers=4, use_auxiliary_head=False, pool_scales=[1, 2]
)
BEIT_REFUSED = {
    "lambda-1-is-lambda-2": (tie("beit.layers.0.lambda_2", "beit.layers.0.lambda_1"), PerSampleGradientError, r"multiplied by its layer scale \{'lambda_1': 2\}"),
    "lambda-tied-to-its-layer-norm": (tie("beit.layers.0.layernorm_after.weight", "beit.layers.0.lambda_1"), PerSampleGradientError, "other than as one operand of a product"),
    "lambda-tied-to-the-next-layer-norm": (tie("beit.layers.1.layernorm_before.weight", "beit.layers.0.lambda_2"), PerSampleGradientError, OUTSIDE),
    "trainable-shared-relative-bias": (lambda: tiny_beit(use_shared_relative_position_bias=True), UnsupportedModuleError, r"shared_position_bias \(BeitRelativePositionBias\)"),
    "semantic-segmentation": (lambda: tiny_beit(tf.BeitForSemanticSegmentation, **SEGMENTATION, auxiliary_channels=8), UnsupportedModuleError, r"BatchNorm2d"),
}  # fmt: skip


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("name", list(BEIT_REFUSED))
def test_beit_configurations_without_a_rule_are_refused(name, mode):
    make, error, match = BEIT_REFUSED[name]
    check_refused(make, beit_images(), classify, mode, error, match)


def test_trainable_lambdas_are_refused_on_opacus_hooks():
    """No Opacus rule for the layer scale: refused at the first forward (the fallback would replay the layer)."""
    model = tiny_beit()
    handle = attach_grad_sample(model)
    try:
        with pytest.raises(UnsupportedModuleError, match=r"beit.layers.0 \(BeitLayer\)"):
            classify(model, beit_images()).sum().backward()
    finally:
        handle.remove()


# -- DPTrainer, black box: one DP-SGD step at sigma = 0, one example added moves the update by <= C ------------

CLIP, LR = 1e-3, 1e4


def trainer_update(make, rows: list[dict], output_dir, mode: str) -> torch.Tensor:
    model = make()
    before = torch.cat([p.detach().double().flatten() for p in trainable(model)])
    args = one_sgd_step_args(output_dir, len(rows), CLIP, LR, per_sample_gradient_mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0 and delta >= 1/N warn, rightly
        trainer = DPTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows))
        trainer.train()
    assert trainer.state.global_step == 1
    after = torch.cat([p.detach().double().flatten() for p in trainable(model)])
    return (before - after) * len(rows) / LR


TRAINER = {
    "swin-table-tied-between-three-blocks": (tied_tables, images(5, 16, seed=3), "auto"),
    "swin-one-window-only-tables": (lambda: only_tables(tiny_swin(image_size=8, window_size=4, depths=[2], num_heads=[2])), images(5, 8, seed=3), "materialize"),
    "data2vec-mean-pooling": (lambda: tiny_beit(**D2V, use_mean_pooling=True, freeze=("cls_token",)), images(5, 16, seed=3), "auto"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(TRAINER))
def test_one_example_moves_a_dp_sgd_step_by_at_most_its_clip(name, tmp_path):
    make, batch, mode = TRAINER[name]
    rows = [{k: v[i].tolist() for k, v in batch.items()} for i in range(5)]
    without = trainer_update(make, rows[:4], tmp_path / "without", mode)
    with_one = trainer_update(make, [rows[4], *rows[:4]], tmp_path / "with", mode)
    assert (with_one - without).norm().item() / CLIP <= 1 + 1e-4
    grads = torch.cat([g.flatten(1) for g in loop_gradients(make(), batch, classify)], 1)
    clipped = grads * (CLIP / grads.norm(dim=1, keepdim=True)).clamp(max=1.0)
    torch.testing.assert_close(without, clipped[:4].sum(0), rtol=0, atol=2e-5 * CLIP)
    torch.testing.assert_close(with_one, clipped.sum(0), rtol=0, atol=2e-5 * CLIP)
