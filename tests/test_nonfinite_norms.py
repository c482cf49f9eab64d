"""One adversarial example cannot escape clipping through floating point (inf, NaN, overflow).

Per-example clipping bounds what one example adds to the clipped sum by ``C`` only if its norm is a
number. An example with huge activations or loss (a regression label of 1e25, an image scaled by
1e19) overflows float32 squared norms and the Gram products of ghost clipping (``inf - inf`` = NaN),
and ``NaN > C`` is False, so a NaN norm used to give the factor 1 (no clipping at all). An example
whose gradient itself is inf/NaN made every parameter NaN (``0 * inf``), revealing its presence.

Every path (Opacus hooks + clip_and_sum, ghost, layer-wise materialization, in the identity and an
adaptive geometry) is checked the same way: the clipped sum of a batch of normal examples is
compared with the clipped sum of the same batch plus one outlier; the difference must have norm at
most ``C`` (exactly ``C`` when the outlier's gradient is finite: clipped, not dropped). The same holds
for the gradient one sigma = 0 optimizer step releases (times ``B``, in the clipping geometry), which
must also leave every parameter finite; for the clipped sums a data-parallel rank all-reduces; and
for a whole DPTrainer run.
"""

from __future__ import annotations

import copy
import math

import datasets
import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_bert_classifier, tiny_image_batch, tiny_text_batch, tiny_vit_classifier

import dp_hf.per_example.ghost as ghost
import dp_hf.privatizer as privatizer
from dp_hf import DPTrainer
from dp_hf.noise import NoiseSource
from dp_hf.optim import create_dp_optimizer
from dp_hf.per_example import attach_fast_clipping, attach_grad_sample
from dp_hf.privatizer import Geometry, Privatizer, clip_and_sum

CLIP = 0.5
NORMAL = 4  # normal examples; the outlier is example NORMAL


# --------------------------------------------------------------------------------------------------
# Outliers: (model factory, per-example losses of the first n examples, outcome)
# "clipped": the outlier's gradient is finite (float32), so it must contribute exactly C;
# "dropped": its gradient has inf/NaN entries, so it must contribute 0.
# --------------------------------------------------------------------------------------------------


def _regression_model():
    return tiny_bert_classifier(num_labels=1)


def _regression_losses(label: float):
    def losses(model, n: int) -> torch.Tensor:
        batch = tiny_text_batch(batch_size=NORMAL + 1)
        target = torch.linspace(-1.0, 1.0, NORMAL + 1)
        target[NORMAL] = label
        ids, mask = batch["input_ids"][:n], batch["attention_mask"][:n]
        prediction = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        return (prediction - target[:n]).pow(2)

    return losses


def _image_losses(scale: float):
    def losses(model, n: int) -> torch.Tensor:
        batch = tiny_image_batch(batch_size=NORMAL + 1)
        pixels = batch["pixel_values"].clone()
        pixels[NORMAL] *= scale
        logits = model(pixel_values=pixels[:n]).logits
        return F.cross_entropy(logits, batch["labels"][:n], reduction="none")

    return losses


OUTLIERS = {
    # finite gradient (entries ~2e25): float32 squared norms overflow, ghost Grams give inf - inf
    "regression_label_1e25": (_regression_model, _regression_losses(1e25), "clipped"),
    # finite, moderate gradient, but pixels ~1e19: the patch-projection Gram overflows
    "image_scaled_1e19": (tiny_vit_classifier, _image_losses(1e19), "clipped"),
    # the gradient itself is inf / NaN
    "regression_label_inf": (_regression_model, _regression_losses(math.inf), "dropped"),
    "regression_label_nan": (_regression_model, _regression_losses(math.nan), "dropped"),
    "image_scaled_1e20": (tiny_vit_classifier, _image_losses(1e20), "dropped"),  # NaN forward
}


def trainable(model) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def adaptive_geometry(params) -> Geometry:
    """A DP-MacAdam-like geometry: a small shift and a positive scale on some tensors."""
    generator = torch.Generator().manual_seed(3)
    shift = [
        0.01 * torch.randn(p.shape, generator=generator) if k % 3 else None for k, p in enumerate(params)
    ]
    scale = [torch.rand(p.shape, generator=generator) + 0.5 if k % 2 else None for k, p in enumerate(params)]
    return Geometry(CLIP, shift, scale)


# --------------------------------------------------------------------------------------------------
# Paths: clipped sum of the first n examples (in the w coordinates)
# --------------------------------------------------------------------------------------------------


def _opacus(geometric: bool):
    def clipped_sum(outlier: str, n: int):
        factory, losses, _ = OUTLIERS[outlier]
        model = factory()
        handle = attach_grad_sample(model)
        losses(model, n).sum().backward()
        params = trainable(model)
        geometry = adaptive_geometry(params) if geometric else Geometry(CLIP)
        result = clip_and_sum([p.grad_sample for p in params], geometry)
        handle.remove()
        return result

    return clipped_sum


def _fast(mode: str, geometric: bool = False, **options):
    def clipped_sum(outlier: str, n: int):
        factory, losses, _ = OUTLIERS[outlier]
        model = factory()
        clipping = attach_fast_clipping(model, mode=mode, **options)
        losses(model, n).sum().backward()
        params = trainable(model)
        geometry = adaptive_geometry(params) if geometric else Geometry(CLIP)
        result = clipping.clipped_sum(params, geometry)
        clipping.remove()
        return result

    return clipped_sum


PATHS = {
    "opacus_hooks": _opacus(geometric=False),
    "opacus_hooks_adaptive_geometry": _opacus(geometric=True),
    "ghost": _fast("ghost"),
    "ghost_dense_layers": _fast("ghost", layer_strategy="materialize"),  # G_i kept per layer
    "ghost_small_chunks": _fast("ghost", layer_strategy="ghost", chunk_bytes=4096),
    "materialize": _fast("materialize"),
    "materialize_adaptive_geometry": _fast("materialize", geometric=True, chunk_bytes=4096),
}


#: Paths that form the norm from Gram products (where pixels ~1e19 overflow). On the others the
#: scaled image is no outlier at all: LayerNorm makes its gradient ordinary (max entry ~1.6).
GRAM_PATHS = ("ghost", "ghost_small_chunks")
CASES = [
    (path, outlier)
    for path in PATHS
    for outlier in OUTLIERS
    if outlier != "image_scaled_1e19" or path in GRAM_PATHS
]


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in tensors])


@pytest.mark.parametrize(("path", "outlier"), CASES)
def test_one_outlier_changes_the_clipped_sum_by_at_most_c(path, outlier):
    sums_without, norms_without = PATHS[path](outlier, NORMAL)
    sums_with, norms_with = PATHS[path](outlier, NORMAL + 1)
    assert torch.isfinite(flat(sums_without)).all()
    assert torch.isfinite(flat(sums_with)).all(), f"{path}: the outlier made the clipped sum non-finite"
    torch.testing.assert_close(norms_with[:NORMAL], norms_without, rtol=1e-5, atol=1e-6)
    change = float((flat(sums_with) - flat(sums_without)).norm())
    assert change <= CLIP * (1 + 1e-4) + 1e-5, (
        f"{path}: one example moved the clipped sum by {change / CLIP:.3g} C"
    )
    if OUTLIERS[outlier][2] == "clipped":  # a finite gradient is clipped to C, not dropped
        assert change >= CLIP * (1 - 1e-3), f"{path}: the outlier contributed {change / CLIP:.3g} C, not C"
        assert not math.isnan(float(norms_with[NORMAL]))
    else:
        assert change <= 1e-5


def test_clip_factors_rule():
    norms = torch.tensor([0.0, 0.25, 0.5, 2.0, 1e30, math.inf, math.nan, -math.nan], dtype=torch.float64)
    clip_factors = privatizer.clip_factors
    factors = clip_factors(norms, 0.5)
    assert factors.dtype == torch.float32
    expected = torch.tensor([1.0, 1.0, 1.0, 0.25, 0.5e-30, 0.0, 0.0, 0.0])
    torch.testing.assert_close(factors, expected, rtol=1e-6, atol=0.0)
    # a float64 norm beyond float32's range is clipped in float64 ...
    assert clip_factors(torch.tensor([1e37], dtype=torch.float64), 1.0).item() == pytest.approx(
        1e-37, rel=1e-6
    )
    # ... unless its factor is below float32's normal range: a denormal factor is imprecise, so it is dropped
    assert clip_factors(torch.tensor([1e40, 1e300], dtype=torch.float64), 1.0).tolist() == [0.0, 0.0]
    # C = inf (no clipping, sigma = 0 checks) keeps every finite example and still drops non-finite ones
    torch.testing.assert_close(
        clip_factors(torch.tensor([0.0, 3.0, 1e38, math.inf, math.nan]), math.inf),
        torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0]),
    )


def test_ghost_and_privatizer_share_the_clip_rule():
    assert ghost.clip_factors is privatizer.clip_factors


def test_overflowing_squared_norm_of_a_finite_gradient_is_clipped_in_clip_and_sum():
    """Entries ~1e20: ||g||^2 ~ 1e40 overflows float32, the norm itself does not."""
    g = torch.zeros(3, 4, 5)
    g[0] = 1.0
    g[1, 0, 0], g[1, 1, 1] = 3e20, -4e20  # norm 5e20
    g[2] = 1e-3
    sums, norms = clip_and_sum([g], Geometry(1.0))
    torch.testing.assert_close(norms, torch.tensor([math.sqrt(20.0), 5e20, math.sqrt(20.0) * 1e-3]))
    expected = g[0] / math.sqrt(20.0) + g[1] / 5e20 + g[2]
    torch.testing.assert_close(sums[0], expected)


def test_nonfinite_gradient_entries_contribute_zero_in_clip_and_sum():
    g = torch.randn(4, 6)
    h = torch.randn(4, 3)
    g[1, 2] = math.inf
    h[2, 0] = math.nan
    sums, norms = clip_and_sum([g, h], Geometry(1.0))
    assert not torch.isfinite(norms[1:3]).any()
    keep = torch.tensor([0, 3])
    expected, _ = clip_and_sum([g[keep], h[keep]], Geometry(1.0))
    for s, e in zip(sums, expected):
        torch.testing.assert_close(s, e)


def test_a_float32_gram_underflow_does_not_under_clip():
    """Output gradients ~1e-23 times inputs ~2e18: G_i ~ 1e-5 per position, ||G_i|| ~ 3 C.

    The float32 Gram matrix of such gradients is denormal (~1e-45: a few bits, or 0), while the
    inputs' Gram stays finite, so no inf flags the example: the float32 ghost norm came out ~4x too
    small and the example passed with factor 1, three times C.
    """
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(NORMAL + 1, 8, 32, generator=generator)
    output_grads = torch.randn(NORMAL + 1, 8, 16, generator=generator)
    inputs[NORMAL] *= 2e18
    output_grads[NORMAL] *= 1e-23
    true_norm = float(
        torch.bmm(output_grads[NORMAL:].double().transpose(1, 2), inputs[NORMAL:].double()).norm()
    )
    clip = true_norm / 3

    def clipped_sum(n: int):
        model = torch.nn.Linear(32, 16, bias=False)
        clipping = attach_fast_clipping(model, mode="ghost", layer_strategy="ghost")
        (model(inputs[:n]) * output_grads[:n]).sum().backward()  # d loss_i / d output_i = output_grads[i]
        result = clipping.clipped_sum([model.weight], Geometry(clip))
        clipping.remove()
        return result

    (with_outlier,), norms = clipped_sum(NORMAL + 1)
    (without,), _ = clipped_sum(NORMAL)
    assert float(norms[NORMAL]) == pytest.approx(true_norm, rel=1e-5)
    change = float((with_outlier.double() - without.double()).norm())
    assert change == pytest.approx(clip, rel=1e-4)


@pytest.mark.parametrize("positions", [1, 8], ids=["one_position", "gram"])
@pytest.mark.parametrize("exponent", [0, -30, -45, -48, -49.5, -50, -51, -60, -75, -90])
def test_gram_diagonal_witnesses_never_clear_a_tiny_factor(exponent, positions):
    """The underflow test skips the exact maxima only when the norms' own Gram diagonals witness that
    no factor is tiny. Across scales around the threshold (2^-50), for output gradients (width 16)
    and for inputs (width 32), with the other factor huge: the witnesses clear exactly the cases in
    which every factor's exact maximum is above 2^-50, so the risk found is the exact test's."""
    from dp_hf.per_example.ghost import kernels, norms

    generator = torch.Generator().manual_seed(0)
    for tiny in ("grads", "inputs"):
        inputs = torch.randn(NORMAL + 1, positions, 32, generator=generator)
        output_grads = torch.randn(NORMAL + 1, positions, 16, generator=generator)
        small, large = (output_grads, inputs) if tiny == "grads" else (inputs, output_grads)
        small[NORMAL] *= 2.0**exponent
        large[NORMAL] *= 2.0**30
        model = torch.nn.Linear(32, 16, bias=False)
        clipping = attach_fast_clipping(model, mode="ghost", layer_strategy="ghost")
        (model(inputs) * output_grads).sum().backward()
        record = clipping.recorder.records[id(model.weight)]
        grams = kernels.GramCache()
        norms.identity_sq_norms(record, NORMAL + 1, 1 << 30, torch.float32, grams)
        outer = record.outers[0]
        exact_maxima = [kernels._max_abs(outer.rows), kernels._max_abs(outer.cols)]
        all_large = bool(torch.stack(exact_maxima).min() >= 2.0**-50)
        cleared = kernels._witnesses_clear(
            {kernels.tensor_key(f): f for f in (outer.rows, outer.cols)}, grams.diagonal_maxima
        )
        assert len(grams.diagonal_maxima) == 2  # both factors witnessed by the norm's own Grams
        if exponent >= -45:
            assert cleared, (tiny, exponent)  # ordinary and moderately small scales skip the exact test
        if cleared:
            assert all_large, (tiny, exponent)
        risk = kernels.gram_underflow_risk([outer], grams.diagonal_maxima)
        exact = kernels.gram_underflow_risk([outer])
        assert torch.equal(risk if risk is not None else torch.zeros_like(exact), exact), (tiny, exponent)
        clipping.remove()


def test_an_ordinary_clipping_pass_does_not_read_the_factors_for_the_underflow_test():
    """With ordinary magnitudes the Gram diagonals clear every factor of the tiny BERT: the exact
    per-example maxima (``amin`` over each factor, on the CPU) are not computed."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = tiny_bert_classifier()
    clipping = attach_fast_clipping(model)
    batch = tiny_text_batch(batch_size=6)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    F.cross_entropy(logits, batch["labels"], reduction="sum").backward()
    params = [p for p in model.parameters() if p.requires_grad]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        clipping.clipped_sum(params, Geometry(CLIP))
    clipping.remove()
    assert not [e for e in prof.events() if e.name == "aten::amin"]


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_cancelling_huge_positions_do_not_overflow_the_book_keeping_product(mode):
    """Two positions with the same input ~1e10 and opposite output gradients ~1e30: G_i = 0 exactly.

    The example's norm is 0 (factor 1), but each position's product is ~1e40: the float32 matmul
    sum_i f_i g_i^T a_i overflowed to inf - inf = NaN, poisoning the whole clipped sum.
    """
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(NORMAL + 1, 2, 32, generator=generator)
    output_grads = torch.randn(NORMAL + 1, 2, 16, generator=generator)
    inputs[NORMAL, 1] = inputs[NORMAL, 0] = 1e10 * torch.randn(32, generator=generator)
    output_grads[NORMAL, 0] = 1e30 * torch.randn(16, generator=generator)
    output_grads[NORMAL, 1] = -output_grads[NORMAL, 0]

    def clipped_sum(n: int):
        model = torch.nn.Linear(32, 16, bias=False)
        clipping = attach_fast_clipping(model, mode=mode, layer_strategy="ghost")
        (model(inputs[:n]) * output_grads[:n]).sum().backward()
        result = clipping.clipped_sum([model.weight], Geometry(CLIP))
        clipping.remove()
        return result

    (with_outlier,), norms = clipped_sum(NORMAL + 1)
    (without,), _ = clipped_sum(NORMAL)
    assert torch.isfinite(with_outlier).all()
    assert float(norms[NORMAL]) <= CLIP
    assert float((with_outlier.double() - without.double()).norm()) <= CLIP


# --------------------------------------------------------------------------------------------------
# Full optimizer steps at sigma = 0
# --------------------------------------------------------------------------------------------------

STEP_CASES = [
    (optimizer, hooks, outlier)
    for optimizer, hooks in [
        ("dp-sgd", "opacus"),
        ("dp-sgd", "fast"),  # ghost
        ("dp-adamw", "fast"),  # ghost
        ("dp-microadam", "opacus"),
        ("dp-microadam", "fast"),  # ghost
        ("dp-macadam", "opacus"),
        ("dp-macadam", "fast"),  # layer-wise materialization in its adaptive geometry
    ]
    for outlier in ("regression_label_1e25", "regression_label_nan", "image_scaled_1e19")
    if outlier != "image_scaled_1e19" or (hooks == "fast" and optimizer != "dp-macadam")  # see GRAM_PATHS
]


def one_step(name: str, hooks: str, outlier: str, n: int):
    """One sigma = 0 step on the first ``n`` examples: ``(parameters, w-coordinates of gtilde * B)``."""
    factory, losses, _ = OUTLIERS[outlier]
    model = factory()
    params = trainable(model)
    clip = 1.0 if "macadam" in name else CLIP  # DP-MacAdam clips to 1 in its geometry
    extra = dict(density=0.5) if name == "dp-microadam" else {}
    optimizer = create_dp_optimizer(
        name,
        params,
        lr=1e-2,
        noise_multiplier=0.0,
        max_grad_norm=clip,
        expected_batch_size=NORMAL + 1,
        **extra,
    )
    geometry = optimizer.current_geometry(params)  # the step's (c, s): gtilde = s * sum / B + c
    scales = [torch.ones(()) if s is None else s.clone() for s in geometry.scale or [None] * len(params)]
    if hooks == "opacus":
        handle = attach_grad_sample(model)
        losses(model, n).sum().backward()
        optimizer.step()
        handle.remove()
    else:
        mode, fast = ghost.resolve_per_sample_gradient_mode("auto", optimizer, model)
        assert fast and mode == ("materialize" if name == "dp-macadam" else "ghost")
        clipping = attach_fast_clipping(model, mode=mode)
        losses(model, n).sum().backward()
        clipping.accumulate(optimizer)
        optimizer.step()
        clipping.remove()
    after = {key: p.detach().clone() for key, p in model.named_parameters()}
    return after, [p.grad.double() * (NORMAL + 1) / s for p, s in zip(params, scales)], clip


@pytest.mark.parametrize(("optimizer", "hooks", "outlier"), STEP_CASES)
def test_an_optimizer_step_with_an_outlier_is_bounded_and_finite(optimizer, hooks, outlier):
    after, released, clip = one_step(optimizer, hooks, outlier, NORMAL + 1)
    bad = [key for key, value in after.items() if not torch.isfinite(value).all()]
    assert not bad, f"non-finite parameters after one step: {bad[:5]}"
    _, reference, _ = one_step(optimizer, hooks, outlier, NORMAL)
    # sigma = 0, same expected batch B: B (gtilde_with - gtilde_without) / s is the outlier's clipped w
    change = float((flat(released) - flat(reference)).norm())
    assert change <= clip * (1 + 1e-4) + 1e-5, (
        f"the outlier moved the released gradient by {change / clip:.3g} C"
    )
    if OUTLIERS[outlier][2] == "clipped":
        assert change >= clip * (1 - 1e-3), f"the outlier contributed {change / clip:.3g} C, not C"


# --------------------------------------------------------------------------------------------------
# Data parallelism: every rank clips with the same rule before the all-reduce
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hooks", ["opacus", "ghost"])
def test_the_all_reduced_clipped_sum_stays_finite_and_bounded(monkeypatch, hooks):
    reduced = []

    def all_reduce(tensor, op=None):  # a process group of one rank: record what would be sent
        reduced.append(tensor.clone())

    monkeypatch.setattr(privatizer.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(privatizer.dist, "get_rank", lambda: 0)

    def rank_buffer(n: int) -> torch.Tensor:
        factory, losses, _ = OUTLIERS["regression_label_nan"]
        model = factory()
        params = trainable(model)
        noise = NoiseSource(seed=0)
        private = Privatizer(0.0, NORMAL + 1, noise, distributed=True)
        assert private.distributed
        if hooks == "opacus":
            handle = attach_grad_sample(model)
            losses(model, n).sum().backward()
            private.accumulate([p.grad_sample for p in params], Geometry(CLIP))
            handle.remove()
        else:
            clipping = attach_fast_clipping(model, mode="ghost")
            losses(model, n).sum().backward()
            sums, norms = clipping.clipped_sum(params, Geometry(CLIP))
            private.accumulate_clipped_sum(sums, int(norms.shape[0]))
            clipping.remove()
        private.release(params, Geometry(CLIP))
        return reduced.pop()

    with_outlier, without = rank_buffer(NORMAL + 1), rank_buffer(NORMAL)
    assert torch.isfinite(with_outlier).all()
    assert float((with_outlier.double() - without.double()).norm()) <= 1e-5


# --------------------------------------------------------------------------------------------------
# Black box: DPTrainer
# --------------------------------------------------------------------------------------------------

DATA_SIZE = 12


def regression_data(outlier: float | None) -> datasets.Dataset:
    """DATA_SIZE examples; with ``outlier`` the last one's label is replaced by it."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 60, (DATA_SIZE, 8), generator=g)
    labels = torch.randn(DATA_SIZE, generator=g)
    if outlier is not None:
        labels[-1] = outlier
    return datasets.Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": [[1] * 8] * DATA_SIZE, "labels": labels.tolist()}
    )


def train_regression(tmp_path, outlier, mode, monkeypatch):
    from dp_training import dp_args, params_of

    if mode == "opacus":  # force dp_hf.grad_sample (Opacus hooks) + clip_and_sum
        monkeypatch.setattr(ghost, "unsupported_modules", lambda model: [("", "", "forced")])
    args = dp_args(
        tmp_path,
        per_device_train_batch_size=DATA_SIZE,  # sample rate 1: every example in the one step
        gradient_accumulation_steps=1,
        max_steps=1,
        learning_rate=0.1,
        noise_multiplier=0.0,
        per_sample_max_grad_norm=CLIP,
        dp_optimizer="dp-sgd",
        per_sample_gradient_mode="auto" if mode == "ghost" else "materialize",
    )
    trainer = DPTrainer(
        model=tiny_bert_classifier(num_labels=1), args=args, train_dataset=regression_data(outlier)
    )
    trainer.train()
    monkeypatch.undo()
    assert trainer.state.global_step == 1
    return trainer, params_of(trainer.model)


@pytest.mark.parametrize("outlier", [1e25, math.inf])
@pytest.mark.parametrize("mode", ["ghost", "materialize", "opacus"])
def test_trainer_with_an_overflowing_regression_label(tmp_path, monkeypatch, mode, outlier):
    trainer, with_outlier = train_regression(tmp_path / "with", outlier, mode, monkeypatch)
    expected_mode = "materialize" if mode == "opacus" else mode
    assert trainer.per_sample_gradient_mode == expected_mode
    assert (trainer.fast_clipping is None) == (mode == "opacus")
    bad = [name for name, value in with_outlier.items() if not torch.isfinite(value).all()]
    assert not bad, f"non-finite parameters after training: {bad[:5]}"
    lr, batch = 0.1, DATA_SIZE  # sample rate 1, sigma = 0: one step of DP-SGD moves by lr * sum / B
    if outlier == math.inf:  # dropped: against the run with an ordinary label there, at most 2 lr C / B apart
        _, reference = train_regression(tmp_path / "without", None, mode, monkeypatch)
        change = float(flat([with_outlier[k] - reference[k] for k in reference]).norm())
        assert change <= 2 * lr * CLIP / batch * (1 + 1e-3) + 1e-6, change
    else:  # clipped to C like any large label: 1e25 and 1e15 give the same direction, so the same step
        _, reference = train_regression(tmp_path / "large", 1e15, mode, monkeypatch)
        change = float(flat([with_outlier[k] - reference[k] for k in reference]).norm())
        assert change <= 1e-4 * lr * CLIP / batch, change


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_row_maxima_of_the_underflow_test_are_exact_and_keep_nan(device):
    import dp_hf.per_example.ghost.kernels as kernels

    x = torch.tensor(
        [[1.0, -3.0, 2.0], [-0.0, 0.0, -1e-40], [float("nan"), 1.0, -5.0], [-float("inf"), 1.0, 2.0]],
        device=device,
    )
    out = kernels._max_abs(x)
    assert torch.equal(out[[0, 1, 3]].cpu(), torch.tensor([3.0, 1e-40, float("inf")]))
    assert torch.isnan(out[2])
    # A strided [B, T, d] factor (attention's key gradient is [B, d, T] transposed): every position.
    factor = torch.randn(4, 3, 5, device=device).transpose(1, 2)
    factor[2, 4, 1] = -100.0
    assert torch.equal(kernels._max_abs(factor), factor.abs().reshape(4, -1).amax(dim=1))


def _alternating(batch: int, positions: int, width: int, big: float = 8192.0) -> torch.Tensor:
    """Per position ``(-1)^t big e0 + e1``: summed over positions, the big parts cancel."""
    x = torch.zeros(batch, positions, width)
    x[:, :, 0] = big * (-1.0) ** torch.arange(positions)
    x[:, :, 1] = 1.0
    return x


class _TwoLinears(torch.nn.Module):
    """Two Linear layers reading the same input (as q and k do): their ghost norms share a bank."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


@pytest.mark.parametrize(
    "case",
    [
        "cancelling_positions",
        "underflow_with_a_decoy",
        "cancelling_embedding_rows",
        "cancelling_positions_in_a_bank",
        "underflow_with_a_decoy_in_a_bank",
    ],
)
def test_a_float32_ghost_norm_lost_to_cancellation_or_underflow_is_redone(case):
    """Float32 Gram norms can lose all of ``||G_i||^2`` with no inf, NaN or negative value to flag them:
    Gram entries +-2^26 + 1 round to +-2^26 and the norm came out exactly 0 (``||G_i|| = 256``: 256 C
    released); factors 2^59 and 2^-76 with one 2^-49 entry (past the underflow test's maxima) flushed the
    products to 0 (6 C). Examples below ``CANCELLATION_GUARD`` times the position-norm mass are redone in
    float64 (found by an audit of the tensor-core path, which shares these Grams). ``in_a_bank``: the
    mass then comes from the bank's Gram diagonals, whose squares of ``2^-76`` flush to 0 as well."""
    generator = torch.Generator().manual_seed(0)
    if (
        case == "cancelling_embedding_rows"
    ):  # one id repeated, its gradients cancelling, in a bank with a Linear
        model = torch.nn.Sequential(torch.nn.Embedding(10, 16), torch.nn.Linear(16, 16, bias=False))
        with torch.no_grad():
            model[1].weight.copy_(torch.eye(16))  # the embedding's output gradient is grads itself
        inputs = torch.full((2, 32), 3)
        inputs[1] = torch.randint(0, 10, (32,), generator=generator)
        grads = _alternating(2, 32, 16)
        grads[1] = torch.randn(32, 16, generator=generator)
        reference = copy.deepcopy(model).double()
        per_example = []
        for i in range(2):
            reference.zero_grad()
            (reference(inputs[i : i + 1]) * grads[i : i + 1].double()).sum().backward()
            per_example.append(torch.cat([p.grad.flatten() for p in reference.parameters()]))
        per_example = torch.stack(per_example)
    else:
        model = _TwoLinears() if case.endswith("in_a_bank") else torch.nn.Linear(64, 64, bias=False)
        if case.startswith("cancelling_positions"):
            inputs, grads = torch.ones(2, 32, 64), _alternating(2, 32, 64)
        else:
            inputs, grads = torch.full((2, 32, 64), 2.0**59), torch.full((2, 32, 64), 2.0**-76)
            inputs[0, 0], grads[0, 0] = 0.0, 0.0
            grads[0, 0, 0] = 2.0**-49
        inputs[1] = torch.randn(32, 64, generator=generator)
        grads[1] = torch.randn(32, 64, generator=generator)
        per_example = torch.einsum("bto,bti->boi", grads.double(), inputs.double())
        if case.endswith("in_a_bank"):  # both layers' gradients are this one
            per_example = torch.cat([per_example, per_example], dim=1)
    true = per_example.flatten(1).norm(dim=1)
    clip = float(true[0]) / 2
    clipping = attach_fast_clipping(model, mode="ghost", layer_strategy="ghost")
    (model(inputs) * grads).sum().backward()
    _, norms = clipping.clipped_sum(list(model.parameters()), Geometry(clip))
    clipping.remove()
    torch.testing.assert_close(norms.double(), true, rtol=1e-6, atol=0)


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_a_large_dense_record_norm_is_summed_accurately(mode):
    """A layer recorded dense (``G_i`` itself, over 1 MiB: LoRA's small matrices, ``layer_strategy=
    "materialize"``) takes its norm when recorded. On the CPU that was ``torch.linalg.vector_norm``, which
    adds each SIMD lane's squares in order: ``G_i`` = 4096 then 2^22 - 1 ones (exact in float32) lost ~2.5%
    of its squared norm, and the example was clipped to ~1.013 C. Cascade sums keep float32's ~1e-7.
    ``materialize``: a geometry's path (DP-MacAdam, scale-then-privatize), which forms ``G_i`` in the pass."""
    width = 2048
    model = torch.nn.Linear(width, width, bias=False)
    inputs, grads = torch.ones(2, 2, width), torch.ones(2, 2, width)  # G_0 = ones ...
    inputs[0, 1], grads[0, 1] = 0.0, 0.0
    inputs[0, 1, 0], grads[0, 1, 0] = 4095.0, 1.0  # ... + 4095 e_0 e_0^T: G_0[0, 0] = 4096
    generator = torch.Generator().manual_seed(0)
    inputs[1], grads[1] = (
        torch.randn(2, width, generator=generator),
        torch.randn(2, width, generator=generator),
    )
    per_example = torch.einsum("bto,bti->boi", grads.double(), inputs.double())
    true = per_example.flatten(1).norm(dim=1)
    assert float(true[0]) ** 2 == 4096.0**2 + width * width - 1
    # ghost: G_i kept dense and its norm taken when recorded; materialize: kept as (a_i, g_i), and G_i
    # formed in the clipping pass
    layer_strategy = "materialize" if mode == "ghost" else "ghost"
    clipping = attach_fast_clipping(model, mode=mode, layer_strategy=layer_strategy)
    (model(inputs) * grads).sum().backward()
    (record,) = clipping.recorder.records.values()
    assert (record.dense_sq_norms is not None) == (mode == "ghost") and bool(record.outers) == (
        mode != "ghost"
    )
    clip = float(true[0]) / 2
    sums, norms = clipping.clipped_sum(list(model.parameters()), Geometry(clip))
    clipping.remove()
    torch.testing.assert_close(norms.double(), true, rtol=1e-6, atol=0)
    contribution = per_example[0] * float(privatizer.clip_factors(norms, clip)[0])
    assert float(contribution.norm()) <= clip * (1 + 1e-6)


@pytest.mark.parametrize("overwrite", [False, True])
def test_example_sq_norms_of_every_shape(overwrite, monkeypatch):
    """One squared norm per example whatever the rank (a scalar parameter's ``G_i`` is ``[B]``), and the same
    values when the CPU sums in chunks of examples."""
    from dp_hf.per_example.ghost import kernels

    generator = torch.Generator().manual_seed(0)
    for shape in [(5,), (5, 3), (5, 3, 4)]:
        x = torch.randn(shape, generator=generator)
        expected = x.double().reshape(5, -1).pow(2).sum(dim=1)
        for chunk_bytes in (1 << 22, 4):  # one chunk; one example per chunk
            monkeypatch.setattr(kernels, "SQUARES_CHUNK_BYTES", chunk_bytes)
            got = kernels.example_sq_norms(x.clone(), overwrite=overwrite)
            assert got.shape == (5,)
            torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("scaled", [False, True])
def test_a_shifted_embedding_norm_does_not_cancel(scaled):
    """A geometry's embedding norm is ``||c/s||^2`` plus, per row the example touches, ``||(r - c_u)/s_u||^2 -
    ||c_u/s_u||^2``. With ``c/s`` on that row (``||c_u|| = 2^19``) and ``r - c_u`` of norm ``2 C``, float32
    cancelled to a norm of 0 and the example was released unclipped (2 C). Values are exact in float32."""
    vocab, width, positions = 50, 64, 8
    model = torch.nn.Embedding(vocab, width)
    generator = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (2, width), generator=generator).float() * 2 - 1
    c_row, delta = signs[0] * 2.0**16, signs[1] / 8  # ||delta|| = 1
    inputs = torch.full((2, positions), 3)
    inputs[1] = torch.randint(4, vocab, (positions,), generator=generator)
    grads = torch.randn(2, positions, width, generator=generator)
    grads[0] = ((c_row + delta) / positions).expand(positions, width)  # G_0's row 3: c_row + delta
    shift = torch.zeros(vocab, width)
    shift[3] = c_row
    scale = torch.full((vocab, width), 2.0) if scaled else None
    clip = 0.5
    clipping = attach_fast_clipping(model, mode="materialize", layer_strategy="ghost")
    (model(inputs) * grads).sum().backward()
    geometry = Geometry(clip, shift=[shift], scale=[scale] if scaled else None)
    sums, norms = clipping.clipped_sum([model.weight], geometry)
    clipping.remove()
    w = torch.zeros(2, vocab, width, dtype=torch.float64)  # G_i, exact in float64, then (G_i - c) / s
    for i in range(2):
        w[i].index_add_(0, inputs[i], grads[i].double())
    c_over_s = shift.double() / (scale.double() if scaled else 1)
    w = w / (scale.double() if scaled else 1) - c_over_s
    true = w.flatten(1).norm(dim=1)
    assert float(true[0]) == 1 / (2 if scaled else 1)
    torch.testing.assert_close(norms.double(), true, rtol=1e-6, atol=0)
    factors = privatizer.clip_factors(true, clip).double()
    expected = torch.einsum("i,ivd->vd", factors, w)
    # the book-keeping sum, sum_i f_i G_i - (sum_i f_i) c, may round at u (sum_i f_i) |c / s| entrywise
    bound = float(factors.sum()) * float(c_over_s.abs().max()) * 2.0**-23
    torch.testing.assert_close(sums[0].double(), expected, rtol=0, atol=bound)


def _released(model_fn, inputs, grads, geometry_fn, mode, n=None):
    """The clipped sum (flat, float64) of the first ``n`` examples (all: None), layers as ghost outers."""
    model = model_fn()
    clipping = attach_fast_clipping(model, mode=mode, layer_strategy="ghost")
    (model(inputs[:n]) * grads[:n]).sum().backward()
    params = [p for p in model.parameters() if p.requires_grad]
    sums, norms = clipping.clipped_sum(params, geometry_fn(params))
    clipping.remove()
    return torch.cat([s.double().flatten() for s in sums]), norms


def _true_norms(model_fn, inputs, grads):
    reference = model_fn().double()
    norms = []
    for i in range(inputs.shape[0]):
        reference.zero_grad()
        x = inputs[i : i + 1].double() if inputs.is_floating_point() else inputs[i : i + 1]
        (reference(x) * grads[i : i + 1].double()).sum().backward()
        grads_i = [p.grad.flatten() for p in reference.parameters() if p.requires_grad and p.grad is not None]
        norms.append(torch.cat(grads_i).norm())
    return torch.stack(norms)


def _cancelling_positions(layer):
    """24 examples with ``G_i = e_00`` (norm 1, unclipped), then one whose positions' gradients are ``(2^28, 16,
    -2^28)`` at entry ``(0, 0)``: ``||G|| = 16``, but a float32 sum over its positions makes ``G^_i`` 0."""
    normal, positions, width = 24, 3, 8
    big = 2.0**24 * 16.0
    grads = torch.zeros(normal + 1, positions, width)
    grads[:normal, 0, 0] = 1.0
    grads[normal, :, 0] = torch.tensor([big, 16.0, -big])
    if layer == "linear":
        inputs = torch.zeros(normal + 1, positions, width)
        inputs[:, :, 0] = 1.0
        return lambda: torch.manual_seed(1) and torch.nn.Linear(width, width, bias=False), inputs, grads
    inputs = torch.full((normal + 1, positions), 3)
    return lambda: torch.manual_seed(1) and torch.nn.Embedding(10, width), inputs, grads


def _absorbed_width(layer):
    """Gram entries ``+-3.6e7 + 127 * 1.96`` over a width of 128: a float32 dot product absorbs every 1.96. The
    weight's ``||G||^2`` (~7e-6 of the position-norm mass, above the former 2^-20 guard) came out 0, and the
    bias's exact norm kept the example's total above that guard."""
    positions, width = 32, 128
    generator = torch.Generator().manual_seed(1)
    grads = torch.zeros(2, positions, width)
    grads[0, :, 0] = 6000.0 * (-1.0) ** torch.arange(positions)
    grads[0, :, 1:] = 1.4
    grads[1] = torch.randn(positions, width, generator=generator)
    if layer == "linear":
        inputs = torch.zeros(2, positions, width)
        inputs[0, :, :3] = 0.25
        inputs[1] = torch.randn(positions, width, generator=generator)
        return lambda: torch.manual_seed(0) and torch.nn.Linear(width, width), inputs, grads

    class TwoEmbeddingsAndABias(torch.nn.Module):  # two embeddings: banked together (one wave of Grams)
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.emb2 = torch.nn.Embedding(10, width), torch.nn.Embedding(10, width)
            self.lin = torch.nn.Linear(1, width)  # its bias: a dense tensor outside the bank
            self.lin.weight.requires_grad_(False)

        def forward(self, ids):
            extra = self.lin(torch.ones(ids.shape[0], 1, 1, dtype=self.lin.bias.dtype))
            return torch.cat([self.emb(ids) + self.emb2(ids), extra], dim=1)

    inputs = torch.full((2, positions), 3)
    inputs[1] = torch.randint(0, 10, (positions,), generator=generator)
    total = positions * (6000.0**2 + 127 * 1.96) ** 0.5
    bias_grad = torch.zeros(2, 1, width)
    bias_grad[0, 0, 0] = (2.0**-20 * 2 * total**2) ** 0.5 * 1.001  # just above the former guard
    bias_grad[1, 0] = torch.randn(width, generator=generator)
    return TwoEmbeddingsAndABias, inputs, torch.cat([grads, bias_grad], dim=1)


@pytest.mark.parametrize(
    "construction, layer, mode",
    [
        ("cancelling_positions", "linear", "materialize"),
        ("cancelling_positions", "embedding", "materialize"),
        ("cancelling_positions", "linear", "materialize_scaled"),
        ("cancelling_positions", "embedding", "materialize_scaled"),
        ("cancelling_positions", "linear", "ghost"),
        ("absorbed_width", "linear", "ghost"),
        ("absorbed_width", "embedding", "ghost"),
        ("absorbed_width", "linear", "materialize"),
    ],
)
def test_a_norm_lost_to_float32_rounding_is_redone_on_every_path(construction, layer, mode):
    """Black box: the clipped sum with and without the last example differs by at most ``C``. Materialize mode
    (DP-MacAdam, scale-then-privatize) formed ``G^_i`` by a float32 sum over the example's positions and had no
    cancellation guard: the cancelling example's norm was 0, and adding it changed the sum by 40 C. Ghost
    norms whose Gram entries absorbed the small terms of a width released 2.8 C (Linear with a bias) and 2.9 C
    (two banked embeddings beside a bias). Both paths now redo an example in float64 below
    ``GUARD_MARGIN`` times its worst-case float32 rounding error."""
    model_fn, inputs, grads = (
        _cancelling_positions if construction == "cancelling_positions" else _absorbed_width
    )(layer)
    true = _true_norms(model_fn, inputs, grads)
    clip = 1.0 if construction == "cancelling_positions" else float(true[0]) / 8
    if mode == "materialize_scaled":

        def geometry(params):
            return Geometry(
                clip,
                shift=[torch.zeros_like(p) for p in params],
                scale=[torch.full_like(p, 2.0) for p in params],
            )

        true = true / 2
    else:

        def geometry(params):
            return Geometry(clip)

    path = "ghost" if mode == "ghost" else "materialize"
    with_it, norms = _released(model_fn, inputs, grads, geometry, path)
    without, _ = _released(model_fn, inputs, grads, geometry, path, n=inputs.shape[0] - 1)
    outlier = -1 if construction == "cancelling_positions" else 0
    torch.testing.assert_close(norms[outlier].double(), true[outlier], rtol=1e-6, atol=0)
    if construction == "cancelling_positions":  # the outlier is the one left out
        assert float((with_it - without).norm()) <= clip * (1 + 1e-6)


@pytest.mark.parametrize("shifted", [False, True])
def test_a_materialized_norm_that_rounding_hides_in_w_coordinates_is_redone(shifted):
    """Materialize mode's guard on ``||G_i||`` alone let a decoy hide a cancellation in ``w`` coordinates: positions
    ``(2^28, 16, -2^28)`` at entry ``(0, 0)``, where ``s = 2^-20`` (or the shift cancels the decoy), and a decoy
    ``2^20`` at ``(1, 1)`` that keeps ``||G^_i||`` above the guard. The computed ``||w_i||`` was ``2^20`` against a
    true ``2^24``: 16 C released. The guard now also compares ``||w_i||`` with ``G^_i``'s error in w coordinates."""
    width, big, decoy = 8, 2.0**28, 2.0**20
    inputs, grads = torch.zeros(2, 4, width), torch.zeros(2, 4, width)
    inputs[:, :3, 0] = 1.0
    grads[0, :3, 0] = torch.tensor([big, 16.0, -big])
    inputs[:, 3, 1], grads[0, 3, 1] = 1.0, decoy
    grads[1, 0, 0] = 1.0  # a normal example: G = e_00

    def model_fn():
        torch.manual_seed(0)
        return torch.nn.Linear(width, width, bias=False)

    scale = torch.ones(width, width)
    shift = torch.zeros(width, width)
    if shifted:  # the shift cancels the decoy in w: what is left is the hidden 16
        shift[1, 1] = decoy
        expected = 16.0
    else:
        scale[0, 0] = 2.0**-20
        expected = float(torch.tensor([16.0 * 2**20, decoy]).norm())
    clip = expected / 4

    def geometry(params):
        return Geometry(clip, shift=[shift], scale=[scale])

    with_it, norms = _released(model_fn, inputs, grads, geometry, "materialize")
    assert float(norms[0]) == pytest.approx(expected, rel=1e-6)
    without, _ = _released(model_fn, inputs[1:], grads[1:], geometry, "materialize")
    assert float((with_it - without).norm()) <= clip * (1 + 1e-6)
