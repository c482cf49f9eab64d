"""Per-example gradients and per-example clipping for Hugging Face models (both paths dp_hf uses).

What the package owns, by module:

* :mod:`~dp_hf.per_example.errors`: :class:`UnsupportedModuleError`, :class:`PerSampleGradientError`;
* :mod:`~dp_hf.per_example.batch`: the batch size of the forward pass in progress (one recorder for
  both paths), broadcast-ids expansion;
* :mod:`~dp_hf.per_example.validate`: :func:`validate_model`, which models can have exact
  per-example gradients at all;
* :mod:`~dp_hf.per_example.samplers`: the grad samplers dp_hf adds to Opacus (ViT/DeiT embeddings,
  registered globally when the module is imported; padding-aware embeddings) and the capture of
  ViT-style embeddings calls shared with the fast path;
* :mod:`~dp_hf.per_example.opacus_hooks`: :func:`attach_grad_sample` and
  :class:`GradSampleHandle`, Opacus's hooks writing ``p.grad_sample`` (any trainable module);
* :mod:`~dp_hf.per_example.ghost`: :func:`attach_fast_clipping` / :class:`FastClipping`, ghost
  norms and layer-wise materialization with one backward pass (supported modules only);
* :mod:`~dp_hf.per_example.modes`: the mode names and :func:`resolve_per_sample_gradient_mode`,
  which picks a path for an optimizer and a model.

Names are imported lazily: ``import dp_hf.per_example.modes`` loads neither Opacus nor transformers.
``dp_hf.grad_sample`` and ``dp_hf.ghost`` are deprecated aliases of this package.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "PerSampleGradientError": "dp_hf.per_example.errors",
    "UnsupportedModuleError": "dp_hf.per_example.errors",
    "BATCH_INPUT_NAMES": "dp_hf.per_example.batch",
    "validate_model": "dp_hf.per_example.validate",
    "PatchEmbeddingLayout": "dp_hf.per_example.samplers",
    "register_patch_embedding_grad_sampler": "dp_hf.per_example.samplers",
    "GradSampleHandle": "dp_hf.per_example.opacus_hooks",
    "attach_grad_sample": "dp_hf.per_example.opacus_hooks",
    "clear_grad_sample": "dp_hf.per_example.opacus_hooks",
    "hooked_parameter_name": "dp_hf.per_example.opacus_hooks",
    "make_private_model": "dp_hf.per_example.opacus_hooks",
    "per_sample_gradients": "dp_hf.per_example.opacus_hooks",
    "FastClipping": "dp_hf.per_example.ghost.clipping",
    "attach_fast_clipping": "dp_hf.per_example.ghost.clipping",
    "unsupported_modules": "dp_hf.per_example.ghost",
    "PER_SAMPLE_GRADIENT_MODES": "dp_hf.per_example.modes",
    "has_identity_geometry": "dp_hf.per_example.modes",
    "is_identity_geometry": "dp_hf.per_example.modes",
    "resolve_per_sample_gradient_mode": "dp_hf.per_example.modes",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dp_hf.per_example' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
