"""Grad samplers dp_hf adds to Opacus, and the capture of ViT-style embeddings calls (both paths).

* **Raw ``nn.Parameter`` s in ViT/DeiT/BEiT embeddings.**  ``ViTEmbeddings``/``DeiTEmbeddings`` (and ``BeitEmbeddings``) own
  ``cls_token``, ``position_embeddings`` (DeiT also ``distillation_token``) and optionally
  ``mask_token``.  Opacus has no grad sampler for them and falls back to
  ``opacus.grad_sample.functorch``: it re-runs the *whole* embeddings module under ``vmap`` from
  its first positional input only.  Keyword inputs are dropped, so ``bool_masked_pos`` is ignored
  (the mask token's per-example gradient silently becomes zero) and ``interpolate_pos_encoding``
  breaks, and any embedding dropout makes ``vmap`` fail.  Exact grad samplers for the module's
  *direct* parameters are registered with Opacus (globally, when this module is imported); the
  patch ``Conv2d`` then gets Opacus's own conv sampler.  The fast clipping hooks call the same
  formulas (:func:`patch_embedding_grad_samples`) on the same captured call
  (:func:`capture_patch_embedding_call`).
* **Convolutions of permuted inputs.** Opacus's conv sampler assumes a contiguous input; dp_hf's
  hooks give it one (:func:`conv_grad_sample_of_contiguous_input`).
* **Embedding ``padding_idx``.**  PyTorch never gives the ``padding_idx`` row a gradient, but
  Opacus's embedding sampler scatters backprops into it.  :data:`GRAD_SAMPLERS` (Opacus's registry
  seen through local overrides, used by dp_hf's Opacus hooks only) zeroes that row, so
  ``sum_i grad_sample[i] == grad`` holds exactly, without affecting other Opacus users.
"""

from __future__ import annotations

import inspect
from collections import ChainMap
from collections.abc import Callable
from dataclasses import dataclass

import torch
from opacus.grad_sample import register_grad_sampler
from opacus.grad_sample.conv import compute_conv_grad_sample
from opacus.grad_sample.embedding import compute_embedding_grad_sample
from opacus.grad_sample.grad_sample_module import GradSampleHooks
from torch import nn

from dp_hf.per_example.errors import PerSampleGradientError

__all__ = [
    "GRAD_SAMPLERS",
    "PATCH_EMBEDDING_CALLS",
    "PATCH_EMBEDDING_LAYOUTS",
    "PatchEmbeddingCall",
    "PatchEmbeddingLayout",
    "capture_patch_embedding_call",
    "constant_index_buffers",
    "has_grad_sampler",
    "patch_embedding_grad_sample",
    "patch_embedding_grad_samples",
    "push_patch_embedding_call",
    "register_patch_embedding_grad_sampler",
]

#: Module attribute holding the recorded calls of a ViT-style embeddings module (a LIFO stack).
PATCH_EMBEDDING_CALLS = "_dp_hf_patch_embedding_calls"


def embedding_grad_sample_without_padding_row(
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


def conv_grad_sample_of_contiguous_input(
    layer: nn.Module, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Opacus's conv sampler, given a contiguous input.

    Its ``unfold2d``/``unfold3d`` read the input through ``as_strided`` with the strides of a contiguous
    ``[B, C, H, W]`` tensor. A permuted (channels-last) input, which ConvNeXt's channels-first
    LayerNorm hands its downsampling convolution, then gave wrong per-example gradients (caught by
    the sum check, but refused).
    """
    return compute_conv_grad_sample(layer, [a.contiguous() for a in activations], backprops)


# Samplers used only by modules attached through dp_hf's Opacus hooks; ChainMap looks them up first
# and then Opacus's live registry, so samplers that anyone registers later are still seen.
_LOCAL_GRAD_SAMPLERS: dict[type[nn.Module], Callable[..., dict[nn.Parameter, torch.Tensor]]] = {
    nn.Embedding: embedding_grad_sample_without_padding_row,
    nn.Conv2d: conv_grad_sample_of_contiguous_input,
    nn.Conv3d: conv_grad_sample_of_contiguous_input,
}
GRAD_SAMPLERS = ChainMap(_LOCAL_GRAD_SAMPLERS, GradSampleHooks.GRAD_SAMPLERS)


def has_grad_sampler(module: nn.Module) -> bool:
    return type(module) in GRAD_SAMPLERS


@dataclass(frozen=True)
class PatchEmbeddingLayout:
    """Where the raw parameters of a ViT-style embeddings module live and how they are combined.

    The module's forward must compute, for ``pixel_values`` of shape ``[B, C, H, W]``::

        patches = patch_embeddings(pixel_values)                          # [B, N, D]
        patches = patches * (1 - mask) + mask_token * mask                # only if bool_masked_pos
        x = cat([tok.expand(B, -1, -1) for tok in special_tokens] + [patches], dim=1)
        x = x + position_embeddings           # or + interpolate_pos_encoding(x, H, W)
        return dropout(x)

    which is what ``ViTEmbeddings`` and ``DeiTEmbeddings`` do. ``BeitEmbeddings`` always adds ``interpolate_pos_encoding(x, H, W)`` (no argument
    turns it on; it returns the parameter itself on the configured square grid): ``always_interpolates``.
    ``Data2VecVisionEmbeddings`` (BEiT's forward otherwise) returns ``(x, (patch_height, patch_width))``:
    ``returns_grid``, the gradient is the first element's. ``CLIPVisionEmbeddings`` adds its positions with a
    child ``nn.Embedding`` looked up at its ``position_ids`` buffer (hooked as any embedding, the ``[1, N]`` ids
    expanded to the batch): no ``position_embeddings`` parameter of its own, and ``index_buffers`` names the
    buffer, a constant ``arange`` (:func:`constant_index_buffers`).
    """

    special_tokens: tuple[str, ...]
    position_embeddings: str | None = "position_embeddings"
    mask_token: str | None = "mask_token"
    dropout: str | None = "dropout"
    always_interpolates: bool = False
    returns_grid: bool = False
    index_buffers: tuple[str, ...] = ()


@dataclass
class PatchEmbeddingCall:
    """Keyword inputs of one ``forward`` call that Opacus's positional-only capture would lose."""

    bool_masked_pos: torch.Tensor | None
    interpolate_pos_encoding: bool
    height: int
    width: int


PATCH_EMBEDDING_LAYOUTS: dict[type[nn.Module], PatchEmbeddingLayout] = {}


def capture_patch_embedding_call(
    module: nn.Module, args: tuple, kwargs: dict, signature: inspect.Signature | None
) -> PatchEmbeddingCall:
    """What :func:`patch_embedding_grad_samples` needs to know about one ``forward(*args, **kwargs)``.

    ``signature`` is ``safe_signature(module)``, computed once when hooking.
    """
    arguments = signature.bind(*args, **kwargs).arguments if signature is not None else dict(kwargs)
    pixel_values = args[0] if args else kwargs["pixel_values"]
    mask = arguments.get("bool_masked_pos")
    return PatchEmbeddingCall(
        bool_masked_pos=mask.detach() if isinstance(mask, torch.Tensor) else None,
        interpolate_pos_encoding=bool(arguments.get("interpolate_pos_encoding") or False),
        height=int(pixel_values.shape[-2]),
        width=int(pixel_values.shape[-1]),
    )


def push_patch_embedding_call(module: nn.Module, call: PatchEmbeddingCall) -> None:
    """Keep ``call`` for the Opacus sampler, which pops it in backward (LIFO, like Opacus's activations)."""
    module.__dict__.setdefault(PATCH_EMBEDDING_CALLS, []).append(call)


def patch_embedding_grad_samples(
    module: nn.Module, call: PatchEmbeddingCall, backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-example gradients of the *direct* parameters of a ViT-style embeddings module.

    ``backprops`` ``g`` has shape ``[B, S + N, D]`` (``S`` special tokens, ``N`` patches) and is
    the gradient w.r.t. the module output, which equals the gradient w.r.t. ``x`` before dropout
    because :func:`~dp_hf.per_example.validate.validate_model` refuses active embedding dropout.
    Then, per example ``i``:

    * special token ``k`` (cls, distillation): it is expanded to every example and concatenated at
      position ``k``, so its gradient is ``g[i, k]``;
    * position embeddings: added to every example, so the gradient is ``g[i]`` (with interpolation
      it is the vector-Jacobian product of the interpolation with ``g[i]``);
    * mask token: it replaces the masked patches, so the gradient is
      ``sum_j mask[i, j] * g[i, S + j]``.

    The children (the patch projection ``Conv2d``) are hooked separately, and are not returned
    here, so nothing is counted twice.
    """
    layout = PATCH_EMBEDDING_LAYOUTS[type(module)]
    batch_size = backprops.shape[0]
    num_special = len(layout.special_tokens)
    grad_samples: dict[nn.Parameter, torch.Tensor] = {}

    for position, name in enumerate(layout.special_tokens):
        token = getattr(module, name)
        if token is not None and token.requires_grad:
            grad_samples[token] = backprops[:, position].reshape(batch_size, *token.shape).clone()

    if call.interpolate_pos_encoding and layout.position_embeddings is None:
        raise PerSampleGradientError(  # CLIP's interpolation reads its child's table outside the child's forward
            f"{type(module).__name__} was called with interpolate_pos_encoding=True, which reads the position "
            "embedding's weight outside that embedding's forward, where no per-example rule sees it. Train at the "
            "configured image size, or freeze the position embedding."
        )
    position_embeddings = getattr(module, layout.position_embeddings) if layout.position_embeddings else None
    if position_embeddings is not None and position_embeddings.requires_grad:
        if call.interpolate_pos_encoding or layout.always_interpolates:
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


def patch_embedding_grad_sample(
    module: nn.Module, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """The Opacus grad sampler: :func:`patch_embedding_grad_samples` of the call being back-propagated."""
    call = _pop_patch_embedding_call(module, activations, backprops)
    return patch_embedding_grad_samples(module, call, backprops)


def _pop_patch_embedding_call(
    module: nn.Module, activations: list[torch.Tensor], backprops: torch.Tensor
) -> PatchEmbeddingCall:
    """The recorded keyword inputs of the call being back-propagated (LIFO, like Opacus's activations).

    When the model was hooked by plain Opacus (e.g. ``PrivacyEngine``) rather than by
    :func:`~dp_hf.per_example.opacus_hooks.attach_grad_sample`, nothing was recorded.  The call is
    then reconstructed from shapes where that is unambiguous: a square input at the configured
    resolution gives the same output with or without ``interpolate_pos_encoding``; a masked call
    cannot be recognised, so a trainable mask token makes that situation an error rather than a
    silent zero gradient.
    """
    recorded_calls = getattr(module, PATCH_EMBEDDING_CALLS, None)
    if recorded_calls:
        return recorded_calls.pop()
    layout = PATCH_EMBEDDING_LAYOUTS[type(module)]
    pixel_values = activations[0]
    height, width = int(pixel_values.shape[-2]), int(pixel_values.shape[-1])
    mask_token = getattr(module, layout.mask_token, None) if layout.mask_token else None
    position_embeddings = getattr(module, layout.position_embeddings) if layout.position_embeddings else None
    same_grid = position_embeddings is None or backprops.shape[1] == position_embeddings.shape[1]
    if (mask_token is not None and mask_token.requires_grad) or not (same_grid and height == width):
        raise PerSampleGradientError(
            f"{type(module).__name__} was back-propagated without its call being recorded; attach the "
            "model with dp_hf.per_example.attach_grad_sample() so that bool_masked_pos and "
            "interpolate_pos_encoding are taken into account."
        )
    return PatchEmbeddingCall(None, False, height, width)


def _interpolated_position_grad_sample(
    module: nn.Module, call: PatchEmbeddingCall, backprops: torch.Tensor
) -> torch.Tensor:
    """Per-example VJP of the module's own (linear, bicubic) position-embedding interpolation.

    Reusing ``module.interpolate_pos_encoding`` instead of re-implementing it keeps us exact for
    whatever the installed transformers version does.  We are inside a backward hook, where grad
    mode is off, hence ``enable_grad``; the small graph is independent of the model's graph.
    """
    position_embeddings = getattr(module, PATCH_EMBEDDING_LAYOUTS[type(module)].position_embeddings)
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


def constant_index_buffers(module: nn.Module) -> set[str]:
    """The buffers of a registered embeddings module that hold an index, no data: its layout's ``index_buffers``
    whose value is ``[arange(n)]``, the positions of every example."""
    layout = PATCH_EMBEDDING_LAYOUTS.get(type(module))
    names = set()
    for name in layout.index_buffers if layout is not None else ():
        ids = module._buffers.get(name)
        if (
            isinstance(ids, torch.Tensor)
            and ids.dim() == 2
            and ids.shape[0] == 1
            and not ids.is_floating_point()
        ):
            if torch.equal(ids[0], torch.arange(ids.shape[1], device=ids.device)):
                names.add(name)
    return names


def register_patch_embedding_grad_sampler(
    module_class: type[nn.Module], layout: PatchEmbeddingLayout
) -> None:
    """Register :func:`patch_embedding_grad_sample` with Opacus for another ViT-style embeddings class.

    Only do this for classes whose ``forward`` matches :class:`PatchEmbeddingLayout` exactly, and
    add a per-example test against a loop over single examples (see tests/test_grad_sample.py).
    Registration is global (Opacus keeps one registry), which is what we want here: these classes
    have no Opacus sampler, and the default functorch fallback is wrong for masked inputs.
    """
    PATCH_EMBEDDING_LAYOUTS[module_class] = layout
    register_grad_sampler(module_class)(patch_embedding_grad_sample)


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
    # BEiT's (absolute position embeddings optional, off by default), and Data2VecVision's copy of it.
    try:
        from transformers.models.beit.modeling_beit import BeitEmbeddings
    except ImportError:  # pragma: no cover - depends on the installed transformers
        pass
    else:
        register_patch_embedding_grad_sampler(
            BeitEmbeddings, PatchEmbeddingLayout(special_tokens=("cls_token",), always_interpolates=True)
        )
    try:
        from transformers.models.data2vec.modeling_data2vec_vision import Data2VecVisionEmbeddings
    except ImportError:  # pragma: no cover - depends on the installed transformers
        pass
    else:
        register_patch_embedding_grad_sampler(
            Data2VecVisionEmbeddings,
            PatchEmbeddingLayout(special_tokens=("cls_token",), always_interpolates=True, returns_grid=True),
        )
    try:
        from transformers.models.clip.modeling_clip import CLIPVisionEmbeddings
    except ImportError:  # pragma: no cover - depends on the installed transformers
        pass
    else:
        register_patch_embedding_grad_sampler(
            CLIPVisionEmbeddings,
            PatchEmbeddingLayout(
                special_tokens=("class_embedding",),
                position_embeddings=None,
                mask_token=None,
                dropout=None,
                index_buffers=("position_ids",),
            ),
        )


_register_transformers_patch_embeddings()
