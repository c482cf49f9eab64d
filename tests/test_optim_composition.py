"""Optimizer variants are compositions: a flag or a wrapper gives the same steps as the named class."""

from __future__ import annotations

import pytest
import torch

from dp_hf.optim import get_optimizer_class

DP = dict(noise_multiplier=0.5, max_grad_norm=1.0, expected_batch_size=4)


def _run(make, steps: int = 6) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    optimizer = make(params)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad_sample = torch.randn((4, *p.shape), generator=g)
            p.grad = p.grad_sample.sum(0)
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize(
    ("named", "base", "extra"),
    [
        ("dp-adamw", "dp-adam", {}),
        ("dp-adamw-bc", "dp-adambc", {"gamma_prime": 1e-8}),
    ],
)
def test_decoupled_weight_decay_is_a_flag(named, base, extra):
    wd = dict(weight_decay=0.05, lr=1e-2, **extra)
    reference = _run(lambda ps: get_optimizer_class(named)(ps, noise_seed=3, **wd, **DP))
    flagged = _run(
        lambda ps: get_optimizer_class(base)(ps, noise_seed=3, decoupled_weight_decay=True, **wd, **DP)
    )
    for a, b in zip(reference, flagged):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    coupled = _run(lambda ps: get_optimizer_class(base)(ps, noise_seed=3, **wd, **DP))
    assert any(not torch.equal(a, b) for a, b in zip(reference, coupled))  # the flag does something


def test_microadam_warns_when_too_sparse_for_the_run():
    from dp_hf.optim.microadam import sparse_horizon_warning

    optimizer = get_optimizer_class("dp-microadam")([torch.nn.Parameter(torch.randn(64))], density=0.01, **DP)
    with pytest.warns(UserWarning, match="selects each coordinate about 0.6 times"):
        optimizer.check_horizon(60)
    assert sparse_horizon_warning(0.01, 1000) is None  # 10 selections per coordinate: fine


@pytest.mark.slow
def test_fidelity_benchmark_quick_mode_runs(tmp_path):
    # The CI smoke of bench/fidelity.py: both tasks, two optimizers, tables and plots written.
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("matplotlib")
    script = Path(__file__).resolve().parent.parent / "bench" / "fidelity.py"
    subprocess.run([sys.executable, str(script), "--quick", "--out", str(tmp_path)], check=True, timeout=600)
    written = {p.name for p in tmp_path.iterdir()}
    for task in ("digits", "mlm"):
        assert f"{task}_summary.md" in written and f"{task}_vs_eps.png" in written, written


def test_scale_then_privatize_wraps_any_adam_rule():
    from dp_hf.optim.adambc import DPAdamBC
    from dp_hf.optim.stp import DPAdamSTP, DPAdamWSTP, ScaleThenPrivatize, scale_then_privatize

    bc_stp = scale_then_privatize(DPAdamBC)  # bias correction and scale-then-privatize, composed
    assert issubclass(bc_stp, ScaleThenPrivatize) and issubclass(bc_stp, DPAdamBC)
    assert not bc_stp.identity_geometry
    exact = dict(noise_multiplier=0.0, max_grad_norm=float("inf"), expected_batch_size=4, lr=1e-2)
    # Without clipping or noise the geometry maps out and back: the wrapped rule's own steps.
    composed = _run(lambda ps: bc_stp(ps, noise_seed=3, **exact))
    plain = _run(lambda ps: DPAdamBC(ps, noise_seed=3, **exact))
    for a, b in zip(composed, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # With clipping, the composed geometry is the STP one (scaled after the first step).
    params = [torch.nn.Parameter(torch.randn(5, 3))]
    optimizer = bc_stp(params, noise_seed=3, **DP)
    params[0].grad_sample = torch.randn(4, 5, 3)
    optimizer.step()
    assert optimizer.current_geometry().scale[0] is not None
    # The named rows are the wrapper over DP-Adam / DP-AdamW.
    wd = dict(weight_decay=0.05, lr=1e-2)
    named = _run(lambda ps: DPAdamWSTP(ps, noise_seed=3, **wd, **DP))
    flagged = _run(lambda ps: DPAdamSTP(ps, noise_seed=3, decoupled_weight_decay=True, **wd, **DP))
    for a, b in zip(named, flagged):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
