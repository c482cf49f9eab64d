"""The autograd functions of the hooked layers and the forwards that call them (the fast path).

A hooked module's ``forward`` is replaced (:func:`replace_forward`) by one that, while its owner
records, checks the input is batch-first and computes the same output with autograd producing the
**input gradient only**: the layer's ``(a, g)`` factors go to the owner's sink instead of a weight
gradient (book-keeping forms the clipped sum from them, so the non-private weight gradient is never
computed). When the owner does not record (eval mode, no grad, disabled) the class's own ``forward``
runs.

Two ways to get there. When the input requires grad (every layer after the first), Linear, Conv1D
and LayerNorm run their native op on **detached** parameters, so autograd's own backward computes
the input gradient alone, and a pre-hook on the op's backward node hands the output gradient to the
sink (:func:`_record_on_backward`): per layer call about 60 us less of Python than an autograd
function's ``apply`` and ``backward`` on 2 CPU cores (tiny BERT: ~1.3 ms per forward/backward).
Otherwise (a first layer on raw inputs, an embedding's integer ids, a convolution) an autograd
function whose backward returns ``dx`` only does the same; its output would have no backward node
to hook. Either way the input is kept as recorded at forward time: an in-place change to it before
the backward is refused (autograd's saved-tensor check, or the version check of the hook), and the
hook lets go of it once recorded, as autograd frees saved tensors. Each recorded layer call takes
one backward pass: a second one through the same graph (``retain_graph=True``) and a differentiable
one (``create_graph=True``) are refused (:func:`check_first_backward`).

Linear, Conv1D and LayerNorm also take flattened batch rows ``[B*T, ...]`` of verified provenance
(:mod:`dp_hf.per_example.flat_rows`): recorded as ``[B, T, ...]``, their output as the caller's shape,
marked as such rows; OPT's/BART's learned position embeddings run their own forward with its lookup
recorded (:mod:`dp_hf.per_example.positions`); a recognised Swin bias module's table lookup is recorded as an
embedding (:func:`embedding_lookup`, :mod:`dp_hf.per_example.swin`).

The owner (a :class:`~dp_hf.per_example.ghost.clipping.FastClipping`) provides ``recording(module)``,
``batch_input(module, x, expand_broadcast=...)``, ``sink(module, kind)`` and ``forward_state()``; see :class:`Owner`.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from dp_hf.per_example.adapters import InstanceAdapter
from dp_hf.per_example.errors import PerSampleGradientError
from dp_hf.per_example.flat_rows import mark_per_example_rows, per_example_rows
from dp_hf.per_example.ghost.kernels import as_dtype
from dp_hf.per_example.positions import check_position_ids, is_learned_position_embedding, route_lookup

__all__ = [
    "FORWARD_KINDS",
    "check_first_backward",
    "embedding_lookup",
    "Owner",
    "Sink",
    "has_owner",
    "register_owner",
    "replace_forward",
    "restore_forward",
    "runs_class_forward",
]

#: What an autograd function calls in backward with the layer's recorded tensors.
Sink = Callable[..., None]


class Owner(Protocol):
    """What the replaced forwards ask of the object that hooked the module."""

    def recording(self, module: nn.Module) -> bool: ...

    def batch_input(
        self, module: nn.Module, x: torch.Tensor, *, expand_broadcast: bool = False
    ) -> torch.Tensor: ...

    def sink(self, module: nn.Module, kind: str) -> Sink: ...

    def forward_state(self) -> tuple[int | None, int]: ...


# module -> owning FastClipping (weak: a deep copy of a hooked module is not hooked, its forward
# falls back to the class's and any gradient it produces is refused as unrecorded).
_OWNERS: weakref.WeakKeyDictionary[nn.Module, Owner] = weakref.WeakKeyDictionary()


def has_owner(module: nn.Module) -> bool:
    return module in _OWNERS


def runs_class_forward(module: nn.Module) -> bool:
    """``module``'s forward is its class's, or one of dp_hf's replacements of it: a replaced forward (owned: the
    class's computation, recorded; a copy's: the class's) or an :class:`~dp_hf.per_example.adapters.InstanceAdapter`
    of this module (owned: a recognised per-example version; a copy's: the class's). A copy of a hooked model then
    counts as the model it copies (attaching to it replaces the copied forwards)."""
    forward = module.__dict__.get("forward")
    if forward is None:
        return True
    if isinstance(forward, types.MethodType):
        return forward.__self__ is module and forward.__func__ in _FORWARDS.values()
    return isinstance(forward, InstanceAdapter) and forward.module is module


def register_owner(module: nn.Module, owner: Owner) -> None:
    """Make ``owner`` the one that records ``module`` (the patch-embedding modules keep their forward)."""
    _OWNERS[module] = owner


def replace_forward(module: nn.Module, owner: Owner, kind: str) -> None:
    """Register ``owner`` and replace ``module.forward`` (an instance attribute) by the one of ``kind``."""
    register_owner(module, owner)
    module.forward = types.MethodType(_FORWARDS[kind], module)


def restore_forward(module: nn.Module) -> None:
    """Undo :func:`register_owner` / :func:`replace_forward`."""
    if "forward" in module.__dict__:
        del module.forward
    _OWNERS.pop(module, None)


def _recording_owner(module: nn.Module) -> Owner | None:
    owner = _OWNERS.get(module)
    if owner is not None and owner.recording(module):
        return owner
    return None


# --------------------------------------------------------------------------------------------------
# Autograd functions: input gradient only; the layer's (a, g) go to the sink
# --------------------------------------------------------------------------------------------------


class _LinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` (``transposed``: ``y = x W + b``, GPT-2's Conv1D); backward: ``dx`` only."""

    @staticmethod
    def forward(ctx, x, weight, bias, transposed: bool, sink: Sink):
        # The weight in the dtype the product runs in, cast once here and saved: backward needs it
        # in grad_output's dtype (the output's), and casting it there again cost a copy per call.
        w = _autocast_weight(weight, x.device.type)
        ctx.input_dtype = x.dtype
        x = _bf16_operand(x, w.dtype)
        ctx.save_for_backward(x, w)
        ctx.transposed, ctx.sink = transposed, sink
        # Rows flattened: F.linear would return its 2-D product viewed as [..., out], and a custom
        # Function's output that is a view may not be edited in place (Falcon's `mlp_output += ...`).
        # The caller views the 2-D result back (_unflatten_rows), a view that autograd tracks.
        return F.linear(x.reshape(-1, x.shape[-1]), w.t() if transposed else w, bias)

    @staticmethod
    def backward(ctx, grad_output):
        _first_backward(ctx, "Linear")
        x, w = ctx.saved_tensors
        grad_output = grad_output.reshape(*x.shape[:-1], grad_output.shape[-1])
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = as_dtype(w, grad_output.dtype)
            grad_x = as_dtype(grad_output @ (w.t() if ctx.transposed else w), ctx.input_dtype)
        ctx.sink(x, grad_output)
        return grad_x, None, None, None, None


def _autocast_weight(weight: torch.Tensor, device_type: str) -> torch.Tensor:
    """``weight`` as autocast would cast it for ``F.linear`` on ``device_type`` (itself outside autocast).

    Autocast casts a floating-point, non-float64 argument to its lower-precision dtype; doing it
    here gives ``F.linear`` the same operands (same output) and leaves nothing for it to cast.
    """
    return as_dtype(weight, _autocast_dtype(weight, device_type))


def _autocast_dtype(weight: torch.Tensor, device_type: str) -> torch.dtype:
    """The dtype autocast gives ``weight`` in ``F.linear`` on ``device_type`` (its own outside autocast)."""
    if (
        weight.dtype == torch.float64
        or not weight.is_floating_point()
        or not torch.is_autocast_enabled(device_type)
    ):
        return weight.dtype
    return torch.get_autocast_dtype(device_type)


def _bf16_operand(x: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the product with a weight of ``weight_dtype`` reads it: on CUDA, a float32 ``x`` against a
    bf16 weight is cast here, as autocast would cast it, so that the recorded factor is exactly the
    layer's bf16 operand (which the ghost kernels multiply on tensor cores, ghost/tensor_cores.py),
    at half the memory of a float32 ``x``."""
    if x.is_cuda and weight_dtype == torch.bfloat16 and x.dtype == torch.float32:
        return x.to(torch.bfloat16)
    return x


def _record_on_backward(output: torch.Tensor, module: nn.Module, saved: list, record: Callable) -> None:
    """Call ``record(*saved, grad)`` with the gradient of ``output`` when autograd reaches the op that made it.

    The pre-hook is on ``output``'s backward node, not on the tensor: a later in-place edit of the
    output (Falcon's ``mlp_output += ...``) gives the tensor a new node, while the op's node still
    receives the gradient of its own result. ``saved`` (the layer's input first) holds what autograd
    does not save here (the weight is detached): it must be unchanged by then, as a saved tensor
    would have to be, and is let go once recorded, as autograd frees saved tensors after the
    backward pass (a graph kept alive by a logged loss must not keep the activations).
    """
    version = saved[0]._version

    def hook(grad_outputs: tuple) -> None:
        check_first_backward(type(module).__name__, not saved)
        tensors = tuple(saved)
        saved.clear()
        if tensors[0]._version != version:
            raise PerSampleGradientError(
                f"the input of a {type(module).__name__} was modified in place after its forward; its "
                "weight's per-example gradients, formed from that input, would be wrong. Do not edit a "
                "layer's input in place between the forward and the backward pass."
            )
        if grad_outputs[0] is not None:  # None: no gradient reached the output (nothing to record)
            record(*tensors, grad_outputs[0])

    output.grad_fn.register_prehook(hook)


def _first_backward(ctx, name: str) -> None:
    """:func:`check_first_backward` for an autograd function's backward, which then marks ``ctx``."""
    check_first_backward(name, getattr(ctx, "recorded", False))
    ctx.recorded = True


def check_first_backward(name: str, recorded: bool) -> None:
    """Refuse a second backward pass through a recorded layer call, and a differentiable backward.

    A forward's per-example gradients are recorded by its backward pass, once: a second pass through
    the same graph (``retain_graph=True``) would record its examples again (clipped twice if the two
    are clipped apart: twice the sensitivity), as Opacus's hooks refuse it too. A backward with
    ``create_graph=True`` (gradient penalties) would miss the terms through the weight itself.
    """
    if recorded:
        raise PerSampleGradientError(
            f"a second backward pass through a {name} call whose per-example gradients were already recorded "
            "(retain_graph=True): the examples would count twice. Sum the losses of a forward pass and call "
            "backward once."
        )
    if torch.is_grad_enabled():
        raise PerSampleGradientError(
            f"a backward pass with create_graph=True through a {name} recorded for per-example clipping: the "
            "higher-order terms through its weight are not recorded, so its per-example gradients would be "
            "wrong. Double backward (gradient penalties) is not supported with DP."
        )


def _native_linear(module: nn.Module, x: torch.Tensor, transposed: bool, sink: Sink) -> torch.Tensor:
    """:class:`_LinearFunction`'s output for an ``x`` that requires grad, by ``F.linear`` on detached
    parameters (rows flattened as there: the hooked node is the product's, never a view's)."""
    weight, bias = module.weight, module.bias
    recorded = x
    if x.is_cuda:  # (the autocast query only where it can matter: it runs on every layer call)
        x = _bf16_operand(x, _autocast_dtype(weight, "cuda"))
        recorded = _shared_cast(recorded, x)
    w = weight.detach()
    rows = F.linear(
        x.reshape(-1, x.shape[-1]), w.t() if transposed else w, None if bias is None else bias.detach()
    )
    _record_on_backward(
        rows, module, [recorded], lambda x, grad: sink(x, grad.reshape(*x.shape[:-1], grad.shape[-1]))
    )
    return rows


# input -> (its version, its cast) for the layers that read one input (q, k and v; gate and up)
_CASTS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _shared_cast(x: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
    """What to record for a layer whose product read ``cast``, autocast's bf16 copy of the float32 ``x``:
    the copy an earlier layer recorded for the same ``x`` (unchanged since) if it is still held, else
    ``cast``. Autocast copies ``x`` for each layer (only parameters are cast once), so without this q,
    k and v would record three equal copies: three times the memory, and three Grams where the
    clipping pass shares one between tensors that record the same factor. The autograd graph keeps
    each layer's own copy (their input gradients are summed in float32, as without DP)."""
    if cast is x:
        return x
    entry = _CASTS.get(x)
    if entry is not None and entry[0] == x._version:
        earlier = entry[1]()
        if earlier is not None and earlier.dtype == cast.dtype:
            return earlier
    _CASTS[x] = (x._version, weakref.ref(cast))
    return cast


class _EmbeddingFunction(torch.autograd.Function):
    """``y = W[ids]``; backward records ``(ids, dy)`` and returns no gradient (ids are integers)."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, sink: Sink):
        ctx.save_for_backward(ids)
        ctx.sink = sink
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_output):
        _first_backward(ctx, "Embedding")
        (ids,) = ctx.saved_tensors
        ctx.sink(ids, grad_output)
        return None, None, None, None


def embedding_lookup(ids: torch.Tensor, weight: torch.Tensor, sink: Sink) -> torch.Tensor:
    """``F.embedding(ids, weight)`` of any 2-D parameter (Swin's bias table), recorded as an embedding: backward
    calls ``sink(ids, dy)`` and gives ``weight`` no gradient, so the owner's completeness check (no ``.grad``
    on a replaced forward's tensors) refuses any other use of it."""
    return _EmbeddingFunction.apply(ids, weight, None, sink)


class _LayerNormFunction(torch.autograd.Function):
    """``y = xhat * w + b`` with ``xhat = (x - mean) * rstd``; backward: ``dx`` by ATen's kernel."""

    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps, sink: Sink):
        out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.normalized_shape, ctx.sink = normalized_shape, sink
        return out

    @staticmethod
    def backward(ctx, grad_output):
        _first_backward(ctx, "LayerNorm")
        x, mean, rstd, weight, bias = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.native_layer_norm_backward(
                as_dtype(grad_output, x.dtype),
                x,
                ctx.normalized_shape,
                mean,
                rstd,
                weight,
                bias,
                [True, False, False],
            )[0]
        ctx.sink(x, mean, rstd, grad_output)
        return grad_x, None, None, None, None, None


class _Conv2dFunction(torch.autograd.Function):
    """``F.conv2d`` with ``groups=1``; backward: ``dx`` only (skipped for pixel inputs)."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, sink: Sink):
        ctx.save_for_backward(x, weight)
        ctx.conv, ctx.sink = (stride, padding, dilation), sink
        return F.conv2d(x, weight, bias, stride, padding, dilation)

    @staticmethod
    def backward(ctx, grad_output):
        _first_backward(ctx, "Conv2d")
        x, weight = ctx.saved_tensors
        stride, padding, dilation = ctx.conv
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.nn.grad.conv2d_input(
                x.shape, as_dtype(weight, grad_output.dtype), grad_output, stride, padding, dilation
            )
            grad_x = as_dtype(grad_x, x.dtype)
        ctx.sink(x, grad_output)
        return grad_x, None, None, None, None, None, None


# --------------------------------------------------------------------------------------------------
# The replacement forwards
# --------------------------------------------------------------------------------------------------


def _linear_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    return _product_forward(self, input, "linear")


def _conv1d_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    return _product_forward(self, input, "conv1d")


def _product_forward(module: nn.Module, input: torch.Tensor, kind: str) -> torch.Tensor:
    """The replaced forward of a Linear (``x W^T + b``) or a Conv1D (``kind`` ``"conv1d"``: ``x W + b``)."""
    owner = _recording_owner(module)
    if owner is None:
        return type(module).forward(module, input)
    x, flat = _rows_input(owner, module, input)
    sink, transposed = owner.sink(module, kind), kind == "conv1d"
    if x.requires_grad:
        rows = _native_linear(module, x, transposed, sink)
    else:
        rows = _LinearFunction.apply(x, module.weight, module.bias, transposed, sink)
    # As the caller's input: a flattened [B*T, d] one gets the [B*T, out] rows, recorded as [B, T, ...].
    return _flat_rows_output(_unflatten_rows(rows, input), owner, flat)


def _unflatten_rows(rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``_LinearFunction``'s ``[n, out]`` product as ``[*x.shape[:-1], out]`` (itself if already so shaped)."""
    if rows.dim() == x.dim() and rows.shape[:-1] == x.shape[:-1]:
        return rows
    return rows.view(*x.shape[:-1], rows.shape[-1])


def _rows_input(owner: Owner, module: nn.Module, input: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(x, flat)``: the input checked batch-first, or flattened batch rows ``[B*T, ...]`` viewed as
    ``[B, T, ...]`` (``flat``), accepted only with a verified provenance (:mod:`dp_hf.per_example.flat_rows`)."""
    batch, forward_id = owner.forward_state()
    if batch is not None and isinstance(input, torch.Tensor) and input.dim() >= 2 and input.shape[0] != batch:
        view = per_example_rows(input, batch, forward_id)
        if view is not None:
            return owner.batch_input(module, view), True
    return owner.batch_input(module, input), False


def _flat_rows_output(output: torch.Tensor, owner: Owner, flat: bool) -> torch.Tensor:
    """``output``, marked as flattened batch rows if the layer (row-wise) read flattened batch rows."""
    if flat:
        mark_per_example_rows(output, *owner.forward_state())
    return output


def _embedding_forward(self: nn.Module, input: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    owner = _recording_owner(self)
    if owner is None:
        return type(self).forward(self, input, *args, **kwargs)
    sink = owner.sink(self, "embedding")
    if is_learned_position_embedding(self):
        # OPT's/BART's positions: the class's own forward computes the ids; its one lookup is recorded.
        def lookup(ids: torch.Tensor) -> torch.Tensor:
            ids = owner.batch_input(self, ids, expand_broadcast=True)
            check_position_ids(self, ids)
            return _EmbeddingFunction.apply(ids, self.weight, self.padding_idx, sink)

        return route_lookup(self, (input, *args), kwargs, lookup)
    if args or kwargs:  # (as nn.Embedding.forward would)
        raise TypeError(f"{type(self).__name__}.forward takes one input, got {1 + len(args) + len(kwargs)}")
    ids = owner.batch_input(self, input, expand_broadcast=True)
    out = _EmbeddingFunction.apply(ids, self.weight, self.padding_idx, sink)
    if type(self) is nn.Embedding:
        return out
    # A scaled embedding (support.is_scaled_embedding): its constant, as the subclass's forward applies it.
    from dp_hf.per_example.ghost.support import embedding_scale  # (support imports this module's users)

    return out * embedding_scale(self)


def _layer_norm_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    owner = _recording_owner(self)
    if owner is None:
        return type(self).forward(self, input)
    x, flat = _rows_input(owner, self, input)
    sink, shape = owner.sink(self, "layer_norm"), list(self.normalized_shape)
    if not x.requires_grad:
        out = _LayerNormFunction.apply(x, self.weight, self.bias, shape, self.eps, sink)
        return _flat_rows_output(out.view(input.shape) if flat else out, owner, flat)
    weight, bias = self.weight, self.bias
    out, mean, rstd = torch.native_layer_norm(
        x,
        shape,
        None if weight is None else weight.detach(),
        None if bias is None else bias.detach(),
        self.eps,
    )
    _record_on_backward(out, self, [x, mean, rstd], sink)
    return _flat_rows_output(out.view(input.shape) if flat else out, owner, flat)


def _conv2d_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    owner = _recording_owner(self)
    if owner is None:
        return type(self).forward(self, input)
    x = owner.batch_input(self, input)
    return _Conv2dFunction.apply(
        x, self.weight, self.bias, self.stride, self.padding, self.dilation, owner.sink(self, "conv2d")
    )


def _swin_bias_forward(self: nn.Module, batch: int | None = None) -> torch.Tensor:
    """A recognised Swin relative-position-bias module's forward (:func:`dp_hf.per_example.swin.recorded_bias`)."""
    owner = _recording_owner(self)
    if owner is None:
        return type(self).forward(self)
    from dp_hf.per_example.swin import recorded_bias  # (swin imports this module)

    return recorded_bias(self, owner, batch)


_FORWARDS = {
    "linear": _linear_forward,
    "conv1d": _conv1d_forward,
    "embedding": _embedding_forward,
    "layer_norm": _layer_norm_forward,
    "conv2d": _conv2d_forward,
    "swin_bias": _swin_bias_forward,
}

#: The layer kinds a forward can be replaced for.
FORWARD_KINDS = tuple(_FORWARDS)
