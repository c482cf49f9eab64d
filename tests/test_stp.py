"""Scale-then-privatize: the normalized geometry (default) learns, the raw form stalls, both are DP.

The learning test is a small task on which DP-Adam learns with default settings (lr 1e-3, C = 1): a
10-class softmax MLP on Gaussian clusters, per-example gradients from ``torch.func``. The raw form (the
paper's Algorithm 8, ``scale_mode="raw"``) must stall there with the same settings -- its scale
``s = sqrt(vhat) + gamma_s`` shrinks like ``t^-1/2`` when every example is clipped -- so a regression
to it is caught. The other tests pin the geometry: RMS 1 over all coordinates, the floor, the
shape of ``sqrt(vhat)``, dependence on privatized state only, sensitivity ``C`` and noise
``sigma C`` in the scaled coordinates.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.func import functional_call, grad, vmap

from dp_hf.optim import create_dp_optimizer
from dp_hf.optim.stp import DEFAULT_SCALE_FLOOR, normalize_scales, raw_scale_drift

NUM_CLASSES, FEATURES, HIDDEN = 10, 20, 64
TRAIN, BATCH, STEPS, SIGMA = 2000, 200, 80, 1.0


def cluster_data(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(NUM_CLASSES, FEATURES, generator=gen)
    labels = torch.randint(NUM_CLASSES, (TRAIN + 1000,), generator=gen)
    x = centers[labels] + torch.randn(TRAIN + 1000, FEATURES, generator=gen)
    return (x[:TRAIN], labels[:TRAIN]), (x[TRAIN:], labels[TRAIN:])


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, NUM_CLASSES)
    )


def per_example_grads(model, names, x, y):
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(out, yi.unsqueeze(0))

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return [grads[n] for n in names]


def train(name: str, seed: int = 0, **kwargs) -> dict:
    """Train the MLP with ``name`` for ``STEPS`` steps; accuracy and the last update's RMS over lr."""
    (x, y), (x_test, y_test) = cluster_data()
    model = mlp(seed)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    opt = create_dp_optimizer(
        name,
        params,
        noise_multiplier=SIGMA,
        max_grad_norm=1.0,
        expected_batch_size=BATCH,
        noise_seed=seed,
        **kwargs,
    )  # every rule hyperparameter at its default (lr 1e-3), C = 1 as in the papers
    lr = opt.param_groups[0]["lr"]
    sampler = torch.Generator().manual_seed(100 + seed)
    step_ratio = math.nan
    for _ in range(STEPS):
        index = (torch.rand(TRAIN, generator=sampler) < BATCH / TRAIN).nonzero().squeeze(1)
        for p, g in zip(params, per_example_grads(model, names, x[index], y[index])):
            p.grad_sample = g
        before = [p.detach().clone() for p in params]
        opt.step()
        opt.zero_grad()
        moved = sum(float((p.detach() - b).square().sum()) for p, b in zip(params, before))
        step_ratio = math.sqrt(moved / sum(p.numel() for p in params)) / lr
    with torch.no_grad():
        accuracy = float((model(x_test).argmax(-1) == y_test).float().mean())
    return {"accuracy": accuracy, "step_ratio": step_ratio, "opt": opt}


@pytest.fixture(scope="module")
def runs():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the raw form warns that it will stall: checked separately
        return {
            "dp-adam": train("dp-adam"),
            "stp": train("dp-adam-stp"),
            "stp-adamw": train("dp-adamw-stp"),
            "raw": train("dp-adam-stp", scale_mode="raw"),
        }


# ---------------------------------------------------------------------- learning
def test_dp_adam_learns_the_task(runs):
    assert runs["dp-adam"]["accuracy"] > 0.8


@pytest.mark.parametrize("key", ["stp", "stp-adamw"])
def test_default_stp_learns_like_dp_adam(runs, key):
    assert runs[key]["accuracy"] > 0.8
    assert runs[key]["accuracy"] > runs["dp-adam"]["accuracy"] - 0.08
    # Its step has DP-Adam's size: the geometry's scale does not drift.
    assert 0.5 < runs[key]["step_ratio"] / runs["dp-adam"]["step_ratio"] < 2.0


def test_raw_form_stalls_with_the_same_settings(runs):
    raw, adam = runs["raw"], runs["dp-adam"]
    assert raw["accuracy"] < adam["accuracy"] - 0.3
    assert raw["step_ratio"] < 0.2 * adam["step_ratio"]  # the step collapsed with the scale


def test_raw_scale_shrinks_and_normalized_scale_does_not(runs):
    raw_opt, rms_opt = runs["raw"]["opt"], runs["stp"]["opt"]
    params = raw_opt.trainable_params()
    raw_scales = raw_opt.geometry(params).scale
    raw_rms = math.sqrt(sum(float(s.square().sum()) for s in raw_scales) / sum(s.numel() for s in raw_scales))
    assert raw_rms < 0.02  # s_1 = 1; t^-1/2 decay and the gradients' own scale put it far below
    rms_scales = rms_opt.geometry(rms_opt.trainable_params()).scale
    total = sum(float(s.double().square().sum()) for s in rms_scales)
    assert total / sum(s.numel() for s in rms_scales) == pytest.approx(1.0, rel=1e-5)


# ---------------------------------------------------------------------- geometry
def stepped(name="dp-adam-stp", steps=3, sigma=0.5, **kwargs):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(6, 5), (5,), (40,)]]
    opt = create_dp_optimizer(
        name,
        params,
        lr=1e-2,
        noise_multiplier=sigma,
        max_grad_norm=1.0,
        expected_batch_size=4,
        noise_seed=1,
        **kwargs,
    )
    for t in range(steps):
        g = torch.Generator().manual_seed(10 + t)
        # very different magnitudes per tensor, so the shape of sqrt(vhat) is far from flat
        for p, scale in zip(params, (1.0, 1e-2, 1e2)):
            p.grad_sample = scale * torch.randn((4, *p.shape), generator=g)
        opt.step()
        opt.zero_grad()
    return opt, params


def test_first_step_is_the_identity_geometry():
    opt, params = stepped(steps=0)
    assert opt.geometry(params).scale == [None, None, None]


@pytest.mark.parametrize("floor", [0.0, DEFAULT_SCALE_FLOOR, 1.0])
def test_rms_geometry_is_the_shape_of_sqrt_vhat_with_unit_rms(floor):
    opt, params = stepped(scale_floor=floor, sigma=0.0)  # no noise: sqrt(vhat) differs a lot per tensor
    assert opt.scale_mode == "rms" and opt.scale_floor == floor
    u = opt.raw_scales(params)
    s = opt.geometry(params).scale
    flat_u = torch.cat([x.reshape(-1) for x in u]).double()
    flat_s = torch.cat([x.reshape(-1) for x in s]).double()
    # one RMS over all tensors together (not per tensor)
    assert flat_s.square().mean().item() == pytest.approx(1.0, rel=1e-6)
    expected = flat_u / flat_u.square().mean().sqrt() + floor
    expected = expected / expected.square().mean().sqrt()
    torch.testing.assert_close(flat_s, expected, rtol=1e-5, atol=1e-7)
    assert flat_s.min().item() >= floor / (1 + floor) - 1e-7
    per_tensor = [x.double().square().mean().item() for x in s]
    spread = 100 if floor == 0 else 2  # the tensors keep their relative scales
    assert max(per_tensor) / min(per_tensor) > spread


def test_normalization_is_scale_invariant():
    gen = torch.Generator().manual_seed(3)
    u = [torch.rand(7, generator=gen) + 1e-3, torch.rand(3, 2, generator=gen) * 50]
    a = normalize_scales(u, 0.1)
    b = normalize_scales([1e-6 * x for x in u], 0.1)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=0)
    assert normalize_scales([None, None], 0.1) == [None, None]
    mixed = normalize_scales([None, u[0]], 0.0)
    assert mixed[0] is None and mixed[1].square().mean().item() == pytest.approx(1.0, rel=1e-6)


@pytest.mark.filterwarnings("ignore:scale-then-privatize")
def test_raw_mode_is_the_paper_formula():
    opt, params = stepped(scale_mode="raw")
    beta2 = opt.param_groups[0]["betas"][1]
    for p, s in zip(params, opt.geometry(params).scale):
        state = opt.state[p]
        vhat = state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))
        torch.testing.assert_close(s, vhat.sqrt() + opt.param_groups[0]["gamma_s"])


def test_geometry_reads_only_privatized_state():
    """Fresh per-example gradients (not yet privatized) do not change the geometry; the state does."""
    opt, params = stepped()
    before = [s.clone() for s in opt.geometry(params).scale]
    for p in params:
        p.grad_sample = 1e3 * torch.randn((4, *p.shape))
    for s, b in zip(opt.geometry(params).scale, before):
        torch.testing.assert_close(s, b)
    opt.zero_grad()
    state = opt.state_dict()
    clone, clone_params = stepped(steps=0)
    clone.load_state_dict(state)
    for s, b in zip(clone.geometry(clone_params).scale, before):
        torch.testing.assert_close(s, b)


def test_sensitivity_and_noise_are_c_and_sigma_c_in_scaled_coordinates():
    """One example of any size moves the clipped sum by at most C in w = g / s; the noise is sigma C there."""
    clip, batch = 1.0, 4
    opt, params = stepped(sigma=0.0)
    s = opt.geometry(params).scale
    for p in params:  # one huge example, three zero ones
        gs = torch.zeros((batch, *p.shape))
        gs[0] = 1e4 * torch.randn(p.shape)
        p.grad_sample = gs
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    w_sum = [p.grad * batch / si for p, si in zip(params, s)]  # sum_i wbar_i in scaled coordinates
    assert math.sqrt(sum(float(w.square().sum()) for w in w_sum)) == pytest.approx(clip, rel=1e-5)
    opt.zero_grad()

    noisy, noisy_params = stepped(sigma=2.0)
    s = noisy.geometry(noisy_params).scale
    noisy.param_groups[0]["lr"] = 0.0
    draws = []
    for _ in range(200):
        for p in noisy_params:
            p.grad_sample = torch.zeros((batch, *p.shape))
        noisy._geometry_cache = None
        s = noisy.geometry(noisy_params).scale
        noisy.step()
        draws.append(torch.cat([(p.grad * batch / si).reshape(-1) for p, si in zip(noisy_params, s)]))
        noisy.zero_grad()
    w_noise = torch.stack(draws)
    assert w_noise.std().item() == pytest.approx(2.0 * clip, rel=0.05)  # N(0, sigma^2 C^2) per coordinate


# ---------------------------------------------------------------------- validation and warnings
@pytest.mark.parametrize(
    "kwargs,shown",
    [
        (dict(scale_mode="l2"), "'l2'"),
        (dict(scale_floor=-0.1), "-0.1"),
        (dict(scale_floor=float("nan")), "nan"),
        (dict(scale_mode="raw", scale_floor=0.5), "0.5"),
    ],
)
def test_bad_scale_settings_are_refused(kwargs, shown):
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=shown):
        create_dp_optimizer(
            "dp-adam-stp", [p], noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=8, **kwargs
        )


def test_raw_form_warns_when_its_scale_will_drift():
    params = [torch.nn.Parameter(torch.zeros(2000))]
    common = dict(expected_batch_size=200, noise_multiplier=1.0)
    with pytest.warns(UserWarning, match="shrinks step after step"):
        create_dp_optimizer("dp-adam-stp", params, scale_mode="raw", max_grad_norm=1.0, **common)
    with pytest.warns(UserWarning, match="grows step after step"):
        create_dp_optimizer("dp-adam-stp", params, scale_mode="raw", max_grad_norm=1000.0, **common)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        balanced = 200.0  # C = B / sigma
        create_dp_optimizer("dp-adam-stp", params, scale_mode="raw", max_grad_norm=balanced, **common)
        create_dp_optimizer("dp-adam-stp", params, max_grad_norm=1.0, **common)  # rms: nothing to warn about
        create_dp_optimizer(
            "dp-adam-stp",
            params,
            scale_mode="raw",
            max_grad_norm=math.inf,
            noise_multiplier=0.0,
            expected_batch_size=200,
        )


def test_raw_scale_drift_formula():
    rho, noise = raw_scale_drift(2.0, 1.0, 256.0, 10_000)
    assert noise == pytest.approx(2.0 / 256)
    assert rho == pytest.approx(math.sqrt((2.0 / 256) ** 2 + 1e-4))
