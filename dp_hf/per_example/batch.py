"""The batch size ``B`` of the forward pass in progress, and inputs checked against it (both paths).

Per-example gradients are exact only if every trainable layer sees a tensor whose first dimension
*is the batch*. :class:`BatchSizeRecorder` records ``B`` with a forward pre-hook on the top-level
model and on every submodule whose ``forward`` takes ``input_ids``/``inputs_embeds``/
``pixel_values``/... (:data:`BATCH_INPUT_NAMES`), so it still works when PEFT or a Trainer calls an
inner model. A nested call with another batch size (multiple-choice heads folding choices into the
batch, MoE routers flattening tokens) raises :class:`~dp_hf.per_example.errors.PerSampleGradientError`
while the recorder is active, since rows would then be taken for examples.

**Broadcast position / token-type ids.** transformers 5 builds ``position_ids`` as a ``[1, L]``
tensor (BERT slices a ``[1, max_len]`` buffer, GPT-2 and Llama use ``arange(L).unsqueeze(0)``) and
lets broadcasting add the ``[1, L, D]`` position embedding to the ``[B, L, D]`` word embedding. A
per-example hook then sees a position-embedding layer with batch 1, and its "per-example" gradient
is the sum over the batch. Nothing can be done after the lookup (the broadcast already summed the
backprops), so :meth:`BatchSizeRecorder.batch_first` expands a batch-1 index tensor to ``B`` *before* the lookup. The
values are unchanged (the rows are what broadcasting would have produced), but autograd now
delivers one backprop row per example. This is family-agnostic: ids are never re-derived, so
RoBERTa's per-example, padding-aware position ids (already ``[B, L]``) pass through untouched.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dp_hf.batches import cuda_devices, select_rows
from dp_hf.per_example.errors import PerSampleGradientError
from dp_hf.per_example.flat_rows import per_example_rows
from dp_hf.random_state import random_state_kept

__all__ = [
    "BATCH_INPUT_NAMES",
    "BatchSizeRecorder",
    "note_broadcast_expansions",
    "ForwardBatch",
    "batch_input_positions",
    "batch_size_of_call",
    "safe_signature",
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


def safe_signature(module: nn.Module) -> inspect.Signature | None:
    """``inspect.signature(module.forward)``, or None where it cannot be read."""
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None


def batch_input_positions(module: nn.Module) -> dict[str, int | None]:
    """For each name in BATCH_INPUT_NAMES that ``module.forward`` takes: its positional index (or None)."""
    signature = safe_signature(module)
    if signature is None:
        return {}
    positions: dict[str, int | None] = {}
    for index, parameter in enumerate(signature.parameters.values()):
        if parameter.name in BATCH_INPUT_NAMES:
            positional = parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
            positions[parameter.name] = index if positional else None
    return positions


def batch_size_of_call(
    positions: Mapping[str, int | None], args: tuple, kwargs: Mapping[str, Any], *, positional_fallback: bool
) -> int | None:
    """Leading dimension of the first batch input (by name; with ``positional_fallback``, else the first tensor).

    ``positional_fallback`` is for the model itself, whose inputs are the batch's tensors (any names).
    """
    for name in BATCH_INPUT_NAMES:
        value = kwargs.get(name)
        position = positions.get(name)
        if value is None and position is not None and position < len(args):
            value = args[position]
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    if positional_fallback:  # the model itself: its first tensor argument (DPTrainer passes keywords only)
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return int(value.shape[0])
    return None


@dataclass
class ForwardBatch:
    """Batch size of the forward pass in progress, as seen by the outermost module that knows it."""

    frames: list[tuple[nn.Module, int | None]] = field(default_factory=list)

    @property
    def batch_size(self) -> int | None:
        for _, size in self.frames:
            if size is not None:
                return size
        return None


class BatchSizeRecorder:
    """Forward hooks that keep the batch size of the forward pass in progress (:attr:`batch_size`).

    ``active()`` says whether a nested call with another batch size must raise (the per-example
    hooks are on). :attr:`forward_count` counts outermost forward calls (new examples).
    """

    def __init__(self, model: nn.Module, *, active: Callable[[], bool]) -> None:
        self.model = model
        self.active = active
        #: Run the first recorded forward pass's first example alone and in a pair first (:meth:`_probe`),
        #: when ``nothing_recorded()`` (earlier records would be lost); ``discard_records()`` drops what its
        #: forwards recorded (a model may back-propagate inside its forward). Set by the clipping hooks.
        self.probe_pending = False
        self.nothing_recorded: Callable[[], bool] = lambda: True
        self.discard_records: Callable[[], None] = lambda: None
        self._probing = False
        self.forward_batch = ForwardBatch()
        self.forward_count = 0
        #: ``path (Type) shape`` of the inputs expanded from a leading 1 in the latest forward pass.
        self.expanded: list[str] = []
        self.paths = {id(module): path for path, module in model.named_modules()}
        self._handles: list[RemovableHandle] = []

    @property
    def batch_size(self) -> int | None:
        return self.forward_batch.batch_size

    def describe(self, module: nn.Module) -> str:
        """``path (Type)`` of a submodule of the model, for error messages."""
        return f"{self.paths.get(id(module), '') or '<root>'} ({type(module).__name__})"

    def batch_first(
        self, module: nn.Module, x: torch.Tensor, *, expand_broadcast: bool = False
    ) -> torch.Tensor:
        """``x`` (an input of ``module``, at least 1-D) checked to be batch-first in the current pass.

        With ``expand_broadcast`` (embedding lookups only) a leading dimension of 1 is expanded to
        the batch size (same values, one backprop row per example); any other mismatch raises.
        """
        batch_size = self.forward_batch.batch_size
        if batch_size is None or x.shape[0] == batch_size:
            return x
        if expand_broadcast and x.shape[0] == 1:
            self.expanded.append(f"{self.describe(module)} {list(x.shape)}")
            return x.expand(batch_size, *x.shape[1:])
        raise PerSampleGradientError(
            f"{self.describe(module)} received an input with leading dimension {x.shape[0]} in a forward pass "
            f"of batch size {batch_size}: its rows would be taken for examples, so the per-example gradients "
            "would be wrong (a broadcast or flattened batch dimension, or none: e.g. a relative position bias). "
            "Freeze that layer (requires_grad=False on its parameters) to train the rest privately."
            + _flat_rows_hint(x, batch_size, self.forward_count)
        )

    def _probe(self, model: nn.Module, args: tuple, kwargs: dict, size: int) -> None:
        """Refuse, before the first backward, a hooked layer whose input's first dimension is not the batch.

        A layer input that only happens to have the batch size as its first dimension (T5's relative position
        bias ``[T, T]`` when ``T`` equals the batch size; a sequence-first ``[T, B, d]`` activation with ``T ==
        B``) passes the per-call shape check, and its rows are clipped as examples (an audit of the own-loop
        API: 1.84 and 6.12 times the bound). So the first recorded forward pass runs first on this batch's
        first example alone and on its first two (one example twice for a batch of one): a dimension that does
        not follow the batch cannot equal both. The outputs are dropped without a backward (nothing is
        recorded) and the random state is restored. ``DPTrainer`` runs the same check with its losses.
        """
        pick = [0, min(1, size - 1)]
        self._probing = True
        try:
            with random_state_kept(cuda_devices((*args, *kwargs.values()))):
                for rows in (pick[:1], pick):
                    positional = select_rows(dict(enumerate(args)), size, rows)
                    model(*positional.values(), **select_rows(kwargs, size, rows))
        except PerSampleGradientError as error:
            raise PerSampleGradientError(
                f"{error} (Found before the first backward, by running the first forward pass's first example alone "
                "and the first two together.)"
            ) from error
        finally:
            self._probing = False
            self.discard_records()

    def attach(self) -> None:
        """Hook the model itself and every submodule whose ``forward`` takes a batch input."""
        self._install(self.model, is_root=True)
        for module in self.model.modules():
            if module is not self.model:
                self._install(module, is_root=False)

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def _install(self, module: nn.Module, *, is_root: bool) -> None:
        positions = batch_input_positions(module)
        if not positions and not is_root:
            return
        frames = self.forward_batch.frames

        def record_batch_size(module: nn.Module, args: tuple, kwargs: dict) -> None:
            size = batch_size_of_call(positions, args, kwargs, positional_fallback=is_root)
            if is_root and not frames and size and self.probe_pending and not self._probing:
                if torch.is_grad_enabled() and self.active() and self.nothing_recorded():
                    # Done only once it passed: a refused model caught and run again (a retry loop, a cell run
                    # again) trained unprobed before (2x the bound).
                    self._probe(module, args, kwargs, size)
                    self.probe_pending = False
            outer = self.forward_batch.batch_size
            if not frames:  # outermost call: a new forward pass (new examples)
                self.forward_count += 1
                self.expanded.clear()
            frames.append((module, size))  # pushed before raising: popped by the post-hook
            if size is not None and outer is not None and size != outer and self.active():
                raise PerSampleGradientError(
                    f"{self.describe(module)} was called with batch size {size} inside a forward pass of "
                    f"batch size {outer}: the model reshapes examples into several rows (e.g. multiple-choice "
                    "heads), so per-row gradients would not be per-example gradients."
                )

        def forget_batch_size(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if frames and frames[-1][0] is module:
                frames.pop()

        self._handles.append(module.register_forward_pre_hook(record_batch_size, with_kwargs=True))
        self._handles.append(
            module.register_forward_hook(forget_batch_size, with_kwargs=True, always_call=True)
        )


def _flat_rows_hint(x: torch.Tensor, batch_size: int, forward_id: int) -> str:
    """Why flattened ``[B*T, ...]`` rows were refused here: the fast path accepts them only with a verified
    provenance (dp_hf.per_example.flat_rows); Opacus's hooks (the fallback when some trainable module has no
    fast rule) never do, their samplers taking the leading dimension for the batch."""
    if x.dim() < 2 or x.shape[0] % batch_size:
        return ""
    if per_example_rows(x, batch_size, forward_id) is not None:
        return (
            " These are flattened batch rows [B*T, ...], which only the fast path records (per-example hooks "
            "of Opacus take each row for an example): make every trainable module supported by it "
            "(dp_hf.per_example.ghost.unsupported_modules(model) lists the others; freeze them or use LoRA)."
        )
    return (
        " dp_hf.per_example.flat_rows accepts flattened rows [B*T, ...] only as a contiguous reshape of a "
        "batch-first tensor, or a hooked Linear/LayerNorm's output on such rows through unary activations; "
        "not rows mixed, gathered or transposed across examples."
    )


def note_broadcast_expansions(error: BaseException, recorder: BatchSizeRecorder | None) -> None:
    """Add to ``error`` (raised in a forward pass) which inputs :meth:`BatchSizeRecorder.batch_first` expanded.

    The expansion is right for broadcast position ids ``[1, T]``; for an input without a batch dimension
    whose first dimension is 1 (T5's relative position bias with one-token targets: ``[1, 1]``) it makes
    the layer's output the wrong shape, and the model then fails with a bare shape error.
    """
    if recorder is not None and recorder.expanded:
        error.add_note(
            f"dp_hf expanded the embedding input(s) {', '.join(recorder.expanded)} from a leading dimension of 1 "
            "to the batch size, as for broadcast position ids [1, T]. If such an input has no batch dimension "
            "(a relative position bias looked up with a [1, 1] bucket tensor), freeze that layer "
            "(requires_grad=False on its parameters)."
        )
