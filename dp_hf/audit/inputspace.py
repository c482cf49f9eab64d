"""Input-space one-run audit of a whole :class:`~dp_hf.trainer.DPTrainer` run (:func:`audit_trainer`).

Canary *examples* (not gradients) are inserted into the training set, each independently with
probability 1/2; the user's own trainer is built on that set and trained once, through everything
the real run uses: dataset, collator, model, per-example loss, sampler, optimizer. Membership is then
scored from the model alone:

* ``"loss"`` (default): ``loss_before - loss_after`` of each canary (a canary trained on is fitted);
* ``"gradient"``: ``<g_j, theta_0 - theta_T> / ||g_j||`` with ``g_j`` canary ``j``'s gradient at the
  initial weights: how far training moved the weights along the canary's own descent direction. It
  is informative when the canaries' gradients are concentrated on weights that ordinary training
  moves little (e.g. embeddings of tokens only the canaries use), and noisy otherwise.

Guesses and the bound are those of :mod:`dp_hf.audit.bound`. This audit is black-box with respect to
the optimizer (it sees only the weights before and after), so its bounds are far weaker than the
white-box gradient audit's: expect ``0`` for a well-tuned private run unless the canaries are easy to
memorize (e.g. each carries a token no other example has, or a label that contradicts its input) and
``epsilon`` is large. Its value is end to end: a collator that mixes examples, a model that leaks
across the batch, or a trainer change that bypasses the privatizer shows up here and nowhere else.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from dp_hf.audit.bound import score_guesses
from dp_hf.audit.report import AuditReport, PrivacyAuditError, PrivacyAuditWarning, report_from_guesses

logger = logging.getLogger(__name__)

__all__ = ["audit_trainer", "label_flip_canaries"]

SCORES = ("loss", "gradient")


def label_flip_canaries(
    dataset: Any, num_canaries: int, *, num_labels: int, label_column: str = "labels", seed: int = 0
) -> Any:
    """``num_canaries`` examples of a (held-out) Hugging Face dataset, each with a wrong random label.

    A mislabeled example is fitted only if it is trained on, the classic input-space canary. Draw
    them from data that is **not** in the training set (a training example and its mislabeled copy
    would fight each other).
    """
    if num_canaries > len(dataset):
        raise ValueError(f"num_canaries={num_canaries} exceeds the dataset's {len(dataset)} examples.")
    if num_labels < 2:
        raise ValueError(f"num_labels must be >= 2, got {num_labels!r}.")
    rng = np.random.default_rng(seed)
    rows = rng.choice(len(dataset), size=num_canaries, replace=False)
    subset = dataset.select(rows.tolist())
    shifts = rng.integers(1, num_labels, size=num_canaries)  # never 0: always a different label
    labels = [(int(label) + int(shift)) % num_labels for label, shift in zip(subset[label_column], shifts)]
    return subset.remove_columns(label_column).add_column(label_column, labels).cast(subset.features)


def _with_canaries(train_dataset: Any, canaries: Any, rows: Sequence[int]) -> Any:
    """The training set plus the included canaries (a Hugging Face dataset when both are one)."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        datasets = None
    if (
        datasets is not None
        and isinstance(train_dataset, datasets.Dataset)
        and isinstance(canaries, datasets.Dataset)
    ):
        chosen = canaries.select(list(rows))
        if chosen.features != train_dataset.features:
            chosen = chosen.cast(train_dataset.features)
        return datasets.concatenate_datasets([train_dataset, chosen])
    from torch.utils.data import ConcatDataset, Subset

    return ConcatDataset([train_dataset, Subset(canaries, list(rows))])


@contextlib.contextmanager
def _scoring_mode(trainer: Any) -> Iterator[torch.nn.Module]:
    """The model in eval mode with the per-example-gradient hooks off; restored afterwards."""
    model = trainer.model
    was_training = model.training
    hooks = [getattr(trainer, name, None) for name in ("grad_sample_handle", "fast_clipping")]
    model.eval()
    try:
        with contextlib.ExitStack() as stack:
            for handle in hooks:
                if handle is not None:
                    stack.enter_context(handle.hooks_off())
            yield model
    finally:
        model.train(was_training)
        for p in model.parameters():
            if getattr(p, "grad_sample", None) is not None:
                p.grad_sample = None


def _scoring_examples(trainer: Any, canaries: Any) -> Any:
    try:
        import datasets

        if isinstance(canaries, datasets.Dataset):
            # As the Trainer's loaders do: keep only the columns the model's forward accepts.
            return trainer._remove_unused_columns(canaries, description="audit canaries")
    except ImportError:  # pragma: no cover
        pass
    return canaries


def _batches(trainer: Any, examples: Any, batch_size: int) -> Iterator[dict[str, Any]]:
    collator = trainer.data_collator
    for lo in range(0, len(examples), batch_size):
        batch = collator([examples[i] for i in range(lo, min(lo + batch_size, len(examples)))])
        yield trainer._prepare_inputs(batch)


def _canary_losses(trainer: Any, examples: Any, batch_size: int) -> np.ndarray:
    out = []
    with _scoring_mode(trainer) as model, torch.no_grad():
        for inputs in _batches(trainer, examples, batch_size):
            out.append(trainer.compute_per_example_losses(model, inputs).detach().float().cpu())
    return torch.cat(out).numpy().astype(np.float64)


def _gradient_alignment(
    trainer: Any, examples: Any, start: dict[str, torch.Tensor], end: dict[str, torch.Tensor]
) -> np.ndarray:
    """``<grad loss_j(theta_0), theta_0 - theta_T> / ||grad loss_j(theta_0)||`` per canary, one backward each."""
    with _scoring_mode(trainer) as model:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        moves = [(start[n] - end[n]).to(p.device) for n, p in named]
        with torch.no_grad():
            for name, p in named:
                p.copy_(start[name])
        scores = []
        try:
            for inputs in _batches(trainer, examples, 1):
                loss = trainer.compute_per_example_losses(model, inputs).sum()
                grads = [g for g in torch.autograd.grad(loss, params, allow_unused=True)]
                dot = sum(
                    float((g.float() * mv.float()).sum()) for g, mv in zip(grads, moves) if g is not None
                )
                norm = math.sqrt(sum(float(g.float().pow(2).sum()) for g in grads if g is not None))
                scores.append(dot / norm if norm > 0 else 0.0)
        finally:
            with torch.no_grad():
                for name, p in named:
                    p.copy_(end[name])
    return np.asarray(scores, dtype=np.float64)


def _trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def audit_trainer(
    make_trainer: Callable[[Any], Any],
    train_dataset: Any,
    canaries: Any,
    *,
    claimed_epsilon: float | None = None,
    delta: float | None = None,
    score: str = "loss",
    seed: int = 0,
    confidence: float = 0.95,
    guesses="auto",
    batch_size: int = 64,
    raise_on_failure: bool = False,
) -> AuditReport:
    """One-run input-space audit of a whole DPTrainer run, including the user's data pipeline and model.

    Args:
        make_trainer: ``make_trainer(dataset) -> DPTrainer`` built on the given training set (the
            real one plus the included canaries) exactly as the run to audit; it is trained once.
        train_dataset: the ordinary training data.
        canaries: the canary examples, in the same format as ``train_dataset`` (e.g.
            :func:`label_flip_canaries` of held-out data, or examples with tokens no other example has).
            Each is inserted with probability 1/2.
        claimed_epsilon, delta: the claim under test; by default the trainer's own
            ``privacy_spent()`` after training, at its ``delta``.
        score: ``"loss"`` (default) or ``"gradient"`` (see the module docstring).
        seed: which canaries are inserted (and tie-breaking among equal scores).
        confidence, guesses: see :func:`dp_hf.audit.bound.score_guesses`.
        batch_size: canaries per forward pass when scoring.
        raise_on_failure: raise :class:`PrivacyAuditError` on failure instead of only warning.

    Returns:
        An :class:`AuditReport`, also stored as ``trainer.audit_report`` so that the privacy card of
        a later ``save_model`` can include it.
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}.")
    m = len(canaries)
    if m < 2:
        raise ValueError(f"audit_trainer needs at least 2 canaries, got {m}.")
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    dataset = _with_canaries(train_dataset, canaries, np.flatnonzero(included).tolist())
    trainer = make_trainer(dataset)
    for attribute in ("train", "privacy_spent", "compute_per_example_losses", "model"):
        if not hasattr(trainer, attribute):
            raise TypeError(
                f"make_trainer must return a dp_hf DPTrainer; {type(trainer).__name__} has no {attribute!r}."
            )
    examples = _scoring_examples(trainer, canaries)
    start_time = time.perf_counter()
    start = _trainable_state(trainer.model)
    losses_before = _canary_losses(trainer, examples, batch_size) if score == "loss" else None
    trainer.train()
    end = _trainable_state(trainer.model)
    if score == "loss":
        scores = losses_before - _canary_losses(trainer, examples, batch_size)
    else:
        scores = _gradient_alignment(trainer, examples, start, end)
    elapsed = time.perf_counter() - start_time

    spent_epsilon, trainer_delta = trainer.privacy_spent()
    claim = float(spent_epsilon if claimed_epsilon is None else claimed_epsilon)
    delta = float(trainer_delta if delta is None else delta)
    result = score_guesses(scores, included, delta, confidence, guesses, seed=seed)
    args = trainer.args
    optimizer_name = getattr(args, "dp_optimizer", None)
    steps = int(getattr(trainer.state, "global_step", 0))
    sample_rate = getattr(trainer, "sample_rate", None)
    sigma = getattr(trainer, "noise_multiplier", None)
    details = {
        "target": f"a DPTrainer run ({optimizer_name})",
        "optimizer": optimizer_name,
        "noise_multiplier": sigma,
        "sample_rate": sample_rate,
        "steps": steps,
        "dataset_size": len(dataset),
        "num_ordinary": len(train_dataset),
        "trainer_epsilon": spent_epsilon,
        "mean_score_included": float(np.mean(scores[included])) if included.any() else None,
        "mean_score_excluded": float(np.mean(scores[~included])) if (~included).any() else None,
        "guess_candidates": [list(c) for c in result.candidates],
        "seconds": round(elapsed, 3),
        "setup_text": (
            f"{steps} training steps of {optimizer_name} at sample rate "
            f"{sample_rate if sample_rate is None else format(sample_rate, '.4g')}, noise multiplier "
            f"{sigma if sigma is None else format(sigma, '.4g')}, {len(train_dataset)} ordinary examples"
        ),
    }
    report = report_from_guesses(
        result,
        claimed_epsilon=claim if not math.isnan(claim) else math.inf,
        delta=delta,
        confidence=confidence,
        included=included,
        method="input-space canaries",
        score=score,
        details=details,
    )
    trainer.audit_report = report
    if report.passed:
        (logger.info if report.conclusive else logger.warning)("%s", report.summary)
    elif raise_on_failure:
        raise PrivacyAuditError(report)
    else:
        warnings.warn(report.summary, PrivacyAuditWarning, stacklevel=2)
    return report
