"""The Opacus-hooks fallback refuses gradients its hooks did not see, like the fast paths do.

Opacus's per-sample hooks (:func:`dp_hf.grad_sample.attach_grad_sample`, which DPTrainer uses for
models with modules the fast paths of :mod:`dp_hf.ghost` lack) only see a
parameter's uses inside its own module's ``forward``. A parent calling
``F.linear(x, self.child.weight)``, or a weight shared with a functional call, adds gradient that
``p.grad_sample`` misses; the DP optimizers must refuse it (``sum_i grad_sample[i] != p.grad``)
instead of clipping an incomplete per-example gradient. Complete cases (module-level tied
weights, Llama through the vmap fallback, bf16, several backward passes, mean reduction) must
still pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dp_training import classification_data, dp_args
from test_grad_sample import CASES as GRAD_SAMPLE_CASES
from tiny_models import tiny_bert_mlm, tiny_gpt2_lm, tiny_llama_lm, tiny_text_batch
from torch import nn

from dp_hf import DPTrainer
from dp_hf.optim import DPSGD, create_dp_optimizer
from dp_hf.per_example import (
    attach_grad_sample,
    per_sample_gradients,
    resolve_per_sample_gradient_mode,
    unsupported_modules,
)

BATCH = 4


def _optimizer(model: nn.Module, name: str = "dp-sgd", **overrides):
    kwargs = dict(lr=0.1, noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=BATCH, noise_seed=0)
    if name.startswith("dp-macadam"):
        kwargs.pop("max_grad_norm")
    kwargs.update(overrides)
    return create_dp_optimizer(name, [p for p in model.parameters() if p.requires_grad], **kwargs)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------------------------------
# Models with uses of a weight outside its module's forward
# --------------------------------------------------------------------------------------------------


class _Gain(nn.Module):
    """A raw trainable scale: no fast-path rule (DPTrainer falls back to Opacus's hooks)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class _ParentReadsChildWeight(nn.Module):
    """``child`` is called as a module *and* its weight is read by the parent's ``F.linear``."""

    def __init__(self, outside_use: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.child = nn.Linear(6, 6)
        self.gain = _Gain(6)
        self.head = nn.Linear(6, 3)
        self.outside_use = outside_use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.child(x)
        if self.outside_use:
            h = h + F.linear(torch.tanh(x), self.child.weight)  # invisible to the hooks
        return self.head(torch.tanh(self.gain(h)))


class _FunctionalTiedHead(nn.Module):
    """Input embeddings reused as the output projection through ``F.linear`` (no output module)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(20, 8)
        self.norm = _Gain(8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.embed(ids))).mean(dim=1)
        return F.linear(h, self.embed.weight)  # logits [B, 20]: gradient to embed.weight, unhooked


def _single_model_batch(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    if isinstance(model, _FunctionalTiedHead):
        return torch.randint(0, 20, (BATCH, 5), generator=generator), torch.randint(0, 20, (BATCH,))
    return torch.randn(BATCH, 6, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator)


def _backward(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    F.cross_entropy(model(inputs), targets, reduction="sum").backward()


@pytest.mark.parametrize("optimizer_name", ["dp-sgd", "dp-adamw", "dp-macadam"])
@pytest.mark.parametrize(
    ("make_model", "culprit"),
    [(_ParentReadsChildWeight, "'child.weight'"), (_FunctionalTiedHead, "'embed.weight'")],
    ids=["parent_reads_child_weight", "functional_tied_head"],
)
def test_weight_used_outside_its_module_is_refused(make_model, culprit, optimizer_name) -> None:
    model = make_model()
    handle = attach_grad_sample(model)
    optimizer = _optimizer(model, optimizer_name)
    before = _snapshot(model)
    inputs, targets = _single_model_batch(model)
    _backward(model, inputs, targets)
    weight = dict(model.named_parameters())[culprit.strip("'")]
    missed = (
        per_sample_gradients(model)[culprit.strip("'")].sum(0) - weight.grad
    ).norm() / weight.grad.norm()
    assert missed > 0.05  # the hooks really missed part of the gradient (the bug being guarded)

    with pytest.raises(RuntimeError, match=rf"do not sum to p\.grad.*{culprit}.*freeze it") as error:
        optimizer.clip_and_accumulate()
    assert "outside that module's own forward" in str(error.value)
    # Nothing accumulated, the unclipped gradient is gone, nothing was updated.
    assert optimizer.privatizer.num_microbatches == 0
    assert all(p.grad is None and p.grad_sample is None for p in model.parameters())
    assert optimizer.dp_step == 0

    # step() without an explicit clip_and_accumulate() refuses the same way, before any update.
    _backward(model, inputs, targets)
    with pytest.raises(RuntimeError, match=culprit):
        optimizer.step()
    assert optimizer.dp_step == 0
    for name, value in _snapshot(model).items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)
    handle.remove()


def test_refused_with_several_backward_passes_and_in_bf16() -> None:
    # Two backward passes before clipping (Opacus keeps a list; p.grad accumulates both): refused as such.
    model = _ParentReadsChildWeight()
    handle = attach_grad_sample(model)
    optimizer = _optimizer(model)
    inputs, targets = _single_model_batch(model)
    _backward(model, inputs[:2], targets[:2])
    _backward(model, inputs[2:], targets[2:])
    assert isinstance(model.child.weight.grad_sample, list)
    with pytest.raises(RuntimeError, match="2 forward passes back-propagated before one clip"):
        optimizer.clip_and_accumulate()
    handle.remove()

    # bf16 weights: the tolerance is looser, but a missed use is far above it.
    model = _ParentReadsChildWeight().to(torch.bfloat16)
    handle = attach_grad_sample(model)
    optimizer = _optimizer(model)
    _backward(model, inputs.to(torch.bfloat16), targets)
    with pytest.raises(RuntimeError, match="'child.weight'"):
        optimizer.clip_and_accumulate()
    handle.remove()


def test_the_same_model_without_the_outside_use_is_accepted() -> None:
    model = _ParentReadsChildWeight(outside_use=False)
    handle = attach_grad_sample(model)
    optimizer = _optimizer(model)
    _backward(model, *_single_model_batch(model))
    assert optimizer.clip_and_accumulate() is not None
    optimizer.step()
    assert optimizer.dp_step == 1
    handle.remove()


def test_the_message_falls_back_to_the_index_without_a_name() -> None:
    """Plain Opacus hooks (no dp_hf handle): the parameter is named by its index and shape."""
    from opacus.grad_sample import GradSampleModule

    model = _ParentReadsChildWeight()
    grad_sample_module = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    optimizer = _optimizer(model)
    _backward(model, *_single_model_batch(model))
    with pytest.raises(RuntimeError, match=r"#0 \(shape \(6, 6\)\)"):
        optimizer.clip_and_accumulate()
    grad_sample_module.cleanup()


# --------------------------------------------------------------------------------------------------
# Complete per-example gradients pass: Llama through the fallback, tied weights
# --------------------------------------------------------------------------------------------------


def _tiny_llama(**overrides) -> nn.Module:
    # tiny_models' Llama at the sizes these tests were written for.
    return tiny_llama_lm(**{"vocab_size": 32, "hidden_size": 16, "intermediate_size": 24, **overrides})


def _lm_batch(seed: int = 0, batch: int = BATCH, length: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 32, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # some padding
    return ids, mask


def _lm_losses(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    token_losses = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return token_losses.sum(dim=1) / (labels != -100).sum(dim=1)


def _loop_reference(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = {n: [] for n in params}
    for i in range(ids.shape[0]):
        model.zero_grad(set_to_none=True)
        _lm_losses(model, ids[i : i + 1], mask[i : i + 1]).sum().backward()
        for n, p in params.items():
            rows[n].append(p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(r) for n, r in rows.items()}


def test_tiny_llama_through_the_fallback_matches_a_single_example_loop() -> None:
    model = _tiny_llama()
    # RMSNorm has a fast rule now (DPTrainer takes the fast path); the Opacus hooks, still the path of
    # models with an unsupported module, must stay exact on it (vmap fallback for LlamaRMSNorm)
    assert not unsupported_modules(model)
    assert resolve_per_sample_gradient_mode("auto", DPSGD, model) == ("ghost", True)
    ids, mask = _lm_batch()
    reference = _loop_reference(model, ids, mask)
    before = _snapshot(model)

    handle = attach_grad_sample(model)
    clip, lr = 0.5, 1.0
    optimizer = _optimizer(model, lr=lr, max_grad_norm=clip)
    _lm_losses(model, ids, mask).sum().backward()
    grads = per_sample_gradients(model)
    for name, per_example in reference.items():
        torch.testing.assert_close(grads[name], per_example, atol=1e-5, rtol=1e-4, msg=name)
    assert all(p.grad is not None for p in model.parameters())  # the check compares, not skipped
    norms = optimizer.clip_and_accumulate()
    optimizer.step()

    flat = torch.cat([g.reshape(BATCH, -1) for g in reference.values()], dim=1)
    torch.testing.assert_close(norms, flat.norm(dim=1), atol=1e-5, rtol=1e-4)
    factors = (clip / flat.norm(dim=1)).clamp(max=1.0)
    for name, p in model.named_parameters():
        expected = before[name] - lr * torch.einsum("i,i...->...", factors, reference[name]) / BATCH
        torch.testing.assert_close(p.detach(), expected, atol=1e-6, rtol=1e-5, msg=name)
    handle.remove()


@pytest.mark.parametrize("variant", ["mean_reduction", "bf16_autocast", "bf16_weights"])
def test_tiny_llama_complete_gradients_pass_the_check(variant: str) -> None:
    model = _tiny_llama()
    ids, mask = _lm_batch(seed=1)
    if variant == "bf16_weights":
        model.to(torch.bfloat16)
    handle = attach_grad_sample(model, loss_reduction="mean" if variant == "mean_reduction" else "sum")
    optimizer = _optimizer(model, "dp-adamw")
    for _ in range(2):
        if variant == "mean_reduction":
            _lm_losses(model, ids, mask).mean().backward()
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "bf16_autocast"):
                losses = _lm_losses(model, ids, mask)
            losses.sum().backward()
        assert model.lm_head.weight.grad is not None
        norms = optimizer.clip_and_accumulate()
        assert norms.shape == (BATCH,)
        optimizer.step()
        optimizer.zero_grad()
    assert optimizer.dp_step == 2
    handle.remove()


@pytest.mark.parametrize("family", ["bert_mlm", "gpt2_lm", "llama_tied"])
def test_tied_input_and_output_embeddings_pass_the_check(family: str) -> None:
    """Module-level ties: Opacus accumulates per-example gradients from both modules (complete)."""
    batch = tiny_text_batch(seed=5)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if family == "bert_mlm":
        model = tiny_bert_mlm(seed=1)
    elif family == "gpt2_lm":
        model = tiny_gpt2_lm(seed=1)
    else:
        model = _tiny_llama(tie_word_embeddings=True, vocab_size=64)
    tied = model.get_output_embeddings().weight
    assert tied is model.get_input_embeddings().weight
    handle = attach_grad_sample(model)
    optimizer = _optimizer(model, "dp-sgd", expected_batch_size=ids.shape[0])
    for _ in range(2):  # the second step starts from the first step's released p.grad, then zero_grad
        logits = model(input_ids=ids, attention_mask=mask).logits
        F.cross_entropy(logits.transpose(1, 2), ids, reduction="none").mean(dim=1).sum().backward()
        grad = tied.grad.clone()
        total = tied.grad_sample.sum(0)
        torch.testing.assert_close(total, grad, atol=1e-5, rtol=1e-4)  # complete: both uses hooked
        assert optimizer.clip_and_accumulate() is not None
        optimizer.step()
        optimizer.zero_grad()
    handle.remove()


def test_hand_set_per_example_gradients_after_a_step_are_not_compared() -> None:
    """p.grad left by step() (no zero_grad, no backward since) is not autograd's: nothing to compare."""
    p = nn.Parameter(torch.zeros(3))
    optimizer = DPSGD([p], lr=0.1, noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=2)
    for _ in range(2):
        p.grad_sample = torch.randn(2, 3)
        optimizer.step()
    assert optimizer.dp_step == 2
    # A backward pass accumulating into that p.grad is compared (and, here, refused).
    p.grad_sample = torch.randn(2, 3)
    p.grad.add_(1.0)
    with pytest.raises(RuntimeError, match="do not sum to p.grad"):
        optimizer.step()


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("case_name", list(GRAD_SAMPLE_CASES))
def test_every_hugging_face_case_passes_the_check(case_name: str, autocast: bool) -> None:
    """BERT/RoBERTa/GPT-2/Llama/ViT/DeiT/LoRA, broadcast position ids, masked/interpolated ViT/DeiT."""
    case = GRAD_SAMPLE_CASES[case_name]()
    handle = attach_grad_sample(case.model)
    optimizer = _optimizer(case.model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        losses = case.per_example_losses(case.model, case.inputs, case.targets)
    losses.float().sum().backward()
    assert all(p.grad is not None for p in optimizer.trainable_params())  # compared, not skipped
    assert optimizer.clip_and_accumulate() is not None
    handle.remove()


def test_a_backward_pass_without_hooks_is_refused_not_dropped() -> None:
    """A micro-batch back-propagated with the hooks disabled would silently vanish from the step."""
    model = _ParentReadsChildWeight(outside_use=False)
    handle = attach_grad_sample(model)
    optimizer = _optimizer(model)
    inputs, targets = _single_model_batch(model)
    _backward(model, inputs[:2], targets[:2])
    optimizer.clip_and_accumulate()
    handle.disable_hooks()
    _backward(model, inputs[2:], targets[2:])
    with pytest.raises(RuntimeError, match="no per-example gradients.*without per-sample hooks"):
        optimizer.clip_and_accumulate()
    _backward(model, inputs[2:], targets[2:])
    with pytest.raises(RuntimeError, match="without per-sample hooks"):
        optimizer.step()
    assert optimizer.dp_step == 0 and all(p.grad is None for p in model.parameters())
    # Zeros (zero_grad(set_to_none=False)) and an empty micro-batch are fine.
    _backward(model, inputs[2:], targets[2:])
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    optimizer.step()
    assert optimizer.dp_step == 1
    handle.remove()


# --------------------------------------------------------------------------------------------------
# Black box: DPTrainer on the fallback path
# --------------------------------------------------------------------------------------------------


class _TinyClassifier(nn.Module):
    """Token classifier with a ``_Gain`` (no fast-path rule) and optionally a functional reuse of its head."""

    def __init__(self, outside_use: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(40, 16)
        self.gain = _Gain(16)
        self.head = nn.Linear(16, 2)
        self.outside_use = outside_use

    def forward(self, input_ids: torch.Tensor, attention_mask=None, labels=None) -> dict:
        # ``labels`` in the signature keeps the Trainer from dropping that column; DPTrainer pops it.
        h = torch.tanh(self.gain(self.embed(input_ids))).mean(dim=1)
        logits = self.head(h)
        if self.outside_use:
            logits = logits + F.linear(h * h, self.head.weight)
        return {"logits": logits}


def _per_example_cross_entropy(outputs, labels, inputs) -> torch.Tensor:
    return F.cross_entropy(outputs["logits"], labels, reduction="none")


@pytest.mark.parametrize("outside_use", [True, False], ids=["outside_use", "control"])
def test_dp_trainer_fallback_refuses_before_the_first_step(tmp_path, outside_use: bool) -> None:
    model = _TinyClassifier(outside_use)
    before = _snapshot(model)
    trainer = DPTrainer(
        model=model,
        args=dp_args(tmp_path, max_steps=2, per_device_train_batch_size=8, gradient_accumulation_steps=2),
        train_dataset=classification_data(64),
        per_example_loss_fn=_per_example_cross_entropy,
    )
    assert trainer.fast_clipping is None and trainer.grad_sample_handle is not None  # the Opacus fallback
    if not outside_use:
        trainer.train()
        assert trainer.dp_optimizer.dp_step == 2
        return
    with pytest.raises(RuntimeError, match=r"do not sum to p\.grad.*'head\.weight'"):
        trainer.train()
    assert trainer.dp_optimizer.dp_step == 0
    for name, value in _snapshot(model).items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)


class _EditsOutputInPlace(_TinyClassifier):
    """Adds to its head's output in place (as Falcon's `mlp_output += ...`, wav2vec2's `h[~mask] = 0`)."""

    def forward(self, input_ids: torch.Tensor, attention_mask=None, labels=None) -> dict:
        logits = self.head(torch.tanh(self.gain(self.embed(input_ids))).mean(dim=1))
        logits += 1.0
        return {"logits": logits}


def _refused_at_the_first_step(model: nn.Module, tmp_path, message: str) -> None:
    trainer = DPTrainer(
        model=model,
        args=dp_args(tmp_path, max_steps=1, per_device_train_batch_size=8),
        train_dataset=classification_data(32),
        per_example_loss_fn=_per_example_cross_entropy,
    )
    with pytest.raises(RuntimeError, match=message):
        trainer.train()
    assert trainer.dp_optimizer.dp_step == 0


def test_an_in_place_edit_of_a_hooked_output_is_explained(tmp_path) -> None:
    """Opacus's backward hooks forbid it; the error says so and names the modules to freeze, not autograd's view rules."""
    _refused_at_the_first_step(
        _EditsOutputInPlace(outside_use=False),
        tmp_path,
        r"edits a layer's output in place.*no fast per-example rule: gain \(_Gain\)\. Freeze",
    )


class _RandomGain(_Gain):
    """A raw scale (Opacus's vmap fallback) that draws a random mask, as ViTMAE's embeddings do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain * (torch.rand(x.shape[-1]) > 0.1)


def test_a_random_draw_in_a_replayed_module_is_explained(tmp_path) -> None:
    model = _TinyClassifier(outside_use=False)
    model.gain = _RandomGain(16)
    _refused_at_the_first_step(
        model, tmp_path, r"draws random numbers.*on that fallback: gain \(_RandomGain\)\. Freeze"
    )
