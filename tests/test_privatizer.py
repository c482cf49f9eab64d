"""The one privatizer (ALGORITHMS.md §1): clipping geometry, noise, division by the expected batch."""

from __future__ import annotations

import math

import pytest
import torch

from dp_hf.optim import OPTIMIZERS, create_dp_optimizer
from dp_hf.optim.sgd import DPSGD
from dp_hf.privatizer import Geometry, RankSteps, clip_and_sum, step_slots

SHAPES = [(4, 3), (5,), (2, 2, 2)]


def per_example(batch: int, seed: int = 0, spread: float = 3.0) -> list[torch.Tensor]:
    """Per-example grads whose norms vary over a wide range (some below C, some above)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.logspace(-1, math.log10(spread) + 1, batch)
    grads = [torch.randn((batch, *s), generator=gen) for s in SHAPES]
    flat = torch.cat([g.reshape(batch, -1) for g in grads], 1)
    factors = sizes / flat.norm(dim=1)
    return [g * factors.view(-1, *([1] * (g.dim() - 1))) for g in grads]


def make_params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]


def sgd(params, **kw) -> DPSGD:
    kw = dict(dict(lr=0.0, noise_multiplier=0.0, max_grad_norm=math.inf, expected_batch_size=8), **kw)
    return DPSGD(params, **kw)


# ---------------------------------------------------------------------- clipping
@pytest.mark.parametrize("geometry_kind", ["identity", "shift_scale"])
def test_every_clipped_example_has_norm_at_most_c_in_its_geometry(geometry_kind):
    batch, clip = 12, 1.5
    grads = per_example(batch)
    gen = torch.Generator().manual_seed(1)
    if geometry_kind == "identity":
        geometry = Geometry(max_grad_norm=clip)
        shift = [torch.zeros(s) for s in SHAPES]
        scale = [torch.ones(s) for s in SHAPES]
    else:
        shift = [0.02 * torch.randn(s, generator=gen) for s in SHAPES]
        scale = [torch.rand(s, generator=gen) + 0.2 for s in SHAPES]
        geometry = Geometry(max_grad_norm=clip, shift=shift, scale=scale)
    clipped_total = [torch.zeros(s) for s in SHAPES]
    n_clipped = 0
    for i in range(batch):
        sums, norms = clip_and_sum([g[i : i + 1] for g in grads], geometry)
        w = torch.cat([((g[i] - c) / s).flatten() for g, c, s in zip(grads, shift, scale)])
        torch.testing.assert_close(norms, w.norm().reshape(1))
        out = torch.cat([s.flatten() for s in sums])
        factor = min(1.0, clip / w.norm().item())
        n_clipped += factor < 1
        assert out.norm() <= clip * (1 + 1e-6)
        torch.testing.assert_close(out, w * factor)  # the factor, read through the norms
        for total, s in zip(clipped_total, sums):
            total += s
    assert 0 < n_clipped < batch  # both sides of min(1, C/||w||) were exercised
    sums, norms = clip_and_sum(grads, geometry)
    for total, s in zip(clipped_total, sums):
        torch.testing.assert_close(s, total)
    assert norms.shape == (batch,)


def test_sigma0_cinf_gives_the_exact_mean_gradient():
    params = make_params()
    opt = sgd(params, expected_batch_size=8)
    grads = per_example(8)
    for p, g in zip(params, grads):
        p.grad_sample = g.clone()
    opt.step()
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g.sum(0) / 8, rtol=1e-6, atol=1e-7)


def test_division_is_by_the_expected_batch_size():
    grads = per_example(3)  # realized batch 3
    outs = {}
    for expected in (10.0, 20.0):
        params = make_params()
        opt = sgd(params, expected_batch_size=expected)
        for p, g in zip(params, grads):
            p.grad_sample = g.clone()
        opt.step()
        outs[expected] = [p.grad.clone() for p in params]
        for p, g in zip(params, grads):
            torch.testing.assert_close(p.grad, g.sum(0) / expected)
    for a, b in zip(outs[10.0], outs[20.0]):
        torch.testing.assert_close(a, 2 * b)


# ---------------------------------------------------------------------- noise
@pytest.mark.parametrize("empty", [False, True], ids=["zero_grads", "empty_batch"])
def test_noise_std_is_sigma_c_over_b(empty):
    sigma, clip, expected = 1.3, 0.7, 50.0
    p = torch.nn.Parameter(torch.zeros(100_000))
    opt = DPSGD(
        [p], lr=0.0, noise_multiplier=sigma, max_grad_norm=clip, expected_batch_size=expected, noise_seed=0
    )
    if not empty:
        p.grad_sample = torch.zeros(5, p.numel())
    opt.step()  # an empty logical batch still releases (pure) noise
    target = sigma * clip / expected
    assert abs(p.grad.std().item() / target - 1) < 0.02
    assert abs(p.grad.mean().item()) < 5 * target / math.sqrt(p.numel())
    assert opt.noise_source.num_draws == 1


def test_noise_is_drawn_once_per_step_and_matches_a_seeded_reference():
    sigma, clip, batch, seed, steps = 0.9, 1.0, 8, 42, 3
    params = make_params()
    opt = DPSGD(
        params, lr=0.0, noise_multiplier=sigma, max_grad_norm=clip, expected_batch_size=batch, noise_seed=seed
    )
    reference = torch.Generator().manual_seed(seed)
    for t in range(steps):
        grads = per_example(batch, seed=t)
        for part in (slice(0, 3), slice(3, batch)):  # two micro-batches, still one draw per tensor
            for p, g in zip(params, grads):
                p.grad_sample = g[part].clone()
            opt.clip_and_accumulate()
        opt.step()
        assert opt.noise_source.num_draws == t + 1  # one flat draw per step for all tensors
        sums, _ = clip_and_sum(grads, Geometry(max_grad_norm=clip))
        # The noise of all tensors is one flat draw, split in parameter order.
        flat = torch.normal(0.0, sigma * clip, size=(sum(p.numel() for p in params),), generator=reference)
        noises = flat.split([p.numel() for p in params])
        for p, s, noise in zip(params, sums, noises):
            torch.testing.assert_close(p.grad, (s + noise.view(p.shape)) / batch, rtol=1e-5, atol=1e-6)
        opt.zero_grad()


def test_microbatches_accumulate_to_one_big_batch():
    grads = per_example(10)
    outs = []
    for parts in ([slice(0, 10)], [slice(0, 2), slice(2, 7), slice(7, 10)]):
        params = make_params()
        opt = DPSGD(
            params, lr=0.0, noise_multiplier=0.5, max_grad_norm=1.0, expected_batch_size=10, noise_seed=7
        )
        for part in parts:
            for p, g in zip(params, grads):
                p.grad_sample = g[part].clone()
            opt.clip_and_accumulate()
        assert opt.privatizer.num_examples == 10
        opt.step()
        outs.append([p.grad.clone() for p in params])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------- misuse
def test_gradient_without_per_example_gradient_raises():
    params = make_params()
    opt = sgd(params)
    for p in params[:2]:
        p.grad_sample = torch.zeros(4, *p.shape)
    params[2].grad = torch.ones_like(params[2])
    with pytest.raises(RuntimeError, match="no per-example"):
        opt.step()
    # Also when nothing was accumulated at all (backward ran without hooks).
    params = make_params()
    opt = sgd(params)
    params[0].grad = torch.ones_like(params[0])
    with pytest.raises(RuntimeError, match="per-example"):
        opt.step()


def test_batch_size_mismatch_across_params_raises():
    params = make_params()
    opt = sgd(params)
    params[0].grad_sample = torch.zeros(4, *SHAPES[0])
    params[1].grad_sample = torch.zeros(1, *SHAPES[1])
    params[2].grad_sample = torch.zeros(4, *SHAPES[2])
    with pytest.raises(RuntimeError, match="batch size"):
        opt.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    "bad,shown",
    [
        (dict(lr=-1.0), "-1.0"),
        (dict(noise_multiplier=-0.5), "-0.5"),
        (dict(noise_multiplier=float("nan")), "nan"),
        (dict(expected_batch_size=0), "0"),
        (dict(expected_batch_size=-3.0), "-3.0"),
        (dict(max_grad_norm=-2.0), "-2.0"),
    ],
)
def test_bad_common_values_raise_value_error_showing_them(name, bad, shown):
    kwargs = dict(lr=1e-3, noise_multiplier=1.0, expected_batch_size=8.0)
    if "macadam" not in name:
        kwargs["max_grad_norm"] = 1.0
    kwargs.update(bad)
    with pytest.raises(ValueError) as info:
        create_dp_optimizer(name, make_params(), **kwargs)
    assert shown in str(info.value)


def test_infinite_clip_needs_zero_noise():
    with pytest.raises(ValueError, match="inf"):
        sgd(make_params(), noise_multiplier=1.0, max_grad_norm=math.inf)


@pytest.mark.parametrize("owned", [False, True])
def test_accumulated_clipped_sums_are_copied_unless_handed_over(owned):
    """A caller's tensors are never summed into (copied), unless it hands them over (ghost clipping)."""
    from dp_hf.noise import NoiseSource
    from dp_hf.privatizer import Privatizer

    privatizer = Privatizer(0.0, 2, NoiseSource(seed=0))
    first, second = [torch.ones(3), torch.full((2,), 2.0)], [torch.ones(3), torch.ones(2)]
    privatizer.accumulate_clipped_sum(first, 1, owned=owned)
    privatizer.accumulate_clipped_sum(second, 1, owned=owned)
    released = privatizer.release([torch.zeros(3), torch.zeros(2)], Geometry(1.0))
    assert torch.equal(released[0], torch.ones(3)) and torch.equal(released[1], torch.full((2,), 1.5))
    assert torch.equal(second[0], torch.ones(3))  # the later micro-batches are only read
    if not owned:  # not handed over: untouched
        assert torch.equal(first[0], torch.ones(3)) and torch.equal(first[1], torch.full((2,), 2.0))


def test_noise_drawn_away_from_the_parameters_warns_once():
    # An own-loop optimizer built before model.to("cuda") keeps a CPU generator: correct noise, but every
    # step draws all of it on the CPU and copies it. The "meta" device stands in for the GPU here.
    import warnings

    from dp_hf.noise import NoiseSource

    source = NoiseSource(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        source.normal((4,), 1.0, torch.device("cpu"))  # same device: silent
    with pytest.warns(UserWarning, match="drawn on cpu and copied every step"):
        assert source.normal((4,), 1.0, torch.device("meta")).device.type == "meta"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        source.normal((4,), 1.0, torch.device("meta"))  # once


@pytest.mark.parametrize("drawn_ahead", [False, True])
def test_reseed_after_loading_draws_other_noise(drawn_ahead):
    """Loading a saved state sets the saved generator, also in a fresh source with another seed: the own-loop
    rollback warning advised "a fresh optimizer with a fresh noise_seed", and the redone step drew exactly the
    abandoned step's noise (an own-loop audit: the two releases differed by the clipped sums, to 1e-7).
    reseed() draws from fresh entropy, and drops a draw made ahead."""
    from dp_hf.noise import PREFETCH_MIN_NUMEL, NoiseSource

    size, cpu = (2 * PREFETCH_MIN_NUMEL,), torch.device("cpu")
    source = NoiseSource(seed=1)
    source.normal(size, 1.0, cpu)
    saved = source.state_dict()
    released = source.normal(size, 1.0, cpu)  # the step that a rollback would take again
    for reseeded in (False, True):
        fresh = NoiseSource(seed=2)
        fresh.normal(size, 1.0, cpu)
        if drawn_ahead:
            fresh.draw_ahead()
        fresh.load_state_dict(saved)
        if reseeded:
            if drawn_ahead:
                fresh.draw_ahead()
            fresh.reseed()
        again = fresh.normal(size, 1.0, cpu)
        assert torch.equal(again, released) != reseeded


def _summed_slots(steps: list[int], device: str = "cpu") -> torch.Tensor:
    # What the all-reduce gives: every rank's step_slots, summed.
    return sum(step_slots(step, rank, len(steps), torch.device(device)) for rank, step in enumerate(steps))


@pytest.mark.parametrize(
    "steps, refused",
    [
        ([5, 5], False),
        ([3, 0], True),
        ([2**40 + 7, 2**40 + 7, 2**40 + 7], False),  # beyond float32's 24 bits: two slots per rank
        ([2**40 + 7, 7, 2**40 + 7], True),  # differs only in the high slot
        ([2**23, 2**23 + 1], True),  # differs only in the low slot, at the boundary
    ],
)
def test_a_release_that_summed_different_steps_is_refused(steps, refused):
    """Each rank's DP step travels in the release's all-reduce; every rank then sees all of them and refuses
    alike when they differ (its share of one Poisson step summed with another rank's share of another)."""
    summed = _summed_slots(steps)
    if refused:
        with pytest.raises(RuntimeError, match="released different DP steps.*No update was applied"):
            RankSteps().check(summed, steps[0])
    else:
        RankSteps().check(summed, steps[0])
