"""PEFT prompt learning under DP, one row per PEFT config x per-example engine.

Prompt tuning and P-tuning prepend ``num_virtual_tokens`` encoded prompts to every row. Before this was
supported, DPTrainer's per-example loss failed on the extra logits ('Expected input batch_size (9) to match
target batch_size (6)'), and the hooks failed inside PEFT's forward: PEFT encodes the prompt once and
repeats it over the batch, and the recorder's expansion of its ``[1, n]`` ids made that ``B * B`` rows (a bare
torch.cat size error). Prefix tuning (keys and values, no extra positions) trained already; its rows are
here as coverage.

* the per-example gradients of the trainable prompt (and P-tuning's MLP, a classifier's head) from each
  engine against a loop of single examples through plain autograd, whose loss PEFT's own forward computes
  (it pads the labels for the virtual tokens itself);
* one DP-SGD step at sigma 0, as in ``test_module_zoo_sensitivity.py``: adding one example moves the
  clipped sum by at most ``C``, and each sum is exactly the single-example gradients clipped to ``C``;
* short private runs that log epsilon; the setups not supported are refused before training.
"""

from __future__ import annotations

import copy
import warnings

import datasets
import pytest
import torch
import torch.nn.functional as F
from peft import (
    MultitaskPromptTuningConfig,
    PrefixTuningConfig,
    PromptEncoderConfig,
    PromptTuningConfig,
    get_peft_model,
)
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
)

from dp_hf import DPTrainer
from dp_hf.per_example import attach_fast_clipping, attach_grad_sample, per_sample_gradients
from dp_hf.privatizer import Geometry, clip_and_sum
from tests.dp_training import Gain, dp_args, one_sgd_step_args

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated"),
]

VOCAB, SEQ, LABELS, VIRTUAL, POOL = 40, 6, 3, 3, 9
CLIP, LR = 1e-3, 1e4

#: name -> (task, PEFT config)
CONFIGS = {
    "prompt-tuning-lm": ("lm", lambda: PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=VIRTUAL)),
    "p-tuning-lm": (
        "lm",
        lambda: PromptEncoderConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=VIRTUAL, encoder_hidden_size=16
        ),
    ),
    "prefix-tuning-lm": ("lm", lambda: PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=VIRTUAL)),
    "prefix-projection-lm": (
        "lm",
        lambda: PrefixTuningConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=VIRTUAL, prefix_projection=True, encoder_hidden_size=16
        ),
    ),
    "prompt-tuning-seq-cls": (
        "cls",
        lambda: PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=VIRTUAL),
    ),
    "p-tuning-seq-cls": (
        "cls",
        lambda: PromptEncoderConfig(task_type="SEQ_CLS", num_virtual_tokens=VIRTUAL, encoder_hidden_size=16),
    ),
    "prompt-tuning-token-cls": (
        "token",
        lambda: PromptTuningConfig(task_type="TOKEN_CLS", num_virtual_tokens=VIRTUAL),
    ),
}
ENGINES = ("ghost", "materialize", "opacus-hooks")


def llama(task: str) -> nn.Module:
    """A tiny random Llama: causal LM (``"lm"``), sequence (``"cls"``) or token (``"token"``) classifier."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        num_labels=LABELS,
        classifier_dropout=0.0,  # (the token classifier's default 0.1 draws other masks alone than in a batch)
    )
    heads = {
        "lm": LlamaForCausalLM,
        "cls": LlamaForSequenceClassification,
        "token": LlamaForTokenClassification,
    }
    return heads[task](config)


def peft_model(name: str, *, opacus_hooks: bool = False) -> nn.Module:
    """:func:`llama` with the PEFT config ``name``; with ``opacus_hooks``, a trainable :class:`Gain` after its final
    norm (no fast rule), so that DPTrainer takes Opacus's hooks."""
    task, config = CONFIGS[name]
    base = llama(task)
    model = get_peft_model(base, config())
    if opacus_hooks:
        base.model.norm = nn.Sequential(base.model.norm, Gain(32))
    # (a classifier's fresh head copy moved too: every example then has a prompt gradient)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    return model.train()


def rows(name: str) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (POOL, SEQ), generator=g)
    labels = {"lm": ids, "cls": torch.randint(0, LABELS, (POOL,), generator=g)}.get(
        CONFIGS[name][0], torch.randint(0, LABELS, (POOL, SEQ), generator=g)
    )
    return [
        {"input_ids": ids[i].tolist(), "attention_mask": [1] * SEQ, "labels": labels[i].tolist()}
        for i in range(POOL)
    ]


def batch(data: list[dict]) -> dict[str, torch.Tensor]:
    return {key: torch.tensor([row[key] for row in data]) for key in data[0]}


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def alone(name: str, row: dict, **kwargs) -> torch.Tensor:
    """Example ``row``'s gradient of every trainable tensor, flat: a batch of one through plain autograd, its loss
    PEFT's own forward's (which pads a causal LM's labels for the virtual tokens; not a token classifier's, whose
    loss is written out here)."""
    model = peft_model(name, **kwargs)
    one = batch([row])
    loss = losses(model, one, "token")[0] if CONFIGS[name][0] == "token" else model(**one).loss
    grads = torch.autograd.grad(loss, list(trainable(model).values()), allow_unused=True)
    return torch.cat(
        [
            (torch.zeros_like(p) if g is None else g).flatten()
            for g, p in zip(grads, trainable(model).values())
        ]
    )


def losses(model: nn.Module, inputs: dict[str, torch.Tensor], task: str) -> torch.Tensor:
    """Per-example losses written out here (not dp_hf's): cross entropy, or the mean over each row's (next) tokens."""
    inputs = dict(inputs)
    labels = inputs.pop("labels")
    logits = model(**inputs).logits.float()
    if task == "cls":
        return F.cross_entropy(logits, labels, reduction="none")
    labels = F.pad(labels, (logits.shape[1] - labels.shape[1], 0), value=-100)  # the virtual tokens: no label
    if task == "lm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=-100)
    counted = (labels != -100).float()
    return (token * counted).sum(1) / counted.sum(1)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_per_example_gradients_of_the_prompt_match_single_examples(name, engine):
    data = rows(name)[:4]
    reference = torch.stack([alone(name, row) for row in data])  # [B, P]
    model = peft_model(name)
    params = list(trainable(model).values())
    shapes = [p.numel() for p in params]
    assert all(reference.norm(dim=1) > 0)
    if engine == "opacus-hooks":
        handle = attach_grad_sample(model)
        losses(model, batch(data), CONFIGS[name][0]).sum().backward()
        samples = per_sample_gradients(model)
        got = torch.cat([samples[n].flatten(1) for n in trainable(model)], dim=1)
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-6)
        handle.remove()
        return
    norms = reference.norm(dim=1)
    clip = float(norms.median())  # examples on both sides: factor 1 and C / ||g_i||
    expected, expected_norms = clip_and_sum(
        [g.view(len(data), *p.shape) for g, p in zip(reference.split(shapes, dim=1), params)], Geometry(clip)
    )
    clipping = attach_fast_clipping(model, mode=engine)
    losses(model, batch(data), CONFIGS[name][0]).sum().backward()
    sums, got_norms = clipping.clipped_sum(params, Geometry(clip))
    clipping.remove()
    torch.testing.assert_close(got_norms, expected_norms, rtol=1e-4, atol=1e-7)
    for got, want in zip(sums, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


def clipped_sum(name: str, data: list[dict], output_dir, engine: str) -> torch.Tensor:
    """``S`` of one DP-SGD step at sigma 0 with every example in the batch (q = 1), read off the parameters."""
    opacus_hooks = engine == "opacus-hooks"
    model = peft_model(name, opacus_hooks=opacus_hooks)
    before = torch.cat([p.detach().double().flatten() for p in trainable(model).values()])
    mode = "auto" if opacus_hooks else engine
    args = one_sgd_step_args(output_dir, len(data), CLIP, LR, per_sample_gradient_mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0 and delta >= 1/N warn, rightly
        trainer = DPTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(data))
        assert (trainer.fast_clipping is None) == opacus_hooks
        trainer.train()
    assert trainer.state.global_step == 1 and trainer.sample_rate == 1.0
    after = torch.cat([p.detach().double().flatten() for p in trainable(model).values()])
    return (before - after) * len(data) / LR


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_example_moves_the_update_by_at_most_its_clipped_gradient(name, engine, tmp_path):
    data = rows(name)
    s_without = clipped_sum(name, data[:8], tmp_path / "without", engine)
    s_with = clipped_sum(name, [data[8], *data[:8]], tmp_path / "with", engine)
    gradients = [alone(name, row, opacus_hooks=engine == "opacus-hooks").double() for row in data]
    assert all(g.norm() > 10 * CLIP for g in gradients)  # every example is clipped: a missed clip would show
    clipped = [CLIP * g / g.norm() for g in gradients]
    assert (s_with - s_without).norm().item() / CLIP <= 1 + 1e-4  # the black-box bound
    for s, examples in ((s_without, range(8)), (s_with, [8, *range(8)])):  # white box: each its own C g/|g|
        expected = torch.stack([clipped[i] for i in examples]).sum(0)
        torch.testing.assert_close(s, expected, rtol=0, atol=2e-5 * CLIP)


@pytest.mark.parametrize("name", ["prompt-tuning-lm", "p-tuning-seq-cls"])
def test_a_private_run_trains_the_prompt_only_and_logs_epsilon(name, tmp_path):
    model = peft_model(name)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    prompt = {n: p.detach().clone() for n, p in trainable(model).items()}
    data = datasets.Dataset.from_list(rows(name) * 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPTrainer(
            model=model,
            args=dp_args(tmp_path, per_device_train_batch_size=8, max_steps=3),
            train_dataset=data,
        )
        trainer.train()
    epsilons = [entry["epsilon"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(epsilons) == 3 and 0 < epsilons[0] < epsilons[-1] < float("inf")
    assert trainer.privacy_spent()[0] == pytest.approx(epsilons[-1], rel=1e-3)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert all(not torch.equal(p, prompt[n]) for n, p in trainable(model).items())


def test_a_per_example_loss_fn_gets_the_labels_aligned_with_the_virtual_tokens(tmp_path):
    """A user's per_example_loss_fn receives the labels as PEFT's forward would pad them (-100 first for the
    virtual tokens): its losses are then the built-in path's. Before, it got them one prompt out of line."""
    from dp_hf.losses import per_example_loss

    seen = []

    def loss_fn(outputs, labels, inputs):
        seen.append((outputs.logits.shape[1], labels.shape[1], bool((labels[:, :VIRTUAL] == -100).all())))
        return per_example_loss(outputs.logits, labels, "causal_lm")

    def run(fn):
        torch.manual_seed(0)
        trainer = DPTrainer(
            model=peft_model("prompt-tuning-lm"),
            args=dp_args(tmp_path, per_device_train_batch_size=8, max_steps=2, noise_multiplier=0.0),
            train_dataset=datasets.Dataset.from_list(rows("prompt-tuning-lm") * 8),
            per_example_loss_fn=fn,
        )
        trainer.train()
        return trainable(trainer.model)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        own, built_in = run(loss_fn), run(None)
    assert seen and all(logits == labels and padded for logits, labels, padded in seen)
    assert all(torch.allclose(own[n], built_in[n], atol=1e-6) for n in own)


def test_a_deep_copy_of_a_hooked_prompt_model_runs_peft_own_get_prompt():
    model = peft_model("prompt-tuning-lm")
    clipping = attach_fast_clipping(model, probe_batch_dimensions=False)
    assert "get_prompt" in vars(model)  # the per-example encoding while recording
    copied = copy.deepcopy(model)
    assert vars(copied)["get_prompt"].owner is None
    data = batch(rows("prompt-tuning-lm")[:3])
    torch.testing.assert_close(copied(**data).logits, peft_model("prompt-tuning-lm")(**data).logits)
    clipping.remove()
    assert "get_prompt" not in vars(model)


REFUSED = {  # name: (PEFT config, the phrase naming the value and its fix)
    "p-tuning-lstm": (
        lambda: PromptEncoderConfig(
            task_type="CAUSAL_LM",
            num_virtual_tokens=VIRTUAL,
            encoder_hidden_size=16,
            encoder_reparameterization_type="LSTM",
        ),
        "encoder_reparameterization_type='LSTM'.*Set encoder_reparameterization_type='MLP'",
    ),
    "multitask-prompt-tuning": (
        lambda: MultitaskPromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=VIRTUAL, num_tasks=2),
        "peft_type='MULTITASK_PROMPT_TUNING' is not supported.*Use PromptTuningConfig",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_an_unsupported_prompt_learning_setup_is_refused_when_the_trainer_is_built(name, tmp_path):
    config, phrase = REFUSED[name]
    model = get_peft_model(llama("lm"), config())
    with pytest.raises(ValueError, match=phrase), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        DPTrainer(
            model=model,
            args=dp_args(tmp_path, per_device_train_batch_size=8),
            train_dataset=datasets.Dataset.from_list(rows("prompt-tuning-lm") * 8),
        )
