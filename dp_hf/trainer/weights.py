"""Model weights read back from a checkpoint under the names the model uses.

transformers 5 renames some models' weights when it loads them (``from_pretrained`` applies the
model's weight conversions: ViT's ``vit.encoder.layer.0...`` becomes ``vit.layers.0...``) and
``save_pretrained`` reverts those renamings, so that a saved model keeps the Hub's names. The
Trainer's resume (``_load_from_checkpoint``) and ``load_best_model_at_end`` (``_load_best_model``)
read the saved file with a plain ``load_state_dict(strict=False)``, without the renamings: every
renamed tensor silently kept the value it had before the resume (for the demo's ViT, the whole
encoder restarted from its initial weights; transformers' issue #48805, PR #49022 open). dp_hf
applies the renamings on the way in and refuses a load that leaves a weight unread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["saved_weight_renames", "weights_loaded_under_model_names"]


def saved_weight_renames(model: nn.Module) -> dict[str, str]:
    """``{name in a saved file: name in model.state_dict()}`` for the weights ``save_pretrained`` renames.

    Empty when the model renames nothing (BERT, Llama, PEFT models, plain modules). Conversions that
    are not renamings (fused MoE experts) give tensors the model does not hold; they are left out,
    and the completeness check of :func:`weights_loaded_under_model_names` refuses their load.
    """
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # pragma: no cover - transformers < 5
        return {}
    if not isinstance(model, PreTrainedModel):
        return {}
    state = model.state_dict()
    reverted = revert_weight_conversion(model, dict(state))
    name_of = {id(tensor): name for name, tensor in state.items()}
    return {
        saved: name_of[id(tensor)]
        for saved, tensor in reverted.items()
        if id(tensor) in name_of and name_of[id(tensor)] != saved
    }


@contextlib.contextmanager
def weights_loaded_under_model_names(model: nn.Module, checkpoint: str) -> Iterator[None]:
    """Within: ``model.load_state_dict`` renames saved names to the model's. On exit: every weight was read.

    Wraps only the full-weights loads of a checkpoint (``model.safetensors``, sharded or not); a PEFT
    model is left as it is: its adapter loads go through PEFT's loader, which loads part of the state.
    """
    if hasattr(model, "peft_config"):
        yield
        return
    renames = saved_weight_renames(model)
    read: set[str] = set()
    load_state_dict = model.load_state_dict

    def load_renamed(state_dict: dict[str, Any], strict: bool = True, assign: bool = False):
        state_dict = {renames.get(name, name): tensor for name, tensor in state_dict.items()}
        read.update(state_dict)
        return load_state_dict(state_dict, strict, assign)

    model.load_state_dict = load_renamed
    try:
        yield
    finally:
        del model.load_state_dict
    if not read:
        return  # nothing loaded through it (adapters only)
    state = model.state_dict(keep_vars=True)
    shared = {state[name].data_ptr() for name in read if name in state}
    # Exempt: weights saved under another read name (tied), frozen ones (training never changes them:
    # MoE experts that save_pretrained splits) and those the model never saves (Marian's sinusoids).
    unsaved = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    unread = [
        name
        for name, tensor in state.items()
        if name not in read
        and tensor.data_ptr() not in shared
        and getattr(tensor, "requires_grad", False)
        and name not in unsaved
    ]
    if unread:
        shown = ", ".join(unread[:5]) + (f" and {len(unread) - 5} more" if len(unread) > 5 else "")
        raise RuntimeError(
            f"loading the model weights of {checkpoint} left {len(unread)} weight(s) unread ({shown}): they would "
            "keep the values they had before the load, and training would go on from a model that never ran. "
            "The checkpoint's names differ from the model's: a checkpoint of another model, or a weight "
            "conversion that is not a renaming (save_pretrained splits fused MoE experts; transformers issue "
            "#48805). Trainable weights that transformers converts cannot be resumed yet: freeze them (train "
            "LoRA adapters or the other layers) or train without interruption."
        )
