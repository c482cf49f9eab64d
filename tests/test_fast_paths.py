"""Fast per-example clipping (dp_hf.ghost) against the materialized reference (Opacus hooks + clip_and_sum).

The reference is the path every optimizer used before: :func:`dp_hf.grad_sample.attach_grad_sample`
writes ``p.grad_sample`` and :func:`dp_hf.privatizer.clip_and_sum` clips and sums. The fast paths
must give the same clipped sums (to 1e-5) and norms, for examples clipped (norm > C) and not
(norm < C), on every tiny architecture: BERT (broadcast position ids, padding rows), BERT-MLM
(decoder tied to the word embeddings, tied bias), GPT-2 (Conv1D, tied LM head), ViT and DeiT (raw
cls/distillation/position parameters, patch Conv2d), LoRA on BERT and on ViT, and full fine-tuning of
Llama and Qwen2 (RMSNorm weights: Opacus's functorch fallback is the reference there).
"""

from __future__ import annotations

from functools import partial

import datasets
import pytest
import torch
import torch.nn.functional as F
from tiny_models import (
    SquaredRMSNorm,
    freeze_all_but,
    lora_bert,
    tiny_bert_classifier,
    tiny_bert_mlm,
    tiny_clip_vision_classifier,
    tiny_data2vec_vision_classifier,
    tiny_deit_classifier,
    tiny_gpt2_lm,
    tiny_image_batch,
    tiny_llama_lm,
    tiny_text_batch,
    tiny_vit_classifier,
)
from torch import nn

import dp_hf.per_example.ghost as ghost
from dp_hf import DPTrainer, DPTrainingArguments
from dp_hf.optim import DPAdamW, get_optimizer_class
from dp_hf.per_example import (
    UnsupportedModuleError,
    attach_fast_clipping,
    attach_grad_sample,
    has_identity_geometry,
    resolve_per_sample_gradient_mode,
)
from dp_hf.per_example.errors import PerSampleGradientError
from dp_hf.per_example.ghost.support import native_kind
from dp_hf.privatizer import Geometry, clip_and_sum

BATCH = 6


def lora_vit():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        modules_to_save=["classifier"],
        init_lora_weights=False,
    )
    torch.manual_seed(1)
    return get_peft_model(tiny_vit_classifier(), config).train()


def tiny_qwen2_lm():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).train()


# name -> (factory, loss kind)
MODELS = {
    "bert": (tiny_bert_classifier, "classify"),
    "bert_mlm_tied": (tiny_bert_mlm, "masked_lm"),
    "gpt2_tied": (tiny_gpt2_lm, "causal_lm"),
    "vit": (tiny_vit_classifier, "image"),
    "deit": (tiny_deit_classifier, "image"),
    "lora_bert": (lora_bert, "classify"),
    "lora_vit": (lora_vit, "image"),
    "llama_full": (tiny_llama_lm, "causal_lm"),  # RMSNorm weights trainable (hook mode)
    "qwen2_full_tied": (tiny_qwen2_lm, "causal_lm"),
    # embeddings returning (x, patch grid); layer scale off (the reference, Opacus's hooks, has no rule for it)
    "data2vec_vision": (partial(tiny_data2vec_vision_classifier, layer_scale=False), "image"),
    "clip_vision": (tiny_clip_vision_classifier, "image"),  # class_embedding beside a position_ids buffer
}


def per_example_losses(model, kind: str) -> torch.Tensor:
    if kind == "image":
        batch = tiny_image_batch(batch_size=BATCH)
        logits = model(pixel_values=batch["pixel_values"]).logits
        return F.cross_entropy(logits, batch["labels"], reduction="none")
    batch = tiny_text_batch(batch_size=BATCH)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    if kind == "classify":
        return F.cross_entropy(logits, batch["labels"], reduction="none")
    labels = batch["lm_labels"]
    if kind == "causal_lm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    token_losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    return token_losses.sum(dim=1)


def trainable(model) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def reference_grad_samples(name: str) -> list[torch.Tensor]:
    factory, kind = MODELS[name]
    model = factory()
    handle = attach_grad_sample(model)
    per_example_losses(model, kind).sum().backward()
    samples = [p.grad_sample for p in trainable(model)]
    handle.remove()
    return samples


def fast_clipped_sum(name: str, geometry: Geometry, **options):
    factory, kind = MODELS[name]
    model = factory()
    clipping = attach_fast_clipping(model, **options)
    per_example_losses(model, kind).sum().backward()
    params = trainable(model)
    assert all(p.grad is None for p in params if id(p) in clipping._native_params)  # no weight gradients
    result = clipping.clipped_sum(params, geometry)
    clipping.remove()
    return result


def assert_sums_close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for k, (a, b) in enumerate(zip(actual, expected)):
        assert a.shape == b.shape, k
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"tensor #{k}: {m}")


def clip_between(norms: torch.Tensor) -> float:
    """A clip norm with examples on both sides of it."""
    ordered = norms.sort().values
    return float(ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2


@pytest.fixture(scope="module")
def references():
    return {name: reference_grad_samples(name) for name in MODELS}


@pytest.mark.parametrize("layer_strategy", ["auto", "ghost", "materialize"])
@pytest.mark.parametrize("name", list(MODELS))
def test_ghost_clipped_sum_matches_materialized(references, name, layer_strategy):
    samples = references[name]
    _, unclipped_norms = clip_and_sum(samples, Geometry(float("inf")))
    clip = clip_between(unclipped_norms)
    assert (unclipped_norms < clip).any() and (unclipped_norms > clip).any()  # factor 1 and factor C/||g||
    expected_sums, expected_norms = clip_and_sum(samples, Geometry(clip))

    sums, norms = fast_clipped_sum(name, Geometry(clip), mode="ghost", layer_strategy=layer_strategy)
    torch.testing.assert_close(norms, expected_norms, rtol=1e-5, atol=1e-6)
    assert_sums_close(sums, expected_sums)


@pytest.mark.parametrize("name", list(MODELS))
def test_layerwise_materialization_in_an_adaptive_geometry(references, name):
    """DP-MacAdam / scale-then-privatize geometry: w_i = (g_i - c) / s, with some tensors left identity."""
    samples = references[name]
    generator = torch.Generator().manual_seed(0)
    shapes = [g.shape[1:] for g in samples]
    shift = [0.01 * torch.randn(s, generator=generator) if k % 3 else None for k, s in enumerate(shapes)]
    scale = [torch.rand(s, generator=generator) + 0.5 if k % 2 else None for k, s in enumerate(shapes)]
    _, unclipped_norms = clip_and_sum(samples, Geometry(float("inf"), shift, scale))
    geometry = Geometry(clip_between(unclipped_norms), shift, scale)
    expected_sums, expected_norms = clip_and_sum(samples, geometry)

    # A tiny chunk budget: per-example gradients are formed a few examples at a time.
    sums, norms = fast_clipped_sum(name, geometry, mode="materialize", chunk_bytes=4096)
    torch.testing.assert_close(norms, expected_norms, rtol=1e-5, atol=1e-6)
    assert_sums_close(sums, expected_sums)


def test_unused_parameter_still_counts_in_an_adaptive_geometry():
    """A tensor without gradient has w_i = -c/s for every example; the reference says so too."""
    model = freeze_all_but(tiny_bert_classifier(), ["bert.encoder.layer.1", "bert.pooler", "classifier"])
    extra = torch.nn.Parameter(torch.zeros(3))
    params = [*trainable(model), extra]
    shift = [None] * (len(params) - 1) + [torch.tensor([0.5, -0.25, 1.0])]
    handle = attach_grad_sample(model)
    per_example_losses(model, "classify").sum().backward()
    samples = [getattr(p, "grad_sample", None) for p in params]
    handle.remove()
    geometry = Geometry(0.5, shift)
    expected_sums, expected_norms = clip_and_sum(samples, geometry, [p.shape for p in params])

    model = freeze_all_but(tiny_bert_classifier(), ["bert.encoder.layer.1", "bert.pooler", "classifier"])
    clipping = attach_fast_clipping(model, mode="materialize")
    per_example_losses(model, "classify").sum().backward()
    sums, norms = clipping.clipped_sum([*trainable(model), extra], geometry)
    torch.testing.assert_close(norms, expected_norms, rtol=1e-5, atol=1e-6)
    assert_sums_close(sums, expected_sums)


def test_ghost_mode_refuses_an_adaptive_geometry():
    model = tiny_bert_classifier()
    clipping = attach_fast_clipping(model, mode="ghost")
    per_example_losses(model, "classify").sum().backward()
    params = trainable(model)
    with pytest.raises(ValueError, match="identity geometry"):
        clipping.clipped_sum(params, Geometry(1.0, scale=[torch.ones(p.shape) for p in params]))


def test_gradient_outside_the_hooked_modules_is_refused():
    model = tiny_bert_classifier()
    clipping = attach_fast_clipping(model)
    losses = per_example_losses(model, "classify")
    # The word embeddings used once more, directly: no hook sees it, so it cannot be clipped per example.
    (losses.sum() + model.bert.embeddings.word_embeddings.weight.sum()).backward()
    with pytest.raises(
        RuntimeError, match="'bert.embeddings.word_embeddings.weight' .* outside the hooked modules"
    ):
        clipping.clipped_sum(trainable(model), Geometry(1.0))


def test_two_forward_passes_before_clipping_are_refused():
    """Row i of two different batches is not one example: merging them would double the sensitivity."""
    model = tiny_bert_classifier()
    clipping = attach_fast_clipping(model)
    per_example_losses(model, "classify").sum().backward()
    per_example_losses(model, "classify").sum().backward()
    with pytest.raises(RuntimeError, match="2 forward passes"):
        clipping.clipped_sum(trainable(model), Geometry(1.0))


def test_raw_vit_parameter_used_outside_its_embeddings_is_refused():
    model = tiny_vit_classifier()
    clipping = attach_fast_clipping(model)
    losses = per_example_losses(model, "image")
    (losses.sum() + model.vit.embeddings.cls_token.sum()).backward()
    with pytest.raises(RuntimeError, match="'vit.embeddings.cls_token' .* outside the hooked modules"):
        clipping.clipped_sum(trainable(model), Geometry(1.0))


def test_remove_restores_plain_modules():
    model = tiny_gpt2_lm()
    clipping = attach_fast_clipping(model)
    clipping.remove()
    assert not any("forward" in m.__dict__ for m in model.modules())
    per_example_losses(model, "causal_lm").sum().backward()
    assert all(p.grad is not None for p in trainable(model))


@pytest.mark.parametrize(
    ("optimizer", "identity"),
    [
        ("dp-sgd", True),
        ("dp-adam", True),
        ("dp-adamw", True),
        ("dp-adamw-bc", True),
        ("dp-microadam", True),
        ("dp-macadam", False),
        ("dp-macadam-bc", False),
        ("dp-adam-stp", False),
        ("dp-adamw-stp", False),
    ],
)
def test_identity_geometry_flag(optimizer, identity):
    cls = get_optimizer_class(optimizer)
    assert has_identity_geometry(cls) is identity
    mode, fast = resolve_per_sample_gradient_mode("auto", cls, tiny_bert_classifier())
    assert (mode, fast) == ("ghost" if identity else "materialize", True)


def test_an_overridden_geometry_without_the_flag_is_not_ghost():
    class Adaptive(DPAdamW):
        def geometry(self, params):
            return Geometry(self.max_grad_norm, scale=[torch.ones_like(p) for p in params])

    assert not has_identity_geometry(Adaptive)
    with pytest.raises(ValueError, match="identity geometry"):
        resolve_per_sample_gradient_mode("ghost", Adaptive, tiny_bert_classifier())


def with_squared_norm(model):
    model.model.norm = SquaredRMSNorm(model.config.hidden_size)
    return model


def test_unsupported_modules_fall_back_to_opacus_hooks():
    assert resolve_per_sample_gradient_mode("auto", DPAdamW, tiny_llama_lm()) == ("ghost", True)  # RMSNorm
    model = with_squared_norm(tiny_llama_lm())  # no fast rule for a weight that enters squared
    assert [(path, kind) for path, kind, _ in ghost.unsupported_modules(model)] == [
        ("model.norm", "SquaredRMSNorm")
    ]
    assert resolve_per_sample_gradient_mode("auto", DPAdamW, model) == ("materialize", False)
    with pytest.raises(UnsupportedModuleError):
        resolve_per_sample_gradient_mode("ghost", DPAdamW, model)
    frozen = freeze_all_but(with_squared_norm(tiny_llama_lm()), ["model.layers.0", "lm_head"])
    assert resolve_per_sample_gradient_mode("auto", DPAdamW, frozen) == ("ghost", True)


class _InitOnlyLinear(nn.Linear):  # like ESMFold's EsmFoldLinear: only the initialization differs
    pass


class _ScaledLinear(nn.Linear):  # its own forward, not x W^T + b
    def forward(self, input):
        return 2 * super().forward(input)


def test_linear_subclasses_get_the_linear_rule_only_when_they_compute_a_linear_layer():
    """A subclass keeping nn.Linear.forward, and Falcon's FalconLinear, are linear; a parametrized Linear
    (its weight is computed from other parameters) and a subclass with its own forward are not."""
    from transformers.models.falcon.modeling_falcon import FalconLinear

    assert native_kind(_InitOnlyLinear(4, 3)) == "linear"
    assert native_kind(FalconLinear(4, 3)) == "linear"
    assert native_kind(_ScaledLinear(4, 3)) is None
    assert native_kind(torch.nn.utils.parametrizations.weight_norm(nn.Linear(4, 3))) is None
    assert [kind for _, kind, _ in ghost.unsupported_modules(nn.Sequential(_ScaledLinear(4, 3)))] == [
        "_ScaledLinear"
    ]


class _WithToken(nn.Module):  # a raw trainable tensor (a cls token): no rule, and not weight_norm either
    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return x + self.token


def test_an_unsupported_module_is_named_with_its_trainable_tensors_and_only_a_legacy_weight_norm_as_one():
    """The reason once said "the legacy torch.nn.utils.weight_norm" for any module with tensors besides
    weight/bias (Swin's absolute embeddings, cls tokens): that reason is for native layer types only."""
    legacy = torch.nn.utils.weight_norm(nn.Linear(4, 3))
    reasons = {
        kind: reason for _, kind, reason in ghost.unsupported_modules(nn.Sequential(_WithToken(), legacy))
    }
    assert reasons["_WithToken"] == (
        "no fast per-example rule for this module type (its trainable tensors: token); freeze them"
    )
    assert "legacy torch.nn.utils.weight_norm" in reasons["Linear"] and "weight_g" in reasons["Linear"]


# --------------------------------------------------------------------------------------------------
# DPTrainer
# --------------------------------------------------------------------------------------------------


def classification_data(n: int = 48) -> datasets.Dataset:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (n,), generator=g)
    ids = torch.randint(3, 60, (n, 8), generator=g)
    ids[: n // 2, 6:] = 0  # padding
    mask = (ids != 0).long()
    return datasets.Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist()}
    )


def train(tmp_path, dp_optimizer: str, mode: str, *, opacus_hooks: bool = False, monkeypatch=None):
    if opacus_hooks:  # the materialized reference: dp_hf.grad_sample (Opacus hooks) + clip_and_sum
        monkeypatch.setattr(ghost, "unsupported_modules", lambda model: [("", "", "forced")])
    args = DPTrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        max_steps=3,
        noise_multiplier=0.0,
        per_sample_max_grad_norm=1.0 if "macadam" in dp_optimizer else 0.05,  # MacAdam fixes C = 1
        dp_optimizer=dp_optimizer,
        per_sample_gradient_mode=mode,
        save_strategy="no",
        report_to="none",
        seed=0,
        sampling_seed=2,
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=100,
    )
    trainer = DPTrainer(model=tiny_bert_classifier(), args=args, train_dataset=classification_data())
    trainer.train()
    if monkeypatch is not None:
        monkeypatch.undo()
    return trainer, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_trainer_selects_ghost_for_adamw_and_materialize_for_macadam(tmp_path):
    def make(dp_optimizer):
        args = DPTrainingArguments(
            output_dir=str(tmp_path),
            noise_multiplier=1.0,
            dp_optimizer=dp_optimizer,
            use_cpu=True,
            report_to="none",
        )
        return DPTrainer(model=tiny_bert_classifier(), args=args, train_dataset=classification_data())

    adamw = make("dp-adamw")
    assert adamw.per_sample_gradient_mode == "ghost" and adamw.fast_clipping.mode == "ghost"
    assert adamw.grad_sample_handle is None
    macadam = make("dp-macadam")
    assert macadam.per_sample_gradient_mode == "materialize" and macadam.fast_clipping.mode == "materialize"


@pytest.mark.parametrize(("dp_optimizer", "mode"), [("dp-adamw", "ghost"), ("dp-macadam", "materialize")])
def test_trainer_fast_path_trains_like_the_materialized_path(tmp_path, monkeypatch, dp_optimizer, mode):
    fast, fast_params = train(tmp_path / "fast", dp_optimizer, "auto")
    assert fast.per_sample_gradient_mode == mode and fast.fast_clipping is not None
    reference, reference_params = train(
        tmp_path / "ref", dp_optimizer, "materialize", opacus_hooks=True, monkeypatch=monkeypatch
    )
    assert reference.fast_clipping is None and reference.grad_sample_handle is not None
    assert fast.state.global_step == reference.state.global_step == 3
    initial = {n: p.detach() for n, p in tiny_bert_classifier().named_parameters()}
    moved = max(float((fast_params[n] - initial[n]).abs().max()) for n in fast_params)
    assert moved > 1e-3  # the comparison is not vacuous
    for name, value in fast_params.items():
        torch.testing.assert_close(value, reference_params[name], rtol=1e-5, atol=1e-5, msg=name)


class _SequenceFirst(nn.Module):
    """A Linear on ``[T, B, d]`` (sequence-first, as torch's own encoders): its rows are positions."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.linear = nn.Embedding(16, 8), nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.linear(self.embed(ids).transpose(0, 1)).transpose(0, 1).sum(dim=(1, 2))


class _RelativeBias(nn.Module):
    """A bias looked up with a ``[T, T]`` bucket tensor (T5's relative position bias): no batch dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.bias = nn.Embedding(16, 8), nn.Embedding(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1])
        buckets = (positions[None, :] - positions[:, None]).abs().clamp(max=7)  # [T, T]
        return self.embed(ids).sum(dim=(1, 2)) + self.bias(buckets).sum()


@pytest.mark.parametrize("model", [_SequenceFirst, _RelativeBias], ids=["sequence_first", "relative_bias"])
@pytest.mark.parametrize("mode", ["ghost", "materialize", "opacus"])
def test_own_loop_refuses_a_layer_input_that_only_happens_to_have_the_batch_size(model, mode):
    """With T == B such an input passes the per-call shape check, and its rows (positions) were clipped as
    examples: an audit of the own-loop API measured 6.12x (sequence-first) and 1.84x (T5) the bound. DPTrainer
    ran its first micro-batch on 1 and on 2 examples; attach_fast_clipping now does so at the first recorded
    forward pass, before any backward, and leaves the random state and the records as they were."""
    torch.manual_seed(0)
    net = model()
    clipping = attach_grad_sample(net) if mode == "opacus" else attach_fast_clipping(net, mode=mode)
    ids = torch.randint(0, 16, (4, 4))  # B == T
    before = torch.get_rng_state()
    with pytest.raises(PerSampleGradientError, match="alone and the first two together"):
        net(ids)
    assert torch.equal(before, torch.get_rng_state())
    # Caught and run again (a retry loop, a notebook cell): the probe runs again. It was marked done before it
    # ran, so the retry trained the refused model (an own-loop audit: 2x the bound).
    with pytest.raises(PerSampleGradientError, match="alone and the first two together"):
        net(ids)
    clipping.remove()


def test_scaled_word_embeddings_take_the_embedding_rule_only_when_their_forward_is_the_known_one():
    # Gemma's and BART's scaled embeddings are the lookup times a constant: the embedding rule records the
    # lookup and the replaced forward applies the same constant. Any other subclass keeps its own forward.
    import torch
    from torch import nn
    from transformers.models.bart.modeling_bart import BartScaledWordEmbedding
    from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding

    from dp_hf.per_example.ghost.support import is_scaled_embedding, native_kind

    class Shifted(nn.Embedding):
        embed_scale = 2.0

        def forward(self, input_ids):
            return super().forward(input_ids) * self.embed_scale + 1

    gemma = GemmaTextScaledWordEmbedding(10, 4, 0, embed_scale=2.0)
    assert is_scaled_embedding(gemma) and native_kind(gemma) == "embedding"
    assert is_scaled_embedding(BartScaledWordEmbedding(10, 4, 0, embed_scale=2.0))
    assert not is_scaled_embedding(nn.Embedding(10, 4)) and native_kind(nn.Embedding(10, 4)) == "embedding"
    assert not is_scaled_embedding(Shifted(10, 4)) and native_kind(Shifted(10, 4)) is None
    trainable_scale = GemmaTextScaledWordEmbedding(10, 4, 0, embed_scale=2.0)
    trainable_scale.embed_scale = nn.Parameter(torch.tensor(2.0))
    assert not is_scaled_embedding(trainable_scale)

    class Mixing(nn.Embedding):  # its super().forward: other rows added to each example's lookup
        def forward(self, input_ids):
            rows = nn.Embedding.forward(self, input_ids)
            return rows + rows.flip(0)

    class Mixed(BartScaledWordEmbedding, Mixing):  # the known text, but super() leads to Mixing first
        pass

    class Subclassed(BartScaledWordEmbedding):  # a subclass that keeps the known forward
        pass

    mixed = Mixed(10, 4, 0, embed_scale=2.0)
    assert not is_scaled_embedding(mixed) and native_kind(mixed) is None
    assert is_scaled_embedding(Subclassed(10, 4, 0, embed_scale=2.0))


@pytest.mark.parametrize("first", ["fast", "opacus"])
def test_one_engine_per_model(first):
    """attach_grad_sample after attach_fast_clipping was accepted (the reverse order was refused): both recorded
    each example, and an own loop that ran both clippings took each example twice (2x the bound, an audit)."""
    net = _SequenceFirst()
    hooks = attach_fast_clipping(net) if first == "fast" else attach_grad_sample(net)
    second = attach_grad_sample if first == "fast" else attach_fast_clipping
    with pytest.raises(ValueError, match="already attached to this model|attached already"):
        second(net)
    hooks.remove()
    second(net).remove()  # free again once the first engine is removed


@pytest.mark.parametrize("engine", ["ghost", "opacus"])
def test_one_dp_optimizer_holds_every_recorded_tensor(engine):
    """Two DP optimizers on one hooked model (e.g. body and head at other learning rates): on Opacus's hooks
    each clipped its own tensors to C, so an example counted sqrt(2) C against the accounted C; on the fast path
    the first clip dropped the other's records, which then got noise only (an own-loop audit)."""

    class BatchFirst(_SequenceFirst):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.linear(self.embed(ids)).sum(dim=(1, 2))

    net = BatchFirst()
    hooks = attach_grad_sample(net) if engine == "opacus" else attach_fast_clipping(net)
    kwargs = dict(lr=1.0, noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4)
    body = get_optimizer_class("dp-sgd")(net.embed.parameters(), **kwargs)
    get_optimizer_class("dp-sgd")(net.linear.parameters(), **kwargs)
    net(torch.randint(0, 16, (4, 3))).sum().backward()
    with pytest.raises(
        (RuntimeError, PerSampleGradientError), match=r"recorded for linear\.weight, linear\.bias"
    ):
        if engine == "opacus":
            body.clip_and_accumulate()
        else:
            hooks.accumulate(body)
    hooks.remove()
