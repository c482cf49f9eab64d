"""A model that sees the padding its collator adds for a batch's longest example is refused (dp_hf.trainer.padding).

A black-box audit (one DP-SGD step at sigma 0, q 1, eight 160-sample clips plus one of 3,200, dynamic right
padding with an attention_mask) moved the clipped sum by 1.035 C (HuBERT), 1.010 C (wav2vec2-base style),
1.018 C (Data2VecAudio) and 1.0001 C (SEW) for one example: their feature encoders normalize over the padded
length, so the longest example changed every other example's gradient. Models that ignore their padding, and
padding to one fixed length, train as before.
"""

from __future__ import annotations

import datasets
import pytest
import torch
import transformers as tf
from dp_training import QUICK_RUN_ARGS, bert_classifier, classification_data

from dp_hf import DPTrainer, DPTrainingArguments
from dp_hf.batches import check_collator_is_per_example
from dp_hf.trainer.padding import check_padding_is_invisible

AUDIO = dict(
    vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
    conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=4,
    num_conv_pos_embedding_groups=2, classifier_proj_size=16, num_labels=3, hidden_dropout=0.0,
    attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
    mask_time_prob=0.0,
)  # fmt: skip
STABLE = dict(feat_extract_norm="layer", do_stable_layer_norm=True)
SPEECH = {
    "hubert": (tf.HubertForSequenceClassification, tf.HubertConfig, {}),
    "wav2vec2": (tf.Wav2Vec2ForSequenceClassification, tf.Wav2Vec2Config, {}),
    "data2vec-audio": (tf.Data2VecAudioForSequenceClassification, tf.Data2VecAudioConfig, {}),
    "sew": (tf.SEWForSequenceClassification, tf.SEWConfig, {}),
    "wav2vec2-stable-layer-norm": (tf.Wav2Vec2ForSequenceClassification, tf.Wav2Vec2Config, STABLE),
}
EXTRACTOR = tf.Wav2Vec2FeatureExtractor(
    feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=False, return_attention_mask=True
)


def speech_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model_class, config_class, extra = SPEECH[name]
    model = model_class(config_class(**AUDIO, **extra))
    model.freeze_feature_encoder()  # (its in-place edits are refused under dynamic padding otherwise)
    for parameter_name, parameter in model.named_parameters():
        if "masked_spec_embed" in parameter_name or "pos_conv_embed" in parameter_name:
            parameter.requires_grad_(False)
    return model


class PadAudio:
    """Pads to the batch's longest clip (``padding=True``), or to ``max_length`` samples."""

    def __init__(self, max_length: int | None = None) -> None:
        self.max_length = max_length

    def __call__(self, features: list[dict]) -> dict:
        padding = "max_length" if self.max_length else True
        batch = EXTRACTOR.pad(
            [{"input_values": f["input_values"]} for f in features], padding=padding, max_length=self.max_length,
            return_attention_mask=True, return_tensors="pt",
        )  # fmt: skip
        return {**batch, "labels": torch.tensor([f["labels"] for f in features])}


def clips() -> datasets.Dataset:
    generator = torch.Generator().manual_seed(4)
    lengths = [160] * 7 + [3200]  # one long clip: the others are padded to its length next to it
    return datasets.Dataset.from_list(
        [
            {"input_values": torch.randn(n, generator=generator).tolist(), "labels": i % 3}
            for i, n in enumerate(lengths)
        ]
    )


def train(tmp_path, model, data, collator) -> DPTrainer:
    args = DPTrainingArguments(
        **{**QUICK_RUN_ARGS, "gradient_accumulation_steps": 1}, output_dir=str(tmp_path), max_steps=1,
        per_device_train_batch_size=4, noise_multiplier=1.0, remove_unused_columns=False,
    )  # fmt: skip
    trainer = DPTrainer(model=model, args=args, train_dataset=data, data_collator=collator)
    trainer.train()
    return trainer


@pytest.mark.parametrize("name", ["hubert", "wav2vec2", "data2vec-audio", "sew"])
def test_a_model_that_sees_its_padding_is_refused_under_dynamic_padding(tmp_path, name):
    with pytest.raises(ValueError, match="the model sees the padding its collator adds") as refused:
        train(tmp_path, speech_model(name), clips(), PadAudio())
    assert "collated alone (160 positions)" in str(refused.value) and "(3200 positions" in str(refused.value)


@pytest.mark.parametrize(
    ("name", "collator"),
    [
        ("wav2vec2-stable-layer-norm", PadAudio()),  # its feature encoder ignores padding: same loss, to 0
        ("hubert", PadAudio(max_length=3200)),  # every clip padded alike: a row depends on its clip alone
    ],
    ids=["ignores-padding", "fixed-length"],
)
def test_models_that_ignore_their_padding_and_fixed_length_padding_train(tmp_path, name, collator):
    assert train(tmp_path, speech_model(name), clips(), collator).state.global_step == 1


def test_text_models_with_dynamic_padding_train(tmp_path, monkeypatch):
    import dp_hf.trainer.data as data

    checked = []
    check = data.check_padding_is_invisible
    monkeypatch.setattr(data, "check_padding_is_invisible", lambda *a: checked.append(check(*a)))
    rows = classification_data(8).map(
        lambda row, i: {"input_ids": row["input_ids"][: 3 + i]}, with_indices=True
    )
    rows = rows.remove_columns("attention_mask")
    collator = tf.DataCollatorWithPadding(
        tf.PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), pad_token="[PAD]")
    )
    assert train(tmp_path, bert_classifier(), rows, collator).state.global_step == 1
    assert checked == [None]  # compared (BERT ignores its padding: the same loss), and passed


def _tokenizer():
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]"))


def test_the_pair_is_only_made_for_a_collator_that_pads_to_the_batch():
    features = [{"input_values": [0.5] * n, "labels": 0} for n in (5, 9, 7)]
    alone, together = check_collator_is_per_example(PadAudio(), features)
    assert alone["input_values"].shape == (1, 5) and together["input_values"].shape == (2, 9)
    assert check_collator_is_per_example(PadAudio(max_length=9), features) is None  # fixed length

    def noisy(items):  # a random collator: its draws change with the batch, so losses cannot be compared
        batch = PadAudio()(items)
        batch["input_values"] = batch["input_values"] + torch.rand(batch["input_values"].shape)
        return batch

    assert check_collator_is_per_example(noisy, features) is None
    assert check_collator_is_per_example(PadAudio(), features[:1]) is None


def test_a_padding_check_that_cannot_compare_refuses():
    """Non-finite losses tell nothing about the padding: refused, not passed."""

    def infinite_losses(model, inputs):
        return torch.full((inputs["input_values"].shape[0],), float("inf"))

    pair = check_collator_is_per_example(
        PadAudio(), [{"input_values": [0.5] * n, "labels": 0} for n in (5, 9)]
    )
    with pytest.raises(ValueError, match="could not check that the model ignores the padding"):
        check_padding_is_invisible(infinite_losses, speech_model("hubert"), pair, dict)
