"""Fidelity benchmark: do the DP adaptive optimizers beat DP-SGD, as their papers say, here?

Optimizers x epsilon x learning rate, several seeds, on two offline tasks:

* ``digits``: the demo's ViT (``recipes/demo.py``: 4x4 patches, hidden 64, 2 layers, 69K
  parameters, from scratch) on scikit-learn's ``load_digits``. The demo's stratified 20% test split
  is held out; a stratified 20% of the rest is the validation split. Expected batch 256 on 1149
  training images, 60 steps (15 epochs). Metric: accuracy.
* ``mlm``: a masked language model on structured synthetic text (a longer horizon, where
  adaptivity should matter). A fixed random "grammar" (seeded): 16 word classes with a sparse
  Markov chain between them, each class emitting from its own Zipfian distribution over its words
  (256 words in all), shifted per sequence by one of 8 topics, so a masked word is predictable from
  its neighbours (class) and from the rest of the sequence (topic). 20000 training sequences of 16
  tokens, 3 positions masked (drawn afresh every step; the head runs on those only). Model: BERT
  with TinyBERT's layout scaled down to fit a CPU hour (hidden 32, 2 layers, 4 heads, MLP 64; 27K
  parameters, TinyBERT-4 has 14.5M), from scratch. Expected batch 128, 1000 steps (6.4 epochs). Metric:
  masked-token cross-entropy (lower is better; the grammar's unigram entropy is printed as the
  no-context reference).

Protocol (``--help`` for every knob). For each task, optimizer and epsilon the noise multiplier
is calibrated (PLD accountant, delta 1e-5, Poisson sampling at ``q = B / N`` for ``T`` steps,
exactly the training that is run); the learning rate is selected on the **validation** split
(grid below, with the first ``--select-seeds`` seeds); the remaining seeds run at the selected
learning rate; the table reports the **test** metric, mean and standard deviation over all seeds
at that learning rate. The test split is never used to choose anything. A learning rate selected
at the edge of its grid is flagged (``edge``): the grid may be too narrow there. Every run
is a plain loop over Poisson-sampled logical batches: per-example clipping by
:mod:`dp_hf.per_example`'s fast path in its layer-wise materialization mode (exact for every
geometry; on models this small faster than ghost norms), ``optimizer.step()``. Findings, per seed
paper: ``bench/fidelity/README.md``.

Outputs (``--out``, default ``bench/fidelity/``): ``<task>_runs.csv`` (every run: its
hyperparameters, validation and test metric, seconds), ``<task>_curves.json`` (validation metric
during training), ``<task>_summary.md`` / ``.csv`` (the table), ``<task>_vs_eps.png`` (metric
against epsilon per optimizer) and ``<task>_curves.png`` (validation curves at the selected
learning rate, one panel per epsilon).

    python bench/fidelity.py                      # default grid, both tasks (~1 h on an idle core)
    python bench/fidelity.py --tasks digits --jobs 2
    python bench/fidelity.py --quick              # CI smoke: a few steps, into a temporary folder
    python bench/fidelity.py --plots-only         # redraw figures and tables from the CSV files
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dp_hf.per_example.samplers  # noqa: E402,F401  (registers the ViT embedding samplers)
from dp_hf.accounting import calibrate_noise_multiplier  # noqa: E402
from dp_hf.optim import create_dp_optimizer, get_optimizer_class  # noqa: E402
from dp_hf.per_example import (  # noqa: E402
    attach_fast_clipping,
    attach_grad_sample,
    resolve_per_sample_gradient_mode,
)

OUT_DIR = Path(__file__).resolve().parent / "fidelity"
DELTA = 1e-5
NONPRIVATE = "adamw (non-private)"


# ------------------------------------------------------------------------------------ optimizers
@dataclass(frozen=True)
class Variant:
    """One row of the table: a registered optimizer with fixed hyperparameters and an lr grid per task."""

    label: str
    name: str  # registry name; NONPRIVATE: torch.optim.AdamW on the mean loss, no clipping, no noise
    lrs: dict[str, tuple[float, ...]]
    kwargs: dict[str, Any] = field(default_factory=dict)
    clip: float | str | None = 1.0  # None: the rule fixes C itself (DP-MacAdam); "B/sigma": per epsilon
    epsilons: tuple[float, ...] | None = None  # run only at these (None: every epsilon asked for)


# Learning-rate grids: x3 ladders around the papers' values, widened where a first run of the grid
# selected an edge (selection on validation only; bench/fidelity/README.md). C = 1 for every L2-clipping rule (the papers' choice); DP-MacAdam
# fixes C = 1 in its own geometry and uses the paper's CIFAR clamp (h1, h2) = (5e-5, 1), the
# demo's choice.
VARIANTS: tuple[Variant, ...] = (
    Variant("dp-sgd", "dp-sgd", {"digits": (0.1, 0.3, 1.0, 3.0, 10.0), "mlm": (0.3, 1.0, 3.0, 10.0)}),
    Variant("dp-adam", "dp-adam", {"digits": (3e-3, 1e-2, 3e-2, 1e-1), "mlm": (3e-3, 1e-2, 3e-2)}),
    Variant("dp-adamw", "dp-adamw", {"digits": (3e-3, 1e-2, 3e-2, 1e-1), "mlm": (3e-3, 1e-2, 3e-2)}),
    Variant("dp-adambc", "dp-adambc", {"digits": (3e-5, 1e-4, 3e-4, 1e-3, 3e-3), "mlm": (1e-4, 3e-4, 1e-3)}),
    Variant(
        "dp-adamw-bc", "dp-adamw-bc", {"digits": (3e-5, 1e-4, 3e-4, 1e-3, 3e-3), "mlm": (1e-4, 3e-4, 1e-3)}
    ),
    Variant(
        "dp-macadam",
        "dp-macadam",
        {"digits": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1), "mlm": (3e-3, 1e-2, 3e-2)},
        {"h1": 5e-5, "h2": 1.0},
        clip=None,
    ),
    Variant("dp-adam-stp", "dp-adam-stp", {"digits": (3e-3, 1e-2, 3e-2, 1e-1), "mlm": (3e-3, 1e-2, 3e-2)}),
    Variant("dp-adamw-stp", "dp-adamw-stp", {"digits": (3e-3, 1e-2, 3e-2, 1e-1), "mlm": (3e-3, 1e-2, 3e-2)}),
    Variant(
        "dp-adamw-stp (raw)",
        "dp-adamw-stp",
        {"digits": (3e-3, 1e-2, 3e-2, 1e-1), "mlm": (3e-3, 1e-2, 3e-2)},
        {"scale_mode": "raw"},
    ),
    Variant(
        "dp-adamw-stp (raw, C = B/σ)",
        "dp-adamw-stp",
        {"digits": (3e-3, 1e-2, 3e-2, 1e-1), "mlm": (3e-3, 1e-2, 3e-2)},
        {"scale_mode": "raw"},
        clip="B/sigma",
    ),
    Variant(
        "dp-adam-stp (raw, C = B/σ)",
        "dp-adam-stp",
        {"digits": (3e-3, 1e-2, 3e-2, 1e-1), "mlm": (3e-3, 1e-2, 3e-2)},
        {"scale_mode": "raw"},
        clip="B/sigma",
        epsilons=(3.0,),
    ),
    Variant(
        "dp-adam-stp (raw)",
        "dp-adam-stp",
        {"digits": (3e-3, 1e-2, 3e-2, 1e-1), "mlm": (3e-3, 1e-2, 3e-2)},
        {"scale_mode": "raw"},
        epsilons=(3.0,),
    ),
    Variant(
        "dp-microadam", "dp-microadam", {"digits": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1), "mlm": (3e-3, 1e-2, 3e-2)}
    ),
    Variant(
        "dp-microadam (density 0.1)",
        "dp-microadam",
        {"digits": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1), "mlm": (3e-3, 1e-2, 3e-2)},
        {"density": 0.1},
    ),
    Variant(
        NONPRIVATE,
        NONPRIVATE,
        {"digits": (3e-4, 1e-3, 3e-3, 1e-2, 3e-2), "mlm": (1e-3, 3e-3, 1e-2)},
        clip=None,
    ),
)
VARIANTS_BY_LABEL = {v.label: v for v in VARIANTS}

# What the default grid runs (a reduction of VARIANTS, to stay within a CPU hour).
DEFAULT_VARIANTS = {
    "digits": (
        "dp-sgd",
        "dp-adam",
        "dp-adamw",
        "dp-adamw-bc",
        "dp-macadam",
        "dp-adamw-stp",
        "dp-adamw-stp (raw)",
        "dp-adamw-stp (raw, C = B/σ)",
        "dp-microadam",
        "dp-microadam (density 0.1)",
        NONPRIVATE,
    ),
    "mlm": (
        "dp-sgd",
        "dp-adam",
        "dp-adambc",
        "dp-adam-stp",
        "dp-adam-stp (raw)",
        "dp-adam-stp (raw, C = B/σ)",
        NONPRIVATE,
    ),
}


# ------------------------------------------------------------------------------------ tasks
@dataclass(frozen=True)
class TaskSpec:
    name: str
    batch: int  # expected logical batch B
    steps: int  # T
    eval_every: int
    higher_is_better: bool
    metric: str


TASKS = {
    "digits": TaskSpec(
        "digits", batch=256, steps=60, eval_every=10, higher_is_better=True, metric="accuracy"
    ),
    "mlm": TaskSpec("mlm", batch=128, steps=1000, eval_every=100, higher_is_better=False, metric="loss"),
}
QUICK_STEPS = {"digits": 6, "mlm": 12}


def digits_data() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The demo's split (test 20%, stratified, seed 0), then validation = 20% of the rest (seed 1)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images.astype(np.float32) / 16.0 - 0.5) / 0.5
    train_x, test_x, train_y, test_y = train_test_split(
        images[:, None], digits.target, test_size=0.2, stratify=digits.target, random_state=0
    )
    train_x, val_x, train_y, val_y = train_test_split(
        train_x, train_y, test_size=0.2, stratify=train_y, random_state=1
    )

    def pair(x, y):
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y.astype(np.int64))

    return {"train": pair(train_x, train_y), "val": pair(val_x, val_y), "test": pair(test_x, test_y)}


def digits_model(seed: int) -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    config = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=1,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=10,
    )
    return ViTForImageClassification(config)


# Synthetic text: special ids, then words.
PAD, MASK, FIRST_WORD = 0, 1, 2
MLM_WORDS, MLM_CLASSES, MLM_TOPICS, MLM_LEN, MLM_MASKED = 256, 16, 8, 16, 3
MLM_SIZES = {"train": 20000, "val": 1000, "test": 2000}
GRAMMAR_SEED = 20240901


class Grammar:
    """A fixed random regular grammar with Zipfian, topic-dependent emissions (all from one seed)."""

    def __init__(self, seed: int = GRAMMAR_SEED, zipf: float = 1.1) -> None:
        rng = np.random.default_rng(seed)
        words = rng.permutation(MLM_WORDS) + FIRST_WORD
        sizes = rng.multinomial(MLM_WORDS - 4 * MLM_CLASSES, np.ones(MLM_CLASSES) / MLM_CLASSES) + 4
        self.class_words = np.split(words, np.cumsum(sizes)[:-1])
        # Class chain: every class goes to 3 random successors; the start class is uniform.
        self.transition = np.zeros((MLM_CLASSES, MLM_CLASSES))
        for c in range(MLM_CLASSES):
            successors = rng.choice(MLM_CLASSES, size=3, replace=False)
            self.transition[c, successors] = rng.dirichlet(np.ones(3))
        # Emissions: half a shared Zipf law over the class's words, half a topic-specific ranking.
        self.emission = []  # [class] -> [topic, words] probabilities
        for c in range(MLM_CLASSES):
            n = len(self.class_words[c])
            base = 1.0 / np.arange(1, n + 1) ** zipf
            base /= base.sum()
            per_topic = np.stack([0.5 * base + 0.5 * base[rng.permutation(n)] for _ in range(MLM_TOPICS)])
            self.emission.append(per_topic)

    def sample(self, count: int, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        classes = np.empty((count, MLM_LEN), dtype=np.int64)
        classes[:, 0] = rng.integers(MLM_CLASSES, size=count)
        cumulative = self.transition.cumsum(axis=1)
        for t in range(1, MLM_LEN):
            u = rng.random(count)[:, None]
            classes[:, t] = np.minimum((u > cumulative[classes[:, t - 1]]).sum(axis=1), MLM_CLASSES - 1)
        topics = rng.integers(MLM_TOPICS, size=count)
        tokens = np.empty_like(classes)
        for c in range(MLM_CLASSES):
            rows, cols = np.nonzero(classes == c)
            probs = self.emission[c][topics[rows]]
            u = rng.random(len(rows))[:, None]
            choice = np.minimum((u > probs.cumsum(axis=1)).sum(axis=1), len(self.class_words[c]) - 1)
            tokens[rows, cols] = self.class_words[c][choice]
        return tokens

    def unigram_entropy(self, tokens: np.ndarray) -> float:
        counts = np.bincount(tokens.reshape(-1), minlength=FIRST_WORD + MLM_WORDS)[FIRST_WORD:]
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())


def mask_positions(count: int, generator: torch.Generator) -> torch.Tensor:
    """``[count, MLM_MASKED]`` distinct positions per sequence."""
    return torch.rand(count, MLM_LEN, generator=generator).argsort(dim=1)[:, :MLM_MASKED]


def mlm_batch(
    tokens: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(inputs with [MASK] at positions, positions, the original tokens there)``."""
    return tokens.scatter(1, positions, MASK), positions, tokens.gather(1, positions)


def mlm_data() -> dict[str, Any]:
    grammar = Grammar()
    data: dict[str, Any] = {}
    for offset, (split, size) in enumerate(MLM_SIZES.items()):
        tokens = torch.from_numpy(grammar.sample(size, GRAMMAR_SEED + 1 + offset))
        if split == "train":
            data[split] = (tokens, None)
            data["unigram_entropy"] = grammar.unigram_entropy(tokens.numpy())
        else:  # fixed masks for evaluation
            data[split] = mlm_batch(tokens, mask_positions(size, torch.Generator().manual_seed(7 + offset)))
    return data


def mlm_model(seed: int) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=FIRST_WORD + MLM_WORDS,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=MLM_LEN,
        type_vocab_size=1,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=PAD,
    )
    return BertForMaskedLM(config)


def mlm_forward(model: torch.nn.Module, inputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Logits ``[b, MLM_MASKED, V]`` at the masked ``positions`` only (the head is the costly part)."""
    b = inputs.shape[0]
    position_ids = torch.arange(MLM_LEN).expand(b, MLM_LEN).contiguous()
    hidden = model.bert(
        input_ids=inputs, position_ids=position_ids, token_type_ids=torch.zeros_like(inputs)
    ).last_hidden_state
    picked = hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    return model.cls(picked)


def mlm_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-example mean cross-entropy over its masked positions (``targets`` ``[b, MLM_MASKED]``)."""
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(dim=1)


_DATA: dict[str, Any] = {}


def task_data(task: str) -> Any:
    if task not in _DATA:
        _DATA[task] = digits_data() if task == "digits" else mlm_data()
    return _DATA[task]


def train_size(task: str) -> int:
    return len(task_data(task)["train"][0])


@torch.no_grad()
def evaluate(task: str, model: torch.nn.Module, split: str, limit: int | None = None) -> float:
    """Accuracy (digits) or masked-token cross-entropy (mlm) on ``split`` (its first ``limit`` rows)."""
    model.eval()
    try:
        if task == "digits":
            x, y = task_data(task)[split]
            if limit is not None:
                x, y = x[:limit], y[:limit]
            return float((model(pixel_values=x).logits.argmax(-1) == y).float().mean())
        inputs, positions, targets = (part[:limit] for part in task_data(task)[split])
        total = 0.0
        for start in range(0, len(inputs), 500):
            window = slice(start, start + 500)
            logits = mlm_forward(model, inputs[window], positions[window])
            total += float(mlm_losses(logits, targets[window]).sum())
        return total / len(inputs)
    finally:
        model.train()


# ------------------------------------------------------------------------------------ one run
_SIGMAS: dict[tuple[str, float, int], float] = {}


def noise_multiplier(task: str, epsilon: float, steps: int) -> float:
    key = (task, epsilon, steps)
    if key not in _SIGMAS:
        q = TASKS[task].batch / train_size(task)
        _SIGMAS[key] = calibrate_noise_multiplier(epsilon, DELTA, q, steps)
    return _SIGMAS[key]


def run_one(task: str, label: str, epsilon: float, lr: float, seed: int, steps: int | None = None) -> dict:
    """Train once; return the row (hyperparameters, sigma, val/test metric, curve, seconds)."""
    spec = TASKS[task]
    variant = VARIANTS_BY_LABEL[label]
    steps = steps or spec.steps
    start = time.perf_counter()
    data = task_data(task)
    train_x, train_y = data["train"][:2]
    n = len(train_x)
    q = spec.batch / n
    model = digits_model(seed) if task == "digits" else mlm_model(seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    private = variant.name != NONPRIVATE
    sigma = noise_multiplier(task, epsilon, steps) if private else 0.0
    clipping = None
    if private:
        kwargs = dict(variant.kwargs, lr=lr, noise_multiplier=sigma, expected_batch_size=spec.batch)
        kwargs["noise_seed"] = 10_000 + seed
        if variant.clip == "B/sigma":  # the raw STP scale's stationary point (dp_hf/optim/stp.py)
            kwargs["max_grad_norm"] = spec.batch / sigma
        elif variant.clip is not None:
            kwargs["max_grad_norm"] = variant.clip
        optimizer = create_dp_optimizer(variant.name, params, **kwargs)
        # Exact per-example gradients, layer by layer; on models this small materializing them is faster
        # than ghost norms (measured), and it serves every geometry alike.
        mode, fast = resolve_per_sample_gradient_mode("materialize", get_optimizer_class(variant.name), model)
        if fast:
            clipping = attach_fast_clipping(model, mode=mode)
        else:
            attach_grad_sample(model)
    else:
        optimizer = torch.optim.AdamW(params, lr=lr)
    sampler = torch.Generator().manual_seed(20_000 + seed)  # Poisson sampling of the logical batches
    masker = torch.Generator().manual_seed(30_000 + seed)
    curve = []
    for t in range(1, steps + 1):
        index = (torch.rand(n, generator=sampler) < q).nonzero().squeeze(1)
        if len(index):
            if task == "digits":
                losses = F.cross_entropy(
                    model(pixel_values=train_x[index]).logits, train_y[index], reduction="none"
                )
            else:
                inputs, positions, targets = mlm_batch(train_x[index], mask_positions(len(index), masker))
                losses = mlm_losses(mlm_forward(model, inputs, positions), targets)
            if private:
                losses.sum().backward()
                if clipping is not None:
                    clipping.accumulate(optimizer)
            else:
                losses.mean().backward()
        optimizer.step()  # an empty logical batch still releases noise (DP) / is a no-op (non-private)
        optimizer.zero_grad()
        if t % spec.eval_every == 0 or t == steps:
            curve.append((t, evaluate(task, model, "val", limit=500)))
    row = {
        "task": task,
        "optimizer": label,
        "epsilon": epsilon if private else math.inf,
        "lr": lr,
        "seed": seed,
        "steps": steps,
        "batch": spec.batch,
        "sigma": sigma,
        "val": evaluate(task, model, "val"),
        "test": evaluate(task, model, "test"),
        "seconds": time.perf_counter() - start,
    }
    if clipping is not None:
        clipping.remove()
    return {"row": row, "curve": curve}


def _run_packed(job: tuple) -> dict:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*[Ff]ull backward hook.*")
    warnings.filterwarnings("ignore", message="scale-then-privatize with scale_mode='raw'")  # expected
    return run_one(*job)


# ------------------------------------------------------------------------------------ protocol
RUN_FIELDS = [
    "task",
    "optimizer",
    "epsilon",
    "lr",
    "seed",
    "steps",
    "batch",
    "sigma",
    "val",
    "test",
    "seconds",
]


def _key(row: dict) -> tuple:
    return (
        row["task"],
        row["optimizer"],
        float(row["epsilon"]),
        float(row["lr"]),
        int(row["seed"]),
        int(row["steps"]),
    )


class RunStore:
    """Runs already done (CSV + curves JSON in ``out``), so an interrupted grid resumes."""

    def __init__(self, out: Path, task: str) -> None:
        self.csv_path = out / f"{task}_runs.csv"
        self.curves_path = out / f"{task}_curves.json"
        self.rows: dict[tuple, dict] = {}
        self.curves: dict[str, list] = {}
        if self.csv_path.exists():
            with open(self.csv_path, newline="") as handle:
                for row in csv.DictReader(handle):
                    self.rows[_key(row)] = _parse_row(row)
        if self.curves_path.exists():
            self.curves = json.loads(self.curves_path.read_text())

    def add(self, result: dict) -> None:
        row = result["row"]
        self.rows[_key(row)] = row
        self.curves[json.dumps(list(_key(row)))] = result["curve"]
        new = not self.csv_path.exists()
        with open(self.csv_path, "a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=RUN_FIELDS)
            if new:
                writer.writeheader()
            writer.writerow({k: row[k] for k in RUN_FIELDS})
        self.curves_path.write_text(json.dumps(self.curves))

    def get(self, key: tuple) -> dict | None:
        return self.rows.get(key)


def _parse_row(row: dict) -> dict:
    out = dict(row)
    for k in ("epsilon", "lr", "sigma", "val", "test", "seconds"):
        out[k] = float(row[k])
    for k in ("seed", "steps", "batch"):
        out[k] = int(row[k])
    return out


def run_jobs(jobs: list[tuple], store: RunStore, workers: int) -> None:
    todo = [job for job in jobs if store.get(_job_key(job)) is None]
    if not todo:
        return
    if workers <= 1:
        for job in todo:
            result = _run_packed(job)
            store.add(result)
            _log(result["row"])
        return
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(workers) as pool:
        for result in pool.imap_unordered(_run_packed, todo):
            store.add(result)
            _log(result["row"])


def _job_key(job: tuple) -> tuple:
    task, label, epsilon, lr, seed, steps = job
    private = VARIANTS_BY_LABEL[label].name != NONPRIVATE
    return (task, label, float(epsilon if private else math.inf), float(lr), int(seed), int(steps))


def _log(row: dict) -> None:
    print(
        f"  {row['task']:6s} {row['optimizer']:28s} eps={row['epsilon']:<4g} lr={row['lr']:<7g} "
        f"seed={row['seed']} val={row['val']:.4f} test={row['test']:.4f} ({row['seconds']:.0f} s)",
        flush=True,
    )


def selected(rows: list[dict], higher_is_better: bool, select_seeds: Sequence[int]) -> tuple[float, bool]:
    """The lr with the best mean validation metric over ``select_seeds``; whether it is a grid edge."""
    by_lr: dict[float, list[float]] = {}
    for row in rows:
        if row["seed"] in select_seeds:
            by_lr.setdefault(row["lr"], []).append(row["val"])
    means = {lr: statistics.fmean(v) for lr, v in by_lr.items() if all(math.isfinite(x) for x in v)}
    if not means:  # every run diverged
        lr = min(by_lr)
        return lr, True
    best = (max if higher_is_better else min)(means, key=means.get)
    grid = sorted(by_lr)
    return best, len(grid) > 1 and best in (grid[0], grid[-1])


def run_task(
    task: str,
    labels: Sequence[str],
    epsilons: Sequence[float],
    seeds: Sequence[int],
    select_seeds: int,
    steps: int,
    out: Path,
    workers: int,
) -> RunStore:
    """Stage 1: lr grid x first ``select_seeds`` seeds; stage 2: the other seeds at the selected lr."""
    store = RunStore(out, task)
    spec = TASKS[task]
    sel = list(seeds[:select_seeds])
    rest = list(seeds[select_seeds:])

    def settings(label):
        return variant_epsilons(VARIANTS_BY_LABEL[label], epsilons)

    stage1 = [
        (task, label, eps, lr, seed, steps)
        for label in labels
        for eps in settings(label)
        for lr in VARIANTS_BY_LABEL[label].lrs[task]
        for seed in sel
    ]
    run_jobs(stage1, store, workers)
    stage2 = []
    for label in labels:
        for eps in settings(label):
            rows = [
                store.get(_job_key((task, label, eps, lr, s, steps)))
                for lr in VARIANTS_BY_LABEL[label].lrs[task]
                for s in sel
            ]
            lr, _ = selected([r for r in rows if r], spec.higher_is_better, sel)
            stage2 += [(task, label, eps, lr, seed, steps) for seed in rest]
    run_jobs(stage2, store, workers)
    return store


def variant_epsilons(variant: Variant, epsilons: Sequence[float]) -> list[float]:
    if variant.name == NONPRIVATE:
        return [math.inf]
    return [e for e in epsilons if variant.epsilons is None or e in variant.epsilons]


# ------------------------------------------------------------------------------------ reports
def summarize(
    store: RunStore,
    task: str,
    labels: Sequence[str],
    epsilons: Sequence[float],
    seeds: Sequence[int],
    select_seeds: int,
    steps: int,
) -> list[dict]:
    spec = TASKS[task]
    sel = list(seeds[:select_seeds])
    table = []
    for label in labels:
        variant = VARIANTS_BY_LABEL[label]
        for eps in variant_epsilons(variant, epsilons):
            grid_rows = [
                store.get((task, label, float(eps), float(lr), int(s), int(steps)))
                for lr in variant.lrs[task]
                for s in sel
            ]
            grid_rows = [r for r in grid_rows if r]
            if not grid_rows:
                continue
            lr, edge = selected(grid_rows, spec.higher_is_better, sel)
            final = [store.get((task, label, float(eps), float(lr), int(s), int(steps))) for s in seeds]
            final = [r for r in final if r]
            tests = [r["test"] for r in final]
            vals = [r["val"] for r in final]
            table.append(
                {
                    "task": task,
                    "optimizer": label,
                    "epsilon": eps,
                    "sigma": final[0]["sigma"],
                    "lr": lr,
                    "lr_edge": edge,
                    "n": len(final),
                    "val_mean": statistics.fmean(vals),
                    "test_mean": statistics.fmean(tests),
                    "test_sd": statistics.stdev(tests) if len(tests) > 1 else 0.0,
                    "seconds_per_run": statistics.fmean(r["seconds"] for r in final),
                }
            )
    return table


def write_summary(table: list[dict], task: str, out: Path, epsilons: Sequence[float], note: str) -> None:
    spec = TASKS[task]
    with open(out / f"{task}_summary.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    arrow = "higher is better" if spec.higher_is_better else "lower is better"
    lines = [
        f"# {task}: test {spec.metric} ({arrow}), mean ± sd over seeds, lr selected on validation",
        "",
        note,
        "",
        "| optimizer | " + " | ".join(f"ε = {e:g}" for e in epsilons) + " |",
        "|---|" + "---|" * len(epsilons),
    ]
    by_opt: dict[str, dict[float, dict]] = {}
    for row in table:
        by_opt.setdefault(row["optimizer"], {})[row["epsilon"]] = row
    for label, cells in by_opt.items():
        if math.inf in cells:
            c = cells[math.inf]
            text = f"{c['test_mean']:.3f} ± {c['test_sd']:.3f} (lr {c['lr']:g}{', edge' if c['lr_edge'] else ''})"
            lines.append(f"| {label} | " + " | ".join([text] * len(epsilons)) + " |")
            continue
        texts = []
        for e in epsilons:
            c = cells.get(float(e))
            if c is None:
                texts.append("")
                continue
            texts.append(
                f"{c['test_mean']:.3f} ± {c['test_sd']:.3f} (lr {c['lr']:g}{', edge' if c['lr_edge'] else ''})"
            )
        lines.append(f"| {label} | " + " | ".join(texts) + " |")
    sigmas = sorted({(r["epsilon"], r["sigma"]) for r in table if math.isfinite(r["epsilon"])})
    lines += ["", "Noise multipliers: " + ", ".join(f"ε {e:g}: σ {s:.3f}" for e, s in sigmas)]
    (out / f"{task}_summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def plot(
    table: list[dict], store: RunStore, task: str, out: Path, epsilons: Sequence[float], steps: int
) -> None:
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figures (pip install matplotlib)", flush=True)
        return
    spec = TASKS[task]
    by_opt: dict[str, list[dict]] = {}
    for row in table:
        by_opt.setdefault(row["optimizer"], []).append(row)
    palette = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    color = {label: palette[i % len(palette)] for i, label in enumerate(by_opt)}  # same in both figures
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rows in by_opt.items():
        if rows[0]["epsilon"] == math.inf:
            ax.axhline(rows[0]["test_mean"], color="black", linestyle=":", label=label)
            continue
        rows = sorted(rows, key=lambda r: r["epsilon"])
        ax.errorbar(
            [r["epsilon"] for r in rows],
            [r["test_mean"] for r in rows],
            yerr=[r["test_sd"] for r in rows],
            marker="o",
            capsize=3,
            label=label,
            color=color[label],
        )
    ax.set_xscale("log")
    ax.set_xticks(list(epsilons))
    ax.set_xticklabels([f"{e:g}" for e in epsilons])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("ε (δ = 1e-5)")
    ax.set_ylabel(f"test {spec.metric}")
    ax.set_title(f"{task}: test {spec.metric} vs ε (lr selected on validation)")
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / f"{task}_vs_eps.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(epsilons), figsize=(4.2 * len(epsilons), 3.8), sharey=True, squeeze=False)
    for ax, eps in zip(axes[0], epsilons):
        for row in table:
            if row["epsilon"] not in (float(eps), math.inf):
                continue
            curves = []
            for seed_key, curve in store.curves.items():
                k = json.loads(seed_key)
                if (
                    k[1] == row["optimizer"]
                    and float(k[2]) == row["epsilon"]
                    and float(k[3]) == row["lr"]
                    and int(k[5]) == steps
                ):
                    curves.append(curve)
            if not curves:
                continue
            xs = [p[0] for p in curves[0]]
            ys = np.mean([[p[1] for p in c] for c in curves if len(c) == len(xs)], axis=0)
            style = ":" if row["epsilon"] == math.inf else "-"
            ax.plot(
                xs,
                ys,
                style,
                label=row["optimizer"],
                color="black" if style == ":" else color[row["optimizer"]],
            )
        ax.set_title(f"ε = {eps:g}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"validation {spec.metric} (mean over seeds)")
    handles = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(out / f"{task}_curves.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------------------------ main
def main(argv: Sequence[str] | None = None) -> None:
    global VARIANTS_BY_LABEL
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", nargs="+", default=["digits", "mlm"], choices=sorted(TASKS))
    parser.add_argument(
        "--optimizers",
        nargs="+",
        default=None,
        help=f"labels among {sorted(VARIANTS_BY_LABEL)} (default: the reduced default grid per task)",
    )
    parser.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 3.0, 8.0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--select-seeds", type=int, default=1, help="seeds used for the lr selection (the first ones)"
    )
    parser.add_argument("--steps", type=int, default=None, help="override T (all tasks)")
    parser.add_argument("--jobs", type=int, default=1, help="parallel runs (each single-threaded)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 2 optimizers, 1 lr, 1 seed, a few steps"
    )
    parser.add_argument("--plots-only", action="store_true", help="only redraw tables and figures from --out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*[Ff]ull backward hook.*")

    if args.quick:
        out = args.out or Path(tempfile.mkdtemp(prefix="fidelity-quick-"))
        VARIANTS_BY_LABEL = {
            label: Variant(v.label, v.name, {t: lrs[1:2] for t, lrs in v.lrs.items()}, v.kwargs, v.clip, None)
            for label, v in VARIANTS_BY_LABEL.items()
        }
        epsilons, seeds = [3.0], [0, 1]
    else:
        out = args.out or OUT_DIR
        epsilons, seeds = args.epsilons, args.seeds
    out.mkdir(parents=True, exist_ok=True)
    total_start = time.perf_counter()
    for task in args.tasks:
        labels = args.optimizers or (("dp-adamw", "dp-adamw-stp") if args.quick else DEFAULT_VARIANTS[task])
        steps = args.steps or (QUICK_STEPS[task] if args.quick else TASKS[task].steps)
        if task == "mlm":
            print(
                f"mlm: unigram entropy of the training text {task_data('mlm')['unigram_entropy']:.3f} nats",
                flush=True,
            )
        if args.plots_only:
            store = RunStore(out, task)
        else:
            store = run_task(task, labels, epsilons, seeds, args.select_seeds, steps, out, args.jobs)
        table = summarize(store, task, labels, epsilons, seeds, args.select_seeds, steps)
        if not table:
            continue
        spec = TASKS[task]
        runs = [r for r in store.rows.values() if r["steps"] == steps]
        note = (
            f"{steps} steps, expected batch {spec.batch}, N = {train_size(task)}, δ = {DELTA:g}; lr grid per "
            f"optimizer in bench/fidelity.py; selection on seed(s) {list(seeds[: args.select_seeds])}, reported "
            f"over seeds {list(seeds)}. {len(runs)} runs, {sum(r['seconds'] for r in runs) / 60:.0f} min of "
            "single-threaded run time in all (their sum, as measured; other jobs shared the machine)."
        )
        write_summary(table, task, out, epsilons, note)
        plot(table, store, task, out, epsilons, steps)
    print(f"done in {time.perf_counter() - total_start:.0f} s; outputs in {out}", flush=True)


if __name__ == "__main__":
    main()
