"""``DPTrainer.train()`` against ``Trainer.train()`` end to end: the step time users see.

Every run builds the same model from a config (same seed, no download), the same synthetic data of
the model's real shapes, and calls ``train()`` as a user would (``bf16=True`` with ``--bf16``). A
callback times each optimizer step (synchronizing the device at step begin and end); the table
reports the median step after ``--warmup`` steps, the ratio to the plain ``Trainer`` of the same
process, the forward/backward passes per optimizer step (Poisson draws larger than the physical
batch cap take two) and, on CUDA, the peak of ``torch.cuda.max_memory_allocated`` during ``train()``.

The plain ``Trainer`` uses the Trainer's default optimizer (``optim`` as transformers sets it, fused
AdamW on CUDA) on the mean loss over shuffled batches of ``--batch``; the DP runs sample Poisson
batches of expected size ``--batch`` (no accumulation), sigma 1, C 1.

``--repeats R`` alternates the runs R times (Trainer, each DP optimizer, Trainer, ...) and reports, per
run, the median over the rounds of its median step (and of its end-to-end time), with the range of the
per-round ratios: on a shared machine whose load drifts, one pair of runs can be off by 1.5x.

``--e2e`` also times construction plus ``train()`` (wall clock, including the privacy calibration
with ``target_epsilon``), as a user's small script experiences it. ``--fresh-processes`` runs each run
in a process of its own with no warm-up run, as a user's script runs: the one-time costs of a process
(lazy imports, first kernels of each shape, the once-per-run probes' odd shapes) then count, where in
one process the later runs find them paid.

``--phases`` also splits each run's median step into the model's forward, ``backward()``, the DP
clipping pass (``FastClipping.accumulate``, or the optimizer's ``clip_and_accumulate`` on Opacus's
hooks), the optimizer step (with its post-step hooks: the accountant) and the rest (data, callbacks,
logs), timed around each call (the device synchronized at each boundary, so on CUDA the split costs
a little time of its own). The plain ``Trainer`` computes its loss inside the forward.

    python bench/bench_trainer.py --model bert-base --device cuda --bf16 --batch 64 --seq-len 128
    python bench/bench_trainer.py --model gpt2-medium --device cuda --bf16 --batch 16 --seq-len 512
    python bench/bench_trainer.py --model llama-1b-lora --device cuda --bf16 --batch 16 --seq-len 512
    python bench/bench_trainer.py --model tiny-bert --device cpu --batch 32 --seq-len 16 --steps 200 --e2e
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = ("tiny-bert", "bert-base", "gpt2-medium", "llama-1b-lora", "deit-small")


def build_config(name: str):
    """``(config, kind)``: kind ``"cls"`` (sequence classification), ``"clm"`` (causal LM) or ``"image"``."""
    import transformers as tf

    if name == "tiny-bert":
        config = tf.BertConfig(
            vocab_size=1000,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=512,
        )
        return config, "cls"
    if name == "bert-base":
        return tf.BertConfig(), "cls"
    if name == "gpt2-medium":
        return tf.GPT2Config(n_embd=1024, n_layer=24, n_head=16, n_positions=1024), "clm"
    if name == "llama-1b-lora":
        config = tf.LlamaConfig(
            vocab_size=32000,
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=5632,
            max_position_embeddings=2048,
        )
        return config, "clm"
    if name == "deit-small":
        config = tf.DeiTConfig(
            hidden_size=384,
            num_hidden_layers=12,
            num_attention_heads=6,
            intermediate_size=1536,
            num_labels=100,
        )
        return config, "image"
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def build_model(name: str):
    """``(model, kind)`` from :func:`build_config` (random weights, seed 0; LoRA r16 for the Llama)."""
    import transformers as tf

    config, kind = build_config(name)
    torch.manual_seed(0)
    if kind == "image":
        return tf.DeiTForImageClassification(config), kind
    if kind == "cls":
        return tf.BertForSequenceClassification(config), kind
    if name == "gpt2-medium":
        return tf.GPT2LMHeadModel(config), kind
    import peft

    lora = peft.LoraConfig(
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(tf.LlamaForCausalLM(config), lora), kind


def make_dataset(kind: str, n: int, seq_len: int, vocab: int):
    import datasets

    g = torch.Generator().manual_seed(0)
    if kind == "image":
        pixels = torch.randn(n, 3, 224, 224, generator=g, dtype=torch.float16)
        data = datasets.Dataset.from_dict(
            {"pixel_values": pixels.numpy(), "labels": torch.randint(0, 100, (n,), generator=g).tolist()}
        )
        return data.with_format("torch")
    ids = torch.randint(5, vocab, (n, seq_len), generator=g)
    columns = {"input_ids": ids.numpy(), "attention_mask": torch.ones(n, seq_len, dtype=torch.int64).numpy()}
    columns["labels"] = ids.numpy() if kind == "clm" else torch.randint(0, 2, (n,), generator=g).numpy()
    return datasets.Dataset.from_dict(columns).with_format("torch")


class StepTimer:
    """A TrainerCallback timing each optimizer step and counting forward passes."""

    def __init__(self, device: torch.device) -> None:
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.sync()
                timer.started = time.perf_counter()
                timer.in_step = True

            def on_step_end(self, args, state, control, **kwargs):
                timer.sync()
                timer.in_step = False
                timer.times.append(time.perf_counter() - timer.started)
                timer.passes.append(timer.forwards)
                timer.forwards = 0
                if timer.phases is not None:
                    timer.phases.end_step()

        self.device = device
        self.callback = _Callback()
        self.times: list[float] = []
        self.started = 0.0
        self.forwards = 0  # in the current step
        self.passes: list[int] = []  # forward passes of each step
        self.largest_pass = (
            0  # most examples in one training forward pass (Poisson slack sets activation memory)
        )
        self.in_step = False
        self.phases: PhaseTimer | None = None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def count_forward(self, module, args, kwargs) -> None:
        if module.training and self.in_step:
            self.forwards += 1
            rows = next((t.shape[0] for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), 0)
            self.largest_pass = max(self.largest_pass, rows)


class SyncRecorder:
    """A TrainerCallback that records, for steps ``[first, first + count)``, every operation that makes the
    host wait for the GPU (``torch.cuda.set_sync_debug_mode``), with the Python stack that called it."""

    def __init__(self, first: int, count: int, path: str) -> None:
        from transformers import TrainerCallback

        recorder = self
        self.sites: collections.Counter = collections.Counter()
        self.messages: dict = {}

        def record(message, category, filename, lineno, file=None, line=None):
            frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
            site = tuple(
                f"{f.filename.rsplit('site-packages/', 1)[-1]}:{f.lineno} {f.name}" for f in frames[-8:]
            )
            recorder.sites[site] += 1
            recorder.messages.setdefault(site, str(message)[:200])

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step == first:
                    recorder.saved = warnings.showwarning, warnings.filters[:]
                    warnings.simplefilter("always")
                    warnings.showwarning = record
                    torch.cuda.set_sync_debug_mode("warn")

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == first + count:
                    torch.cuda.set_sync_debug_mode("default")
                    warnings.showwarning, warnings.filters[:] = recorder.saved
                    with open(path, "w") as f:
                        f.write(f"{sum(recorder.sites.values())} synchronizing calls in {count} steps\n\n")
                        for site, n in recorder.sites.most_common():
                            f.write(f"{n}x {recorder.messages[site]}\n  " + "\n  ".join(site) + "\n\n")

        self.callback = _Callback()


class PhaseTimer:
    """Medians of the time spent per step in the forward, backward, clipping and optimizer calls."""

    PHASES = ("forward", "backward", "clip", "optimizer")

    def __init__(self, step_timer: StepTimer) -> None:
        self.sync = step_timer.sync
        self.totals = {name: 0.0 for name in self.PHASES}
        self.per_step: dict[str, list[float]] = {name: [] for name in self.PHASES}
        self._started: dict[str, float] = {}
        self._restore = []

    def start(self, name: str) -> None:
        self.sync()
        self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        self.sync()
        self.totals[name] += time.perf_counter() - self._started.pop(name)

    def end_step(self) -> None:
        """Close the step: each phase's time in it (a step may hold several passes)."""
        for name in self.PHASES:
            self.per_step[name].append(self.totals[name])
            self.totals[name] = 0.0

    def wrap(self, owner, attribute: str, name: str) -> None:
        """Time every call of ``owner.attribute`` (restored by :meth:`remove`)."""
        inner = getattr(owner, attribute)

        def timed(*args, **kwargs):
            self.start(name)
            try:
                return inner(*args, **kwargs)
            finally:
                self.stop(name)

        setattr(owner, attribute, timed)
        self._restore.append((owner, attribute, inner))

    def attach(self, model, trainer) -> None:
        model.register_forward_pre_hook(lambda module, args: self.start("forward"))
        model.register_forward_hook(lambda module, args, output: self.stop("forward"))
        self.wrap(torch.Tensor, "backward", "backward")
        clipping = getattr(trainer, "fast_clipping", None)
        trainer.create_optimizer()  # train() keeps an optimizer it finds
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        if clipping is not None:
            self.wrap(clipping, "accumulate", "clip")
        elif hasattr(optimizer, "clip_and_accumulate"):
            self.wrap(optimizer, "clip_and_accumulate", "clip")
        # Registered after the DPTrainer's own post-step hook, so the optimizer phase includes it.
        optimizer.register_step_pre_hook(lambda *args: self.start("optimizer"))
        optimizer.register_step_post_hook(lambda *args: self.stop("optimizer"))

    def remove(self) -> None:
        while self._restore:
            owner, attribute, inner = self._restore.pop()
            if owner is torch.Tensor:
                setattr(owner, attribute, inner)
            else:
                delattr(owner, attribute)  # the instance attribute hid the class's method

    def medians(self, warmup: int) -> dict[str, float]:
        return {
            name: statistics.median(values[warmup:] or values) if values else 0.0
            for name, values in self.per_step.items()
        }


def run_one(args, optimizer: str | None, dataset, device: torch.device, profile_dir: str | None) -> dict:
    """One ``train()`` (``optimizer`` None: the plain Trainer). Returns the row."""
    import transformers as tf

    from dp_hf import DPTrainer, DPTrainingArguments
    from dp_hf.accounting import clear_caches

    # As in a fresh process: otherwise a second identical run would take its noise calibration and its
    # log lines' epsilons from the first run's caches (0.3 s and 0.3 s of a 6 s tiny-BERT run).
    clear_caches()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    construction_start = time.perf_counter()
    model, _ = build_model(args.model)
    timer = StepTimer(device)
    model.register_forward_pre_hook(timer.count_forward, with_kwargs=True)
    common = dict(
        output_dir=tempfile.mkdtemp(prefix="bench_trainer_"),
        per_device_train_batch_size=args.batch,
        learning_rate=1e-4,
        max_steps=args.steps,
        logging_steps=args.logging_steps,
        save_strategy="no",
        report_to="none",
        bf16=args.bf16,
        use_cpu=device.type == "cpu",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    if optimizer is None:
        targs = tf.TrainingArguments(**common)
        trainer = tf.Trainer(model=model, args=targs, train_dataset=dataset, callbacks=[timer.callback])
    else:
        privacy = (
            dict(target_epsilon=args.target_epsilon) if args.target_epsilon else dict(noise_multiplier=1.0)
        )
        targs = DPTrainingArguments(
            **common,
            **privacy,
            dp_optimizer=optimizer,
            per_sample_max_grad_norm=1.0,
            per_sample_gradient_mode=args.mode,
            dp_max_physical_batch_size=args.max_physical_batch,
            noise_seed=1,
            sampling_seed=2,
        )
        trainer = DPTrainer(model=model, args=targs, train_dataset=dataset, callbacks=[timer.callback])
    construction = time.perf_counter() - construction_start
    if args.sync_debug and device.type == "cuda":
        path = os.path.join(args.sync_debug, f"{args.model}_{optimizer or 'trainer'}.txt")
        trainer.add_callback(SyncRecorder(args.warmup, 3, path).callback)
    if args.phases:
        timer.phases = PhaseTimer(timer)
        timer.phases.attach(model, trainer)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    train_start = time.perf_counter()
    if profile_dir is not None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            trainer.train()
        # Device time first (what the kernels cost), then host self time (launches, syncs, Python).
        keys = (
            ["self_cuda_time_total", "self_cpu_time_total"]
            if device.type == "cuda"
            else ["self_cpu_time_total"]
        )
        table = "\n\n".join(prof.key_averages().table(sort_by=key, row_limit=45) for key in keys)
        name = f"{args.model}_{optimizer or 'trainer'}.txt"
        with open(os.path.join(profile_dir, name), "w") as f:
            f.write(table)
    else:
        trainer.train()
    train_time = time.perf_counter() - train_start
    if timer.phases is not None:
        timer.phases.remove()
    steps = timer.times[args.warmup :] or timer.times
    row = {
        "run": optimizer or f"Trainer ({targs.optim})",
        "median_step_s": statistics.median(steps),
        "steps": len(timer.times),
        # Over the timed steps, as the median: the first step also runs the DPTrainer's one-time loss
        # probes (4 forward passes), which 40 steps would otherwise count as 0.1 pass per step.
        "passes_per_step": statistics.mean(timer.passes[args.warmup :] or timer.passes or [0]),
        "largest_pass": timer.largest_pass,
        "construction_s": construction,
        "train_s": train_time,
    }
    if device.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if timer.phases is not None:
        row["phases_s"] = timer.phases.medians(args.warmup)
    if optimizer is not None:
        row["mode"] = getattr(trainer, "per_sample_gradient_mode", None)
        row["epsilon"] = trainer.accountant.get_epsilon(trainer.delta)
    del trainer, model
    return row


def combine(runs: list[dict]) -> dict:
    """One row from the same run repeated: medians over the rounds of the timed fields."""
    row = dict(runs[0], rounds=runs)
    for key in ("median_step_s", "construction_s", "train_s", "passes_per_step", "peak_mem_gib"):
        if key in row:
            row[key] = statistics.median(r[key] for r in runs)
    row["largest_pass"] = max(r["largest_pass"] for r in runs)
    if "phases_s" in row:
        row["phases_s"] = {
            name: statistics.median(r["phases_s"][name] for r in runs) for name in row["phases_s"]
        }
    return row


def print_phases(rows: list[dict]) -> None:
    """The median step of each run split into its phases (ms; "rest" is the step minus the phases)."""
    names = PhaseTimer.PHASES
    print("\n| run | " + " | ".join(f"{name} (ms)" for name in names) + " | rest (ms) | step (ms) |")
    print("|" + "---|" * (len(names) + 3))
    for row in rows:
        phases = row["phases_s"]
        rest = row["median_step_s"] - sum(phases.values())
        cells = " | ".join(f"{1e3 * phases[name]:.2f}" for name in names)
        print(f"| {row['run']} | {cells} | {1e3 * rest:.2f} | {1e3 * row['median_step_s']:.2f} |", flush=True)


def in_fresh_process(run: str) -> dict:
    """The row of one run ("trainer" or an optimizer) made by this script in a new Python process."""
    import subprocess

    argv = [a for a in sys.argv[1:] if a != "--fresh-processes"]
    if "--json" in argv:  # the parent's table file, not the child's row
        del argv[argv.index("--json") : argv.index("--json") + 2]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "row.json")
        command = [sys.executable, os.path.abspath(__file__), *argv, "--only", run, "--json", out]
        subprocess.run(command, check=True)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=MODELS, default="tiny-bert")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--dataset-size", type=int, default=None, help="default: 8 x batch x steps")
    parser.add_argument("--optimizers", nargs="+", default=["dp-adamw"])
    parser.add_argument("--mode", default="auto", help="per_sample_gradient_mode of the DP runs")
    parser.add_argument(
        "--max-physical-batch",
        type=int,
        default=None,
        help="dp_max_physical_batch_size of the DP runs (default: the batch plus its Poisson slack; --batch "
        "for the Trainer's activation memory, at ~1.3-1.5 passes a step)",
    )
    parser.add_argument(
        "--target-epsilon", type=float, default=None, help="calibrate sigma (default sigma 1)"
    )
    parser.add_argument("--e2e", action="store_true", help="also report construction + train() wall time")
    parser.add_argument("--phases", action="store_true", help="split the median step into its phases")
    parser.add_argument("--profile", default=None, help="folder for torch.profiler tables (one per run)")
    parser.add_argument(
        "--sync-debug", default=None, help="CUDA: folder for the host-device synchronizations of 3 steps"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=1, help="alternate the runs this many times")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--fresh-processes", action="store_true", help="each run in a new process, without a warm-up run"
    )
    parser.add_argument("--only", default=None, help=argparse.SUPPRESS)  # one run (a --fresh-processes child)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    import logging

    logging.getLogger("dp_hf").setLevel(logging.ERROR)
    device = torch.device(args.device)
    config, kind = build_config(args.model)  # the data's shapes; no model built just to read them
    vocab = getattr(config, "vocab_size", 1000)
    n = args.dataset_size or 8 * args.batch * args.steps
    dataset = make_dataset(kind, n, args.seq_len, vocab)
    for folder in (args.profile, args.sync_debug):
        if folder:
            os.makedirs(folder, exist_ok=True)
    if args.only is not None:  # a --fresh-processes child: this one run, its row to --json
        row = run_one(args, None if args.only == "trainer" else args.only, dataset, device, args.profile)
        with open(args.json, "w") as f:
            json.dump(row, f)
        return
    if args.fresh_processes:
        rounds = [
            [in_fresh_process(run) for run in ("trainer", *args.optimizers)] for _ in range(args.repeats)
        ]
    else:
        # One short untimed run first: the process's one-time costs (lazy imports, kernel and allocator
        # warm-up) would otherwise land on whichever run comes first.
        warm = argparse.Namespace(**{**vars(args), "steps": 3, "warmup": 0, "sync_debug": None})
        run_one(warm, None, dataset, device, None)
        rounds = []
        for _ in range(args.repeats):
            rounds.append([run_one(args, None, dataset, device, args.profile)])
            for optimizer in args.optimizers:
                rounds[-1].append(run_one(args, optimizer, dataset, device, args.profile))
    rows = [combine([round_[k] for round_ in rounds]) for k in range(len(rounds[0]))]
    base = rows[0]["median_step_s"]
    base_total = rows[0]["construction_s"] + rows[0]["train_s"]
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(
        f"\n{args.model}, B{args.batch}, L{args.seq_len}, {'bf16' if args.bf16 else 'fp32'}, {args.steps} steps, "
        f"{args.repeats} round(s), "
        f"{machine}, torch {torch.__version__}, transformers {transformers.__version__}\n"
    )
    header = "| run | mode | median step (s) | ratio | passes/step | largest pass |"
    header += " peak mem (GiB) | mem ratio |" if device.type == "cuda" else ""
    header += " construct+train (s) | e2e ratio |" if args.e2e else ""
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for row in rows:
        ratios = [r["median_step_s"] / t["median_step_s"] for r, t in zip(row["rounds"], rows[0]["rounds"])]
        spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
        line = (
            f"| {row['run']} | {row.get('mode') or '-'} | {row['median_step_s']:.4f} | "
            f"{row['median_step_s'] / base:.2f}x{spread} | {row['passes_per_step']:.2f} | {row['largest_pass']} |"
        )
        if device.type == "cuda":
            line += f" {row['peak_mem_gib']:.2f} | {row['peak_mem_gib'] / rows[0]['peak_mem_gib']:.2f}x |"
        if args.e2e:
            total = row["construction_s"] + row["train_s"]
            line += f" {total:.2f} | {total / base_total:.2f}x |"
        print(line, flush=True)
    if args.phases:
        print_phases(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
