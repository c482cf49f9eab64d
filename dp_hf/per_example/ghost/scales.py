"""RMSNorms & co. on the fast path: modules whose output is elementwise affine in a 1-D weight.

``LlamaRMSNorm`` (and Qwen2's, Mistral's..., which copy it), ``T5LayerNorm``, Gemma's
``(1 + weight)`` norm and torch's ``nn.RMSNorm`` all compute, per token, ``y = y0(x) + w * z(x)``
with ``w`` the ``[H]`` weight broadcast over the last dimension (Llama: ``z = xhat`` cast to the
input dtype, ``y0 = 0``; Gemma: ``z = y0 = xhat``). Then ``dy/dw = z`` elementwise and example
``i``'s weight gradient is ``G_i = sum_t g_{i,t} * z_{i,t}`` (``[H]``; per segment in packed rows).

How (:func:`register_scale_hook`): the module keeps its own forward (PyTorch's "hook mode", like
the ViT/DeiT embeddings); an output-gradient hook recomputes ``z = y(w=1) - y(w=0)`` from the
call's own inputs (two no-grad calls of the module's forward through ``torch.func.functional_call``,
under the forward's autocast state) and records the dense ``G_i`` (``[B, H]`` floats: the only
per-example tensor kept; the product ``g * z`` is transient). Why this rule:

* generic: no formula per class. Each class casts differently (Llama multiplies after casting
  ``xhat`` to the input dtype, Gemma before, T5 depending on the weight dtype); ``z`` taken from the
  module's own forward is the derivative its autograd graph uses, whatever it does. The
  difference is exact in binary floating point for these forms (``1 * a - 0``; ``2a - a``);
  Gemma's form rounds ``z`` to the output dtype when that is below float32 (bf16 models).
* cheap: two elementwise forwards per call, no per-example backward (``torch.func.vjp`` under
  ``vmap`` would run one per example) and no per-example ``[T, H]`` tensor.
* sound: a module is taken only if a probe (:func:`scale_problem`, at attach time and in
  ``unsupported_modules``) finds it affine in its weight (``y(w) = y(0) + w * (y(1) - y(0))`` for
  a random ``w``) and token-wise (rows and positions computed independently, so packed segments
  can be told apart); otherwise it is listed as unsupported (Opacus's hooks). And every step the
  recorded ``G_i`` must add up to autograd's ``.grad`` of the weight, which these modules still
  receive (:meth:`~dp_hf.per_example.ghost.records.LayerRecorder.batch_size`): a module whose weight
  does not enter as assumed (``y = xhat * w**2``, a forward that changes with the input's size) is
  refused, never mis-clipped. An input modified in place before the backward is refused as well.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.hooks import RemovableHandle

from dp_hf.per_example.errors import PerSampleGradientError
from dp_hf.per_example.ghost.functions import check_first_backward
from dp_hf.per_example.ghost.records import LayerRecorder
from dp_hf.per_example.ghost.segments import Segments

__all__ = ["ScaleOwner", "is_scale_candidate", "register_scale_hook", "scale_direction", "scale_problem"]

#: Class-name endings of the modules offered this rule (nn.LayerNorm itself has a native rule).
_NAME_ENDINGS = ("RMSNorm", "LayerNorm")


class ScaleOwner(Protocol):
    """What the hook asks of the object that hooked the module (a ``FastClipping``)."""

    recorder: LayerRecorder
    segments: Segments | None

    def recording(self, module: nn.Module) -> bool: ...

    def forward_state(self) -> tuple[int | None, int]: ...


def _weight(module: nn.Module) -> tuple[str, torch.Tensor]:
    ((name, weight),) = module.named_parameters(recurse=False)
    return name, weight


def is_scale_candidate(module: nn.Module) -> bool:
    """An RMSNorm-like leaf: named ``*RMSNorm``/``*LayerNorm`` (or an ``nn.RMSNorm``), one 1-D parameter."""
    named = isinstance(module, nn.RMSNorm) or type(module).__name__.endswith(_NAME_ENDINGS)
    if not named or next(module.children(), None) is not None:
        return False
    params = list(module.parameters(recurse=False))
    return len(params) == 1 and params[0].dim() == 1 and params[0].is_floating_point()


def _call(module: nn.Module, name: str, weight: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    return functional_call(module, {name: weight}, args, kwargs)


def scale_problem(module: nn.Module) -> str | None:
    """Why ``module`` (a candidate) cannot take this rule, or None: the affine and token-wise probe."""
    name, weight = _weight(module)
    width = weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    positions = 3 if width != 3 else 4  # never the width: a weight broadcast elsewhere fails
    x = torch.randn(2, positions, width, generator=generator).to(weight.device, weight.dtype)
    w = torch.randn(width, generator=generator).to(weight.device, weight.dtype)
    try:
        with torch.no_grad():
            y = _call(module, name, w, (x,), {})
            zero = _call(module, name, torch.zeros_like(w), (x,), {})
            one = _call(module, name, torch.ones_like(w), (x,), {})
            row = _call(module, name, w, (x[1:],), {})
            token = _call(module, name, w, (x[:, 1:2],), {})
    except Exception as error:  # noqa: BLE001 - any failure means "not this rule"
        return f"no fast per-example rule: its forward(x) failed on a probe ({type(error).__name__})"
    if not all(isinstance(t, torch.Tensor) and t.shape == x.shape for t in (y, zero, one)):
        return "no fast per-example rule: its output is not a tensor shaped like its input"
    predicted = zero + w * (one - zero)
    if not _close(y, predicted, zero, w * (one - zero)):
        return "its output is not elementwise affine in its weight (y != y(0) + w * (y(1) - y(0)))"
    if not (_close(row, y[1:], y[1:]) and _close(token, y[:, 1:2], y[:, 1:2])):
        return "its output mixes rows or positions (not token-wise), so examples cannot be told apart"
    return None


def _close(actual: torch.Tensor, expected: torch.Tensor, *scales: torch.Tensor) -> bool:
    eps = torch.finfo(actual.dtype).eps if actual.is_floating_point() else 0.0
    bound = sum(s.float().abs() for s in scales) * (16 * eps) + 1e-30
    return bool(((actual.float() - expected.float()).abs() <= bound).all())


def scale_direction(
    module: nn.Module, args: tuple, kwargs: dict, autocast: tuple[str, bool, torch.dtype]
) -> torch.Tensor:
    """``z = y(w=1) - y(w=0)``: the module's output derivative in its weight, from its own forward."""
    name, weight = _weight(module)
    device_type, enabled, dtype = autocast
    with torch.no_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
        one = _call(module, name, torch.ones_like(weight), args, kwargs)
        zero = _call(module, name, torch.zeros_like(weight), args, kwargs)
    return one - zero


def _versions(args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, int]]:
    return [(t, t._version) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]


def register_scale_hook(module: nn.Module, owner: ScaleOwner) -> RemovableHandle:
    """Forward hook on ``module``: its output's gradient records the weight's ``G_i`` with ``owner``."""
    _, weight = _weight(module)
    kind = type(module).__name__

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not owner.recording(module) or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        batch, forward_id = owner.forward_state()
        if (
            output.dim() < 2
            or output.shape[-1] != weight.shape[0]
            or (batch is not None and output.shape[0] != batch)
        ):
            raise PerSampleGradientError(
                f"{kind} output of shape {tuple(output.shape)} is not [batch, ..., {weight.shape[0]}] "
                f"(batch {batch}): its weight's per-example gradients cannot be formed."
            )
        device_type = output.device.type
        autocast = (
            device_type,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
        )
        segments, recorder = owner.segments, owner.recorder
        held = [args, kwargs, _versions(args, kwargs)]  # let go once recorded, as saved tensors are

        def on_grad(grad: torch.Tensor) -> None:
            check_first_backward(kind, not held)
            call_args, call_kwargs, versions = held
            held.clear()
            if any(t._version != version for t, version in versions):
                raise PerSampleGradientError(
                    f"the input of a {kind} was modified in place after its forward; its weight's per-example "
                    "gradients (recomputed from that input) cannot be formed."
                )
            direction = scale_direction(module, call_args, call_kwargs, autocast)
            recorder.record_scale(module, weight, forward_id, grad, direction, segments=segments)

        output.register_hook(on_grad)

    return module.register_forward_hook(hook, with_kwargs=True)
