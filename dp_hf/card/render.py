"""Rendering a privacy report as the model card: ``README.md``, Hub YAML front matter + Markdown.

Owns :func:`render_card` and its Markdown helpers: the introduction, the "Privacy" section (its
table, warnings, audit, what the guarantee does not cover, how to reproduce epsilon) and the
"Evaluation" section. It reads only the report (:mod:`dp_hf.card.report`), never a trainer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dp_hf.accounting.display import delta_text, significant
from dp_hf.audit.report import audit_card_lines

__all__ = ["THREAT_MODEL", "render_card"]

#: Where the card points for the full threat model.
THREAT_MODEL = "the threat model of dp_hf (`docs/threat-model.md` in the dp_hf repository)"


def render_card(report: Mapping[str, Any], evaluation: Mapping[str, Any] | None = None) -> str:
    """The model card (YAML front matter + Markdown) for a ``privacy.json`` report.

    ``evaluation`` (as returned by :func:`~dp_hf.card.report.eval_metrics_from_log_history`) replaces
    the one stored in the report, e.g. a newer one from ``trainer_state.json``.
    """
    meta = report["model_card"]
    if evaluation is None:
        evaluation = meta.get("evaluation")
    metrics = (evaluation or {}).get("metrics") or {}
    body = "\n".join(
        [
            f"# {meta.get('model_name')}",
            "",
            *(_CHECKPOINT_NOTICE if report.get("checkpoint") else []),
            _intro(report),
            "",
            _privacy_section(report),
            _evaluation_section(evaluation, metrics),
            "## Training with dp_hf",
            "",
            "Trained with dp_hf (differentially private fine-tuning of Hugging Face models). `privacy.json` next "
            "to this card holds every value above in machine-readable form.",
            "",
        ]
    )
    return f"---\n{_front_matter(meta, metrics)}\n---\n\n{body}"


_CHECKPOINT_NOTICE = [
    "> **This directory is a training checkpoint: do not publish it as it is.** Its `optimizer.pt` holds the "
    "noise generator (its state holds the seed it started from) and `dp_state.pt` the secret sampling seed: "
    "with them anyone can regenerate the noise of every step, those already taken as well as those to come, "
    "and every batch. Keep checkpoints out of the folder you publish. Publish the final model (`trainer.save_model()`, "
    "`trainer.push_to_hub()`), or only this directory's weights, config and card.",
    "",
]


def _front_matter(meta: Mapping[str, Any], metrics: Mapping[str, Any]) -> str:
    """The Hub metadata as YAML, with a model-index entry per evaluation metric."""
    from huggingface_hub import EvalResult, ModelCardData

    eval_dataset = meta.get("eval_dataset_name")
    eval_results = [
        EvalResult(
            task_type=meta.get("pipeline_tag") or "other",
            # The Hub reads type as a dataset id: a description (with spaces) is only a name.
            dataset_type=eval_dataset
            if eval_dataset and not any(c.isspace() for c in eval_dataset)
            else "custom",
            dataset_name=eval_dataset or "custom evaluation data",
            metric_type=name,
            metric_value=value,
            metric_name=_title(name),
        )
        for name, value in metrics.items()
    ]
    data = ModelCardData(
        base_model=meta.get("base_model"),
        datasets=meta.get("datasets") or None,
        language=meta.get("language"),
        license=meta.get("license"),
        library_name=meta.get("library_name"),
        model_name=meta.get("model_name") if eval_results else None,  # only model-index uses it
        pipeline_tag=meta.get("pipeline_tag"),
        tags=meta.get("tags"),
        eval_results=eval_results or None,
    )
    return data.to_yaml()


def _intro(report: Mapping[str, Any]) -> str:
    meta = report["model_card"]
    base = meta.get("base_model")
    what = "A PEFT adapter" if meta.get("library_name") == "peft" else "A model"
    # Without a known base model dp_hf cannot tell fine-tuning from training from scratch: say "trained".
    source = f" fine-tuned from [{base}](https://huggingface.co/{base})" if base else " trained"
    dataset = report["dataset"]
    size = f"{dataset['size']} training examples" if dataset.get("size") is not None else ""
    if dataset.get("name"):
        data = f" on {_md(dataset['name'])}" + (f" ({size})" if size else "")
    else:
        data = f" on {size}" if size else ""
    if not report["private"]:
        return f"{what}{source}{data}. **It is NOT differentially private** (see below)."
    eps = _fmt_epsilon(report["epsilon"])
    if not report["sampling"]["accounting_holds"]:
        return (
            f"{what}{source}{data} with per-example clipping and Gaussian noise, but with shuffled batches: its "
            f"accounted ({eps}, {delta_text(report['delta'])})-DP assumes Poisson sampling and is **not a proven guarantee "
            "for this run** (see the warning below)."
        )
    return (
        f"{what}{source}{data} with differential privacy: ({eps}, {delta_text(report['delta'])})-DP "
        "for each training example."
    )


# --------------------------------------------------------------------------- the Privacy section


def _privacy_section(report: Mapping[str, Any]) -> str:
    if not report["private"]:
        return "\n".join(["## Privacy", "", *_not_private_lines(report)])
    lines = [
        "## Privacy",
        "",
        *_warning_lines(report),
        _guarantee_sentence(report),
        "",
        "| | |",
        "|---|---|",
        *[f"| {name} | {_cell(value)} |" for name, value in _privacy_rows(report)],
        "",
        *(audit_card_lines(report["audit"], report["epsilon"]) if report.get("audit") else []),
        "### What the guarantee does not cover",
        "",
        *[f"- {item}" for item in report["not_covered"]],
        "",
        f"What dp_hf protects, refuses and does not cover is listed item by item in {THREAT_MODEL}.",
        "",
        "### Reproducing epsilon",
        "",
        *_reproduce_lines(report),
        "",
    ]
    return "\n".join(lines)


def _not_private_lines(report: Mapping[str, Any]) -> list[str]:
    return [
        f"**This model is NOT private.** Reason: {report['not_private_reason']}. No differential-privacy "
        "guarantee of any kind applies to its training data; it is a non-private baseline.",
        "",
        f"Training: {_steps(report['steps'])}, expected batch {report['expected_batch_size']}, "
        f"optimizer `{report['optimizer']['name']}` ({_hyperparameters(report['optimizer'])}), "
        f"dp_hf {report['versions']['dp_hf']}.",
        "",
    ]


def _warning_lines(report: Mapping[str, Any]) -> list[str]:
    """Quoted warnings: sampling that voids the accounting, and mismatches found when the report was built."""
    lines = []
    sampling = report["sampling"]
    if not sampling["accounting_holds"]:
        lines += [f"> **Warning: the accounting does not hold for this run.** {sampling['warning']}", ""]
    for warning in report.get("warnings") or []:
        lines += [f"> **Warning:** {warning}; the epsilon below may not describe this run.", ""]
    if report.get("delta_at_least_one_over_n"):
        size = report["dataset"]["size"]
        lines += [
            f"> **Warning: δ = {delta_text(report['delta'])} is not below 1/N = {1 / size:.2g}** (N = {size:,} training "
            "examples). Publishing one training example in full, chosen at random, meets (0, 1/N)-DP: a δ this "
            "large does not rule out that kind of leak. A meaningful δ is well below 1/N (dp_hf's default is "
            "1/(10 N)).",
            "",
        ]
    return lines


def _guarantee_sentence(report: Mapping[str, Any]) -> str:
    epsilon_delta = f"**(ε, δ) = ({_fmt_epsilon(report['epsilon'])}, {delta_text(report['delta'])})**"
    unit = f"{report['privacy_unit']}, under {report['adjacency']}"
    if not report["sampling"]["accounting_holds"]:
        return (
            f"The accountant reports {epsilon_delta} for {unit}, **for Poisson-sampled batches**. This run used "
            "shuffled fixed-size batches, for which that epsilon is not proven: it overstates this run's privacy."
        )
    return (
        f"This model was trained with differential privacy: {epsilon_delta} for {unit}. The weights (and "
        "anything computed from them) reveal at most this much about whether any one example was in the "
        "training set."
    )


def _by_phase(report: Mapping[str, Any], column: int, current: float) -> str:
    """A history column (0: sigma, 1: q) with the steps each value held, when it changed (a resume)."""
    history = report["accountant_state"]["history"]
    # In full (repr): a reader recomputes epsilon from them, and sigma 0.923339 for 0.923338623 gave less.
    if len({entry[column] for entry in history}) <= 1:
        return repr(float(current))
    parts, first = [], 1
    for entry in history:
        last = first + entry[2] - 1
        parts.append(f"{float(entry[column])!r} (steps {first}-{last})")
        first = last + 1
    return ", ".join(parts)


def _privacy_rows(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The (name, value) rows of the Privacy table."""
    dataset = report["dataset"]
    optimizer = report["optimizer"]
    rows = [
        ("Unit of privacy", f"{report['privacy_unit']}; {report['adjacency']}"),
        ("Epsilon (ε) spent", _fmt_epsilon(report["epsilon"])),
        ("Delta (δ)", delta_text(report["delta"])),
        ("Accountant", f"{report['accountant'].upper()} ({report['accounting_library']})"),
        ("Noise multiplier σ", _by_phase(report, 0, report["noise_multiplier"])),
    ]
    sample_rate = _by_phase(report, 1, report["sample_rate"])
    if report["sampling"]["method"] == "poisson":
        rows += [
            ("Sample rate q", sample_rate),
            ("Steps", _steps_text(report)),
            ("Expected logical batch", str(report["expected_batch_size"])),
        ]
    else:  # q and the batch are what the accounting assumed, not what ran
        rows += [
            ("Sample rate q (accounted, assumes Poisson)", sample_rate),
            ("Steps", f"{_steps(report['steps'])} (shuffled batches: each example once per epoch)"),
            (
                "Logical batch",
                f"{report['expected_batch_size']} (fixed; an epoch's last batch may be smaller)",
            ),
        ]
    rows += [
        ("Clipping", report["clipping"]["description"]),
        ("Sampling", _sampling_text(report["sampling"])),
        ("Optimizer", f"`{optimizer['name']}` ({_hyperparameters(optimizer)})"),
        ("Training data", f"{_md(dataset.get('name') or 'not named')}, {dataset.get('size')} examples"),
        ("Noise generator", _noise_text(report)),
        ("Library", f"dp_hf {report['versions']['dp_hf']}"),
    ]
    if report.get("target_epsilon") is not None:
        stop = " (training stopped at the budget)" if report.get("stopped_by_budget") else ""
        rows.insert(2, ("Target epsilon", f"{report['target_epsilon']:g}{stop}"))
    return rows


def _reproduce_lines(report: Mapping[str, Any]) -> list[str]:
    """A snippet that recomputes epsilon: ``compute_epsilon`` for one phase, the whole history otherwise."""
    history = report["accountant_state"]["history"]
    grid = report.get("pld_value_discretization_interval")
    grid_line = (
        [
            f"With dp_accounting directly, use `PLDAccountant(value_discretization_interval={grid!r})`, the "
            "grid this epsilon was computed on (its default grid gives a slightly larger upper bound).",
            "",
        ]
        if grid is not None
        else []
    )
    if len(history) <= 1:
        return grid_line + [
            "```python",
            "from dp_hf.accounting import compute_epsilon",
            "",
            f"compute_epsilon(sample_rate={report['sample_rate']!r}, noise_multiplier={report['noise_multiplier']!r}, "
            f"steps={report['steps']!r}, delta={report['delta']!r}, accountant={report['accountant']!r})",
            "```",
        ]
    return grid_line + [
        f"The noise multiplier or sample rate changed during training ({len(history)} phases); compose the "
        "whole history stored in `privacy.json`:",
        "",
        "```python",
        "import json",
        "from dp_hf.card import epsilon_from_report",
        "",
        'epsilon_from_report(json.load(open("privacy.json")))',
        "```",
    ]


def _steps_text(report: Mapping[str, Any]) -> str:
    """``90 steps (15 epochs of 6 steps; each example sampled 16 times in expectation = steps × q)``."""
    passes = report.get("expected_passes", report.get("epochs"))
    formula = "Σ steps × q over the phases" if len(report["accountant_state"]["history"]) > 1 else "steps × q"
    sampled = f"each example sampled {passes:.3g} times in expectation = {formula}"
    per_epoch, epochs = report.get("steps_per_epoch"), report.get("trainer_epochs")
    if per_epoch and epochs is not None:
        unit = "epoch" if epochs == 1 else "epochs"
        return f"{_steps(report['steps'])} ({epochs:.3g} {unit} of {per_epoch} steps; {sampled})"
    return f"{_steps(report['steps'])} ({sampled})"


def _sampling_text(sampling: Mapping[str, Any]) -> str:
    if sampling["method"] == "poisson":
        return "Poisson: each example joins each logical batch independently with probability q"
    return "shuffled fixed-size batches: **the Poisson accounting above does not hold**"


def _noise_text(report: Mapping[str, Any]) -> str:
    if report["secure_mode"]:
        return "freshly seeded from OS entropy at every draw (secure_mode)"
    if report["noise_seed_fixed"]:
        return "seeded with a user-fixed noise_seed (not published here; the guarantee needs it secret)"
    return "seeded once from OS entropy"


# --------------------------------------------------------------------------- the Evaluation section


def _evaluation_section(evaluation: Mapping[str, Any] | None, metrics: Mapping[str, Any]) -> str:
    if not metrics:
        return ""
    where = f" (step {evaluation.get('step')})" if evaluation and evaluation.get("step") is not None else ""
    split = (evaluation or {}).get("split")
    if split and split != "eval":
        where = f" on the `{split}` split{where}"
    rows = [f"| {_cell(_title(name))} | {value:.6g} |" for name, value in metrics.items()]
    return "\n".join(
        [
            "## Evaluation",
            "",
            f"Latest evaluation{where}. These metrics were computed without noise: they are not covered by the "
            "privacy guarantee.",
            "",
            "| Metric | Value |",
            "|---|---|",
            *rows,
            "",
            "",
        ]
    )


# --------------------------------------------------------------------------- formatting


def _hyperparameters(optimizer: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={_fmt_value(value)}" for key, value in optimizer["hyperparameters"].items())


def _steps(count: int) -> str:
    return f"{count} step" if count == 1 else f"{count} steps"


def _fmt_epsilon(epsilon: float | None) -> str:
    return "∞" if epsilon is None else significant(epsilon, 4)  # rounded up: never below the accounted ε


def _fmt_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "(" + ", ".join(_fmt_value(item) for item in value) + ")"
    return str(value)


def _title(name: str) -> str:
    return " ".join(part.capitalize() for part in name.split("_"))


def _md(text: Any) -> str:
    """User-given text inside Markdown: no raw HTML, no line breaks."""
    return str(text).replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def _cell(text: Any) -> str:
    return _md(text).replace("|", "\\|")
