"""bench/bench_tensor_cores.py --emulate-on-cpu: the bound's cost on a bf16 causal LM, on the CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def _load_bench():
    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(
        "bench_tensor_cores", REPO / "bench" / "bench_tensor_cores.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_emulated_inflation_of_a_causal_lm_with_and_without_the_first_order_terms(monkeypatch, capsys):
    """The clip-norm inflation the trainer would use is positive and below the Gram-free bound's (a causal
    LM's nearly orthogonal position gradients), and the emulation leaves torch as it found it."""
    from tiny_models import tiny_gpt2_lm

    bench = _load_bench()
    monkeypatch.setattr(
        bench, "build_model", lambda name: (tiny_gpt2_lm(n_embd=64, n_inner=256, n_positions=64), "clm")
    )
    mm, bmm, is_cuda = torch.mm, torch.bmm, torch.Tensor.is_cuda
    median, worst, gram_free, delta = bench.inflation("tiny-gpt2", 2, 48, emulate=True, top=3)
    assert (torch.mm, torch.bmm, torch.Tensor.is_cuda) == (mm, bmm, is_cuda)
    assert 0 < median <= worst and delta > 0
    assert median < gram_free / 2, (median, gram_free)
    assert len([line for line in capsys.readouterr().out.splitlines() if "Gram-free" in line]) == 3
