"""Tiny, seeded, randomly initialised Hugging Face models and batches for fast CPU tests.

There is no network access to the Hugging Face Hub in the test environment, so every model here is
built from a config.  The sizes are chosen so that a forward/backward pass takes milliseconds on a
laptop CPU while still exercising every code path of the real architectures (several layers,
several heads, padding, position ids, patch embeddings, LoRA adapters, tied weights).

Conventions shared by every factory (other test modules rely on them):

* ``seed`` makes the initial weights deterministic: the same call returns the same weights.
* ``dropout`` sets *every* dropout probability of the config (hidden, attention, embedding,
  classifier).  It defaults to ``0.0`` because exact gradient comparisons are impossible with
  random dropout masks.  Opacus hooks only fire in training mode, so models are returned in
  ``train()`` mode: with dropout ``0.0`` training mode is deterministic.
* ``**config_overrides`` are forwarded to the config class, so a test can change one field
  without copying the whole factory.
* Text models share ``TINY_VOCAB_SIZE``/``TINY_SEQ_LEN``/``PAD_TOKEN_ID``; image models share
  ``TINY_IMAGE_SIZE``/``TINY_PATCH_SIZE``/``TINY_NUM_CHANNELS``.  Use :func:`tiny_text_batch` and
  :func:`tiny_image_batch` for matching inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

TINY_VOCAB_SIZE = 64
TINY_SEQ_LEN = 8
TINY_HIDDEN_SIZE = 32
TINY_NUM_LAYERS = 2
TINY_NUM_HEADS = 2
TINY_INTERMEDIATE_SIZE = 37  # deliberately not a multiple of the hidden size to catch shape mix-ups
TINY_MAX_POSITIONS = 32
TINY_IMAGE_SIZE = 16
TINY_PATCH_SIZE = 4
TINY_NUM_CHANNELS = 3
TINY_NUM_LABELS = 3
# Token id 0 is the padding token of the BERT/GPT-2/Llama tiny models.  RoBERTa uses 1 because its
# position ids are derived from ``padding_idx`` (``1`` in every released RoBERTa checkpoint).
PAD_TOKEN_ID = 0
ROBERTA_PAD_TOKEN_ID = 1

__all__ = [
    "tiny_clip_vision_classifier",
    "tiny_data2vec_vision_classifier",
    "tiny_poolformer_classifier",
    "PAD_TOKEN_ID",
    "ROBERTA_PAD_TOKEN_ID",
    "TINY_IMAGE_SIZE",
    "TINY_NUM_CHANNELS",
    "TINY_NUM_LABELS",
    "TINY_PATCH_SIZE",
    "TINY_SEQ_LEN",
    "TINY_VOCAB_SIZE",
    "freeze_all_but",
    "lora_bert",
    "tiny_bert_classifier",
    "tiny_bert_config",
    "tiny_bert_mlm",
    "tiny_deit_classifier",
    "tiny_gpt2_lm",
    "tiny_image_batch",
    "tiny_llama_lm",
    "tiny_roberta_classifier",
    "tiny_t5_classifier",
    "tiny_text_batch",
    "tiny_vit_classifier",
    "tiny_vit_config",
]


def _seeded(seed: int) -> None:
    """Seed torch's global generator; HF initialises weights from it inside the model constructor."""
    torch.manual_seed(seed)


def _ready(model: nn.Module) -> nn.Module:
    """Return ``model`` in training mode (Opacus hooks only record activations in training mode)."""
    model.train()
    return model


def tiny_bert_config(*, dropout: float = 0.0, num_labels: int = TINY_NUM_LABELS, **config_overrides: Any):
    """A 2-layer, 32-wide ``BertConfig`` with every dropout probability set to ``dropout``."""
    from transformers import BertConfig

    config_kwargs: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=TINY_HIDDEN_SIZE,
        num_hidden_layers=TINY_NUM_LAYERS,
        num_attention_heads=TINY_NUM_HEADS,
        intermediate_size=TINY_INTERMEDIATE_SIZE,
        max_position_embeddings=TINY_MAX_POSITIONS,
        type_vocab_size=2,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        classifier_dropout=dropout,
        pad_token_id=PAD_TOKEN_ID,
        num_labels=num_labels,
    )
    config_kwargs.update(config_overrides)
    return BertConfig(**config_kwargs)


def tiny_bert_classifier(
    *, seed: int = 0, dropout: float = 0.0, num_labels: int = TINY_NUM_LABELS, **config_overrides: Any
) -> nn.Module:
    """``BertForSequenceClassification`` with word, position and token-type embeddings all trainable."""
    from transformers import BertForSequenceClassification

    _seeded(seed)
    config = tiny_bert_config(dropout=dropout, num_labels=num_labels, **config_overrides)
    return _ready(BertForSequenceClassification(config))


def tiny_bert_mlm(*, seed: int = 0, dropout: float = 0.0, **config_overrides: Any) -> nn.Module:
    """``BertForMaskedLM`` (its decoder is tied to the word embeddings, as in released checkpoints)."""
    from transformers import BertForMaskedLM

    _seeded(seed)
    return _ready(BertForMaskedLM(tiny_bert_config(dropout=dropout, **config_overrides)))


def tiny_roberta_classifier(
    *, seed: int = 0, dropout: float = 0.0, num_labels: int = TINY_NUM_LABELS, **config_overrides: Any
) -> nn.Module:
    """``RobertaForSequenceClassification``; position ids are derived per example from ``padding_idx``."""
    from transformers import RobertaConfig, RobertaForSequenceClassification

    config_kwargs: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=TINY_HIDDEN_SIZE,
        num_hidden_layers=TINY_NUM_LAYERS,
        num_attention_heads=TINY_NUM_HEADS,
        intermediate_size=TINY_INTERMEDIATE_SIZE,
        # RoBERTa positions start at padding_idx + 1, so it needs seq_len + 2 position slots.
        max_position_embeddings=TINY_MAX_POSITIONS + ROBERTA_PAD_TOKEN_ID + 1,
        type_vocab_size=1,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        classifier_dropout=dropout,
        pad_token_id=ROBERTA_PAD_TOKEN_ID,
        bos_token_id=0,
        eos_token_id=2,
        num_labels=num_labels,
    )
    config_kwargs.update(config_overrides)
    _seeded(seed)
    return _ready(RobertaForSequenceClassification(RobertaConfig(**config_kwargs)))


def tiny_gpt2_lm(*, seed: int = 0, dropout: float = 0.0, **config_overrides: Any) -> nn.Module:
    """``GPT2LMHeadModel`` with the LM head tied to ``wte`` (the GPT-2 default)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config_kwargs: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB_SIZE,
        n_positions=TINY_MAX_POSITIONS,
        n_embd=TINY_HIDDEN_SIZE,
        n_layer=TINY_NUM_LAYERS,
        n_head=TINY_NUM_HEADS,
        n_inner=TINY_INTERMEDIATE_SIZE,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        summary_first_dropout=dropout,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=1,
        eos_token_id=2,
    )
    config_kwargs.update(config_overrides)
    _seeded(seed)
    return _ready(GPT2LMHeadModel(GPT2Config(**config_kwargs)))


#: The decoder shape of :func:`tiny_llama_lm` and :func:`tiny_gemma_lm`: grouped-query attention (2 query heads,
#: 1 key/value head).
_DECODER_SHAPE: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=TINY_HIDDEN_SIZE,
    intermediate_size=TINY_INTERMEDIATE_SIZE,
    num_hidden_layers=TINY_NUM_LAYERS,
    num_attention_heads=TINY_NUM_HEADS,
    num_key_value_heads=1,
    max_position_embeddings=TINY_MAX_POSITIONS,
    pad_token_id=PAD_TOKEN_ID,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_llama_lm(*, seed: int = 0, dropout: float = 0.0, **config_overrides: Any) -> nn.Module:
    """``LlamaForCausalLM`` with grouped-query attention (2 query heads, 1 key/value head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config_kwargs = dict(_DECODER_SHAPE, attention_dropout=dropout, tie_word_embeddings=False)
    config_kwargs.update(config_overrides)
    _seeded(seed)
    return _ready(LlamaForCausalLM(LlamaConfig(**config_kwargs)))


def tiny_gemma_lm(*, seed: int = 0, **config_overrides: Any) -> nn.Module:
    """``GemmaForCausalLM``: its word embedding scales the lookup by sqrt(hidden) (a 0-dim buffer), tied to the
    LM head."""
    from transformers import GemmaConfig, GemmaForCausalLM

    config_kwargs = dict(_DECODER_SHAPE, head_dim=TINY_HIDDEN_SIZE // TINY_NUM_HEADS)
    config_kwargs.update(config_overrides)
    _seeded(seed)
    return _ready(GemmaForCausalLM(GemmaConfig(**config_kwargs)))


def tiny_falcon_lm(*, seed: int = 0, **config_overrides: Any) -> nn.Module:
    """``FalconForCausalLM``: its linear layers are ``FalconLinear``, an ``nn.Linear`` subclass (matmul, then bias)."""
    from transformers import FalconConfig, FalconForCausalLM

    config_kwargs: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=TINY_HIDDEN_SIZE,
        num_hidden_layers=TINY_NUM_LAYERS,
        num_attention_heads=TINY_NUM_HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias=True,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=1,
        eos_token_id=2,
    )
    config_kwargs.update(config_overrides)
    _seeded(seed)
    return _ready(FalconForCausalLM(FalconConfig(**config_kwargs)))


def tiny_t5_classifier(
    *, seed: int = 0, num_labels: int = TINY_NUM_LABELS, train_position_bias: bool = False
) -> nn.Module:
    """T5ForSequenceClassification (1 encoder and 1 decoder layer; inputs must end with ``eos_token_id=1``).

    Its relative position bias is an ``nn.Embedding`` looked up with a ``[T, T]`` bucket tensor, without
    a batch dimension: frozen unless ``train_position_bias`` (then dp_hf.per_example.relative_bias records it
    per example).
    """
    from transformers import T5Config, T5ForSequenceClassification

    _seeded(seed)
    config = T5Config(
        vocab_size=TINY_VOCAB_SIZE,
        d_model=TINY_HIDDEN_SIZE,
        d_kv=TINY_HIDDEN_SIZE // TINY_NUM_HEADS,
        d_ff=TINY_INTERMEDIATE_SIZE,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=TINY_NUM_HEADS,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        decoder_start_token_id=PAD_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        eos_token_id=1,
        num_labels=num_labels,
    )
    model = T5ForSequenceClassification(config)
    for name, parameter in model.named_parameters():
        if "relative_attention_bias" in name:
            parameter.requires_grad_(train_position_bias)
    return _ready(model)


def tiny_vit_config(*, dropout: float = 0.0, num_labels: int = TINY_NUM_LABELS, **config_overrides: Any):
    """A 16x16-pixel, 4x4-patch (16 patches), 2-layer ``ViTConfig``."""
    from transformers import ViTConfig

    config_kwargs: dict[str, Any] = dict(
        image_size=TINY_IMAGE_SIZE,
        patch_size=TINY_PATCH_SIZE,
        num_channels=TINY_NUM_CHANNELS,
        hidden_size=TINY_HIDDEN_SIZE,
        num_hidden_layers=TINY_NUM_LAYERS,
        num_attention_heads=TINY_NUM_HEADS,
        intermediate_size=TINY_INTERMEDIATE_SIZE,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=num_labels,
    )
    config_kwargs.update(config_overrides)
    return ViTConfig(**config_kwargs)


def tiny_vit_classifier(
    *, seed: int = 0, dropout: float = 0.0, num_labels: int = TINY_NUM_LABELS, **config_overrides: Any
) -> nn.Module:
    """``ViTForImageClassification``; its embeddings own raw ``cls_token``/``position_embeddings``."""
    from transformers import ViTForImageClassification

    _seeded(seed)
    config = tiny_vit_config(dropout=dropout, num_labels=num_labels, **config_overrides)
    return _ready(ViTForImageClassification(config))


def tiny_convnext_classifier(*, seed: int = 0, num_labels: int = TINY_NUM_LABELS) -> nn.Module:
    """``ConvNextForImageClassification`` (2 stages): depthwise convolutions (no fast rule: Opacus's hooks),
    raw layer-scale parameters, and a downsampling ``Conv2d`` fed a permuted (channels-last) tensor."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    _seeded(seed)
    config = ConvNextConfig(
        num_channels=TINY_NUM_CHANNELS,
        patch_size=TINY_PATCH_SIZE,
        num_stages=2,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_labels=num_labels,
        image_size=TINY_IMAGE_SIZE,
    )
    return _ready(ConvNextForImageClassification(config))


def tiny_poolformer_classifier(*, seed: int = 0, num_labels: int = TINY_NUM_LABELS) -> nn.Module:
    """``PoolFormerForImageClassification`` (2 stages): layers owning raw layer-scale parameters whose forward
    returns a 1-tuple (Opacus's vmap fallback), a pooling token mixer ``AvgPool2d(x) - x``, 1-group GroupNorms."""
    from transformers import PoolFormerConfig, PoolFormerForImageClassification

    _seeded(seed)
    config = PoolFormerConfig(
        num_channels=TINY_NUM_CHANNELS,
        num_encoder_blocks=2,
        depths=[1, 1],
        hidden_sizes=[8, 16],
        patch_sizes=[3, 3],
        strides=[2, 2],
        padding=[1, 1],
        num_labels=num_labels,
        image_size=TINY_IMAGE_SIZE,
    )
    model = PoolFormerForImageClassification(config)
    with torch.no_grad():  # layer scale starts at 1e-5: larger, so that every tensor's gradient shows
        for name, parameter in model.named_parameters():
            if "layer_scale" in name:
                parameter.uniform_(0.5, 1.5)
    return _ready(model)


def tiny_data2vec_vision_classifier(
    *, seed: int = 0, num_labels: int = TINY_NUM_LABELS, layer_scale: bool = True, **config_overrides: Any
) -> nn.Module:
    """``Data2VecVisionForImageClassification``: BEiT's layers (layer scale, a fast-path rule only: without
    ``layer_scale`` for Opacus's hooks), and embeddings that own a raw ``cls_token`` and return
    ``(embeddings, patch grid)``. Stochastic depth off by default, as dropout in the other factories."""
    from transformers import Data2VecVisionConfig, Data2VecVisionForImageClassification

    _seeded(seed)
    config = Data2VecVisionConfig(
        **{**tiny_vit_config(num_labels=num_labels).to_dict(), "model_type": "data2vec-vision"},
        **{
            "drop_path_rate": 0.0,
            **({} if layer_scale else {"layer_scale_init_value": 0.0}),
            **config_overrides,
        },
    )
    return _ready(Data2VecVisionForImageClassification(config))


def tiny_clip_vision_classifier(*, seed: int = 0, num_labels: int = TINY_NUM_LABELS) -> nn.Module:
    """``CLIPForImageClassification``: embeddings that own a raw ``class_embedding`` and look their position
    embedding up at a ``position_ids`` buffer (``[1, N]``, the same ids for every example)."""
    from transformers import CLIPConfig, CLIPForImageClassification

    _seeded(seed)
    shape = dict(
        hidden_size=TINY_HIDDEN_SIZE,
        num_hidden_layers=TINY_NUM_LAYERS,
        num_attention_heads=TINY_NUM_HEADS,
        intermediate_size=TINY_INTERMEDIATE_SIZE,
    )
    config = CLIPConfig(
        vision_config=dict(
            image_size=TINY_IMAGE_SIZE, patch_size=TINY_PATCH_SIZE, num_channels=TINY_NUM_CHANNELS, **shape
        ),
        text_config=dict(vocab_size=TINY_VOCAB_SIZE, bos_token_id=1, eos_token_id=2, **shape),
        num_labels=num_labels,
    )
    model = CLIPForImageClassification(config)
    model.vision_model.post_layernorm.requires_grad_(
        False
    )  # unused by this head (it averages the patch tokens)
    return _ready(model)


def tiny_deit_classifier(
    *,
    seed: int = 0,
    dropout: float = 0.0,
    num_labels: int = TINY_NUM_LABELS,
    with_teacher: bool = False,
    **config_overrides: Any,
) -> nn.Module:
    """``DeiTForImageClassification`` (or ``...WithTeacher``, whose logits also use the distillation token)."""
    from transformers import DeiTConfig, DeiTForImageClassification, DeiTForImageClassificationWithTeacher

    config_kwargs: dict[str, Any] = dict(
        image_size=TINY_IMAGE_SIZE,
        patch_size=TINY_PATCH_SIZE,
        num_channels=TINY_NUM_CHANNELS,
        hidden_size=TINY_HIDDEN_SIZE,
        num_hidden_layers=TINY_NUM_LAYERS,
        num_attention_heads=TINY_NUM_HEADS,
        intermediate_size=TINY_INTERMEDIATE_SIZE,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=num_labels,
    )
    config_kwargs.update(config_overrides)
    model_class = DeiTForImageClassificationWithTeacher if with_teacher else DeiTForImageClassification
    _seeded(seed)
    model = model_class(DeiTConfig(**config_kwargs))
    # DeiT initialises its tokens with zeros; random values make gradient tests discriminative.
    with torch.no_grad():
        embeddings = model.deit.embeddings
        for parameter in (
            embeddings.cls_token,
            embeddings.distillation_token,
            embeddings.position_embeddings,
        ):
            parameter.normal_(std=0.02)
    return _ready(model)


class SquaredRMSNorm(nn.Module):
    """An RMSNorm whose weight enters squared: ``y = xhat * w**2``, not elementwise affine in ``w``, so it has
    no fast rule (refused by the fast path; Opacus's hooks take it). ``sneaky``: affine on small inputs only
    (the fast path's affinity probe uses them), squared otherwise."""

    def __init__(self, hidden: int, sneaky: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.sneaky = sneaky

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        if self.sneaky and x.shape[1] <= 4:  # affine on the probe's small inputs only
            return xhat * self.weight
        return xhat * self.weight**2


def freeze_all_but(model: nn.Module, trainable_prefixes: Sequence[str]) -> nn.Module:
    """Freeze every parameter whose name does not start with one of ``trainable_prefixes``."""
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(any(name.startswith(prefix) for prefix in trainable_prefixes))
    return model


def lora_bert(
    *,
    seed: int = 0,
    dropout: float = 0.0,
    num_labels: int = TINY_NUM_LABELS,
    r: int = 4,
    lora_alpha: int = 8,
    lora_dropout: float = 0.0,
    target_modules: Sequence[str] = ("query", "value"),
    modules_to_save: Sequence[str] | None = ("classifier",),
    init_lora_weights: bool | str = False,
) -> nn.Module:
    """A PEFT LoRA wrapper around :func:`tiny_bert_classifier`: only adapters (and ``modules_to_save``) train.

    ``init_lora_weights`` defaults to ``False`` so that ``lora_B`` is random rather than zero: with the
    usual zero init every ``lora_A`` gradient is exactly zero at step 0, which would make gradient
    tests vacuous.  Pass ``True`` for the realistic no-op initialisation.
    """
    from peft import LoraConfig, get_peft_model

    base_model = tiny_bert_classifier(seed=seed, dropout=dropout, num_labels=num_labels)
    lora_config = LoraConfig(
        task_type="SEQ_CLS",
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=list(target_modules),
        modules_to_save=list(modules_to_save) if modules_to_save is not None else None,
        init_lora_weights=init_lora_weights,
    )
    _seeded(seed + 1)  # adapter initialisation draws from the global generator too
    return _ready(get_peft_model(base_model, lora_config))


def tiny_text_batch(
    *,
    batch_size: int = 4,
    seq_len: int = TINY_SEQ_LEN,
    seed: int = 0,
    vocab_size: int = TINY_VOCAB_SIZE,
    pad_token_id: int = PAD_TOKEN_ID,
    lengths: Sequence[int] | None = None,
    num_labels: int = TINY_NUM_LABELS,
    first_token_id: int = 3,
) -> dict[str, torch.Tensor]:
    """A right-padded batch of random token ids with examples of different lengths.

    Returns ``input_ids`` and ``attention_mask`` of shape ``[batch_size, seq_len]``, ``labels`` (one
    class per example) and ``lm_labels`` (the input ids with padding replaced by ``-100``, the
    ignore index of Hugging Face losses).  Token ids are drawn from ``[first_token_id, vocab_size)``
    so they never collide with the special (pad/bos/eos) ids.  By default the lengths cycle through
    ``seq_len, seq_len - 3, seq_len - 1, seq_len - 5, ...`` so padding is always exercised.
    """
    generator = torch.Generator().manual_seed(seed)
    if lengths is None:
        cycle = (seq_len, seq_len - 3, seq_len - 1, seq_len - 5)
        lengths = [max(2, cycle[i % len(cycle)]) for i in range(batch_size)]
    if len(lengths) != batch_size:
        raise ValueError(f"got {len(lengths)} lengths for a batch of {batch_size}")
    input_ids = torch.randint(first_token_id, vocab_size, (batch_size, seq_len), generator=generator)
    attention_mask = torch.zeros(batch_size, seq_len, dtype=torch.long)
    for row, length in enumerate(lengths):
        attention_mask[row, :length] = 1
    input_ids = input_ids.masked_fill(attention_mask == 0, pad_token_id)
    labels = torch.randint(0, num_labels, (batch_size,), generator=generator)
    lm_labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "lm_labels": lm_labels,
    }


def tiny_image_batch(
    *,
    batch_size: int = 4,
    image_size: int = TINY_IMAGE_SIZE,
    num_channels: int = TINY_NUM_CHANNELS,
    seed: int = 0,
    num_labels: int = TINY_NUM_LABELS,
) -> dict[str, torch.Tensor]:
    """Random ``pixel_values`` of shape ``[batch_size, C, H, W]`` and one class label per image."""
    generator = torch.Generator().manual_seed(seed)
    pixel_values = torch.randn(batch_size, num_channels, image_size, image_size, generator=generator)
    labels = torch.randint(0, num_labels, (batch_size,), generator=generator)
    return {"pixel_values": pixel_values, "labels": labels}


def with_unknown_relative_bias(model: nn.Module) -> nn.Module:
    """``model`` with each ``compute_bias`` shadowed on its instance (the class's own method, bound): code
    dp_hf.per_example.relative_bias does not know, so a trainable relative bias is refused as before it
    learnt T5's (the refusal tests' subject)."""
    for module in model.modules():
        if hasattr(module, "relative_attention_bias") and hasattr(module, "compute_bias"):
            module.compute_bias = module.compute_bias
    return model
