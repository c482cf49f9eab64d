"""Swin's window attention on the fast path: the attention context as flattened rows of verified provenance.

``SwinAttention`` runs on windows, ``[B*nW, N, C]`` (``N = ws*ws``): ``SwinLayer`` partitions the
(padded, cyclically shifted) ``[B, H, W, C]`` map into a contiguous ``[B, H/ws, W/ws, ws, ws, C]`` tensor
and views it as windows, so row ``r`` is example ``r // nW``'s window ``r % nW`` and ``q/k/v_proj`` accept
it (:mod:`dp_hf.per_example.flat_rows`, provenance 1). Its ``o_proj`` reads the attention context, which
the class computes with a matmul over ``[B*nW, heads, N, d]`` then transposes and views: not a view of a
batch-first tensor, so the hooks refuse it, rightly, since nothing in that chain is verified.

While per-example gradients are recorded, :class:`SwinAttentionAdapters` shadows ``forward`` on each
``SwinAttention`` whose class forward is the known body (:data:`KNOWN_ATTENTION`, compared as source text
with its relative-bias module's forward, :data:`KNOWN_BIAS`) by :meth:`_WindowAttention.__call__`, which
computes the same attention with the batch kept as its own dimension:

* ``q, k, v = proj(x).view(B, nW, N, heads, d).transpose(2, 3)``: ``[B, nW, heads, N, d]``;
* ``s = q k^T * scale + (bias + mask)``, bias ``[1, 1, heads, N, N]`` (a frozen table) or ``[B, 1, heads, N,
  N]`` (a trainable one, see below) and the shift mask ``[1, nW, 1, N, N]`` (a constant of the window
  geometry, no gradient);
* ``p = dropout(softmax(s, -1))``, ``ctx = (p v).transpose(2, 3).contiguous()``: ``[B, nW, N, heads, d]``;
* ``o_proj(ctx.view(B*nW, N, C))``.

**Safety.** It is applied only when the window rows are verified (``per_example_rows`` on the input, as
``q_proj``'s own hook does; or ``nW = 1``, batch-first), so splitting the leading dimension as ``[B, nW]``
puts example ``b``'s windows in row ``b``. Every later op is batched over ``(B, nW)`` (matmuls), works
along the last dimension (softmax) or is elementwise, and the only other operands (bias, mask) carry no
gradient and no example's data (or, a trainable table's, is example ``b``'s own row of the lookup: below).
So ``ctx[b]`` is a function of example ``b``'s windows alone, and it is
materialised as a contiguous tensor whose leading dimension is ``B``: ``o_proj`` reads its row-major view,
which :mod:`~dp_hf.per_example.flat_rows` verifies (provenance 1) as for ``q/k/v``. No new provenance is
trusted: the proof is this code, run in place of the class's. The values are the eager implementation's
(the same products, sums and softmax per window; SDPA's fused kernel rounds differently). Anything else,
a differing body in any token, an instance override, a trainable bias table whose module is not hooked
(:func:`trainable_bias_problem`), another attention implementation, an attention function that is not
transformers' own (:func:`library_attention`: a function registered in ``ALL_ATTENTION_FUNCTIONS`` under
"sdpa" or "eager", or other objects bound to the names the class's forward reads; the replacement ignored
them before, so its per-example gradients were another model's than the hooks-off forward's: 5% off the
norms, 16% off the clipped sum for an attention output times 3), unverified rows or a mask that is not
``[nW, N, N]`` without gradient, runs the class's forward, which the hooks then refuse at ``o_proj`` (and a
hooked trainable table's lookup there, :func:`recorded_bias`). Outside recording (eval, no grad, disabled
hooks) the class's forward runs.

**A trainable table.** The class looks ``T`` (``[(2ws-1)^2, heads]``) up with ``index`` (``[N*N]``, a
constant buffer of the window size) once, ``[1, heads, N, N]``, broadcast over all ``B*nW`` windows:
autograd sums every example's score gradients into one ``dT``. The fast path's table
(:mod:`~dp_hf.per_example.ghost.support`, kind :data:`SWIN_BIAS`, only on a bias module recognised by
:func:`recognised_bias`) is instead looked up once *per example*, ``T[index.expand(B, N*N)]`` (ids shared,
stride 0), ``[B, heads, N, N]``, and broadcast over each example's ``nW`` windows only. Row ``b`` holds the
very values of the class's lookup (a gather: bit-identical forward) and reaches example ``b``'s scores only,
so its backprop is ``sum_w dS_{b,w}`` and the embedding rule records
``G_b[u] = sum_w sum_{t: index_t = u} dS_{b,w,t}``: example ``b``'s exact gradient
(:mod:`~dp_hf.per_example.ghost.shared_ids`: dense ``[B, R, heads]`` beyond 1024 positions). The lookup
gives ``T`` no ``.grad``; any other use of ``T`` while recording does, which the clipping refuses.

After ``o_proj`` the layer reverses the windows to ``[B, H, W, C]`` (``window_reverse`` views ``-1`` as
the batch, example-major as partitioned), rolls back over the spatial dims ``(1, 2)``, crops and adds the
residual: all batch-first, as drop path (one draw per example) and patch merging; the first-step probes
(alone vs. in pairs) back up the batch dimension of these, as for any batch-first layer.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dp_hf.per_example.adapters import InstanceAdapter, InstanceAdapters
from dp_hf.per_example.errors import PerSampleGradientError
from dp_hf.per_example.flat_rows import per_example_rows
from dp_hf.per_example.known_code import signature_and_body

__all__ = [
    "KNOWN_ATTENTION",
    "KNOWN_BIAS",
    "KNOWN_EAGER",
    "SWIN_BIAS",
    "SwinAttentionAdapters",
    "attach_swin_attention_adapters",
    "is_known_swin_attention",
    "library_attention",
    "recognised_bias",
    "recorded_bias",
    "trainable_bias_problem",
]

#: ``(signature, body)`` of ``SwinAttention.forward`` (transformers 5.x), as :func:`dp_hf.per_example.known_code.signature_and_body` spells them.
KNOWN_ATTENTION = (
    "self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None=None, "
    "**kwargs: Unpack[TransformersKwargs]",
    """input_shape = hidden_states.shape[:-1]
hidden_shape = (*input_shape, -1, self.head_dim)
query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
relative_position_bias = self.relative_position_bias()
if attention_mask is not None:
    num_windows = attention_mask.shape[0]
    batch_size = input_shape[0] // num_windows
    seq_len = input_shape[1]
    attention_mask = attention_mask.unsqueeze(1).unsqueeze(0).expand(batch_size, -1, -1, -1, -1).reshape(\
-1, 1, seq_len, seq_len)
    combined_mask = relative_position_bias + attention_mask
else:
    combined_mask = relative_position_bias
attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, \
eager_attention_forward)
attn_output, attn_weights = attention_interface(self, query_states, key_states, value_states, \
combined_mask, dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
attn_output = attn_output.reshape(*input_shape, -1).contiguous()
attn_output = self.o_proj(attn_output)
return (attn_output, attn_weights)""",
)
#: ``(signature, body)`` of ``SwinRelativePositionBias.forward``: ``table[index]`` as ``[1, heads, N, N]``.
KNOWN_BIAS = (
    "self",
    """relative_position_bias = self.relative_position_bias_table[self.relative_position_index]
relative_position_bias = relative_position_bias.view(self.window_area, self.window_area, -1)
return relative_position_bias.permute(2, 0, 1).contiguous().unsqueeze(0)""",
)
#: The replaced-forward kind of a recognised bias module (:func:`recognised_bias`; ghost/functions.py).
SWIN_BIAS = "swin_bias"
#: The attention implementations whose values the replacement computes (eager's exactly; SDPA's math).
_IMPLEMENTATIONS = (None, "eager", "sdpa")
#: ``(signature, body)`` of Swin's ``eager_attention_forward`` (transformers 5.x): what the replacement computes.
KNOWN_EAGER = (
    "module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | "
    "None, scaling: float | None=None, dropout: float=0.0, **kwargs: Unpack[TransformersKwargs]",
    """if scaling is None:
    scaling = query.size(-1) ** (-0.5)
attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
if attention_mask is not None:
    attn_weights = attn_weights + attention_mask
attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
attn_output = torch.matmul(attn_weights, value)
attn_output = attn_output.transpose(1, 2).contiguous()
return (attn_output, attn_weights)""",
)


def _library_attention_functions() -> tuple[object, Callable]:
    """transformers' attention interface and its SDPA function (imported here: Swin's module has imported them)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS, sdpa_attention_forward


def library_attention(module: nn.Module) -> bool:
    """Whether the class's forward of a known Swin attention (:func:`is_known_swin_attention`) would now call
    transformers' own eager (:data:`KNOWN_EAGER`) or SDPA function, whose values the replacement computes: its
    globals ``ALL_ATTENTION_FUNCTIONS`` and ``eager_attention_forward`` as it reads them at this call, and the
    function the interface gives for the configured implementation (a function registered under "sdpa" or
    "eager", or another object bound to those names, ran in the class's forward and not in the replacement)."""
    implementation = module.config._attn_implementation
    if implementation not in _IMPLEMENTATIONS:
        return False
    namespace = getattr(type(module).forward, "__globals__", {})
    interface, eager = namespace.get("ALL_ATTENTION_FUNCTIONS"), namespace.get("eager_attention_forward")
    library_interface, sdpa = _library_attention_functions()
    if interface is not library_interface or not inspect.isfunction(eager):
        return False
    try:
        function = interface.get_interface(implementation, eager)
    except (KeyError, TypeError, AttributeError):
        return False
    if function is sdpa:
        return implementation == "sdpa"
    return function is eager and signature_and_body(eager) == (KNOWN_EAGER[0], KNOWN_EAGER[1])


def _known_forward(module: nn.Module, known: tuple[str, str]) -> bool:
    """The class's forward is ``known``, not shadowed on the instance (but by the fast path's own replacements,
    hooked or copied: :func:`~dp_hf.per_example.ghost.functions.runs_class_forward`)."""
    from dp_hf.per_example.ghost.functions import (
        runs_class_forward,
    )  # (the ghost package imports this module)

    forward = getattr(type(module), "forward", None)
    return (
        runs_class_forward(module)
        and inspect.isfunction(forward)
        and signature_and_body(forward) == (known[0], known[1].replace("\\\n", ""))
    )


def is_known_swin_attention(module: nn.Module) -> bool:
    """A module whose forward and whose bias module's forward are Swin's known bodies, with the parts they
    use (``q/k/v/o_proj`` Linears, ``relative_position_bias`` with its table and index)."""
    bias = getattr(module, "relative_position_bias", None)
    return (
        isinstance(bias, nn.Module)
        and all(
            isinstance(getattr(module, name, None), nn.Linear)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj")
        )
        and isinstance(getattr(bias, "relative_position_bias_table", None), nn.Parameter)
        and isinstance(getattr(bias, "relative_position_index", None), torch.Tensor)
        and _known_forward(module, KNOWN_ATTENTION)
        and _known_forward(bias, KNOWN_BIAS)
    )


def recognised_bias(module: nn.Module) -> nn.Module | None:
    """The bias module of a known Swin attention (:func:`is_known_swin_attention`) whose table the fast path
    looks up per example (:func:`recorded_bias`), else None: it owns the table ``[(2ws-1)^2, heads]`` and the
    constant integer buffer ``relative_position_index`` (``N*N`` entries, within the table) and nothing else."""
    if not is_known_swin_attention(module):
        return None
    bias = module.relative_position_bias
    table, index, area = bias.relative_position_bias_table, bias.relative_position_index, bias.window_area
    if (
        [name for name, _ in bias.named_parameters()] != ["relative_position_bias_table"]
        or [name for name, _ in bias.named_buffers()] != ["relative_position_index"]
        or table.dim() != 2
        or table.shape[1] != module.num_attention_heads
        or index.dtype not in (torch.int64, torch.int32)
        or not isinstance(area, int)
        or index.numel() != area * area
        or (index.numel() and not (0 <= int(index.min()) and int(index.max()) < table.shape[0]))
    ):
        return None
    return bias


class _TableAsEmbedding:
    """What the embedding record reads of its module (``weight``, ``num_embeddings``, ``padding_idx``): a table."""

    def __init__(self, table: torch.Tensor) -> None:
        self.weight, self.num_embeddings, self.padding_idx = table, table.shape[0], None


def recorded_bias(bias: nn.Module, owner, batch: int | None) -> torch.Tensor:
    """A hooked bias module's forward while ``owner`` records: ``[B, heads, N, N]``, example ``b``'s lookup in row
    ``b`` (module docstring), recorded by the embedding rule. ``batch`` comes from the window attention; a
    call without it (the class's attention forward, the table broadcast over the batch's windows) is refused."""
    if batch is None or batch != owner.forward_state()[0]:
        raise PerSampleGradientError(
            f"dp_hf.per_example.swin: the trainable relative position bias table of {type(bias).__name__} was "
            "looked up outside the per-example window attention (the class's SwinAttention.forward ran: its window "
            "rows were not verified as example-major, or its mask or attention implementation is not supported, or "
            "its attention function is not transformers' own eager or SDPA one), "
            "where one lookup is broadcast over every example's windows and has no per-example gradient. Freeze "
            "the tables (relative_position_bias_table.requires_grad_(False)) or keep the windows example-major."
        )
    from dp_hf.per_example.ghost.functions import embedding_lookup  # (the ghost package imports this module)

    table, area = bias.relative_position_bias_table, bias.window_area
    ids = bias.relative_position_index.reshape(1, -1).expand(batch, -1)  # shared by every example (stride 0)
    values = embedding_lookup(
        ids, table, owner.sink(_TableAsEmbedding(table), "embedding")
    )  # [B, N*N, heads]
    return values.view(batch, area, area, -1).permute(0, 3, 1, 2)


def trainable_bias_problem(module: nn.Module) -> str | None:
    """Why the replacement leaves a known Swin attention alone because of its bias table (None: it does not):
    a trainable table whose bias module the fast path does not hook (unfrozen after attaching, or not
    :func:`recognised_bias`), so its lookup would not be recorded per example (the clipping then refuses
    its ``.grad``)."""
    from dp_hf.per_example.ghost.functions import has_owner  # (the ghost package imports this module)

    bias = module.relative_position_bias
    if bias.relative_position_bias_table.requires_grad and not has_owner(bias):
        return "its relative position bias table is trainable but its module is not hooked: freeze it"
    return None


class _WindowAttention(InstanceAdapter):
    """The per-example replacement of one ``SwinAttention.forward`` (an instance attribute shadowing the class's;
    a copy of a hooked attention is not hooked: :mod:`dp_hf.per_example.adapters`)."""

    def __call__(self, hidden_states, attention_mask=None, **kwargs):
        if self.owner is None:  # a copy of a hooked attention
            return self.original()(hidden_states, attention_mask, **kwargs)
        windows = self._windows(hidden_states, attention_mask)
        if windows is None:
            return self.original()(hidden_states, attention_mask, **kwargs)
        module, (batch, count) = self.module, windows
        rows, length, channels = hidden_states.shape
        heads, width = module.num_attention_heads, module.head_dim

        def split(states: torch.Tensor) -> torch.Tensor:  # [B*nW, N, C] -> [B, nW, heads, N, d]
            return states.view(batch, count, length, heads, width).transpose(2, 3)

        query, key, value = (split(p(hidden_states)) for p in (module.q_proj, module.k_proj, module.v_proj))
        bias = module.relative_position_bias
        if bias.relative_position_bias_table.requires_grad:  # hooked (_windows): [B, 1, heads, N, N]
            combined = bias(batch).unsqueeze(1)
        else:
            combined = bias().unsqueeze(1)  # [1, 1, heads, N, N]
        if attention_mask is not None:  # [nW, N, N] -> [1, nW, 1, N, N]
            combined = combined + attention_mask[None, :, None]
        scores = torch.matmul(query, key.transpose(-2, -1)) * module.scaling + combined
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        dropout = module.attention_dropout if module.training else 0.0
        probs = F.dropout(probs, p=dropout, training=module.training)
        context = torch.matmul(probs, value).transpose(2, 3).contiguous()  # [B, nW, N, heads, d]
        output = module.o_proj(context.view(rows, length, channels))  # a view of a [B, ...] tensor
        eager = module.config._attn_implementation in (None, "eager")
        return output, probs.view(rows, heads, length, length) if eager else None

    def _windows(self, hidden_states, attention_mask) -> tuple[int, int] | None:
        """``(B, nW)`` if the replacement applies to this call (module docstring), else None."""
        module = self.module
        batch, forward_id = self.owner.clipping.forward_state()
        if not (self.owner.clipping.enabled and module.training and torch.is_grad_enabled()) or batch is None:
            return None
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            return None
        rows, length, channels = hidden_states.shape
        if rows % batch or module.num_attention_heads * module.head_dim != channels:
            return None
        if rows != batch and per_example_rows(hidden_states, batch, forward_id) is None:
            return None
        count = rows // batch
        if attention_mask is not None and (
            not isinstance(attention_mask, torch.Tensor)
            or attention_mask.requires_grad
            or tuple(attention_mask.shape) != (count, length, length)
        ):
            return None
        if not library_attention(module) or trainable_bias_problem(module):
            return None
        return batch, count


class SwinAttentionAdapters(InstanceAdapters):
    """The per-example window attention on ``model``'s known Swin attentions (see the module docstring).

    ``clipping`` is the :class:`~dp_hf.per_example.ghost.clipping.FastClipping` whose hooks record: its
    ``enabled`` flag and ``forward_state()`` (batch size and forward id of the pass in progress)."""

    def __init__(self, model: nn.Module, clipping) -> None:
        super().__init__(model)
        self.clipping = clipping

    def attach(self) -> None:
        for module in self.candidates():
            if is_known_swin_attention(module):
                self.install(_WindowAttention(module, self))


def attach_swin_attention_adapters(model: nn.Module, clipping) -> SwinAttentionAdapters:
    """:class:`SwinAttentionAdapters` attached to ``model`` (``remove()`` them with the hooks)."""
    adapters = SwinAttentionAdapters(model, clipping)
    adapters.attach()
    return adapters
