"""Audit of learned positions, flattened rows, relative attention biases and the known-code reader.

Configurations the feature tests do not cover, each either exact (per-example norms and clipped sums equal a
loop of single examples through plain autograd, in the identity geometry and in a shifted and scaled one) or
refused with a clear error: OPT post-norm with ``project_in``/``project_out``, its classification and QA heads,
explicit and ``[T]`` position ids, padding in the middle; BART's causal LM, encoder alone, mBART's scaled
embeddings with a decoder mask, BioGPT; T5 with unusual buckets, one target token, ``B == S == T``, its encoder
alone, an encoder/decoder bias tied by hand, UMT5, LongT5 (its local bias refused, its decoder exact),
Pix2Struct's text decoder, MPNet's masked LM with ``B == T``; Blenderbot's ``[T]`` positions, a mixin in the
``super()`` chain of OPT's positions that adds other rows, sequence-major flattened rows with ``B == T``
(refused). Where the new rule covers only some tensors, only those are trained (their share of a whole
model's norm is small enough to hide a wrong rule). A DP-SGD step at sigma 0 through ``DPTrainer`` with
micro-batches of 2, 2 and 1 examples moves by at most ``C`` when one example is added.

Holes found, fixed in :mod:`dp_hf.per_example.known_code` (every reader of known code):

* a subclass whose ``compute_bias`` is T5's text in a module whose ``torch`` counted in steps of 2 (or whose
  ``torch`` is a closure variable) was recognised, and dp_hf's per-example copy of the body ran instead of
  the class's: per-example norms 5% and the clipped sum 27% off the loop (a whole T5), silently;
* ``MPNetEncoder.compute_position_bias.__defaults__`` set to 16 buckets: dp_hf's copy used the 32 its text
  writes (the bias's per-example norms 23% off, the clipped sum 123%);
* ``T5Attention.compute_bias.__code__`` replaced after a first read: its cached text was still recognised;
* transformers' checkpointing wrapper whose ``__wrapped__`` names another function than the one it calls.

Now the reader refuses all four, and the relative bias falls back to the class's own ``[q, k]`` lookup, which
the hooks refuse. Mutation check: each known-code test fails with ``known_code.py`` of before the fix.
"""

from __future__ import annotations

import importlib.util
import inspect
import textwrap
import warnings

import datasets
import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn
from transformers.models.beit.modeling_beit import BeitLayer
from transformers.models.mpnet.modeling_mpnet import MPNetEncoder
from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding
from transformers.models.t5.modeling_t5 import T5Attention

from dp_hf import DPTrainer
from dp_hf.per_example import attach_fast_clipping, attach_grad_sample
from dp_hf.per_example.errors import PerSampleGradientError, UnsupportedModuleError
from dp_hf.per_example.known_code import normalized_source, signature_and_body
from dp_hf.per_example.relative_bias import _PerExampleBias, known_bias_method
from dp_hf.privatizer import Geometry, clip_factors
from tests.dp_training import one_sgd_step_args
from tests.test_learned_positions_and_flat_rows import FlatMLP, flat_mlp_losses

V, H = 40, 16
NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)

# ------------------------------------------------------------------------------------------- tiny models


def opt(cls=tf.OPTForCausalLM, **overrides):
    def build():
        torch.manual_seed(0)
        config = dict(
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=2,
            num_attention_heads=2,
            ffn_dim=24,
            word_embed_proj_dim=H,
            max_position_embeddings=32,
            pad_token_id=1,
            layerdrop=0.0,
            num_labels=3,
            **NO_DROPOUT,
        )
        return cls(tf.OPTConfig(**{**config, **overrides})).train()

    return build


def seq2seq(cls, config_cls, **overrides):
    def build():
        torch.manual_seed(0)
        config = dict(
            vocab_size=V,
            d_model=H,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=24,
            decoder_ffn_dim=24,
            max_position_embeddings=32,
            encoder_layerdrop=0.0,
            decoder_layerdrop=0.0,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
            **NO_DROPOUT,
        )
        return cls(config_cls(**{**config, **overrides})).train()

    return build


def bart_encoder():
    return seq2seq(tf.BartModel, tf.BartConfig)().encoder


def biogpt():
    torch.manual_seed(0)
    config = tf.BioGptConfig(
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
        pad_token_id=1,
    )
    return tf.BioGptForCausalLM(config).train()


T5_SIZES = dict(
    vocab_size=V,
    d_model=H,
    d_kv=8,
    d_ff=24,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=2,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    dropout_rate=0.0,
    decoder_start_token_id=0,
    pad_token_id=0,
)


def t5(cls=tf.T5ForConditionalGeneration, config_cls=tf.T5Config, attn="sdpa", **overrides):
    def build():
        torch.manual_seed(0)
        config = config_cls(**{**T5_SIZES, **overrides})
        config._attn_implementation = attn
        return cls(config).train()

    return build


def t5_tied_bias():
    model = t5()()
    encoder = model.encoder.block[0].layer[0].SelfAttention
    model.decoder.block[0].layer[0].SelfAttention.relative_attention_bias = encoder.relative_attention_bias
    return model


def longt5_local(encoder_bias_trainable: bool):
    def build():
        model = t5(
            tf.LongT5ForConditionalGeneration,
            tf.LongT5Config,
            "eager",
            encoder_attention_type="local",
            local_radius=2,
        )()
        for module in model.encoder.modules():
            if hasattr(module, "relative_attention_bias"):
                module.relative_attention_bias.weight.requires_grad_(encoder_bias_trainable)
        return model

    return build


def pix2struct_text():
    torch.manual_seed(0)
    config = tf.Pix2StructTextConfig(
        **{k: v for k, v in T5_SIZES.items() if k not in ("d_model", "num_decoder_layers")},
        hidden_size=H,
        initializer_range=0.02,
        initializer_factor=1.0,
    )
    config._attn_implementation = "eager"
    return tf.Pix2StructTextModel(config).train()


def mpnet(cls=tf.MPNetForMaskedLM):
    def build():
        torch.manual_seed(0)
        config = tf.MPNetConfig(
            vocab_size=V,
            hidden_size=H,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=24,
            max_position_embeddings=32,
            pad_token_id=1,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=3,
        )
        config._attn_implementation = "eager"
        return cls(config).train()

    return build


# ------------------------------------------------------------------------------------------- batches, losses


def text(
    n: int, length: int, padding: str = "right", seed: int = 0, pad_id: int = 1, target: int = 5
) -> dict:
    """Token ids padded with lengths ``T, T-3, T-1, T-2, ...`` on ``padding`` (left, right, middle, none),
    seq2seq targets and decoder inputs, a class label and per-example position ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    for i in range(n):
        pad = (0, 3, 1, 2)[i % 4] if padding != "none" else 0
        if pad and padding == "left":
            mask[i, :pad] = 0
        elif pad and padding == "right":
            mask[i, length - pad :] = 0
        elif pad and padding == "middle":
            mask[i, 2 : 2 + pad] = 0
    ids = ids.masked_fill(mask == 0, pad_id)
    labels = torch.randint(3, V, (n, target), generator=g)
    decoder = torch.cat([torch.full((n, 1), 2), labels[:, :-1]], dim=1)
    decoder_mask = torch.ones(n, target, dtype=torch.long)
    decoder_mask[0, -2:] = 0
    return dict(
        input_ids=ids,
        attention_mask=mask,
        decoder_input_ids=decoder,
        decoder_attention_mask=decoder_mask,
        labels=labels,
        classes=torch.randint(0, 3, (n,), generator=g),
        position_ids=(mask.cumsum(1) * mask - 1).clamp(min=0) + torch.arange(n)[:, None] % 3,
    )


def causal_lm(*keys):
    def losses(model, batch):
        logits = model(**{k: batch[k] for k in ("input_ids", "attention_mask", *keys)}).logits
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none").sum(1)

    return losses


def seq2seq_lm(*keys):
    def losses(model, batch):
        logits = model(
            **{k: batch[k] for k in ("input_ids", "attention_mask", "decoder_input_ids", *keys)}
        ).logits
        return F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none").sum(1)

    return losses


def classify(*keys):
    def losses(model, batch):
        logits = model(**{k: batch[k] for k in ("input_ids", "attention_mask", *keys)}).logits
        return F.cross_entropy(logits, batch["classes"], reduction="none")

    return losses


def answer(model, batch):
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    )
    start = F.cross_entropy(out.start_logits, batch["classes"], reduction="none")
    return start + F.cross_entropy(out.end_logits, batch["classes"] + 1, reduction="none")


def masked_lm(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").sum(1)


def encoded(model, batch):
    """A per-example loss of an encoder's hidden states (not their norm: a norm layer makes that constant)."""
    hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    direction = torch.linspace(-1, 1, hidden.shape[-1])
    return ((hidden * batch["attention_mask"][..., None]) @ direction).sin().sum(1)


# ------------------------------------------------------------------------------------------- the check


def only(factory, names):
    """``factory``'s model with only the tensors whose name contains one of ``names`` trainable (None: all)."""

    def build():
        model = factory()
        if names is not None:
            for name, p in model.named_parameters():
                p.requires_grad_(any(n in name for n in names))
        return model

    return build


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def rows(batch: dict, i: int) -> dict:
    return {k: v[i : i + 1] for k, v in batch.items()}


def loop_gradients(factory, losses, batch) -> torch.Tensor:
    """``[B, d]``: each example's gradient alone (plain autograd, a batch of one, the same padded row)."""
    model = factory()
    out = []
    for i in range(batch["input_ids"].shape[0]):
        grads = torch.autograd.grad(losses(model, rows(batch, i)).sum(), trainable(model), allow_unused=True)
        out.append(
            torch.cat(
                [(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(grads, trainable(model))]
            )
        )
    return torch.stack(out).double()


def geometry_of(model, kind: str):
    """The identity, or a shifted and scaled geometry (DP-MacAdam's: ``w_i = (g_i - c) / s``)."""
    if kind == "identity":
        return None, None
    g = torch.Generator().manual_seed(1)
    shapes = [p.shape for p in trainable(model)]
    return [1e-3 * torch.randn(s, generator=g) for s in shapes], [
        torch.rand(s, generator=g) + 0.5 for s in shapes
    ]


def reference_clipped_sum(grads: torch.Tensor, clip: float, shift, scale):
    w = grads
    if shift is not None:
        w = (w - torch.cat([c.flatten() for c in shift]).double()) / torch.cat(
            [s.flatten() for s in scale]
        ).double()
    norms = w.norm(dim=1)
    return (clip_factors(norms, clip).double()[:, None] * w).sum(0), norms


def clipped_sum(factory, losses, batch, path: str, geometry: str, clip: float | None = None):
    """``(sum, norms, clip)`` on ``path`` (ghost, materialize or opacus), ``clip`` between the examples' norms."""
    model = factory()
    params = trainable(model)
    shift, scale = geometry_of(model, geometry)
    if path == "opacus":
        handle = attach_grad_sample(model)
        try:
            losses(model, batch).sum().backward()
            per_example = handle.per_sample_gradients(check_sums=True)
        finally:
            handle.remove()
        names = {id(p): n for n, p in model.named_parameters()}
        w = torch.cat([per_example[names[id(p)]].flatten(1) for p in params], dim=1).double()
        if shift is not None:
            w = (w - torch.cat([c.flatten() for c in shift]).double()) / torch.cat(
                [s.flatten() for s in scale]
            ).double()
        norms = w.norm(dim=1)
        return (clip_factors(norms, clip).double()[:, None] * w).sum(0), norms
    clipping = attach_fast_clipping(model, mode=path)
    try:
        losses(model, batch).sum().backward()
        sums, norms = clipping.clipped_sum(params, Geometry(clip, shift, scale))
    finally:
        clipping.remove()
    return torch.cat([s.flatten() for s in sums]).double(), norms.double()


def assert_exact(factory, losses, batch, path: str, geometry: str = "identity") -> None:
    reference = loop_gradients(factory, losses, batch)
    shift, scale = geometry_of(factory(), geometry)
    _, unclipped = reference_clipped_sum(reference, float("inf"), shift, scale)
    assert (unclipped > 0).all()
    clip = float(unclipped.sort().values[len(unclipped) // 2])  # some examples clipped, some not
    expected_sum, expected_norms = reference_clipped_sum(reference, clip, shift, scale)
    got_sum, got_norms = clipped_sum(factory, losses, batch, path, geometry, clip)
    torch.testing.assert_close(got_norms, expected_norms, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got_sum, expected_sum, rtol=1e-4, atol=1e-6 * clip)


# ------------------------------------------------------------------------------------------- exact

POS, MLP, BIAS = (
    ["embed_positions"],
    ["embed_positions", "fc1", "fc2", "final_layer_norm"],
    ["relative_attention_bias"],
)

EXACT = {  # name -> (factory, trained tensors (None: all), losses, batch, paths)
    "opt-postnorm-proj-seqcls-left": (
        opt(tf.OPTForSequenceClassification, word_embed_proj_dim=8, do_layer_norm_before=False),
        None,
        classify(),
        text(3, 7, "left"),
        ("ghost", "materialize"),
    ),
    "opt-qa-explicit-positions-middle-padding": (
        opt(tf.OPTForQuestionAnswering),
        MLP,
        answer,
        text(3, 7, "middle"),
        ("ghost",),
    ),
    "opt-B==T": (opt(), MLP, causal_lm(), text(5, 5, "left"), ("ghost", "materialize")),
    "bart-causal-lm-B==T": (
        seq2seq(tf.BartForCausalLM, tf.BartConfig),
        POS,
        causal_lm(),
        text(5, 5),
        ("ghost", "materialize"),
    ),
    "bart-encoder-alone": (bart_encoder, POS, encoded, text(3, 7), ("materialize",)),
    "mbart-scaled-decoder-mask": (
        seq2seq(tf.MBartForConditionalGeneration, tf.MBartConfig, scale_embedding=True),
        None,
        seq2seq_lm("decoder_attention_mask"),
        text(3, 7),
        ("ghost",),
    ),
    "biogpt-left": (biogpt, POS, causal_lm(), text(3, 7, "left"), ("ghost",)),
    "t5-B==S==T": (
        t5(),
        BIAS,
        seq2seq_lm("decoder_attention_mask"),
        text(4, 4, pad_id=0, target=4),
        ("ghost", "materialize", "opacus"),
    ),
    "t5-5-buckets-distance-3-one-target": (
        t5(relative_attention_num_buckets=5, relative_attention_max_distance=3),
        BIAS,
        seq2seq_lm(),
        text(3, 7, pad_id=0, target=1),
        ("ghost",),
    ),
    "t5-encoder-model": (
        t5(tf.T5EncoderModel),
        BIAS,
        encoded,
        text(3, 7, "middle", pad_id=0),
        ("ghost", "opacus"),
    ),
    "t5-bias-tied-encoder-decoder": (
        t5_tied_bias,
        BIAS,
        seq2seq_lm(),
        text(3, 7, pad_id=0),
        ("ghost", "materialize"),
    ),
    "umt5-B==S==T": (
        t5(tf.UMT5ForConditionalGeneration, tf.UMT5Config),
        BIAS,
        seq2seq_lm(),
        text(4, 4, pad_id=0, target=4),
        ("ghost", "materialize"),
    ),
    "longt5-local-decoder-bias": (
        longt5_local(False),
        ["decoder.block.0.layer.0.SelfAttention.relative"],
        seq2seq_lm(),
        text(3, 7, pad_id=0),
        ("ghost",),
    ),
    "pix2struct-text-B==T": (pix2struct_text, BIAS, causal_lm(), text(4, 4, "none", pad_id=0), ("ghost",)),
    "mpnet-mlm-B==T": (mpnet(), BIAS, masked_lm, text(5, 5), ("ghost", "materialize", "opacus")),
}

EXACT_CASES = [(name, path) for name, case in EXACT.items() for path in case[4]]


@pytest.mark.parametrize("name, path", EXACT_CASES)
def test_new_configurations_equal_a_loop_of_single_examples(name, path):
    factory, names, losses, batch, _ = EXACT[name]
    model = only(factory, names)()
    assert trainable(model)
    if (
        names is not None
    ):  # the new rule's tensors are trained (a wrong rule cannot hide in a whole model's norm)
        assert all(any(n in name for n in names) for name, p in model.named_parameters() if p.requires_grad)
    assert_exact(only(factory, names), losses, batch, path)


@pytest.mark.parametrize("name", ["opt-B==T", "t5-B==S==T", "mpnet-mlm-B==T", "bart-causal-lm-B==T"])
def test_a_shifted_and_scaled_geometry(name):
    factory, names, losses, batch, _ = EXACT[name]
    assert_exact(only(factory, names), losses, batch, "materialize", geometry="macadam")


# ------------------------------------------------------------------------------------------- refused


class _AddOtherRows(nn.Embedding):
    """A mixin in the ``super()`` chain of OPT's recognised positions: adds another example's rows (a new tensor)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        return out + out.roll(1, 0)


class _MixedPositions(OPTLearnedPositionalEmbedding, _AddOtherRows):
    pass


def opt_mixed_positions():
    model = opt()()
    old = model.model.decoder.embed_positions
    new = _MixedPositions(old.weight.shape[0] - old.offset, old.weight.shape[1])
    new.load_state_dict(old.state_dict())
    model.model.decoder.embed_positions = new
    return model


REFUSED = {  # name -> (factory, losses, batch, error, message)
    "opt-position-ids-[T]": (
        opt(),
        causal_lm("position_ids"),
        {**text(3, 7, "none"), "position_ids": torch.arange(7)},
        PerSampleGradientError,
        r"embed_positions \(OPTLearnedPositionalEmbedding\) received an input with leading dimension 7",
    ),
    "opt-positions-mixin-returns-other-rows": (
        opt_mixed_positions,
        causal_lm(),
        text(3, 7),
        PerSampleGradientError,
        r"returned something else than the lookup",
    ),
    "blenderbot-1d-positions": (
        seq2seq(tf.BlenderbotForConditionalGeneration, tf.BlenderbotConfig),
        seq2seq_lm(),
        text(3, 7),
        UnsupportedModuleError,
        r"BlenderbotLearnedPositionalEmbedding\): no fast per-example rule",
    ),
    "longt5-local-encoder-bias-B==block": (
        longt5_local(True),
        seq2seq_lm(),
        text(3, 7, pad_id=0),
        PerSampleGradientError,
        r"LocalSelfAttention.relative_attention_bias \(Embedding\) received an input",
    ),
    "flat-rows-sequence-major-B==T": (
        lambda: FlatMLP("transpose-contiguous"),
        flat_mlp_losses,
        {"input_ids": torch.randint(0, V, (7, 7), generator=torch.Generator().manual_seed(0))},
        PerSampleGradientError,
        r"norm \(LayerNorm\) received an input .* alone and the first two together",
    ),
}


@pytest.mark.parametrize("path", ["ghost", "materialize"])
@pytest.mark.parametrize("name", list(REFUSED))
def test_configurations_without_exact_rule_are_refused(name, path):
    factory, losses, batch, error, message = REFUSED[name]
    with pytest.raises(error, match=message):
        clipped_sum(factory, losses, batch, path, "identity", 1.0)


def test_own_loop_opacus_hooks_probe_the_batch_dimensions():
    """attach_grad_sample runs the first recorded forward on 1 and 2 examples, as attach_fast_clipping does:
    LongT5's local bias has a block dimension equal to the batch of 3, and was 27% off a loop without it."""
    factory, losses, batch = longt5_local(True), seq2seq_lm(), text(3, 7, pad_id=0)
    with pytest.raises(PerSampleGradientError, match="received an input .* alone and the first two together"):
        clipped_sum(factory, losses, batch, "opacus", "identity", 1.0)
    model = factory()  # without the probe, the mismatch is silent (what the probe is for)
    handle = attach_grad_sample(model, probe_batch_dimensions=False)
    try:
        losses(model, batch).sum().backward()
        handle.per_sample_gradients(check_sums=True)
    finally:
        handle.remove()


@pytest.mark.parametrize(
    "model_class, config_class",
    [
        (tf.BlenderbotForConditionalGeneration, tf.BlenderbotConfig),
        (tf.LEDForConditionalGeneration, tf.LEDConfig),
    ],
    ids=["blenderbot", "led"],
)
def test_learned_positions_called_with_a_size_are_refused_by_opacus_hooks_naming_them(
    model_class, config_class
):
    """Their forward takes the input's torch.Size: Opacus's activation hook failed on it with a bare
    AttributeError ('torch.Size' object has no attribute 'detach') that named no module."""
    overrides = (
        dict(max_encoder_position_embeddings=32, max_decoder_position_embeddings=32)
        if config_class is tf.LEDConfig
        else {}
    )
    with pytest.raises(
        UnsupportedModuleError,
        match=r"LearnedPositionalEmbedding\): called with positional inputs that are not tensors \(Size",
    ):
        clipped_sum(
            seq2seq(model_class, config_class, **overrides),
            seq2seq_lm(),
            text(3, 7),
            "opacus",
            "identity",
            1.0,
        )


# ------------------------------------------------------------------------------------------- the known-code reader

SHIM_MODULE = '''
import torch as _torch
from transformers.models.t5.modeling_t5 import T5Attention


class _Torch:
    """torch, but arange counts in steps of 2."""

    def __getattr__(self, name):
        return getattr(_torch, name)

    @staticmethod
    def arange(*args, **kwargs):
        return _torch.arange(*args, **kwargs) * 2


torch = _Torch()


class ShimGlobals(T5Attention):
{compute_bias}

def _closure(torch):
    class ShimClosure(T5Attention):
{closure_compute_bias}
    return ShimClosure


ShimClosure = _closure(_Torch())
'''


@pytest.fixture(scope="module")
def shim_classes(tmp_path_factory):
    """T5Attention subclasses whose ``compute_bias`` is T5's text, their ``torch`` another object (a global, a
    closure variable). Written to a file: the reader reads source files."""
    source = textwrap.indent(textwrap.dedent(inspect.getsource(T5Attention.compute_bias)), "    ")
    path = tmp_path_factory.mktemp("shim") / "shim_t5_attention.py"
    path.write_text(
        SHIM_MODULE.format(compute_bias=source, closure_compute_bias=textwrap.indent(source, "    "))
    )
    spec = importlib.util.spec_from_file_location("shim_t5_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for cls in (module.ShimGlobals, module.ShimClosure):  # the same text as T5's
        assert textwrap.dedent(inspect.getsource(cls.compute_bias)) == textwrap.dedent(
            inspect.getsource(T5Attention.compute_bias)
        )
    return module


def t5_of_class(cls):
    def build():
        model = t5()()
        for module in model.modules():
            if type(module) is T5Attention:
                module.__class__ = cls
        return model

    return build


def doubled_bias(self, query_length, key_length, device=None, past_seen_tokens=0):
    """A replacement code for T5's ``compute_bias``: the bias times 2."""
    context_position = torch.arange(query_length, dtype=torch.long)[:, None] + past_seen_tokens
    memory_position = torch.arange(key_length, dtype=torch.long)[None, :]
    bucket = self._relative_position_bucket(
        memory_position - context_position,
        bidirectional=not self.is_decoder,
        num_buckets=self.relative_attention_num_buckets,
        max_distance=self.relative_attention_max_distance,
    )
    return 2 * self.relative_attention_bias(bucket).permute([2, 0, 1]).unsqueeze(0)


def code_swapped_t5(monkeypatch):
    model = t5()()
    assert (
        known_bias_method(model.encoder.block[0].layer[0].SelfAttention) is not None
    )  # read (and cached) once
    monkeypatch.setattr(T5Attention.compute_bias, "__code__", doubled_bias.__code__)
    return t5()


KNOWN_CODE = ["globals", "closure", "defaults", "code"]
ENCODER_BIAS = r"relative_attention_bias \(Embedding\) received an input"


@pytest.mark.parametrize(
    ("how", "path"),
    [
        (how, path)
        for how in KNOWN_CODE
        for path in ("ghost", "materialize", "opacus")
        if (how, path) != ("code", "opacus")  # (the same reader as the other paths: one is enough)
    ],
)
def test_known_text_that_runs_as_other_code_is_refused(how, path, shim_classes, monkeypatch):
    """Before the fix: recognised, dp_hf's copy of the body recorded, the class's code ran in the loop (silent)."""
    if how == "globals":
        factory, losses, batch = t5_of_class(shim_classes.ShimGlobals), seq2seq_lm(), text(3, 7, pad_id=0)
    elif how == "closure":
        factory, losses, batch = t5_of_class(shim_classes.ShimClosure), seq2seq_lm(), text(3, 7, pad_id=0)
    elif how == "defaults":  # 16 buckets instead of the text's 32 (the config's embedding has 32 rows)
        monkeypatch.setattr(MPNetEncoder.compute_position_bias, "__defaults__", (None, 16))
        factory, losses, batch = mpnet(tf.MPNetForSequenceClassification), classify(), text(3, 7)
    else:
        factory, losses, batch = code_swapped_t5(monkeypatch), seq2seq_lm(), text(3, 7, pad_id=0)
    with pytest.raises(PerSampleGradientError, match=ENCODER_BIAS):  # before the fix: exact assertion failed
        assert_exact(only(factory, BIAS), losses, batch, path)
    module = next(m for m in factory().modules() if hasattr(m, "relative_attention_bias"))
    assert known_bias_method(module) is None  # the class's own [q, k] lookup ran, and was refused


def test_the_known_wrapper_must_call_the_function_it_names():
    class Layer(tf.modeling_layers.GradientCheckpointingLayer):
        def forward(self, hidden_states):
            return hidden_states.flip(0)

    wrapper = Layer.forward
    assert normalized_source(wrapper) is not None  # transformers' wrapper, read through
    wrapper.__wrapped__ = inspect.unwrap(BeitLayer.forward)  # names BEiT's forward, calls Layer's
    assert normalized_source(wrapper) is None and signature_and_body(wrapper) is None
    assert normalized_source(BeitLayer.forward) is not None


def test_the_library_methods_are_still_read():
    from transformers.models.bart.modeling_bart import BartLearnedPositionalEmbedding, BartScaledWordEmbedding
    from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding
    from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding
    from transformers.models.swin.modeling_swin import SwinAttention, SwinRelativePositionBias

    for method in (
        T5Attention.compute_bias,
        MPNetEncoder.compute_position_bias,
        OPTLearnedPositionalEmbedding.forward,
        BartLearnedPositionalEmbedding.forward,
        BartScaledWordEmbedding.forward,
        GemmaTextScaledWordEmbedding.forward,
        BeitLayer.forward,
        SwinAttention.forward,
        SwinRelativePositionBias.forward,
    ):
        assert normalized_source(method) is not None and signature_and_body(method) is not None, method


# ------------------------------------------------------------------------------------------- generation-like lengths


class _Owner:
    def __init__(self, batch: int) -> None:
        self.batch = type("Batch", (), {"batch_size": batch})()

    def recording(self, embedding) -> bool:
        return True


@pytest.mark.parametrize("family", ["t5", "umt5"])
def test_the_per_example_bias_equals_the_class_bias_for_every_length(family):
    """``q != k`` and ``past_seen_tokens > 0`` (generation with a cache, prefixes): each example's copy of the
    per-example lookup equals the class's broadcast bias, in encoder and decoder."""
    model = t5(tf.UMT5Model, tf.UMT5Config)() if family == "umt5" else t5(tf.T5Model)()
    modules = [m for m in model.modules() if hasattr(m, "relative_attention_bias")]
    assert any(m.is_decoder for m in modules) and any(not m.is_decoder for m in modules)
    for module in modules:
        name, buckets = known_bias_method(module)
        adapter = _PerExampleBias(module, name, buckets, _Owner(3))
        for q, k, past in [(1, 9, 8), (3, 7, 4), (4, 4, 0), (5, 2, 0), (2, 40, 38)]:
            ours = adapter(q, k, past_seen_tokens=past)
            theirs = getattr(type(module), name)(module, q, k, past_seen_tokens=past)
            assert ours.shape == (3, *theirs.shape[1:])
            assert torch.equal(ours, theirs.expand_as(ours))


# ------------------------------------------------------------------------------------------- DPTrainer, black box

CLIP, LR = 1e-3, 1e4


def dp_step(factory, data: list[dict], losses_of_outputs, output_dir, **overrides) -> torch.Tensor:
    model = factory()
    before = torch.cat([p.detach().double().flatten() for p in trainable(model)])
    args = one_sgd_step_args(output_dir, len(data), CLIP, LR, remove_unused_columns=False, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0 and delta >= 1/N warn, rightly
        trainer = DPTrainer(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_list(data),
            per_example_loss_fn=losses_of_outputs,
        )
        trainer.train()
    assert trainer.state.global_step == 1 and trainer.sample_rate == 1.0
    return (before - torch.cat([p.detach().double().flatten() for p in trainable(model)])) * len(data) / LR


def classes_of_outputs(outputs, labels, inputs):
    return F.cross_entropy(outputs["logits"], labels, reduction="none")


@pytest.mark.parametrize("mode", ["auto", "materialize"])
def test_one_example_moves_an_opt_step_by_at_most_its_clip(mode, tmp_path):
    """OPT post-norm with ``project_in``/``project_out``, micro-batches of 2, 2 and 1 examples (physical
    splits of one Poisson batch): one example added moves the sigma-0 update by at most ``C``."""
    factory = opt(tf.OPTForSequenceClassification, word_embed_proj_dim=8, do_layer_norm_before=False)
    batch = text(5, 7, "right", seed=3)
    data = [
        {
            "input_ids": batch["input_ids"][i].tolist(),
            "attention_mask": batch["attention_mask"][i].tolist(),
            "labels": int(batch["classes"][i]),
        }
        for i in range(5)
    ]
    options = dict(per_sample_gradient_mode=mode, dp_max_physical_batch_size=2)
    without = dp_step(factory, data[:4], classes_of_outputs, tmp_path / "without", **options)
    with_one = dp_step(factory, [data[4], *data[:4]], classes_of_outputs, tmp_path / "with", **options)
    assert (with_one - without).norm().item() / CLIP <= 1 + 1e-4
    reference = loop_gradients(factory, classify(), {k: v for k, v in batch.items()})
    assert (reference.norm(dim=1) > 10 * CLIP).all()
    clipped = CLIP * reference / reference.norm(dim=1, keepdim=True)
    torch.testing.assert_close(without, clipped[:4].sum(0), rtol=0, atol=2e-5 * CLIP)
    torch.testing.assert_close(with_one, clipped.sum(0), rtol=0, atol=2e-5 * CLIP)
