"""The fused geometry-norm kernel (dp_hf/per_example/ghost/fused.py), run in Triton's interpreter on the CPU.

On CUDA the kernel replaces the materialize path's ``G_i`` chunks for a Linear-like weight. Here Triton's
interpreter runs the same kernel source in a process of its own (tests/fused_interpreter_worker.py), so its
indexing, masking, example groups, strides and sums, and the first-launch cross-check, are checked against
float64 references on every machine. The compiled kernel's checks (tensor cores, speed) are in
tests/test_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from dp_hf.per_example.ghost import fused  # noqa: E402

WORKER = Path(__file__).resolve().parent / "fused_interpreter_worker.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fused") / "results.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent.parent)}
    done = subprocess.run([sys.executable, str(WORKER), str(out)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=False)


def float64_sums(rows, cols, shift, scale):
    g = torch.einsum("btr,btc->brc", rows.double(), cols.double())
    a = torch.einsum("btr,btc->brc", rows.double().abs(), cols.double().abs())
    shape = g.shape[1:]
    w = g - shift.double().reshape(shape) if shift is not None else g
    s = scale.double().reshape(shape) if scale is not None else 1.0
    return (w / s).square().sum((1, 2)), g.square().sum((1, 2)), (a / s).square().sum((1, 2))


@pytest.mark.parametrize(
    "name",
    [
        "float32-shift-scale",
        "float32-scale-strided",
        "float32-identity",
        "bf16-shift-scale",
        "bf16-identity-strided",
    ],
)
def test_kernel_sums_equal_float64(results, name):
    case = results["kernel"][name]
    assert case["strided"] == name.endswith("strided")
    want = float64_sums(case["rows"], case["cols"], case["shift"], case["scale"])
    for key, expected in zip(("sq", "ident", "abs"), want):
        torch.testing.assert_close(case[key].double(), expected, rtol=2e-5, atol=1e-6, msg=key)
    assert (
        case["ident"][3] == case["abs"][3] == 0
    )  # the example of zeros (its sq: ||c / s||^2, compared above)
    # The first launch of its kind was cross-checked against the torch path, and agreed.
    assert case["checked"] and not case["disabled"]


def test_materialize_clipping_with_the_kernel_equals_the_torch_path(results):
    out = results["clipping"]
    # The two Linear weights ([B, T, out] output gradients): the embedding and the biases take other paths.
    assert sorted(out["launches"]) == [(10, 9, 16), (10, 9, 80)] and out["launches_when_off"] == 0
    (sums, norms), (ref_sums, ref_norms) = out["kernel"], out["torch"]
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    for got, want in zip(sums, ref_sums):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_wrong_kernel_is_caught_by_the_first_launch_check_and_the_torch_path_takes_over(results):
    # A kernel whose norms read 10% low must not reach the clip factors: the first launch's cross-check
    # warns once, and that pass and the next are the torch path's, exactly.
    out = results["clipping"]
    assert len(out["lossy_warnings"]) == 1 and "disagreed with the torch path" in out["lossy_warnings"][0]
    assert out["disabled"]
    # A kernel that fails to build (first launch) warns once too, and the torch path takes over.
    assert len(out["broken_warnings"]) == 1 and "failed on its first launch" in out["broken_warnings"][0]
    assert "PassManager::run failed" in out["broken_warnings"][0]
    for run in ("lossy", "lossy_again", "broken"):
        sums, norms = out[run]
        torch.testing.assert_close(norms, out["torch"][1], rtol=0, atol=0)
        for got, want in zip(sums, out["torch"][0]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_kernel_is_off_on_the_cpu_without_the_interpreter_and_when_asked(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fused.fused_enabled(torch.device("cpu"))
    assert (
        fused.fused_outer_norms(torch.randn(2, 3, 4), torch.randn(2, 3, 5), None, None, absolute=False)
        is None
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused.fused_enabled(torch.device("cpu"))
    monkeypatch.setenv(fused.FUSED_NORMS_ENV, "0")
    assert not fused.fused_enabled(torch.device("cpu"))
