"""Layer scale of BEiT's and Data2VecVision's transformer layers on the fast path: recognising and recording it.

``BeitLayer`` and ``Data2VecVisionLayer`` own two 1-D parameters ``lambda_1``, ``lambda_2`` (``[H]``, "layer
scale") that their forward uses once each, as ``self.lambda_k * y`` with ``y`` the ``[B, T, H]`` output of the
attention (``k = 1``) or of the MLP (``k = 2``). With ``out = lambda * y`` (broadcast over ``B, T``),
``d out_{b,t,h} / d lambda_h = y_{b,t,h}``, so example ``b``'s gradient is ``G_b = sum_t g_{b,t} * y_{b,t}``
(``[H]``) with ``g = d loss / d out``: a dense record, as an RMSNorm weight's
(:meth:`~dp_hf.per_example.ghost.records.LayerRecorder.record_scale`, direction ``z = y``). The other
parameters of the layer belong to its children (Linear, LayerNorm), which keep their own rules.

How: :func:`is_layer_scale_block` accepts a module only if its class's forward, without docstring, comments,
decorators and annotations, hashes to one of :data:`KNOWN_FORWARDS` (read from its source: a changed forward,
a subclass overriding it, an instance override, is refused, never guessed at), and its own trainable
parameters are exactly its 1-D floating ``lambda_1``/``lambda_2``. While recording,
:class:`LayerScaleAdapters` runs that very forward (the class's code, not a copy) under a
``TorchFunctionMode`` that sees every torch call made in it (children's included): a multiplication
``lambda * y`` / ``y * lambda`` whose operand *is* a trainable lambda runs as it is (bit-identical) and an
output-gradient hook on its result records ``G_b``.

Safety: (1) any other torch call that receives a trainable lambda (another op, a second operand, a keyword)
raises, and each trainable lambda must be multiplied exactly once per forward (one use each, as the known
forwards do), so every path from a lambda to the loss goes through a recorded product; (2) ``y`` must have the
product's shape ``[B, ..., H]`` with ``B`` the batch size of the forward pass (rows are examples) and must not be
modified in place before the backward; (3) the lambdas still get autograd's ``.grad``, and the recorder
refuses a step where the recorded ``G_b`` do not add up to it (a use outside the hooks). Outside recording
(evaluation, no grad, hooks disabled) the class's forward runs without the mode. Opacus's hooks have no rule
for these layers (they are called with keyword inputs): there they stay refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from dp_hf.per_example.adapters import InstanceAdapter, InstanceAdapters
from dp_hf.per_example.errors import PerSampleGradientError
from dp_hf.per_example.ghost.functions import check_first_backward
from dp_hf.per_example.known_code import normalized_source

__all__ = [
    "KNOWN_FORWARDS",
    "LAMBDAS",
    "LayerScaleAdapters",
    "attach_layer_scale_adapters",
    "is_layer_scale_block",
]

#: The layer-scale parameters of the recognised layers (each used once per forward as ``lambda * y``).
LAMBDAS = ("lambda_1", "lambda_2")

#: sha256 of the normalized forward source (:func:`dp_hf.per_example.known_code.normalized_source`) of the recognised layers:
#: ``BeitLayer.forward`` and ``Data2VecVisionLayer.forward`` (transformers 5.x).
KNOWN_FORWARDS = frozenset(
    {
        "b6feebbef05bd494e6bd3d7fd2092814435c4297475bc1cd732435ed3a0e1880",  # BeitLayer
        "b00bf63d5a4065a32aca7a2862b66e3c6faed7b786bfdffde52fd0a25f19b8e1",  # Data2VecVisionLayer
    }
)

#: The multiplications routed to the recorder (``lambda * y`` is ``Tensor.__mul__``; ``y * lambda`` too).
_PRODUCTS = frozenset({torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.mul, torch.mul})


def forward_digest(kind: type) -> str | None:
    source = normalized_source(kind.forward)
    return None if source is None else hashlib.sha256(source.encode()).hexdigest()


def is_layer_scale_block(module: nn.Module) -> bool:
    """A layer whose forward is a known one (:data:`KNOWN_FORWARDS`), with no instance override of ``forward``
    (other than this module's adapter), whose own trainable parameters are only its 1-D ``lambda_1``/``lambda_2``."""
    forward = module.__dict__.get("forward")
    if forward is not None and not isinstance(forward, _RecordingForward):
        return False
    own = [(name, p) for name, p in module.named_parameters(recurse=False) if p.requires_grad]
    if not own or any(name not in LAMBDAS or p.dim() != 1 or not p.is_floating_point() for name, p in own):
        return False
    return forward_digest(type(module)) in KNOWN_FORWARDS


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value


class _RoutedProducts(TorchFunctionMode):
    """Runs every torch call as it is; a product ``lambda * y`` of a trainable lambda is handed to ``record``."""

    def __init__(self, forward: _RecordingForward, lambdas: dict[int, tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        self.forward, self.lambdas = forward, lambdas
        self.uses = {name: 0 for name, _ in lambdas.values()}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        touched = [leaf for leaf in _leaves((args, kwargs)) if id(leaf) in self.lambdas]
        if not touched:
            return func(*args, **kwargs)
        name, param = self.lambdas[id(touched[0])]
        other = [a for a in args if a is not param] if len(args) == 2 else []
        if func not in _PRODUCTS or kwargs or len(touched) != 1 or len(other) != 1:
            raise PerSampleGradientError(
                f"{type(self.forward.module).__name__} (dp_hf.per_example.ghost.layer_scale) used its {name} in "
                f"{getattr(func, '__name__', func)!r} other than as one operand of a product: not the recognised "
                "forward. Freeze the layer scale (requires_grad=False on lambda_1/lambda_2)."
            )
        self.uses[name] += 1
        output = func(*args)
        self.forward.record(name, param, other[0], output)
        return output


class _RecordingForward(InstanceAdapter):
    """The instance ``forward`` of one recognised layer (shadowing its class's while the hooks are attached; a
    copy of a hooked layer is not hooked: :mod:`dp_hf.per_example.adapters`)."""

    def __call__(self, *args, **kwargs):
        module = self.module
        if self.owner is None or not self.owner.recording(module):
            return type(module).forward(module, *args, **kwargs)
        lambdas = {id(p): (name, p) for name, p in module.named_parameters(recurse=False) if p.requires_grad}
        mode = _RoutedProducts(self, lambdas)
        with mode:
            output = type(module).forward(module, *args, **kwargs)
        if any(count != 1 for count in mode.uses.values()):
            raise PerSampleGradientError(
                f"{type(module).__name__} (dp_hf.per_example.ghost.layer_scale) multiplied by its layer scale "
                f"{mode.uses} times in one forward; the recognised forward uses each once. Freeze the layer "
                "scale (requires_grad=False on lambda_1/lambda_2)."
            )
        return output

    def record(self, name: str, param: torch.Tensor, y: Any, output: torch.Tensor) -> None:
        """Check ``y`` (batch-first, the product's shape) and hook the product's gradient: ``G_b``."""
        kind = f"{type(self.module).__name__}.{name}"
        batch, forward_id = self.owner.forward_state()
        if (
            not isinstance(y, torch.Tensor)
            or batch is None
            or y.shape != output.shape
            or y.dim() < 2
            or y.shape[0] != batch
            or y.shape[-1] != param.shape[0]
        ):
            shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise PerSampleGradientError(
                f"{kind} (dp_hf.per_example.ghost.layer_scale) multiplied an operand of shape {shape} (batch {batch}); "
                f"per-example gradients need a batch-first [batch, ..., {param.shape[0]}] operand inside a "
                "forward pass of the whole model. Call the model, or freeze the layer scale."
            )
        if not output.requires_grad:
            return
        recorder, segments = self.owner.recorder, self.owner.segments
        held = [y, y._version]  # let go once recorded, as saved tensors are

        def on_grad(grad: torch.Tensor) -> None:
            check_first_backward(kind, not held)
            direction, version = held
            held.clear()
            if direction._version != version:
                raise PerSampleGradientError(
                    f"{kind} (dp_hf.per_example.ghost.layer_scale): the operand of the layer scale was modified in "
                    "place after its forward; its per-example gradients cannot be formed."
                )
            recorder.record_scale(self.module, param, forward_id, grad, direction, segments=segments)

        output.register_hook(on_grad)


class LayerScaleAdapters(InstanceAdapters):
    """The recording forwards of ``model``'s recognised layers; ``owner`` is the ``FastClipping`` (its
    ``recording``, ``forward_state``, ``recorder`` and ``segments``). ``remove()`` restores the class's forward."""

    def __init__(self, model: nn.Module, owner: Any) -> None:
        super().__init__(model)
        self.owner = owner

    def attach(self) -> None:
        for module in self.candidates():
            if is_layer_scale_block(module) and "forward" not in module.__dict__:
                self.install(_RecordingForward(module, self.owner))


def attach_layer_scale_adapters(model: nn.Module, owner: Any) -> LayerScaleAdapters:
    """:class:`LayerScaleAdapters` attached to ``model`` (``remove()`` them with the hooks)."""
    adapters = LayerScaleAdapters(model, owner)
    adapters.attach()
    return adapters
