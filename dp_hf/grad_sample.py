"""Deprecated alias of :mod:`dp_hf.per_example` (Opacus's per-example-gradient hooks); import from there.

Kept so that existing imports keep working: every name this module exported is re-exported from
its new home (:mod:`dp_hf.per_example.opacus_hooks`, :mod:`~dp_hf.per_example.validate`,
:mod:`~dp_hf.per_example.samplers`, :mod:`~dp_hf.per_example.batch`,
:mod:`~dp_hf.per_example.errors`). Importing it registers the ViT/DeiT grad samplers with Opacus,
as before.
"""

from __future__ import annotations

from dp_hf.per_example.batch import (
    BATCH_INPUT_NAMES,
    ForwardBatch,
    batch_input_positions,
    batch_size_of_call,
    safe_signature,
)
from dp_hf.per_example.errors import PerSampleGradientError, UnsupportedModuleError
from dp_hf.per_example.opacus_hooks import (
    GradSampleHandle,
    attach_grad_sample,
    clear_grad_sample,
    hooked_parameter_name,
    make_private_model,
    per_sample_gradients,
)
from dp_hf.per_example.samplers import (
    PATCH_EMBEDDING_LAYOUTS,
    PatchEmbeddingCall,
    PatchEmbeddingLayout,
    patch_embedding_grad_sample,
    register_patch_embedding_grad_sampler,
)
from dp_hf.per_example.validate import only_aliases_descendant_parameters, validate_model

# Former private names, still imported by older code.
_PATCH_EMBEDDING_LAYOUTS = PATCH_EMBEDDING_LAYOUTS
_PatchEmbeddingCall = PatchEmbeddingCall
_ForwardBatch = ForwardBatch
_batch_input_positions = batch_input_positions
_batch_size_of_call = batch_size_of_call
_only_aliases_descendant_parameters = only_aliases_descendant_parameters
_patch_embedding_grad_sample = patch_embedding_grad_sample
_safe_signature = safe_signature

__all__ = [
    "BATCH_INPUT_NAMES",
    "GradSampleHandle",
    "PatchEmbeddingLayout",
    "PerSampleGradientError",
    "UnsupportedModuleError",
    "attach_grad_sample",
    "clear_grad_sample",
    "hooked_parameter_name",
    "make_private_model",
    "per_sample_gradients",
    "register_patch_embedding_grad_sampler",
    "validate_model",
]
