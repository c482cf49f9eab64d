"""Clipping's float32 matmuls run in IEEE float32 even where the user lowered their precision.

``TrainingArguments(tf32=True)``, ``torch.set_float32_matmul_precision("high")`` and friends let
CUDA run float32 matmuls in TF32 (and oneDNN on a CPU in bf16). Ghost norms are Gram GEMMs and the
clipped sums GEMMs: at TF32 an example's norm reads up to ~0.1% low and its contribution exceeds C.
On this CPU the lowered settings change no result (no TF32 here), so the tests watch the setting
in force at every float32 matmul of the clipping pass, and that the user's setting comes back. An
enclosing ``torch.autocast`` (bf16 matmuls) does change results on a CPU: compared bit for bit.
cuBLAS's reduced-precision reductions in bf16 GEMMs (the tensor-core bound assumes float32
accumulation) are off for the pass too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_bert_classifier, tiny_text_batch
from torch.utils._python_dispatch import TorchDispatchMode

from dp_hf.per_example import attach_fast_clipping
from dp_hf.precision import ieee_float32_matmuls
from dp_hf.privatizer import Geometry, clip_and_sum

FULL = {"ieee", "none"}  # "none": unset, the default (IEEE)
MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.bmm.out,  # the ghost-norm bank's Grams, written in its rows
    torch.ops.aten.addmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.mv.default,
    torch.ops.aten.dot.default,
}


def _precisions() -> tuple[str, str]:
    return torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision


def _bf16_reductions() -> bool:
    return torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction


class MatmulPrecisions(TorchDispatchMode):
    """The (cuda, mkldnn) float32 matmul precision in force at each float32 matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []
        self.bf16_reductions: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS and any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args):
            self.seen.append(_precisions())
            self.bf16_reductions.append(_bf16_reductions())
        return func(*args, **(kwargs or {}))


def _reset() -> None:
    """The default state, reached from any of the APIs (the legacy one first: setting the new one over a
    legacy value would leave the legacy flags unreadable)."""
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    torch.set_float32_matmul_precision("highest")
    torch.backends.fp32_precision = "none"
    torch.backends.cuda.matmul.fp32_precision = "none"
    torch.backends.mkldnn.matmul.fp32_precision = "none"


@pytest.fixture(autouse=True)
def default_precision():
    _reset()
    yield
    _reset()


# How users lower the precision: transformers' tf32=True sets the generic one (torch >= 2.9).
LOWERINGS = {
    "set_float32_matmul_precision": lambda: torch.set_float32_matmul_precision("high"),
    "allow_tf32": lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    "generic_fp32_precision": lambda: setattr(torch.backends, "fp32_precision", "tf32"),
    "cuda_fp32_precision": lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
    "mkldnn_bf16": lambda: setattr(torch.backends.mkldnn.matmul, "fp32_precision", "bf16"),
}


@pytest.fixture(params=list(LOWERINGS))
def lowered(request):
    """The precision lowered in one of the users' ways: ``(name, (cuda, mkldnn) precisions)``."""
    LOWERINGS[request.param]()
    before = _precisions()
    assert not set(before) <= FULL
    return request.param, before


def _ghost_pass(mode: str):
    torch.manual_seed(0)
    model = tiny_bert_classifier()
    clipping = attach_fast_clipping(model, mode=mode)
    batch = tiny_text_batch(batch_size=5)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    F.cross_entropy(logits, batch["labels"], reduction="none").sum().backward()
    params = [p for p in model.parameters() if p.requires_grad]
    return lambda: clipping.clipped_sum(params, Geometry(0.05))


def _hooks_pass(mode: str):
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(6, 7, 5, generator=generator), torch.randn(6, 5, generator=generator)]
    return lambda: clip_and_sum(grads, Geometry(0.05))


@pytest.mark.parametrize(
    "make_pass, mode",
    [(_ghost_pass, "ghost"), (_ghost_pass, "materialize"), (_hooks_pass, "hooks")],
    ids=["ghost", "materialize", "opacus_hooks"],
)
def test_clipping_matmuls_run_in_ieee_float32_and_the_setting_comes_back(lowered, make_pass, mode):
    name, before = lowered
    run = make_pass(mode)  # the model's own passes keep the user's setting
    with MatmulPrecisions() as watch:
        run()
    assert len(watch.seen) >= (20 if mode != "hooks" else 2), watch.seen  # Grams, sums, GEMVs
    assert {p for seen in watch.seen for p in seen} <= FULL, (
        f"{name}: float32 matmuls of the clipping pass ran at {sorted(set(watch.seen))}"
    )
    assert not any(watch.bf16_reductions)  # the tensor-core bound's float32 accumulation
    assert _precisions() == before
    assert _bf16_reductions() is True  # the default, given back
    if name in ("set_float32_matmul_precision", "allow_tf32"):  # a legacy setting stays readable
        assert torch.backends.cuda.matmul.allow_tf32 is True


def test_a_generic_setting_still_reaches_the_backends_afterwards():
    # transformers' tf32=True sets torch.backends.fp32_precision; the backends inherit it. After the
    # pass they must inherit again, so that turning TF32 off later (enable_tf32(False)) still works.
    torch.backends.fp32_precision = "tf32"
    try:
        with ieee_float32_matmuls():
            assert _precisions() == ("ieee", "ieee")
        assert _precisions() == ("tf32", "tf32")
        torch.backends.fp32_precision = "ieee"
        assert _precisions() == ("ieee", "ieee")
    finally:
        torch.backends.fp32_precision = "none"


def test_full_precision_is_left_untouched(monkeypatch):
    # Nothing lowered (and reduced-precision bf16 reductions already off): the context sets nothing (setting a value through the new API would make the
    # legacy allow_tf32 unreadable for a user who set it before).
    assert set(_precisions()) <= FULL
    before = _precisions()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    monkeypatch.setattr(torch.backends.cuda.matmul.__class__, "__setattr__", _refuse)
    with ieee_float32_matmuls():
        assert _precisions() == before
    assert _precisions() == before


def _refuse(self, name, value):
    raise AssertionError(f"set {name}={value!r} though nothing was lowered")


def test_torch_before_2_9_uses_the_one_legacy_setting(monkeypatch):
    import dp_hf.precision as precision

    monkeypatch.setattr(precision, "_per_backend_api", lambda: False)
    torch.set_float32_matmul_precision("high")
    with ieee_float32_matmuls():
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.get_float32_matmul_precision() == "high"


# The per-example-gradient completeness check's tolerance rests on the precision the model's own gradients
# were computed in: (lowering, device) -> the machine epsilon it must allow for.
ARITHMETIC_EPS = [
    (None, "cpu", 2.0**-23),
    (None, "cuda", 2.0**-10),  # cuDNN's convolutions run TF32 by default
    ("generic_fp32_precision", "cuda", 2.0**-10),  # TrainingArguments(tf32=True) on torch >= 2.9
    ("generic_fp32_precision", "cpu", 2.0**-10),
    ("cuda_fp32_precision", "cuda", 2.0**-10),
    ("cuda_fp32_precision", "cpu", 2.0**-23),
    ("mkldnn_bf16", "cpu", 2.0**-7),
    ("mkldnn_bf16", "cuda", 2.0**-10),
    ("set_float32_matmul_precision", "cuda", 2.0**-10),
    ("legacy_medium", "cpu", 2.0**-7),  # oneDNN may run float32 matmuls in bf16
]


@pytest.mark.parametrize(("lowering", "device", "eps"), ARITHMETIC_EPS)
def test_completeness_tolerance_reads_the_precision_the_gradients_were_computed_in(lowering, device, eps):
    # On torch >= 2.9, torch.get_float32_matmul_precision() raises once the new API was used (as transformers'
    # tf32=True does): the check's tolerance crashed there on CUDA before any training.
    from dp_hf.optim.completeness import _compute_eps

    if lowering == "legacy_medium":
        torch.set_float32_matmul_precision("medium")
    elif lowering is not None:
        LOWERINGS[lowering]()
    assert _compute_eps(torch.float32, torch.device(device)) == eps
    assert _compute_eps(torch.bfloat16, torch.device(device)) == 2.0**-7
    assert _compute_eps(torch.float64, torch.device(device)) == 2.0**-52


def test_completeness_tolerance_before_torch_2_9(monkeypatch):
    import dp_hf.precision as precision
    from dp_hf.optim.completeness import _compute_eps

    monkeypatch.setattr(precision, "_per_backend_api", lambda: False)
    assert _compute_eps(torch.float32, torch.device("cpu")) == 2.0**-23
    assert _compute_eps(torch.float32, torch.device("cuda")) == 2.0**-10
    torch.set_float32_matmul_precision("medium")
    assert _compute_eps(torch.float32, torch.device("cpu")) == 2.0**-7
    assert _compute_eps(torch.float32, torch.device("cuda")) == 2.0**-7


def _mlp_clipped_sum(mode: str, autocast: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    x = torch.randn(6, 10, 16)
    if mode == "hooks":
        grads = [torch.randn(6, *p.shape) for p in model.parameters()]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            result = clip_and_sum(grads, Geometry(0.05))
            assert torch.is_autocast_enabled("cpu") is autocast  # the user's block is on again
        return result
    clipping = attach_fast_clipping(model, mode=mode)
    model(x).pow(2).sum(dim=(1, 2)).sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # as around a user's optimizer step
        result = clipping.clipped_sum(list(model.parameters()), Geometry(0.05))
        assert torch.is_autocast_enabled("cpu") is autocast  # the user's block is on again
    return result


@pytest.mark.parametrize("mode", ["ghost", "materialize", "hooks"])
def test_an_enclosing_autocast_does_not_lower_the_clipping_pass(mode):
    """An optimizer step inside the user's ``torch.autocast(bfloat16)`` block: the clipping pass's
    matmuls would run in bf16 (sums ~0.2-0.5% off, in bf16). They run in float32, bit for bit as
    outside the block, and the block is still on afterwards."""
    sums, norms = _mlp_clipped_sum(mode, autocast=False)
    autocast_sums, autocast_norms = _mlp_clipped_sum(mode, autocast=True)
    assert torch.equal(autocast_norms, norms)
    for a, b in zip(autocast_sums, sums):
        assert a.dtype == torch.float32
        assert torch.equal(a, b)
