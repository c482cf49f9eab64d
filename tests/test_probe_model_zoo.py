"""False-refusal audit of the once-per-run probes on real Hugging Face architectures.

The buffer probe (:mod:`dp_hf.trainer.buffers`) and the gradient-attribution probe
(:func:`dp_hf.trainer.probe.check_gradients_follow_the_examples`) refuse models that mix batch rows or
leak data through buffers. Ordinary architectures must not be refused: each row builds one tiny model
from its config (dropout, layer drop and stochastic depth at their default, non-zero values), trains it
for two DP steps in one per-sample gradient mode and optimizer, and checks that the probes ran and the
parameters moved. A row that a pre-existing check refuses (an unsupported module) asserts that refusal.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import datasets
import pytest
import torch
import transformers as tf

from dp_hf import DPTrainer
from dp_hf.losses import per_example_loss
from dp_hf.per_example.errors import UnsupportedModuleError
from tests.dp_training import dp_args, params_of

N, BATCH, SEQ, VOCAB, H = 16, 4, 8, 100, 32
TEXT = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37)
DECODER = dict(TEXT, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0)
VISION = dict(image_size=16, num_channels=3, num_labels=3)
VIT = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37)
ENCODER = dict(TEXT, max_position_embeddings=64, pad_token_id=0, num_labels=3)


@dataclass
class Row:
    name: str
    build: Any  # () -> model
    data: str  # "cls", "lm", "mlm", "s2s", "image", "audio"
    args: dict = field(default_factory=dict)
    refused: str | None = None  # a pre-existing refusal's message (regex)
    lora: list | None = None  # peft LoRA target modules
    seq: int = SEQ  # the text rows' length


def _m(model_cls, config_cls, freeze=(), **kw):
    """A factory of ``model_cls(config_cls(**kw))`` whose parameters named with any of ``freeze`` are frozen."""

    def build():
        model = model_cls(config_cls(**kw))
        for name, p in model.named_parameters():
            if any(part in name for part in freeze):
                p.requires_grad_(False)
        return model

    return build


def _whisper():
    config = tf.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=8,
        d_model=H,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        max_source_positions=8,
        max_target_positions=16,
        num_labels=3,
        pad_token_id=0,
        decoder_start_token_id=1,
    )
    return tf.WhisperForAudioClassification(config)


#: The speech models' shape (wav2vec2 and its relatives).
AUDIO = dict(
    vocab_size=VOCAB,
    hidden_size=H,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=37,
    conv_dim=(8, 8),
    conv_stride=(4, 2),
    conv_kernel=(8, 4),
    num_conv_pos_embeddings=4,
    num_conv_pos_embedding_groups=2,
    classifier_proj_size=16,
    num_labels=3,
)


def _wav2vec2(freeze=(), **overrides):
    config = tf.Wav2Vec2Config(**AUDIO, **overrides)
    model = tf.Wav2Vec2ForSequenceClassification(config)
    model.freeze_feature_encoder()
    for name, p in model.named_parameters():
        if any(part in name for part in freeze):
            p.requires_grad_(False)
    return model


#: Configurations that a row and its frozen variant below share.
T5 = dict(
    vocab_size=VOCAB,
    d_model=H,
    d_kv=16,
    d_ff=37,
    num_layers=2,
    num_heads=2,
    pad_token_id=0,
    decoder_start_token_id=0,
)
BART = dict(
    vocab_size=VOCAB,
    d_model=H,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=37,
    decoder_ffn_dim=37,
    max_position_embeddings=64,
)
OPT = dict(
    vocab_size=VOCAB,
    hidden_size=H,
    num_hidden_layers=2,
    num_attention_heads=2,
    ffn_dim=37,
    word_embed_proj_dim=H,
    max_position_embeddings=64,
    pad_token_id=1,
)
ROWS = [
    Row("bert", _m(tf.BertForSequenceClassification, tf.BertConfig, **ENCODER), "cls"),
    Row(
        "bert-materialize-macadam",
        _m(tf.BertForSequenceClassification, tf.BertConfig, **ENCODER),
        "cls",
        dict(per_sample_gradient_mode="materialize", dp_optimizer="dp-macadam"),
    ),
    Row("bert-mlm", _m(tf.BertForMaskedLM, tf.BertConfig, **ENCODER), "mlm"),
    Row(
        "roberta",
        _m(tf.RobertaForSequenceClassification, tf.RobertaConfig, **dict(ENCODER, pad_token_id=1)),
        "cls",
    ),
    Row(
        "xlm-roberta",
        _m(tf.XLMRobertaForSequenceClassification, tf.XLMRobertaConfig, **dict(ENCODER, pad_token_id=1)),
        "cls",
    ),
    Row(
        "distilbert",
        _m(
            tf.DistilBertForSequenceClassification,
            tf.DistilBertConfig,
            vocab_size=VOCAB,
            dim=H,
            n_layers=2,
            n_heads=2,
            hidden_dim=37,
            max_position_embeddings=64,
            pad_token_id=0,
            num_labels=3,
        ),
        "cls",
    ),
    Row(
        "albert",
        _m(tf.AlbertForSequenceClassification, tf.AlbertConfig, embedding_size=16, **ENCODER),
        "cls",
    ),
    Row(
        "electra",
        _m(tf.ElectraForSequenceClassification, tf.ElectraConfig, embedding_size=16, **ENCODER),
        "cls",
    ),
    Row("deberta-v2", _m(tf.DebertaV2ForSequenceClassification, tf.DebertaV2Config, **ENCODER), "cls"),
    Row(
        "mpnet", _m(tf.MPNetForSequenceClassification, tf.MPNetConfig, **dict(ENCODER, pad_token_id=1)), "cls"
    ),
    Row(
        "gpt2",
        _m(
            tf.GPT2LMHeadModel,
            tf.GPT2Config,
            vocab_size=VOCAB,
            n_embd=H,
            n_layer=2,
            n_head=2,
            n_inner=37,
            n_positions=64,
        ),
        "lm",
    ),
    Row(
        "gpt2-materialize-adamw",
        _m(
            tf.GPT2LMHeadModel, tf.GPT2Config, vocab_size=VOCAB, n_embd=H, n_layer=2, n_head=2, n_positions=64
        ),
        "lm",
        dict(per_sample_gradient_mode="materialize", dp_optimizer="dp-adamw"),
    ),
    Row(
        "gpt-neo",
        _m(
            tf.GPTNeoForCausalLM,
            tf.GPTNeoConfig,
            vocab_size=VOCAB,
            hidden_size=H,
            num_layers=2,
            num_heads=2,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
            max_position_embeddings=64,
        ),
        "lm",
    ),
    Row(
        "gpt-j",
        _m(
            tf.GPTJForCausalLM,
            tf.GPTJConfig,
            vocab_size=VOCAB,
            n_embd=H,
            n_layer=2,
            n_head=2,
            rotary_dim=8,
            n_positions=64,
        ),
        "lm",
    ),
    Row(
        "gpt-neox",
        _m(tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig, **dict(TEXT, max_position_embeddings=64)),
        "lm",
    ),
    Row(
        "opt",
        _m(tf.OPTForCausalLM, tf.OPTConfig, **OPT),
        "lm",
    ),
    Row("llama", _m(tf.LlamaForCausalLM, tf.LlamaConfig, **DECODER), "lm"),
    Row(
        "llama-materialize-macadam",
        _m(tf.LlamaForCausalLM, tf.LlamaConfig, **DECODER),
        "lm",
        dict(per_sample_gradient_mode="materialize", dp_optimizer="dp-macadam"),
    ),
    Row("llama-lora", _m(tf.LlamaForCausalLM, tf.LlamaConfig, **DECODER), "lm", lora=["q_proj", "v_proj"]),
    Row("mistral", _m(tf.MistralForCausalLM, tf.MistralConfig, **DECODER), "lm"),
    Row("qwen2", _m(tf.Qwen2ForCausalLM, tf.Qwen2Config, **DECODER), "lm"),
    Row("phi", _m(tf.PhiForCausalLM, tf.PhiConfig, **DECODER), "lm"),
    Row("phi3", _m(tf.Phi3ForCausalLM, tf.Phi3Config, **DECODER), "lm"),
    Row("gemma", _m(tf.GemmaForCausalLM, tf.GemmaConfig, head_dim=16, **DECODER), "lm"),
    Row("gemma2", _m(tf.Gemma2ForCausalLM, tf.Gemma2Config, head_dim=16, sliding_window=4, **DECODER), "lm"),
    Row(
        "mixtral",
        _m(tf.MixtralForCausalLM, tf.MixtralConfig, num_local_experts=4, num_experts_per_tok=2, **DECODER),
        "lm",
    ),
    Row(
        "qwen2-moe",
        _m(
            tf.Qwen2MoeForCausalLM,
            tf.Qwen2MoeConfig,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            **DECODER,
        ),
        "lm",
    ),
    Row(
        "t5",
        _m(tf.T5ForConditionalGeneration, tf.T5Config, **T5),
        "s2s",
    ),
    Row(
        "bart",
        _m(tf.BartForConditionalGeneration, tf.BartConfig, **BART),
        "s2s",
    ),
    Row(
        "bert-lora",
        _m(tf.BertForSequenceClassification, tf.BertConfig, **ENCODER),
        "cls",
        lora=["query", "value"],
    ),
    Row("vit", _m(tf.ViTForImageClassification, tf.ViTConfig, patch_size=4, **VISION, **VIT), "image"),
    Row("deit", _m(tf.DeiTForImageClassification, tf.DeiTConfig, patch_size=4, **VISION, **VIT), "image"),
    Row("beit", _m(tf.BeitForImageClassification, tf.BeitConfig, patch_size=4, **VISION, **VIT), "image"),
    Row(
        "swin",
        _m(
            tf.SwinForImageClassification,
            tf.SwinConfig,
            patch_size=2,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[1, 2],
            window_size=2,
            **VISION,
        ),
        "image",
    ),
    Row(
        "convnext",
        _m(
            tf.ConvNextForImageClassification,
            tf.ConvNextConfig,
            num_stages=2,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            **VISION,
        ),
        "image",
    ),
    Row("wav2vec2", _wav2vec2, "audio"),
    Row("whisper", _whisper, "audio-mel"),
]


# Relative attention biases trained per example (dp_hf.per_example.relative_bias): a bias in every layer
# (UMT5), and mT5's copy of T5's.
ROWS += [
    Row("umt5", _m(tf.UMT5ForConditionalGeneration, tf.UMT5Config, **T5), "s2s"),
    Row("mt5", _m(tf.MT5ForConditionalGeneration, tf.MT5Config, **T5), "s2s"),
]

# Learned position embeddings (dp_hf.per_example.positions) and OPT's flattened MLP rows
# (dp_hf.per_example.flat_rows) in the other fast mode.
ROWS += [
    Row(
        "opt-materialize-macadam",
        _m(tf.OPTForCausalLM, tf.OPTConfig, **OPT),
        "lm",
        dict(per_sample_gradient_mode="materialize", dp_optimizer="dp-macadam"),
    ),
    Row(
        "bart-materialize-adamw",
        _m(tf.BartForConditionalGeneration, tf.BartConfig, **BART),
        "s2s",
        dict(per_sample_gradient_mode="materialize", dp_optimizer="dp-adamw"),
    ),
]

# Workarounds of the pre-existing refusals (frozen modules), so that the new probes see these models too.
ROWS += [
    Row(
        "t5-frozen-bias",
        _m(tf.T5ForConditionalGeneration, tf.T5Config, freeze=("relative_attention_bias",), **T5),
        "s2s",
    ),
    Row(
        "bart-frozen-pos",
        _m(tf.BartForConditionalGeneration, tf.BartConfig, freeze=("embed_positions",), **BART),
        "s2s",
    ),
    Row("opt-frozen-pos", _m(tf.OPTForCausalLM, tf.OPTConfig, freeze=("embed_positions",), **OPT), "lm"),
    Row(
        "mpnet-frozen-bias",
        _m(
            tf.MPNetForSequenceClassification,
            tf.MPNetConfig,
            freeze=("relative_attention_bias",),
            **dict(ENCODER, pad_token_id=1),
        ),
        "cls",
    ),
    Row(
        "gemma-frozen-emb",
        _m(tf.GemmaForCausalLM, tf.GemmaConfig, freeze=("embed_tokens", "lm_head"), head_dim=16, **DECODER),
        "lm",
    ),
    Row(
        "gemma2-frozen-emb",
        _m(
            tf.Gemma2ForCausalLM,
            tf.Gemma2Config,
            freeze=("embed_tokens", "lm_head"),
            head_dim=16,
            sliding_window=4,
            **DECODER,
        ),
        "lm",
    ),
    Row(
        "mixtral-frozen-moe",
        _m(
            tf.MixtralForCausalLM,
            tf.MixtralConfig,
            freeze=(".mlp.",),
            num_local_experts=4,
            num_experts_per_tok=2,
            **dict(DECODER, intermediate_size=32),
        ),
        "lm",
    ),
    Row(
        "qwen2-moe-frozen-moe",
        _m(
            tf.Qwen2MoeForCausalLM,
            tf.Qwen2MoeConfig,
            freeze=(".mlp.",),
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            **DECODER,
        ),
        "lm",
    ),
    Row(
        "beit-no-layer-scale",
        _m(
            tf.BeitForImageClassification,
            tf.BeitConfig,
            layer_scale_init_value=0.0,
            patch_size=4,
            **VISION,
            **VIT,
        ),
        "image",
    ),
    Row(  # layer scale (dp_hf.per_example.ghost.layer_scale) and absolute positions (the patch-embedding rule)
        "beit-absolute-positions",
        _m(
            tf.BeitForImageClassification,
            tf.BeitConfig,
            use_absolute_position_embeddings=True,
            patch_size=4,
            **VISION,
            **VIT,
        ),
        "image",
    ),
    Row(
        "beit-materialize-macadam",
        _m(tf.BeitForImageClassification, tf.BeitConfig, patch_size=4, **VISION, **VIT),
        "image",
        dict(per_sample_gradient_mode="materialize", dp_optimizer="dp-macadam"),
    ),
    Row(
        "swin-materialize-macadam",
        _m(
            tf.SwinForImageClassification,
            tf.SwinConfig,
            patch_size=2,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[1, 2],
            window_size=2,
            **VISION,
        ),
        "image",
        dict(per_sample_gradient_mode="materialize", dp_optimizer="dp-macadam"),
    ),
    Row(
        "swin-frozen-bias",
        _m(
            tf.SwinForImageClassification,
            tf.SwinConfig,
            freeze=("relative_position_bias",),
            patch_size=2,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[1, 2],
            window_size=2,
            **VISION,
        ),
        "image",
    ),
    Row(
        "wav2vec2-frozen-mask-emb", lambda: _wav2vec2(freeze=("masked_spec_embed", "pos_conv_embed")), "audio"
    ),
    Row("wav2vec2-padded", lambda: _wav2vec2(freeze=("masked_spec_embed", "pos_conv_embed")), "audio-padded"),
    Row(
        "wav2vec2-no-specaugment", lambda: _wav2vec2(freeze=("pos_conv_embed",), mask_time_prob=0.0), "audio"
    ),
]
ROWS += [
    Row(
        "convnext-drop-path",
        _m(
            tf.ConvNextForImageClassification,
            tf.ConvNextConfig,
            num_stages=2,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            drop_path_rate=0.2,
            **VISION,
        ),
        "image",
    ),
    Row(
        "llama-dynamic-rope",
        _m(
            tf.LlamaForCausalLM,
            tf.LlamaConfig,
            rope_scaling={"rope_type": "dynamic", "factor": 2.0},
            **dict(DECODER, max_position_embeddings=4),
        ),
        "lm",
    ),
    Row(
        "mistral-materialize-adamw",
        _m(tf.MistralForCausalLM, tf.MistralConfig, **DECODER),
        "lm",
        dict(per_sample_gradient_mode="materialize"),
    ),
    Row(
        "vit-materialize-macadam",
        _m(tf.ViTForImageClassification, tf.ViTConfig, patch_size=4, **VISION, **VIT),
        "image",
        dict(per_sample_gradient_mode="materialize", dp_optimizer="dp-macadam"),
    ),
]


# More architectures: NumPy-drawn SpecAugment and random block-sparse attention, drop path with layer
# scale, other decoders.


def _speech(model_cls, config_cls, **kw):
    """A wav2vec2-like classifier, its feature encoder, positional convolution and mask embedding frozen."""

    def build():
        model = model_cls(config_cls(**dict(AUDIO, **kw)))
        model.freeze_feature_encoder()
        for name, p in model.named_parameters():
            if "masked_spec_embed" in name or "pos_conv_embed" in name:
                p.requires_grad_(False)
        return model

    return build


ROWS += [
    Row("hubert-padded", _speech(tf.HubertForSequenceClassification, tf.HubertConfig), "audio-padded"),
    Row(
        "data2vec-audio-padded",
        _speech(tf.Data2VecAudioForSequenceClassification, tf.Data2VecAudioConfig),
        "audio-padded",
    ),
    Row(
        "wavlm",
        _speech(tf.WavLMForSequenceClassification, tf.WavLMConfig, num_buckets=8, max_bucket_distance=16),
        "audio-padded",
    ),
    Row(
        "bigbird-block-sparse",
        _m(
            tf.BigBirdForSequenceClassification,
            tf.BigBirdConfig,
            attention_type="block_sparse",
            block_size=2,
            num_random_blocks=2,
            **ENCODER,
        ),
        "cls",
        seq=32,
    ),
    Row("deberta", _m(tf.DebertaForSequenceClassification, tf.DebertaConfig, **ENCODER), "cls"),
    Row(
        "falcon",
        _m(
            tf.FalconForCausalLM,
            tf.FalconConfig,
            vocab_size=VOCAB,
            hidden_size=H,
            num_hidden_layers=2,
            num_attention_heads=2,
        ),
        "lm",
    ),
    Row("qwen3", _m(tf.Qwen3ForCausalLM, tf.Qwen3Config, head_dim=16, **DECODER), "lm"),
    Row(
        "pegasus",
        _m(
            tf.PegasusForConditionalGeneration,
            tf.PegasusConfig,
            vocab_size=VOCAB,
            d_model=H,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=37,
            decoder_ffn_dim=37,
            max_position_embeddings=64,
            decoder_start_token_id=0,
        ),
        "s2s",
    ),
    Row(
        "dinov2-drop-path",
        _m(
            tf.Dinov2ForImageClassification,
            tf.Dinov2Config,
            patch_size=4,
            drop_path_rate=0.2,
            **VISION,
            **VIT,
        ),
        "image",
    ),
    Row(
        "segformer-drop-path",
        _m(
            tf.SegformerForImageClassification,
            tf.SegformerConfig,
            num_encoder_blocks=2,
            depths=[1, 1],
            sr_ratios=[2, 1],
            hidden_sizes=[8, 16],
            patch_sizes=[3, 3],
            strides=[2, 2],
            num_attention_heads=[1, 2],
            mlp_ratios=[2, 2],
            drop_path_rate=0.2,
            num_channels=3,
            num_labels=3,
        ),
        "image",
    ),
]


# Vision models that were refused or crashed: PoolFormer's layers (layer scale, a 1-tuple output) crashed in
# Opacus's vmap fallback mid-training; Data2VecVision's embeddings (returning (x, patch grid)) and CLIP's (a class
# embedding beside a position_ids buffer) were refused. And wav2vec2's weighted layer sum with its layer_weights
# frozen, the fix its refusal names (layer drop off: transformers' weighted sum fails on a dropped layer).
ROWS += [
    Row(
        "poolformer",
        _m(
            tf.PoolFormerForImageClassification,
            tf.PoolFormerConfig,
            num_encoder_blocks=2,
            depths=[1, 1],
            hidden_sizes=[8, 16],
            patch_sizes=[3, 3],
            strides=[2, 2],
            padding=[1, 1],
            **VISION,
        ),
        "image",
    ),
    Row(
        "data2vec-vision",
        _m(tf.Data2VecVisionForImageClassification, tf.Data2VecVisionConfig, patch_size=4, **VISION, **VIT),
        "image",
    ),
    Row(
        "clip-vision",
        _m(
            tf.CLIPForImageClassification,
            tf.CLIPConfig,
            vision_config=dict(image_size=16, patch_size=4, **VIT),
            text_config=dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, **VIT),
            num_labels=3,
        ),
        "image",
    ),
    Row(
        "wav2vec2-weighted-layer-sum-frozen",
        lambda: _wav2vec2(
            freeze=("masked_spec_embed", "pos_conv_embed", "layer_weights"),
            use_weighted_layer_sum=True,
            layerdrop=0.0,
        ),
        "audio",
    ),
]


def _data(kind: str, model, seq: int = SEQ) -> datasets.Dataset:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (N, seq), generator=g)
    labels3 = torch.randint(0, 3, (N,), generator=g)
    if kind == "cls":
        cols = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels3)
    elif kind == "lm":
        cols = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    elif kind == "mlm":
        mask = torch.rand(N, seq, generator=g) < 0.3
        mask[:, 1] = True
        cols = dict(input_ids=ids.masked_fill(mask, 4), labels=ids.masked_fill(~mask, -100))
    elif kind == "s2s":
        target = ids.flip(1)[:, :6]
        start = torch.full((N, 1), model.config.decoder_start_token_id)
        decoder = torch.cat([start, target[:, :-1]], dim=1)
        cols = dict(
            input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=decoder, labels=target
        )
    elif kind == "image":
        cols = dict(pixel_values=torch.randn(N, 3, 16, 16, generator=g), labels=labels3)
    elif kind == "audio":
        cols = dict(input_values=torch.randn(N, 400, generator=g), labels=labels3)
    elif kind == "audio-padded":  # right-padded clips of different lengths, with their attention mask
        lengths = torch.randint(120, 401, (N,), generator=g)
        mask = (torch.arange(400)[None, :] < lengths[:, None]).long()
        values = torch.randn(N, 400, generator=g) * mask
        cols = dict(input_values=values, attention_mask=mask, labels=labels3)
    elif kind == "audio-mel":
        cols = dict(input_features=torch.randn(N, 8, 16, generator=g), labels=labels3)
    else:
        raise ValueError(kind)
    return datasets.Dataset.from_dict({k: v.tolist() for k, v in cols.items()})


def _token_losses(outputs, labels, inputs):
    return per_example_loss(outputs["logits"], labels, "token")


def run_row(row: Row, tmp_path):
    torch.manual_seed(0)
    model = row.build()
    if row.lora:
        from peft import LoraConfig, get_peft_model

        task = "CAUSAL_LM" if row.data == "lm" else "SEQ_CLS"
        model = get_peft_model(
            model, LoraConfig(r=4, lora_dropout=0.1, target_modules=row.lora, task_type=task)
        )
    model.train()
    before = params_of(model)
    args = dp_args(
        tmp_path,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
        max_steps=2,
        num_train_epochs=1,
        **row.args,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPTrainer(
            model=model,
            args=args,
            train_dataset=_data(row.data, model, row.seq),
            per_example_loss_fn=_token_losses if row.data == "s2s" else None,
        )
        trainer.train()
    return trainer, model, before


#: Rows that pre-existing checks refuse (not the buffer or attribution probe): the refusal expected.
PRE_EXISTING_REFUSALS = {
    "mixtral": r"MixtralTopKRouter\) received an input with leading dimension",
    "qwen2-moe": r"shared_expert.gate_proj \(Linear\) received an input with leading dimension",
    "wav2vec2": r"\(masked_spec_embed\) have no Opacus grad sampler.*cannot reproduce the dropout masks",
    "convnext-drop-path": r"draws random numbers in its forward",
    "llama-dynamic-rope": r"rope_type 'dynamic'",
    "wavlm": r"the model edits a layer's output in place",
    "deberta": r"DisentangledSelfAttention\): its own trainable tensors \(q_bias, v_bias\) have no Opacus grad sampler",
}
for _row in ROWS:
    _row.refused = PRE_EXISTING_REFUSALS.get(_row.name)
assert set(PRE_EXISTING_REFUSALS) <= {r.name for r in ROWS}


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_architecture_trains_past_the_probes(row, tmp_path):
    if row.refused:
        with pytest.raises(Exception, match=row.refused):
            run_row(row, tmp_path)
        return
    trainer, model, before = run_row(row, tmp_path)
    assert trainer.state.global_step == 2
    assert trainer._losses_checked and trainer._gradients_checked
    after = params_of(model)
    assert any(not torch.equal(before[n], after[n]) for n in before if model.get_parameter(n).requires_grad)


def test_a_weighted_layer_sum_is_refused_naming_its_weights_and_the_fix(tmp_path):
    """wav2vec2's ``use_weighted_layer_sum`` head owns ``layer_weights`` on the model's root, which has no rule;
    the refusal (when the trainer is built, before any step) said only that dropout masks could not be
    replayed, naming neither the tensor nor the fix."""
    row = Row(
        "wav2vec2-weighted-layer-sum",
        lambda: _wav2vec2(
            freeze=("masked_spec_embed", "pos_conv_embed"), use_weighted_layer_sum=True, layerdrop=0.0
        ),
        "audio",
    )
    model = row.build().train()
    args = dp_args(tmp_path, per_device_train_batch_size=BATCH, max_steps=2, num_train_epochs=1)
    with warnings.catch_warnings(), pytest.raises(UnsupportedModuleError) as refused:
        warnings.simplefilter("ignore")
        DPTrainer(model=model, args=args, train_dataset=_data(row.data, model))
    message = str(refused.value)
    assert "<root> (Wav2Vec2ForSequenceClassification): its own trainable tensors (layer_weights)" in message
    assert "requires_grad_(False)" in message and "config.use_weighted_layer_sum=False" in message
