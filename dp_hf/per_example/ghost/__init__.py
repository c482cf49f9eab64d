"""Fast per-example clipping: ghost / book-keeping norms and layer-wise materialization.

DP training needs, for every example ``i`` of a micro-batch, the clipped gradient
``wbar_i = w_i * min(1, C / ||w_i||)`` with ``w_i = (g_i - c) / s`` (see
:mod:`dp_hf.privatizer`), summed over the batch. Opacus's hooks materialize every
``g_i`` for every parameter (``[B, *p.shape]``, e.g. ``B x V x H`` for a word embedding)
before :func:`~dp_hf.privatizer.clip_and_sum` reads them. This module gets the same
sum with one ordinary forward pass and **one** backward pass, from what each layer
sees (Bu et al., "book-keeping"; Li et al., "ghost clipping")::

    trainable layer l, example i:  input  a_i  [T, d_in]   (T positions: tokens, patches)
                                   output gradient  g_i  [T, d_out]   (of sum_j loss_j)
    per-example weight gradient:   G_i = g_i^T a_i = sum_t g_{i,t} (x) a_{i,t}

* **Norms without the gradient** (identity geometry ``c = 0``, ``s = 1``)::

      ||G_i||_F^2 = <g_i^T a_i, g_i^T a_i> = sum_{t,t'} (a_i a_i^T)[t,t'] (g_i g_i^T)[t,t']

  costs ``O(T^2 (d_in + d_out))`` per example instead of ``O(T d_in d_out)``. Per
  layer we keep whichever of ``G_i`` (``d_in d_out`` floats per example) and
  ``(a_i, g_i)`` (``T (d_in + d_out)``) is smaller: when ``G_i`` is smaller, it is also
  cheaper to compute than the two Gram matrices, so the rule picks the faster
  *and* the smaller representation (the book-keeping papers' ``2T^2`` vs ``d_in d_out``
  criterion, in storage form). For embeddings, ``G_i`` has one row per distinct
  token ``u`` of example ``i``, ``r_{i,u} = sum_{t: id_t = u} g_{i,t}``, and
  ``||G_i||^2 = sum_u ||r_{i,u}||^2`` is computed from the ``B T`` (example, token)
  keys without the ``V x H`` matrix.
* **Clipped sum without a second backward** (book-keeping): with the factors
  ``f_i = min(1, C / ||w_i||)``, ``sum_i f_i G_i = (f * g)^T a`` is one matrix product
  over all ``B T`` positions (an ``index_add`` of ``f_i g_{i,t}`` into rows ``id_t`` for
  embeddings): exactly the flops of the non-private weight gradient, which the
  backward pass therefore skips (the layers run through autograd functions that
  return only the input gradient).
* **Geometry-aware clipping** (``c``, ``s`` from DP-MacAdam / scale-then-privatize):
  ``||(G_i - c)/s||`` needs the per-example gradients themselves. They are formed
  layer by layer, in chunks of examples bounded by ``chunk_bytes``, and dropped
  after their contribution to the norm; embeddings use the sparse identity
  ``||(G_i - c)/s||^2 = ||c/s||^2 + sum_{u in ids(i)} (||(r_{i,u} - c_u)/s_u||^2 - ||c_u/s_u||^2)``.
  The sum is linear again: ``sum_i f_i w_i = (sum_i f_i G_i - (sum_i f_i) c) / s``.

Supported trainable modules: ``nn.Linear`` (hence PEFT LoRA adapters and
``modules_to_save`` heads) and its plain subclasses (Falcon's ``FalconLinear``), GPT-2's ``Conv1D``, ``nn.Embedding``, ``nn.LayerNorm``,
``nn.Conv2d`` (``groups=1``, zero padding: ViT/DeiT patch projections), the raw
``cls``/``distillation``/``mask`` tokens and position embeddings of ViT/DeiT
embeddings (via :mod:`dp_hf.per_example.samplers`), and heads whose own
parameters are tied aliases of a child's (BERT's MLM bias). Parameters used by
several modules or several times (tied input/output embeddings of GPT-2 and BERT
MLM) are exact: ``||sum_k G^k_i||^2`` includes every cross term ``<G^k_i, G^l_i>``,
computed from the same factors. Broadcast ``[1, T]`` position ids are expanded to
the batch before the lookup (:mod:`dp_hf.per_example.batch`). Any other trainable
module makes :func:`~dp_hf.per_example.ghost.support.unsupported_modules` non-empty; :class:`~dp_hf.DPTrainer` then
falls back to Opacus's hooks (``per_sample_gradient_mode="auto"``).

Use::

    clipping = attach_fast_clipping(model)              # after freezing / PEFT
    losses = per_example_losses(model(**batch))         # [b]
    losses.sum().backward()                             # records, no weight gradients
    clipping.accumulate(optimizer)                      # -> optimizer.accumulate_clipped_sum
    optimizer.step()

Every example of the micro-batch is clipped over all of the optimizer's trainable
tensors; a tensor that got a gradient outside the hooked modules raises instead of
being skipped.

Modules: :mod:`~dp_hf.per_example.ghost.kernels` (outer-product / Gram kernels),
:mod:`~dp_hf.per_example.ghost.functions` (autograd functions, replaced forwards),
:mod:`~dp_hf.per_example.ghost.support` (which modules are handled),
:mod:`~dp_hf.per_example.ghost.records` (what a backward pass records per tensor),
:mod:`~dp_hf.per_example.ghost.norms` (norms and clipped sums from the records),
:mod:`~dp_hf.per_example.ghost.banks` (many layers' ghost norms from one bank of Grams),
:mod:`~dp_hf.per_example.ghost.clipping` (:class:`FastClipping`, the hooks on a model).
"""

from __future__ import annotations

from dp_hf.per_example.ghost.clipping import FastClipping, attach_fast_clipping
from dp_hf.per_example.ghost.norms import clip_factors  # the clipping rule (dp_hf.privatizer's)
from dp_hf.per_example.ghost.support import unsupported_modules  # read by resolve_per_sample_gradient_mode
from dp_hf.per_example.modes import resolve_per_sample_gradient_mode

__all__ = [
    "FastClipping",
    "attach_fast_clipping",
    "clip_factors",
    "resolve_per_sample_gradient_mode",
    "unsupported_modules",
]
