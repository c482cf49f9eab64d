"""Completeness of per-example gradients: every use of a parameter must have been seen by the hooks.

Per-sample hooks only see how a parameter is used inside its own module's ``forward``; a use
elsewhere (``F.linear(x, self.child.weight)`` in a parent) reaches ``p.grad`` but not
``p.grad_sample``. :func:`check_complete_grad_samples` compares the two before anything is clipped,
and :func:`refuse_unhooked_gradients` refuses a ``p.grad`` that no hook recorded at all. Used by
:meth:`dp_hf.optim.base.DPOptimizer.clip_and_accumulate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from dp_hf.precision import float32_arithmetic_eps

__all__ = [
    "check_complete_grad_samples",
    "describe_parameter",
    "drop_gradients",
    "mark_released",
    "refuse_unhooked_gradients",
]

# Tolerance of the completeness check in clip_and_accumulate: ||sum_i g_i - p.grad|| must stay below
# tol * (||p.grad|| + ||sum_i g_i|| + ||G||_F), where ||G||_F is the Frobenius norm of all per-example
# gradients of the micro-batch (every tensor, every example). The last term is the absolute floor
# that tensors whose exact gradient is ~0 need (e.g. attention key biases, which softmax ignores:
# their p.grad is pure rounding noise). tol = max(_SUM_CHECK_MIN_TOL, _SUM_CHECK_EPS_FACTOR * eps)
# for the least precise of the two dtypes (bf16: 3.1e-2). Measured on the tiny BERT/RoBERTa/GPT-2/
# Llama/ViT/DeiT/LoRA models of tests/test_grad_sample.py, the ratio is <= 1.4e-7 in float32 and
# <= 3e-3 with bf16 weights or autocast: a margin of 10x (bf16) to 7000x (float32) for larger
# batches, longer sequences and other summation orders, while a use the hooks missed is found as
# soon as it is above ~0.1% (float32) / ~3% (bf16) of that scale.
_SUM_CHECK_MIN_TOL = 1e-3
_SUM_CHECK_EPS_FACTOR = 4.0


def _compute_eps(dtype: torch.dtype, device: torch.device) -> float:
    """Machine epsilon of the arithmetic that produced a tensor of ``dtype`` on ``device``: float32
    matmuls/convolutions may run in TF32 or bf16 while the tensors stay float32."""
    return float32_arithmetic_eps(device) if dtype == torch.float32 else torch.finfo(dtype).eps


# The p.grad tensors that step() wrote (weak keys) -> their version then. A p.grad that is still one
# of them, unmodified, is a privatized gradient left from the last step (zero_grad() not called yet),
# not autograd's: the completeness check has nothing to compare it with. A backward pass that
# accumulates into it in place bumps its version, and is then compared (and refused).
_RELEASED_GRADS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _stacked_norms(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``[n]`` float32 on ``device``: the 2-norm of each tensor, in its own dtype."""
    return _stacked(torch._foreach_norm(list(tensors)), device).float()


def _stacked(scalars: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The 0-d tensors ``scalars`` as one ``[n]`` tensor on ``device`` (moving only those elsewhere)."""
    return torch.stack([s if s.device == device else s.to(device) for s in scalars])


def _parts(grad_sample: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    # Opacus stores a list when backward ran several times before the grads were consumed.
    return list(grad_sample) if isinstance(grad_sample, (list, tuple)) else [grad_sample]


def mark_released(grad: torch.Tensor) -> None:
    """Record that ``grad`` (a ``p.grad`` that ``step()`` wrote) is a privatized gradient, not autograd's."""
    _RELEASED_GRADS[grad] = grad._version


def drop_gradients(params: list[torch.Tensor]) -> None:
    """Drop ``p.grad_sample`` and ``p.grad`` (the non-private gradients must never reach an update)."""
    for p in params:
        p.grad_sample = None
        p.grad = None


def refuse_unhooked_gradients(optimizer: Any, params: list[torch.Tensor]) -> None:
    """Refuse a ``p.grad`` from a backward pass that no per-sample hook recorded.

    With nothing in ``p.grad_sample``, a non-zero ``p.grad`` other than the one the last
    ``step()`` left is an autograd gradient nobody can clip (backward ran with the hooks
    disabled or removed, or the model in eval mode): its examples would silently be dropped
    from the step (before any micro-batch was clipped, or after the last one). Zeros, as
    ``zero_grad(set_to_none=False)`` leaves, are fine. Only tensors that have a ``p.grad``
    are looked at: the usual path (``p.grad`` cleared by clipping) costs nothing.
    """
    candidates = [
        (index, p)
        for index, p in enumerate(params)
        if p.grad is not None and _RELEASED_GRADS.get(p.grad) != p.grad._version
    ]
    stray = [(index, p) for index, p in candidates if bool(p.grad.ne(0).any())]
    if stray:
        names = ", ".join(describe_parameter(optimizer, index, p) for index, p in stray[:5])
        more = f" and {len(stray) - 5} more" if len(stray) > 5 else ""
        drop_gradients(params)
        raise RuntimeError(
            f"trainable parameter(s) {names}{more} have gradients but no per-example gradients: the "
            "backward pass ran without per-sample hooks (not attached, disabled or removed, or the model in "
            "eval mode), so nothing could be clipped. Attach them with "
            "dp_hf.per_example.attach_grad_sample(model) (or Opacus's GradSampleModule) and train in "
            "train() mode. With hooks attached, a training-mode forward pass that was never back-propagated "
            "(e.g. for metrics) does this to the next step: run such passes under torch.no_grad(), or call "
            "handle.clear() after them. p.grad was dropped."
        )


def describe_parameter(optimizer: Any, index: int, p: torch.Tensor) -> str:
    """``'name' (shape ...)`` for error messages, or ``#index (shape ...)`` when no name is known."""
    name = None
    for group in optimizer.param_groups:  # torch optimizers built from named_parameters() keep the names
        names = group.get("param_names")
        if names is not None:
            name = next((n for n, q in zip(names, group["params"]) if q is p), name)
    if name is None:
        from dp_hf.per_example.opacus_hooks import (
            hooked_parameter_name,  # imports Opacus: only when raising
        )

        name = hooked_parameter_name(p)
    where = repr(name) if name is not None else f"#{index}"
    return f"{where} (shape {tuple(p.shape)})"


def check_complete_grad_samples(
    optimizer: Any, params: list[torch.Tensor], grad_samples: list[torch.Tensor | list[torch.Tensor] | None]
) -> None:
    """Refuse per-example gradients that do not sum to ``p.grad``: some use of ``p`` was not hooked.

    Per-sample hooks (Opacus's, as attached by :func:`dp_hf.per_example.attach_grad_sample`)
    only see how a parameter is used inside its own module's ``forward``. A parent that calls
    ``F.linear(x, self.child.weight)``, or a weight shared with a functional call, also sends
    gradient to ``p`` that no hook records: ``p.grad_sample`` then misses that part and
    clipping it would privatize a wrong gradient (the fast paths of :mod:`dp_hf.per_example.ghost` refuse
    the same thing). ``p.grad`` is the ordinary gradient that autograd computes anyway, with
    every use, so ``sum_i grad_sample[i] == p.grad`` is an exact test of completeness at the
    cost of one reduction over the per-example gradients. (Counting gradient contributions
    with tensor hooks during backward would miss the case of one autograd node mixing hooked
    and unhooked uses, and depends on the order in which autograd fires hooks.)

    * Several backward passes before clipping: Opacus keeps a list, ``p.grad`` accumulates;
      the list's parts are summed.
    * Opacus's ``loss_reduction="mean"`` scales each backward's rows by its batch size ``b``,
      so they sum to ``b`` times its share of ``p.grad``. The reduction is not recorded on the
      parameters; the check accepts the micro-batch when every tensor agrees under "sum", or
      every tensor agrees under "mean" (a missed use cannot mimic that for all tensors at once).
    * Tied weights hooked in each of their modules (GPT-2's ``lm_head``/``wte``, BERT's MLM
      decoder/word embeddings) get per-example gradients from both modules: complete, accepted.
    * No ``p.grad`` (per-example gradients set by hand), or a ``p.grad`` that is still the
      one the last ``step()`` left, untouched since (no backward reached it): nothing to compare.
    * bf16/fp16 tensors, TF32 matmuls: the tolerance follows the precision (see
      ``_SUM_CHECK_MIN_TOL``).

    First, with dp_hf's hooks: this optimizer holds every tensor of the model that has per-example
    gradients (two optimizers on one model would each clip to C), and
    (:func:`~dp_hf.per_example.opacus_hooks.grad_sample_forwards`) every tensor's rows come from one
    forward pass, the same for all, or row ``i`` of two tensors would be two examples (two batches
    through different heads, or one batch twice, back-propagated before one clip).
    """
    _check_one_optimizer_holds_the_model(params, grad_samples)
    _check_same_forward_passes(params, grad_samples)
    to_check = [
        (index, p, _parts(gs))
        for index, (p, gs) in enumerate(zip(params, grad_samples))
        if gs is not None and p.grad is not None and _RELEASED_GRADS.get(p.grad) != p.grad._version
    ]
    if not to_check:
        return
    device = to_check[0][2][0].device
    # The norms go through torch._foreach_norm, a few launches for all tensors instead of a handful
    # per tensor: this runs once per micro-batch over every trainable tensor, on the host's critical path.
    totals, mean_totals, grads, tolerances = [], [], [], []
    for _, p, parts in to_check:
        accum = torch.promote_types(parts[0].dtype, torch.float32)
        sums = [part.sum(dim=0, dtype=accum) for part in parts]
        total, mean_total = sums[0], sums[0] / max(parts[0].shape[0], 1)
        for part_sum, part in zip(sums[1:], parts[1:]):
            total = total + part_sum
            mean_total = mean_total + part_sum / max(part.shape[0], 1)
        totals.append(total)
        mean_totals.append(mean_total)
        grads.append(p.grad if p.grad.dtype == accum else p.grad.to(accum))
        eps = max(_compute_eps(parts[0].dtype, parts[0].device), _compute_eps(p.grad.dtype, p.grad.device))
        tolerances.append(max(_SUM_CHECK_MIN_TOL, _SUM_CHECK_EPS_FACTOR * eps))
    sum_error, mean_error, grad_norm, total_norm, mean_norm = (
        _stacked_norms(tensors, device)
        for tensors in (
            torch._foreach_sub(totals, grads),
            torch._foreach_sub(mean_totals, grads),
            grads,
            totals,
            mean_totals,
        )
    )
    # per checked tensor: |sum - grad|, |mean - grad|, |grad| + |sum|, |grad| + |mean|, |grad|
    stats = torch.stack(
        [sum_error, mean_error, grad_norm + total_norm, grad_norm + mean_norm, grad_norm], dim=1
    )
    # Absolute floor: the Frobenius norm of every per-example gradient of the micro-batch, summed in
    # float64 (finite outliers must not overflow; each norm is taken in float32 at least).
    every_part = [part for gs in grad_samples if gs is not None for part in _parts(gs)]
    low = [part for part in every_part if part.element_size() < 4]
    high = [part for part in every_part if part.element_size() >= 4]
    part_norms = [*(torch._foreach_norm(low, 2, dtype=torch.float32) if low else ())]
    part_norms += torch._foreach_norm(high) if high else ()
    floor_sq = _stacked(part_norms, device).double().square().sum()
    tolerance = torch.tensor(tolerances, dtype=torch.float32, device=device)
    floor = floor_sq.sqrt().float()
    bad_sum = stats[:, 0] > tolerance * (stats[:, 2] + floor)
    bad_mean = stats[:, 1] > tolerance * (stats[:, 3] + floor)
    # One device synchronisation per micro-batch: both verdicts come back in one transfer (reading
    # them one after the other waited on the device twice). (Non-finite gradients compare as
    # agreeing: they are not a missed use, and this check is not the place to refuse them.)
    *bad_sum_list, any_bad_mean = torch.cat([bad_sum, bad_mean.any().reshape(1)]).tolist()
    complete_as_mean = not any_bad_mean
    if not any(bad_sum_list) or complete_as_mean:
        return
    offenders = [(k, to_check[k][0]) for k, bad in enumerate(bad_sum_list) if bad]
    details = []
    for k, index in offenders[:5]:
        relative = float(stats[k, 0] / stats[k, 4].clamp_min(torch.finfo(torch.float32).tiny))
        details.append(
            f"{describe_parameter(optimizer, index, params[index])}: off by {relative:.1%} of |p.grad|"
        )
    more = f" and {len(offenders) - 5} more" if len(offenders) > 5 else ""
    raise RuntimeError(
        f"per-example gradients do not sum to p.grad for trainable parameter(s) {'; '.join(details)}{more}. "
        "Part of their gradient was computed outside the per-sample hooks (or a module's per-example rule "
        "does not fit how it was called, e.g. a custom grad sampler that assumes a contiguous input), so it "
        "cannot be clipped per example. The usual cause is a module's weight used outside that module's "
        "own forward (e.g. a parent calling F.linear(x, self.child.weight), or a weight shared with a "
        "functional call): use the weight only by calling its module, or freeze it (requires_grad=False). "
        "Also check that p.grad was zeroed after the last step() (optimizer.zero_grad()), that nothing "
        "rescaled p.grad after the backward pass (a GradScaler: loss scaling is not supported, use bf16; "
        "clip_grad_norm_; gradient hooks) and that the backward pass did not go through a "
        "DistributedDataParallel wrapper (it averages p.grad over ranks). Nothing was accumulated; p.grad "
        "and p.grad_sample were dropped."
    )


def _check_one_optimizer_holds_the_model(params: list[torch.Tensor], grad_samples: list) -> None:
    if all(gs is None for gs in grad_samples):
        return
    from dp_hf.per_example.opacus_hooks import unheld_recorded_parameters  # the Opacus path only

    unheld = unheld_recorded_parameters([p for p, gs in zip(params, grad_samples) if gs is not None])
    if unheld:
        raise RuntimeError(
            f"per-example gradients were recorded for {', '.join(unheld)}, trainable tensors of this model that "
            "this optimizer does not hold: clipped by another optimizer, each example would count up to C in "
            "each (sqrt(2) C for two, an own-loop audit), or they are never released. Give one DP optimizer every "
            "trainable tensor of the model, or freeze the others (requires_grad=False). p.grad and p.grad_sample "
            "were dropped."
        )


def _check_same_forward_passes(params: list[torch.Tensor], grad_samples: list) -> None:
    if all(gs is None for gs in grad_samples):
        return
    from dp_hf.per_example.opacus_hooks import grad_sample_forwards  # the Opacus path only

    passes = {grad_sample_forwards(p) for p, gs in zip(params, grad_samples) if gs is not None}
    passes.discard(None)
    if len(passes) > 1:
        raise RuntimeError(
            f"the per-example gradients of different parameters come from different forward passes "
            f"({sorted(passes)}): row i of one would be clipped together with row i of another, which is another "
            "example (e.g. two batches through different heads back-propagated before one clip). Clip "
            "(clip_and_accumulate) after each forward/backward pass. p.grad and p.grad_sample were dropped."
        )
    forwards = next(iter(passes), None)
    if forwards is not None and len(set(forwards)) > 1:
        raise RuntimeError(  # (the fast path refuses this too, naming the forward passes)
            f"the per-example gradients come from {len(set(forwards))} forward passes back-propagated before one "
            "clip: their rows are clipped as different examples, so one example in two of them (two losses on "
            "one batch, each with its forward and backward) counted twice (2x the bound, an own-loop audit). "
            "Clip (clip_and_accumulate) after each forward/backward pass. p.grad and p.grad_sample were dropped."
        )
