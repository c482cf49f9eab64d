"""Which trainable modules the fast path handles, and how: the supported-module table.

``nn.Linear`` (hence PEFT LoRA adapters and ``modules_to_save`` heads; also plain subclasses such as
Falcon's ``FalconLinear``, see :data:`PLAIN_LINEAR_SUBCLASSES`), GPT-2's ``Conv1D``,
``nn.Embedding`` (also the scaled word embeddings of Gemma's and BART's families, the lookup times a
constant ``embed_scale``: :func:`is_scaled_embedding`; and OPT's and BART's learned position embeddings,
:mod:`dp_hf.per_example.positions`), ``nn.LayerNorm`` and ``nn.Conv2d`` (``groups=1``, zero padding: ViT/DeiT patch
projections) get a replaced forward (:mod:`dp_hf.per_example.ghost.functions`); the raw
``cls``/``distillation``/``mask`` tokens and position embeddings of ViT/DeiT embeddings get an
output hook and dp_hf's exact sampler (:data:`PATCH`); RMSNorms (``LlamaRMSNorm`` & co.,
``T5LayerNorm``, Gemma's ``(1 + weight)`` norm, ``nn.RMSNorm``: a ``*RMSNorm``/``*LayerNorm`` leaf
with one 1-D weight that a probe finds elementwise affine in it and token-wise) keep their forward
and get an output-gradient hook (:data:`SCALE`, :mod:`~dp_hf.per_example.ghost.scales`); heads whose own parameters are tied aliases
of a child's (BERT's MLM bias) are skipped, the child accounting for every use; so are BEiT's and
Data2VecVision's layers with layer scale, whose known forward records its ``lambda_1``/``lambda_2`` products
(:mod:`dp_hf.per_example.ghost.layer_scale`, attached with the hooks; its children keep their rules). The
relative position bias module of a known Swin attention (:func:`~dp_hf.per_example.swin.recognised_bias`, found
from its parent) gets kind :data:`~dp_hf.per_example.swin.SWIN_BIAS`: its table is looked up per example and
recorded as an embedding (:mod:`dp_hf.per_example.swin`). Any other trainable module is listed by
:func:`unsupported_modules`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

from dp_hf.per_example.ghost.layer_scale import is_layer_scale_block
from dp_hf.per_example.ghost.scales import is_scale_candidate, scale_problem
from dp_hf.per_example.known_code import function_definition
from dp_hf.per_example.positions import is_learned_position_embedding
from dp_hf.per_example.samplers import PATCH_EMBEDDING_LAYOUTS
from dp_hf.per_example.swin import SWIN_BIAS, recognised_bias
from dp_hf.per_example.validate import only_aliases_descendant_parameters

try:  # GPT-2 & co. use transformers' Conv1D (a Linear with a transposed [d_in, d_out] weight)
    from transformers.pytorch_utils import Conv1D as _HFConv1D
except ImportError:  # pragma: no cover - transformers is a dependency
    _HFConv1D = None

__all__ = [
    "PATCH",
    "PLAIN_LINEAR_SUBCLASSES",
    "SCALED_EMBEDDING_FORWARDS",
    "SCALE",
    "embedding_scale",
    "hooked_modules",
    "is_scaled_embedding",
    "native_kind",
    "unsupported_modules",
]

#: ViT/DeiT embeddings: output hook + dp_hf's exact patch-embedding sampler.
PATCH = "patch"
#: RMSNorm-like modules (output elementwise affine in a 1-D weight): output-gradient hook.
SCALE = "scale"


def native_kind(module: nn.Module) -> str | None:
    """The replaced-forward kind of ``module`` (see ``FORWARD_KINDS``), or None."""
    kind = type(module)
    if kind is nn.Linear or _is_plain_linear_subclass(module):
        return "linear"
    if _HFConv1D is not None and kind is _HFConv1D:
        return "conv1d"
    if kind is nn.Embedding or is_scaled_embedding(module) or is_learned_position_embedding(module):
        return "embedding"
    if kind is nn.LayerNorm:
        return "layer_norm"
    if kind is nn.Conv2d:
        return "conv2d"
    return None


#: ``nn.Linear`` subclasses whose own ``forward`` computes ``input @ weight.T + bias`` (module, qualname).
#: Falcon's unfused matmul-then-bias: the replaced forward fuses them (F.linear), which rounds
#: differently in bf16 only, and only while per-example gradients are recorded.
PLAIN_LINEAR_SUBCLASSES = frozenset({("transformers.models.falcon.modeling_falcon", "FalconLinear")})


#: The forward bodies of the ``nn.Embedding`` subclasses that scale the lookup by a constant ``embed_scale``:
#: Gemma's family (``GemmaTextScaledWordEmbedding``: a 0-dim buffer cast to the weight's dtype, VaultGemma,
#: MiniCPM3) and BART's (``BartScaledWordEmbedding``: a float; mBART, M2M100, BioGPT, XGLM, ...).
SCALED_EMBEDDING_FORWARDS = frozenset(
    {
        "return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)",
        "return super().forward(input_ids) * self.embed_scale",
    }
)


def _forward_body(kind: type) -> str | None:
    """``kind.forward``'s body, without its ``def`` line and docstring, as one line (None if unreadable, or
    not ``forward(self, input_ids)``)."""
    definition = function_definition(kind.forward)
    if definition is None or [a.arg for a in definition.args.args] != ["self", "input_ids"]:
        return None
    return " ".join(ast.unparse(statement) for statement in definition.body)


def is_scaled_embedding(module: nn.Module) -> bool:
    """An ``nn.Embedding`` subclass whose forward is the lookup times a constant, non-trainable ``embed_scale``
    (a number or a 0-dim buffer): the embedding rule records the lookup, and the scale multiplies its output
    as the subclass's own forward does (:data:`SCALED_EMBEDDING_FORWARDS`), so its per-example gradients are
    exact. Gemma ties this weight to its LM head, as GPT-2 does."""
    if not isinstance(module, nn.Embedding) or type(module).forward is nn.Embedding.forward:
        return False
    scale = getattr(module, "embed_scale", None)
    constant = isinstance(scale, (int, float)) or (
        isinstance(scale, torch.Tensor)
        and scale.dim() == 0
        and not scale.requires_grad
        and any(b is scale for b in module.buffers(recurse=False))
    )
    return (
        constant
        and _forward_body(type(module)) in SCALED_EMBEDDING_FORWARDS
        and _super_forward_is_the_lookup(type(module))
    )


def _super_forward_is_the_lookup(kind: type) -> bool:
    """The ``super().forward(input_ids)`` of ``kind``'s forward is ``nn.Embedding.forward``: the next class after
    the one defining it, in ``kind``'s MRO, that defines a forward is ``nn.Embedding`` (a mixin there whose forward
    added other examples' rows was recognised, and the recorded lookup was not what ran: own-loop norms 3%, the
    clipped sum 24% off)."""
    mro = kind.__mro__
    owner = next(i for i, c in enumerate(mro) if "forward" in c.__dict__)
    following = next((c for c in mro[owner + 1 :] if "forward" in c.__dict__), None)
    return following is nn.Embedding


def embedding_scale(module: nn.Module) -> float | torch.Tensor:
    """The operand a scaled embedding's forward multiplies its lookup by, as that forward computes it."""
    scale = module.embed_scale
    if isinstance(scale, torch.Tensor) and _forward_body(type(module)).endswith(".to(self.weight.dtype)"):
        return scale.to(module.weight.dtype)
    return scale


def _is_plain_linear_subclass(module: nn.Module) -> bool:
    """An ``nn.Linear`` subclass that computes what ``nn.Linear`` does, so the linear rule is exact for it.

    Either it keeps ``nn.Linear.forward`` (ESMFold's ``EsmFoldLinear`` only changes the initialization),
    or it is listed in :data:`PLAIN_LINEAR_SUBCLASSES`. A parametrized Linear (weight norm, ...) keeps
    ``nn.Linear.forward`` too, but its ``weight`` is computed from other parameters: never plain.
    """
    kind = type(module)
    if not isinstance(module, nn.Linear) or parametrize.is_parametrized(module):
        return False
    return (
        kind.forward is nn.Linear.forward or (kind.__module__, kind.__qualname__) in PLAIN_LINEAR_SUBCLASSES
    )


def _native_problem(module: nn.Module) -> str | None:
    # The legacy torch.nn.utils.weight_norm: `weight` is recomputed from weight_g/weight_v in a pre-hook. (Other
    # module types with raw trainable tensors, a cls token or a table, just have no rule: named by the caller.)
    native = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.Conv2d) + (
        (_HFConv1D,) if _HFConv1D is not None else ()
    )
    extra = [
        n
        for n, p in module.named_parameters(recurse=False)
        if p.requires_grad and n not in ("weight", "bias")
    ]
    if extra and isinstance(module, native):
        return (
            f"trainable tensors {', '.join(extra)} besides the weight/bias its rule computes gradients for (the "
            "legacy torch.nn.utils.weight_norm: use torch.nn.utils.parametrizations.weight_norm)"
        )
    if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.sparse):
        return "nn.Embedding with max_norm (renormalizes in place) or sparse=True"
    if isinstance(module, nn.Embedding) and module.scale_grad_by_freq:
        return "nn.Embedding with scale_grad_by_freq=True (batch-dependent gradients)"
    if isinstance(module, nn.Conv2d) and (
        module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding, str)
    ):
        return "nn.Conv2d with groups > 1, a non-zero padding_mode or string padding"
    return None


def hooked_modules(module: nn.Module, path: str = "") -> Iterator[tuple[str, nn.Module, str | None]]:
    """``(path, module, kind)`` for every module to hook, mirroring the Opacus hooks' traversal.

    ``kind`` is a native kind (``"linear"``...), :data:`PATCH`, :data:`SCALE`, Swin's bias, or ``None`` (owns trainable
    parameters the fast path cannot handle). Modules whose own trainable parameters are aliases of a
    descendant's (BERT's MLM ``bias``) are skipped: the descendant accounts for every use. So are recognised
    layer-scale layers (:func:`~dp_hf.per_example.ghost.layer_scale.is_layer_scale_block`): their lambdas are
    recorded by the adapters :func:`~dp_hf.per_example.ghost.clipping.attach_fast_clipping` attaches.
    """
    owns = any(p.requires_grad for p in module.parameters(recurse=False))
    if owns and not only_aliases_descendant_parameters(module) and not is_layer_scale_block(module):
        kind = native_kind(module)
        if kind is not None and _native_problem(module) is None:
            yield path, module, kind
            return
        if type(module) in PATCH_EMBEDDING_LAYOUTS:
            yield path, module, PATCH
        elif is_scale_candidate(module) and scale_problem(module) is None:
            yield path, module, SCALE
            return
        else:
            yield path, module, None
            return
    swin_bias = recognised_bias(module)
    for name, child in module.named_children():
        child_path = f"{path}.{name}" if path else name
        if child is swin_bias and any(p.requires_grad for p in child.parameters(recurse=False)):
            yield child_path, child, SWIN_BIAS
        else:
            yield from hooked_modules(child, child_path)


def unsupported_modules(model: nn.Module) -> list[tuple[str, str, str]]:
    """``(path, type, reason)`` for every trainable module the fast path cannot handle (empty: supported)."""
    problems = []
    for path, module, kind in hooked_modules(model):
        if kind is None:
            reason = _native_problem(module) or (
                scale_problem(module) if is_scale_candidate(module) else None
            )
            trainable = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            reason = reason or (
                f"no fast per-example rule for this module type (its trainable tensors: {', '.join(trainable)}); "
                "freeze them"
            )
            problems.append((path, type(module).__name__, reason))
    return problems
