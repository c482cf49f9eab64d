"""FastClipping: the fast path's hooks on a model, and the clipped sum of what they recorded.

:func:`attach_fast_clipping` hooks the supported modules (:mod:`~dp_hf.per_example.ghost.support`)
in place; after one ordinary backward pass :meth:`FastClipping.clipped_sum` clips every recorded
example in a :class:`~dp_hf.privatizer.Geometry` and returns the sums and norms, like
:func:`~dp_hf.privatizer.clip_and_sum`. :meth:`FastClipping.accumulate` is the glue to a DP
optimizer, through its public ``current_geometry()`` and ``accumulate_clipped_sum()``.

Packed rows (padding-free batches): inside :meth:`FastClipping.packed` the layer calls of a forward
pass record per segment (:class:`~dp_hf.per_example.ghost.segments.Segments`), so the examples of
the clipped sum are the segments, not the rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dp_hf.per_example.batch import BatchSizeRecorder, safe_signature
from dp_hf.per_example.errors import PerSampleGradientError, UnsupportedModuleError
from dp_hf.per_example.ghost import norms
from dp_hf.per_example.ghost.functions import (
    Sink,
    check_first_backward,
    has_owner,
    register_owner,
    replace_forward,
    restore_forward,
)
from dp_hf.per_example.ghost.layer_scale import attach_layer_scale_adapters
from dp_hf.per_example.ghost.records import LayerRecorder
from dp_hf.per_example.ghost.scales import register_scale_hook
from dp_hf.per_example.ghost.segments import Segments
from dp_hf.per_example.ghost.support import PATCH, SCALE, hooked_modules, unsupported_modules
from dp_hf.per_example.modes import FAST_CLIPPING_MODES, GHOST, is_identity_geometry
from dp_hf.per_example.prompts import attach_prompt_adapters
from dp_hf.per_example.relative_bias import attach_relative_bias_adapters
from dp_hf.per_example.samplers import PATCH_EMBEDDING_LAYOUTS, capture_patch_embedding_call
from dp_hf.per_example.swin import attach_swin_attention_adapters
from dp_hf.per_example.validate import validate_model
from dp_hf.precision import ieee_float32_matmuls
from dp_hf.privatizer import Geometry

__all__ = ["FastClipping", "attach_fast_clipping", "default_chunk_bytes"]


class FastClipping:
    """Per-example clipping hooks on ``model`` (see :mod:`dp_hf.per_example.ghost`); create with :func:`attach_fast_clipping`.

    Args:
        model: the model, already frozen / PEFT-wrapped as it will be trained.
        mode: ``"ghost"`` (default): norms from factors, identity geometry only;
            ``"materialize"``: per-example gradients formed layer by layer, any geometry.
            Either way the clipped sum is formed by book-keeping, without a second backward.
        layer_strategy: ``"auto"`` (per layer call, keep the smaller of ``G_i`` and
            ``(a_i, g_i)``), or force ``"ghost"`` (factors) / ``"materialize"`` (``G_i``) for
            every Linear/Conv call (for tests and benchmarks).
        chunk_bytes: bound on transient per-chunk buffers (Gram matrices, materialized ``G_i``); ``None``:
            :func:`default_chunk_bytes` of the parameters' device.
        probe_batch_dimensions: run the first recorded forward pass on its first example alone and on its
            first two before it (:meth:`~dp_hf.per_example.batch.BatchSizeRecorder._probe`); ``DPTrainer``
            turns it off and runs the same check itself.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        mode: str = GHOST,
        layer_strategy: str = "auto",
        chunk_bytes: int | None = None,
        probe_batch_dimensions: bool = True,
    ) -> None:
        if mode not in FAST_CLIPPING_MODES:
            raise ValueError(f"mode must be 'ghost' or 'materialize', got {mode!r}")
        self.model = model
        self.mode = mode
        self.recorder = LayerRecorder(layer_strategy)
        self.chunk_bytes = None if chunk_bytes is None else int(chunk_bytes)
        self.enabled = True
        self._native_params: set[int] = set()  # tensors whose .grad the replaced forwards never produce
        self._hooked: list[nn.Module] = []
        self._handles: list[RemovableHandle] = []
        self._batch = BatchSizeRecorder(model, active=lambda: self.enabled)
        self._batch.probe_pending = probe_batch_dimensions  # (the recorder's batch-dimension probe)
        self._batch.nothing_recorded = lambda: (
            not self.recorder.records and not self.recorder.recorded_forwards
        )
        self._batch.discard_records = self.recorder.clear
        self.segments: Segments | None = None  # the examples of the packed rows being forwarded

    @contextlib.contextmanager
    def packed(self, segments: Segments | None) -> Iterator[None]:
        """Forward passes inside record each segment of ``segments`` as one example (None: rows)."""
        previous, self.segments = self.segments, segments
        try:
            yield
        finally:
            self.segments = previous

    @property
    def layer_strategy(self) -> str:
        return self.recorder.layer_strategy

    # -- attaching --------------------------------------------------------------------------------

    def attach(self) -> None:
        """Hook the model (called by :func:`attach_fast_clipping`)."""
        problems = unsupported_modules(self.model)
        if problems:
            raise UnsupportedModuleError(problems)
        validate_model(self.model, fast_path=True)
        if any(has_owner(module) for module in self.model.modules()):
            raise ValueError("fast clipping hooks are already attached to this model; remove() them first")
        try:
            for _, module, kind in hooked_modules(self.model):
                self._hooked.append(module)
                if kind == PATCH:
                    register_owner(module, self)
                    _hook_patch_embedding(self, module)
                elif kind == SCALE:  # keeps its forward; still gets autograd's .grad (checked against)
                    register_owner(module, self)
                    self._handles.append(register_scale_hook(module, self))
                else:
                    replace_forward(module, self, kind)
                    self._native_params.update(id(p) for p in module.parameters(recurse=False))
            self._batch.attach()
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Restore every module's forward, remove the hooks and drop what was recorded."""
        for module in self._hooked:
            restore_forward(module)
        self._hooked.clear()
        self._batch.remove()
        while self._handles:
            self._handles.pop().remove()
        self.recorder.close()

    def __enter__(self) -> FastClipping:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def disable(self) -> None:
        """Stop recording (forward passes then run the modules' own forward)."""
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True

    @contextlib.contextmanager
    def hooks_off(self) -> Iterator[None]:
        """Plain autograd inside (nothing recorded; autograd's ``.grad`` as without hooks); the previous
        on/off state afterwards. :class:`~dp_hf.per_example.opacus_hooks.GradSampleHandle` has the same."""
        was_on, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was_on

    def clear(self) -> None:
        """Forget what the last backward pass recorded."""
        self.recorder.clear()

    # -- what the replaced forwards call (dp_hf.per_example.ghost.functions.Owner) ------------------

    def recording(self, module: nn.Module) -> bool:
        # Asked on every forward of every hooked module: read the module's own parameter dict
        # (what parameters(recurse=False) yields) rather than walking the named-members generators.
        return (
            self.enabled
            and module.training
            and torch.is_grad_enabled()
            and any(p is not None and p.requires_grad for p in module._parameters.values())
        )

    def batch_input(
        self, module: nn.Module, x: torch.Tensor, *, expand_broadcast: bool = False
    ) -> torch.Tensor:
        """``x`` with its first dimension checked to be the batch (broadcast ``[1, ...]`` ids expanded)."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or (x.dim() < 2 and not expand_broadcast):
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise PerSampleGradientError(
                f"{type(module).__name__} got an input of shape {shape} without a batch dimension; "
                "per-example gradients need batch-first inputs."
            )
        return self._batch.batch_first(module, x, expand_broadcast=expand_broadcast)

    @property
    def batch_recorder(self) -> BatchSizeRecorder:
        """The batch sizes of the forward passes (and the broadcast inputs expanded to them)."""
        return self._batch

    def forward_state(self) -> tuple[int | None, int]:
        """``(batch size, forward id)`` of the forward pass in progress (for the hook-mode modules)."""
        return self._batch.batch_size, self._batch.forward_count

    def sink(self, module: nn.Module, kind: str) -> Sink:
        return self.recorder.sink(module, kind, self._batch.forward_count, self.segments)

    # -- clipping ---------------------------------------------------------------------------------

    @torch.no_grad()
    def clipped_sum(
        self, params: Sequence[torch.Tensor], geometry: Geometry
    ) -> tuple[list[torch.Tensor], torch.Tensor] | None:
        """Clip every recorded example in ``geometry`` and sum: ``(sums, norms)`` like :func:`clip_and_sum`.

        ``sums`` is aligned with ``params`` (float32, in the ``w`` coordinates); ``norms`` are
        the ``[b]`` per-example norms ``||w_i||`` before clipping (float32; ``inf`` beyond its
        range, NaN for an example with inf/NaN entries). Returns ``None`` when nothing was
        recorded (no backward pass reached a hooked module). Clears the records, and the ``.grad``
        of the hook-mode tensors (RMSNorm weights, ViT raw parameters: autograd's sum, kept only to
        check the per-example records against), so that the next micro-batch is checked alone.

        The factors are :func:`~dp_hf.privatizer.clip_factors`'s, the rule of every path.
        Norms are computed in float32 (Gram products, materialized chunks; IEEE float32 even
        where the user allowed TF32, :func:`~dp_hf.precision.ieee_float32_matmuls`) and summed
        over the tensors in float64. An example with extreme magnitudes is redone in float64, both its
        norm and its share of the weighted sum, where products of float32 numbers are exact and
        cannot overflow: one whose float32 norm is not a finite non-negative number (huge
        activations or gradients overflow the Gram products: ``inf - inf``), or whose Gram
        products may underflow (:func:`~dp_hf.per_example.ghost.kernels.gram_underflow_risk`). So
        a finite per-example gradient is clipped to ``C``; one with inf/NaN entries keeps a
        non-finite norm and is dropped (factor 0, and masked out of the book-keeping products).
        """
        try:
            batch = self.recorder.batch_size(params, self._native_params, self._parameter_name)
            if batch is None:
                return None
            if self.mode == GHOST and not is_identity_geometry(geometry):
                raise ValueError(
                    "ghost clipping computes norms in the identity geometry only (c = 0, s = 1), but the optimizer "
                    "returned a shift or scale; use mode='materialize'."
                )
            records = self.recorder.records
            device = next(iter(records.values())).param.device
            with ieee_float32_matmuls():  # TF32 Grams or sums could let an example exceed C
                return norms.clipped_sum(
                    [records.get(id(p)) for p in params],
                    params,
                    geometry,
                    ghost=self.mode == GHOST,
                    batch=batch,
                    device=device,
                    budget=self.chunk_bytes if self.chunk_bytes is not None else default_chunk_bytes(device),
                )
        finally:
            recorded = self.recorder.records
            for p in params:
                if id(p) in recorded and id(p) not in self._native_params:
                    p.grad = None
            self.clear()

    def _parameter_name(self, param: torch.Tensor) -> str | None:
        """``param``'s name in the model, for error messages (a search: only when raising)."""
        return next((name for name, p in self.model.named_parameters() if p is param), None)

    def accumulate(self, optimizer: Any) -> torch.Tensor | None:
        """Clip the recorded micro-batch in ``optimizer``'s geometry and add it to its logical batch.

        Uses the DP optimizer's public API only: ``trainable_params()``, ``current_geometry()``
        (the geometry of the logical step in progress) and ``accumulate_clipped_sum()``. Returns
        the per-example norms before clipping (``None`` when nothing was recorded).
        """
        params = optimizer.trainable_params()
        held = {id(p) for p in params}
        unheld = [record.param for key, record in self.recorder.records.items() if key not in held]
        if unheld:  # (its records would be dropped here, or clipped again by another optimizer: sqrt(2) C)
            self.clear()
            names = ", ".join(
                self._parameter_name(p) or f"a tensor of shape {tuple(p.shape)}" for p in unheld
            )
            raise PerSampleGradientError(
                f"per-example gradients were recorded for {names}, trainable tensors of this model that "
                f"{type(optimizer).__name__} does not hold. Give one DP optimizer every trainable tensor of the "
                "model, or freeze the others (requires_grad=False)."
            )
        geometry = optimizer.current_geometry(params)
        identity = is_identity_geometry(geometry)
        if self.recorder.records and not identity and self.mode == GHOST:
            self.clear()
            raise ValueError(
                f"{type(optimizer).__name__} clips in a non-identity geometry; ghost clipping cannot. "
                "Use per_sample_gradient_mode='materialize'."
            )
        result = self.clipped_sum(params, geometry)
        if result is None:
            if not identity:
                raise PerSampleGradientError(
                    "nothing was recorded for this micro-batch, but in a non-identity geometry every example "
                    "contributes -c/s: run the backward pass with the hooks enabled before accumulating."
                )
            return None
        sums, norms_ = result
        # The sums are fresh tensors of norms.clipped_sum's, referenced nowhere else: handed over.
        optimizer.accumulate_clipped_sum(sums, int(norms_.shape[0]), owned=True)
        return norms_


def _hook_patch_embedding(clipping: FastClipping, module: nn.Module) -> None:
    """ViT/DeiT embeddings keep their forward: their output gradient goes to the recorder."""
    signature, recorder = safe_signature(module), clipping.recorder

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if isinstance(output, tuple) and PATCH_EMBEDDING_LAYOUTS[type(module)].returns_grid:
            output = output[0]  # Data2VecVision's (embeddings, patch grid)
        if not clipping.recording(module) or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        if clipping.segments is not None:
            raise PerSampleGradientError(
                f"{type(module).__name__} cannot be split into the examples of packed rows; train without "
                "padding_free."
            )
        call = capture_patch_embedding_call(module, args, kwargs, signature)
        batch = clipping._batch.batch_size
        if batch is not None and output.shape[0] != batch:
            raise PerSampleGradientError(f"{type(module).__name__} output is not batch-first")
        forward_id, pending = clipping._batch.forward_count, [call]  # let go once recorded

        def on_grad(grad: torch.Tensor) -> None:
            check_first_backward(type(module).__name__, not pending)
            recorder.record_patch_embedding(module, pending.pop(), forward_id, grad)

        output.register_hook(on_grad)

    clipping._handles.append(module.register_forward_hook(hook, with_kwargs=True))


def default_chunk_bytes(device: torch.device) -> int:
    """The clipping pass's default bound on transient buffers: 16 MiB on a CPU, 256 MiB on an accelerator.

    On a CPU, a chunk that stays in cache and reuses freed memory is faster than a large fresh buffer (page
    faults, memory traffic): materializing a 768 x 768 layer's ``G_i`` for 32 examples took 39 ms in one
    256 MiB chunk and 8 ms in ~16 MiB ones (2 cores). An accelerator's caching allocator has neither cost,
    and fewer, larger kernels keep it busy."""
    return 16 * 2**20 if device.type == "cpu" else 256 * 2**20


def attach_fast_clipping(
    model: nn.Module,
    *,
    mode: str = GHOST,
    layer_strategy: str = "auto",
    chunk_bytes: int | None = None,
    probe_batch_dimensions: bool = True,
) -> FastClipping:
    """Hook ``model`` (in place) for fast per-example clipping; see :class:`FastClipping`.

    Raises :class:`~dp_hf.per_example.errors.UnsupportedModuleError` if a trainable module has no
    fast rule (see :func:`~dp_hf.per_example.ghost.support.unsupported_modules`) or cannot have
    exact per-example gradients at all.
    """
    clipping = FastClipping(
        model,
        mode=mode,
        layer_strategy=layer_strategy,
        chunk_bytes=chunk_bytes,
        probe_batch_dimensions=probe_batch_dimensions,
    )
    clipping.attach()
    # T5's and MPNet's relative biases looked up per example while recording (removed with the hooks)
    clipping._handles.append(
        attach_relative_bias_adapters(model, clipping.batch_recorder, clipping.recording)
    )
    clipping._handles.append(attach_swin_attention_adapters(model, clipping))  # Swin: batch-first windows
    clipping._handles.append(attach_prompt_adapters(model, clipping.recording))  # PEFT prompts, per example
    clipping._handles.append(attach_layer_scale_adapters(model, clipping))  # BEiT's layer scale, per example
    return clipping
