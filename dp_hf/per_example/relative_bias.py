"""Per-example lookups of the trainable relative attention biases of T5's and MPNet's families (both paths).

T5's attention looks its relative position bias ``E`` (an ``nn.Embedding(num_buckets, H)``) up with a
``[q, k]`` bucket tensor that has no batch dimension: ``E(bucket)`` is ``[q, k, H]``, permuted to
``[1, H, q, k]`` and broadcast over the batch where it is added to the ``[B, H, q, k]`` attention scores
(and reused by the later layers). Autograd sums the broadcast's backprop over the batch before it reaches
``E``, so no hook on ``E`` can recover one example's share: the per-call shape check refuses it (the
bucket's first dimension is not the batch), or, when ``q`` happens to equal ``B``, the probe does.

While per-example gradients are recorded, :class:`RelativeBiasAdapters` shadows the method that builds the
bias (``compute_bias``; MPNet's ``compute_position_bias``) on each module whose method is one of the known
bodies (:data:`KNOWN_BODIES`: its signature and body compared as source text, as
:mod:`~dp_hf.per_example.ghost.support` does for scaled embeddings) by one that does the lookup *before*
the broadcast: ``E(bucket.expand(B, q, k))``, ``[B, q, k, H]``, permuted to ``[B, H, q, k]``.

**Exactness.** Every row ``b`` of the expanded lookup is ``E[bucket]``: the very values the broadcast
produced, and adding a ``[B, H, q, k]`` tensor to the scores rounds exactly as broadcasting a
``[1, H, q, k]`` one, so the forward is bit-identical. Row ``b`` is used by example ``b``'s attention only
(elementwise additions to its own scores, in every layer that reuses it), so the backprop row ``b`` that
the embedding's per-example rule receives is ``d loss_b / d E(bucket)``, and the rule's
``G_b = sum_t onehot(bucket_t) (x) backprop_{b,t}`` is example ``b``'s gradient. The bucket ids are shared
by all examples (a stride-0 expand), which the ghost recorder sums in ``O(B q k H)``
(:mod:`~dp_hf.per_example.ghost.shared_ids`). Any other method, a body that differs in any token, an
instance override, or a bias built outside a forward pass of known batch size, is left alone or refused:
the hooks' shape check and the probe then refuse it as before. Outside recording (evaluation, no grad,
hooks disabled) the class's own method runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from dp_hf.per_example.adapters import InstanceAdapter, InstanceAdapters
from dp_hf.per_example.batch import BatchSizeRecorder
from dp_hf.per_example.errors import PerSampleGradientError
from dp_hf.per_example.known_code import signature_and_body

__all__ = ["KNOWN_BODIES", "RelativeBiasAdapters", "attach_relative_bias_adapters", "per_example_lookup"]

_T5_SIGNATURE = "self, query_length, key_length, device=None, past_seen_tokens=0"
_T5_BODY = """if device is None:
    device = self.relative_attention_bias.weight.device
context_position = torch.arange(query_length, dtype=torch.long, device=device)[:, None] + past_seen_tokens
memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
relative_position = memory_position - context_position
relative_position_bucket = self._relative_position_bucket({bucket_args})
values = self.relative_attention_bias(relative_position_bucket)
values = values.permute([2, 0, 1]).unsqueeze(0)
return values"""
_LIMITS = "num_buckets=self.relative_attention_num_buckets, max_distance=self.relative_attention_max_distance"
_MPNET_SIGNATURE = "self, x, position_ids=None, num_buckets=32"
_MPNET_BODY = """bsz, qlen, klen = (x.size(0), x.size(1), x.size(1))
if position_ids is not None:
    context_position = position_ids[:, :, None]
    memory_position = position_ids[:, None, :]
else:
    context_position = torch.arange(qlen, dtype=torch.long, device=x.device)[:, None]
    memory_position = torch.arange(klen, dtype=torch.long, device=x.device)[None, :]
relative_position = memory_position - context_position
rp_bucket = self.relative_position_bucket(relative_position, num_buckets=num_buckets)
values = self.relative_attention_bias(rp_bucket)
values = values.permute([2, 0, 1]).unsqueeze(0)
values = values.expand((bsz, -1, qlen, klen)).contiguous()
return values"""


def _t5_buckets(module: nn.Module, relative_position: torch.Tensor) -> torch.Tensor:
    return module._relative_position_bucket(
        relative_position,
        bidirectional=not module.is_decoder,
        num_buckets=module.relative_attention_num_buckets,
        max_distance=module.relative_attention_max_distance,
    )


def _causal_buckets(module: nn.Module, relative_position: torch.Tensor) -> torch.Tensor:
    return module._relative_position_bucket(
        relative_position,
        bidirectional=False,
        num_buckets=module.relative_attention_num_buckets,
        max_distance=module.relative_attention_max_distance,
    )


def _own_config_buckets(module: nn.Module, relative_position: torch.Tensor) -> torch.Tensor:
    return module._relative_position_bucket(relative_position)


#: ``(method name, signature, body)`` -> the bucket computation of that body (None: MPNet's method).
#: T5, mT5, Pop2Piano, SwitchTransformers, UDOP and LongT5's full attention share the first; Pix2Struct's
#: text attention the second (always causal); UMT5 the third (its bucket reads its own config).
KNOWN_BODIES: dict[tuple[str, str, str], Callable[[nn.Module, torch.Tensor], torch.Tensor] | None] = {
    ("compute_bias", _T5_SIGNATURE, _T5_BODY.format(bucket_args=args)): buckets
    for args, buckets in (
        (f"relative_position, bidirectional=not self.is_decoder, {_LIMITS}", _t5_buckets),
        (f"relative_position, bidirectional=False, {_LIMITS}", _causal_buckets),
        ("relative_position", _own_config_buckets),
    )
}
KNOWN_BODIES[("compute_position_bias", _MPNET_SIGNATURE, _MPNET_BODY)] = None


def known_bias_method(module: nn.Module) -> tuple[str, Callable | None] | None:
    """``(method name, bucket computation)`` of a module whose bias method is a known body, else None.

    The module must own a plain ``nn.Embedding`` named ``relative_attention_bias`` and not shadow the method
    on the instance (an override is unknown code)."""
    if type(getattr(module, "relative_attention_bias", None)) is not nn.Embedding:
        return None
    for name in ("compute_bias", "compute_position_bias"):
        function = getattr(type(module), name, None)
        if function is None or name in module.__dict__ or not inspect.isfunction(function):
            continue
        key = signature_and_body(function)
        if key is not None and (name, *key) in KNOWN_BODIES:
            return name, KNOWN_BODIES[(name, *key)]
    return None


def per_example_lookup(embedding: nn.Module, bucket: torch.Tensor, batch: int) -> torch.Tensor:
    """``embedding(bucket)`` once per example, ``[B, *bucket.shape, H]``: ids expanded (shared, stride 0)
    *before* the lookup, so the backprop keeps one row per example."""
    return embedding(bucket.expand(batch, *bucket.shape))


class _PerExampleBias(InstanceAdapter):
    """The per-example replacement of one module's bias method (an instance attribute shadowing the class's; a
    copy of a hooked module is not hooked: :mod:`dp_hf.per_example.adapters`)."""

    def __init__(self, module: nn.Module, name: str, buckets: Callable | None, owner: RelativeBiasAdapters):
        super().__init__(module, owner, name)
        self.buckets = buckets

    def batch_size(self) -> int:
        batch = self.owner.batch.batch_size
        if batch is None:
            raise PerSampleGradientError(
                f"dp_hf.per_example.relative_bias: {self.owner.batch.describe(self.module)} built its relative "
                "position bias outside a forward pass of known batch size, so it cannot be looked up per "
                "example. Call the model (or a submodule taking input_ids) rather than the attention layer alone."
            )
        return batch

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        if self.owner is None or not self.owner.recording(self.module.relative_attention_bias):
            return self.original()(*args, **kwargs)
        if self.buckets is None:
            return self._mpnet(*args, **kwargs)
        return self._t5(*args, **kwargs)

    def _t5(self, query_length, key_length, device=None, past_seen_tokens=0) -> torch.Tensor:
        # The known body's arithmetic (KNOWN_BODIES), up to the lookup.
        embedding = self.module.relative_attention_bias
        if device is None:
            device = embedding.weight.device
        context_position = (
            torch.arange(query_length, dtype=torch.long, device=device)[:, None] + past_seen_tokens
        )
        memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        bucket = self.buckets(self.module, memory_position - context_position)  # [q, k]
        return per_example_lookup(embedding, bucket, self.batch_size()).permute(0, 3, 1, 2)  # [B, H, q, k]

    def _mpnet(self, x, position_ids=None, num_buckets=32) -> torch.Tensor:
        if position_ids is not None:  # [B, T] position ids: the class's method (batched already)
            return self.original()(x, position_ids, num_buckets)
        self.batch_size()  # (x's rows are checked against it by the lookup's hooks)
        qlen = klen = x.size(1)
        context_position = torch.arange(qlen, dtype=torch.long, device=x.device)[:, None]
        memory_position = torch.arange(klen, dtype=torch.long, device=x.device)[None, :]
        rp_bucket = self.module.relative_position_bucket(
            memory_position - context_position, num_buckets=num_buckets
        )
        values = per_example_lookup(self.module.relative_attention_bias, rp_bucket, x.size(0))
        return values.permute(0, 3, 1, 2).contiguous()  # [B, H, q, k], contiguous as MPNet's own


class RelativeBiasAdapters(InstanceAdapters):
    """The per-example bias methods on ``model``'s known relative-bias modules (see the module docstring).

    ``batch`` is the hooks' :class:`~dp_hf.per_example.batch.BatchSizeRecorder`; ``recording(embedding)`` says
    whether the hooks record that embedding's call now (else the class's own method runs).
    """

    def __init__(
        self, model: nn.Module, batch: BatchSizeRecorder, recording: Callable[[nn.Module], bool]
    ) -> None:
        super().__init__(model)
        self.batch, self.recording = batch, recording

    def attach(self) -> None:
        for module in self.candidates():
            known = known_bias_method(module)
            if known is not None and module.relative_attention_bias.weight.requires_grad:
                self.install(_PerExampleBias(module, *known, self))


def attach_relative_bias_adapters(
    model: nn.Module, batch: BatchSizeRecorder, recording: Callable[[nn.Module], bool]
) -> RelativeBiasAdapters:
    """:class:`RelativeBiasAdapters` attached to ``model`` (``remove()`` them with the hooks)."""
    adapters = RelativeBiasAdapters(model, batch, recording)
    adapters.attach()
    return adapters
