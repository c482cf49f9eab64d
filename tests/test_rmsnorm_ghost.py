"""RMSNorms on the fast path (dp_hf.per_example.ghost.scales) against a micro-batch loop.

Full fine-tuning (every parameter trainable: embeddings, norms, projections, head) of a tiny Llama,
a tiny Qwen2 and toy models with torch's ``nn.RMSNorm``, ``T5LayerNorm`` and Gemma's ``(1 + w)``
norm: the per-example norms and clipped sums of the one-backward fast path equal those of each
example alone through the model (float64, autograd), to float32 rounding; under bf16 autocast
(CPU) they equal the same loop under the same autocast. A norm whose weight does not enter
elementwise-affinely is refused (by the probe, or at runtime by the ``.grad`` completeness check).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tiny_models import SquaredRMSNorm, freeze_all_but, tiny_llama_lm
from torch import nn

from dp_hf.optim import DPAdamW
from dp_hf.per_example import UnsupportedModuleError, attach_fast_clipping, resolve_per_sample_gradient_mode
from dp_hf.per_example.ghost import unsupported_modules
from dp_hf.privatizer import Geometry, clip_factors

VOCAB, BATCH, LENGTH = 48, 5, 9
LENGTHS = [9, 6, 8, 3, 7]


def _random_norm_weights(model: nn.Module) -> nn.Module:
    """Norm weights away from their init (ones / zeros), so that a wrong rule cannot hide."""
    generator = torch.Generator().manual_seed(7)
    for module in model.modules():
        if (
            type(module).__name__.endswith(("RMSNorm", "LayerNorm"))
            and getattr(module, "weight", None) is not None
        ):
            with torch.no_grad():
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=generator))
    return model


def tiny_llama() -> nn.Module:
    model = tiny_llama_lm(vocab_size=VOCAB, hidden_size=16, intermediate_size=24)
    return _random_norm_weights(model)


def tiny_qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        pad_token_id=0,
        tie_word_embeddings=True,  # tied input/output embeddings on the fast path as well
    )
    return _random_norm_weights(Qwen2ForCausalLM(config)).train()


class ToyLM(nn.Module):
    """Embedding -> norm -> Linear -> GELU -> norm -> head, with a norm class of choice."""

    def __init__(self, norm: type[nn.Module], hidden: int = 12) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(VOCAB, hidden)
        self.norm1, self.mlp, self.norm2 = norm(hidden), nn.Linear(hidden, hidden), norm(hidden)
        self.head = nn.Linear(hidden, VOCAB)
        _random_norm_weights(self)

    def forward(self, input_ids: torch.Tensor, attention_mask=None, **_) -> torch.Tensor:
        h = self.embed(input_ids)
        h = h + F.gelu(self.mlp(self.norm1(h)))
        return self.head(self.norm2(h))


def _gemma_norm(hidden: int) -> nn.Module:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    return GemmaRMSNorm(hidden)


def _t5_norm(hidden: int) -> nn.Module:
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    return T5LayerNorm(hidden)


MODELS = {
    "llama": tiny_llama,
    "qwen2_tied": tiny_qwen2,
    "nn_rmsnorm": lambda: ToyLM(nn.RMSNorm),
    "gemma_norm": lambda: ToyLM(_gemma_norm),
    "t5_norm": lambda: ToyLM(_t5_norm),
}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=generator)
    mask = (torch.arange(LENGTH)[None] < torch.tensor(LENGTHS)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def losses(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, attention_mask=mask)
    logits = (out if isinstance(out, torch.Tensor) else out.logits).float()
    labels = ids.masked_fill(mask == 0, -100)[:, 1:]
    token = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels, reduction="none")
    return token.sum(1)


def trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def loop_reference(model: nn.Module, dtype: torch.dtype, autocast: bool) -> list[list[torch.Tensor]]:
    """Per-example gradients: each example alone (unpadded) through a copy of the model, autograd."""
    model = copy.deepcopy(model).to(dtype)
    ids, mask = batch()
    per_example = []
    for i, length in enumerate(LENGTHS):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = losses(model, ids[i : i + 1, :length], mask[i : i + 1, :length]).sum()
        loss.backward()
        per_example.append(
            [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in trainable(model)]
        )
    return [torch.stack(rows).double() for rows in zip(*per_example)]


def batched_reference(model: nn.Module) -> list[torch.Tensor]:
    """Per-example gradients of one batched bf16-autocast forward: one backward per example's loss."""
    model = copy.deepcopy(model)
    ids, mask = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        per_example = losses(model, ids, mask)
    rows = [torch.autograd.grad(loss, trainable(model), retain_graph=True) for loss in per_example]
    return [torch.stack(row).double() for row in zip(*rows)]


def reference_clipped_sum(grads: list[torch.Tensor], clip: float, shift=None, scale=None):
    w = [
        (g - (0 if c is None else c.double())) / (1 if s is None else s.double())
        for g, c, s in zip(grads, shift or [None] * len(grads), scale or [None] * len(grads))
    ]
    norms = torch.sqrt(sum(x.flatten(1).square().sum(1) for x in w))
    factors = clip_factors(norms, clip).double()
    return [torch.einsum("b,b...->...", factors, x) for x in w], norms


def fast_clipped_sum(model: nn.Module, geometry: Geometry, autocast: bool, **options):
    clipping = attach_fast_clipping(model, **options)
    ids, mask = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = losses(model, ids, mask).sum()
    loss.backward()
    params = trainable(model)
    # the norm weights' per-example gradients G_i, as recorded (dense [B, H])
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    records = {
        k: clipping.recorder.records[id(p)].dense.clone() for k, p in enumerate(params) if "norm" in names[k]
    }
    try:
        sums, norms = clipping.clipped_sum(params, geometry)
        return sums, norms, records
    finally:
        clipping.remove()


def assert_matches(sums, norms, expected_sums, expected_norms, rtol: float) -> None:
    torch.testing.assert_close(norms.double(), expected_norms, rtol=rtol, atol=rtol * 1e-2)
    for k, (a, b) in enumerate(zip(sums, expected_sums)):
        scale = float(b.abs().max()) + 1e-12
        torch.testing.assert_close(
            a.double(), b, rtol=rtol, atol=rtol * scale, msg=lambda m, k=k: f"#{k}: {m}"
        )


def _median(norms: torch.Tensor) -> float:
    return float(norms.sort().values[len(norms) // 2])


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize(
    "mode, layer_strategy", [("ghost", "auto"), ("ghost", "ghost"), ("materialize", "materialize")]
)
@pytest.mark.parametrize("name", list(MODELS))
def test_full_fine_tuning_matches_a_micro_batch_loop(name, mode, layer_strategy, autocast):
    model = MODELS[name]()
    assert not unsupported_modules(model)
    assert resolve_per_sample_gradient_mode("auto", DPAdamW, model) == ("ghost", True)
    # bf16 autocast: the loop under the same autocast (float32 weights) is the reference
    grads = loop_reference(model, torch.float32 if autocast else torch.float64, autocast)
    _, unclipped = reference_clipped_sum(grads, float("inf"))
    clip = _median(unclipped)  # clipping active for some examples, not for others
    expected_sums, expected_norms = reference_clipped_sum(grads, clip)
    sums, norms, records = fast_clipped_sum(
        model, Geometry(clip), autocast, mode=mode, layer_strategy=layer_strategy
    )
    # float32 rounding. bf16 autocast: a padded batch's bf16 products round differently from a lone
    # example's (a few bf16 ulps); and autograd's own weight gradients of a bf16 matmul are rounded to
    # bf16, where the fast path sums float32 products. So: loosely against the lone-example loop,
    # to bf16 rounding against the same batched forward, and the norm weights' G_i to float32 rounding.
    assert_matches(sums, norms, expected_sums, expected_norms, rtol=3e-2 if autocast else 2e-5)
    if autocast:
        grads = batched_reference(model)
        expected_sums, expected_norms = reference_clipped_sum(grads, clip)
        assert_matches(sums, norms, expected_sums, expected_norms, rtol=4e-3)
    assert len(records) in (2, 5)  # 2 layers x 2 norms + the final norm; the toy: 2
    for k, dense in records.items():
        torch.testing.assert_close(dense.double(), grads[k], rtol=1e-4, atol=1e-6, msg=f"tensor #{k}")


@pytest.mark.parametrize("name", ["llama", "nn_rmsnorm"])
def test_materialize_in_an_adaptive_geometry(name):
    model = MODELS[name]()
    grads = loop_reference(model, torch.float64, False)
    generator = torch.Generator().manual_seed(0)
    shapes = [g.shape[1:] for g in grads]
    shift = [0.01 * torch.randn(s, generator=generator) if k % 3 else None for k, s in enumerate(shapes)]
    scale = [torch.rand(s, generator=generator) + 0.5 if k % 2 else None for k, s in enumerate(shapes)]
    _, unclipped = reference_clipped_sum(grads, float("inf"), shift, scale)
    clip = _median(unclipped)
    expected_sums, expected_norms = reference_clipped_sum(grads, clip, shift, scale)
    geometry = Geometry(clip, shift, scale)
    sums, norms, _ = fast_clipped_sum(model, geometry, False, mode="materialize", chunk_bytes=4096)
    assert_matches(sums, norms, expected_sums, expected_norms, rtol=2e-5)


def test_llama_full_fine_tuning_takes_the_fast_path():
    model = tiny_llama_lm()
    assert unsupported_modules(model) == []
    assert resolve_per_sample_gradient_mode("auto", DPAdamW, model) == ("ghost", True)
    clipping = attach_fast_clipping(model)
    ids, mask = batch()
    ids = ids.clamp(max=model.config.vocab_size - 1)
    losses(model, ids, mask).sum().backward()
    norm = model.model.layers[0].input_layernorm.weight
    assert norm.grad is not None  # hook mode: autograd's .grad, checked against the per-example sum
    sums, norms = clipping.clipped_sum(trainable(model), Geometry(1.0))
    assert norms.shape == (BATCH,) and all(torch.isfinite(s).all() for s in sums)


# ------------------------------------------------------------------ refused, never mis-clipped


def test_a_norm_not_affine_in_its_weight_is_unsupported():
    model = ToyLM(SquaredRMSNorm)
    problems = unsupported_modules(model)
    assert [(path, kind) for path, kind, _ in problems] == [
        ("norm1", "SquaredRMSNorm"),
        ("norm2", "SquaredRMSNorm"),
    ]
    assert all("not elementwise affine" in reason for _, _, reason in problems)
    assert resolve_per_sample_gradient_mode("auto", DPAdamW, model) == ("materialize", False)
    with pytest.raises(UnsupportedModuleError):
        attach_fast_clipping(model)
    frozen = freeze_all_but(ToyLM(SquaredRMSNorm), ["embed", "mlp", "head"])
    assert resolve_per_sample_gradient_mode("auto", DPAdamW, frozen) == ("ghost", True)


def test_a_norm_that_fools_the_probe_is_refused_by_the_grad_check():
    model = ToyLM(lambda hidden: SquaredRMSNorm(hidden, sneaky=True))
    assert not unsupported_modules(model)  # the probe's inputs are too short to see it
    with pytest.raises(RuntimeError, match="do not add up to its .grad"):
        fast_clipped_sum(model, Geometry(1.0), False)


def test_an_input_modified_in_place_before_the_backward_is_refused():
    class InPlace(ToyLM):
        def forward(self, input_ids, attention_mask=None, **_):
            h = self.embed(input_ids) * 1.0
            y = self.norm1(h)
            out = self.head(y.detach() * 0 + y)
            h.add_(1.0)  # the norm's input changes after its forward: z would be recomputed from it
            return out + self.head(self.norm2(h)) * 0

    with pytest.raises(RuntimeError, match="modified in place"):
        fast_clipped_sum(InPlace(nn.RMSNorm), Geometry(1.0), False)


def test_the_grad_check_of_hook_mode_tensors_reads_the_device_once():
    # One verdict per RMSNorm weight (a Llama has ~65), read together: on a GPU each host read waits for
    # the backward pass to finish and leaves the device idle while the next kernels are queued.
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
                self.count += 1
            return func(*args, **(kwargs or {}))

    model = tiny_llama()
    clipping = attach_fast_clipping(model)
    ids, mask = batch()
    losses(model, ids, mask).sum().backward()
    params = trainable(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sum("norm" in n for n in names) >= 3  # hook-mode tensors, each with its own verdict
    with HostReads() as reads:
        assert clipping.recorder.batch_size(params, clipping._native_params) == BATCH
    assert reads.count <= 1
    clipping.remove()
