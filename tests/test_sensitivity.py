"""Black-box sensitivity of a whole ``DPTrainer`` step: one example moves the update by its clipped gradient.

The guarantee rests on one fact: adding or removing one training example changes the sum that the
noise hides by at most ``C``. Other tests check the pieces (the clip factor, the fast paths against
Opacus, the sampler, the privatizer). This one checks the trainer as a user runs it, knowing nothing of
its insides: train one DP-SGD step at ``sigma = 0`` on two neighbouring datasets and read each update
off the parameters.

Every example is in the batch (expected batch = dataset size, so ``q = 1``), with no momentum, weight
decay or schedule, so ``theta_0 - theta_1 = lr * S / B`` exposes the clipped sum ``S``. ``C`` is far
below every example's gradient norm, so each example contributes exactly ``C g / ||g||``; the reference
``g`` is plain autograd on the example alone through the model's own loss (a batch of one), independent
of dp_hf's per-example losses, hooks and samplers. Each run's ``S`` must be the sum of its examples'
references, and the two runs must differ by the changed example's (norm ``C``). The changed example
comes first, so the other examples' micro-batches and padding differ between the runs and a fault
common to both does not cancel.

The table covers each per-example path (ghost, materialize, Opacus's hooks), tied weights, RMSNorm
hooks, patch embeddings, LoRA, micro-batches split by ``dp_max_physical_batch_size``, gradient
accumulation (there the neighbours swap one example, as ``q = 1`` fixes the dataset size) and DP SFT
with padded and padding-free (packed) rows.
"""

from __future__ import annotations

import warnings

import datasets
import pytest
import torch
from dp_training import Gain, bert_on_opacus_hooks, one_sgd_step, one_sgd_step_args
from tiny_models import (
    lora_bert,
    tiny_bert_classifier,
    tiny_bert_mlm,
    tiny_convnext_classifier,
    tiny_deit_classifier,
    tiny_falcon_lm,
    tiny_gemma_lm,
    tiny_gpt2_lm,
    tiny_image_batch,
    tiny_llama_lm,
    tiny_roberta_classifier,
    tiny_t5_classifier,
    tiny_text_batch,
    tiny_vit_classifier,
    with_unknown_relative_bias,
)
from torch import nn

from dp_hf import DPTrainer, DPTrainingArguments
from dp_hf.per_example.errors import PerSampleGradientError

CLIP = 1e-3  # far below every example's gradient norm (checked): each contributes exactly C g / ||g||
LR = 1e4  # a large step, so theta_1 - theta_0 is not lost in the rounding of theta_0
POOL = 9  # examples 0..8; the datasets are subsets of this pool
#: One plain DP-SGD step at sigma = 0: theta_0 - theta_1 = LR * S / B.
ONE_SGD_STEP = one_sgd_step(CLIP, LR)


def text_rows(kind: str) -> list[dict]:
    batch = tiny_text_batch(batch_size=POOL, seed=3)
    rows = []
    for i in range(POOL):
        row = {"input_ids": batch["input_ids"][i], "attention_mask": batch["attention_mask"][i]}
        if kind == "classify":
            row["labels"] = batch["labels"][i]
        elif kind == "t5":  # T5's classification head pools the eos token, which ends every example
            row["labels"] = batch["labels"][i]
            row["input_ids"] = row["input_ids"].clone()
            row["input_ids"][int(row["attention_mask"].sum()) - 1] = 1
        elif kind == "causal_lm":
            row["labels"] = batch["lm_labels"][i]
        else:  # masked LM: every third real token carries a label
            labels = batch["lm_labels"][i].clone()
            keep = torch.zeros_like(labels, dtype=torch.bool)
            keep[i % 3 :: 3] = True
            row["labels"] = labels.masked_fill(~keep, -100)
        rows.append(row)
    return rows


def image_rows() -> list[dict]:
    batch = tiny_image_batch(batch_size=POOL, seed=3)
    return [{"pixel_values": batch["pixel_values"][i], "labels": batch["labels"][i]} for i in range(POOL)]


# name -> (model factory, data kind, DPTrainingArguments overrides)
CASES = {
    "bert-ghost": (tiny_bert_classifier, "classify", dict(per_sample_gradient_mode="ghost")),
    "bert-materialize": (tiny_bert_classifier, "classify", dict(per_sample_gradient_mode="materialize")),
    "bert-opacus-hooks": (lambda: bert_on_opacus_hooks(tiny_bert_classifier()), "classify", {}),
    "bert-one-example-per-pass": (tiny_bert_classifier, "classify", dict(dp_max_physical_batch_size=1)),
    "bert-accumulation": (tiny_bert_classifier, "classify", dict(gradient_accumulation_steps=2)),
    "bert-mlm-tied-decoder": (tiny_bert_mlm, "masked_lm", {}),
    "gpt2-tied-lm-head": (tiny_gpt2_lm, "causal_lm", dict(dp_max_physical_batch_size=4)),
    "llama-rmsnorm": (tiny_llama_lm, "causal_lm", {}),
    # GemmaTextScaledWordEmbedding: the lookup times sqrt(hidden), tied to the LM head (the embedding rule).
    "gemma-scaled-embedding": (tiny_gemma_lm, "causal_lm", {}),
    # FalconLinear subclasses nn.Linear with its own forward (matmul, then bias): the fast linear rule.
    "falcon-linear-subclass": (tiny_falcon_lm, "causal_lm", dict(per_sample_gradient_mode="ghost")),
    "vit": (tiny_vit_classifier, "image", {}),
    "deit": (tiny_deit_classifier, "image", dict(per_sample_gradient_mode="materialize")),
    # Opacus's hooks (depthwise convolutions); the downsampling Conv2d gets a permuted input.
    "convnext-opacus-hooks": (tiny_convnext_classifier, "image", {}),
    "lora-bert": (lora_bert, "classify", {}),
    "roberta": (tiny_roberta_classifier, "classify", dict(dp_max_physical_batch_size=3)),
    # Its relative position bias (no batch dimension) frozen; 8 examples of padded length 8.
    "t5-frozen-position-bias": (tiny_t5_classifier, "t5", {}),
    "t5-frozen-position-bias-materialize": (
        tiny_t5_classifier,
        "t5",
        dict(per_sample_gradient_mode="materialize"),
    ),
}


def trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().double().flatten() for t in tensors])


def clipped_sum_of_one_step(factory, rows: list[dict], tmp_path, **overrides) -> torch.Tensor:
    """``S`` of one DP-SGD step at sigma = 0 on ``rows``, all in the batch, read off the parameters."""
    model = factory()
    before = flat(trainable(model))
    accumulation = overrides.get("gradient_accumulation_steps", 1)
    assert len(rows) % accumulation == 0
    args = one_sgd_step_args(
        tmp_path, len(rows) // accumulation, CLIP, LR, **overrides
    )  # expected batch N: q = 1
    dataset = datasets.Dataset.from_list([{k: v.tolist() for k, v in row.items()} for row in rows])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0 and delta >= 1/N warn, rightly
        trainer = DPTrainer(model=model, args=args, train_dataset=dataset)
        trainer.train()
    assert trainer.state.global_step == 1
    assert trainer.sample_rate == 1.0
    return (before - flat(trainable(model))) * len(rows) / LR


def clipped_gradient_alone(factory, row: dict) -> torch.Tensor:
    """``C g / ||g||``: the example's gradient through the model's own loss on a batch of one."""
    model = factory()
    model.train()
    inputs = {k: v.unsqueeze(0) for k, v in row.items()}
    loss = model(**inputs).loss
    grads = torch.autograd.grad(loss, trainable(model), allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, trainable(model))]
    gradient = flat(grads)
    assert gradient.norm() > 10 * CLIP, (
        "the example would not be clipped: the test could not see a missing clip"
    )
    return CLIP * gradient / gradient.norm()


def assert_neighbours_differ_by_one_clipped_gradient(s_without, s_with, clipped, without, with_):
    """Each run's sum is the sum of its examples' reference clipped gradients, and the two differ by one.

    ``clipped[i]``: example ``i``'s reference ``C g / ||g||``; ``without``/``with_``: the examples of each run.
    """
    # The sums are ~N C, rounded at ~1e-7 N C; a missed clip, a double count or two examples clipped as
    # one are ~C off.
    for name, s, examples in (("without", s_without, without), ("with", s_with, with_)):
        expected = torch.stack([clipped[i] for i in examples]).sum(0)
        torch.testing.assert_close(s, expected, rtol=0, atol=2e-5 * CLIP, msg=lambda m, n=name: f"{n}: {m}")
    added, removed = set(with_) - set(without), set(without) - set(with_)
    expected = sum(clipped[i] for i in added) - sum((clipped[i] for i in removed), torch.zeros(()))
    torch.testing.assert_close(s_with - s_without, expected, rtol=0, atol=2e-5 * CLIP)
    if not removed:
        assert (s_with - s_without).norm().item() == pytest.approx(CLIP, rel=1e-4)


@pytest.mark.parametrize("name", list(CASES))
def test_one_example_moves_the_update_by_its_clipped_gradient(name, tmp_path):
    factory, kind, overrides = CASES[name]
    rows = image_rows() if kind == "image" else text_rows(kind)
    # The changed example (8, the longest text) comes first, so the other examples' micro-batches and
    # padding differ between the runs: a fault shared by both runs does not cancel in the difference.
    if overrides.get("gradient_accumulation_steps", 1) > 1:
        without, with_ = list(range(8)), [8, *range(7)]  # replace-one: q = 1 fixes the dataset size
    else:
        without, with_ = list(range(8)), [8, *range(8)]  # add-one
    s_without = clipped_sum_of_one_step(
        factory, [rows[i] for i in without], tmp_path / "without", **overrides
    )
    s_with = clipped_sum_of_one_step(factory, [rows[i] for i in with_], tmp_path / "with", **overrides)
    clipped = [clipped_gradient_alone(factory, row) for row in rows]
    assert_neighbours_differ_by_one_clipped_gradient(s_without, s_with, clipped, without, with_)


@pytest.mark.parametrize("path", ["ghost", "materialize", "opacus-hooks"])
def test_a_trained_layer_without_a_batch_dimension_is_refused_though_its_size_is_the_batch(path, tmp_path):
    """T5's relative position bias is looked up with a ``[T, T]`` bucket tensor. With the padded length T equal
    to the micro-batch size (8 and 8 here) it passed the hooks' shape check, and its rows were clipped as
    examples: replace-one neighbours differed by 3.8 C. Forwards on 1 and 2 examples refuse it first. (T5's
    own ``compute_bias`` is now recorded per example, dp_hf.per_example.relative_bias; the model here
    shadows it on the instance, code dp_hf does not know, which takes the old path.)"""

    def factory():
        model = with_unknown_relative_bias(tiny_t5_classifier(train_position_bias=True))
        if path == "opacus-hooks":
            head = model.classification_head
            head.out_proj = nn.Sequential(head.out_proj, Gain(model.config.num_labels))
        return model

    overrides = {} if path == "opacus-hooks" else dict(per_sample_gradient_mode=path)
    with pytest.raises(PerSampleGradientError) as refused:
        clipped_sum_of_one_step(factory, text_rows("t5")[:8], tmp_path, **overrides)
    message = str(refused.value)
    assert "relative_attention_bias (Embedding) received an input with leading dimension 8" in message
    assert "forward pass of batch size 1" in message and "Freeze that layer" in message


def test_a_one_position_input_without_a_batch_dimension_is_explained(tmp_path):
    """With one position, T5's bucket tensor is ``[1, 1]``: the hooks expand a leading 1 to the batch (as for
    broadcast position ids), T5's bias then has the wrong shape, and the forward fails on a bare shape error.
    The error now says which input was expanded and to freeze that layer."""
    rows = [
        {"input_ids": torch.tensor([1]), "attention_mask": torch.tensor([1]), "labels": torch.tensor(i % 2)}
        for i in range(4)
    ]
    with pytest.raises(RuntimeError) as failed:
        clipped_sum_of_one_step(
            lambda: with_unknown_relative_bias(tiny_t5_classifier(train_position_bias=True)), rows, tmp_path
        )
    notes = "\n".join(getattr(failed.value, "__notes__", []))
    assert "relative_attention_bias (Embedding) [1, 1] from a leading dimension of 1" in notes
    assert "freeze that layer" in notes


class _RelativeBiasNet(nn.Module):
    """A custom model whose batch input has a name no Hugging Face model uses, and a T5-like relative bias."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.bias, self.head = nn.Embedding(40, 16), nn.Embedding(32, 1), nn.Linear(16, 2)

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden, positions = self.embed(tokens), torch.arange(tokens.shape[1])
        bias = self.bias(positions[None, :] - positions[:, None] + 16).squeeze(
            -1
        )  # [T, T]: no batch dimension
        attention = torch.softmax(hidden @ hidden.transpose(1, 2) / 4 + bias, -1)
        return {"logits": self.head((attention @ hidden).mean(1))}


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_the_batch_size_is_known_whatever_the_input_is_called(mode, tmp_path):
    """The hooks learnt the batch size from input names they know (input_ids, pixel_values, ...): with another
    name they checked no layer's input, and the probe could not refuse the bias above."""
    generator = torch.Generator().manual_seed(0)
    tokens, labels = (
        torch.randint(0, 40, (8, 8), generator=generator),
        torch.randint(0, 2, (8,), generator=generator),
    )
    rows = [{"tokens": t.tolist(), "labels": int(y)} for t, y in zip(tokens, labels)]
    args = DPTrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        **ONE_SGD_STEP,
        per_sample_gradient_mode=mode,
        remove_unused_columns=False,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = DPTrainer(
        model=_RelativeBiasNet(),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        per_example_loss_fn=lambda outputs, y, inputs: nn.functional.cross_entropy(
            outputs["logits"], y, reduction="none"
        ),
    )
    with warnings.catch_warnings(), pytest.raises(PerSampleGradientError, match="bias .*leading dimension 8"):
        warnings.simplefilter("ignore")  # sigma = 0 and delta >= 1/N warn, rightly
        trainer.train()


# ------------------------------------------------------------------ DP SFT (trl), padded and padding-free rows


def sft_model(full: bool):
    """A tiny Llama: every parameter trainable (RMSNorm weights moved off 1), or LoRA adapters."""
    from peft import get_peft_model
    from test_sft import lora_config, tiny_llama
    from test_sft_packing import full_llama

    from recipes.smoke import chat_tokenizer

    if full:
        return full_llama(chat_tokenizer())
    model = tiny_llama(chat_tokenizer())
    torch.manual_seed(1)  # the adapters' initialisation
    config = lora_config()
    config.init_lora_weights = False  # B != 0, so A has a gradient too
    return get_peft_model(model, config)


@pytest.mark.parametrize("full", [True, False], ids=["full", "lora"])
@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding-free"])
def test_one_conversation_moves_the_sft_update_by_its_clipped_gradient(padding_free, full, tmp_path):
    pytest.importorskip("trl")
    from test_sft import prompt_completion, sft_args

    from dp_hf import DPSFTTrainer
    from recipes.smoke import chat_tokenizer

    tokenizer = chat_tokenizer()
    pool = prompt_completion(POOL, seed=5)

    def clipped_sum(dataset, output_dir):
        model = sft_model(full)
        before = flat(trainable(model))
        args = sft_args(
            output_dir,
            per_device_train_batch_size=len(dataset),
            gradient_accumulation_steps=1,
            max_length=None,
            padding_free=padding_free,
            dp_max_physical_batch_size=4,  # the packed rows split between whole conversations
            **ONE_SGD_STEP,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = DPSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
            trainer.train()
        assert trainer.state.global_step == 1 and trainer.sample_rate == 1.0
        assert trainer.packed_examples == padding_free
        return (before - flat(trainable(model))) * len(dataset) / LR, trainer

    without, with_ = list(range(POOL - 1)), [POOL - 1, *range(POOL - 1)]  # the added conversation first
    s_without, _ = clipped_sum(pool.select(without), tmp_path / "without")
    s_with, trainer = clipped_sum(pool.select(with_), tmp_path / "with")
    clipped = {}
    for position, i in enumerate(with_):
        tokenized = trainer.train_dataset[position]  # as the trainer tokenized it: labels outside the prompt
        row = {k: torch.tensor(tokenized[k]) for k in ("input_ids", "labels")}
        clipped[i] = clipped_gradient_alone(lambda: sft_model(full), row)
    assert_neighbours_differ_by_one_clipped_gradient(s_without, s_with, clipped, without, with_)


# ------------------------------------------------------------------ the test's own checks


def test_each_factory_builds_the_same_initial_model():
    """The references are taken on a fresh model: it must start where the trained one started."""
    for factory, _, _ in CASES.values():
        a, b = factory(), factory()
        assert a is not b
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    a, b = sft_model(full=False), sft_model(full=False)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
