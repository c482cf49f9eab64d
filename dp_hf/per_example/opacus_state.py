"""What Opacus's hooks leave on a model, read and cleared: per-example gradients (``p.grad_sample``), the forward
pass each of their rows came from, and the hooked parameters' names (split from
:mod:`dp_hf.per_example.opacus_hooks`, which attaches the hooks and re-exports these)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from dp_hf.per_example.errors import PerSampleGradientError
from dp_hf.per_example.samplers import PATCH_EMBEDDING_CALLS

__all__ = [
    "clear_grad_sample",
    "grad_sample_forwards",
    "hooked_parameter_name",
    "per_sample_gradients",
    "unheld_recorded_parameters",
]

# The outermost forward pass (BatchSizeRecorder.forward_count) of each activation Opacus holds on a module.
FORWARD_IDS = "_dp_hf_forward_ids"
# Attributes that Opacus and this module leave on submodules during a forward/backward pass.
MODULE_STATE_ATTRIBUTES = ("activations", "max_batch_len", PATCH_EMBEDDING_CALLS, FORWARD_IDS)
# Trainable parameter -> the forward passes whose rows Opacus is summing into its next per-example gradient.
SUMMED_FORWARDS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
# Trainable parameter -> the forward pass of each entry of its p.grad_sample (a list after several backwards).
GRAD_SAMPLE_FORWARDS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def grad_sample_forwards(parameter: torch.Tensor) -> tuple[int, ...] | None:
    """The forward pass (counted per model) of each entry of ``parameter.grad_sample``; None if unknown.

    Rows of two parameters are the same examples only if their entries come from the same passes."""
    forwards = GRAD_SAMPLE_FORWARDS.get(parameter)
    return (
        tuple(forwards)
        if forwards is not None and getattr(parameter, "grad_sample", None) is not None
        else None
    )


# Trainable parameter -> its name in the attached model, for error messages of consumers that see
# only tensors (the DP optimizers). Weak keys: nothing is stored on the parameters themselves.
PARAMETER_NAMES: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


# Trainable parameter -> id of the model it was attached with (which tensors one optimizer must hold).
PARAMETER_MODELS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def unheld_recorded_parameters(parameters: Sequence[torch.Tensor]) -> list[str]:
    """Names of the tensors attached with the same models as ``parameters`` that hold per-example gradients
    but are not among them: clipped by another optimizer, each example would count once in each (an own-loop
    audit of two DP optimizers on one model: sqrt(2) C)."""
    held = {id(p) for p in parameters}
    models = {PARAMETER_MODELS.get(p) for p in parameters} - {None}
    return [
        PARAMETER_NAMES.get(p) or f"a tensor of shape {tuple(p.shape)}"
        for p in list(GRAD_SAMPLE_FORWARDS.keys())
        if id(p) not in held
        and PARAMETER_MODELS.get(p) in models
        and getattr(p, "grad_sample", None) is not None
    ]


def hooked_parameter_name(parameter: torch.Tensor) -> str | None:
    """Name of ``parameter`` in the model it was attached with by :func:`attach_grad_sample` (or None)."""
    return PARAMETER_NAMES.get(parameter)


def per_sample_gradients(
    model: nn.Module, *, strict: bool = True, check_sums: bool = False
) -> dict[str, torch.Tensor]:
    """``{parameter name: per-example gradients [B, *p.shape]}`` for every trainable parameter of ``model``.

    A list in ``p.grad_sample`` (several backward passes without clearing) is concatenated along
    the batch dimension, i.e. each backward is taken to be a micro-batch of different examples.
    Tied parameters appear once, under their first name.  Parameters that received neither a
    gradient nor a per-example gradient (unused in this forward) are omitted.

    With ``strict`` (default) this raises :class:`PerSampleGradientError` when a parameter has a
    ``.grad`` but no ``.grad_sample`` (it was used outside its module's forward, or the model ran
    in eval mode / with hooks disabled) or when the per-example batch sizes disagree (a batch
    dimension was broadcast or reshaped somewhere): in both cases a DP optimizer would be wrong.

    ``check_sums=True`` additionally verifies ``sum_i grad_sample[i] == p.grad`` for every
    parameter (valid when ``p.grad`` was zeroed before the backward passes being read).  That
    catches any use of a parameter the hooks did not see, at the cost of one reduction per
    parameter; use it in tests and when bringing up a new architecture.
    """
    gradients: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        grad_sample = getattr(parameter, "grad_sample", None)
        if grad_sample is None:
            if parameter.grad is not None:
                missing.append(name)
            continue
        gradients[name] = torch.cat(grad_sample, dim=0) if isinstance(grad_sample, list) else grad_sample
    if strict:
        if missing:
            raise PerSampleGradientError(
                f"{len(missing)} trainable parameter(s) have a .grad but no .grad_sample: {', '.join(missing[:8])}. "
                "Were the hooks attached (and enabled) before the forward pass, was the model in train() "
                "mode, and is every parameter used through its own module's forward?"
            )
        batch_sizes = {name: g.shape[0] for name, g in gradients.items()}
        if len(set(batch_sizes.values())) > 1:
            by_size: dict[int, list[str]] = {}
            for name, size in batch_sizes.items():
                by_size.setdefault(size, []).append(name)
            details = "; ".join(f"batch {size}: {', '.join(names[:3])}" for size, names in by_size.items())
            raise PerSampleGradientError(
                f"per-example gradients have inconsistent batch sizes ({details}); some layer saw a "
                "broadcast or reshaped batch dimension, so its 'per-example' gradients are not per example."
            )
    if check_sums:
        parameters = dict(model.named_parameters())
        mismatched = []
        for name, grads in gradients.items():
            grad = parameters[name].grad
            total = grads.sum(dim=0)
            reference = grad if grad is not None else torch.zeros_like(total)
            tolerance = 1e-5 * max(1.0, float(reference.abs().max()))
            if not torch.allclose(total.to(reference.dtype), reference, rtol=1e-4, atol=tolerance):
                mismatched.append(name)
        if mismatched:
            raise PerSampleGradientError(
                f"per-example gradients do not sum to .grad for: {', '.join(mismatched[:8])}. Some use of "
                "these parameters was not seen by the hooks (e.g. a parameter read outside its module's forward)."
            )
    return gradients


def clear_grad_sample(model: nn.Module) -> None:
    """Forget per-example gradients and any half-finished capture state of ``model``.

    Sets ``p.grad_sample = None`` (Opacus expects the attribute to exist) and drops activations
    recorded by forward passes that were never back-propagated (e.g. a training-mode forward used
    only for metrics), which would otherwise be paired with the next backward.  Call it between
    micro-batches (after reading the gradients), never between a forward and its backward.
    """
    for parameter in model.parameters():
        if hasattr(parameter, "grad_sample"):
            parameter.grad_sample = None
        if hasattr(parameter, "_current_grad_sample"):
            del parameter._current_grad_sample
        if hasattr(parameter, "_forward_counter"):
            parameter._forward_counter = 0
        SUMMED_FORWARDS.pop(parameter, None)
        GRAD_SAMPLE_FORWARDS.pop(parameter, None)
    for module in model.modules():
        for attribute in MODULE_STATE_ATTRIBUTES:
            if attribute in module.__dict__:
                delattr(module, attribute)
