"""Exact per-example gradients for Hugging Face models, built on Opacus's grad-sample hooks.

DP-SGD clips each example's gradient before summing, so it needs ``p.grad_sample[i]``: the gradient
of example ``i``'s own loss term, for every trainable parameter ``p``.  Opacus computes it with a
forward hook (keeps each layer's input activations) and a backward hook (combines them with the
gradient w.r.t. the layer's output).  That is exact only if every trainable layer sees a tensor
whose first dimension *is the batch*, and if Opacus knows how to turn (activations, backprops) into
per-example gradients for the layer's type.  Hugging Face models break both assumptions, often
without any error: Opacus silently produces a batch-summed "per-example" gradient, which is a
privacy bug.  This module fixes or refuses those cases:

* **Broadcast position / token-type ids.**  transformers 5 builds ``position_ids`` as a ``[1, L]``
  tensor (BERT slices a ``[1, max_len]`` buffer, GPT-2 and Llama use ``arange(L).unsqueeze(0)``) and
  lets broadcasting add the ``[1, L, D]`` position embedding to the ``[B, L, D]`` word embedding.
  Opacus then sees a position-embedding layer with batch 1 and its "per-example" gradient is the sum
  over the batch (no error until an optimizer stacks it with ``[B, ...]`` tensors).  Caller-provided
  ``[1, L]`` ids have the same problem; BERT's default ``token_type_ids`` are already ``expand``-ed
  to ``[B, L]``.  Nothing can be done after the lookup (the broadcast already summed the
  backprops), so a forward pre-hook on every trainable ``nn.Embedding`` expands a batch-1 index
  tensor to the model's batch size ``B`` *before* the lookup.  The values are unchanged (the rows
  are what broadcasting would have produced) but autograd now delivers one backprop row per example.
  ``B`` comes from a forward pre-hook on the top-level model and on every submodule whose ``forward``
  takes ``input_ids``/``inputs_embeds``/``pixel_values``/... (so it still works when PEFT or a
  Trainer calls an inner model).  This is family-agnostic: we never re-derive ids ourselves, so
  RoBERTa's per-example, padding-aware position ids (already ``[B, L]``) pass through untouched.
  The same pre-hook checks that *every* trainable module sees a batch of ``B`` and raises
  :class:`PerSampleGradientError` otherwise (e.g. multiple-choice heads that fold choices into the
  batch, MoE routers that flatten tokens), because Opacus would then treat rows as examples.
* **Raw ``nn.Parameter`` s in ViT/DeiT embeddings.**  ``ViTEmbeddings``/``DeiTEmbeddings`` own
  ``cls_token``, ``position_embeddings`` (DeiT also ``distillation_token``) and optionally
  ``mask_token``.  Opacus has no grad sampler for them and falls back to
  ``opacus.grad_sample.functorch``: it re-runs the *whole* embeddings module (patch projection
  included; it does not double count because Opacus then does not hook the children) under
  ``vmap`` from its first positional input only.  Keyword inputs are dropped, so ``bool_masked_pos``
  is ignored (the mask token's per-example gradient silently becomes zero) and
  ``interpolate_pos_encoding`` breaks, and any embedding dropout makes ``vmap`` fail.  We register
  exact grad samplers (:func:`opacus.grad_sample.register_grad_sampler`) that compute only the
  module's *direct* parameters from the output backprops; the patch ``Conv2d`` then gets Opacus's
  own conv sampler.  See :func:`_patch_embedding_grad_sample` for the formulas.
* **Embedding ``padding_idx``.**  PyTorch never gives the ``padding_idx`` row a gradient, but
  Opacus's embedding sampler scatters backprops into it.  Our hooks use an embedding sampler that
  zeroes that row, so ``sum_i grad_sample[i] == grad`` holds exactly.  (Scoped to modules attached
  here via a subclass, so other Opacus users in the process are not affected.)
* **Tied LM-head biases.**  ``BertLMPredictionHead`` (and similar heads) own ``bias`` but use it
  only as ``decoder.bias`` (the same tensor).  Opacus would replay the whole head with ``vmap``,
  which fails on the tie; we hook the children instead (see ``_HFGradSampleModule``).
* **Modules Opacus cannot handle** (BatchNorm in training mode, trainable modules with buffers,
  bare ``ParameterDict`` s, active dropout inside a module Opacus would re-run with ``vmap``...) are
  refused up front by :func:`validate_model` with an :class:`UnsupportedModuleError` naming the
  module path and type.

Typical use::

    handle = attach_grad_sample(model)          # ``model`` itself is unchanged and still used
    loss = per_example_losses.sum()             # loss_reduction="sum": a SUM over examples
    loss.backward()
    grads = handle.per_sample_gradients()       # {name: [B, *p.shape]}
    ...
    handle.clear()                              # before the next micro-batch (or see below)
    handle.remove()                             # when done; model is back to plain PyTorch

Accumulation: when ``backward`` runs several times without clearing, Opacus stores a *list* of
``[B_k, ...]`` tensors in ``p.grad_sample`` (one per backward).  :func:`per_sample_gradients`
concatenates that list along the batch dimension, i.e. it treats each backward as a micro-batch of
*different* examples; consumers reading ``p.grad_sample`` directly must ``torch.cat`` it themselves
or call :func:`clear_grad_sample` between micro-batches.  Running two backward passes over the
*same* examples (e.g. two losses) therefore requires summing the two losses before one backward.

Attach *after* freezing parameters and applying PEFT: the hooked set of trainable parameters is
fixed at attach time (a forward pass with a different set raises), and ``copy.deepcopy`` of a
hooked module (PEFT's ``modules_to_save``) copies the hooks too (refused by :func:`validate_model`).

Not supported: gradient checkpointing (refused), per-example losses that mix examples (in-batch
negatives), parameters read outside their module's ``forward`` (e.g. ``F.linear(x,
self.child.weight)`` in a parent: Opacus's hooks cannot see that use, so ``p.grad_sample`` would
silently miss part of the gradient; the dp_hf optimizers refuse it in ``clip_and_accumulate`` by
checking ``sum_i grad_sample[i] == p.grad``, and ``per_sample_gradients(model, check_sums=True)``
checks the same for other consumers), and trainable layers whose input's first dimension is not
the batch, e.g. T5's ``relative_attention_bias`` (refused at run time unless that dimension
happens to equal the batch size, so freeze such layers).  Opacus's hooks only fire in training
mode with grad enabled.
"""

from __future__ import annotations

import inspect
import warnings
from collections import ChainMap
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from opacus.grad_sample import GradSampleModule, register_grad_sampler
from opacus.grad_sample.embedding import compute_embedding_grad_sample
from opacus.grad_sample.grad_sample_module import GradSampleHooks
from opacus.grad_sample.gsm_base import AbstractGradSampleHooks
from opacus.layers.dp_rnn import DPGRU, DPLSTM, DPRNN
from opacus.validators import ModuleValidator
from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = [
    "BATCH_INPUT_NAMES",
    "GradSampleHandle",
    "PatchEmbeddingLayout",
    "PerSampleGradientError",
    "UnsupportedModuleError",
    "attach_grad_sample",
    "clear_grad_sample",
    "hooked_parameter_name",
    "make_private_model",
    "per_sample_gradients",
    "register_patch_embedding_grad_sampler",
    "validate_model",
]

#: Names of ``forward`` arguments whose first dimension is the batch.  A pre-hook on every module
#: whose ``forward`` takes one of them records the batch size ``B`` of the current forward pass.
BATCH_INPUT_NAMES: tuple[str, ...] = (
    "input_ids",
    "inputs_embeds",
    "pixel_values",
    "input_values",
    "input_features",
)

_FULL_BACKWARD_HOOK_WARNING = (
    "Full backward hook is firing when gradients are computed with respect to module outputs since no inputs "
    "require gradients"
)

# Attributes that Opacus and this module leave on submodules during a forward/backward pass.
_MODULE_STATE_ATTRIBUTES = ("activations", "max_batch_len", "_dp_hf_patch_embedding_calls")

# Trainable parameter -> its name in the attached model, for error messages of consumers that see
# only tensors (the DP optimizers). Weak keys: nothing is stored on the parameters themselves.
_PARAMETER_NAMES: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def hooked_parameter_name(parameter: torch.Tensor) -> str | None:
    """Name of ``parameter`` in the model it was attached with by :func:`attach_grad_sample` (or None)."""
    return _PARAMETER_NAMES.get(parameter)


class UnsupportedModuleError(ValueError):
    """The model contains a module for which exact per-example gradients cannot be computed.

    ``problems`` lists ``(module_path, module_type_name, reason)`` for every offending module, so
    callers can report all of them at once instead of fixing one per run.
    """

    def __init__(self, problems: list[tuple[str, str, str]]):
        self.problems = problems
        lines = [f"  - {path or '<root>'} ({type_name}): {reason}" for path, type_name, reason in problems]
        super().__init__(
            "dp_hf cannot compute exact per-example gradients for this model:\n" + "\n".join(lines)
        )


class PerSampleGradientError(RuntimeError):
    """Per-example gradients would be wrong for this forward/backward pass (detected at run time)."""


# --------------------------------------------------------------------------------------------------
# Grad samplers
# --------------------------------------------------------------------------------------------------


def _embedding_grad_sample_without_padding_row(
    layer: nn.Embedding, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Opacus's embedding sampler, with the ``padding_idx`` row zeroed as autograd does.

    ``F.embedding`` never propagates gradient into ``weight[padding_idx]``; Opacus scatters the
    backprops of padding positions into that row anyway.  Usually those backprops are zero (padding
    is masked out of attention and ignored by the loss), but not always, and then the per-example
    gradients would not sum to ``p.grad``.
    """
    grad_samples = compute_embedding_grad_sample(layer, activations, backprops)
    if layer.padding_idx is not None and layer.weight in grad_samples:
        grad_samples[layer.weight][:, layer.padding_idx] = 0
    return grad_samples


@dataclass(frozen=True)
class PatchEmbeddingLayout:
    """Where the raw parameters of a ViT-style embeddings module live and how they are combined.

    The module's forward must compute, for ``pixel_values`` of shape ``[B, C, H, W]``::

        patches = patch_embeddings(pixel_values)                          # [B, N, D]
        patches = patches * (1 - mask) + mask_token * mask                # only if bool_masked_pos
        x = cat([tok.expand(B, -1, -1) for tok in special_tokens] + [patches], dim=1)
        x = x + position_embeddings           # or + interpolate_pos_encoding(x, H, W)
        return dropout(x)

    which is what ``ViTEmbeddings`` and ``DeiTEmbeddings`` do.
    """

    special_tokens: tuple[str, ...]
    position_embeddings: str = "position_embeddings"
    mask_token: str | None = "mask_token"
    dropout: str | None = "dropout"


@dataclass
class _PatchEmbeddingCall:
    """Keyword inputs of one ``forward`` call that Opacus's positional-only capture would lose."""

    bool_masked_pos: torch.Tensor | None
    interpolate_pos_encoding: bool
    height: int
    width: int


_PATCH_EMBEDDING_LAYOUTS: dict[type[nn.Module], PatchEmbeddingLayout] = {}


def _patch_embedding_grad_sample(
    module: nn.Module, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-example gradients of the *direct* parameters of a ViT-style embeddings module.

    ``backprops`` ``g`` has shape ``[B, S + N, D]`` (``S`` special tokens, ``N`` patches) and is
    the gradient w.r.t. the module output, which equals the gradient w.r.t. ``x`` before dropout
    because :func:`validate_model` refuses active embedding dropout.  Then, per example ``i``:

    * special token ``k`` (cls, distillation): it is expanded to every example and concatenated at
      position ``k``, so its gradient is ``g[i, k]``;
    * position embeddings: added to every example, so the gradient is ``g[i]`` (with interpolation
      it is the vector-Jacobian product of the interpolation with ``g[i]``);
    * mask token: it replaces the masked patches, so the gradient is
      ``sum_j mask[i, j] * g[i, S + j]``.

    The children (the patch projection ``Conv2d``) are hooked by Opacus separately, and are not
    returned here, so nothing is counted twice.
    """
    layout = _PATCH_EMBEDDING_LAYOUTS[type(module)]
    batch_size = backprops.shape[0]
    num_special = len(layout.special_tokens)
    call = _pop_patch_embedding_call(module, layout, activations, backprops)
    grad_samples: dict[nn.Parameter, torch.Tensor] = {}

    for position, name in enumerate(layout.special_tokens):
        token = getattr(module, name)
        if token is not None and token.requires_grad:
            grad_samples[token] = backprops[:, position].reshape(batch_size, *token.shape).clone()

    position_embeddings = getattr(module, layout.position_embeddings)
    if position_embeddings is not None and position_embeddings.requires_grad:
        if call.interpolate_pos_encoding:
            grad_samples[position_embeddings] = _interpolated_position_grad_sample(module, call, backprops)
        else:
            grad_samples[position_embeddings] = backprops.reshape(batch_size, *position_embeddings.shape)

    mask_token = getattr(module, layout.mask_token, None) if layout.mask_token else None
    if mask_token is not None and mask_token.requires_grad:
        if call.bool_masked_pos is None:
            grad_samples[mask_token] = backprops.new_zeros(batch_size, *mask_token.shape)
        else:
            mask = call.bool_masked_pos.to(backprops.dtype).unsqueeze(-1)  # [B, N, 1]
            masked_sum = (backprops[:, num_special:] * mask).sum(dim=1)  # [B, D]
            grad_samples[mask_token] = masked_sum.reshape(batch_size, *mask_token.shape)
    return grad_samples


def _pop_patch_embedding_call(
    module: nn.Module, layout: PatchEmbeddingLayout, activations: list[torch.Tensor], backprops: torch.Tensor
) -> _PatchEmbeddingCall:
    """The recorded keyword inputs of the call being back-propagated (LIFO, like Opacus's activations).

    When the model was hooked by plain Opacus (e.g. ``PrivacyEngine``) rather than by
    :func:`attach_grad_sample`, nothing was recorded.  The call is then reconstructed from shapes
    where that is unambiguous: a square input at the configured resolution gives the same output
    with or without ``interpolate_pos_encoding``; a masked call cannot be recognised, so a
    trainable mask token makes that situation an error rather than a silent zero gradient.
    """
    recorded_calls = getattr(module, "_dp_hf_patch_embedding_calls", None)
    if recorded_calls:
        return recorded_calls.pop()
    pixel_values = activations[0]
    height, width = int(pixel_values.shape[-2]), int(pixel_values.shape[-1])
    mask_token = getattr(module, layout.mask_token, None) if layout.mask_token else None
    position_embeddings = getattr(module, layout.position_embeddings)
    same_grid = backprops.shape[1] == position_embeddings.shape[1]
    if (mask_token is not None and mask_token.requires_grad) or not (same_grid and height == width):
        raise PerSampleGradientError(
            f"{type(module).__name__} was back-propagated without its call being recorded; attach the "
            "model with dp_hf.grad_sample.attach_grad_sample() so that bool_masked_pos and "
            "interpolate_pos_encoding are taken into account."
        )
    return _PatchEmbeddingCall(None, False, height, width)


def _interpolated_position_grad_sample(
    module: nn.Module, call: _PatchEmbeddingCall, backprops: torch.Tensor
) -> torch.Tensor:
    """Per-example VJP of the module's own (linear, bicubic) position-embedding interpolation.

    Reusing ``module.interpolate_pos_encoding`` instead of re-implementing it keeps us exact for
    whatever the installed transformers version does.  We are inside a backward hook, where grad
    mode is off, hence ``enable_grad``; the small graph is independent of the model's graph.
    """
    position_embeddings = getattr(module, _PATCH_EMBEDDING_LAYOUTS[type(module)].position_embeddings)
    template = backprops.new_zeros(1, *backprops.shape[1:])
    with torch.enable_grad():
        interpolated = module.interpolate_pos_encoding(template, call.height, call.width)
        if interpolated is position_embeddings:  # same grid: the method returns the parameter itself
            return backprops.reshape(backprops.shape[0], *position_embeddings.shape)
        per_example = [
            torch.autograd.grad(
                interpolated, position_embeddings, grad_outputs=row.unsqueeze(0), retain_graph=True
            )[0]
            for row in backprops
        ]
    return torch.stack(per_example)


def register_patch_embedding_grad_sampler(
    module_class: type[nn.Module], layout: PatchEmbeddingLayout
) -> None:
    """Register :func:`_patch_embedding_grad_sample` with Opacus for another ViT-style embeddings class.

    Only do this for classes whose ``forward`` matches :class:`PatchEmbeddingLayout` exactly, and
    add a per-example test against a loop over single examples (see tests/test_grad_sample.py).
    Registration is global (Opacus keeps one registry), which is what we want here: these classes
    have no Opacus sampler, and the default functorch fallback is wrong for masked inputs.
    """
    _PATCH_EMBEDDING_LAYOUTS[module_class] = layout
    register_grad_sampler(module_class)(_patch_embedding_grad_sample)


def _register_transformers_patch_embeddings() -> None:
    try:
        from transformers.models.vit.modeling_vit import ViTEmbeddings
    except ImportError:  # pragma: no cover - depends on the installed transformers
        pass
    else:
        register_patch_embedding_grad_sampler(
            ViTEmbeddings, PatchEmbeddingLayout(special_tokens=("cls_token",))
        )
    try:
        from transformers.models.deit.modeling_deit import DeiTEmbeddings
    except ImportError:  # pragma: no cover - depends on the installed transformers
        pass
    else:
        register_patch_embedding_grad_sampler(
            DeiTEmbeddings, PatchEmbeddingLayout(special_tokens=("cls_token", "distillation_token"))
        )


_register_transformers_patch_embeddings()

# Samplers used only by modules attached through this file (see _HFGradSampleModule).
_LOCAL_GRAD_SAMPLERS: dict[type[nn.Module], Callable[..., dict[nn.Parameter, torch.Tensor]]] = {
    nn.Embedding: _embedding_grad_sample_without_padding_row,
}


class _HFGradSampleModule(GradSampleModule):
    """Opacus's ``GradSampleModule`` with our local samplers layered over Opacus's global registry.

    ``ChainMap`` looks up our overrides first and then Opacus's live registry, so samplers that
    anyone registers later are still seen, while the override of ``nn.Embedding`` stays local.
    """

    GRAD_SAMPLERS = ChainMap(_LOCAL_GRAD_SAMPLERS, GradSampleHooks.GRAD_SAMPLERS)

    def iterate_submodules(self, module: nn.Module) -> Iterator[nn.Module]:
        """Opacus's traversal, except that modules whose own parameters are tied aliases are skipped.

        ``BertLMPredictionHead`` owns ``bias`` but only uses it as ``decoder.bias`` (the same
        tensor).  Opacus would hook the head, find no grad sampler, and replay the whole head with
        ``vmap`` (which fails on tied parameters).  The child ``decoder`` already accounts for every
        use of the tensor, so we hook the children instead; see :func:`_only_aliases_descendant_parameters`.
        """
        owns_trainable = any(p.requires_grad for p in module.parameters(recurse=False))
        if owns_trainable and _only_aliases_descendant_parameters(module):
            for child in module.children():
                yield from self.iterate_submodules(child)
            return
        if owns_trainable:
            yield module
            if type(module) not in self.GRAD_SAMPLERS and type(module) not in (DPRNN, DPLSTM, DPGRU):
                return  # handled as a whole by Opacus's functorch fallback
        for child in module.children():
            yield from self.iterate_submodules(child)


def _only_aliases_descendant_parameters(module: nn.Module) -> bool:
    """Whether every trainable parameter ``module`` owns is also owned by one of its descendants.

    That is how transformers ties an LM head's ``bias`` to ``decoder.bias``.  Such a module is not
    hooked: its forward is assumed to use the tensor only through the descendant (true for the
    tied heads in transformers); :func:`per_sample_gradients` with ``check_sums=True`` verifies it.
    """
    owned = [p for p in module.parameters(recurse=False) if p.requires_grad]
    if not owned:
        return False
    descendants = {id(p) for child in module.children() for p in child.parameters()}
    return all(id(p) in descendants for p in owned)


def _has_grad_sampler(module: nn.Module) -> bool:
    return type(module) in _HFGradSampleModule.GRAD_SAMPLERS


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _direct_trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def _active_dropouts(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, submodule in module.named_modules():
        if isinstance(submodule, nn.modules.dropout._DropoutNd) and submodule.training and submodule.p > 0:
            yield name, submodule


def _module_problems(path: str, module: nn.Module) -> list[str]:
    """Reasons why ``module`` (at ``path``) makes exact per-example gradients impossible."""
    problems: list[str] = []
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
        problems.append(
            "BatchNorm in training mode normalises each example with statistics of the whole batch, so "
            "one example's output (and every gradient upstream) depends on the others and no per-example "
            "gradient exists. Replace it with GroupNorm/LayerNorm, e.g. "
            "`model = opacus.validators.ModuleValidator.fix(model)`, or freeze it and put it in eval mode."
        )
    trainable = _direct_trainable_parameters(module)
    if not trainable:
        return problems  # frozen modules never receive per-example gradients: any type is fine
    if _only_aliases_descendant_parameters(module):
        return problems  # tied aliases: the descendant owning the same tensor is checked instead

    if type(module) in ModuleValidator.VALIDATORS and not isinstance(module, nn.modules.batchnorm._BatchNorm):
        opacus_errors = ModuleValidator.VALIDATORS[type(module)](module)
        if opacus_errors:
            problems.append(
                "Opacus's ModuleValidator rejects this trainable layer type "
                f"({type(opacus_errors[0]).__name__}); replace it with its DP-compatible equivalent, e.g. "
                "`model = opacus.validators.ModuleValidator.fix(model)`, or freeze it."
            )
    buffer_names = [name for name, _ in module.named_buffers()]
    if buffer_names:
        problems.append(
            f"it has trainable parameters and buffers ({', '.join(buffer_names[:4])}); Opacus cannot "
            "compute per-example gradients for it (and buffers such as running statistics are not private). "
            "Freeze it or replace it."
        )
    if isinstance(module, nn.Embedding) and (module.sparse or module.scale_grad_by_freq):
        problems.append(
            "a trainable nn.Embedding with sparse=True or scale_grad_by_freq=True has batch-dependent "
            "gradients; create it with sparse=False, scale_grad_by_freq=False."
        )

    if type(module) in _PATCH_EMBEDDING_LAYOUTS:
        layout = _PATCH_EMBEDDING_LAYOUTS[type(module)]
        dropout = getattr(module, layout.dropout, None) if layout.dropout else None
        if dropout is not None and dropout.training and getattr(dropout, "p", 0.0) > 0:
            problems.append(
                f"its dropout (p={dropout.p}) is applied after the cls/position tokens are added, so the "
                "output gradient Opacus sees is masked by an unknown dropout mask. Set "
                f"`{(path + '.') if path else ''}{layout.dropout}.p = 0.0` (or hidden_dropout_prob=0 in "
                "the config), or freeze its cls/position parameters."
            )
    elif not _has_grad_sampler(module):
        # Opacus falls back to re-running this module's forward under torch.func.vmap with only its
        # first positional input (opacus.grad_sample.functorch). That is exact for deterministic
        # modules such as LlamaRMSNorm or GPT-2's Conv1D; we refuse the cases where it cannot be.
        if type(module).forward is nn.Module.forward:
            problems.append(
                "it owns trainable parameters but has no forward (e.g. ParameterDict/ParameterList): the "
                "parent reads them directly, so no hook can see how each example uses them and there is no "
                "grad sampler for it. Wrap them in a module whose forward uses them, and register an Opacus "
                "grad sampler (opacus.grad_sample.register_grad_sampler) for it."
            )
        else:
            dropouts = [name for name, _ in _active_dropouts(module)]
            if dropouts:
                problems.append(
                    "it has no Opacus grad sampler, and the generic fallback re-runs its forward per example, "
                    f"which cannot reproduce the dropout masks of {', '.join(dropouts)}. Register a grad "
                    "sampler for it, set those dropout probabilities to 0, or freeze it."
                )
    return problems


def _has_opacus_hooks(module: nn.Module) -> bool:
    """Whether ``module`` carries hooks owned by an Opacus grad-sample object.

    Besides a second attach, this catches hooks *copied* with a module: ``copy.deepcopy`` (used by
    PEFT for ``modules_to_save``) duplicates the hook dictionaries together with a copy of the
    Opacus object, and those stale hooks would add a second per-example gradient.
    """
    hooks = [*module._forward_hooks.values(), *module._backward_hooks.values()]
    for hook in hooks:
        owner = getattr(hook, "__self__", None) or getattr(getattr(hook, "func", None), "__self__", None)
        if isinstance(owner, AbstractGradSampleHooks):
            return True
    return False


def validate_model(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModuleError` if exact per-example gradients are impossible for ``model``.

    Checks every submodule (error lists all offenders, with their dotted path and type):

    * BatchNorm (``nn.BatchNorm1d/2d/3d``, ``SyncBatchNorm``, lazy variants) in training mode,
      trainable or not, because batch statistics mix the examples of a batch;
    * trainable modules (own parameters with ``requires_grad``) we cannot handle: types Opacus's
      ``ModuleValidator`` rejects (LSTM/GRU/MultiheadAttention/InstanceNorm with running stats),
      modules with buffers, sparse or frequency-scaled embeddings, parameter containers without a
      forward, ViT-style embeddings with active embedding dropout, and modules without a grad
      sampler whose subtree has active dropout (the vmap fallback cannot replay it);
    * gradient checkpointing, whose recomputed forward would be recorded twice;
    * Opacus hooks already present (attached twice, or copied along with a module).

    Frozen modules are fine whatever their type.  Runtime conditions that cannot be seen from the
    module tree (wrong batch dimension, keyword inputs to a fallback module) are checked by the
    hooks of :func:`attach_grad_sample` and raise :class:`PerSampleGradientError`/
    :class:`UnsupportedModuleError` during the forward pass.
    """
    problems: list[tuple[str, str, str]] = []
    for path, module in model.named_modules():
        for reason in _module_problems(path, module):
            problems.append((path, type(module).__name__, reason))
        if _has_opacus_hooks(module):
            problems.append(
                (
                    path,
                    type(module).__name__,
                    "it already carries Opacus grad-sample hooks: the model is attached already, or this "
                    "module was copied from an attached model (e.g. PEFT's modules_to_save when "
                    "get_peft_model() ran after attaching). Remove the existing handle, or rebuild the model "
                    "and attach once, after wrapping and freezing.",
                )
            )
        if getattr(module, "gradient_checkpointing", False) is True:
            problems.append(
                (
                    path,
                    type(module).__name__,
                    "gradient checkpointing is enabled: the recomputed forward would record activations a "
                    "second time. Call model.gradient_checkpointing_disable().",
                )
            )
    if problems:
        raise UnsupportedModuleError(problems)


# --------------------------------------------------------------------------------------------------
# Reading and clearing per-example gradients
# --------------------------------------------------------------------------------------------------


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
    for module in model.modules():
        for attribute in _MODULE_STATE_ATTRIBUTES:
            if attribute in module.__dict__:
                delattr(module, attribute)


# --------------------------------------------------------------------------------------------------
# Attaching hooks
# --------------------------------------------------------------------------------------------------


def _batch_input_positions(module: nn.Module) -> dict[str, int | None]:
    """For each name in BATCH_INPUT_NAMES that ``module.forward`` takes: its positional index (or None)."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    positions: dict[str, int | None] = {}
    for index, parameter in enumerate(parameters):
        if parameter.name in BATCH_INPUT_NAMES:
            positional = parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
            positions[parameter.name] = index if positional else None
    return positions


@dataclass
class _ForwardBatch:
    """Batch size of the forward pass in progress, as seen by the outermost module that knows it."""

    frames: list[tuple[nn.Module, int | None]] = field(default_factory=list)

    @property
    def batch_size(self) -> int | None:
        for _, size in self.frames:
            if size is not None:
                return size
        return None


@dataclass(repr=False, eq=False)
class GradSampleHandle:
    """Hooks attached to ``model`` by :func:`attach_grad_sample`; ``model`` itself is not wrapped.

    Opacus registers its hooks on the submodules, so calling ``model`` (or a PEFT/Trainer wrapper
    around it) fires them; ``grad_sample_module`` is the Opacus object that owns them (also usable
    as a module: ``grad_sample_module(**batch)`` calls ``model``).  Use the handle to turn the hooks
    off and on, read or clear per-example gradients, and :meth:`remove` everything.  It is also a
    context manager that removes the hooks on exit.
    """

    model: nn.Module
    grad_sample_module: GradSampleModule
    module_paths: dict[int, str]
    _hook_handles: list[RemovableHandle] = field(default_factory=list)
    _forward_batch: _ForwardBatch = field(default_factory=_ForwardBatch)
    _removed: bool = False

    def __repr__(self) -> str:
        state = "removed" if self._removed else f"hooks_enabled={self.grad_sample_module.hooks_enabled}"
        num_trainable = sum(1 for p in self.model.parameters() if p.requires_grad)
        return f"GradSampleHandle({type(self.model).__name__}, {num_trainable} trainable tensors, {state})"

    @property
    def hooks_enabled(self) -> bool:
        return not self._removed and self.grad_sample_module.hooks_enabled

    def disable_hooks(self) -> None:
        """Stop computing per-example gradients (e.g. for evaluation or a non-private warm-up)."""
        self.grad_sample_module.disable_hooks()

    def enable_hooks(self) -> None:
        """Resume computing per-example gradients after :meth:`disable_hooks`."""
        if self._removed:
            raise RuntimeError("the hooks were removed; call attach_grad_sample(model) again")
        self.grad_sample_module.enable_hooks()

    def per_sample_gradients(
        self, *, strict: bool = True, check_sums: bool = False
    ) -> dict[str, torch.Tensor]:
        """See :func:`per_sample_gradients`."""
        return per_sample_gradients(self.model, strict=strict, check_sums=check_sums)

    def clear(self) -> None:
        """See :func:`clear_grad_sample`."""
        clear_grad_sample(self.model)

    def remove(self) -> None:
        """Remove every hook and every attribute added to the model and its parameters.

        Autograd graphs built before this call keep references to the hooks; they are disabled
        first, so a late ``backward`` on such a graph computes no per-example gradients.
        """
        if self._removed:
            return
        self.grad_sample_module.disable_hooks()
        while self._hook_handles:
            self._hook_handles.pop().remove()
        self.grad_sample_module.cleanup()  # Opacus hooks + grad_sample/_forward_counter attributes
        for parameter in self.model.parameters():
            _PARAMETER_NAMES.pop(parameter, None)
        for module in self.model.modules():
            for attribute in _MODULE_STATE_ATTRIBUTES:
                if attribute in module.__dict__:
                    delattr(module, attribute)
        self._removed = True

    def __enter__(self) -> GradSampleHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    # -- hooks -------------------------------------------------------------------------------------

    def _records(self, module: nn.Module) -> bool:
        """Whether Opacus's forward hook will record this call (mirrors its own conditions)."""
        return (
            self.grad_sample_module.hooks_enabled
            and module.training
            and torch.is_grad_enabled()
            and any(p.requires_grad for p in module.parameters(recurse=False))
        )

    def _register(self, handle: RemovableHandle) -> None:
        self._hook_handles.append(handle)

    def _install_batch_size_recorder(self, module: nn.Module, *, is_root: bool) -> None:
        positions = _batch_input_positions(module)
        if not positions and not is_root:
            return
        path = self.module_paths.get(id(module), "")
        forward_batch = self._forward_batch

        def record_batch_size(module: nn.Module, args: tuple, kwargs: dict) -> None:
            size = _batch_size_of_call(positions, args, kwargs, positional_fallback=is_root)
            outer = forward_batch.batch_size
            forward_batch.frames.append((module, size))  # pushed before raising: popped by the post-hook
            if (
                size is not None
                and outer is not None
                and size != outer
                and self.grad_sample_module.hooks_enabled
            ):
                raise PerSampleGradientError(
                    f"{path or '<root>'} ({type(module).__name__}) was called with batch size {size} inside a "
                    f"forward pass of batch size {outer}: the model reshapes examples into several rows (e.g. "
                    "multiple-choice heads), so per-row gradients would not be per-example gradients."
                )

        def forget_batch_size(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if forward_batch.frames and forward_batch.frames[-1][0] is module:
                forward_batch.frames.pop()

        self._register(module.register_forward_pre_hook(record_batch_size, with_kwargs=True))
        self._register(module.register_forward_hook(forget_batch_size, with_kwargs=True, always_call=True))

    def _install_trainable_set_check(self) -> None:
        """Refuse to run once the set of trainable parameters differs from the one hooked.

        Opacus decides which modules to hook, and initialises per-parameter counters, at attach
        time.  Parameters unfrozen later (or adapters injected by ``get_peft_model`` after
        attaching) would get no per-example gradients, and frozen ones would keep stale state.
        """
        hooked = frozenset(id(p) for p in self.model.parameters() if p.requires_grad)
        model = self.model

        def check_trainable_set(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not (self.grad_sample_module.hooks_enabled and model.training and torch.is_grad_enabled()):
                return
            current = frozenset(id(p) for p in model.parameters() if p.requires_grad)
            if current != hooked:
                raise PerSampleGradientError(
                    f"the trainable parameters of the model changed since attach_grad_sample() "
                    f"({len(current - hooked)} added, {len(hooked - current)} no longer trainable). Freeze or "
                    "unfreeze parameters and apply PEFT *before* attaching; call handle.remove() and "
                    "attach_grad_sample() again after any change."
                )

        self._register(model.register_forward_pre_hook(check_trainable_set, with_kwargs=True))

    def _install_input_check(self, module: nn.Module) -> None:
        """Pre-hook on a module Opacus hooks: fix broadcast embedding ids, refuse wrong batch dims."""
        path = self.module_paths.get(id(module), "")
        uses_vmap_fallback = not _has_grad_sampler(module)
        signature = _safe_signature(module)

        def check_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if not self._records(module):
                return None
            where = f"{path or '<root>'} ({type(module).__name__})"
            if not args:
                raise UnsupportedModuleError(
                    [
                        (
                            path,
                            type(module).__name__,
                            "called with keyword arguments only; Opacus records "
                            "positional inputs only, so it cannot compute per-example gradients for this call.",
                        )
                    ]
                )
            if uses_vmap_fallback:
                _check_vmap_fallback_call(path, module, signature, args, kwargs)
            batch_size = self._forward_batch.batch_size
            last_input = args[-1]  # Opacus infers a module's batch size from its last positional input
            if batch_size is None or not isinstance(last_input, torch.Tensor) or last_input.dim() == 0:
                return None
            if last_input.shape[0] == batch_size:
                return None
            if isinstance(module, nn.Embedding) and last_input.shape[0] == 1 and len(args) == 1:
                # Broadcast ids (position_ids / token_type_ids of shape [1, L]): materialise them per
                # example so that autograd keeps one backprop row per example.  Same values.
                return (last_input.expand(batch_size, *last_input.shape[1:]),), kwargs
            raise PerSampleGradientError(
                f"{where} received an input with leading dimension {last_input.shape[0]} in a forward pass "
                f"of batch size {batch_size}; Opacus would treat those rows as examples, so its per-example "
                "gradients would be wrong (a broadcast or flattened batch dimension)."
            )

        self._register(module.register_forward_pre_hook(check_inputs, with_kwargs=True))

    def _install_patch_embedding_recorder(self, module: nn.Module) -> None:
        """Keep the keyword inputs of ViT-style embeddings calls for :func:`_patch_embedding_grad_sample`."""
        signature = _safe_signature(module)

        def record_call(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._records(module):
                return
            bound = signature.bind(*args, **kwargs) if signature is not None else None
            arguments = bound.arguments if bound is not None else {}
            pixel_values = args[0]
            bool_masked_pos = arguments.get("bool_masked_pos")
            call = _PatchEmbeddingCall(
                bool_masked_pos=bool_masked_pos.detach()
                if isinstance(bool_masked_pos, torch.Tensor)
                else None,
                interpolate_pos_encoding=bool(arguments.get("interpolate_pos_encoding") or False),
                height=int(pixel_values.shape[-2]),
                width=int(pixel_values.shape[-1]),
            )
            module.__dict__.setdefault("_dp_hf_patch_embedding_calls", []).append(call)

        self._register(module.register_forward_pre_hook(record_call, with_kwargs=True))


def _safe_signature(module: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None


def _batch_size_of_call(
    positions: Mapping[str, int | None], args: tuple, kwargs: Mapping[str, Any], *, positional_fallback: bool
) -> int | None:
    """Leading dimension of the first batch input (by name, then by position) of a ``forward`` call."""
    for name in BATCH_INPUT_NAMES:
        value = kwargs.get(name)
        position = positions.get(name)
        if value is None and position is not None and position < len(args):
            value = args[position]
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    if positional_fallback:
        for value in args:
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return int(value.shape[0])
    return None


def _check_vmap_fallback_call(
    path: str, module: nn.Module, signature: inspect.Signature | None, args: tuple, kwargs: dict
) -> None:
    """Refuse calls that Opacus's functorch fallback would replay incorrectly.

    The fallback re-runs ``module(args[0])`` per example, so any other input (a second positional
    argument, or a keyword argument that differs from the ``forward`` default) would be silently
    dropped from the replay.
    """
    dropped: list[str] = []
    if len(args) > 1:
        dropped.append(f"{len(args) - 1} extra positional argument(s)")
    defaults = {}
    if signature is not None:
        defaults = {name: p.default for name, p in signature.parameters.items() if p.default is not p.empty}
    for name, value in kwargs.items():
        if value is None:
            continue
        default = defaults.get(name, inspect.Parameter.empty)
        if isinstance(value, torch.Tensor) or default is inspect.Parameter.empty or value != default:
            dropped.append(f"keyword argument {name!r}")
    if dropped:
        raise UnsupportedModuleError(
            [
                (
                    path,
                    type(module).__name__,
                    "it has no Opacus grad sampler, and Opacus's generic fallback replays only its first "
                    f"positional input, but it was called with {', '.join(dropped)}. Register a grad sampler "
                    "for it (opacus.grad_sample.register_grad_sampler) or freeze it.",
                )
            ]
        )


def attach_grad_sample(
    model: nn.Module, *, loss_reduction: str = "sum", strict: bool = True
) -> GradSampleHandle:
    """Attach Opacus per-example-gradient hooks to ``model`` (in place) and return their handle.

    After ``loss.backward()`` every trainable parameter ``p`` has ``p.grad_sample`` of shape
    ``[B, *p.shape]``, row ``i`` being the gradient of example ``i``'s term of the loss.  With
    ``loss_reduction="sum"`` (default) the loss must be the *sum* of per-example losses; with
    ``"mean"`` it must be their mean over the batch (Opacus then rescales by ``B``).  Inputs are
    batch-first.

    ``model`` is validated first (:func:`validate_model`).  With ``strict=False`` validation problems
    are only warned about and Opacus computes what it can: the result is then not guaranteed to be
    per-example, so never use that for private training.  Freeze parameters *before* attaching:
    the set of trainable parameters is fixed here.  ``model`` is not wrapped or copied; PEFT, the
    Trainer and ``save_pretrained`` keep working on it.
    """
    # Opacus's full backward hook on a model's first module (whose input, token ids, needs no gradient)
    # makes torch warn on every backward; the hook reads the output gradient only, so it is harmless.
    warnings.filterwarnings("ignore", message=_FULL_BACKWARD_HOOK_WARNING, category=UserWarning)
    if loss_reduction not in ("sum", "mean"):
        raise ValueError(f"loss_reduction must be 'sum' or 'mean', got {loss_reduction!r}")
    try:
        validate_model(model)
    except UnsupportedModuleError as error:
        if strict:
            raise
        warnings.warn(
            f"{error}\nContinuing because strict=False: gradients may not be per-example.", stacklevel=2
        )
    if hasattr(model, "autograd_grad_sample_hooks"):  # reachable with strict=False only
        raise ValueError(
            "Opacus hooks are already attached to this model; remove() the existing handle first"
        )

    # strict=False: validate_model above is the stricter check (Opacus's own would also reject
    # tied-alias owners such as BertLMPredictionHead, which we deliberately do not hook).
    grad_sample_module = _HFGradSampleModule(
        model, batch_first=True, loss_reduction=loss_reduction, strict=False, force_functorch=False
    )
    handle = GradSampleHandle(
        model=model,
        grad_sample_module=grad_sample_module,
        module_paths={id(module): path for path, module in model.named_modules()},
    )
    try:
        handle._install_trainable_set_check()
        handle._install_batch_size_recorder(model, is_root=True)
        for module in model.modules():
            if module is not model:
                handle._install_batch_size_recorder(module, is_root=False)
        for module in grad_sample_module.iterate_submodules(model):
            handle._install_input_check(module)
            if type(module) in _PATCH_EMBEDDING_LAYOUTS:
                handle._install_patch_embedding_recorder(module)
        for name, parameter in model.named_parameters():  # tied tensors: first name, as named_parameters
            if parameter.requires_grad:
                _PARAMETER_NAMES[parameter] = name
    except BaseException:
        handle.remove()
        raise
    return handle


#: Alias of :func:`attach_grad_sample` under the name used in the project plan.  It does *not* add
#: noise or clipping: that is the DP optimizer's job, which consumes ``p.grad_sample``.
make_private_model = attach_grad_sample
