"""Which models can have exact per-example gradients: :func:`validate_model`, checked before attaching.

Modules Opacus cannot handle (BatchNorm in training mode, trainable modules with buffers, bare
``ParameterDict`` s, active dropout inside a module Opacus would re-run with ``vmap``...) are refused
up front with an :class:`~dp_hf.per_example.errors.UnsupportedModuleError` naming the module path
and type.  Tied LM-head biases (``BertLMPredictionHead`` owns ``bias`` but uses it only as
``decoder.bias``, the same tensor) are recognised by :func:`only_aliases_descendant_parameters`:
both paths hook the child that owns the tensor instead of the head.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator

import torch
from opacus.grad_sample.gsm_base import AbstractGradSampleHooks
from opacus.validators import ModuleValidator
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.weight_norm import WeightNorm

from dp_hf.per_example.errors import UnsupportedModuleError
from dp_hf.per_example.samplers import PATCH_EMBEDDING_LAYOUTS, constant_index_buffers, has_grad_sampler
from dp_hf.per_example.swin import recognised_bias

__all__ = [
    "UnsupportedModuleError",
    "check_fallback_output",
    "check_opacus_call",
    "freeze_own_fix",
    "only_aliases_descendant_parameters",
    "refuse_batch_norm",
    "validate_model",
]


def only_aliases_descendant_parameters(module: nn.Module) -> bool:
    """Whether every trainable parameter ``module`` owns is also owned by one of its descendants.

    That is how transformers ties an LM head's ``bias`` to ``decoder.bias``.  Such a module is not
    hooked: its forward is assumed to use the tensor only through the descendant (true for the
    tied heads in transformers); ``per_sample_gradients`` with ``check_sums=True`` verifies it.
    """
    owned = [p for p in module.parameters(recurse=False) if p.requires_grad]
    if not owned:
        return False
    descendants = {id(p) for child in module.children() for p in child.parameters()}
    return all(id(p) in descendants for p in owned)


def _direct_trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for _, p in _direct_trainable_parameters_named(module)]


def _direct_trainable_parameters_named(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in module.named_parameters(recurse=False) if p.requires_grad]


def _active_dropouts(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, submodule in module.named_modules():
        if isinstance(submodule, nn.modules.dropout._DropoutNd) and submodule.training and submodule.p > 0:
            yield name, submodule


def _batch_dependent_rope(module: nn.Module) -> str | None:
    """The rope type of a rotary embedding whose frequencies follow the batch's longest position ("dynamic" NTK
    scaling, "longrope": transformers' ``dynamic_rope_update``; per layer type too), else None."""
    rope_type = getattr(module, "rope_type", None)
    for kind in rope_type.values() if isinstance(rope_type, dict) else [rope_type]:
        if isinstance(kind, str) and ("dynamic" in kind or kind == "longrope"):
            return kind
    return None


def _parametrization_problems(module: nn.Module) -> list[str]:
    """A parametrized layer (``torch.nn.utils.parametrize``) none of whose own tensors is trainable, while the
    tensors of its parametrizations (``parametrizations.weight.original0``...) are: the hooks then reach the
    parametrization modules, whose input is the weight (no batch dimension), not the layer's input."""
    if not parametrize.is_parametrized(module) or _direct_trainable_parameters(module):
        return []  # the layer is hooked as a whole (Opacus's vmap replays its parametrizations: exact)
    inner = [
        f"parametrizations.{name}"
        for name, p in module.parametrizations.named_parameters()
        if p.requires_grad
    ]
    if not inner:
        return []
    return [
        f"its parametrizations own trainable tensors ({', '.join(inner[:4])}) but the layer itself owns none (no "
        "trainable bias), so the per-example hooks would sit on the parametrization modules, whose input is the "
        "weight (no batch dimension), and could not clip per example. Give the layer a trainable bias (it is then "
        "replayed per example as a whole), or remove the parametrization before training "
        "(torch.nn.utils.parametrize.remove_parametrizations)."
    ]


def _layer_type_problems(module: nn.Module) -> list[str]:
    """Trainable torch layers that Opacus's validator lets through but its grad samplers get wrong."""
    if any(isinstance(hook, WeightNorm) for hook in module._forward_pre_hooks.values()):
        return [
            "the legacy torch.nn.utils.weight_norm recomputes `weight` from weight_g/weight_v in a forward pre-hook, "
            "so the layer's per-example rule (written for a leaf `weight`) misses them or misattributes them. Use "
            "torch.nn.utils.parametrizations.weight_norm instead (with a trainable bias), or "
            "torch.nn.utils.remove_weight_norm(module) before training."
        ]
    if isinstance(module, nn.RNNBase) and type(module) not in ModuleValidator.VALIDATORS:
        return [
            f"a trainable {type(module).__name__} has no per-example rule here (Opacus's hooks fail on its packed "
            "weights); replace it with opacus.layers.DPRNN / DPLSTM / DPGRU, or freeze it."
        ]
    if isinstance(module, nn.EmbeddingBag):
        return [
            "Opacus's nn.EmbeddingBag grad sampler needs explicit offsets, drops repeated ids within a bag and ignores "
            "per_sample_weights/padding_idx, so its per-example gradients are wrong. Use nn.Embedding and reduce "
            "each example's vectors yourself (mean/sum), or freeze it."
        ]
    return []


def _module_problems(path: str, module: nn.Module, constant_index: bool = False) -> list[str]:
    """Reasons why ``module`` (at ``path``) makes exact per-example gradients impossible (``constant_index``: a
    recognised Swin bias module, whose ``relative_position_index`` buffer is a constant of the window size)."""
    problems: list[str] = []
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
        problems.append(
            "BatchNorm in training mode normalises each example with statistics of the whole batch, so "
            "one example's output (and every gradient upstream) depends on the others and no per-example "
            "gradient exists. Replace it with GroupNorm/LayerNorm, e.g. "
            "`model = opacus.validators.ModuleValidator.fix(model)`, or (in your own training loop) freeze it and "
            "keep it in eval mode."
        )
    rope_type = _batch_dependent_rope(module)
    if rope_type is not None:
        problems.append(
            f"its rotary frequencies (rope_type {rope_type!r}) follow the longest position of the forward pass "
            "(transformers' dynamic_rope_update): the batch's longest example, or a packed row's longest segment, "
            "sets every other example's angles, so one example changes the others' gradients (1.7-2.9 C measured "
            "on a tiny Llama), and 'dynamic' also carries the longest length across steps. Use a static rope type "
            "in config.rope_parameters ('default', 'linear', 'yarn', 'llama3' with a fixed factor)."
        )
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
        problems.append(
            "InstanceNorm with track_running_stats=True updates its running_mean/running_var buffers from every "
            "training batch (the Trainer puts it in train mode), and they are saved with the model without noise: "
            "a direct release of training-data statistics, trainable or not. Create it with "
            "track_running_stats=False (each example is then normalised by its own statistics)."
        )
    lazy = [name for name, p in module.named_parameters(recurse=False) if nn.parameter.is_lazy(p)]
    if lazy:
        problems.append(
            f"its parameters {', '.join(lazy)} are uninitialized (a Lazy module): the hooks and the clipping need "
            "their shapes. Run one forward pass on a dummy batch before attaching (or building the DPTrainer)."
        )
    problems += _parametrization_problems(module)
    trainable = _direct_trainable_parameters(module)
    if not trainable:
        return problems  # frozen modules never receive per-example gradients: any type is fine
    if only_aliases_descendant_parameters(module):
        return problems  # tied aliases: the descendant owning the same tensor is checked instead

    if type(module) in ModuleValidator.VALIDATORS and not isinstance(module, nn.modules.batchnorm._BatchNorm):
        opacus_errors = ModuleValidator.VALIDATORS[type(module)](module)
        if opacus_errors:
            problems.append(
                "Opacus's ModuleValidator rejects this trainable layer type "
                f"({type(opacus_errors[0]).__name__}); replace it with its DP-compatible equivalent, e.g. "
                "`model = opacus.validators.ModuleValidator.fix(model)`, or freeze it."
            )
    problems += _layer_type_problems(module)
    indices = constant_index_buffers(module)  # CLIP's position_ids: an index, no data (samplers.py)
    buffer_names = [
        name
        for name, _ in module.named_buffers()
        if not (constant_index and name == "relative_position_index")  # an index, no data (swin.py)
        and name not in indices
    ]
    if buffer_names and not _is_scaled_embedding(module):  # (its embed_scale: a constant of the config)
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

    if type(module) in PATCH_EMBEDDING_LAYOUTS:
        layout = PATCH_EMBEDDING_LAYOUTS[type(module)]
        dropout = getattr(module, layout.dropout, None) if layout.dropout else None
        if dropout is not None and dropout.training and getattr(dropout, "p", 0.0) > 0:
            problems.append(
                f"its dropout (p={dropout.p}) is applied after the cls/position tokens are added, so the "
                "output gradient Opacus sees is masked by an unknown dropout mask. Set "
                f"`{(path + '.') if path else ''}{layout.dropout}.p = 0.0` (or hidden_dropout_prob=0 in "
                "the config), or freeze its cls/position parameters."
            )
    elif not has_grad_sampler(module):
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
                own = ", ".join(name for name, _ in _direct_trainable_parameters_named(module))
                problems.append(
                    f"its own trainable tensors ({own}) have no Opacus grad sampler, and the generic fallback "
                    "re-runs its whole forward per example, which cannot reproduce the dropout masks of "
                    f"{', '.join(dropouts)}. {freeze_own_fix(module)}"
                    # (a model's root is called with keyword inputs, which the fallback refuses anyway)
                    + ("" if not path else "; or set those dropout probabilities to 0")
                    + "; or register a grad sampler for it (opacus.grad_sample.register_grad_sampler)."
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


def _is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is a ``torch.compile`` wrapper or was compiled in place (``Module.compile``)."""
    # Only a loaded dynamo can have made one (looking it up here would import it: ~1 s).
    wrapper = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    return (wrapper is not None and isinstance(module, wrapper)) or (
        getattr(module, "_compiled_call_impl", None) is not None
    )


def validate_model(model: nn.Module, *, fast_path: bool = False) -> None:
    """Raise :class:`UnsupportedModuleError` if exact per-example gradients are impossible for ``model``.

    ``fast_path``: the model is for dp_hf's own hooks (:mod:`dp_hf.per_example.ghost`), which look a recognised
    Swin bias module's table up per example; Opacus's hooks (the default) have no rule for it (its buffer).

    Checks every submodule (error lists all offenders, with their dotted path and type):

    * BatchNorm (``nn.BatchNorm1d/2d/3d``, ``SyncBatchNorm``, lazy variants) in training mode,
      trainable or not, because batch statistics mix the examples of a batch; so do rotary embeddings
      whose frequencies follow the batch's longest position ("dynamic", "longrope");
    * trainable modules (own parameters with ``requires_grad``) we cannot handle: types Opacus's
      ``ModuleValidator`` rejects (LSTM/GRU/MultiheadAttention/InstanceNorm with running stats),
      modules with buffers (but, with ``fast_path``, the constant index of a recognised Swin bias module),
      sparse or frequency-scaled embeddings, parameter containers without a forward, ViT-style embeddings with active embedding dropout, and modules without a grad
      sampler whose subtree has active dropout (the vmap fallback cannot replay it);
    * InstanceNorm with running statistics (released un-noised), trainable or not; uninitialized Lazy
      modules; the legacy ``weight_norm``, ``nn.RNN``, ``nn.EmbeddingBag`` and parametrized layers owning no
      trainable tensor themselves, when trainable (no exact per-example rule);
    * gradient checkpointing, whose recomputed forward would be recorded twice;
    * a compiled model or submodule (``torch.compile``, ``Module.compile``);
    * Opacus hooks already present (attached twice, or copied along with a module).

    Frozen modules are fine whatever their type.  Runtime conditions that cannot be seen from the
    module tree (wrong batch dimension, keyword inputs to a fallback module) are checked by the
    hooks of ``attach_grad_sample`` and raise ``PerSampleGradientError``/
    :class:`UnsupportedModuleError` during the forward pass.
    """
    problems: list[tuple[str, str, str]] = []
    swin_biases = (
        {id(bias) for bias in map(recognised_bias, model.modules()) if bias is not None}
        if fast_path
        else set()
    )
    for path, module in model.named_modules():
        for reason in _module_problems(path, module, id(module) in swin_biases):
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
        if _is_compiled(module):
            problems.append(
                (
                    path,
                    type(module).__name__,
                    "it is compiled (torch.compile or Module.compile): dynamo would trace the per-example "
                    "hooks, break the graph at every hooked layer and recompile for every Poisson batch size, "
                    "and the records under compiled autograd are untested. Attach to the uncompiled model "
                    "(a torch.compile result's ._orig_mod) and do not compile it afterwards.",
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


def check_opacus_call(
    path: str,
    module: nn.Module,
    signature: inspect.Signature | None,
    args: tuple,
    kwargs: dict,
    vmap_fallback: bool,
) -> None:
    """Refuse a call of a module Opacus hooks whose per-example gradients Opacus cannot compute.

    Opacus records positional tensor inputs only: a call with keyword arguments only, or with a positional
    input that is not a tensor (Blenderbot's, LED's and BigBird-Pegasus's learned positions take the input's
    ``torch.Size``: Opacus's activation hook failed on it with a bare AttributeError naming no module). With
    ``vmap_fallback`` (no grad sampler), Opacus's functorch fallback re-runs ``module(args[0])`` per example,
    so any other input (a second positional argument, or a keyword argument that differs from the
    ``forward`` default) would be silently dropped from the replay.
    """

    def refuse(reason: str) -> None:
        raise UnsupportedModuleError([(path, type(module).__name__, reason)])

    if not args:
        refuse(
            "called with keyword arguments only; Opacus records positional inputs only, so it cannot compute "
            f"per-example gradients for this call. {freeze_own_fix(module)}."
        )
    non_tensors = [type(a).__name__ for a in args if not isinstance(a, torch.Tensor)]
    if non_tensors:
        refuse(
            f"called with positional inputs that are not tensors ({', '.join(non_tensors)}); Opacus records "
            f"tensor inputs only, so it cannot compute per-example gradients for this call. {freeze_own_fix(module)}."
        )
    if not vmap_fallback:
        return
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
        refuse(
            "it has no Opacus grad sampler, and Opacus's generic fallback replays only its first positional "
            f"input, but it was called with {', '.join(dropped)}. {freeze_own_fix(module)}; or register a grad "
            "sampler for it (opacus.grad_sample.register_grad_sampler)."
        )


def freeze_own_fix(module: nn.Module) -> str:
    """The fix that names what to freeze: the module's own trainable tensors (its children keep their rules), and
    for the weighted layer sum of wav2vec2's family of classifiers (``layer_weights``, a softmax over the hidden
    states of every layer, owned by the model's root) the config switch that removes it."""
    own = [name for name, _ in _direct_trainable_parameters_named(module)]
    fix = f"Freeze its own trainable tensors ({', '.join(own)}: requires_grad_(False); its submodules keep their rules)"
    config = getattr(module, "config", None)
    if "layer_weights" in own and getattr(config, "use_weighted_layer_sum", False) is True:
        fix += ", or build it with config.use_weighted_layer_sum=False (the head then reads the last layer's output)"
    return fix


def check_fallback_output(path: str, module: nn.Module, output: object) -> None:
    """Refuse a module on Opacus's vmap fallback whose output the replay cannot stand for.

    Opacus's backward hook gives the fallback the gradient of the module's first output tensor only, and
    dp_hf's replay (:func:`~dp_hf.per_example.opacus_hooks.attach_grad_sample`) reads the same output: a tensor,
    or the first element of a tuple (PoolFormer's layers return ``(hidden_states,)``; Opacus's own replay
    crashed on it mid-training). Any other output carrying gradient would leave part of the per-example
    gradient out."""
    if isinstance(output, torch.Tensor):
        return
    first = (
        output[0] if isinstance(output, tuple) and output else None
    )  # (a backward hook's outputs: a tuple)
    rest = list(output[1:]) if isinstance(first, torch.Tensor) else [output]
    carrying = [t for t in _tensor_leaves(rest) if t.requires_grad]
    if not carrying:
        return
    raise UnsupportedModuleError(
        [
            (
                path,
                type(module).__name__,
                f"it has no Opacus grad sampler, and Opacus's generic fallback replays it per example from the "
                f"gradient of its first output tensor only, but it returned a {type(output).__name__} with "
                f"{'other outputs' if isinstance(first, torch.Tensor) else 'no first tensor'} that carry "
                f"gradient. {freeze_own_fix(module)}; or register a grad sampler for it "
                "(opacus.grad_sample.register_grad_sampler).",
            )
        ]
    )


def _tensor_leaves(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensor_leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensor_leaves(item)


def refuse_batch_norm(model: nn.Module) -> None:
    """Refuse every BatchNorm of a model that a ``Trainer`` will train, whatever its current mode.

    :func:`validate_model` accepts a BatchNorm in eval mode (it then normalises with its running statistics,
    example by example), which an own training loop can keep. The ``Trainer`` cannot: it puts every module in
    train mode at every step, where BatchNorm normalises with the batch's statistics (and a frozen one's
    running statistics are still updated from the data)."""
    problems = [
        (
            path,
            type(module).__name__,
            "BatchNorm is not supported by DPTrainer, in any mode: the Trainer puts the model in train mode at "
            "every step, where BatchNorm normalises each example with statistics of the whole batch (one example "
            "then changes the others' gradients) and updates its running statistics from the data without noise. "
            "Replace it with GroupNorm/LayerNorm, e.g. `model = opacus.validators.ModuleValidator.fix(model)`.",
        )
        for path, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm)
    ]
    if problems:
        raise UnsupportedModuleError(problems)


def _is_scaled_embedding(module: nn.Module) -> bool:
    from dp_hf.per_example.ghost.support import is_scaled_embedding  # (support imports this module)

    return is_scaled_embedding(module)
