"""How much the tensor-core error bound inflates the clip norms of real bf16 models (CUDA only).

For one bf16-autocast backward pass of each model on random data, the ghost norms are computed as
the trainer does (bf16 factors on tensor cores) and the table reports the ratio of the norm the clip
factor uses (inflated by the bound of dp_hf.per_example.ghost.tensor_cores) to the estimate itself:
the fraction of the clip norm the bound costs, per example (median and maximum over the batch).

    python bench/bench_tensor_cores.py
    python bench/bench_tensor_cores.py --emulate-on-cpu --models bert-base:8:128 gpt2-medium:1:512

``--emulate-on-cpu`` (no GPU): a bf16-weight model on the CPU, whose bf16 factors take the CUDA path
(``Tensor.is_cuda`` made True, and ``out_dtype`` GEMMs computed as exact bf16 products summed by the
CPU's float32 GEMM, which the tensor cores' sums approximate). The table also gives the median
inflation of the Gram-free bound (``delta_t (sum_k S_k)^2`` for every tensor, before the first-order
terms of ``dp_hf.per_example.ghost.grams``). ``--top N`` lists the N tensors whose terms are largest
against ``n^``.
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
from dp_hf.per_example.ghost.grams import GramCache  # noqa: E402
from dp_hf.per_example.ghost.kernels import on_tensor_cores  # noqa: E402
from dp_hf.per_example.ghost.norms import sq_norms  # noqa: E402
from dp_hf.per_example.ghost.tensor_cores import (  # noqa: E402
    first_order_terms,
    model_precision_records,
    rounding_bound,
    second_order,
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
    grams = GramCache()  # as clipped_sum shares it: the norms leave the bound's first-order terms there
    with torch.no_grad(), _as_cuda() if emulate else contextlib.nullcontext():  # (the inputs require grad)
        sq = _sq_norms(records, params, batch, ids.device, grams)
        bound = rounding_bound(records, batch, ids.device, grams)
        gram_free = rounding_bound(records, batch, ids.device)  # without them: delta_t (sum_k S_k)^2
        if bound is not None and top:
            _print_top(records, model, sq, top, grams)
    clipping.remove()
    if bound is None:  # no layer kept (a, g) factors (e.g. LoRA: every G_i is small and formed densely)
        return 0.0, 0.0, 0.0, 0.0
    ratio = (bound.inflate(sq) / sq.sqrt() - 1).detach()
    old = (gram_free.inflate(sq) / sq.sqrt() - 1).detach()
    return float(ratio.median()), float(ratio.max()), float(old.median()), bound.delta


@contextlib.contextmanager
def _as_cuda():
    """CUDA's bf16 tensor-core branch on the CPU: ``Tensor.is_cuda`` True, and ``torch.mm``/``torch.bmm``
    take ``out_dtype=torch.float32`` for bf16 operands (exact products, the CPU's float32 GEMM)."""
    real_is_cuda, real_mm, real_bmm = torch.Tensor.is_cuda, torch.mm, torch.bmm

    def with_out_dtype(real):
        def op(a, b, *args, out_dtype=None, out=None, **kwargs):
            if out_dtype is None:
                return real(a, b, *args, out=out, **kwargs)
            return real(a.float(), b.float(), *args, out=out, **kwargs)

        return op

    torch.Tensor.is_cuda = property(lambda self: True)
    torch.mm, torch.bmm = with_out_dtype(real_mm), with_out_dtype(real_bmm)
    try:
        yield
    finally:
        torch.Tensor.is_cuda, torch.mm, torch.bmm = real_is_cuda, real_mm, real_bmm


def _print_top(records, model, sq: torch.Tensor, top: int, grams: GramCache) -> None:
    """The ``top`` tensors whose bound terms are largest against ``n^``: the Gram-free ``delta_t (sum_k S_k)^2``
    and the one the clip factor uses (with the first-order terms the Grams left)."""
    names = {id(p): n for n, p in model.named_parameters()}
    terms = []
    for record in records:
        outers = [o for o in record.outers if on_tensor_cores(o)] if record is not None else []
        if outers:
            mass = _position_norm_mass(outers)
            gram_free = tensor_delta(record, outers) * mass
            first = first_order_terms(outers, grams.errors)
            used = (
                gram_free
                if first is None
                else torch.minimum(gram_free, first + second_order(record, outers) * mass)
            )
            terms.append(
                (float((used / sq).median()), float((gram_free / sq).median()), names[id(record.param)])
            )
    for share, old, name in sorted(terms, reverse=True)[:top]:
        print(f"    {name}: median term / n^ {share:.2e} (Gram-free {old:.2e})")


def _position_norm_mass(outers) -> torch.Tensor:
    total = sum((o.rows.double().norm(dim=-1) * o.cols.double().norm(dim=-1)).sum(dim=1) for o in outers)
    return total.square()


def _sq_norms(records, params, batch: int, device: torch.device, grams: GramCache) -> torch.Tensor:
    return sq_norms(
        records,
        params,
        Geometry(max_grad_norm=1.0),
        ghost=True,
        batch=batch,
        device=device,
        budget=256 * 2**20,
        dtype=torch.float32,
        grams=grams,
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
    print(
        "| model | batch x positions | median norm inflation | max | median, Gram-free bound | largest delta_t |"
    )
    print("|---|---|---|---|---|---|")
    for spec in args.models:
        name, batch, seq_len = spec.split(":")
        median, worst, old, delta = inflation(name, int(batch), int(seq_len), args.emulate_on_cpu, args.top)
        row = f"| {name} | {batch} x {seq_len} | {median:.2e} | {worst:.2e} | {old:.2e} | {delta:.2e} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
