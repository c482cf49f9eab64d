"""The dp_hf optimizer family, table-driven.

``OPTIMIZER_TABLE`` has one row ``(name, kwargs)`` per registered optimizer;
the generic tests are parametrized over it, so a new optimizer needs one row.
Per-example gradients are random ``p.grad_sample`` tensors from seeded
generators; rule checks compare against slow references written here.
"""

from __future__ import annotations

import collections
import io
import math
import warnings

import numpy as np
import pytest
import torch

from dp_hf.optim import OPTIMIZERS, create_dp_optimizer
from dp_hf.optim.sparse import (
    dequantize_4bit,
    quantize_4bit,
    topk_count,
)

SHAPES = [(6, 5), (5,), (3, 4, 2), (37,)]
BATCH = 8
SIGMA = 0.8

# ONE table: (registry name, rule kwargs incl. max_grad_norm where the rule takes one).
OPTIMIZER_TABLE = [
    ("dp-sgd", dict(lr=0.05, momentum=0.9, weight_decay=0.01, max_grad_norm=1.0)),
    ("dp-adam", dict(lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)),
    ("dp-adamw", dict(lr=1e-2, weight_decay=0.05, max_grad_norm=1.0)),
    ("dp-adambc", dict(lr=1e-3, gamma_prime=1e-4, max_grad_norm=1.0)),
    ("dp-adamw-bc", dict(lr=1e-3, weight_decay=0.05, gamma_prime=1e-4, max_grad_norm=1.0)),
    ("dp-macadam", dict(lr=1e-2, h1=1e-9, h2=1e-5)),
    ("dp-macadam-bc", dict(lr=1e-2, h1=1e-9, h2=1e-5, gamma_prime=1e-6, bc_phi="per_coordinate")),
    ("dp-adam-stp", dict(lr=1e-2, gamma_s=1e-3, max_grad_norm=1.0)),
    ("dp-adamw-stp", dict(lr=1e-2, weight_decay=0.05, gamma_s=1e-3, max_grad_norm=1.0)),
    (
        "dp-microadam",
        dict(
            lr=1e-2,
            weight_decay=0.05,
            density=0.1,
            window=3,
            block_size=16,
            quant_block=24,
            max_grad_norm=1.0,
        ),
    ),
]
ROW_IDS = [name for name, _ in OPTIMIZER_TABLE]


# ---------------------------------------------------------------------- helpers
def make_params(dtype=torch.float32, seed=0, frozen=True) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((0.1 * torch.randn(s, generator=gen)).to(dtype)) for s in SHAPES]
    if frozen:
        params.append(torch.nn.Parameter(torch.randn(4, 3, generator=gen).to(dtype), requires_grad=False))
    return params


def param_groups(params, lr_second=None):
    """Two groups (the second with its own lr) and the frozen tensor inside the second."""
    second = {"params": params[2:]}
    if lr_second is not None:
        second["lr"] = lr_second
    return [{"params": params[:2]}, second]


def example_grads(params, step: int, batch: int = BATCH, scale: float = 1e-2) -> list[torch.Tensor]:
    """Per-example grads of step ``step`` (a shared mean direction plus per-example spread)."""
    gen = torch.Generator().manual_seed(10_000 + step)
    out = []
    for k, p in enumerate(params):
        mean = torch.randn(p.shape, generator=torch.Generator().manual_seed(k))
        out.append(scale * (mean + torch.randn((batch, *p.shape), generator=gen)))
    return out


def set_grad_samples(params, step: int, **kw) -> None:
    trainable = [p for p in params if p.requires_grad]
    for p, g in zip(trainable, example_grads(trainable, step, **kw)):
        p.grad_sample = g.to(p.dtype)


def build(name, kwargs, params, **overrides):
    kw = dict(kwargs, noise_multiplier=SIGMA, expected_batch_size=BATCH, noise_seed=1234)
    kw.update(overrides)
    return create_dp_optimizer(name, params, **kw)


def train(opt, params, steps: range, **kw) -> None:
    for t in steps:
        set_grad_samples(params, t, **kw)
        opt.step()
        opt.zero_grad()


def state_nbytes(opt, params) -> int:
    return sum(v.nbytes for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor))


# ---------------------------------------------------------------------- generic, one row each
def test_table_covers_the_registry():
    assert sorted(ROW_IDS) == sorted(OPTIMIZERS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,kwargs", OPTIMIZER_TABLE, ids=ROW_IDS)
def test_interrupt_and_resume_is_exact(name, kwargs, dtype):
    steps, cut = 7, 4
    ref_params = make_params(dtype)
    ref = build(name, kwargs, param_groups(ref_params, lr_second=kwargs["lr"] / 2))
    train(ref, ref_params, range(steps))

    params = make_params(dtype)
    opt = build(name, kwargs, param_groups(params, lr_second=kwargs["lr"] / 2))
    train(opt, params, range(cut))
    buffer = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "optimizer": opt.state_dict()}, buffer)
    del opt, params

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    resumed_params = [
        torch.nn.Parameter(t.clone(), requires_grad=t_ref.requires_grad)
        for t, t_ref in zip(checkpoint["params"], ref_params)
    ]
    # A different seed: the checkpoint's generator state must win.
    resumed = build(name, kwargs, param_groups(resumed_params, lr_second=kwargs["lr"] / 2), noise_seed=999)
    resumed.load_state_dict(checkpoint["optimizer"])
    assert resumed.dp_step == cut
    train(resumed, resumed_params, range(cut, steps))

    for p_ref, p in zip(ref_params, resumed_params):
        assert torch.equal(p_ref, p)
    for p_ref, p in zip(ref_params, resumed_params):
        for key, value in ref.state[p_ref].items():
            assert value.dtype == resumed.state[p][key].dtype, key
            assert torch.equal(value, resumed.state[p][key]), key
    assert resumed.noise_source.num_draws == ref.noise_source.num_draws


@pytest.mark.parametrize("name,kwargs", OPTIMIZER_TABLE, ids=ROW_IDS)
def test_another_update_rules_state_is_refused(name, kwargs):
    # Resuming dp-adamw's checkpoint with dp-sgd used to fail at the first step with KeyError('momentum').
    params = make_params()
    saved = build(name, kwargs, param_groups(params))
    train(saved, params, range(2))
    other_name, other_kwargs = OPTIMIZER_TABLE[(ROW_IDS.index(name) + 1) % len(ROW_IDS)]
    other = build(other_name, other_kwargs, param_groups(make_params()))
    with pytest.raises(ValueError, match=f"saved by {type(saved).__name__}, not {type(other).__name__}"):
        other.load_state_dict(saved.state_dict())
    assert other.dp_step == 0


@pytest.mark.parametrize("name,kwargs", OPTIMIZER_TABLE, ids=ROW_IDS)
def test_frozen_untouched_and_group_learning_rates(name, kwargs):
    params = make_params()
    before = [p.detach().clone() for p in params]
    opt = build(name, kwargs, param_groups(params, lr_second=0.0))
    train(opt, params, range(3))
    frozen = params[-1]
    assert torch.equal(frozen, before[-1]) and frozen.grad is None
    assert frozen not in opt.state or not opt.state[frozen]
    # Group 2 has lr = 0: unchanged (also under decoupled weight decay); group 1 moved.
    for p, b in zip(params[2:4], before[2:4]):
        assert torch.equal(p, b)
    assert all(not torch.equal(p, b) for p, b in zip(params[:2], before[:2]))
    # After step(), p.grad holds the privatized mean gradient in p's dtype, finite.
    set_grad_samples(params, 3)
    opt.step()
    for p in params[:4]:
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype
        assert torch.isfinite(p.grad).all()


@pytest.mark.parametrize("name,kwargs", OPTIMIZER_TABLE, ids=ROW_IDS)
def test_lr_scheduler_drives_the_groups(name, kwargs):
    params = make_params(frozen=False)
    opt = build(name, kwargs, params)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch < 2 else 0.0)
    for t in range(4):
        if t == 2:
            frozen_at = [p.detach().clone() for p in params]
        set_grad_samples(params, t)
        opt.step()
        opt.zero_grad()
        scheduler.step()
    assert all(group["lr"] == 0.0 for group in opt.param_groups)
    for p, b in zip(params, frozen_at):
        assert torch.equal(p, b)
    assert opt.dp_step == 4


@pytest.mark.parametrize("name,kwargs", OPTIMIZER_TABLE, ids=ROW_IDS)
def test_microbatches_equal_one_logical_batch(name, kwargs):
    one = make_params()
    opt_one = build(name, kwargs, one)
    many = make_params()
    opt_many = build(name, kwargs, many)
    for t in range(3):
        set_grad_samples(one, t)
        opt_one.step()
        opt_one.zero_grad()
        grads = example_grads([p for p in many if p.requires_grad], t)
        for part in (slice(0, 3), slice(3, 5), slice(5, BATCH)):
            for p, g in zip(many[:4], grads):
                p.grad_sample = g[part].clone()
            opt_many.clip_and_accumulate()
        opt_many.step()
        opt_many.zero_grad()
    for a, b in zip(one, many):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,kwargs", OPTIMIZER_TABLE, ids=ROW_IDS)
def test_zero_grad_abandons_the_step_in_progress(name, kwargs):
    """A micro-batch clipped and then abandoned with zero_grad() (say, after an out-of-memory error in the
    next one) was released with the next step's batch: an example drawn into both counted twice."""
    abandoning, plain = make_params(), make_params()
    opt_abandoning, opt_plain = build(name, kwargs, abandoning), build(name, kwargs, plain)
    for t in range(3):
        if t == 1:
            set_grad_samples(abandoning, 7)
            opt_abandoning.clip_and_accumulate()
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # raised as an error, it must still have dropped the sums
                with pytest.raises(UserWarning, match="zero_grad.. discarded the clipped gradients"):
                    opt_abandoning.zero_grad()
        for params, opt in ((abandoning, opt_abandoning), (plain, opt_plain)):
            set_grad_samples(params, t)
            opt.step()
            opt.zero_grad()
    for a, b in zip(abandoning, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name,kwargs", OPTIMIZER_TABLE, ids=ROW_IDS)
def test_param_groups_are_checked_and_cannot_set_dp_values(name, kwargs):
    """torch checks only the default lr; a group's max_grad_norm (or sigma, B) was silently not used."""
    opt = build(name, kwargs, make_params())
    extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="lr=-1.0"):
        opt.add_param_group({"params": [extra], "lr": -1.0})
    with pytest.raises(
        ValueError, match="sets max_grad_norm, noise_multiplier: .* arguments of the optimizer"
    ):
        opt.add_param_group({"params": [extra], "max_grad_norm": 0.1, "noise_multiplier": 2.0})
    with pytest.raises(ValueError, match="lr=-2"):
        build(name, kwargs, [{"params": make_params(), "lr": -2}])
    with pytest.raises(ValueError, match="lr=inf"):
        opt.add_param_group({"params": [extra], "lr": math.inf})
    if "betas" in opt.defaults:  # a group's own Adam values are checked too (betas (0.9, 1.5): NaN weights)
        with pytest.raises(ValueError, match="beta parameter at index 1: 1.5"):
            opt.add_param_group({"params": [extra], "betas": (0.9, 1.5)})
    if opt.defaults.get("eps", 0) > 0:  # with eps 0 a coordinate whose released gradient is 0 gives 0 / 0
        with pytest.raises(ValueError, match="epsilon value: 0.0 .* > 0"):
            opt.add_param_group({"params": [extra], "eps": 0.0})
        with pytest.raises(ValueError, match="epsilon value: 0 "):
            build(name, dict(kwargs, eps=0), make_params())
    for key in ("gamma_s", "gamma_prime"):  # a group's own stability constants too (gamma_s=-1 was kept)
        if key in opt.defaults:
            with pytest.raises(ValueError, match=f"{key} .* must be a finite number > 0, got -1.0"):
                opt.add_param_group({"params": [extra], key: -1.0})


def test_rolling_back_a_secure_mode_optimizer_warns_that_the_steps_are_released_again():
    """secure_mode draws fresh noise, so a rollback replays no noise, but the steps after the saved one are
    released a second time: that went unsaid (an own-loop review)."""
    params = make_params()
    opt = create_dp_optimizer(
        "dp-sgd",
        params,
        lr=0.1,
        noise_multiplier=SIGMA,
        max_grad_norm=1.0,
        expected_batch_size=BATCH,
        secure_mode=True,
    )
    set_grad_samples(params, 0)
    opt.step()
    saved = opt.state_dict()
    set_grad_samples(params, 1)
    opt.step()
    with pytest.warns(
        UserWarning, match="steps 2-2 will be released again \\(with fresh noise, secure_mode\\)"
    ):
        opt.load_state_dict(saved)


@pytest.mark.parametrize("name,kwargs", OPTIMIZER_TABLE, ids=ROW_IDS)
def test_a_state_dict_is_a_snapshot_and_rolling_a_live_optimizer_back_warns(name, kwargs):
    """torch hands out the live state: a state_dict held in memory kept counting DP steps while its noise
    generator stayed put, and loading it into the optimizer that went on replayed a released step's noise
    (an audit recovered the difference of two batches' clipped sums to 1e-7)."""
    params = make_params()
    opt = build(name, kwargs, params)
    for t in range(2):
        set_grad_samples(list(opt.param_groups[0]["params"]), t)
        opt.step()
    saved = opt.state_dict()
    set_grad_samples(list(opt.param_groups[0]["params"]), 2)
    opt.step()
    assert saved["state"]["dp"]["step"] == 2 and opt.dp_step == 3
    with pytest.warns(
        UserWarning, match="saved at DP step 2 into an optimizer that took 3: its noise generator"
    ):
        opt.load_state_dict(saved)
    fresh = build(name, kwargs, make_params())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a resume into a fresh optimizer is silent
        fresh.load_state_dict(saved)
    assert fresh.state["dp"] is not opt.state["dp"]  # two optimizers loading one dict share nothing of it


@pytest.mark.parametrize("name,kwargs", OPTIMIZER_TABLE, ids=ROW_IDS)
def test_loading_a_state_saved_with_other_dp_values_warns(name, kwargs):
    saved = build(name, kwargs, make_params())
    set_grad_samples(list(saved.param_groups[0]["params"]), 0)
    saved.step()
    state = saved.state_dict()
    resumed = build(name, kwargs, make_params(), noise_multiplier=SIGMA * 2)
    with pytest.warns(UserWarning, match=rf"saved with noise_multiplier={SIGMA!r} \(now {SIGMA * 2!r}\)"):
        resumed.load_state_dict(state)
    assert resumed.noise_multiplier == SIGMA * 2


@pytest.mark.parametrize("name,kwargs", OPTIMIZER_TABLE, ids=ROW_IDS)
def test_bf16_parameters_track_fp32(name, kwargs):
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        params = make_params(dtype)
        opt = build(name, kwargs, params)
        start = [p.detach().float().clone() for p in params]
        for t in range(4):
            set_grad_samples(params, t)
            opt.step()
            opt.zero_grad()
            assert all(torch.isfinite(p).all() for p in params)
            assert all(p.dtype == dtype for p in params)
        # The moments stay float32 (FP32Params); only MicroAdam's window values are bf16 by design.
        for p in params[:4]:
            for key, value in opt.state[p].items():
                if value.is_floating_point() and key not in ("win_val",):
                    assert value.dtype == torch.float32, key
        runs[dtype] = torch.cat([(p.detach().float() - s).flatten() for p, s in zip(params, start)])
    delta32, delta16 = runs[torch.float32], runs[torch.bfloat16]
    # bf16 rounds the parameters (and per-example grads) at every step: loose tolerance.
    assert (delta16 - delta32).norm() <= 0.25 * delta32.norm() + 2e-3


@pytest.mark.parametrize("name,kwargs", OPTIMIZER_TABLE, ids=ROW_IDS)
def test_state_is_in_optimizer_not_on_parameters(name, kwargs):
    params = make_params()
    attrs_before = [set(vars(p)) for p in params]
    opt = build(name, kwargs, params)
    train(opt, params, range(2))
    for p, before in zip(params, attrs_before):
        assert set(vars(p)) - before <= {"grad_sample"}
        assert getattr(p, "grad_sample", None) is None
    assert set(opt.state["dp"]) >= {"step"}
    state = opt.state_dict()
    assert "generator_state" in state["state"]["dp"]["noise"]


# ---------------------------------------------------------------------- non-private equality with torch
@pytest.mark.parametrize(
    "name,kwargs,torch_cls",
    [
        ("dp-sgd", dict(lr=0.05, momentum=0.9, weight_decay=0.01), torch.optim.SGD),
        ("dp-sgd", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), torch.optim.SGD),
        ("dp-adam", dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.01), torch.optim.Adam),
        ("dp-adamw", dict(lr=1e-2, weight_decay=0.1), torch.optim.AdamW),
    ],
)
def test_sigma0_cinf_equals_torch(name, kwargs, torch_cls):
    ours, theirs = make_params(frozen=False), make_params(frozen=False)
    opt = create_dp_optimizer(
        name, ours, noise_multiplier=0.0, max_grad_norm=math.inf, expected_batch_size=BATCH, **kwargs
    )
    ref = torch_cls(theirs, **kwargs)
    for t in range(20):
        grads = example_grads(ours, t, scale=1.0)
        for p, q, g in zip(ours, theirs, grads):
            p.grad_sample = g.clone()
            q.grad = g.sum(0) / BATCH
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- DP-MacAdam vs Algorithm 1
def macadam_reference(
    theta0,
    per_step_grads,
    noises,
    stats,
    *,
    sigma,
    batch,
    lr,
    betas,
    h1,
    h2,
    gamma,
    bc_phi=None,
    gamma_prime=None,
):
    """Algorithm 1 line by line on one flat float64 vector of all d coordinates.

    ``per_step_grads[t]`` is ``[b, d]``; ``noises[t]`` is ``z * sigma`` as drawn for the sum (C = 1).
    Yields ``theta`` after every step and counts in ``stats`` how often each branch was taken.
    """
    beta1, beta2 = betas
    theta = theta0.clone()
    d = theta.numel()
    m, v, s = (
        torch.zeros(d, dtype=torch.float64),
        torch.zeros(d, dtype=torch.float64),
        torch.zeros(d, dtype=torch.float64),
    )
    mhat_prev = torch.zeros(d, dtype=torch.float64)
    b = torch.full((d,), 1.0 / d, dtype=torch.float64)
    for t, (g, noise) in enumerate(zip(per_step_grads, noises), start=1):
        w = (g - mhat_prev) / b  # 8
        wbar = w / torch.clamp(w.norm(dim=1, keepdim=True), min=1.0)  # 9
        stats["clipped"] += int((w.norm(dim=1) > 1).sum())
        stats["unclipped"] += int((w.norm(dim=1) <= 1).sum())
        wtilde = (wbar.sum(0) + noise) / batch  # 11-12: N(0, sigma^2/B^2)
        gtilde = b * wtilde + mhat_prev  # 13
        m = beta1 * m + (1 - beta1) * gtilde  # 14
        v = beta2 * v + (1 - beta2) * gtilde**2  # 15
        mhat, vhat = m / (1 - beta1**t), v / (1 - beta2**t)  # 16
        if bc_phi is None:
            theta = theta - lr * mhat / (vhat.sqrt() + gamma)  # 17
        else:
            phi = (sigma / batch) ** 2 if bc_phi == "paper" else b**2 * sigma**2 / batch**2
            theta = theta - lr * mhat / torch.clamp(vhat - phi, min=gamma_prime).sqrt()
            stats["floored"] += int((vhat - phi < gamma_prime).sum())
            stats["not_floored"] += int((vhat - phi >= gamma_prime).sum())
        if t > 1:  # t = 1: u_1 = 0, kappa_1 = 0, keep s_1 = 0 and b_1 = b_0
            u = (gtilde - mhat) ** 2  # 18
            s = beta1 * s + (1 - beta1) * u  # 19
            kappa = 2 * (beta1 - beta1**t) / (1 + beta1)  # 20
            raw = s / kappa - b**2 * sigma**2 / batch**2
            shat = torch.clamp(raw, h1, h2)  # 21
            stats["at_h1"] += int((raw < h1).sum())
            stats["at_h2"] += int((raw > h2).sum())
            stats["inside"] += int(((raw >= h1) & (raw <= h2)).sum())
            b = shat**0.25 * shat.sqrt().sum().sqrt()  # 22
        mhat_prev = mhat
        yield theta


@pytest.mark.parametrize(
    "name,sigma,extra",
    [
        # sigma and gamma' chosen so that every branch (clip or not, h1 / h2 / no clamp, floor or
        # not) is taken on some coordinates; asserted below.
        ("dp-macadam", 0.5, dict(gamma=1e-8)),
        ("dp-macadam-bc", 0.003, dict(gamma_prime=1e-8, bc_phi="paper")),
        ("dp-macadam-bc", 0.5, dict(gamma_prime=1e-6, bc_phi="per_coordinate")),
    ],
)
def test_macadam_matches_algorithm_1_with_noise(name, sigma, extra):
    steps, lr, betas, h1, h2 = 24, 1e-2, (0.9, 0.99), 1e-9, 1e-7
    params = make_params(frozen=True)
    trainable = params[:4]
    theta0 = torch.cat([p.detach().double().flatten() for p in trainable])
    noise_seed = 77
    opt = create_dp_optimizer(
        name,
        params,
        lr=lr,
        betas=betas,
        h1=h1,
        h2=h2,
        noise_multiplier=sigma,
        expected_batch_size=BATCH,
        generator=torch.Generator().manual_seed(noise_seed),
        **extra,
    )
    # The reference gets the same noise: the privatizer draws N(0, (sigma C)^2), C = 1, once per
    # step for all tensors (one flat draw, split in parameter order), from the generator.
    gen = torch.Generator().manual_seed(noise_seed)
    grads, noises = [], []
    for t in range(steps):
        per_tensor = example_grads(trainable, t, scale=1e-3)
        grads.append(torch.cat([g.reshape(BATCH, -1) for g in per_tensor], dim=1).double())
        numel = sum(p.numel() for p in trainable)
        noises.append(torch.normal(0.0, sigma, size=(numel,), generator=gen).double())
    stats = collections.Counter()
    reference = macadam_reference(
        theta0,
        grads,
        noises,
        stats,
        sigma=sigma,
        batch=BATCH,
        lr=lr,
        betas=betas,
        h1=h1,
        h2=h2,
        gamma=extra.get("gamma"),
        bc_phi=extra.get("bc_phi"),
        gamma_prime=extra.get("gamma_prime"),
    )
    for t, theta_ref in zip(range(steps), reference):
        set_grad_samples(params, t, scale=1e-3)
        opt.step()
        opt.zero_grad()
        if t < 2:  # every value finite at t = 1 and t = 2
            for p in trainable:
                assert all(torch.isfinite(v).all() for v in opt.state[p].values())
        ours = torch.cat([p.detach().double().flatten() for p in trainable])
        torch.testing.assert_close(ours, theta_ref, rtol=2e-5, atol=2e-6, msg=f"step {t + 1}")
    assert opt.noise_source.num_draws == steps  # one flat draw per step
    # b really adapted, and it couples all tensors: sum_j b_j^2 = (sum_j shat_j^1/2)^2 ... > 0.
    b = torch.cat([opt.state[p]["clip_scale"].flatten() for p in trainable])
    assert b.min() > 0 and b.max() > b.min()
    assert stats["clipped"] and stats["at_h1"] and stats["at_h2"] and stats["inside"], stats
    if name == "dp-macadam-bc":
        assert stats["floored"] and stats["not_floored"], stats


def test_macadam_rejects_other_clip_norms():
    for ok in (None, 1, 1.0):
        kw = {} if ok is None else {"max_grad_norm": ok}
        create_dp_optimizer("dp-macadam", make_params(), noise_multiplier=1.0, expected_batch_size=4, **kw)
    for bad in (2.0, 0.5, math.inf):
        with pytest.raises(ValueError, match=repr(bad)):
            create_dp_optimizer(
                "dp-macadam-bc", make_params(), noise_multiplier=1.0, expected_batch_size=4, max_grad_norm=bad
            )


# ---------------------------------------------------------------------- DP-AdamBC / DP-AdamW-BC
@pytest.mark.parametrize("name,weight_decay", [("dp-adambc", 0.0), ("dp-adamw-bc", 0.1)])
def test_adambc_matches_its_formula(name, weight_decay):
    lr, betas, gamma_prime, clip, steps = 1e-3, (0.9, 0.999), 1e-4, 1.0, 20
    params = make_params(frozen=False)
    opt = create_dp_optimizer(
        name,
        params,
        lr=lr,
        betas=betas,
        weight_decay=weight_decay,
        gamma_prime=gamma_prime,
        noise_multiplier=SIGMA,
        max_grad_norm=clip,
        expected_batch_size=BATCH,
        noise_seed=5,
    )
    phi = (SIGMA * clip / BATCH) ** 2
    theta = [p.detach().double().numpy().copy() for p in params]
    m = [np.zeros_like(x) for x in theta]
    v = [np.zeros_like(x) for x in theta]
    floored = 0
    for t in range(1, steps + 1):
        set_grad_samples(params, t)
        opt.step()
        for k, p in enumerate(params):
            g = p.grad.double().numpy()  # gtilde (post-processing: the rule sees only this)
            m[k] = betas[0] * m[k] + (1 - betas[0]) * g
            v[k] = betas[1] * v[k] + (1 - betas[1]) * g * g
            mhat, vhat = m[k] / (1 - betas[0] ** t), v[k] / (1 - betas[1] ** t)
            vcorr = np.maximum(vhat - phi, gamma_prime)
            floored += int((vhat - phi < gamma_prime).sum())
            theta[k] = theta[k] - lr * (mhat / np.sqrt(vcorr) + weight_decay * theta[k])
        opt.zero_grad()
        for k, p in enumerate(params):
            np.testing.assert_allclose(p.detach().double().numpy(), theta[k], rtol=1e-5, atol=1e-6)
    assert floored > 0  # the floor was exercised, and so was the subtraction
    assert floored < steps * sum(x.size for x in theta)


# ---------------------------------------------------------------------- scale-then-privatize
@pytest.mark.filterwarnings("ignore:scale-then-privatize")
@pytest.mark.parametrize("name", ["dp-adam-stp", "dp-adamw-stp"])
def test_stp_first_step_uses_unit_scale_then_clips_large_second_moment_less(name):
    gamma_s, clip = 1e-3, 0.5
    p = torch.nn.Parameter(torch.zeros(2))
    opt = create_dp_optimizer(  # the paper's raw scale (the normalized default: tests/test_stp.py)
        name,
        [p],
        lr=0.0,
        gamma_s=gamma_s,
        noise_multiplier=0.0,
        max_grad_norm=clip,
        expected_batch_size=2,
        scale_mode="raw",
    )
    # t = 1: s = 1, plain L2 clipping.
    assert opt.geometry([p]).scale == [None]
    p.grad_sample = torch.tensor([[3.0, 0.04], [3.0, 0.04]])
    opt.step()
    g1 = torch.tensor([3.0, 0.04]) * (clip / math.hypot(3.0, 0.04))
    torch.testing.assert_close(p.grad, g1)
    # t = 2: s = sqrt(vhat_1) + gamma_s: coordinate 0 (large second moment) ~ 0.5, coordinate 1 ~ 0.008.
    beta2 = opt.param_groups[0]["betas"][1]
    vhat1 = (1 - beta2) * g1**2 / (1 - beta2)
    s = vhat1.sqrt() + gamma_s
    torch.testing.assert_close(opt.geometry([p]).scale[0], s)
    # Two examples of the same Euclidean norm, one on each coordinate: ||w|| = 1 / s_j.
    p.grad_sample = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    opt.step()
    kept = p.grad * 2  # each example's retained fraction, in its own coordinate
    torch.testing.assert_close(kept, torch.clamp(clip * s, max=1.0))  # factor min(1, C s_j)
    assert kept[0] > 10 * kept[1]  # the large-second-moment coordinate is clipped (much) less
    # Plain DP-Adam clips both alike.
    q = torch.nn.Parameter(torch.zeros(2))
    plain = create_dp_optimizer(
        "dp-adam", [q], noise_multiplier=0.0, max_grad_norm=clip, expected_batch_size=2
    )
    q.grad_sample = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    plain.step()
    torch.testing.assert_close(q.grad * 2, torch.full((2,), clip))


# ---------------------------------------------------------------------- DP-MicroAdam
def quantize_reference(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """Q then Qinv, one bucket at a time."""
    out = torch.empty_like(x)
    bucket = min(bucket, x.numel())
    for start in range(0, x.numel(), bucket):
        chunk = x[start : start + bucket]
        lo, hi = chunk.min(), chunk.max()
        delta = (hi - lo) / 15
        codes = torch.zeros_like(chunk) if delta == 0 else torch.round((chunk - lo) / delta).clamp(0, 15)
        out[start : start + bucket] = lo + codes * delta
    return out


class MicroAdamReference:
    """DP-MicroAdam per ALGORITHMS.md, one tensor, a Python loop over blocks (fed ``gtilde``)."""

    def __init__(self, numel, *, density, window, block_size, quant_block, betas, eps, lr, wd):
        self.n, self.density, self.m = numel, density, window
        self.block, self.quant_block = min(block_size, numel), quant_block
        self.betas, self.eps, self.lr, self.wd = betas, eps, lr, wd
        self.e = torch.zeros(numel)
        self.rows = [None] * window  # (global indices, bf16-rounded values)
        self.t = 0

    def step(self, theta: torch.Tensor, gtilde: torch.Tensor) -> torch.Tensor:
        self.t += 1
        t, (beta1, beta2) = self.t, self.betas
        a = gtilde.flatten() + self.e
        indices, values = [], []
        for start in range(0, self.n, self.block):
            block = a[start : start + self.block]
            k = math.ceil(self.density * block.numel())
            local = torch.topk(block.abs(), k).indices
            indices.append(local + start)
            values.append(block[local])
        idx = torch.cat(indices)
        self.rows[(t - 1) % self.m] = (idx, torch.cat(values).to(torch.bfloat16).float())
        a = a.clone()
        a[idx] = 0.0
        self.e = quantize_reference(a, self.quant_block)
        mt, vt = torch.zeros(self.n), torch.zeros(self.n)
        for j in range(min(t, self.m)):
            age = (t - 1 - j) % self.m
            rows_idx, rows_val = self.rows[j]
            mt.index_add_(0, rows_idx, beta1**age * rows_val)
            vt.index_add_(0, rows_idx, beta2**age * rows_val**2)
        mhat = (1 - beta1) / (1 - beta1**t) * mt
        vhat = (1 - beta2) / (1 - beta2**t) * vt
        theta = theta.flatten() * (1 - self.lr * self.wd)
        return (theta - self.lr * mhat / (vhat.sqrt() + self.eps)).view(gtilde.shape)


@pytest.mark.parametrize(
    "hp, shapes",
    [
        # 30, 5, 24, 37 elements: partial last blocks and buckets
        (dict(density=0.2, window=4, block_size=16, quant_block=24), SHAPES),
        # density 1%: the CPU's two-round top-k (topk_abs_rows), also in partial last blocks of 512 and 476
        (dict(density=0.01, window=4, block_size=1024, quant_block=1500), [(40, 64), (1500,), (2, 1024)]),
    ],
    ids=["small-blocks", "two-round-topk"],
)
def test_microadam_matches_slow_reference(hp, shapes):
    lr, betas, eps, wd, steps = 1e-2, (0.9, 0.999), 1e-8, 0.1, 11
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(0.1 * torch.randn(s, generator=gen)) for s in shapes]
    opt = create_dp_optimizer(
        "dp-microadam",
        params,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=wd,
        noise_multiplier=SIGMA,
        max_grad_norm=1.0,
        expected_batch_size=BATCH,
        noise_seed=3,
        **hp,
    )
    refs = [MicroAdamReference(p.numel(), betas=betas, eps=eps, lr=lr, wd=wd, **hp) for p in params]
    theta = [p.detach().clone() for p in params]
    for t in range(steps):
        set_grad_samples(params, t)
        opt.step()
        for k, (p, ref) in enumerate(zip(params, refs)):
            theta[k] = ref.step(theta[k], p.grad)
            state = opt.state[p]
            # Error feedback: the stored 4-bit buffer decodes to the reference's e.
            e = dequantize_4bit(
                state["ef_codes"], state["ef_min"], state["ef_max"], p.numel(), hp["quant_block"]
            )
            torch.testing.assert_close(e, ref.e, rtol=1e-5, atol=1e-6)
            # Window row of this step: same per-block top-k indices and bf16 values.
            row = t % hp["window"]
            block = min(hp["block_size"], p.numel())
            offsets = torch.arange(state["win_idx"].shape[1]).unsqueeze(1) * block
            ours_idx = (state["win_idx"][row].long() + offsets).flatten()
            ours_val = state["win_val"][row].float().flatten()
            real = ours_idx < p.numel()
            ref_idx, ref_val = ref.rows[row]
            assert sorted(ours_idx[real].tolist()) == sorted(ref_idx.tolist())
            assert torch.all(ours_val[~real] == 0)
            order_ours, order_ref = ours_idx[real].argsort(), ref_idx.argsort()
            torch.testing.assert_close(ours_val[real][order_ours], ref_val[order_ref])
            torch.testing.assert_close(p.detach(), theta[k], rtol=1e-5, atol=1e-6)
        opt.zero_grad()


def test_topk_count_is_ceil():
    assert topk_count(0.01, 16384) == 164
    assert topk_count(0.07, 100) == 7
    assert topk_count(0.01, 5) == 1
    assert topk_count(1.0, 5) == 5


def test_4bit_quantization_round_trip_and_constant_bucket():
    gen = torch.Generator().manual_seed(0)
    bucket = 64
    x = torch.randn(1001, generator=gen) * torch.linspace(0.1, 10, 1001)
    x[128:192] = -3.7  # one full constant bucket
    x[192:256] = 0.0  # and an all-zero one
    packed, lo, hi = quantize_4bit(x, bucket)
    assert packed.dtype == torch.uint8 and packed.numel() == 501
    assert lo.numel() == hi.numel() == math.ceil(1001 / bucket)
    y = dequantize_4bit(packed, lo, hi, x.numel(), bucket)
    level = ((hi - lo) / 15).repeat_interleave(bucket)[: x.numel()]
    assert torch.all((y - x).abs() <= level * 0.5 + 1e-6)  # within half a level (so within one)
    assert torch.equal(y[128:256], x[128:256])  # constant buckets exact, no 0/0
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, quantize_reference(x, bucket))
    # Byte layout: code 2i in the low nibble, 2i+1 in the high one; an odd tail alone (lo 0, delta 1).
    packed, _, _ = quantize_4bit(torch.tensor([0.0, 15.0, 7.0, 3.0, 15.0]), 5)
    assert packed.tolist() == [0 | 15 << 4, 7 | 3 << 4, 15]
    tiny = torch.full((3,), 2.5)  # a tensor smaller than a bucket, constant
    assert torch.equal(dequantize_4bit(*quantize_4bit(tiny, bucket), 3, bucket), tiny)


def test_microadam_state_is_under_one_byte_per_parameter():
    big = torch.nn.Parameter(torch.zeros(1_000_000))
    opt = create_dp_optimizer(
        "dp-microadam",
        [big],
        lr=1e-3,
        density=0.01,
        window=10,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=2,
        noise_seed=0,
    )
    big.grad_sample = torch.randn(2, big.numel(), generator=torch.Generator().manual_seed(0))
    opt.step()
    per_param = state_nbytes(opt, [big]) / big.numel()
    assert per_param <= 1.0, per_param
    assert opt.state[big]["win_idx"].dtype == torch.int16
    assert opt.state[big]["ef_codes"].dtype == torch.uint8
    adam = create_dp_optimizer(
        "dp-adam", [big], noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=2, noise_seed=0
    )
    big.grad_sample = torch.zeros(2, big.numel())
    adam.step()
    assert state_nbytes(adam, [big]) / big.numel() >= 8.0


# ---------------------------------------------------------------------- hyperparameter validation
@pytest.mark.parametrize(
    "name,bad,shown",
    [
        ("dp-adambc", dict(gamma_prime=-1.0), "-1.0"),
        ("dp-adambc", dict(gamma_prime=0.0), "0.0"),
        ("dp-adamw-bc", dict(gamma_prime=float("nan")), "nan"),
        ("dp-adambc", dict(betas=(0.9, 1.5)), "1.5"),
        ("dp-macadam", dict(h1=-3.0), "-3.0"),
        ("dp-macadam", dict(h2=0.0), "0.0"),
        ("dp-macadam", dict(gamma=-0.25), "-0.25"),
        ("dp-macadam", dict(betas=(1.2, 0.999)), "1.2"),
        ("dp-macadam-bc", dict(bc_phi="bogus"), "'bogus'"),
        ("dp-macadam-bc", dict(gamma_prime=-2.0), "-2.0"),
        ("dp-adam-stp", dict(gamma_s=-0.5), "-0.5"),
        ("dp-adamw-stp", dict(gamma_s=0.0), "0.0"),
        ("dp-adam-stp", dict(eps=-1.0), "-1.0"),
        ("dp-microadam", dict(density=1.5), "1.5"),
        ("dp-microadam", dict(density=0.0), "0.0"),
        ("dp-microadam", dict(window=0), "0"),
        ("dp-microadam", dict(window=2.5), "2.5"),
        ("dp-microadam", dict(block_size=40000), "40000"),
        ("dp-microadam", dict(quant_block=0), "0"),
        ("dp-microadam", dict(eps=-1e-3), "-0.001"),
        ("dp-microadam", dict(weight_decay=-0.1), "-0.1"),
    ],
)
def test_rule_hyperparameters_are_validated(name, bad, shown):
    kwargs = dict(noise_multiplier=1.0, expected_batch_size=4)
    if "macadam" not in name:
        kwargs["max_grad_norm"] = 1.0
    with pytest.raises(ValueError) as info:
        create_dp_optimizer(name, make_params(), **kwargs, **bad)
    assert shown in str(info.value)


def test_macadam_h1_above_h2_is_rejected():
    with pytest.raises(ValueError, match="h1=0.01"):
        create_dp_optimizer(
            "dp-macadam", make_params(), h1=1e-2, h2=1e-3, noise_multiplier=1.0, expected_batch_size=4
        )


def test_microadam_per_group_override_is_validated():
    params = make_params(frozen=False)
    with pytest.raises(ValueError, match="70000"):
        create_dp_optimizer(
            "dp-microadam",
            [{"params": params[:2]}, {"params": params[2:], "block_size": 70000}],
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            expected_batch_size=4,
        )
