"""A black-box check, once per run, on the whole first micro-batch: no example's gradient lands in another's row.

:func:`dp_hf.trainer.probe.check_gradients_follow_the_examples` compares the clipping with each example's
own gradient for one pair of examples, run as a 2-row batch. A forward that moves rows only in some
batches passes it: a move that happens only above two rows (``if x.shape[0] > 2``), a sort of the batch
by length that the probed pair happens to be in order for, a sub-batch of the "long" examples processed
together only when there are more than two of them. One DP-SGD step at sigma 0 with one example
replaced then moves by up to 1.35x the clip bound (tests/test_probe_evasion_audit.py).

:func:`check_examples_keep_their_rows` looks at every row of the real micro-batch, in the modes
training uses (dropout modules off, the same seeded draws in every pass). The hooks' records are
linear in the output gradient, so back-propagating ``sum_i w_i loss_i`` (``w_i`` 0 or 1) gives row
``j`` the record ``sum_k w_k M_jk``, where ``M_jk`` is the part of example ``k``'s gradient credited to
row ``j``. For an honest model ``M_jk = 0`` for ``k != j``, so a row of weight 0 records exactly zero
(``0 * g`` through every per-row kernel). The passes give each row a distinct half of ``m`` weight
patterns (a Sperner family: ``comb(m, m // 2) >= b``), so for any two rows ``j != k`` some pass weighs
``k`` and not ``j``: any share of ``k``'s gradient in row ``j`` shows as a nonzero norm of a row that
should have none. It must stay below ``rtol`` (the attribution probe's) of that row's norm when
weighted. Cost: ``m`` forward and backward passes of the micro-batch (5 for 8 rows, 8 for 64), once per
run; only the engine's per-example norms are compared, so no extra gradient is held.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd

from dp_hf.batches import batch_size_of, cuda_devices
from dp_hf.random_state import random_state_kept, seed_every_generator
from dp_hf.trainer.probe import (
    ATTRIBUTION_PROBE_RTOL,
    ATTRIBUTION_PROBE_RTOL_FLOAT32,
    attributed_clipped_sum,
    backward_explained,
    reduced_precision,
)

if TYPE_CHECKING:
    from dp_hf.per_example.ghost.clipping import FastClipping
    from dp_hf.per_example.opacus_hooks import GradSampleHandle

__all__ = ["check_examples_keep_their_rows", "weight_patterns"]

#: The seed every pass starts from (their random draws then coincide).
_SEED = 0x120E5


def weight_patterns(size: int) -> torch.Tensor:
    """``[m, size]`` 0/1 weights: row ``j`` is weighed in the passes of its own ``m // 2``-subset of ``m``."""
    m = 2
    while math.comb(m, m // 2) < size:
        m += 1
    codes = list(itertools.islice(itertools.combinations(range(m), m // 2), size))
    weights = torch.zeros(m, size)
    for row, code in enumerate(codes):
        weights[list(code), row] = 1.0
    return weights


def check_examples_keep_their_rows(
    compute_losses: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
    model: nn.Module,
    inputs: Mapping[str, Any],
    context: Callable[[], Any],
    params: Sequence[torch.Tensor],
    clipping: FastClipping | GradSampleHandle,
) -> bool:
    """Raise ``ValueError`` if a row of the clipping records a share of another example's gradient.

    Arguments as :func:`~dp_hf.trainer.probe.check_gradients_follow_the_examples`'s. Returns False, having
    checked nothing, for fewer than two examples, nothing recorded or non-finite norms (the caller tries
    the next micro-batch); True once checked. Modes, ``.grad``, random state and records are restored.
    """
    size = batch_size_of(inputs)
    if size < 2:
        return False
    params = list(params)
    modes = [(module, module.training) for module in model.modules()]
    saved_grads = [p.grad for p in params]
    devices = cuda_devices(inputs.values())
    fast = hasattr(clipping, "clipped_sum")
    patterns = weight_patterns(size)
    norms = []
    try:
        for module, training in modes:
            module.training = training and not isinstance(module, _DropoutNd)
        with random_state_kept(devices), torch.enable_grad():
            for weights in patterns:
                for p in params:
                    p.grad = None
                seed_every_generator(devices, _SEED)
                with context():
                    losses = compute_losses(model, dict(inputs)).float()
                    rtol = (
                        ATTRIBUTION_PROBE_RTOL
                        if reduced_precision(model, devices)
                        else ATTRIBUTION_PROBE_RTOL_FLOAT32
                    )
                keep = (weights > 0).to(losses.device)
                # where(), not a product: a weighed-out row gets an exact zero even where its loss is inf/NaN.
                backward_explained(torch.where(keep, losses, 0.0).sum(), model, opacus=not fast)
                attributed = attributed_clipped_sum(clipping, fast, params, 1.0)
                clipping.clear()
                if attributed is None:
                    return False
                norms.append(attributed[1].double().cpu())
    finally:
        clipping.clear()
        for p, grad in zip(params, saved_grads):
            p.grad = grad
        for module, training in modes:
            module.training = training
    norms = torch.stack(norms)  # [pass, row]
    weighed = patterns > 0
    if not bool(torch.isfinite(norms[weighed]).all()):
        return False  # an example's own gradient is not finite: check the next micro-batch
    own = torch.where(weighed, norms, 0.0).amax(dim=0)  # each row's norm in the passes that weigh it
    leaked = torch.where(weighed, 0.0, norms)  # what rows record in the passes that weigh them out
    tiny = 1e-6 * float(own.max())
    bad = ~(leaked <= rtol * own + tiny)  # (NaN leaked: another row's non-finite gradient)
    if not bool(bad.any()):
        return True
    which, row = (int(i) for i in bad.nonzero()[0])
    others = [k for k in range(size) if patterns[which, k] > 0]
    raise ValueError(
        f"the per-example clipping credits one example's gradient to another: with only examples {others} of a "
        f"micro-batch of {size} weighed in the loss, row {row} (weighed out, {float(own[row]):.6g} when weighed) "
        f"recorded a gradient of norm {float(leaked[which, row]):.6g}. The hooks take row i of each layer's input "
        "and output gradient as example i's, so a forward that moves rows of the batch (flip or sort along the "
        "batch, gathering positions of the whole flattened batch into new rows, only for some batch sizes or "
        "inputs, ...) mixes several examples in one clipped gradient: clipping it to norm C no longer bounds any "
        "one example's influence, which can exceed C. Do not mix batch rows inside forward: keep each row's "
        "computation to that row (e.g. gather per example, keeping the batch dimension), or freeze the layers "
        "that see the moved rows."
    )
