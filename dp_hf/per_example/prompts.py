"""PEFT prompt tuning's and P-tuning's virtual tokens, encoded once per example while the hooks record.

PEFT's ``get_prompt`` runs the prompt encoder on *one* row of prompt ids and repeats its output over the
batch (``prompts.repeat(batch_size, 1, 1)``, a memory saving: peft issue 2043). Every example's backprop
then reaches the prompt embedding through that one row, summed, so no per-example gradient can be read off
the encoder; and the batch recorder, taking the ``[1, n]`` ids for broadcast position ids, expanded them to
``B`` rows, which the repeat made ``B * B`` (a bare ``torch.cat`` size error in PEFT's forward).

While the hooks record the encoder, :class:`PromptAdapters` replaces the ``PeftModel``'s ``get_prompt`` by
the lookup PEFT made before that change: the prompt ids expanded to ``[B, n]`` *before* the encoder, so
its output (the same values) has one row, and one backprop, per example, and every engine's embedding and
linear rules apply as they are. Outside recording (evaluation, generation, a copy of the model) PEFT's own
method runs. Prefix tuning already encodes ``[B, n]`` ids (its ``get_prompt`` branch is left alone).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dp_hf.per_example.adapters import InstanceAdapter, InstanceAdapters

__all__ = [
    "PREPENDING",
    "PromptAdapters",
    "attach_prompt_adapters",
    "has_peft_get_prompt",
    "peft_type_name",
]

#: PEFT types whose encoded virtual tokens are prepended to each row's input embeddings.
PREPENDING = ("PROMPT_TUNING", "P_TUNING")


def peft_type_name(config: Any) -> str:
    """``config.peft_type`` as its plain name (``"PROMPT_TUNING"``), whether an enum or a string."""
    value = getattr(config, "peft_type", None)
    return str(getattr(value, "value", value))


def has_peft_get_prompt(model: nn.Module) -> bool:
    """Whether ``model`` is a ``PeftModel`` whose ``get_prompt`` is PEFT's own (the code the adapter stands in
    for; a subclass's override is not guessed at)."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - depends on the environment
        return False
    return isinstance(model, PeftModel) and type(model).get_prompt is PeftModel.get_prompt


class _PerExamplePrompt(InstanceAdapter):
    """``get_prompt`` of one ``PeftModel``: per-example encoding while its encoder records (module docstring)."""

    def __call__(self, batch_size: int, task_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        model = self.module
        config = model.active_peft_config
        encoder = model.prompt_encoder[model.active_adapter]
        if (
            self.owner is None
            or peft_type_name(config) not in PREPENDING
            or config.inference_mode
            or not any(self.owner.recording(m) for m in encoder.modules())
        ):
            return self.original()(batch_size, task_ids, **kwargs)
        ids = model.prompt_tokens[model.active_adapter].to(encoder.embedding.weight.device)
        return encoder(ids.unsqueeze(0).expand(batch_size, -1))  # [B, n, D]: one row per example


class PromptAdapters(InstanceAdapters):
    """The per-example ``get_prompt`` on ``model``'s PEFT models; ``recording(module)`` says whether the hooks
    record that module's call now."""

    def __init__(self, model: nn.Module, recording: Callable[[nn.Module], bool]) -> None:
        super().__init__(model)
        self.recording = recording

    def attach(self) -> None:
        for module in self.candidates():
            if has_peft_get_prompt(module):
                self.install(_PerExamplePrompt(module, self, "get_prompt"))


def attach_prompt_adapters(model: nn.Module, recording: Callable[[nn.Module], bool]) -> PromptAdapters:
    """:class:`PromptAdapters` attached to ``model`` (``remove()`` them with the hooks)."""
    adapters = PromptAdapters(model, recording)
    adapters.attach()
    return adapters
