"""A black-box check, once per run, that each example's loss depends on that example only.

The clip bound limits one example's influence on the step only if every other example's gradient is
unchanged when it is added or removed. A loss that looks at the rest of its batch breaks that while
every row is still clipped: one divided by the batch's token count (a realized batch size in a
denominator), in-batch negatives (contrastive losses), batch statistics, routing with an expert
capacity. Such a coupling is often in a user's ``per_example_loss_fn``, where no structural check
can see it. :func:`check_losses_are_per_example` runs two comparisons, without gradients:

* in eval mode (no dropout), the first micro-batch's losses against the losses of its first and last
  examples alone (the same padded rows, sliced): a loss that depends on the batch's size;
* in the modes training runs in (train mode), an example's loss in the micro-batch against its loss
  in a micro-batch of the same shape whose other rows are all copies of it. A layer that looks at the
  batch only in train mode (batch centering without BatchNorm's class, an MoE router's train-only
  expert capacity) is a no-op in eval mode and would pass the first comparison. Dropout modules are
  switched to eval for this pass, and both forwards draw the same random numbers (same seed, same
  shapes), so other train-mode randomness (attention dropout, layer drop, router jitter) falls at the
  same positions and an honest model's example gets the same loss in both.

The random state is restored afterwards: training draws as if the probe had not run.

It catches gross couplings, not every one: the tolerance (5% relative, 0.05 absolute) leaves room
for a bf16 model's batch-size-dependent kernels; and it does not run on packed micro-batches
(padding-free SFT, whose examples are segments of one row). Structural checks cover the rest
(BatchNorm, NEFTune, label smoothing, ... are refused).

Per-example losses are not enough: a forward that moves rows of the batch and back (``flip(0)``, a
head gathering positions of the whole flattened batch into new rows) keeps each loss its own while the
hooks clip rows that mix examples. :func:`check_gradients_follow_the_examples` compares, once per run,
what the clipping attributes to two examples with each one's own gradient (plain autograd).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd

from dp_hf.batches import batch_size_of, cuda_devices, split_microbatch, take_examples
from dp_hf.optim.completeness import check_complete_grad_samples
from dp_hf.per_example.errors import PerSampleGradientError
from dp_hf.privatizer import Geometry, clip_and_sum, clip_factors
from dp_hf.random_state import random_state_kept, seed_every_generator

if TYPE_CHECKING:
    from dp_hf.per_example.ghost.clipping import FastClipping
    from dp_hf.per_example.opacus_hooks import GradSampleHandle

__all__ = [
    "ATTRIBUTION_PROBE_RTOL",
    "ATTRIBUTION_PROBE_RTOL_FLOAT32",
    "LOSS_PROBE_ATOL",
    "LOSS_PROBE_RTOL",
    "attributed_clipped_sum",
    "backward_explained",
    "check_gradients_follow_the_examples",
    "check_layers_follow_the_batch",
    "check_losses_are_per_example",
    "random_replay_message",
    "reduced_precision",
]

#: How far an example's loss alone may be from its loss in the micro-batch (float noise of batched
#: kernels, bf16 included), relative and absolute.
LOSS_PROBE_RTOL = 0.05
LOSS_PROBE_ATOL = 0.05

#: How far the clipping's figures for an example may be from that example's own gradient, relative
#: (its norm, the clipped sum): float noise of batched kernels in bf16/fp16, autocast or TF32 ...
ATTRIBUTION_PROBE_RTOL = 0.05
#: ... and in IEEE float32 (rounding ~1e-6: a mixed row of a layer is a larger share than this).
ATTRIBUTION_PROBE_RTOL_FLOAT32 = 0.01


#: The seed both train-mode forwards of the loss probe start from (their random draws then coincide).
_PROBE_SEED = 0x5EED


@torch.no_grad()
def check_losses_are_per_example(
    compute_losses: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
    model: nn.Module,
    inputs: Mapping[str, Any],
    context: Callable[[], Any],
) -> bool:
    """Raise ``ValueError`` if an example's loss changes when the rest of its micro-batch changes.

    ``compute_losses(model, inputs) -> [b]`` is the trainer's per-example loss; ``context()`` its
    forward's context manager (autocast). ``model``'s modules are in the modes training uses; each
    gets its mode back. Returns False, having checked nothing, for a micro-batch of fewer than two
    examples or whose compared losses are all non-finite (the caller tries the next one); True once
    checked.
    """
    size = batch_size_of(inputs)
    if size < 2:
        return False
    modes = [(module, module.training) for module in model.modules()]
    picks = (0, size - 1)
    try:
        model.eval()
        with context():
            together = compute_losses(model, dict(inputs)).float()[list(picks)]
            rows = split_microbatch(inputs, 1)
            alone = torch.cat([compute_losses(model, rows[i]).float().reshape(1) for i in picks])
        for module, training in modes:
            module.training = training and not isinstance(module, _DropoutNd)
        # The example compared in train mode: one whose loss is finite, if any.
        row = (
            picks[0]
            if bool(torch.isfinite(together[0])) or not bool(torch.isfinite(together[1]))
            else picks[1]
        )
        in_batch = _seeded_loss(compute_losses, model, dict(inputs), row, context)
        among_copies = _seeded_loss(compute_losses, model, take_examples(inputs, [row] * size), row, context)
    finally:
        for module, training in modes:
            module.training = training
    close = torch.isclose(alone, together, rtol=LOSS_PROBE_RTOL, atol=LOSS_PROBE_ATOL, equal_nan=True)
    if bool(close.all()) and not bool((torch.isfinite(alone) & torch.isfinite(together)).any()):
        return False  # only non-finite losses, equal but telling nothing: check the next micro-batch
    if not bool(close.all()):
        shown = ", ".join(
            f"example {i}: {float(t):.6g} in its micro-batch of {size}, {float(a):.6g} alone"
            for i, t, a in zip(picks, together.tolist(), alone.tolist())
        )
        raise ValueError(
            f"the per-example losses depend on the other examples of their batch ({shown}; model in eval "
            "mode, same padded rows). Then one example changes the others' clipped gradients too, and the "
            "clip bound no longer bounds its influence. Typical causes: a loss divided by the batch's token "
            "count or size, in-batch negatives, batch statistics, MoE routing with an expert capacity. Make "
            "each example's loss a function of that example alone (per_example_loss_fn)."
        )
    if not bool(
        torch.isclose(among_copies, in_batch, rtol=LOSS_PROBE_RTOL, atol=LOSS_PROBE_ATOL, equal_nan=True)
    ):
        raise ValueError(
            f"in train mode the per-example losses depend on the other examples of their batch (example {row}: "
            f"{float(in_batch):.6g} in its micro-batch of {size}, {float(among_copies):.6g} in a micro-batch of "
            f"{size} copies of itself; dropout off, same random draws; in eval mode it does not). Some layer looks "
            "at the whole batch only when training (batch centering or normalization written as tensor ops, an "
            "MoE router's train-only expert capacity or token dropping, ...), so one example changes the others' "
            "clipped gradients and the clip bound no longer bounds its influence. Make every layer act on each "
            "example alone in train mode too (e.g. no capacity limit, or LayerNorm/GroupNorm for batch "
            "statistics)."
        )
    return True


def _seeded_loss(
    compute_losses: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
    model: nn.Module,
    inputs: dict[str, Any],
    row: int,
    context: Callable[[], Any],
) -> torch.Tensor:
    """Example ``row``'s loss, from a forward whose random draws start at :data:`_PROBE_SEED`.

    The random state is restored afterwards. Two batches of the same shapes then draw the same
    numbers at the same positions (dropout masks, layer drop), so an example's own draws do not depend
    on what the other rows hold.
    """
    devices = cuda_devices(inputs.values())
    with random_state_kept(devices):
        seed_every_generator(devices, _PROBE_SEED)
        with context():
            return compute_losses(model, inputs).float()[row]


def check_layers_follow_the_batch(
    compute_losses: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
    model: nn.Module,
    inputs: Mapping[str, Any],
    context: Callable[[], Any],
    discard: Callable[[], None],
) -> None:
    """Refuse a hooked layer whose input's first dimension is not the batch, before the first backward.

    The per-example hooks take row ``i`` of each hooked layer's input for example ``i``, and refuse
    an input whose first dimension differs from the batch size. A tensor without a batch dimension
    whose first dimension happens to equal the batch size (T5's and MPNet's relative position bias
    ``[T, T]`` when the padded length ``T`` equals the micro-batch size) would pass that check and be
    clipped as examples. So the forward pass (train mode, gradients and hooks on, as in training) runs
    once on 1 and once on 2 rows of this micro-batch: a dimension that does not follow the batch size
    cannot equal both. ``discard()`` then drops what the hooks kept; the random state is restored, so
    dropout draws as if the probe had not run.
    """
    size = batch_size_of(inputs)
    pick = [0, min(1, size - 1)]  # a micro-batch of one: its example twice
    devices = cuda_devices(inputs.values())
    try:
        with random_state_kept(devices), torch.enable_grad(), context():
            for rows in (pick[:1], pick):
                compute_losses(model, take_examples(inputs, rows))
    except PerSampleGradientError as error:
        raise PerSampleGradientError(
            f"{error} (Found before the first step, by running the first micro-batch's first example alone and "
            "the first two together.)"
        ) from error
    finally:
        discard()


def check_gradients_follow_the_examples(
    compute_losses: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
    model: nn.Module,
    inputs: Mapping[str, Any],
    context: Callable[[], Any],
    params: Sequence[torch.Tensor],
    clipping: FastClipping | GradSampleHandle,
) -> bool:
    """Raise ``ValueError`` if the clipping credits one example's gradient to another, before the first step.

    The hooks take row ``i`` of every hooked layer's input and output gradient for example ``i``. A
    forward that moves rows of the batch (``h.flip(0)`` and back, a sort by length, a head that gathers
    the masked positions of the whole flattened batch and reshapes them to ``[b, ...]``) keeps the
    shapes and each example's loss its own, so the other probes pass; but the layers in between then
    credit example ``j``'s share of their gradient to row ``i``. The clipped vector ``w_i`` mixes several
    examples, ``||w_i|| <= C`` no longer bounds any one example's influence, and one example can move
    the update by more than ``C``.

    So this compares, for the first and last examples ``x_0, x_1`` of ``inputs``:

    * the truth: ``g_i = d loss_i / d theta`` by plain autograd with ``clipping``'s hooks off, from a
      2-row batch of copies of ``x_i`` (``x_i`` alone: no other example present);
    * what the clipping attributes: one forward and backward of the pair ``[x_0, x_1]`` with the hooks
      recording, as in training; then the engine's per-example norms ``n_i`` (identity geometry) must be
      ``||g_i||``, and its clipped sum at ``C = min_i ||g_i|| / 2`` (both clipped) must be
      ``sum_i f_i g_i`` with ``f_i = min(1, C / n_i)`` its own factors: a swap of the two examples'
      gradients is caught even where their norms coincide, and each tensor's share names the
      parameters whose attribution differs.

    Both pair passes run in the modes training uses with dropout modules off, and start from the same
    seed: a 2-row batch of the same shapes draws the same random numbers at the same positions
    (functional attention dropout included; torch's, NumPy's and Python's generators all seeded), so
    ``x_i`` gets the same draws in its pair as among its copies. Not where the draws of a row depend on
    the rows before it (wav2vec2's SpecAugment draws each row's spans from NumPy in turn, as many as that
    row's length asks for): so where the copies disagree, the comparison is made once more with the
    truth from the pair itself (``d loss_i / d theta`` by plain autograd on ``[x_0, x_1]``, the same
    draws as the hooked pass), and only a second disagreement refuses. Each loss being a function of its
    own example (the loss probe, run first), that is still ``x_i``'s own gradient; a moved row still
    differs. The random state, every module's mode, each parameter's ``.grad`` and the hooks' on/off
    state are restored, and what the hooks recorded is dropped: training runs as if the probe had not.

    ``clipping`` is the model's :class:`~dp_hf.per_example.ghost.clipping.FastClipping` or Opacus
    :class:`~dp_hf.per_example.opacus_hooks.GradSampleHandle`; ``params`` the trainable tensors the
    optimizer clips. Cost: five forward and backward passes of 2 rows (ten where a second comparison is
    made), once per run (each example's gradient is taken twice, for its norms and then for the sum, so
    that no more than two gradients' worth of memory is held: the clipping's sum and one example's
    gradient). Returns False, having checked nothing, for a micro-batch of fewer than two
    examples, non-finite or all-zero gradients, or nothing recorded (the caller tries the next one);
    True once checked. Packed (padding-free) micro-batches are not probed: their examples are segments
    of one row, recorded per segment. A pair that agrees is not enough (a move only in larger batches or
    for some inputs): :func:`dp_hf.trainer.rows.check_examples_keep_their_rows` then checks every row of
    ``inputs`` (its result is returned).
    """
    size = batch_size_of(inputs)
    if size < 2:
        return False
    picks = [0, size - 1]
    params = list(params)
    modes = [(module, module.training) for module in model.modules()]
    saved_grads = [p.grad for p in params]
    devices = cuda_devices(inputs.values())
    fast = hasattr(clipping, "clipped_sum")

    from_pair = False  # where the truth comes from: copies of each example (first), or the pair itself

    def alone(row: int) -> list[torch.Tensor]:  # example picks[row]'s own gradient (one at a time: memory)
        rows = picks if from_pair else [picks[row], picks[row]]
        return _gradient_alone(
            compute_losses, model, take_examples(inputs, rows), row, params, clipping, context
        )

    try:
        for module, training in modes:
            module.training = training and not isinstance(module, _DropoutNd)
        for from_pair in (False, True):
            with random_state_kept(devices), torch.enable_grad():
                part_norms = []  # [example][tensor] float64 norms of each example's own gradient
                for row in range(len(picks)):
                    part_norms.append(
                        torch.stack(
                            [torch.linalg.vector_norm(g, dtype=torch.float64).cpu() for g in alone(row)]
                        )
                    )
                part_norms = torch.stack(part_norms)
                true_norms = part_norms.square().sum(dim=1).sqrt()
                if not bool(torch.isfinite(true_norms).all()) or not bool((true_norms > 0).any()):
                    return False
                clip = float(true_norms[true_norms > 0].min()) / 2
                for p in params:
                    p.grad = None  # (the fast path checks its hook-mode records against autograd's .grad)
                seed_every_generator(devices, _PROBE_SEED)
                with context():
                    losses = compute_losses(model, take_examples(inputs, picks))
                    rtol = (
                        ATTRIBUTION_PROBE_RTOL
                        if reduced_precision(model, devices)
                        else ATTRIBUTION_PROBE_RTOL_FLOAT32
                    )
                backward_explained(losses.float().sum(), model, opacus=not fast)
                attributed = attributed_clipped_sum(clipping, fast, params, clip)
                clipping.clear()
                for p in params:
                    p.grad = None
                if attributed is None:
                    return False
                sums, norms = attributed
                norms = norms.double().cpu()
                factors = clip_factors(norms, clip).double()
                # sum_i f_i g_i subtracted from the clipping's (fresh, float32) sum in place, one example's
                # gradient at a time: two gradients' worth of memory, the sum and one example's, not four.
                for row in range(len(picks)):
                    own = alone(row)  # (the same seeded forward as the first time: the same gradient)
                    with torch.no_grad():
                        for residual, g in zip(sums, own):
                            residual.sub_(g.to(residual.device, residual.dtype), alpha=float(factors[row]))
                    del own
            errors = [float(r.double().norm()) for r in sums]
            sizes = (factors[:, None] * part_norms).sum(dim=0).tolist()  # sum_i f_i ||g_ik|| per tensor
            figures = (model, params, true_norms, norms, errors, sizes, clip, picks, rtol)
            if _compare_attribution(*figures, refuse=from_pair):
                break  # (the second comparison refuses or breaks)
    finally:
        clipping.clear()  # the records or p.grad_sample of the pair (none left by a failed pass either)
        for p, grad in zip(params, saved_grads):
            p.grad = grad
        for module, training in modes:
            module.training = training
    from dp_hf.trainer.rows import check_examples_keep_their_rows  # (it imports this module)

    return check_examples_keep_their_rows(compute_losses, model, inputs, context, params, clipping)


def reduced_precision(model: nn.Module, devices: list[torch.device]) -> bool:
    """Whether the forward in progress computes below IEEE float32: half-precision weights, autocast, TF32.

    (cuDNN's TF32, on by default, counts for models with convolutions only.)
    """
    if any(p.is_floating_point() and p.element_size() < 4 for p in model.parameters()):
        return True
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        return True
    if not devices:
        return False
    convolutions = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    return (
        torch.get_float32_matmul_precision() != "highest"
        or torch.backends.cuda.matmul.allow_tf32
        or (convolutions and torch.backends.cudnn.allow_tf32)
    )


def _gradient_alone(
    compute_losses: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
    model: nn.Module,
    copies: dict[str, Any],
    row: int,
    params: list[torch.Tensor],
    clipping: FastClipping | GradSampleHandle,
    context: Callable[[], Any],
) -> list[torch.Tensor]:
    """``d loss_row / d params`` (zeros where unused) by plain autograd, the clipping hooks off.

    ``copies`` is a 2-row batch of one example (or the pair itself), whose forward starts at
    :data:`_PROBE_SEED` like the pair's: row ``row`` draws what the example draws at that row of the pair.
    """
    with clipping.hooks_off():
        seed_every_generator(cuda_devices(copies.values()), _PROBE_SEED)
        with context():
            loss = compute_losses(model, copies)[row]
        grads = torch.autograd.grad(loss.float(), params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, params)]


def attributed_clipped_sum(
    clipping: FastClipping | GradSampleHandle, fast: bool, params: list[torch.Tensor], clip: float
) -> tuple[list[torch.Tensor], torch.Tensor] | None:
    """The clipping's ``(per-tensor clipped sums, per-example norms)`` of the pair just back-propagated.

    The fast path clips from its records (:meth:`FastClipping.clipped_sum`); Opacus's hooks left
    ``p.grad_sample``, clipped by :func:`~dp_hf.privatizer.clip_and_sum` as its optimizer does. Both in
    the identity geometry at bound ``clip``. None when nothing was recorded.
    """
    geometry = Geometry(max_grad_norm=clip)
    if fast:
        return clipping.clipped_sum(params, geometry)
    grad_samples = [getattr(p, "grad_sample", None) for p in params]
    grad_samples = [torch.cat(g, dim=0) if isinstance(g, list) else g for g in grad_samples]
    if all(g is None for g in grad_samples):
        return None
    # A use of a parameter outside its module's forward: the step's own check names it (p.grad is the pair's).
    check_complete_grad_samples(SimpleNamespace(param_groups=[]), params, grad_samples)
    with torch.no_grad():
        return clip_and_sum(grad_samples, geometry, [p.shape for p in params])


def _compare_attribution(
    model: nn.Module,
    params: list[torch.Tensor],
    true_norms: torch.Tensor,
    norms: torch.Tensor,
    errors: list[float],
    sizes: list[float],
    clip: float,
    picks: list[int],
    rtol: float,
    refuse: bool = True,
) -> bool:
    """Raise ``ValueError`` where the clipping's norms or clipped sum differ from the examples' own gradients
    (return False instead when not ``refuse``); True where they agree.

    Norms: ``|n_i - ||g_i||| <= rtol ||g_i||``. Sum: with the engine's factors ``f_i``, each tensor's error
    ``||S_k - sum_i f_i g_ik||`` (``errors``) must stay within ``rtol sum_i f_i ||g_ik||`` (``sizes``, the size
    of what is summed), and so must the whole vector's; the figures are given in units of ``C``.
    """
    tiny = 1e-6 * float(true_norms.max())
    norms_ok = bool((torch.abs(norms - true_norms) <= rtol * true_norms + tiny).all())
    error, size = float(torch.tensor(errors).norm()), float(torch.tensor(sizes).norm())
    if norms_ok and error <= rtol * size + tiny * clip:
        return True
    if not refuse:
        return False
    names = {id(p): name for name, p in model.named_parameters()}
    differing = sorted(
        (
            k
            for k in range(len(params))
            if errors[k] > rtol * sizes[k] + tiny * clip and errors[k] > 1e-3 * error
        ),
        key=lambda k: -errors[k],
    )
    shown = ", ".join(
        f"{names.get(id(params[k]), f'tensor {k}')} ({errors[k] / clip:.3g} C off, of {sizes[k] / clip:.3g} C)"
        for k in differing[:5]
    )
    more = f" and {len(differing) - 5} more" if len(differing) > 5 else ""
    figures = "; ".join(
        f"example {i}: norm {float(n):.6g} as clipped, {float(t):.6g} alone"
        for i, n, t in zip(picks, norms.tolist(), true_norms.tolist())
    )
    raise ValueError(
        f"the per-example clipping credits one example's gradient to another ({figures}; clipped sum of the "
        f"two at C = {clip:.6g}: {error / clip:.3g} C away from the sum of their own clipped gradients"
        f"{'; in ' + shown + more if shown else ''}). The hooks take row i of each layer's input and output "
        "gradient as example i's, so a forward that moves rows of the batch (flip or sort along the batch, "
        "gathering positions of the whole flattened batch into new rows, ...) mixes several examples in one "
        "clipped gradient: clipping it to norm C no longer bounds any one example's influence, which can "
        "exceed C. Do not mix batch rows inside forward: keep each row's computation to that row (e.g. "
        "gather per example, keeping the batch dimension), or freeze the layers that see the moved rows."
    )


def backward_explained(loss: torch.Tensor, model: nn.Module, *, opacus: bool) -> None:
    """``loss.backward()``; under Opacus's hooks (``opacus``), a random draw that its vmap fallback cannot
    replay is re-raised with :func:`random_replay_message` (the training step and the probe alike)."""
    try:
        loss.backward()
    except RuntimeError as error:
        if opacus and "vmap: called random operation" in str(error):
            raise RuntimeError(random_replay_message(model)) from error
        raise


def random_replay_message(model: nn.Module) -> str:
    """Why Opacus's vmap fallback failed on a random draw, naming the modules on it (a backward's error)."""
    from dp_hf.per_example.samplers import has_grad_sampler

    names = ", ".join(
        f"{path} ({type(m).__name__})"
        for path, m in model.named_modules()
        if any(p.requires_grad for p in m.parameters(recurse=False)) and not has_grad_sampler(m)
    )
    return (
        "a module without an Opacus grad sampler draws random numbers in its forward (ViTMAE's random "
        "masking, dropout inside it). Opacus's fallback replays such a module's forward once per example "
        "under torch.func.vmap, and a random draw cannot be replayed: this step was not taken. Modules on that "
        f"fallback: {names or 'none'}. Freeze that module's own parameters (requires_grad=False) or register "
        "a grad sampler for it (opacus.grad_sample.register_grad_sampler)."
    )
