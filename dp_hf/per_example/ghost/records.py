"""What one backward pass records per trainable tensor: :class:`ParamRecord` s, filled by :class:`LayerRecorder`.

Per layer call we keep whichever of ``G_i`` (``d_in d_out`` floats per example, "dense") and
``(a_i, g_i)`` (``T (d_in + d_out)``, an :class:`~dp_hf.per_example.ghost.kernels.Outer`) is
smaller (``layer_strategy="auto"``): when ``G_i`` is smaller it is also cheaper to compute than the
two Gram matrices. Embeddings keep ``(ids, g)`` (ids shared by all examples: ``G_i``, see
:mod:`~dp_hf.per_example.ghost.shared_ids`); LayerNorm, biases, RMSNorm weights and the
ViT/DeiT raw parameters keep ``G_i``. A tensor used several times (tied embeddings) gets one record with every use.

Packed rows (padding-free batches, :mod:`~dp_hf.per_example.ghost.segments`): a sink created with
``segments`` regroups every per-token tensor of its layer call from ``[rows, T, ...]`` into
``[S, T_max, ...]`` (one zero-padded row per example) before anything is formed from it, so every
record, dense or factored, has one entry per example (segment), never per row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dp_hf.per_example.errors import PerSampleGradientError
from dp_hf.per_example.ghost.kernels import Outer, as_dtype, batched_matmul, example_sq_norms
from dp_hf.per_example.ghost.segments import Segments
from dp_hf.per_example.ghost.shared_ids import shared_ids_dense, takes_shared_ids_dense
from dp_hf.per_example.modes import LAYER_STRATEGIES
from dp_hf.per_example.samplers import PatchEmbeddingCall, patch_embedding_grad_samples

__all__ = ["SMALL_DENSE_BYTES", "LayerRecorder", "LayerSink", "ParamRecord"]

#: A dense ``G`` (all examples, float32) up to this size is small: biases, norm layers' weights. Its norm
#: and its clipped sum are taken together with the others' (dp_hf.per_example.ghost.norms).
SMALL_DENSE_BYTES = 1 << 20


@dataclass
class ParamRecord:
    """Everything recorded for one parameter in one micro-batch: ``G_i = dense_i + sum_k outers[k]_i``."""

    param: torch.Tensor
    dense: torch.Tensor | None = None  # [B, *param.shape], float32
    outers: list[Outer] = field(default_factory=list)
    # ||dense_i||^2 of a large dense G_i, taken while it is hot in cache (a small one's is taken in a
    # group with the others, see dp_hf.per_example.ghost.norms.small_dense_groups)
    dense_sq_norms: torch.Tensor | None = None

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

    def select(self, index: torch.Tensor) -> ParamRecord:
        """The record of the examples ``index`` only (for recomputing their norms)."""
        outers = [
            Outer(o.rows.index_select(0, index), o.cols.index_select(0, index), o.num_rows, o.rows_are_ids)
            for o in self.outers
        ]
        dense = self.dense.index_select(0, index) if self.dense is not None else None
        return ParamRecord(self.param, dense, outers)

    def add_dense(self, value: torch.Tensor) -> None:
        value = as_dtype(value, torch.float32)
        if self.dense is None:
            self.dense = value
            if value.numel() * value.element_size() > SMALL_DENSE_BYTES:
                self.dense_sq_norms = example_sq_norms(value)  # hot in cache
        else:  # a second use of the parameter: the norm of the sum is taken later
            self.dense = self.dense + value
            self.dense_sq_norms = None


@dataclass
class LayerSink:
    """What an autograd function calls in backward: routes ``(tensors...)`` to the recorder."""

    recorder: LayerRecorder
    module: nn.Module
    kind: str
    forward_id: int
    segments: Segments | None = None  # the examples of a packed batch, fixed at forward time

    def __call__(self, *tensors: torch.Tensor) -> None:
        self.recorder.record(self.module, self.kind, self.forward_id, *tensors, segments=self.segments)


class LayerRecorder:
    """The records of the micro-batch in progress (``records``: ``id(param) -> ParamRecord``).

    ``recorded_forwards`` are the forward passes whose backward reached a hooked layer; after
    :meth:`close` (hooks removed) late backward passes record nothing.
    """

    def __init__(self, layer_strategy: str = "auto") -> None:
        if layer_strategy not in LAYER_STRATEGIES:
            raise ValueError(f"layer_strategy must be one of {LAYER_STRATEGIES}, got {layer_strategy!r}")
        self.layer_strategy = layer_strategy
        self.records: dict[int, ParamRecord] = {}
        self.recorded_forwards: set[int] = set()
        self.closed = False

    def clear(self) -> None:
        self.records.clear()
        self.recorded_forwards.clear()

    def close(self) -> None:
        self.records.clear()
        self.closed = True

    def sink(
        self, module: nn.Module, kind: str, forward_id: int, segments: Segments | None = None
    ) -> LayerSink:
        return LayerSink(self, module, kind, forward_id, segments)

    def record(
        self,
        module: nn.Module,
        kind: str,
        forward_id: int,
        *tensors: torch.Tensor,
        segments: Segments | None = None,
    ) -> None:
        if self.closed:
            return
        self.recorded_forwards.add(forward_id)
        if kind in ("linear", "conv1d"):
            self._linear(module, *tensors, transposed=kind == "conv1d", segments=segments)
        elif kind in ("embedding", "layer_norm"):
            getattr(self, f"_{kind}")(module, *tensors, segments=segments)
        elif segments is not None:
            raise PerSampleGradientError(
                f"{type(module).__name__} ({kind}) cannot be split into the examples of packed rows; only "
                "token-wise layers (Linear, Conv1D, Embedding, LayerNorm) can. Train without padding_free."
            )
        else:
            getattr(self, f"_{kind}")(module, *tensors)

    def record_patch_embedding(
        self, module: nn.Module, call: PatchEmbeddingCall, forward_id: int, grad: torch.Tensor
    ) -> None:
        """The output gradient of a ViT-style embeddings call: its raw parameters' ``G_i``."""
        if self.closed:
            return
        self.recorded_forwards.add(forward_id)
        for param, per_example in patch_embedding_grad_samples(module, call, grad).items():
            if param.requires_grad:
                self._param(param).add_dense(per_example)

    def record_scale(
        self,
        module: nn.Module,
        param: torch.Tensor,
        forward_id: int,
        grad: torch.Tensor,
        direction: torch.Tensor,
        segments: Segments | None = None,
    ) -> None:
        """An RMSNorm-like call's output gradient ``g`` and ``z = dy/dw``: ``G_i = sum_t g_t * z_t`` (``[B, H]``).

        See :mod:`~dp_hf.per_example.ghost.scales`; packed rows sum per segment instead of per row.
        """
        if self.closed or not param.requires_grad:
            return
        self.recorded_forwards.add(forward_id)
        if direction.shape != grad.shape:
            raise PerSampleGradientError(
                f"{type(module).__name__}: the output derivative in the weight has shape {tuple(direction.shape)}, "
                f"the output gradient {tuple(grad.shape)}."
            )
        width = param.shape[0]
        product = as_dtype(grad, torch.float32) * as_dtype(direction, torch.float32)  # transient [B, ..., H]
        if segments is not None:
            per_example = segments.sum_tokens(product, f"the output gradient of a {type(module).__name__}")
        else:
            per_example = product.reshape(product.shape[0], -1, width).sum(dim=1)
        self._param(param).add_dense(per_example.reshape(-1, width))

    def batch_size(
        self,
        params: Sequence[torch.Tensor],
        unrecorded: set[int],
        name_of: Callable[[torch.Tensor], str | None] | None = None,
    ) -> int | None:
        """Batch size of the recorded pass; refuse gradients that bypassed the hooks.

        Row ``i`` of every record must be example ``i``: two forward passes back-propagated before
        clipping would merge different examples into one "example" (twice the sensitivity), so
        that is refused, as is any gradient that reached a tensor of ``params`` outside the hooked
        forwards (``unrecorded``: ids of the tensors whose ``.grad`` the hooks never produce).
        ``name_of(p)`` names a refused parameter in the error (its index otherwise).
        """
        if len(self.recorded_forwards) > 1:
            raise PerSampleGradientError(
                f"{len(self.recorded_forwards)} forward passes were back-propagated before clipping; their rows would "
                "be taken for the same examples. Clip (accumulate) after each backward pass, and sum the losses of "
                "one batch before a single backward."
            )
        sizes = {record.batch_size for record in self.records.values()}
        if len(sizes) > 1:
            raise PerSampleGradientError(
                f"the recorded per-example gradients disagree on the batch size ({sorted(sizes)}): several forward "
                "passes of different batches were back-propagated before clipping."
            )
        outside: list[int] = []
        verdicts: list[tuple[int, torch.Tensor]] = []  # whether G_i sum to .grad (hook mode); .grad is zero
        for index, p in enumerate(params):
            if p.grad is None:
                continue
            record = self.records.get(id(p))
            if record is None or id(p) in unrecorded:
                # Zeros (zero_grad(set_to_none=False), a released step's leftover) are no gradient at all.
                verdicts.append((index, p.grad.eq(0).all()))
            elif record.dense is not None and not record.outers:
                verdicts.append((index, _sums_to_grad(record.dense, p.grad)))
        if verdicts:  # one host read for all (a Llama has ~65 RMSNorm weights: one sync each before)
            device = verdicts[0][1].device
            agree = torch.stack([verdict.to(device) for _, verdict in verdicts]).tolist()
            outside += [index for (index, _), ok in zip(verdicts, agree) if not ok]
        if outside:
            index = min(outside)
            p = params[index]
            name = name_of(p) if name_of is not None else None
            where = repr(name) if name is not None else f"#{index}"
            raise PerSampleGradientError(
                f"trainable parameter {where} (shape {tuple(p.shape)}) received a gradient outside the hooked "
                "modules (used outside its module's forward, or by an unhooked module; or its module's "
                "per-example gradients do not add up to its .grad: a forward not of the form its rule assumes), "
                "so it cannot be clipped per example. Use the weight only by calling its module, or freeze it "
                "(requires_grad=False)."
            )
        return next(iter(sizes)) if sizes else None

    # -- per layer kind ---------------------------------------------------------------------------

    def _param(self, param: torch.Tensor) -> ParamRecord:
        record = self.records.get(id(param))
        if record is None:
            record = self.records[id(param)] = ParamRecord(param)
        return record

    def _prefer_dense(self, rows: int, cols: int, positions: int) -> bool:
        """Keep ``G_i`` (``R C`` floats) rather than ``(a_i, g_i)`` (``T (R + C)``) when it is smaller."""
        if self.layer_strategy == "materialize":
            return True
        if self.layer_strategy == "ghost":
            return False
        return rows * cols <= positions * (rows + cols)

    def _add_outer(self, param: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, num_rows: int) -> None:
        record = self._param(param)
        if self._prefer_dense(num_rows, cols.shape[-1], cols.shape[1]):
            # [B, R, C]; a bf16 layer's operands on CUDA: exact products on tensor cores, float32 sums
            # over positions (the float32 path's own rounding; LoRA's small matrices take this path).
            # (the very G_i whose norm is clipped and which is summed: no bound needed)
            dense = batched_matmul(rows.transpose(1, 2), cols, torch.float32, tensor_cores=True)
            record.add_dense(dense.view(rows.shape[0], *param.shape))
        else:
            record.outers.append(Outer(rows, cols, num_rows))

    def _linear(
        self,
        module: nn.Module,
        x: torch.Tensor,
        grad: torch.Tensor,
        transposed: bool,
        segments: Segments | None = None,
    ) -> None:
        batch = x.shape[0]
        a = _by_position(x, batch, x.shape[-1:])
        g = _by_position(grad, batch, grad.shape[-1:])
        if segments is not None:  # [rows, T, d] -> [examples, T_max, d]
            name = type(module).__name__
            a, g = (
                segments.regroup(a, f"the input of a {name}"),
                segments.regroup(g, f"the gradient of a {name}"),
            )
        weight, bias = module.weight, module.bias
        if weight.requires_grad:
            if transposed:  # Conv1D weight [d_in, d_out]: G_i = a_i^T g_i
                self._add_outer(weight, a, g, weight.shape[0])
            else:  # Linear weight [d_out, d_in]: G_i = g_i^T a_i
                self._add_outer(weight, g, a, weight.shape[0])
        if bias is not None and bias.requires_grad:
            self._param(bias).add_dense(g.sum(dim=1, dtype=torch.float32))  # reduce in float32, no cast copy

    def _embedding(
        self, module: nn.Module, ids: torch.Tensor, grad: torch.Tensor, segments: Segments | None = None
    ) -> None:
        if not module.weight.requires_grad:
            return
        batch = ids.shape[0]
        g = _by_position(grad, batch, grad.shape[ids.dim() :])  # [B, *positions, C] -> [B, T, C]
        ids = _by_position(ids, batch, ())
        if segments is not None:  # padded positions: id 0 with a zero gradient row, which adds nothing
            ids, g = (
                segments.regroup(ids, "the ids of an Embedding"),
                segments.regroup(g, "an Embedding gradient"),
            )
        if module.padding_idx is not None:
            # F.embedding never sends gradient to weight[padding_idx]; neither do we.
            g = g.masked_fill((ids == module.padding_idx)[:, :, None], 0)
        if segments is None and takes_shared_ids_dense(ids, module.num_embeddings):  # no [T, T] ghost norm
            self._param(module.weight).add_dense(shared_ids_dense(ids, g, module.num_embeddings))
            return
        self._param(module.weight).outers.append(Outer(ids, g, module.num_embeddings, rows_are_ids=True))

    def _layer_norm(
        self,
        module: nn.Module,
        x: torch.Tensor,
        mean: torch.Tensor,
        rstd: torch.Tensor,
        grad: torch.Tensor,
        segments: Segments | None = None,
    ) -> None:
        batch, shape = x.shape[0], tuple(module.normalized_shape)
        g = _by_position(as_dtype(grad, torch.float32), batch, shape)
        if segments is not None:
            g = segments.regroup(g, "a LayerNorm gradient")
        if module.weight is not None and module.weight.requires_grad:
            xhat = _by_position(
                (as_dtype(x, torch.float32) - as_dtype(mean, torch.float32)) * as_dtype(rstd, torch.float32),
                batch,
                shape,
            )
            if segments is not None:
                xhat = segments.regroup(xhat, "a LayerNorm input")
            self._param(module.weight).add_dense((g * xhat).sum(dim=1))
        if module.bias is not None and module.bias.requires_grad:
            self._param(module.bias).add_dense(g.sum(dim=1))

    def _conv2d(self, module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
        batch = x.shape[0]
        g = grad.reshape(batch, grad.shape[1], -1).transpose(1, 2)  # [B, L, out]
        if module.weight.requires_grad:
            patches = F.unfold(x, module.kernel_size, module.dilation, module.padding, module.stride)
            self._add_outer(module.weight, g, patches.transpose(1, 2), module.out_channels)
        if module.bias is not None and module.bias.requires_grad:
            self._param(module.bias).add_dense(g.sum(dim=1, dtype=torch.float32))


def _by_position(t: torch.Tensor, batch: int, trailing: Sequence[int]) -> torch.Tensor:
    """``t`` as ``[B, positions, *trailing]`` (a reshape only when it is not already: one op fewer per
    record, and this runs for every layer call)."""
    if t.dim() == 2 + len(trailing) and tuple(t.shape[2:]) == tuple(trailing):
        return t
    return t.reshape(batch, -1, *trailing)


def _sums_to_grad(dense: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Whether the hook-mode ``G_i`` (ViT/DeiT raw parameters, RMSNorm weights) sum to autograd's ``.grad``:
    a 0-d bool tensor on their device (read by the caller, once for all tensors).

    Those tensors also get autograd's ``.grad``: it must be the sum of what the hooks saw, or the
    tensor was used elsewhere too (or its module's forward is not of the form its rule assumes).
    Compared where both sums are finite: an example with inf/NaN entries (dropped when clipping)
    makes both non-finite, and must not be taken for a use outside the hooks. A ``.grad`` in a
    16-bit dtype is compared to its own rounding (``4 eps``: 3% for bf16) instead of ``1e-3``.
    """
    rtol = max(1e-3, 4 * torch.finfo(grad.dtype).eps)
    total, grad = dense.sum(dim=0), grad.float()
    finite = torch.isfinite(total) & torch.isfinite(grad)
    total, grad = torch.where(finite, total, 0.0), torch.where(finite, grad, 0.0)
    # allclose(total, grad, rtol, atol=rtol / 10 * scale + 1e-12), with the scale kept on the device
    scale = grad.abs().max() + total.abs().max()
    return ((total - grad).abs() <= rtol / 10 * scale + 1e-12 + rtol * grad.abs()).all()
