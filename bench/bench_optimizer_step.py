"""Time one ``step()`` of every dp_hf optimizer against ``torch.optim.AdamW(foreach=True)``.

A DP step here is privatization (clip a small batch of random per-example
gradients, noise once, divide by ``B``) plus the optimizer's update; the AdamW
baseline is its update on a ready ``p.grad``. Every optimizer runs on the same
parameter set in the same process, one after the other, and the table reports the
median step time, the ratio to AdamW and the optimizer state in bytes per
parameter (sum of ``nbytes`` of the tensors in ``optimizer.state[p]``, without the
optimizer-wide ``"dp"`` entry).

    python bench/bench_optimizer_step.py --numel 5000000 --repeats 5 --device cpu
    python bench/bench_optimizer_step.py --bert-like --repeats 5 --device cpu

The noise is drawn inside the timed step: a trainer on a CPU draws the next step's noise ahead, during
the forward and backward passes (``NoiseSource.draw_ahead``), but back-to-back steps have nothing to
hide it behind, and a draw still running from one optimizer would slow the next one's timed step.

``--bert-like`` replaces the four big tensors by 169 BERT-shaped ones (~10M parameters), where the
per-tensor Python and kernel-launch overhead of an optimizer shows (issue 16: DP-MicroAdam's step
grew with the tensor count).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dp_hf.noise
from dp_hf.optim import OPTIMIZERS, create_dp_optimizer

dp_hf.noise.PREFETCH_MIN_NUMEL = 1 << 62  # no draw ahead: see the module docstring

# Every rule runs with its defaults; MacAdam fixes C = 1 and takes no max_grad_norm.
FIXED_CLIP = {"dp-macadam", "dp-macadam-bc"}


def make_shapes(numel: int) -> list[tuple[int, ...]]:
    """A few tensors (three matrices and a vector) totalling about ``numel`` elements."""
    width = 1024
    shapes = []
    for fraction in (0.45, 0.3, 0.2):
        shapes.append((max(1, int(numel * fraction) // width), width))
    shapes.append((max(1, numel - sum(r * c for r, c in shapes)),))
    return shapes


def bert_like_shapes(hidden: int = 256, layers: int = 12, vocab: int = 2048) -> list[tuple[int, ...]]:
    """169 tensors, ~10M parameters, shaped like a small BERT encoder.

    Per layer: q/k/v/output ``[h, h]`` matrices and their biases, the FFN ``[4h, h]`` / ``[h, 4h]``
    matrices and their biases, two LayerNorm scales (14 tensors); plus one ``[vocab, h]`` embedding.
    """
    shapes: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(hidden,)] * 4
        shapes += [(4 * hidden, hidden), (4 * hidden,), (hidden, 4 * hidden), (hidden,)]
        shapes += [(hidden,)] * 2
    return shapes


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def state_bytes_per_param(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> float:
    total = sum(
        value.nbytes
        for p in params
        for value in optimizer.state[p].values()
        if isinstance(value, torch.Tensor)
    )
    return total / sum(p.numel() for p in params)


def time_round_robin(entries, repeats: int, device: torch.device) -> list[float]:
    """Median seconds of ``step()`` per entry ``(optimizer, feed)``.

    One warm-up step each (lazy state, allocator), then ``repeats`` rounds that time
    every optimizer once in turn, so that load from other processes hits all alike.
    """
    for optimizer, feed in entries:
        feed()
        optimizer.step()
    times: list[list[float]] = [[] for _ in entries]
    for _ in range(repeats):
        for k, (optimizer, feed) in enumerate(entries):
            feed()
            sync(device)
            start = time.perf_counter()
            optimizer.step()
            sync(device)
            times[k].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def profile_steps(entries, names: list[str], device: torch.device, path: str) -> None:
    """One more ``step()`` of each optimizer under ``torch.profiler``: device time first, then host self time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    keys = (
        ["self_cuda_time_total", "self_cpu_time_total"] if device.type == "cuda" else ["self_cpu_time_total"]
    )
    with open(path, "w") as f:
        for name, (optimizer, feed) in zip(names, entries):
            feed()
            sync(device)
            with profile(activities=activities) as prof:
                optimizer.step()
                sync(device)
            for key in keys:
                f.write(
                    f"## {name}, sorted by {key}\n{prof.key_averages().table(sort_by=key, row_limit=30)}\n\n"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=5_000_000, help="total parameters (default 5M)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per optimizer (median reported)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--batch", type=int, default=4, help="per-example gradients per step")
    parser.add_argument(
        "--bert-like",
        action="store_true",
        help="169 BERT-shaped tensors (~10M parameters) instead of --numel",
    )
    parser.add_argument(
        "--bert-base", action="store_true", help="BERT-base's 201 tensor shapes (~110M parameters; CUDA)"
    )
    parser.add_argument(
        "--profile", default=None, help="file for torch.profiler tables of one more step each"
    )
    parser.add_argument("--only", nargs="*", default=None, help="time only these registry names")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    if args.bert_base:
        # + position and token-type embeddings, the embedding LayerNorm, pooler and classifier
        shapes = bert_like_shapes(hidden=768, layers=12, vocab=30522) + [(512, 768), (2, 768), (768,), (768,)]
        shapes += [(768, 768), (768,), (2, 768), (2,)]
    else:
        shapes = bert_like_shapes() if args.bert_like else make_shapes(args.numel)
    init = [torch.randn(s, generator=gen, device=device) * 0.02 for s in shapes]
    grad_samples = [torch.randn((args.batch, *s), generator=gen, device=device) * 1e-2 for s in shapes]
    mean_grads = [g.mean(0) for g in grad_samples]
    numel = sum(t.numel() for t in init)

    names, entries, param_sets = [], [], []
    adamw_params = [torch.nn.Parameter(t.clone()) for t in init]

    def feed_grads(params=adamw_params):
        for p, g in zip(params, mean_grads):
            p.grad = g

    names.append("torch AdamW (foreach, no DP)")
    entries.append((torch.optim.AdamW(adamw_params, lr=1e-3, foreach=True), feed_grads))
    param_sets.append(adamw_params)

    for name in OPTIMIZERS if args.only is None else args.only:
        params = [torch.nn.Parameter(t.clone()) for t in init]
        kwargs = dict(lr=1e-3, noise_multiplier=1.0, expected_batch_size=args.batch, noise_seed=0)
        if name not in FIXED_CLIP:
            kwargs["max_grad_norm"] = 1.0

        def feed_samples(params=params):
            for p, g in zip(params, grad_samples):
                p.grad_sample = g  # consumed (not copied) by the privatizer

        names.append(name)
        entries.append((create_dp_optimizer(name, params, **kwargs), feed_samples))
        param_sets.append(params)

    seconds = time_round_robin(entries, args.repeats, device)
    if args.profile:
        profile_steps(entries, names, device, args.profile)
    base = seconds[0]
    rows = [
        (name, sec, state_bytes_per_param(opt, params))
        for name, sec, (opt, _), params in zip(names, seconds, entries, param_sets)
    ]

    print(
        f"\nstep() time, {numel / 1e6:.2f}M parameters in {len(shapes)} tensors, batch {args.batch}, "
        f"device {args.device} ({torch.get_num_threads()} threads), median of {args.repeats} interleaved rounds\n"
    )
    print("| optimizer | step (ms) | x AdamW | state bytes / param |")
    print("|---|---:|---:|---:|")
    for name, seconds, nbytes in rows:
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / base:.2f} | {nbytes:.3f} |")


if __name__ == "__main__":
    main()
