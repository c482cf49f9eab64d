"""Per-example gradients from dp_hf.grad_sample against a loop over single examples.

The reference for example ``i`` is a plain forward/backward of the model on example ``i`` alone
(no hooks attached).  The batched pass with hooks must reproduce it for *every* trainable
parameter, and the per-example gradients must sum to the ordinary batch gradient.  Each model
family is here because it hides a different trap: broadcast position ids (BERT, GPT-2), per-example
padding-aware position ids that must not be overridden (RoBERTa), tied embeddings (GPT-2, BERT MLM),
functorch-fallback layers (GPT-2 Conv1D, Llama RMSNorm), raw parameters in the embeddings (ViT,
DeiT) and adapter/``modules_to_save`` copies (PEFT LoRA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from opacus.grad_sample import GradSampleModule
from tiny_models import (
    ROBERTA_PAD_TOKEN_ID,
    TINY_NUM_LABELS,
    TINY_VOCAB_SIZE,
    freeze_all_but,
    lora_bert,
    tiny_bert_classifier,
    tiny_bert_config,
    tiny_bert_mlm,
    tiny_clip_vision_classifier,
    tiny_convnext_classifier,
    tiny_data2vec_vision_classifier,
    tiny_deit_classifier,
    tiny_gpt2_lm,
    tiny_image_batch,
    tiny_llama_lm,
    tiny_poolformer_classifier,
    tiny_roberta_classifier,
    tiny_text_batch,
    tiny_vit_classifier,
    tiny_vit_config,
)
from torch import nn

from dp_hf.optim import create_dp_optimizer
from dp_hf.per_example import (
    PerSampleGradientError,
    UnsupportedModuleError,
    attach_grad_sample,
    clear_grad_sample,
    per_sample_gradients,
    validate_model,
)
from dp_hf.per_example.ghost import attach_fast_clipping

# torch warns on every backward that full backward hooks fire on outputs when no input needs grad
# (always the case for token ids / pixels); it is expected with Opacus and only noise here.
# peft 0.21 still reads the deprecated ``is_gradient_checkpointing`` of transformers 5.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated"),
]

BATCH_SIZE = 4
ATOL = 1e-5
RTOL = 1e-4

Inputs = dict[str, torch.Tensor]


# --------------------------------------------------------------------------------------------------
# Per-example losses (computed from logits, never by the model, so the reduction is under our control)
# --------------------------------------------------------------------------------------------------


def classification_losses(model: nn.Module, inputs: Inputs, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(**inputs).logits, targets, reduction="none")


def _token_mean_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    token_losses = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    counted = (labels != -100).to(token_losses.dtype)
    return (token_losses * counted).sum(dim=1) / counted.sum(dim=1)


def causal_lm_losses(model: nn.Module, inputs: Inputs, labels: torch.Tensor) -> torch.Tensor:
    logits = model(**inputs).logits
    return _token_mean_losses(logits[:, :-1], labels[:, 1:])


def masked_lm_losses(model: nn.Module, inputs: Inputs, labels: torch.Tensor) -> torch.Tensor:
    return _token_mean_losses(model(**inputs).logits, labels)


def hidden_state_losses(
    model: nn.Module, inputs: Inputs, example_ids: torch.Tensor, *, weights: torch.Tensor
) -> torch.Tensor:
    """A nonlinear per-example function of every output token and of the pooled output.

    ``weights`` are shared by all examples; ``example_ids`` only plays the role of the targets.
    """
    output = model(**inputs)
    tokens = output.last_hidden_state
    per_token = (torch.tanh(tokens) * weights[: tokens.shape[1]]).sum(dim=(1, 2))
    return per_token + output.pooler_output.pow(2).sum(dim=1)


# --------------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------------


@dataclass
class Case:
    """A model, its inputs and targets, and how to turn them into one loss per example."""

    model: nn.Module
    inputs: Inputs
    targets: torch.Tensor
    per_example_losses: Callable[[nn.Module, Inputs, torch.Tensor], torch.Tensor]


def _text_inputs(batch: dict[str, torch.Tensor]) -> Inputs:
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def bert_all_trainable() -> Case:
    batch = tiny_text_batch(seed=1)
    return Case(tiny_bert_classifier(), _text_inputs(batch), batch["labels"], classification_losses)


def bert_explicit_broadcast_ids() -> Case:
    """Caller-provided ids: per-example token types, and position ids of shape [1, L] (broadcast)."""
    batch = tiny_text_batch(seed=2)
    inputs = _text_inputs(batch)
    generator = torch.Generator().manual_seed(2)
    inputs["token_type_ids"] = torch.randint(0, 2, batch["input_ids"].shape, generator=generator)
    inputs["position_ids"] = torch.arange(3, 3 + batch["input_ids"].shape[1]).unsqueeze(0)
    return Case(tiny_bert_classifier(seed=1), inputs, batch["labels"], classification_losses)


def bert_last_layer_only() -> Case:
    batch = tiny_text_batch(seed=3)
    model = freeze_all_but(
        tiny_bert_classifier(seed=2), ["bert.encoder.layer.1.", "bert.pooler.", "classifier."]
    )
    return Case(model, _text_inputs(batch), batch["labels"], classification_losses)


def bert_masked_lm() -> Case:
    batch = tiny_text_batch(seed=4)
    generator = torch.Generator().manual_seed(4)
    chosen = (torch.rand(batch["input_ids"].shape, generator=generator) < 0.4) & (
        batch["attention_mask"] == 1
    )
    chosen[:, 0] = True  # every example needs at least one predicted token
    labels = batch["input_ids"].masked_fill(~chosen, -100)
    inputs = _text_inputs(batch)
    inputs["input_ids"] = inputs["input_ids"].masked_fill(chosen, 3)  # a stand-in [MASK] id
    return Case(tiny_bert_mlm(seed=3), inputs, labels, masked_lm_losses)


def roberta_classifier() -> Case:
    batch = tiny_text_batch(seed=5, pad_token_id=ROBERTA_PAD_TOKEN_ID)
    return Case(tiny_roberta_classifier(), _text_inputs(batch), batch["labels"], classification_losses)


def gpt2_causal_lm() -> Case:
    batch = tiny_text_batch(seed=6)
    return Case(tiny_gpt2_lm(), _text_inputs(batch), batch["lm_labels"], causal_lm_losses)


def llama_causal_lm() -> Case:
    batch = tiny_text_batch(seed=7)
    return Case(tiny_llama_lm(), _text_inputs(batch), batch["lm_labels"], causal_lm_losses)


def vit_classifier() -> Case:
    batch = tiny_image_batch(seed=8)
    return Case(
        tiny_vit_classifier(), {"pixel_values": batch["pixel_values"]}, batch["labels"], classification_losses
    )


def convnext_classifier() -> Case:
    batch = tiny_image_batch(seed=9)
    return Case(
        tiny_convnext_classifier(),
        {"pixel_values": batch["pixel_values"]},
        batch["labels"],
        classification_losses,
    )


def deit_classifier() -> Case:
    batch = tiny_image_batch(seed=9)
    return Case(
        tiny_deit_classifier(),
        {"pixel_values": batch["pixel_values"]},
        batch["labels"],
        classification_losses,
    )


def deit_with_teacher() -> Case:
    batch = tiny_image_batch(seed=10)
    model = tiny_deit_classifier(seed=1, with_teacher=True)
    return Case(model, {"pixel_values": batch["pixel_values"]}, batch["labels"], classification_losses)


def _masked_interpolated_encoder(model: nn.Module, num_special_tokens: int) -> Case:
    """Larger images than the model was built for (position interpolation) and masked patches."""
    image_size = 24  # 6x6 patches instead of the configured 4x4
    batch = tiny_image_batch(seed=11, image_size=image_size)
    generator = torch.Generator().manual_seed(11)
    num_patches = (image_size // 4) ** 2
    bool_masked_pos = torch.rand(BATCH_SIZE, num_patches, generator=generator) < 0.5
    inputs = {
        "pixel_values": batch["pixel_values"],
        "bool_masked_pos": bool_masked_pos,
        "interpolate_pos_encoding": True,
    }
    weights = torch.randn(num_patches + num_special_tokens, 32, generator=generator)
    return Case(model, inputs, torch.arange(BATCH_SIZE), partial(hidden_state_losses, weights=weights))


def vit_masked_interpolated() -> Case:
    from transformers import ViTModel

    torch.manual_seed(12)
    model = ViTModel(tiny_vit_config(), use_mask_token=True).train()
    with torch.no_grad():
        model.embeddings.mask_token.normal_()
    return _masked_interpolated_encoder(model, num_special_tokens=1)


def deit_masked_interpolated() -> Case:
    from transformers import DeiTConfig, DeiTModel

    torch.manual_seed(13)
    config = DeiTConfig(**{**tiny_vit_config().to_dict(), "model_type": "deit"})
    model = DeiTModel(config, use_mask_token=True).train()
    with torch.no_grad():
        for parameter in model.embeddings.parameters(recurse=False):
            parameter.normal_()
    return _masked_interpolated_encoder(model, num_special_tokens=2)


def _image_case(factory: Callable[[], nn.Module], seed: int) -> Case:
    batch = tiny_image_batch(seed=seed)
    return Case(factory(), {"pixel_values": batch["pixel_values"]}, batch["labels"], classification_losses)


def poolformer_classifier() -> Case:
    """Layers owning layer scale and returning ``(hidden_states,)``: Opacus's vmap fallback replays the first
    output (its own replay multiplied the tuple and crashed mid-training)."""
    return _image_case(tiny_poolformer_classifier, seed=15)


def data2vec_vision_classifier() -> Case:
    """BEiT's layout of embeddings, returning ``(embeddings, patch grid)`` (was refused: no rule)."""
    return _image_case(partial(tiny_data2vec_vision_classifier, layer_scale=False), seed=16)


def clip_vision_classifier() -> Case:
    """A raw ``class_embedding`` beside a ``position_ids`` buffer, positions from a child ``nn.Embedding``
    (was refused: trainable parameters and buffers)."""
    return _image_case(tiny_clip_vision_classifier, seed=17)


def peft_lora_bert() -> Case:
    batch = tiny_text_batch(seed=14)
    return Case(lora_bert(), _text_inputs(batch), batch["labels"], classification_losses)


CASES: dict[str, Callable[[], Case]] = {
    "bert_all_trainable": bert_all_trainable,
    "bert_explicit_broadcast_ids": bert_explicit_broadcast_ids,
    "bert_last_layer_only": bert_last_layer_only,
    "bert_masked_lm": bert_masked_lm,
    "roberta_classifier": roberta_classifier,
    "gpt2_causal_lm": gpt2_causal_lm,
    "llama_causal_lm": llama_causal_lm,
    "vit_classifier": vit_classifier,
    "deit_classifier": deit_classifier,
    "convnext_classifier": convnext_classifier,
    "deit_with_teacher": deit_with_teacher,
    "vit_masked_interpolated": vit_masked_interpolated,
    "deit_masked_interpolated": deit_masked_interpolated,
    "peft_lora_bert": peft_lora_bert,
    "poolformer_classifier": poolformer_classifier,
    "data2vec_vision_classifier": data2vec_vision_classifier,
    "clip_vision_classifier": clip_vision_classifier,
}


# --------------------------------------------------------------------------------------------------
# Reference and comparison
# --------------------------------------------------------------------------------------------------


def _example(inputs: Inputs, index: int, batch_size: int) -> Inputs:
    """Example ``index`` alone; tensors without a batch dimension (e.g. [1, L] ids) are shared."""
    return {
        key: value[index : index + 1]
        if isinstance(value, torch.Tensor) and value.shape[0] == batch_size
        else value
        for key, value in inputs.items()
    }


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def loop_reference(case: Case) -> dict[str, torch.Tensor]:
    """Per-example gradients from B separate forward/backward passes on one example each."""
    parameters = _trainable(case.model)
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in parameters}
    for index in range(BATCH_SIZE):
        case.model.zero_grad(set_to_none=True)
        example = _example(case.inputs, index, BATCH_SIZE)
        case.per_example_losses(case.model, example, case.targets[index : index + 1]).sum().backward()
        for name, parameter in parameters.items():
            grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
            rows[name].append(grad.detach().clone())
    case.model.zero_grad(set_to_none=True)
    return {name: torch.stack(grads) for name, grads in rows.items()}


@pytest.mark.parametrize("case_name", list(CASES))
def test_per_example_gradients_match_single_example_loop(case_name: str) -> None:
    case = CASES[case_name]()
    reference = loop_reference(case)
    with torch.no_grad():
        losses_without_hooks = case.per_example_losses(case.model, case.inputs, case.targets)

    handle = attach_grad_sample(case.model)
    losses = case.per_example_losses(case.model, case.inputs, case.targets)
    torch.testing.assert_close(losses.detach(), losses_without_hooks, atol=1e-6, rtol=1e-6)
    losses.sum().backward()
    grad_samples = per_sample_gradients(case.model)

    parameters = _trainable(case.model)
    assert set(grad_samples) == set(parameters)
    for name, parameter in parameters.items():
        assert reference[name].abs().sum() > 0, f"{name}: vacuous test, zero gradient for every example"
        assert grad_samples[name].shape == (BATCH_SIZE, *parameter.shape), name
        torch.testing.assert_close(grad_samples[name], reference[name], atol=ATOL, rtol=RTOL, msg=name)
        torch.testing.assert_close(grad_samples[name].sum(0), parameter.grad, atol=ATOL, rtol=RTOL, msg=name)
    handle.remove()


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


class _Encoder(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


class _Net(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.encoder = _Encoder(norm)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


@pytest.mark.parametrize(
    "norm", [nn.BatchNorm1d(4), nn.SyncBatchNorm(4)], ids=["BatchNorm1d", "SyncBatchNorm"]
)
def test_batchnorm_in_training_is_refused_with_its_path(norm: nn.Module) -> None:
    with pytest.raises(UnsupportedModuleError) as error:
        validate_model(_Net(norm))
    message = str(error.value)
    assert f"encoder.norm ({type(norm).__name__})" in message
    assert "GroupNorm" in message and "ModuleValidator.fix" in message
    assert error.value.problems[0][:2] == ("encoder.norm", type(norm).__name__)


def test_frozen_batchnorm_is_refused_in_training_but_accepted_in_eval() -> None:
    model = _Net(nn.BatchNorm1d(4))
    model.encoder.norm.requires_grad_(False)
    with pytest.raises(UnsupportedModuleError, match="encoder.norm"):
        validate_model(model)  # still mixes examples through batch statistics
    model.encoder.norm.eval()
    validate_model(model)
    handle = attach_grad_sample(model)
    model(torch.randn(3, 4)).sum().backward()
    assert per_sample_gradients(model)["head.weight"].shape == (3, 2, 4)
    handle.remove()


class _RunningScale(nn.Module):
    """A trainable scale with a running-statistics buffer: Opacus cannot make that private."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("running_mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale - self.running_mean


class _ScaledBlock(nn.Module):
    """Raw parameter plus a child with active dropout: the vmap fallback cannot replay the mask."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x * self.gain)


class _Adapters(nn.Module):
    """Parameters read directly by the parent (like PEFT's ParameterDict-based adapters)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.deltas = nn.ParameterDict({"default": nn.Parameter(torch.zeros(4))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.deltas["default"]


@pytest.mark.parametrize(
    ("module", "path", "type_name", "reason"),
    [
        (_Net(_RunningScale()), "encoder.norm", "_RunningScale", "buffers (running_mean)"),
        (_Net(_ScaledBlock()), "encoder.norm", "_ScaledBlock", "dropout masks of dropout"),
        (_Adapters(), "deltas", "ParameterDict", "has no forward"),
        (nn.Sequential(nn.LSTM(4, 4)), "0", "LSTM", "ModuleValidator"),
    ],
    ids=["buffers", "dropout_in_fallback", "parameter_dict", "lstm"],
)
def test_unsupported_trainable_module_is_refused_with_its_path(
    module: nn.Module, path: str, type_name: str, reason: str
) -> None:
    with pytest.raises(UnsupportedModuleError) as error:
        attach_grad_sample(module)
    assert f"{path} ({type_name})" in str(error.value)
    assert reason in str(error.value)
    assert not hasattr(module, "autograd_grad_sample_hooks")  # nothing was attached


def test_frozen_unsupported_modules_are_fine() -> None:
    model = _Net(_ScaledBlock())
    model.encoder.norm.requires_grad_(False)
    validate_model(model)


def test_strict_false_only_warns() -> None:
    model = _Net(_ScaledBlock())
    with pytest.warns(UserWarning, match="encoder.norm"):
        handle = attach_grad_sample(model, strict=False)
    handle.remove()


def test_vit_embedding_dropout_is_refused_and_the_suggested_fix_works() -> None:
    model = tiny_vit_classifier(dropout=0.1)
    with pytest.raises(UnsupportedModuleError) as error:
        validate_model(model)
    assert "vit.embeddings (ViTEmbeddings)" in str(error.value)
    assert "vit.embeddings.dropout.p = 0.0" in str(error.value)
    model.vit.embeddings.dropout.p = 0.0
    validate_model(model)  # dropout elsewhere is fine: Opacus sees the real activations and backprops


def test_gradient_checkpointing_is_refused() -> None:
    model = tiny_bert_classifier()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    with pytest.raises(UnsupportedModuleError, match="gradient checkpointing"):
        validate_model(model)


@pytest.mark.parametrize("attach", [attach_grad_sample, attach_fast_clipping], ids=["hooks", "ghost"])
def test_a_compiled_model_is_refused(attach) -> None:
    # Dynamo would trace the hooks (a graph break per layer, a recompile per batch size); untested records.
    with pytest.raises(UnsupportedModuleError, match=r"\(OptimizedModule\): it is compiled"):
        attach(torch.compile(tiny_bert_classifier()))


# --------------------------------------------------------------------------------------------------
# Runtime guards
# --------------------------------------------------------------------------------------------------


class _Shift(nn.Module):
    """No Opacus grad sampler (vmap fallback), and a second input the fallback would drop."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return (x + self.bias) * (1.0 if scale is None else scale)


class _ShiftNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shift = _Shift()

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.shift(x, scale=scale).sum(dim=1)


def test_vmap_fallback_module_with_extra_inputs_is_refused_at_forward() -> None:
    model = _ShiftNet()
    handle = attach_grad_sample(model)
    model(torch.randn(3, 4)).sum().backward()  # single positional input: the fallback is exact
    assert per_sample_gradients(model)["shift.bias"].shape == (3, 4)
    clear_grad_sample(model)
    with pytest.raises(UnsupportedModuleError, match=r"shift \(_Shift\).*keyword argument 'scale'"):
        model(torch.randn(3, 4), scale=torch.full((3, 1), 2.0))
    handle.remove()


class _Pair(nn.Module):
    """No Opacus grad sampler; returns a tuple, whose second tensor carries gradient only if ``both``."""

    def __init__(self, both: bool) -> None:
        super().__init__()
        self.gain, self.both = nn.Parameter(torch.linspace(0.5, 1.5, 4)), both

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * self.gain, (x * self.gain**2 if self.both else x.detach())


class _PairNet(nn.Module):
    def __init__(self, both: bool) -> None:
        super().__init__()
        self.pair = _Pair(both)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = self.pair(x)
        return (first.tanh() + second.sin()).sum(dim=1)


def test_vmap_fallback_replays_the_first_output_of_a_tuple_and_refuses_other_gradient() -> None:
    """Opacus's replay multiplied a returned tuple by the first output's gradient (PoolFormer's layers return
    ``(hidden_states,)``): a TypeError in the first backward. It now replays the first output; a tuple whose
    other outputs carry gradient too is refused at the forward (the replay would leave that part out)."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    model = _PairNet(both=False)
    reference = torch.stack([torch.autograd.grad(model(row[None]).sum(), model.pair.gain)[0] for row in x])
    handle = attach_grad_sample(model)
    model(x).sum().backward()
    torch.testing.assert_close(per_sample_gradients(model)["pair.gain"], reference, atol=ATOL, rtol=RTOL)
    handle.remove()
    model = _PairNet(both=True)
    handle = attach_grad_sample(model)
    with pytest.raises(
        UnsupportedModuleError, match=r"pair \(_Pair\).*other outputs that carry gradient.*\(gain:"
    ):
        model(x)
    handle.remove()


def test_multiple_choice_batch_folding_is_refused() -> None:
    from transformers import BertForMultipleChoice

    torch.manual_seed(0)
    model = BertForMultipleChoice(tiny_bert_config()).train()
    handle = attach_grad_sample(model)
    input_ids = torch.randint(3, TINY_VOCAB_SIZE, (BATCH_SIZE, 2, 8))
    # (found by the batch-dimension probe's first example alone: 2 choices folded into its batch of 1)
    with pytest.raises(PerSampleGradientError, match="batch size 2 inside a forward pass of batch size 1"):
        model(input_ids=input_ids)
    handle.remove()
    handle = attach_grad_sample(model, probe_batch_dimensions=False)
    with pytest.raises(PerSampleGradientError, match="batch size 8 inside a forward pass of batch size 4"):
        model(input_ids=input_ids)
    handle.remove()
    model(input_ids=input_ids)  # no state left behind by the failed call


@pytest.mark.parametrize("same_examples", [False, True])
def test_two_forward_passes_in_one_backward_are_refused(same_examples) -> None:
    """Opacus sums row i of both passes into one "example" (different batches: twice the sensitivity).

    The fast paths refuse this too, whichever examples the passes hold; so does the fallback."""
    model = tiny_gpt2_lm()  # tied embeddings: one forward uses the weight twice, which stays allowed
    handle = attach_grad_sample(model)
    first = tiny_text_batch(batch_size=4, seed=1)
    second = first if same_examples else tiny_text_batch(batch_size=3, seed=2)
    losses = [
        model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.sum()
        for b in (first, second)
    ]
    with pytest.raises(
        PerSampleGradientError, match="several forward passes were back-propagated in one backward"
    ):
        (losses[0] + losses[1]).backward()
    handle.clear()
    model(input_ids=first["input_ids"]).logits.sum().backward()  # one pass per backward: fine
    assert per_sample_gradients(model)["transformer.wte.weight"].shape[0] == 4
    handle.remove()


class _TwoHeads(nn.Module):
    """Two task heads over a frozen trunk: no trainable parameter is used by both tasks."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.head_a, self.head_b = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 1)
        self.trunk.requires_grad_(False)

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        return (self.head_a if task == "a" else self.head_b)(torch.tanh(self.trunk(x))).squeeze(-1)


@pytest.mark.parametrize("backward", ["together", "one after the other"])
def test_rows_of_different_forward_passes_are_never_clipped_as_one_example(backward) -> None:
    """Head A's row i and head B's row i were clipped as one "example" (3 counted for 6)."""
    torch.manual_seed(0)
    model = _TwoHeads()
    handle = attach_grad_sample(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = create_dp_optimizer(
        "dp-sgd", params, lr=1.0, noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=6
    )
    losses = [model(torch.randn(3, 4), "a").sum(), model(torch.randn(3, 4), "b").sum()]
    if backward == "together":
        (losses[0] + losses[1]).backward()
    else:
        losses[0].backward()
        losses[1].backward()
    with pytest.raises(RuntimeError, match="come from different forward passes"):
        optimizer.clip_and_accumulate()
    # One task per forward/backward pass, clipped after each: fine.
    for task in "ab":
        model(torch.randn(3, 4), task).sum().backward()
        assert optimizer.clip_and_accumulate().shape == (3,)
    handle.remove()


@pytest.mark.parametrize("same_batch", [False, True], ids=["two_batches", "one_batch_twice"])
def test_several_backward_passes_before_one_clip_are_refused(same_batch) -> None:
    """Opacus's list concatenates the passes' rows as different examples: one batch through two losses, each
    with its own forward and backward, counted each example twice (2x the bound, an own-loop audit). Two
    batches cannot be told from one batch twice, so the optimizer refuses both, as the fast path does."""
    model = tiny_bert_classifier()
    handle = attach_grad_sample(model)
    optimizer = create_dp_optimizer(
        "dp-sgd", model.parameters(), lr=1.0, noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=8
    )
    for seed in (1, 1) if same_batch else (1, 2):
        batch = tiny_text_batch(batch_size=4, seed=seed)
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        classification_losses(model, inputs, batch["labels"]).sum().backward()
    with pytest.raises(RuntimeError, match="come from 2 forward passes back-propagated before one clip"):
        optimizer.clip_and_accumulate()
    assert all(p.grad is None and getattr(p, "grad_sample", None) is None for p in model.parameters())
    assert optimizer.privatizer.num_microbatches == 0  # nothing accumulated
    handle.remove()


@pytest.mark.parametrize("how", ["eval mode", "second backward"])
def test_backward_without_recorded_inputs_says_why(how) -> None:
    """Opacus raised a bare IndexError ('pop from empty list')."""
    model = tiny_bert_classifier()
    handle = attach_grad_sample(model)
    if how == "eval mode":
        model.eval()
    loss = model(input_ids=tiny_text_batch()["input_ids"]).logits.sum()
    with pytest.raises(PerSampleGradientError, match="without its forward pass's inputs"):
        if how == "second backward":
            loss.backward(retain_graph=True)
        loss.backward()
    handle.remove()


class _ReadsWeightDirectly(nn.Module):
    """Uses ``linear.weight`` both through ``linear`` (hooked) and directly (invisible to hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + x @ self.linear.weight.T


def test_check_sums_catches_uses_the_hooks_cannot_see() -> None:
    model = _ReadsWeightDirectly()
    handle = attach_grad_sample(model)
    model(torch.randn(3, 4)).pow(2).sum().backward()
    assert per_sample_gradients(model)["linear.weight"].shape == (3, 4, 4)  # looks plausible...
    with pytest.raises(PerSampleGradientError, match="do not sum to .grad for: linear.weight"):
        per_sample_gradients(model, check_sums=True)  # ...but misses the direct use
    handle.remove()


def test_mean_loss_reduction_gives_the_same_per_example_gradients() -> None:
    batch = tiny_text_batch()
    per_reduction = {}
    for reduction in ("sum", "mean"):
        model = tiny_bert_classifier()
        handle = attach_grad_sample(model, loss_reduction=reduction)
        losses = classification_losses(model, _text_inputs(batch), batch["labels"])
        (losses.sum() if reduction == "sum" else losses.mean()).backward()
        per_reduction[reduction] = handle.per_sample_gradients(check_sums=reduction == "sum")
        handle.remove()
    for name, grads in per_reduction["sum"].items():
        torch.testing.assert_close(per_reduction["mean"][name], grads, atol=ATOL, rtol=RTOL)


def test_peft_lora_trains_only_adapters_and_the_modules_to_save_copy() -> None:
    model = lora_bert()
    handle = attach_grad_sample(model)
    batch = tiny_text_batch()
    classification_losses(model, _text_inputs(batch), batch["labels"]).sum().backward()
    grads = handle.per_sample_gradients(check_sums=True)
    assert any(".lora_A.default." in name for name in grads)
    assert any(".lora_B.default." in name for name in grads)
    assert {name for name in grads if "classifier" in name} == {
        "base_model.model.classifier.modules_to_save.default.weight",
        "base_model.model.classifier.modules_to_save.default.bias",
    }  # the trained copy, not the frozen original_module
    assert not any(".query.base_layer." in name or "embeddings" in name for name in grads)
    handle.remove()


def test_changing_the_trainable_set_after_attaching_is_refused() -> None:
    """E.g. get_peft_model() applied to a model that was already attached: re-attach instead."""
    from peft import LoraConfig, get_peft_model

    base_model = tiny_bert_classifier()
    stale_handle = attach_grad_sample(base_model)
    peft_model = get_peft_model(base_model, LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query"]))
    batch = tiny_text_batch()
    with pytest.raises(PerSampleGradientError, match="trainable parameters of the model changed"):
        peft_model(input_ids=batch["input_ids"])
    stale_handle.remove()
    # PEFT deep-copied the hooked classifier into modules_to_save, hooks included: refuse to reuse it.
    with pytest.raises(
        UnsupportedModuleError, match=r"modules_to_save\.default \(Linear\).*Opacus grad-sample hooks"
    ):
        attach_grad_sample(peft_model)


def test_attaching_twice_is_refused() -> None:
    model = tiny_bert_classifier()
    handle = attach_grad_sample(model)
    with pytest.raises(UnsupportedModuleError, match="already carries Opacus grad-sample hooks"):
        attach_grad_sample(model)
    handle.remove()
    attach_grad_sample(model).remove()


def test_padding_row_gets_no_per_example_gradient() -> None:
    """Padding positions whose outputs *are* used: Opacus alone would fill weight[padding_idx]."""
    model = nn.Sequential(nn.Embedding(10, 3, padding_idx=0), nn.Flatten(), nn.Linear(15, 1))
    handle = attach_grad_sample(model)
    input_ids = torch.tensor([[1, 2, 0, 0, 0], [3, 0, 4, 5, 0], [6, 7, 8, 9, 1]])
    model(input_ids).sum().backward()
    weight = model[0].weight
    assert torch.all(weight.grad_sample[:, 0] == 0)
    torch.testing.assert_close(weight.grad_sample.sum(0), weight.grad)
    handle.remove()


# --------------------------------------------------------------------------------------------------
# Handle: original model, hooks on/off/removed, accumulation
# --------------------------------------------------------------------------------------------------


def _hook_counts(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()
    )


def _classification_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    F.cross_entropy(logits, batch["labels"], reduction="sum").backward()


def test_original_model_is_hooked_in_place_and_stays_saveable(tmp_path) -> None:
    model = tiny_bert_classifier()
    state_keys = list(model.state_dict())
    handle = attach_grad_sample(model)
    assert handle.model is model and handle.grad_sample_module._module is model
    assert list(model.state_dict()) == state_keys  # no "_module." prefix: Trainer/PEFT see the same model
    _classification_step(model, tiny_text_batch())  # calling the original model fires the hooks
    assert model.classifier.weight.grad_sample.shape == (BATCH_SIZE, TINY_NUM_LABELS, 32)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists()
    handle.remove()


def test_hooks_can_be_disabled_enabled_and_removed() -> None:
    model = tiny_bert_classifier()
    batch = tiny_text_batch()
    hooks_before = _hook_counts(model)

    handle = attach_grad_sample(model)
    assert _hook_counts(model) > hooks_before
    handle.disable_hooks()
    _classification_step(model, batch)
    assert model.classifier.weight.grad_sample is None
    with pytest.raises(PerSampleGradientError, match="no .grad_sample"):
        per_sample_gradients(model)

    handle.enable_hooks()
    model.zero_grad()
    _classification_step(model, batch)
    first = {name: g.clone() for name, g in per_sample_gradients(model).items()}

    handle.remove()
    assert _hook_counts(model) == hooks_before
    assert not hasattr(model, "autograd_grad_sample_hooks")
    model.zero_grad()
    _classification_step(model, batch)
    assert all(not hasattr(p, "grad_sample") for p in model.parameters())
    with pytest.raises(RuntimeError, match="removed"):
        handle.enable_hooks()

    with attach_grad_sample(model) as second_handle:  # re-attaching after removal works
        model.zero_grad()
        _classification_step(model, batch)
        for name, grads in second_handle.per_sample_gradients().items():
            torch.testing.assert_close(grads, first[name])
    assert _hook_counts(model) == hooks_before


def test_backward_twice_stores_a_list_that_is_concatenated_until_cleared() -> None:
    model = tiny_bert_classifier()
    first_batch, second_batch = tiny_text_batch(seed=1), tiny_text_batch(seed=2)
    handle = attach_grad_sample(model)
    _classification_step(model, first_batch)
    first = {name: g.clone() for name, g in handle.per_sample_gradients().items()}
    handle.clear()
    _classification_step(model, second_batch)
    second = {name: g.clone() for name, g in handle.per_sample_gradients().items()}

    handle.clear()
    _classification_step(model, first_batch)
    _classification_step(model, second_batch)
    assert isinstance(model.classifier.weight.grad_sample, list)
    accumulated = handle.per_sample_gradients()
    for name, grads in accumulated.items():
        torch.testing.assert_close(grads, torch.cat([first[name], second[name]]))

    handle.clear()
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    handle.remove()


def test_forward_without_backward_is_forgotten_by_clear() -> None:
    model = tiny_bert_classifier()
    batch = tiny_text_batch()
    handle = attach_grad_sample(model)
    model(input_ids=batch["input_ids"])  # e.g. a training-mode forward used only for a metric
    handle.clear()
    _classification_step(model, batch)
    grads = handle.per_sample_gradients()
    torch.testing.assert_close(grads["classifier.weight"].sum(0), model.classifier.weight.grad)
    handle.remove()


# --------------------------------------------------------------------------------------------------
# Plain Opacus users also get the ViT/DeiT samplers (they are registered globally)
# --------------------------------------------------------------------------------------------------


def test_plain_opacus_grad_sample_module_uses_the_registered_vit_sampler() -> None:
    model = tiny_vit_classifier()
    batch = tiny_image_batch()
    reference = loop_reference(
        Case(model, {"pixel_values": batch["pixel_values"]}, batch["labels"], classification_losses)
    )
    grad_sample_module = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    assert "vit.embeddings.patch_embeddings.projection" in dict(model.named_modules())
    hooked_types = {type(m).__name__ for m in grad_sample_module.iterate_submodules(model)}
    assert {"ViTEmbeddings", "Conv2d"} <= hooked_types  # the patch projection is hooked on its own
    classification_losses(model, {"pixel_values": batch["pixel_values"]}, batch["labels"]).sum().backward()
    for name in ("cls_token", "position_embeddings"):
        parameter = getattr(model.vit.embeddings, name)
        torch.testing.assert_close(
            parameter.grad_sample, reference[f"vit.embeddings.{name}"], atol=ATOL, rtol=RTOL
        )
    grad_sample_module.cleanup()
