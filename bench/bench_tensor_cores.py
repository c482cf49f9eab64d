"""How much the tensor-core error bound inflates the clip norms of real bf16 models (CUDA only).

For one bf16-autocast backward pass of each model on random data, the ghost norms are computed as
the trainer does (bf16 factors on tensor cores) and the table reports the ratio of the norm the clip
factor uses (inflated by the bound of dp_hf.per_example.ghost.tensor_cores) to the estimate itself:
the fraction of the clip norm the bound costs, per example (median and maximum over the batch).

    python bench/bench_tensor_cores.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_trainer import build_model  # noqa: E402

from dp_hf.per_example.ghost import attach_fast_clipping  # noqa: E402
from dp_hf.per_example.ghost.norms import sq_norms  # noqa: E402
from dp_hf.per_example.ghost.tensor_cores import model_precision_records, rounding_bound  # noqa: E402
from dp_hf.privatizer import Geometry  # noqa: E402


def inflation(name: str, batch: int, seq_len: int) -> tuple[float, float, float]:
    model, kind = build_model(name)
    model = model.cuda().train()
    clipping = attach_fast_clipping(model, mode="ghost")
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, model.config.vocab_size, (batch, seq_len), generator=g).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if kind == "clm":
            logits = model(input_ids=ids).logits.float()
            losses = torch.nn.functional.cross_entropy(
                logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none"
            ).mean(dim=1)
        else:
            labels = torch.randint(0, 2, (batch,), generator=g).cuda()
            logits = model(input_ids=ids).logits.float()
            losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    losses.sum().backward()
    records = model_precision_records([clipping.recorder.records.get(id(p)) for p in params])
    with torch.no_grad():  # as the clipping pass runs (the recorded inputs require grad)
        sq, bound = _norms_and_bound(records, params, batch, ids.device)
    clipping.remove()
    if bound is None:  # no layer kept (a, g) factors (e.g. LoRA: every G_i is small and formed densely)
        return 0.0, 0.0, 0.0
    ratio = (bound.inflate(sq) / sq.sqrt() - 1).detach()
    return float(ratio.median()), float(ratio.max()), bound.delta


def _norms_and_bound(records, params, batch: int, device: torch.device):
    sq = sq_norms(
        records,
        params,
        Geometry(max_grad_norm=1.0),
        ghost=True,
        batch=batch,
        device=device,
        budget=256 * 2**20,
        dtype=torch.float32,
    )
    return sq, rounding_bound(records, batch, device)


def main() -> None:
    print("| model | batch x positions | median norm inflation | max | largest delta_t |")
    print("|---|---|---|---|---|")
    for name, batch, seq_len in [("bert-base", 32, 128), ("gpt2-medium", 8, 512), ("llama-1b-lora", 4, 512)]:
        median, worst, delta = inflation(name, batch, seq_len)
        print(f"| {name} | {batch} x {seq_len} | {median:.2e} | {worst:.2e} | {delta:.2e} |", flush=True)


if __name__ == "__main__":
    main()
