"""CUDA checks of the fast paths (skipped without CUDA; CI has none): ``pytest -m gpu`` on a GPU machine.

* bf16 layers run their ghost norms and book-keeping sums on tensor cores: the norms the clip factors
  use are never below the float64 per-example gradient norms (examples on both sides of C, and one
  adversarial example whose positions are orthogonal), every example's contribution stays <= C, and
  the sum equals the float64 sum of ``f_i G_i`` to the stated bound;
* the float32 path on CUDA equals the float64 reference to float32 rounding, also with TF32 allowed;
* banked ghost norms (many layers' Grams in one bank) equal the per-layer ones, tensor cores included,
  and embeddings in a bank give the float64 norms;
* the DP optimizers' CUDA path (incl. MicroAdam) equals their CPU path; DP-AdamW at sigma 0 equals
  torch's AdamW;
* a short ``DPTrainer`` run in bf16.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dp_hf.per_example.ghost import attach_fast_clipping
from dp_hf.per_example.ghost.tensor_cores import ETA
from dp_hf.privatizer import Geometry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEVICE = "cuda"


class TokenMLP(nn.Module):
    """Two Linear layers over ``[B, T, d]`` positions, a fixed projection as the loss: each weight's
    ``G_i`` is a sum over positions (both are recorded as outers, the tensor-core path)."""

    def __init__(self, width: int = 256, hidden: int = 1024) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.register_buffer("projection", torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(self.down(torch.relu(self.up(x)))).float() * self.projection).sum(dim=(1, 2))


class Float64PerExample:
    """The float64 per-example gradients of the layers as they computed: ``sum_t g_t (x) in_t``.

    A bf16 layer (autocast or bf16 weights) used its input rounded to bf16 and produced a bf16 output
    gradient: both are taken as the layer saw them, then multiplied in float64.
    """

    def __init__(self, model: nn.Module) -> None:
        self.inputs: dict[nn.Linear, torch.Tensor] = {}
        self.grads: dict[nn.Linear, torch.Tensor] = {}
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(self._forward)

    def _forward(self, module, args, output) -> None:
        self.inputs[module] = args[0].to(output.dtype).detach()
        output.register_hook(lambda grad: self.grads.__setitem__(module, grad.detach()))

    def per_example(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        out = {}
        for module, x in self.inputs.items():
            g = self.grads[module].double()
            out[id(module.weight)] = torch.einsum("bto,bti->boi", g, x.double())
            out[id(module.bias)] = g.sum(dim=1)
        return [out[id(p)] for p in params]

    def position_norm_sums(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """``S_i = sum_t ||g_t|| ||x_t||`` per weight (0 for biases, whose sums are exact)."""
        out = {}
        for module, x in self.inputs.items():
            g = self.grads[module].double()
            out[id(module.weight)] = (g.norm(dim=-1) * x.double().norm(dim=-1)).sum(dim=1)
            out[id(module.bias)] = torch.zeros(g.shape[0], dtype=torch.float64, device=g.device)
        return [out[id(p)] for p in params]


def bf16_setup(batch: int, positions: int, *, autocast: bool, seed: int = 0):
    torch.manual_seed(seed)
    model = TokenMLP().to(DEVICE)
    if not autocast:
        model = model.to(torch.bfloat16)
    x = torch.randn(batch, positions, 256, device=DEVICE)
    x = x if autocast else x.to(torch.bfloat16)
    # Example 0 is adversarial for the bound: its positions point in orthogonal directions (the Gram
    # matrices are diagonal, so sum_t ||a_t|| ||g_t|| is largest relative to ||G||).
    x[0] = torch.eye(positions, 256, device=DEVICE) * 3
    # Example 1 is huge: clipped by a factor of ~1e-4.
    x[1] *= 1e3
    return model, x


def true_norms(per_example: list[torch.Tensor], batch: int) -> torch.Tensor:
    return sum(g.reshape(batch, -1).pow(2).sum(dim=1) for g in per_example).sqrt()


def clipped_sum_and_reference(model, x, max_grad_norm: float, *, autocast: bool, mode: str = "ghost"):
    reference = Float64PerExample(model)
    clipping = attach_fast_clipping(model, mode=mode)
    params = [p for p in model.parameters()]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        losses = model(x)
    losses.float().sum().backward()
    sums, norms = clipping.clipped_sum(params, Geometry(max_grad_norm=max_grad_norm))
    clipping.remove()
    return sums, norms, reference.per_example(params), reference.position_norm_sums(params)


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "bf16-weights"])
def test_bf16_tensor_core_norms_bound_the_true_norms_and_clip_to_c(autocast):
    batch, positions = 16, 64
    model, x = bf16_setup(batch, positions, autocast=autocast)
    _, _, per_example, _ = clipped_sum_and_reference(model, x, 1e30, autocast=autocast)
    true = true_norms(per_example, batch)
    max_grad_norm = float(true[2:].median())  # examples on both sides of C
    model, x = bf16_setup(batch, positions, autocast=autocast)
    sums, norms, per_example, position_sums = clipped_sum_and_reference(
        model, x, max_grad_norm, autocast=autocast
    )
    true = true_norms(per_example, batch)
    used = norms.double()
    # Never below the true norm; above it by the worst-case bound only (a few percent at most here).
    assert (used >= true).all(), (used - true).min()
    assert ((used / true) - 1).max() < 0.05, ((used / true) - 1).max()
    assert (true > max_grad_norm).sum() >= 4 and (true < max_grad_norm).sum() >= 4
    factors = (max_grad_norm / used).clamp(max=1.0)
    # Each example's contribution (float64, with the factor actually used) is at most C.
    assert (factors * true <= max_grad_norm * (1 + 1e-12)).all()
    # The released sum is sum_i f_i G_i up to the book-keeping bound eta f_i S_i per example and tensor
    # (plus float32 accumulation); a one-term bf16 split (error 2^-9) would exceed it.
    for total, g, s in zip(sums, per_example, position_sums):
        expected = torch.einsum("b,b...->...", factors, g)
        error = (total.double() - expected).norm()
        budget = ETA * (factors * s).sum() + 1e-6 * expected.norm()
        assert error <= budget, (error, budget)


def test_single_example_contribution_is_at_most_c():
    # The huge example alone: its clipped contribution, in float64, is <= C to float32 output rounding.
    model, x = bf16_setup(4, 64, autocast=True)
    sums, _, _, _ = clipped_sum_and_reference(model, x[1:2], 0.5, autocast=True)
    released = torch.cat([s.double().reshape(-1) for s in sums]).norm()
    assert released <= 0.5 * (1 + 1e-6), released


class SharedInput(nn.Module):
    """q, k and v read one LayerNorm output (float32 under CUDA autocast), as attention does."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.up, self.norm = nn.Linear(width, width), nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.up(x))
        return (self.q(hidden) * self.k(hidden) + self.v(hidden)).float().square().mean(dim=(1, 2))


def test_layers_sharing_an_input_under_autocast_record_one_copy_and_clip_to_c():
    torch.manual_seed(0)
    model = SharedInput().to(DEVICE)
    x = torch.randn(8, 64, 256, device=DEVICE)
    reference = Float64PerExample(model)
    clipping = attach_fast_clipping(model, mode="ghost")
    params = list(model.parameters())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        losses = model(x)
    losses.sum().backward()
    recorded = [
        clipping.recorder.records[id(layer.weight)].outers[0].cols for layer in (model.q, model.k, model.v)
    ]
    assert recorded[0].dtype == torch.bfloat16 and recorded[1] is recorded[0] and recorded[2] is recorded[0]
    linear = [p for layer in (model.up, model.q, model.k, model.v) for p in (layer.weight, layer.bias)]
    # float64 norms of the Linear layers' parameters (the LayerNorm's only add to an example's norm)
    true = sum(g.reshape(8, -1).pow(2).sum(dim=1) for g in reference.per_example(linear)).sqrt()
    max_grad_norm = float(true.median())
    _, norms = clipping.clipped_sum(params, Geometry(max_grad_norm=max_grad_norm))
    clipping.remove()
    assert (norms.double() >= true).all()  # the norms used bound them
    factors = (max_grad_norm / norms.double()).clamp(max=1.0)
    assert (factors * true <= max_grad_norm * (1 + 1e-12)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_banked_norms_equal_the_per_layer_norms_on_cuda(dtype):
    from dp_hf.per_example.ghost import banks, kernels
    from dp_hf.per_example.ghost.kernels import Outer

    generator = torch.Generator().manual_seed(0)
    shared = torch.randn(8, 64, 256, generator=generator).to(DEVICE, dtype)  # q, k and v's input
    outers = [
        Outer(torch.randn(8, 64, width, generator=generator).to(DEVICE, dtype), shared, width)
        for width in (256, 256, 1024)
    ]
    assert all(kernels.on_tensor_cores(o) == (dtype == torch.bfloat16) for o in outers)
    assert len(layer_keys := {kernels.tensor_key(f) for o in outers for f in (o.rows, o.cols)}) == 4, (
        layer_keys
    )
    banked_grams, layer_grams = kernels.GramCache(), kernels.GramCache()
    banked = banks.banked_sq_norms(outers, 1 << 30, banked_grams)
    for o, norm in zip(outers, banked):
        torch.testing.assert_close(
            norm, kernels.outer_sq_norm(o, 1 << 30, torch.float32, layer_grams), rtol=1e-6, atol=0
        )
    for key, maxima in layer_grams.diagonal_maxima.items():
        assert torch.equal(banked_grams.diagonal_maxima[key], maxima)


def test_the_grams_first_order_terms_bound_the_tensor_core_error_of_causal_lm_like_factors():
    """Nearly orthogonal position gradients (a token-level loss) against dense, 4x wider inputs (an MLP's
    output projection), on real tensor cores: the norms' error stays within the bound taken from the
    Grams (ghost/grams.py), which is several times below the Gram-free one; banked and per-layer alike."""
    from dp_hf.per_example import ghost
    from dp_hf.per_example.ghost import kernels
    from dp_hf.per_example.ghost.kernels import Outer
    from dp_hf.per_example.ghost.records import ParamRecord
    from dp_hf.per_example.ghost.tensor_cores import rounding_bound

    generator = torch.Generator().manual_seed(0)
    outers, records = [], []
    for positions in (256, 256, 128):
        rows = 0.05 * torch.randn(4, positions, 1024, generator=generator)
        rows[:, torch.arange(positions), torch.arange(positions)] += 1.0
        cols = 1.0 + 0.3 * torch.randn(4, positions, 4096, generator=generator)
        outers.append(Outer(rows.to(DEVICE, torch.bfloat16), cols.to(DEVICE, torch.bfloat16), 1024))
        records.append(ParamRecord(torch.zeros(1024, 4096, device=DEVICE), None, [outers[-1]]))
    params = [r.param for r in records]
    grams = kernels.GramCache()
    with torch.no_grad():
        sq = ghost.norms.sq_norms(
            records, params, Geometry(1.0), ghost=True, batch=4, device=torch.device(DEVICE),
            budget=1 << 30, dtype=torch.float32, grams=grams,
        )  # fmt: skip
        bound = rounding_bound(records, 4, torch.device(DEVICE), grams)
        gram_free = rounding_bound(records, 4, torch.device(DEVICE))
    assert len(grams.errors) == 3
    true = sum(
        torch.einsum("btr,btc->brc", o.rows.double(), o.cols.double()).square().sum(dim=(1, 2))
        for o in outers
    )
    assert ((sq - true).abs() <= bound.gram_error).all()
    assert (bound.gram_error < gram_free.gram_error / 4).all(), bound.gram_error / gram_free.gram_error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_banked_embedding_norms_on_cuda_are_the_float64_norms(dtype):
    # On CUDA an embedding with per-example ids joins the bank at any length (no torch.unique, which waits
    # for the device); its cols (here also a Linear's input) are multiplied in float32, never on tensor cores.
    from dp_hf.per_example.ghost import banks, kernels
    from dp_hf.per_example.ghost.kernels import Outer
    from dp_hf.per_example.ghost.records import ParamRecord

    generator = torch.Generator().manual_seed(0)
    shared = torch.randn(8, 128, 256, generator=generator).to(DEVICE, dtype)
    ids = torch.randint(0, 50, (8, 128), generator=generator).to(DEVICE)
    embedding = Outer(ids, shared, 50, rows_are_ids=True)
    linear = Outer(torch.randn(8, 128, 64, generator=generator).to(DEVICE, dtype), shared, 64)
    assert banks.bankable(ParamRecord(torch.empty(0), outers=[embedding]))
    # ids shared by the batch (positions) keep their per-layer path beyond 32 positions: no search there
    positions = Outer(torch.arange(128, device=DEVICE)[None].expand(8, -1), shared, 128, rows_are_ids=True)
    assert not banks.bankable(ParamRecord(torch.empty(0), outers=[positions]))
    norm, linear_norm = banks.banked_sq_norms([embedding, linear], 1 << 30, kernels.GramCache())
    reference = (
        torch.einsum("btr,btc->brc", torch.nn.functional.one_hot(ids, 50).double(), shared.double())
        .pow(2)
        .sum(dim=(1, 2))
    )
    torch.testing.assert_close(norm.double(), reference, rtol=1e-5, atol=0)
    torch.testing.assert_close(
        linear_norm,
        kernels.outer_sq_norm(linear, 1 << 30, torch.float32, kernels.GramCache()),
        rtol=1e-6,
        atol=0,
    )


@pytest.fixture
def tf32():
    """TF32 float32 matmuls, as ``TrainingArguments(tf32=True)`` sets them; default precision afterwards."""
    torch.backends.fp32_precision = "tf32"
    yield
    torch.backends.fp32_precision = "none"


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("allow_tf32", [False, True], ids=["ieee", "tf32"])
def test_float32_path_on_cuda_matches_float64(request, allow_tf32, mode):
    # With TF32 allowed the Grams and sums would be ~1e-3 off; the clipping pass runs them in IEEE float32.
    # materialize: the geometries' path, whose norms on CUDA are vector_norm's (example_sq_norms).
    if allow_tf32:
        request.getfixturevalue("tf32")
    torch.manual_seed(0)
    model = TokenMLP().to(DEVICE)
    x = torch.randn(8, 32, 256).to(DEVICE)
    sums, norms, per_example, _ = clipped_sum_and_reference(model, x, 0.1, autocast=False, mode=mode)
    true = true_norms(per_example, 8)
    torch.testing.assert_close(norms.double(), true, rtol=1e-5, atol=0)
    factors = (0.1 / true).clamp(max=1.0)
    for total, g in zip(sums, per_example):
        torch.testing.assert_close(
            total.double(), torch.einsum("b,b...->...", factors, g), rtol=1e-4, atol=1e-7
        )


def test_bf16_materialize_mode_bounds_its_tensor_core_products():
    # Materialized norms (a geometry's path) of bf16 outers run on tensor cores, G^_i and A^_i = |rows|^T |cols|,
    # and absorb their error and the book-keeping split's in a slack of ~2 (g_T + eta) ||A^_i||: never below
    # the true norm, a fraction of a percent above it at T = 32, and each contribution <= C.
    model, x = bf16_setup(8, 32, autocast=True)
    sums, norms, per_example, position_sums = clipped_sum_and_reference(
        model, x, 0.05, autocast=True, mode="materialize"
    )
    true = true_norms(per_example, 8)
    used = norms.double()
    assert (used >= true).all(), (used - true).min()
    assert ((used / true) - 1)[1:].max() < 1e-2, (used / true) - 1  # (example 0's positions are orthogonal)
    factors = (0.05 / used).clamp(max=1.0)
    assert (factors * true <= 0.05 * (1 + 1e-12)).all()
    for total, g, s in zip(sums, per_example, position_sums):
        expected = torch.einsum("b,b...->...", factors, g)
        budget = ETA * (factors * s).sum() + 1e-6 * expected.norm()
        assert (total.double() - expected).norm() <= budget


@pytest.mark.parametrize("name", ["dp-sgd", "dp-adamw", "dp-adambc", "dp-macadam", "dp-microadam"])
def test_optimizer_cuda_path_equals_cpu_path(name):
    from dp_hf.optim import create_dp_optimizer

    def run(device):
        torch.manual_seed(0)
        params = [torch.randn(shape).to(device).requires_grad_() for shape in [(300, 70), (70,), (5000,)]]
        kwargs = {} if "macadam" in name else {"max_grad_norm": float("inf")}
        optimizer = create_dp_optimizer(
            name, params, lr=1e-2, noise_multiplier=0.0, expected_batch_size=4, **kwargs
        )
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad_sample = torch.randn(4, *p.shape, generator=g).to(device)
                p.grad = p.grad_sample.sum(0)
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().cpu() for p in params]

    for cpu, cuda in zip(run("cpu"), run(DEVICE)):
        torch.testing.assert_close(cuda, cpu, rtol=1e-4, atol=1e-5)


def test_dp_adamw_at_sigma_zero_equals_torch_adamw_on_cuda():
    from dp_hf.optim import DPAdamW

    torch.manual_seed(0)
    ours = [
        torch.randn(64, 32, device=DEVICE, requires_grad=True),
        torch.randn(32, device=DEVICE, requires_grad=True),
    ]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    dp = DPAdamW(ours, lr=1e-2, noise_multiplier=0.0, max_grad_norm=float("inf"), expected_batch_size=1)
    ref = torch.optim.AdamW(theirs, lr=1e-2)
    for _ in range(5):
        grads = [torch.randn_like(p) for p in ours]
        for p, q, g in zip(ours, theirs, grads):
            p.grad_sample, p.grad, q.grad = g[None], g.clone(), g.clone()
        dp.step()
        ref.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["dp-adamw", "dp-adam"])
def test_fused_adam_kernel_on_cuda_matches_the_multi_tensor_step(monkeypatch, name):
    """float32 CUDA parameters take torch's fused Adam kernel (step count passed as a device tensor)."""
    import dp_hf.optim.adam as adam
    from dp_hf.optim import create_dp_optimizer
    from tests.test_optim_multitensor import counted_fused_kernels

    calls, fused_kernels = counted_fused_kernels()

    def run(fused: bool):
        monkeypatch.setattr(adam, "_FUSED", fused_kernels if fused else {})
        torch.manual_seed(0)
        params = [torch.randn(s, device=DEVICE).requires_grad_() for s in [(300, 70), (70,), (5000,)]]
        optimizer = create_dp_optimizer(
            name,
            params,
            lr=1e-2,
            weight_decay=0.05,
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            expected_batch_size=4,
        )
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad_sample = torch.randn(4, *p.shape, generator=g).to(DEVICE)
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach() for p in params]

    with_kernel, without = run(True), run(False)
    assert len(calls) == 4
    for a, b in zip(with_kernel, without):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_short_dp_trainer_run_in_bf16(tmp_path):
    from dp_training import bert_classifier, classification_data, dp_args

    from dp_hf import DPTrainer

    args = dp_args(tmp_path, use_cpu=False, bf16=True, max_steps=6, per_device_train_batch_size=16)
    trainer = DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(128))
    assert trainer.per_sample_gradient_mode == "ghost"
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 6 and all(torch.isfinite(torch.tensor(entry["loss"])) for entry in logged)
    assert logged[-1]["epsilon"] > 0
    assert next(trainer.model.parameters()).is_cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_fused_geometry_norms_equal_the_torch_path_and_bound_the_true_norms(monkeypatch, dtype):
    # The fused kernel (ghost/fused.py) replaces the materialize path's G_i chunks of each Linear weight in a
    # geometry: its norms equal the torch path's (float32: to rounding; bf16: both on tensor cores, each with
    # its slack), never fall below the float64 norms in the geometry, and it really ran (no cross-check failure).
    from dp_hf.per_example.ghost import fused

    monkeypatch.setattr(fused, "_checked", set())
    monkeypatch.setattr(fused, "_disabled", [])
    launches = []
    launch = fused._launch
    monkeypatch.setattr(fused, "_launch", lambda *a, **k: launches.append(a[0].dtype) or launch(*a, **k))

    def run(kernel: bool):
        monkeypatch.setenv(fused.FUSED_NORMS_ENV, "1" if kernel else "0")
        torch.manual_seed(0)
        model = TokenMLP().to(DEVICE, dtype)
        x = torch.randn(16, 64, 256, device=DEVICE, dtype=dtype)
        params = list(model.parameters())
        geometry = Geometry(
            max_grad_norm=1.0,
            shift=[torch.randn_like(p, dtype=torch.float32) * 1e-3 for p in params],
            scale=[torch.rand_like(p, dtype=torch.float32) + 0.05 for p in params],
        )
        reference = Float64PerExample(model)
        clipping = attach_fast_clipping(model, mode="materialize")
        model(x).float().sum().backward()
        sums, norms = clipping.clipped_sum(params, geometry)
        clipping.remove()
        per_example = reference.per_example(params)
        true = sum(
            ((g - c.double()) / s.double()).reshape(16, -1).square().sum(1)
            for g, c, s in zip(per_example, geometry.shift, geometry.scale)
        ).sqrt()
        return sums, norms.double(), true

    sums, norms, true = run(True)
    assert launches == [dtype, dtype] and not fused._disabled
    ref_sums, ref_norms, _ = run(False)
    rtol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(norms, ref_norms, rtol=rtol, atol=0)
    assert (norms >= true * (1 - 1e-6)).all(), (norms / true).min()
    for got, want in zip(sums, ref_sums):
        torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6)


class EqualLayers(nn.Module):
    """Four 256 x 256 Linear layers over ``[B, T, 256]`` positions: one group of the grouped book-keeping sums."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.float().sum(dim=(1, 2))


def test_grouped_tensor_core_sums_equal_the_per_layer_sums_on_cuda(monkeypatch):
    # ghost/grouped.py sums equal-shape bf16 layers with batched tensor-core GEMMs: the same bf16 operands and
    # float32 accumulation as the per-layer split, so the sums agree to float32 rounding, and both stay within
    # the split's bound of the float64 sum of f_i G_i.
    from dp_hf.per_example.ghost import grouped, norms

    made = []
    real = grouped.grouped_tensor_core_sums
    monkeypatch.setattr(norms, "grouped_tensor_core_sums", lambda *args: made.append(real(*args)) or made[-1])

    def run():
        torch.manual_seed(0)
        model = EqualLayers().to(DEVICE)
        x = torch.randn(16, 64, 256, device=DEVICE)
        return clipped_sum_and_reference(model, x, 0.05, autocast=True)

    sums, norms_, per_example, position_sums = run()
    assert len(made) == 1 and len(made[0]) == 4
    monkeypatch.setattr(norms, "grouped_tensor_core_sums", lambda *args: {})
    per_layer_sums, per_layer_norms, _, _ = run()
    torch.testing.assert_close(norms_, per_layer_norms, rtol=0, atol=0)
    factors = (0.05 / norms_.double()).clamp(max=1.0)
    for total, reference, g, s in zip(sums, per_layer_sums, per_example, position_sums):
        torch.testing.assert_close(total, reference, rtol=1e-5, atol=1e-7)
        expected = torch.einsum("b,b...->...", factors, g)
        assert (total.double() - expected).norm() <= ETA * (factors * s).sum() + 1e-6 * expected.norm()


def test_a_release_of_different_steps_is_refused_at_the_next_release_on_cuda():
    """On CUDA the summed DP steps are copied to the host without waiting (no stall each step) and checked
    when the next release begins."""
    from dp_hf.privatizer import RankSteps, step_slots

    summed = step_slots(3, 0, 2, torch.device(DEVICE)) + step_slots(0, 1, 2, torch.device(DEVICE))
    rank_steps = RankSteps()
    rank_steps.check(summed, 3)  # left for later
    with pytest.raises(RuntimeError, match="released different DP steps.*That update was applied"):
        rank_steps.check_pending()
    rank_steps.check_pending()  # nothing left
    same = step_slots(4, 0, 2, torch.device(DEVICE)) + step_slots(4, 1, 2, torch.device(DEVICE))
    rank_steps.check(same, 4)
    rank_steps.check_pending()
