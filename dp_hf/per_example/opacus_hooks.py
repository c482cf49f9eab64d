"""Exact per-example gradients in ``p.grad_sample`` from Opacus's hooks: the adapter for HF models.

DP-SGD clips each example's gradient before summing, so it needs ``p.grad_sample[i]``: the gradient
of example ``i``'s own loss term, for every trainable parameter ``p``.  Opacus computes it with a
forward hook (keeps each layer's input activations) and a backward hook (combines them with the
gradient w.r.t. the layer's output).  That is exact only if every trainable layer sees a tensor
whose first dimension *is the batch*, and if Opacus knows how to turn (activations, backprops) into
per-example gradients for the layer's type.  Hugging Face models break both assumptions, often
without any error: Opacus silently produces a batch-summed "per-example" gradient, which is a
privacy bug.  :func:`attach_grad_sample` fixes or refuses those cases: it validates the model
(:mod:`dp_hf.per_example.validate`), tracks the batch size and expands broadcast ids
(:mod:`dp_hf.per_example.batch`), records ViT/DeiT calls for dp_hf's samplers
(:mod:`dp_hf.per_example.samplers`), and hooks the children of tied-alias heads.

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
*same* examples (e.g. two losses) therefore requires summing the two losses before one backward. A dp_hf
optimizer's ``clip_and_accumulate()`` refuses per-example gradients of more than one forward pass, as the
fast path does (it cannot tell two batches from one batch twice): clip after each backward.

Attach *after* freezing parameters and applying PEFT: the hooked set of trainable parameters is
fixed at attach time (a forward pass with a different set raises), and ``copy.deepcopy`` of a
hooked module (PEFT's ``modules_to_save``) copies the hooks too (refused by ``validate_model``).

Not supported: gradient checkpointing (refused), per-example losses that mix examples (in-batch
negatives), parameters read outside their module's ``forward`` (e.g. ``F.linear(x,
self.child.weight)`` in a parent: Opacus's hooks cannot see that use, so ``p.grad_sample`` would
silently miss part of the gradient; the dp_hf optimizers refuse it in ``clip_and_accumulate`` by
checking ``sum_i grad_sample[i] == p.grad``, and ``per_sample_gradients(model, check_sums=True)``
checks the same for other consumers), and trainable layers whose input's first dimension is not
the batch (refused at run time; T5's and MPNet's known ``relative_attention_bias`` lookups are made
per example, :mod:`dp_hf.per_example.relative_bias`).  Opacus's hooks only fire in training
mode with grad enabled.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from opacus.grad_sample import GradSampleModule
from opacus.grad_sample.functorch import prepare_layer
from opacus.layers.dp_rnn import DPGRU, DPLSTM, DPRNN
from torch import nn
from torch.utils.hooks import RemovableHandle

from dp_hf.per_example.batch import BatchSizeRecorder, safe_signature
from dp_hf.per_example.errors import PerSampleGradientError, UnsupportedModuleError
from dp_hf.per_example.ghost.functions import has_owner
from dp_hf.per_example.opacus_state import (
    FORWARD_IDS,
    GRAD_SAMPLE_FORWARDS,
    MODULE_STATE_ATTRIBUTES,
    PARAMETER_MODELS,
    PARAMETER_NAMES,
    SUMMED_FORWARDS,
    clear_grad_sample,
    grad_sample_forwards,
    hooked_parameter_name,
    per_sample_gradients,
    unheld_recorded_parameters,
)
from dp_hf.per_example.prompts import PromptAdapters, attach_prompt_adapters
from dp_hf.per_example.relative_bias import RelativeBiasAdapters, attach_relative_bias_adapters
from dp_hf.per_example.samplers import (
    GRAD_SAMPLERS,
    PATCH_EMBEDDING_LAYOUTS,
    capture_patch_embedding_call,
    has_grad_sampler,
    push_patch_embedding_call,
)
from dp_hf.per_example.validate import (
    check_fallback_output,
    check_opacus_call,
    only_aliases_descendant_parameters,
    validate_model,
)

__all__ = [
    "GradSampleHandle",
    "attach_grad_sample",
    "clear_grad_sample",
    "grad_sample_forwards",
    "hooked_parameter_name",
    "make_private_model",
    "per_sample_gradients",
    "unheld_recorded_parameters",
]

_FULL_BACKWARD_HOOK_WARNING = (
    "Full backward hook is firing when gradients are computed with respect to module outputs since no inputs "
    "require gradients"
)


class _FirstOutput(nn.Module):
    """What the vmap fallback replays for ``layer``: its output, or the first element of a returned tuple.

    Opacus's backward hook hands the fallback the gradient of that first output, but its replay multiplied the
    whole output by it (PoolFormer's layers return ``(hidden_states,)``: a TypeError in the first backward).
    :func:`~dp_hf.per_example.validate.check_fallback_output` refuses outputs with gradient elsewhere."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.layer(x)
        return output[0] if isinstance(output, tuple) else output

    def __deepcopy__(self, memo: dict) -> _FirstOutput:
        # Opacus's replay runs on a deep copy, made before it hooks the module; this one is made after, so the
        # copy is left without hooks (copied, Opacus's would fire in the replay, on tensors it never counted).
        for module in self.layer.modules():
            for name, value in vars(module).items():
                if "hooks" in name and isinstance(value, dict):
                    memo[id(value)] = type(value)()
        copied = _FirstOutput.__new__(_FirstOutput)
        memo[id(self)] = copied
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return copied


def _prepare_first_output_replay(module: nn.Module) -> None:
    """Replace the replay Opacus prepared for ``module`` by one of :class:`_FirstOutput` (the same parameters,
    in the same order: the wrapper's only child is ``module``)."""
    wrapper = _FirstOutput(module)
    prepare_layer(wrapper)
    module.ft_compute_sample_grad = wrapper.ft_compute_sample_grad


class _HFGradSampleModule(GradSampleModule):
    """Opacus's ``GradSampleModule`` with dp_hf's local samplers layered over Opacus's global registry."""

    GRAD_SAMPLERS = GRAD_SAMPLERS

    def iterate_submodules(self, module: nn.Module) -> Iterator[nn.Module]:
        """Opacus's traversal, except that modules whose own parameters are tied aliases are skipped.

        ``BertLMPredictionHead`` owns ``bias`` but only uses it as ``decoder.bias`` (the same
        tensor).  Opacus would hook the head, find no grad sampler, and replay the whole head with
        ``vmap`` (which fails on tied parameters).  The child ``decoder`` already accounts for every
        use of the tensor, so we hook the children instead.
        """
        owns_trainable = any(p.requires_grad for p in module.parameters(recurse=False))
        if owns_trainable and only_aliases_descendant_parameters(module):
            for child in module.children():
                yield from self.iterate_submodules(child)
            return
        if owns_trainable:
            yield module
            if type(module) not in self.GRAD_SAMPLERS and type(module) not in (DPRNN, DPLSTM, DPGRU):
                return  # handled as a whole by Opacus's functorch fallback
        for child in module.children():
            yield from self.iterate_submodules(child)

    #: The outermost forward pass in progress (set by :class:`GradSampleHandle` to its recorder's count).
    current_forward: Callable[[], int] = staticmethod(lambda: 0)

    def capture_activations_hook(self, module: nn.Module, forward_input, forward_output) -> None:
        held = len(module.__dict__.get("activations", ()))
        super().capture_activations_hook(module, forward_input, forward_output)
        if len(module.__dict__.get("activations", ())) > held:
            module.__dict__.setdefault(FORWARD_IDS, []).append(self.current_forward())

    def capture_backprops_hook(self, module: nn.Module, *args, **kwargs) -> None:
        # Opacus sums the rows of a parameter's calls until its call count is 0: right within one forward
        # (tied weights), wrong across two forwards back-propagated together (rows of different examples).
        if self.hooks_enabled and not module.__dict__.get("activations"):  # Opacus: a bare IndexError
            raise PerSampleGradientError(
                f"a backward pass reached {type(module).__name__} without its forward pass's inputs, which the hooks "
                "record in train() mode with gradients on only: the model ran in eval mode or under torch.no_grad(), "
                "or this graph was back-propagated twice. Train in train() mode, one backward per forward pass."
            )
        ids = module.__dict__.get(FORWARD_IDS)
        forward = ids.pop() if self.hooks_enabled and ids else None  # the activation Opacus pops (LIFO)
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        for p in params if forward is not None else ():
            SUMMED_FORWARDS.setdefault(p, set()).add(forward)
        super().capture_backprops_hook(module, *args, **kwargs)
        for p in params:
            merged = SUMMED_FORWARDS.pop(p, ()) if getattr(p, "_forward_counter", 0) == 0 else ()
            if len(merged) == 1:  # promoted by Opacus: a new tensor, or one more entry of a list
                entries = GRAD_SAMPLE_FORWARDS.get(p) if isinstance(p.grad_sample, list) else None
                GRAD_SAMPLE_FORWARDS[p] = [*(entries or ()), *merged]
            elif len(merged) > 1:
                p.grad_sample = None  # merged rows: never to be clipped
                raise PerSampleGradientError(
                    "several forward passes were back-propagated in one backward pass; Opacus would add row i "
                    "of each, which is one example only if every pass held the same examples in the same order "
                    "(e.g. R-Drop), and that cannot be checked. Back-propagate each forward pass before the next "
                    "(clip after each backward), or compute all of a batch's losses in one forward pass."
                )


# --------------------------------------------------------------------------------------------------
# Attaching hooks
# --------------------------------------------------------------------------------------------------


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
    probe_batch_dimensions: bool = True
    _hook_handles: list[RemovableHandle] = field(default_factory=list)
    _batch: BatchSizeRecorder | None = None
    _relative_bias: RelativeBiasAdapters | None = None
    _prompts: PromptAdapters | None = None
    _removed: bool = False

    def __repr__(self) -> str:
        state = "removed" if self._removed else f"hooks_enabled={self.grad_sample_module.hooks_enabled}"
        num_trainable = sum(1 for p in self.model.parameters() if p.requires_grad)
        return f"GradSampleHandle({type(self.model).__name__}, {num_trainable} trainable tensors, {state})"

    @property
    def batch_recorder(self) -> BatchSizeRecorder:
        """The batch sizes of the forward passes (and the broadcast inputs expanded to them)."""
        return self._batch

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

    @contextlib.contextmanager
    def hooks_off(self) -> Iterator[None]:
        """No per-example gradients inside (plain autograd); the previous on/off state afterwards (as
        :meth:`FastClipping.hooks_off <dp_hf.per_example.ghost.clipping.FastClipping.hooks_off>`)."""
        was_on = self.hooks_enabled
        self.grad_sample_module.disable_hooks()
        try:
            yield
        finally:
            if was_on:
                self.enable_hooks()

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
        if self._relative_bias is not None:
            self._relative_bias.remove()
        if self._prompts is not None:
            self._prompts.remove()
        if self._batch is not None:
            self._batch.remove()
        while self._hook_handles:
            self._hook_handles.pop().remove()
        self.grad_sample_module.cleanup()  # Opacus hooks + grad_sample/_forward_counter attributes
        for parameter in self.model.parameters():
            PARAMETER_NAMES.pop(parameter, None)
            PARAMETER_MODELS.pop(parameter, None)
        for module in self.model.modules():
            for attribute in MODULE_STATE_ATTRIBUTES:
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

    def _install(self) -> None:
        """All hooks, in order: trainable-set check, batch sizes, then per hooked module its checks."""
        self._install_trainable_set_check()
        self._batch = BatchSizeRecorder(self.model, active=lambda: self.grad_sample_module.hooks_enabled)
        self._batch.probe_pending = self.probe_batch_dimensions  # (the recorder's batch-dimension probe)
        self._batch.nothing_recorded = lambda: (
            not any("activations" in m.__dict__ for m in self.model.modules())
            and all(getattr(p, "grad_sample", None) is None for p in self.model.parameters())
        )
        self._batch.discard_records = self.clear
        self._batch.attach()
        self._relative_bias = attach_relative_bias_adapters(self.model, self._batch, self._records)
        self._prompts = attach_prompt_adapters(self.model, self._records)  # PEFT prompts, per example
        self.grad_sample_module.current_forward = lambda: self._batch.forward_count
        for module in self.grad_sample_module.iterate_submodules(self.model):
            self._install_input_check(module)
            if not has_grad_sampler(module):
                self._install_output_check(module)
            if type(module) in PATCH_EMBEDDING_LAYOUTS:
                self._install_patch_embedding_recorder(module)

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

        self._hook_handles.append(model.register_forward_pre_hook(check_trainable_set, with_kwargs=True))

    def _install_input_check(self, module: nn.Module) -> None:
        """Pre-hook on a module Opacus hooks: fix broadcast embedding ids, refuse wrong batch dims."""
        path = self.module_paths.get(id(module), "")
        uses_vmap_fallback = not has_grad_sampler(module)
        signature = safe_signature(module)

        def check_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if not self._records(module):
                return None
            check_opacus_call(path, module, signature, args, kwargs, uses_vmap_fallback)
            last_input = args[-1]  # Opacus infers a module's batch size from its last positional input
            if last_input.dim() == 0:
                return None
            expand = isinstance(module, nn.Embedding) and len(args) == 1
            checked = self._batch.batch_first(module, last_input, expand_broadcast=expand)
            return None if checked is last_input else ((checked,), kwargs)

        self._hook_handles.append(module.register_forward_pre_hook(check_inputs, with_kwargs=True))

    def _install_output_check(self, module: nn.Module) -> None:
        """Forward hook on a module on the vmap fallback: its output must be one the replay stands for."""
        path = self.module_paths.get(id(module), "")

        def check_output(module: nn.Module, args: tuple, output: object) -> None:
            if self._records(module):
                check_fallback_output(path, module, output)

        self._hook_handles.append(module.register_forward_hook(check_output))

    def _install_patch_embedding_recorder(self, module: nn.Module) -> None:
        """Keep the keyword inputs of ViT-style embeddings calls for dp_hf's patch-embedding sampler."""
        signature = safe_signature(module)

        def record_call(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._records(module):
                push_patch_embedding_call(
                    module, capture_patch_embedding_call(module, args, kwargs, signature)
                )

        self._hook_handles.append(module.register_forward_pre_hook(record_call, with_kwargs=True))


def attach_grad_sample(
    model: nn.Module, *, loss_reduction: str = "sum", strict: bool = True, probe_batch_dimensions: bool = True
) -> GradSampleHandle:
    """Attach Opacus per-example-gradient hooks to ``model`` (in place) and return their handle.

    After ``loss.backward()`` every trainable parameter ``p`` has ``p.grad_sample`` of shape
    ``[B, *p.shape]``, row ``i`` being the gradient of example ``i``'s term of the loss.  With
    ``loss_reduction="sum"`` (default) the loss must be the *sum* of per-example losses; with
    ``"mean"`` it must be their mean over the batch (Opacus then rescales by ``B``).  Inputs are
    batch-first.

    ``model`` is validated first (:func:`~dp_hf.per_example.validate.validate_model`).  With
    ``strict=False`` validation problems are only warned about and Opacus computes what it can: the
    result is then not guaranteed to be per-example, so never use that for private training.
    Freeze parameters *before* attaching: the set of trainable parameters is fixed here.  ``model``
    is not wrapped or copied; PEFT, the Trainer and ``save_pretrained`` keep working on it.
    ``probe_batch_dimensions``: the first recorded forward pass first runs on its first example alone and on
    its first two (as :func:`~dp_hf.per_example.ghost.clipping.attach_fast_clipping`'s; ``DPTrainer`` runs it
    with its losses): a layer input whose first dimension only equals the batch size is refused (without it,
    LongT5's local bias with a batch of its block length was 27% off a loop of single examples).
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
    if any(has_owner(module) for module in model.modules()):  # (the reverse order is refused there)
        raise ValueError(  # both engines recorded each example: clipped twice, 2x the bound (an audit)
            "fast clipping hooks (attach_fast_clipping) are already attached to this model: one engine per "
            "model; remove() them first"
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
        probe_batch_dimensions=probe_batch_dimensions,
    )
    try:
        # Before dp_hf's hooks are installed: the replay's copy is made as Opacus's was, from the bare modules.
        for module in grad_sample_module.iterate_submodules(model):
            if not has_grad_sampler(module):
                _prepare_first_output_replay(module)
        handle._install()
        for name, parameter in model.named_parameters():  # tied tensors: first name, as named_parameters
            if parameter.requires_grad:
                PARAMETER_NAMES[parameter], PARAMETER_MODELS[parameter] = name, id(model)
    except BaseException:
        handle.remove()
        raise
    return handle


#: Alias of :func:`attach_grad_sample` under the name used in the project plan.  It does *not* add
#: noise or clipping: that is the DP optimizer's job, which consumes ``p.grad_sample``.
make_private_model = attach_grad_sample
