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
``modules_to_save`` heads), GPT-2's ``Conv1D``, ``nn.Embedding``, ``nn.LayerNorm``,
``nn.Conv2d`` (``groups=1``, zero padding: ViT/DeiT patch projections), the raw
``cls``/``distillation``/``mask`` tokens and position embeddings of ViT/DeiT
embeddings (via :mod:`dp_hf.grad_sample`'s exact samplers), and heads whose own
parameters are tied aliases of a child's (BERT's MLM bias). Parameters used by
several modules or several times (tied input/output embeddings of GPT-2 and BERT
MLM) are exact: ``||sum_k G^k_i||^2`` includes every cross term ``<G^k_i, G^l_i>``,
computed from the same factors. Broadcast ``[1, T]`` position ids are expanded to
the batch before the lookup, as in :mod:`dp_hf.grad_sample`. Any other trainable
module makes :func:`unsupported_modules` non-empty; :class:`~dp_hf.DPTrainer` then
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
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from dp_hf.grad_sample import (
    _PATCH_EMBEDDING_LAYOUTS,
    PerSampleGradientError,
    UnsupportedModuleError,
    _batch_input_positions,
    _batch_size_of_call,
    _ForwardBatch,
    _only_aliases_descendant_parameters,
    _patch_embedding_grad_sample,
    _PatchEmbeddingCall,
    _safe_signature,
    validate_model,
)
from dp_hf.privatizer import Geometry, _mask_batch, clip_factors

__all__ = [
    "FastClipping",
    "PER_SAMPLE_GRADIENT_MODES",
    "attach_fast_clipping",
    "has_identity_geometry",
    "is_identity_geometry",
    "resolve_per_sample_gradient_mode",
    "unsupported_modules",
]

#: Values of ``DPTrainingArguments.per_sample_gradient_mode``.
PER_SAMPLE_GRADIENT_MODES = ("auto", "ghost", "materialize")

#: Layer strategies: ``"auto"`` keeps the smaller of ``G_i`` and ``(a_i, g_i)`` per layer call.
LAYER_STRATEGIES = ("auto", "ghost", "materialize")

try:  # GPT-2 & co. use transformers' Conv1D (a Linear with a transposed [d_in, d_out] weight)
    from transformers.pytorch_utils import Conv1D as _HFConv1D
except ImportError:  # pragma: no cover - transformers is a dependency
    _HFConv1D = None


# --------------------------------------------------------------------------------------------------
# Per-example gradient representations
# --------------------------------------------------------------------------------------------------


@dataclass
class _Outer:
    """A per-example gradient of a 2-D view ``[R, C]`` of a parameter: ``G_i = sum_t rows_{i,t} (x) cols_{i,t}``.

    ``rows`` is ``[B, T, R]``, or ``[B, T]`` integer ids standing for one-hot rows (embeddings:
    ``R`` = vocabulary size); ``cols`` is ``[B, T, C]``. Both stay in the model's dtype until used.
    """

    rows: torch.Tensor
    cols: torch.Tensor
    num_rows: int
    rows_are_ids: bool = False

    @property
    def batch_size(self) -> int:
        return int(self.cols.shape[0])


@dataclass
class _ParamRecord:
    """Everything recorded for one parameter in one micro-batch: ``G_i = dense_i + sum_k outers[k]_i``."""

    param: torch.Tensor
    dense: torch.Tensor | None = None  # [B, *param.shape], float32
    outers: list[_Outer] = field(default_factory=list)
    dense_sq_norms: torch.Tensor | None = None  # ||dense_i||^2, taken while dense is hot in cache

    @property
    def batch_size(self) -> int:
        if self.dense is not None:
            return int(self.dense.shape[0])
        return self.outers[0].batch_size

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """The ``[R, C]`` view of the parameter in which the outers are expressed."""
        rows = self.outers[0].num_rows if self.outers else self.param.shape[0]
        return int(rows), self.param.numel() // int(rows)

    def select(self, index: torch.Tensor) -> _ParamRecord:
        """The record of the examples ``index`` only (for recomputing their norms)."""
        outers = [
            _Outer(o.rows.index_select(0, index), o.cols.index_select(0, index), o.num_rows, o.rows_are_ids)
            for o in self.outers
        ]
        dense = self.dense.index_select(0, index) if self.dense is not None else None
        return _ParamRecord(self.param, dense, outers)

    def add_dense(self, value: torch.Tensor) -> None:
        value = value.float()
        if self.dense is None:
            self.dense = value
            self.dense_sq_norms = torch.linalg.vector_norm(value.reshape(value.shape[0], -1), dim=1).square()
        else:  # a second use of the parameter: the norm of the sum is taken later
            self.dense = self.dense + value
            self.dense_sq_norms = None


def _chunks(batch: int, bytes_per_example: int, budget: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of examples whose transient buffers fit ``budget`` bytes."""
    step = max(1, budget // max(1, bytes_per_example))
    return [(start, min(batch, start + step)) for start in range(0, batch, step)]


# The norm helpers below take the dtype of their arithmetic: float32 for the whole batch, float64 to
# redo the few examples whose float32 result overflowed (see FastClipping.clipped_sum). Products of
# two float32 numbers are exact in float64 and no sum of them can overflow it.


def _row_gram(
    x: _Outer, y: _Outer, start: int, stop: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``[n, Tx, Ty]`` inner products of the row factors of ``x`` and ``y`` (one-hot rows allowed)."""
    if x.rows_are_ids and y.rows_are_ids:
        return (x.rows[start:stop, :, None] == y.rows[start:stop, None, :]).to(dtype)
    if x.rows_are_ids:  # <onehot(id_s), r_t> = r_t[id_s]
        dense = y.rows[start:stop].to(dtype)  # [n, Ty, R]
        ids = x.rows[start:stop]  # [n, Tx]
        return dense.gather(2, ids[:, None, :].expand(-1, dense.shape[1], -1)).transpose(1, 2)
    if y.rows_are_ids:
        return _row_gram(y, x, start, stop, dtype).transpose(1, 2)
    return torch.bmm(x.rows[start:stop].to(dtype), y.rows[start:stop].to(dtype).transpose(1, 2))


def _outer_inner(x: _Outer, y: _Outer, budget: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``<X_i, Y_i>_F = sum_{s,t} <rows^x_s, rows^y_t> <cols^x_s, cols^y_t>`` for every example, ``[B]``."""
    batch, tx, ty = x.batch_size, x.cols.shape[1], y.cols.shape[1]
    out = torch.empty(batch, dtype=dtype, device=x.cols.device)
    if tx == 1 and ty == 1 and not (x.rows_are_ids or y.rows_are_ids):
        rows = (x.rows.to(dtype) * y.rows.to(dtype)).sum(dim=(1, 2))
        return rows * (x.cols.to(dtype) * y.cols.to(dtype)).sum(dim=(1, 2))
    itemsize = torch.empty((), dtype=dtype).element_size()
    for start, stop in _chunks(batch, 3 * itemsize * tx * ty, budget):
        cols = torch.bmm(x.cols[start:stop].to(dtype), y.cols[start:stop].to(dtype).transpose(1, 2))
        out[start:stop] = (_row_gram(x, y, start, stop, dtype) * cols).sum(dim=(1, 2))
    return out


def _ids_rows(
    outers: Sequence[_Outer], dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (example, distinct id) row sums of one-hot outers: ``(example, id, r)`` with ``r`` ``[U, C]``.

    ``r_{i,u} = sum_{t: id_{i,t} = u} cols_{i,t}`` over every outer (several calls of the same
    embedding concatenate), which are exactly the non-zero rows of ``G_i``.
    """
    ids = outers[0].rows if len(outers) == 1 else torch.cat([o.rows for o in outers], dim=1)  # [B, T]
    cols = outers[0].cols if len(outers) == 1 else torch.cat([o.cols for o in outers], dim=1)  # [B, T, C]
    batch, num_rows = ids.shape[0], outers[0].num_rows
    keys = (torch.arange(batch, device=ids.device)[:, None] * num_rows + ids).reshape(-1)
    unique, inverse = torch.unique(keys, return_inverse=True)
    rows = torch.zeros(unique.shape[0], cols.shape[-1], dtype=dtype, device=cols.device)
    rows.index_add_(0, inverse, cols.reshape(-1, cols.shape[-1]).to(dtype))
    return unique // num_rows, unique % num_rows, rows


def _outer_sq_norm(o: _Outer, budget: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``||G_i||_F^2`` for every example (the ghost norm), ``[B]``."""
    if o.rows_are_ids:
        example, _, rows = _ids_rows([o], dtype)
        out = torch.zeros(o.batch_size, dtype=dtype, device=rows.device)
        return out.index_add_(0, example, rows.pow(2).sum(dim=1))
    return _outer_inner(o, o, budget, dtype)


def _dense_outer_inner(
    dense: torch.Tensor, o: _Outer, budget: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``<D_i, sum_t rows_t (x) cols_t> = sum_t rows_t^T D_i cols_t``, ``[B]``."""
    batch, num_rows = o.batch_size, o.num_rows
    d = dense.reshape(batch, num_rows, -1).to(dtype)
    if o.rows_are_ids:  # D_i[id_t] . cols_t
        picked = d.gather(1, o.rows[:, :, None].expand(-1, -1, d.shape[2]))
        return (picked * o.cols.to(dtype)).sum(dim=(1, 2))
    out = torch.empty(batch, dtype=dtype, device=d.device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    for start, stop in _chunks(batch, itemsize * num_rows * o.cols.shape[1], budget):
        dc = torch.bmm(d[start:stop], o.cols[start:stop].to(dtype).transpose(1, 2))  # [n, R, T]
        out[start:stop] = (dc * o.rows[start:stop].to(dtype).transpose(1, 2)).sum(dim=(1, 2))
    return out


def _gram_underflow_risk(o: _Outer) -> torch.Tensor | None:
    """``[B]`` bool: examples whose float32 Gram products of ``o`` may lose part of ``||G_i||^2``.

    The ghost norm multiplies two Gram matrices. If one factor is tiny (``max |rows_i|`` or
    ``max |cols_i|`` below ``2^-50``: its Gram entries are then near or below float32's normal
    range, down to denormals with a few bits or 0) while the other is huge, ``G_i`` itself can
    still be large: the float32 norm would be too small, and the example under-clipped. Such
    examples (with ``max |rows_i| max |cols_i| > 2^-40``, below which ``G_i`` is negligible) are
    redone in float64. Overflow needs no such test: it leaves inf or NaN.
    """
    if o.rows_are_ids:  # one-hot rows: only the cols' own squares, which cannot hide a large G_i
        return None
    batch = o.batch_size
    row_min, row_max = torch.aminmax(o.rows.reshape(batch, -1), dim=1)
    col_min, col_max = torch.aminmax(o.cols.reshape(batch, -1), dim=1)
    rows = torch.maximum(row_max.double(), -row_min.double())
    cols = torch.maximum(col_max.double(), -col_min.double())
    return (torch.minimum(rows, cols) < 2.0**-50) & (rows * cols > 2.0**-40)


def _outer_weighted_sum(
    o: _Outer, factors: torch.Tensor, keep: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``sum_i f_i G_i = (f * rows)^T cols`` over all ``B T`` positions, ``[R, C]`` in ``dtype``.

    ``keep`` (``[B]`` bool, given when some examples are left out) zeroes their rows *and* cols
    first: ``f_i = 0`` alone would leave ``0 * inf = NaN`` in the product.
    """
    factors = factors.to(dtype)
    o_cols = o.cols.to(dtype) if keep is None else _mask_batch(o.cols.to(dtype), keep)
    cols = o_cols.reshape(-1, o.cols.shape[-1])
    if o.rows_are_ids:
        weighted = (o_cols * factors[:, None, None]).reshape(-1, cols.shape[-1])
        out = torch.zeros(o.num_rows, cols.shape[-1], dtype=dtype, device=cols.device)
        return out.index_add_(0, o.rows.reshape(-1), weighted)
    rows = o.rows.to(dtype) * factors[:, None, None]
    if keep is not None:
        rows = _mask_batch(rows, keep)
    return rows.reshape(-1, o.rows.shape[-1]).transpose(0, 1) @ cols


def _outer_materialize(o: _Outer, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``G_i`` for examples ``[start, stop)``: ``[n, R, C]``."""
    cols = o.cols[start:stop].to(dtype)
    if o.rows_are_ids:
        n, _, width = cols.shape
        out = torch.zeros(n * o.num_rows, width, dtype=dtype, device=cols.device)
        offsets = torch.arange(n, device=cols.device)[:, None] * o.num_rows
        out.index_add_(0, (offsets + o.rows[start:stop]).reshape(-1), cols.reshape(-1, width))
        return out.view(n, o.num_rows, width)
    return torch.bmm(o.rows[start:stop].to(dtype).transpose(1, 2), cols)


# --------------------------------------------------------------------------------------------------
# Autograd functions: input gradient only; the layer's (a, g) go to the recorder
# --------------------------------------------------------------------------------------------------

_Sink = Callable[..., None]


class _LinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` (``transposed``: ``y = x W + b``, GPT-2's Conv1D); backward: ``dx`` only."""

    @staticmethod
    def forward(ctx, x, weight, bias, transposed: bool, sink: _Sink):
        ctx.save_for_backward(x, weight)
        ctx.transposed, ctx.sink = transposed, sink
        if transposed:
            return F.linear(x, weight.t(), bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = weight.to(grad_output.dtype)
            grad_x = (grad_output @ (w.t() if ctx.transposed else w)).to(x.dtype)
        ctx.sink(x, grad_output)
        return grad_x, None, None, None, None


class _EmbeddingFunction(torch.autograd.Function):
    """``y = W[ids]``; backward records ``(ids, dy)`` and returns no gradient (ids are integers)."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, sink: _Sink):
        ctx.save_for_backward(ids)
        ctx.sink = sink
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_output):
        (ids,) = ctx.saved_tensors
        ctx.sink(ids, grad_output)
        return None, None, None, None


class _LayerNormFunction(torch.autograd.Function):
    """``y = xhat * w + b`` with ``xhat = (x - mean) * rstd``; backward: ``dx`` by ATen's kernel."""

    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps, sink: _Sink):
        out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.normalized_shape, ctx.sink = normalized_shape, sink
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x, mean, rstd, weight, bias = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.native_layer_norm_backward(
                grad_output.to(x.dtype),
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
    def forward(ctx, x, weight, bias, stride, padding, dilation, sink: _Sink):
        ctx.save_for_backward(x, weight)
        ctx.conv, ctx.sink = (stride, padding, dilation), sink
        return F.conv2d(x, weight, bias, stride, padding, dilation)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        stride, padding, dilation = ctx.conv
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.nn.grad.conv2d_input(
                x.shape, weight.to(grad_output.dtype), grad_output, stride, padding, dilation
            ).to(x.dtype)
        ctx.sink(x, grad_output)
        return grad_x, None, None, None, None, None, None


# --------------------------------------------------------------------------------------------------
# Which modules are handled
# --------------------------------------------------------------------------------------------------

_NATIVE = "native"  # forward replaced by one of the functions above
_PATCH = "patch"  # ViT/DeiT embeddings: output hook + dp_hf.grad_sample's exact sampler


def _native_kind(module: nn.Module) -> str | None:
    kind = type(module)
    if kind is nn.Linear:
        return "linear"
    if _HFConv1D is not None and kind is _HFConv1D:
        return "conv1d"
    if kind is nn.Embedding:
        return "embedding"
    if kind is nn.LayerNorm:
        return "layer_norm"
    if kind is nn.Conv2d:
        return "conv2d"
    return None


def _native_problem(module: nn.Module) -> str | None:
    if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.sparse):
        return "nn.Embedding with max_norm (renormalizes in place) or sparse=True"
    if isinstance(module, nn.Embedding) and module.scale_grad_by_freq:
        return "nn.Embedding with scale_grad_by_freq=True (batch-dependent gradients)"
    if isinstance(module, nn.Conv2d) and (
        module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding, str)
    ):
        return "nn.Conv2d with groups > 1, a non-zero padding_mode or string padding"
    return None


def _walk(module: nn.Module, path: str = ""):
    """``(path, module, how)`` for every module to hook, mirroring dp_hf.grad_sample's traversal.

    ``how`` is ``"native"``, ``"patch"`` or ``None`` (owns trainable parameters we cannot handle).
    Modules whose own trainable parameters are aliases of a descendant's (BERT's MLM ``bias``) are
    skipped: the descendant accounts for every use of the tensor.
    """
    owns = any(p.requires_grad for p in module.parameters(recurse=False))
    if owns and not _only_aliases_descendant_parameters(module):
        if _native_kind(module) is not None and _native_problem(module) is None:
            yield path, module, _NATIVE
            return
        if type(module) in _PATCH_EMBEDDING_LAYOUTS:
            yield path, module, _PATCH
        else:
            yield path, module, None
            return
    for name, child in module.named_children():
        yield from _walk(child, f"{path}.{name}" if path else name)


def unsupported_modules(model: nn.Module) -> list[tuple[str, str, str]]:
    """``(path, type, reason)`` for every trainable module the fast path cannot handle (empty: supported)."""
    problems = []
    for path, module, how in _walk(model):
        if how is None:
            reason = _native_problem(module) or "no fast per-example rule for this module type"
            problems.append((path, type(module).__name__, reason))
    return problems


def is_identity_geometry(geometry: Geometry) -> bool:
    """``c = 0`` and ``s = 1`` for every tensor: the clipped sum then needs only per-example norms."""
    shift_identity = geometry.shift is None or all(c is None for c in geometry.shift)
    scale_identity = geometry.scale is None or all(s is None for s in geometry.scale)
    return shift_identity and scale_identity


def has_identity_geometry(optimizer: Any) -> bool:
    """Whether a DP optimizer (class or instance) always clips in the identity geometry.

    True when it declares ``identity_geometry = True`` and does not override ``geometry()``
    (a subclass that adapts its geometry but forgot the flag is thus never given ghost clipping).
    """
    from dp_hf.optim.base import DPOptimizer

    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    if getattr(cls, "identity_geometry", False) is not True:
        return False
    return getattr(cls, "geometry", None) is DPOptimizer.geometry


def resolve_per_sample_gradient_mode(requested: str, optimizer: Any, model: nn.Module) -> tuple[str, bool]:
    """``(mode, fast)`` for a DP optimizer (class or instance) and a model.

    ``mode`` is ``"ghost"`` (norms only, identity geometry) or ``"materialize"`` (per-example
    gradients, any geometry); ``fast`` says whether this module's hooks handle the model
    (otherwise Opacus's hooks write ``p.grad_sample``). ``"auto"`` picks ghost whenever the
    optimizer's geometry is the identity and the model is supported.
    """
    if requested not in PER_SAMPLE_GRADIENT_MODES:
        raise ValueError(
            f"per_sample_gradient_mode={requested!r} is unknown; choose one of {list(PER_SAMPLE_GRADIENT_MODES)}."
        )
    problems = unsupported_modules(model)
    identity = has_identity_geometry(optimizer)
    name = optimizer.__name__ if isinstance(optimizer, type) else type(optimizer).__name__
    if requested == "ghost":
        if not identity:
            raise ValueError(
                f"per_sample_gradient_mode='ghost' needs an optimizer that clips in the identity geometry "
                f"(c = 0, s = 1); {name} adapts its clipping geometry and needs the per-example gradients "
                "themselves. Use 'materialize' or 'auto'."
            )
        if problems:
            raise UnsupportedModuleError(problems)
        return "ghost", True
    if requested == "materialize":
        return "materialize", not problems
    return ("ghost", True) if identity and not problems else ("materialize", not problems)


# --------------------------------------------------------------------------------------------------
# The hooks
# --------------------------------------------------------------------------------------------------

# module -> owning FastClipping (weak: a deep copy of a hooked module is not hooked, its forward
# falls back to the class's and any gradient it produces is refused as unrecorded).
_OWNERS: weakref.WeakKeyDictionary[nn.Module, FastClipping] = weakref.WeakKeyDictionary()


def _owner_recording(module: nn.Module) -> FastClipping | None:
    owner = _OWNERS.get(module)
    if owner is not None and owner._recording(module):
        return owner
    return None


def _linear_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    owner = _owner_recording(self)
    if owner is None:
        return type(self).forward(self, input)
    x = owner._batch_input(self, input)
    return _LinearFunction.apply(x, self.weight, self.bias, False, owner._sink(self, "linear"))


def _conv1d_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    owner = _owner_recording(self)
    if owner is None:
        return type(self).forward(self, x)
    x = owner._batch_input(self, x)
    return _LinearFunction.apply(x, self.weight, self.bias, True, owner._sink(self, "conv1d"))


def _embedding_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    owner = _owner_recording(self)
    if owner is None:
        return type(self).forward(self, input)
    ids = owner._batch_input(self, input, expand_broadcast=True)
    return _EmbeddingFunction.apply(ids, self.weight, self.padding_idx, owner._sink(self, "embedding"))


def _layer_norm_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    owner = _owner_recording(self)
    if owner is None:
        return type(self).forward(self, input)
    x = owner._batch_input(self, input)
    return _LayerNormFunction.apply(
        x, self.weight, self.bias, list(self.normalized_shape), self.eps, owner._sink(self, "layer_norm")
    )


def _conv2d_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    owner = _owner_recording(self)
    if owner is None:
        return type(self).forward(self, input)
    x = owner._batch_input(self, input)
    return _Conv2dFunction.apply(
        x, self.weight, self.bias, self.stride, self.padding, self.dilation, owner._sink(self, "conv2d")
    )


_FORWARDS = {
    "linear": _linear_forward,
    "conv1d": _conv1d_forward,
    "embedding": _embedding_forward,
    "layer_norm": _layer_norm_forward,
    "conv2d": _conv2d_forward,
}


class FastClipping:
    """Per-example clipping hooks on ``model`` (see the module docstring); create with :func:`attach_fast_clipping`.

    Args:
        model: the model, already frozen / PEFT-wrapped as it will be trained.
        mode: ``"ghost"`` (default): norms from factors, identity geometry only;
            ``"materialize"``: per-example gradients formed layer by layer, any geometry.
            Either way the clipped sum is formed by book-keeping, without a second backward.
        layer_strategy: ``"auto"`` (per layer call, keep the smaller of ``G_i`` and
            ``(a_i, g_i)``), or force ``"ghost"`` (factors) / ``"materialize"`` (``G_i``) for
            every Linear/Conv call (for tests and benchmarks).
        chunk_bytes: bound on transient per-chunk buffers (Gram matrices, materialized ``G_i``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        mode: str = "ghost",
        layer_strategy: str = "auto",
        chunk_bytes: int = 256 * 2**20,
    ) -> None:
        if mode not in ("ghost", "materialize"):
            raise ValueError(f"mode must be 'ghost' or 'materialize', got {mode!r}")
        if layer_strategy not in LAYER_STRATEGIES:
            raise ValueError(f"layer_strategy must be one of {LAYER_STRATEGIES}, got {layer_strategy!r}")
        self.model = model
        self.mode = mode
        self.layer_strategy = layer_strategy
        self.chunk_bytes = int(chunk_bytes)
        self.enabled = True
        self._records: dict[int, _ParamRecord] = {}
        self._native_params: set[int] = set()
        self._hooked: list[nn.Module] = []
        self._handles: list[RemovableHandle] = []
        self._forward_batch = _ForwardBatch()
        self._forward_id = 0  # counts top-level forward passes
        self._recorded_forwards: set[int] = set()  # forward passes whose backward was recorded
        self._removed = False

    # -- attaching --------------------------------------------------------------------------------

    def _attach(self) -> None:
        problems = unsupported_modules(self.model)
        if problems:
            raise UnsupportedModuleError(problems)
        validate_model(self.model)
        for module in self.model.modules():
            if module in _OWNERS:
                raise ValueError(
                    "fast clipping hooks are already attached to this model; remove() them first"
                )
        try:
            for _, module, how in _walk(self.model):
                _OWNERS[module] = self
                self._hooked.append(module)
                if how == _NATIVE:
                    module.forward = types.MethodType(_FORWARDS[_native_kind(module)], module)
                    self._native_params.update(id(p) for p in module.parameters(recurse=False))
                else:
                    self._handles.append(
                        module.register_forward_hook(self._patch_embedding_hook, with_kwargs=True)
                    )
            self._install_batch_size_recorders()
        except BaseException:
            self.remove()
            raise

    def _install_batch_size_recorders(self) -> None:
        """Record the batch size ``B`` of each forward pass (as :mod:`dp_hf.grad_sample` does)."""
        frames = self._forward_batch

        for module in self.model.modules():
            is_root = module is self.model
            positions = _batch_input_positions(module)
            if not positions and not is_root:
                continue

            def record(module, args, kwargs, positions=positions, is_root=is_root):
                if not frames.frames:  # outermost call: a new forward pass (new examples)
                    self._forward_id += 1
                frames.frames.append(
                    (module, _batch_size_of_call(positions, args, kwargs, positional_fallback=is_root))
                )

            def forget(module, args, kwargs, output):
                if frames.frames and frames.frames[-1][0] is module:
                    frames.frames.pop()

            self._handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
            self._handles.append(module.register_forward_hook(forget, with_kwargs=True, always_call=True))

    def remove(self) -> None:
        """Restore every module's forward, remove the hooks and drop what was recorded."""
        for module in self._hooked:
            if "forward" in module.__dict__:
                del module.forward
            _OWNERS.pop(module, None)
        self._hooked.clear()
        while self._handles:
            self._handles.pop().remove()
        self._records.clear()
        self._removed = True

    def __enter__(self) -> FastClipping:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def disable(self) -> None:
        """Stop recording (forward passes then run the modules' own forward)."""
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True

    def clear(self) -> None:
        """Forget what the last backward pass recorded."""
        self._records.clear()
        self._recorded_forwards.clear()

    # -- recording --------------------------------------------------------------------------------

    def _recording(self, module: nn.Module) -> bool:
        return (
            self.enabled
            and module.training
            and torch.is_grad_enabled()
            and any(p.requires_grad for p in module.parameters(recurse=False))
        )

    def _batch_input(
        self, module: nn.Module, x: torch.Tensor, *, expand_broadcast: bool = False
    ) -> torch.Tensor:
        """``x`` with its first dimension checked to be the batch (broadcast ``[1, ...]`` ids expanded)."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or (x.dim() < 2 and not expand_broadcast):
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise PerSampleGradientError(
                f"{type(module).__name__} got an input of shape {shape} without a batch dimension; "
                "per-example gradients need batch-first inputs."
            )
        batch = self._forward_batch.batch_size
        if batch is None or x.shape[0] == batch:
            return x
        if expand_broadcast and x.shape[0] == 1:
            # Broadcast position / token-type ids: one row per example, same values, so that the
            # backward pass delivers per-example output gradients (see dp_hf.grad_sample).
            return x.expand(batch, *x.shape[1:])
        raise PerSampleGradientError(
            f"{type(module).__name__} received an input with leading dimension {x.shape[0]} in a forward pass of "
            f"batch size {batch}: its rows are not examples (a broadcast or flattened batch dimension)."
        )

    def _record(self, param: torch.Tensor) -> _ParamRecord:
        record = self._records.get(id(param))
        if record is None:
            record = self._records[id(param)] = _ParamRecord(param)
        return record

    def _prefer_dense(self, rows: int, cols: int, positions: int) -> bool:
        """Keep ``G_i`` (``R C`` floats) rather than ``(a_i, g_i)`` (``T (R + C)``) when it is smaller."""
        if self.layer_strategy == "materialize":
            return True
        if self.layer_strategy == "ghost":
            return False
        return rows * cols <= positions * (rows + cols)

    def _add_outer(self, param: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, num_rows: int) -> None:
        record = self._record(param)
        if self._prefer_dense(num_rows, cols.shape[-1], cols.shape[1]):
            dense = torch.bmm(rows.float().transpose(1, 2), cols.float())  # [B, R, C]
            record.add_dense(dense.view(rows.shape[0], *param.shape))
        else:
            record.outers.append(_Outer(rows, cols, num_rows))

    def _sink(self, module: nn.Module, kind: str) -> _Sink:
        return _BoundSink(self, module, kind, self._forward_id)

    def _record_linear(
        self, module: nn.Module, x: torch.Tensor, grad: torch.Tensor, transposed: bool
    ) -> None:
        batch = x.shape[0]
        a = x.reshape(batch, -1, x.shape[-1])
        g = grad.reshape(batch, -1, grad.shape[-1])
        weight, bias = module.weight, module.bias
        if weight.requires_grad:
            if transposed:  # Conv1D weight [d_in, d_out]: G_i = a_i^T g_i
                self._add_outer(weight, a, g, weight.shape[0])
            else:  # Linear weight [d_out, d_in]: G_i = g_i^T a_i
                self._add_outer(weight, g, a, weight.shape[0])
        if bias is not None and bias.requires_grad:
            self._record(bias).add_dense(g.float().sum(dim=1))

    def _record_embedding(self, module: nn.Module, ids: torch.Tensor, grad: torch.Tensor) -> None:
        if not module.weight.requires_grad:
            return
        batch = ids.shape[0]
        ids = ids.reshape(batch, -1)
        g = grad.reshape(batch, ids.shape[1], -1)
        if module.padding_idx is not None:
            # F.embedding never sends gradient to weight[padding_idx]; neither do we.
            g = g.masked_fill((ids == module.padding_idx)[:, :, None], 0)
        self._record(module.weight).outers.append(_Outer(ids, g, module.num_embeddings, rows_are_ids=True))

    def _record_layer_norm(
        self, module: nn.Module, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, grad: torch.Tensor
    ) -> None:
        batch, shape = x.shape[0], tuple(module.normalized_shape)
        g = grad.float().reshape(batch, -1, *shape)
        if module.weight is not None and module.weight.requires_grad:
            xhat = ((x.float() - mean.float()) * rstd.float()).reshape(batch, -1, *shape)
            self._record(module.weight).add_dense((g * xhat).sum(dim=1))
        if module.bias is not None and module.bias.requires_grad:
            self._record(module.bias).add_dense(g.sum(dim=1))

    def _record_conv2d(self, module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
        batch = x.shape[0]
        g = grad.reshape(batch, grad.shape[1], -1).transpose(1, 2)  # [B, L, out]
        if module.weight.requires_grad:
            patches = F.unfold(x, module.kernel_size, module.dilation, module.padding, module.stride)
            self._add_outer(module.weight, g, patches.transpose(1, 2), module.out_channels)
        if module.bias is not None and module.bias.requires_grad:
            self._record(module.bias).add_dense(g.float().sum(dim=1))

    def _patch_embedding_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._recording(module) or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        signature = _safe_signature(module)
        arguments = signature.bind(*args, **kwargs).arguments if signature is not None else dict(kwargs)
        pixel_values = args[0] if args else kwargs["pixel_values"]
        mask = arguments.get("bool_masked_pos")
        call = _PatchEmbeddingCall(
            bool_masked_pos=mask.detach() if isinstance(mask, torch.Tensor) else None,
            interpolate_pos_encoding=bool(arguments.get("interpolate_pos_encoding") or False),
            height=int(pixel_values.shape[-2]),
            width=int(pixel_values.shape[-1]),
        )
        batch = self._forward_batch.batch_size
        if batch is not None and output.shape[0] != batch:
            raise PerSampleGradientError(f"{type(module).__name__} output is not batch-first")
        forward_id = self._forward_id

        def record(grad: torch.Tensor) -> None:
            if self._removed:
                return
            self._recorded_forwards.add(forward_id)
            # dp_hf.grad_sample's exact sampler pops the call it is given (LIFO, like its own recorder).
            module.__dict__.setdefault("_dp_hf_patch_embedding_calls", []).append(call)
            for param, per_example in _patch_embedding_grad_sample(module, [pixel_values], grad).items():
                if param.requires_grad:
                    self._record(param).add_dense(per_example)

        output.register_hook(record)

    # -- clipping ---------------------------------------------------------------------------------

    def _check_params(self, params: Sequence[torch.Tensor]) -> int | None:
        """Batch size of the recorded pass; refuse gradients that bypassed the hooks.

        Row ``i`` of every record must be example ``i``: two forward passes back-propagated before
        clipping would merge different examples into one "example" (twice the sensitivity), so
        that is refused, as is any gradient that reached a tensor outside the hooked forwards.
        """
        if len(self._recorded_forwards) > 1:
            raise PerSampleGradientError(
                f"{len(self._recorded_forwards)} forward passes were back-propagated before clipping; their rows would "
                "be taken for the same examples. Clip (accumulate) after each backward pass, and sum the losses of "
                "one batch before a single backward."
            )
        sizes = {record.batch_size for record in self._records.values()}
        if len(sizes) > 1:
            raise PerSampleGradientError(
                f"the recorded per-example gradients disagree on the batch size ({sorted(sizes)}): several forward "
                "passes of different batches were back-propagated before clipping."
            )
        for index, p in enumerate(params):
            if p.grad is None:
                continue
            record = self._records.get(id(p))
            outside = record is None or id(p) in self._native_params
            if not outside and record.dense is not None and not record.outers:
                # Hook-mode tensors (ViT/DeiT raw parameters) also get autograd's .grad: it must be
                # the sum of what the hooks saw, or the tensor was used elsewhere too.
                # Compared where both sums are finite: an example with inf/NaN entries (dropped when
                # clipping) makes both non-finite, and must not be taken for a use outside the hooks.
                total, grad = record.dense.sum(dim=0), p.grad.float()
                finite = torch.isfinite(total) & torch.isfinite(grad)
                total, grad = torch.where(finite, total, 0.0), torch.where(finite, grad, 0.0)
                scale = float(grad.abs().max()) + float(total.abs().max())
                outside = not torch.allclose(total, grad, rtol=1e-3, atol=1e-4 * scale + 1e-12)
            if outside:
                raise PerSampleGradientError(
                    f"trainable parameter #{index} (shape {tuple(p.shape)}) received a gradient outside the hooked "
                    "modules (used outside its module's forward, or by an unhooked module), so it cannot be clipped "
                    "per example. Use the weight only by calling its module, or freeze it (requires_grad=False)."
                )
        return next(iter(sizes)) if sizes else None

    def _identity_sq_norms(
        self, record: _ParamRecord, batch: int, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """``||G_i||^2`` with every cross term between the uses of a (tied) parameter."""
        budget = self.chunk_bytes
        sq = torch.zeros(batch, dtype=dtype, device=record.param.device)
        if record.dense_sq_norms is not None and dtype == torch.float32:
            sq += record.dense_sq_norms
        elif record.dense is not None:
            sq += torch.linalg.vector_norm(record.dense.reshape(batch, -1).to(dtype), dim=1).square()
        outers = record.outers
        if outers and all(o.rows_are_ids for o in outers):
            example, _, rows = _ids_rows(outers, dtype)  # cross terms included by summing rows first
            sq.index_add_(0, example, rows.pow(2).sum(dim=1))
            if record.dense is not None:
                sq += 2 * sum(_dense_outer_inner(record.dense, o, budget, dtype) for o in outers)
            return sq
        for k, o in enumerate(outers):
            sq += _outer_sq_norm(o, budget, dtype)
            if record.dense is not None:
                sq += 2 * _dense_outer_inner(record.dense, o, budget, dtype)
            for other in outers[k + 1 :]:
                sq += 2 * _outer_inner(o, other, budget, dtype)
        return sq

    def _geometry_sq_norms(
        self,
        record: _ParamRecord | None,
        p: torch.Tensor,
        shift: torch.Tensor | None,
        scale: torch.Tensor | None,
        batch: int,
        device,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """``||(G_i - c) / s||^2``, forming ``G_i`` layer by layer in chunks (sparse for embeddings)."""
        c = shift.to(dtype) if shift is not None else None
        s = scale.to(dtype) if scale is not None else None
        sq = torch.zeros(batch, dtype=dtype, device=device)
        if c is not None:  # ||c / s||^2: what an example with G_i = 0 contributes
            base = c / s if s is not None else c
            base_sq = base.pow(2).sum()
        else:
            base, base_sq = None, None
        if record is None:
            return sq + base_sq if base_sq is not None else sq
        if record.dense is None and record.outers and all(o.rows_are_ids for o in record.outers):
            example, ids, rows = _ids_rows(record.outers, dtype)
            shape = record.matrix_shape
            c_rows = c.reshape(shape)[ids] if c is not None else None
            s_rows = s.reshape(shape)[ids] if s is not None else None
            w = rows if c_rows is None else rows - c_rows
            if s_rows is not None:
                w = w / s_rows
            correction = w.pow(2).sum(dim=1)
            if base is not None:
                correction -= base.reshape(shape)[ids].pow(2).sum(dim=1)
                sq += base_sq
            return sq.index_add_(0, example, correction)
        numel = p.numel()
        itemsize = torch.empty((), dtype=dtype).element_size()
        for start, stop in _chunks(batch, 3 * itemsize * numel, self.chunk_bytes):
            g = self._materialize(record, start, stop, dtype)  # [n, *p.shape]
            if c is not None:
                g = g - c
            if s is not None:
                g = g / s
            sq[start:stop] += g.reshape(stop - start, -1).pow(2).sum(dim=1)
        return sq

    def _materialize(
        self, record: _ParamRecord, start: int, stop: int, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        shape = record.param.shape
        total = record.dense[start:stop].to(dtype, copy=True) if record.dense is not None else None
        for o in record.outers:
            g = _outer_materialize(o, start, stop, dtype).view(stop - start, *shape)
            total = g if total is None else total.add_(g)
        return total

    def _sq_norms(
        self,
        records: Sequence[_ParamRecord | None],
        params: Sequence[torch.Tensor],
        geometry: Geometry,
        batch: int,
        device,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """``||w_i||^2`` over every tensor of ``params``, ``[batch]`` float64, computed in ``dtype``."""
        sq = torch.zeros(batch, dtype=torch.float64, device=device)
        for k, (p, record) in enumerate(zip(params, records)):
            if self.mode == "ghost":
                if record is not None:
                    sq += self._identity_sq_norms(record, batch, dtype).to(device, torch.float64)
            else:
                shift = geometry.shift[k] if geometry.shift is not None else None
                scale = geometry.scale[k] if geometry.scale is not None else None
                part = self._geometry_sq_norms(record, p, shift, scale, batch, p.device, dtype)
                sq += part.to(device, torch.float64)
        return sq

    @staticmethod
    def _weighted_sum(
        record: _ParamRecord,
        factors: torch.Tensor,
        keep: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """``sum_i f_i G_i`` (book-keeping: no per-example gradient for the outers), in ``dtype``.

        ``keep`` (given when some examples are left out) masks the others out: a dropped example's
        recorded tensors may hold inf/NaN, and ``0 * inf`` is NaN.
        """
        shape = record.param.shape
        total = None
        if record.dense is not None:
            dense = record.dense.to(dtype)
            dense = dense if keep is None else _mask_batch(dense, keep)
            total = torch.einsum("i,i...->...", factors.to(dtype), dense)
        for o in record.outers:
            part = _outer_weighted_sum(o, factors, keep, dtype).view(shape)
            total = part if total is None else total.add_(part)
        return total

    @torch.no_grad()
    def clipped_sum(
        self, params: Sequence[torch.Tensor], geometry: Geometry
    ) -> tuple[list[torch.Tensor], torch.Tensor] | None:
        """Clip every recorded example in ``geometry`` and sum: ``(sums, norms)`` like :func:`clip_and_sum`.

        ``sums`` is aligned with ``params`` (float32, in the ``w`` coordinates); ``norms`` are
        the ``[b]`` per-example norms ``||w_i||`` before clipping (float32; ``inf`` beyond its
        range, NaN for an example with inf/NaN entries). Returns ``None`` when nothing was
        recorded (no backward pass reached a hooked module). Clears the records.

        The factors are :func:`~dp_hf.privatizer.clip_factors`'s, the rule of every path.
        Norms are computed in float32 (Gram products, materialized chunks) and summed over the
        tensors in float64. An example with extreme magnitudes is redone in float64, both its
        norm and its share of the weighted sum, where products of float32 numbers are exact and
        cannot overflow: one whose float32 norm is not a finite non-negative number (huge
        activations or gradients overflow the Gram products: ``inf - inf``), or whose Gram
        products may underflow (:func:`_gram_underflow_risk`). So a finite per-example gradient
        is clipped to ``C``; one with inf/NaN entries keeps a non-finite norm and is dropped
        (factor 0, and masked out of the book-keeping products).
        """
        try:
            batch = self._check_params(params)
            if batch is None:
                return None
            identity = is_identity_geometry(geometry)
            if self.mode == "ghost" and not identity:
                raise ValueError(
                    "ghost clipping computes norms in the identity geometry only (c = 0, s = 1), but the optimizer "
                    "returned a shift or scale; use mode='materialize'."
                )
            device = next(iter(self._records.values())).param.device
            records = [self._records.get(id(p)) for p in params]
            sq = self._sq_norms(records, params, geometry, batch, device, torch.float32)
            redo = ~torch.isfinite(sq) | (sq < 0)  # overflow (inf, inf - inf) or cancellation below 0
            if self.mode == "ghost":
                for record in records:
                    for o in record.outers if record is not None else ():
                        risk = _gram_underflow_risk(o)
                        if risk is not None:
                            redo |= risk.to(device)
            rows, subset = None, None
            if redo.any():
                rows = redo.nonzero().squeeze(1)
                subset = [r.select(rows.to(r.param.device)) if r is not None else None for r in records]
                sq[rows] = self._sq_norms(subset, params, geometry, rows.shape[0], device, torch.float64)
            norms = sq.sqrt()  # NaN where still negative: dropped
            factors = clip_factors(norms, geometry.max_grad_norm)
            keep = factors > 0
            fast = keep if rows is None else keep.index_fill(0, rows, False)  # float32 book-keeping
            fast = None if fast.all() else fast
            total_factor = factors.sum()
            sums = []
            for k, (p, record) in enumerate(zip(params, records)):
                if record is None:
                    total = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                else:
                    f = factors.to(p.device)
                    total = self._weighted_sum(record, f, fast.to(p.device) if fast is not None else None)
                    if rows is not None:  # the redone examples' share, in float64 (<= C each: representable)
                        index = rows.to(p.device)
                        part = self._weighted_sum(
                            subset[k], f[index], keep.to(p.device)[index], torch.float64
                        )
                        total = total.add_(part.float())
                if not identity:  # sum_i f_i (G_i - c) / s = (sum_i f_i G_i - (sum_i f_i) c) / s
                    if geometry.shift is not None and geometry.shift[k] is not None:
                        total = total - total_factor.to(p.device) * geometry.shift[k].float()
                    if geometry.scale is not None and geometry.scale[k] is not None:
                        total = total / geometry.scale[k].float()
                sums.append(total)
            return sums, norms.float()
        finally:
            self.clear()

    def accumulate(self, optimizer: Any) -> torch.Tensor | None:
        """Clip the recorded micro-batch in ``optimizer``'s geometry and add it to its logical batch.

        Returns the per-example norms before clipping (``None`` when nothing was recorded).
        """
        params = optimizer.trainable_params()
        geometry = optimizer._current_geometry(params)
        if self._records and not is_identity_geometry(geometry) and self.mode == "ghost":
            self.clear()
            raise ValueError(
                f"{type(optimizer).__name__} clips in a non-identity geometry; ghost clipping cannot. "
                "Use per_sample_gradient_mode='materialize'."
            )
        result = self.clipped_sum(params, geometry)
        if result is None:
            if not is_identity_geometry(geometry):
                raise PerSampleGradientError(
                    "nothing was recorded for this micro-batch, but in a non-identity geometry every example "
                    "contributes -c/s: run the backward pass with the hooks enabled before accumulating."
                )
            return None
        sums, norms = result
        optimizer.accumulate_clipped_sum(sums, int(norms.shape[0]))
        return norms


@dataclass
class _BoundSink:
    """What an autograd function calls in backward: routes ``(tensors...)`` to the owner's recorder."""

    owner: FastClipping
    module: nn.Module
    kind: str
    forward_id: int

    def __call__(self, *tensors: torch.Tensor) -> None:
        owner, module = self.owner, self.module
        if owner._removed:
            return
        owner._recorded_forwards.add(self.forward_id)
        if self.kind in ("linear", "conv1d"):
            owner._record_linear(module, *tensors, transposed=self.kind == "conv1d")
        else:
            getattr(owner, f"_record_{self.kind}")(module, *tensors)


def attach_fast_clipping(
    model: nn.Module, *, mode: str = "ghost", layer_strategy: str = "auto", chunk_bytes: int = 256 * 2**20
) -> FastClipping:
    """Hook ``model`` (in place) for fast per-example clipping; see :class:`FastClipping`.

    Raises :class:`~dp_hf.grad_sample.UnsupportedModuleError` if a trainable module has no fast
    rule (see :func:`unsupported_modules`) or cannot have exact per-example gradients at all.
    """
    clipping = FastClipping(model, mode=mode, layer_strategy=layer_strategy, chunk_bytes=chunk_bytes)
    clipping._attach()
    return clipping
