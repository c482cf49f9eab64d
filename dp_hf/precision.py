"""Float32 matmuls at full precision wherever the clip bound rests on them (:func:`ieee_float32_matmuls`).

The clip bound ``||f_i g_i|| <= C`` holds for the norms and weighted sums that clipping computes
only up to float32 rounding (``2^-24`` relative per operation), which is what every exactness
test allows. But PyTorch may run float32 matmuls at lower precision:

* **TF32 on CUDA** (10-bit mantissa, ``2^-11`` relative per operand): ``TrainingArguments(tf32=True)``,
  ``torch.set_float32_matmul_precision("high")``, ``torch.backends.fp32_precision = "tf32"``, or
  ``torch.backends.cuda.matmul.allow_tf32 = True``, all common in bf16 GPU scripts;
* **bf16 on CPU** (``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``, 8-bit mantissa);
* **autocast**: an optimizer step taken inside the user's ``torch.autocast(dtype=torch.bfloat16)``
  block would run the clipping pass's matmuls in bf16.

A ghost norm is a Frobenius product of two Gram GEMMs, and the book-keeping sum a GEMM of the
factors scaled by the clip factors: at TF32, an example's norm could read ~0.1% low and its
contribution could exceed ``C`` by as much. The model's own forward and backward may keep the
user's setting (the factors they produce define each example's gradient); only the arithmetic
*on* those factors is switched to IEEE float32, for the duration of the clipping pass.

Bf16 tensor-core products (``out_dtype=torch.float32``, :mod:`dp_hf.per_example.ghost.tensor_cores`)
are bf16 GEMMs, which these settings do not touch; their error has its own bound, which assumes
float32 accumulation: cuBLAS's reduced-precision reductions for bf16 GEMMs (allowed by default,
``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction``) are switched off as well.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["float32_arithmetic_eps", "ieee_float32_matmuls"]

_FULL = ("ieee", "none")  # "none": unset, i.e. the default, IEEE float32
_AUTOCAST_DEVICES = ("cuda", "cpu")


def _matmul_backends() -> tuple:
    """The float32 matmul backends whose precision a user may lower (``torch.backends`` objects)."""
    return (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)


@contextlib.contextmanager
def ieee_float32_matmuls() -> Iterator[None]:
    """Run float32 matmuls in IEEE float32 inside the block, then restore the user's setting.

    Also disallows cuBLAS's reduced-precision reductions in bf16 GEMMs for the block (the
    tensor-core bound assumes float32 accumulation throughout), and turns off an enclosing
    ``torch.autocast``, which would run float32 matmuls in bf16 (an optimizer step inside the
    user's autocast block: its clipped sums came out in bf16, ~0.5% off).
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(_per_backend_ieee() if _per_backend_api() else _legacy_highest())
        stack.enter_context(_float32_reductions())
        for device_type in _AUTOCAST_DEVICES:
            if _autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


_PRECISION_EPS = {"bf16": 2.0**-7, "tf32": 2.0**-10}


def float32_arithmetic_eps(device: torch.device) -> float:
    """Machine epsilon of the float32 matmuls and convolutions the model runs on ``device`` under the
    user's precision settings: bf16's (``2^-7``) or TF32's (``2^-10``) where they may be lowered to it,
    else float32's. On an accelerator at least TF32's (cuDNN's convolutions use TF32 by default).

    Reads the per-backend settings where torch has them (>= 2.9): the legacy
    ``torch.get_float32_matmul_precision()`` raises there once a user set the new API (as
    ``TrainingArguments(tf32=True)`` does).
    """
    accelerator = device.type != "cpu"
    if _per_backend_api():
        backends = torch.backends
        if device.type == "cpu":
            lowered = (backends.mkldnn.matmul, backends.mkldnn.conv, backends.mkldnn.rnn)
        else:
            lowered = (backends.cuda.matmul, backends.cudnn.conv, backends.cudnn.rnn)
        values = {backend.fp32_precision for backend in lowered}
    else:  # "medium": bf16 allowed (oneDNN, CUDA); "high": TF32 on CUDA
        values = {"bf16"} if torch.get_float32_matmul_precision() == "medium" else set()
    if accelerator:
        values.add("tf32")
    return max([torch.finfo(torch.float32).eps] + [_PRECISION_EPS[v] for v in values if v in _PRECISION_EPS])


@contextlib.contextmanager
def _per_backend_ieee() -> Iterator[None]:
    """Each lowered backend set to ``"ieee"``, then given back its setting: its own value if it had
    one, or ``"none"`` again (inheriting the generic ``torch.backends.fp32_precision``) where it
    equalled a non-default generic setting, so that a later change of the generic setting still
    reaches it. Restoring the same value also leaves the legacy ``allow_tf32`` readable. Nothing is
    set when no backend is lowered (the usual case)."""
    lowered = [(backend, backend.fp32_precision) for backend in _matmul_backends()]
    lowered = [(backend, value) for backend, value in lowered if value not in _FULL]
    if not lowered:
        yield
        return
    generic = torch.backends.fp32_precision
    for backend, _ in lowered:
        backend.fp32_precision = "ieee"
    try:
        yield
    finally:
        for backend, value in lowered:
            inherited = generic not in _FULL and value == generic
            backend.fp32_precision = "none" if inherited else value


@contextlib.contextmanager
def _float32_reductions() -> Iterator[None]:
    """``allow_bf16_reduced_precision_reduction`` off (it is on by default). Only ``(True, split-K
    True)`` is allowed with it on, so setting ``True`` back restores the default exactly."""
    matmul = torch.backends.cuda.matmul
    if not matmul.allow_bf16_reduced_precision_reduction:
        yield
        return
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = True


def _autocast_enabled(device_type: str) -> bool:
    return torch.is_autocast_enabled(device_type)


def _per_backend_api() -> bool:
    return hasattr(torch.backends, "fp32_precision")  # torch >= 2.9


@contextlib.contextmanager
def _legacy_highest() -> Iterator[None]:
    saved = torch.get_float32_matmul_precision()  # "high" / "medium": TF32 on CUDA, bf16 in oneDNN
    if saved == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)
