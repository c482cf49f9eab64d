"""PEFT prompt learning under DP: prompt tuning, P-tuning (its MLP encoder) and prefix tuning.

The trainable prompt is one embedding table (``prompt_encoder.<adapter>.embedding``; P-tuning adds an MLP,
prefix tuning an optional MLP) looked up with the same ids for every row: each example's gradient of it
comes from its own row's backprops, like any embedding's, once the ids are expanded over the batch before
the lookup (prefix tuning's are; prompt tuning's and P-tuning's are while the hooks record:
:mod:`dp_hf.per_example.prompts`). Both per-example engines then handle it as they are.

What changes is the loss. Prompt tuning and P-tuning prepend ``num_virtual_tokens`` embeddings to the
inputs, so the model returns that many more logits per row than the batch has labels. PEFT pads the labels
with ``-100`` when they go through its forward; DP training pops them (each example's loss is computed
from the logits, :mod:`dp_hf.losses`), so :func:`align_labels` pads them the same way. Prefix tuning adds
keys and values, not positions: its logits line up already.

Refused before training (:func:`check_prompt_learning`): the prompt-learning methods not tested here
(multitask prompt tuning, CPT, cartridges), P-tuning's LSTM encoder (no exact per-example rule), and a
``PeftModel`` subclass with its own ``get_prompt`` (the per-example lookup stands in for PEFT's).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dp_hf.distributed import unwrap_ddp
from dp_hf.per_example.prompts import PREPENDING, has_peft_get_prompt, peft_type_name

__all__ = ["align_labels", "check_prompt_learning", "prepended_virtual_tokens", "prompt_learning_config"]

#: Prompt-learning PEFT types DP training supports.
SUPPORTED = (*PREPENDING, "PREFIX_TUNING")


def prompt_learning_config(model: torch.nn.Module) -> Any | None:
    """The active PEFT config of ``model`` when it is a prompt-learning one (else None)."""
    config = getattr(unwrap_ddp(model), "active_peft_config", None)
    return config if getattr(config, "is_prompt_learning", False) else None


def prepended_virtual_tokens(model: torch.nn.Module) -> int:
    """How many virtual tokens PEFT prepends to each row's inputs (prompt tuning, P-tuning), else 0."""
    config = prompt_learning_config(model)
    if config is None or peft_type_name(config) not in PREPENDING:
        return 0
    return int(config.num_virtual_tokens) * int(getattr(config, "num_transformer_submodules", 1) or 1)


def check_prompt_learning(model: torch.nn.Module) -> None:
    """Refuse, before training, a PEFT prompt-learning setup whose per-example gradients are not exact here."""
    config = prompt_learning_config(model)
    if config is None:
        return
    kind = peft_type_name(config)
    if kind not in SUPPORTED:
        raise ValueError(
            f"PEFT peft_type={kind!r} is not supported by DP training (its forward adds its own label or task "
            "inputs, which per-example losses do not reproduce; not tested here). Use PromptTuningConfig, "
            "PromptEncoderConfig (P-tuning, MLP encoder), PrefixTuningConfig or LoRA."
        )
    reparameterization = getattr(config, "encoder_reparameterization_type", "MLP")
    reparameterization = str(getattr(reparameterization, "value", reparameterization))
    if kind == "P_TUNING" and reparameterization != "MLP":
        raise ValueError(
            f"PromptEncoderConfig(encoder_reparameterization_type={reparameterization!r}): its LSTM encoder has "
            "no exact per-example gradient rule (torch's nn.LSTM). Set encoder_reparameterization_type='MLP'."
        )
    if kind in PREPENDING and not has_peft_get_prompt(unwrap_ddp(model)):
        raise ValueError(
            f"{type(unwrap_ddp(model)).__name__} overrides PEFT's PeftModel.get_prompt: DP training replaces PEFT's "
            f"method to encode {kind}'s virtual tokens once per example, and does not know what the override "
            "does. Use PEFT's own model classes (get_peft_model), or LoRA."
        )


def align_labels(model: torch.nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``labels`` padded on the left with ``-100`` for the virtual tokens whose logits come first, as PEFT's
    own forward pads them (token-level heads: causal and masked LM, token classification)."""
    virtual = prepended_virtual_tokens(model)
    if virtual and labels.dim() >= 2 and logits.dim() >= 3 and logits.shape[1] == labels.shape[1] + virtual:
        return F.pad(labels, (virtual, 0), value=-100)
    return labels
