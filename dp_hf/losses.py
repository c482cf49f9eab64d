"""Per-example losses for Hugging Face heads.

Per-example clipping bounds the contribution of one example only if the loss
is a sum of terms each of which depends on one example. Hugging Face models
average the loss over every token of the batch, which couples examples (each
example's gradient is scaled by the batch's total token count). DPTrainer
therefore recomputes the loss from the logits: one term per example (the mean
over that example's own labelled tokens for token-level heads), summed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dp_hf.distributed import unwrap_ddp

TASKS = ("single_label_classification", "regression", "multi_label_classification", "token", "causal_lm")


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    model = unwrap_ddp(model)
    if hasattr(model, "get_base_model"):  # PEFT
        model = model.get_base_model()
    return model


def _architectures(mapping_name: str) -> set[str]:
    from transformers.models.auto import modeling_auto

    names = set()
    for value in getattr(modeling_auto, mapping_name).values():
        names.update(value if isinstance(value, (list, tuple)) else [value])
    return names


def infer_task(model: torch.nn.Module) -> str | None:
    """The loss family of a Hugging Face model from its class, or None if unknown.

    Uses transformers' auto-class mappings (so ``GPT2LMHeadModel`` is a causal LM)
    and falls back to the class name's suffix. Classification heads defer the
    choice between single-label, multi-label and regression to
    :func:`per_example_loss` (as Hugging Face does, from ``config.problem_type``,
    ``num_labels`` and the labels' dtype).
    """
    name = type(_base_model(model)).__name__
    if name in _architectures("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES") or name.endswith("ForCausalLM"):
        return "causal_lm"
    token_level = _architectures("MODEL_FOR_MASKED_LM_MAPPING_NAMES") | _architectures(
        "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"
    )
    if name in token_level or name.endswith(("ForMaskedLM", "ForTokenClassification")):
        return "token"
    if "Classification" in name:
        return "classification"
    return None


def _classification_kind(model: torch.nn.Module, labels: torch.Tensor) -> str:
    config = getattr(_base_model(model), "config", None)
    problem_type = getattr(config, "problem_type", None)
    if problem_type:
        return problem_type
    num_labels = getattr(config, "num_labels", 2)
    if num_labels == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM targets of every position, ``[b, T]``: position ``t`` predicts ``labels[:, t + 1]``, the last
    one nothing (-100). As transformers' ``ForCausalLMLoss``, the labels are shifted, not the logits: the slice
    ``logits[:, :-1]`` is not contiguous, and flattening it copied one more ``[b, T, V]`` float32 tensor at the
    forward's peak (GPT-2-medium, B 16, L 512: 1.6 GB)."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def token_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each example's labelled tokens; 0 for an example without any."""
    per_token = per_token * mask
    counts = mask.sum(dim=1)
    return per_token.sum(dim=1) / counts.clamp_min(1)


def per_example_loss(
    logits: torch.Tensor, labels: torch.Tensor, task: str, model: torch.nn.Module | None = None
) -> torch.Tensor:
    """``[b]`` losses, one per example, for ``task`` (see :data:`TASKS`, or ``"classification"``)."""
    if task == "classification":
        task = _classification_kind(model, labels)
    logits = logits.float()
    if task == "single_label_classification":
        return F.cross_entropy(logits.view(labels.shape[0], -1), labels.view(-1), reduction="none")
    if task == "regression":
        return F.mse_loss(
            logits.view(labels.shape[0], -1),
            labels.view(labels.shape[0], -1).to(logits.dtype),
            reduction="none",
        ).mean(dim=1)
    if task == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none").mean(
            dim=1
        )
    if task in ("token", "causal_lm"):
        if logits.dim() == labels.dim() + 1 and logits.shape[:2] != labels.shape[:2]:  # not a bare size error
            raise ValueError(
                f"the model returned logits for {tuple(logits.shape[:2])} positions but the labels have "
                f"{tuple(labels.shape[:2])}: each label must be its own position's. Return one logit row per "
                "input token, or pass per_example_loss_fn=fn(outputs, labels, inputs) that aligns them."
            )
        if task == "causal_lm":  # predict token t+1 from tokens <= t, as Hugging Face's causal LM loss
            labels = shifted_labels(labels)
        mask = labels != -100
        per_token = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.clamp_min(0).reshape(-1), reduction="none"
        ).view(labels.shape)
        return token_mean(per_token, mask.to(per_token.dtype))
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS + ('classification',)}.")
