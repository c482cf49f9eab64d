"""How much the tensor-core error bound inflates the clip norms of real bf16 models (CUDA only).

For one bf16-autocast backward pass of each model on random data, the ghost norms are computed as
the trainer does (bf16 factors on tensor cores) and the table reports the ratio of the norm the clip
factor uses (inflated by the bound of dp_hf.per_example.ghost.tensor_cores) to the estimate itself:
the fraction of the clip norm the bound costs, per example (median and maximum over the batch).

    python bench/bench_tensor_cores.py
    python bench/bench_tensor_cores.py --emulate-on-cpu --models bert-base:8:128 gpt2-medium:1:512

``--emulate-on-cpu`` (no GPU): a bf16-weight model on the CPU, whose bf16 factors the bound treats as
the CUDA path's (``Tensor.is_cuda`` made True while it is computed); the norms are the float32 CPU
path's, which the tensor-core norms approximate. ``--top N`` also lists the N tensors whose terms
``delta_t (sum_k S_k)^2 / n^`` are largest.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_trainer import build_model  # noqa: E402

from dp_hf.per_example.ghost import attach_fast_clipping  # noqa: E402
from dp_hf.per_example.ghost.kernels import on_tensor_cores  # noqa: E402
from dp_hf.per_example.ghost.norms import sq_norms  # noqa: E402
from dp_hf.per_example.ghost.tensor_cores import (  # noqa: E402
    model_precision_records,
    rounding_bound,
    tensor_delta,
)
from dp_hf.privatizer import Geometry  # noqa: E402


def inflation(
    name: str, batch: int, seq_len: int, emulate: bool = False, top: int = 0
) -> tuple[float, float, float]:
    model, kind = build_model(name)
    model = (model.to(torch.bfloat16) if emulate else model.cuda()).train()
    device = torch.device("cpu" if emulate else "cuda")
    clipping = attach_fast_clipping(model, mode="ghost")
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, model.config.vocab_size, (batch, seq_len), generator=g).to(device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not emulate):
        if kind == "clm":
            logits = model(input_ids=ids).logits.float()
            losses = torch.nn.functional.cross_entropy(
                logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none"
            ).mean(dim=1)
        else:
            labels = torch.randint(0, 2, (batch,), generator=g).to(device)
            logits = model(input_ids=ids).logits.float()
            losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    losses.sum().backward()
    records = model_precision_records([clipping.recorder.records.get(id(p)) for p in params])
    with torch.no_grad():  # as the clipping pass runs (the recorded inputs require grad)
        sq = _sq_norms(records, params, batch, ids.device)
        with _as_cuda() if emulate else contextlib.nullcontext():
            bound = rounding_bound(records, batch, ids.device)
            if bound is not None and top:
                _print_top(records, params, model, sq, top)
    clipping.remove()
    if bound is None:  # no layer kept (a, g) factors (e.g. LoRA: every G_i is small and formed densely)
        return 0.0, 0.0, 0.0
    ratio = (bound.inflate(sq) / sq.sqrt() - 1).detach()
    return float(ratio.median()), float(ratio.max()), bound.delta


@contextlib.contextmanager
def _as_cuda():
    real = torch.Tensor.is_cuda
    torch.Tensor.is_cuda = property(lambda self: True)
    try:
        yield
    finally:
        torch.Tensor.is_cuda = real


def _print_top(records, params, model, sq: torch.Tensor, top: int) -> None:
    names = {id(p): n for n, p in model.named_parameters()}
    terms = []
    for record in records:
        outers = [o for o in record.outers if on_tensor_cores(o)] if record is not None else []
        if outers:
            mass = _position_norm_mass(outers)
            delta = tensor_delta(record, outers)
            terms.append((float((delta * mass / sq).median()), names[id(record.param)], delta))
    for share, name, delta in sorted(terms, reverse=True)[:top]:
        print(f"    {name}: delta_t {delta:.2e}, median delta_t (sum_k S_k)^2 / n^ = {share:.2e}")


def _position_norm_mass(outers) -> torch.Tensor:
    total = sum((o.rows.double().norm(dim=-1) * o.cols.double().norm(dim=-1)).sum(dim=1) for o in outers)
    return total.square()


def _sq_norms(records, params, batch: int, device: torch.device) -> torch.Tensor:
    return sq_norms(
        records,
        params,
        Geometry(max_grad_norm=1.0),
        ghost=True,
        batch=batch,
        device=device,
        budget=256 * 2**20,
        dtype=torch.float32,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", nargs="+", default=["bert-base:32:128", "gpt2-medium:8:512", "llama-1b-lora:4:512"]
    )
    parser.add_argument("--emulate-on-cpu", action="store_true")
    parser.add_argument("--top", type=int, default=0)
    args = parser.parse_args()
    if args.emulate_on_cpu:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    print("| model | batch x positions | median norm inflation | max | largest delta_t |")
    print("|---|---|---|---|---|")
    for spec in args.models:
        name, batch, seq_len = spec.split(":")
        median, worst, delta = inflation(name, int(batch), int(seq_len), args.emulate_on_cpu, args.top)
        print(f"| {name} | {batch} x {seq_len} | {median:.2e} | {worst:.2e} | {delta:.2e} |", flush=True)


if __name__ == "__main__":
    main()
