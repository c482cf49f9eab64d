"""A check, once per run, that the model does not see the padding its collator adds for the other examples.

A collator that pads each batch to its longest example (``DataCollatorWithPadding``, a feature
extractor's ``pad``) makes every row as long as the longest other example. With an ``attention_mask``
most models ignore those positions, but not all: wav2vec2's group-norm feature encoder (HuBERT, SEW, and
wav2vec2-base configs) normalizes each channel over the whole padded length, and Data2VecAudio's
positional convolutions read padded positions. The longest example of a batch then changes every other
example's loss, and so its clipped gradient: a black-box audit measured 1.02-1.23 C for one example
(``tests/test_padding_probe.py``). Neither the loss probe (rows of one padded batch) nor the collator
probe (no model) sees it.

:func:`dp_hf.batches.dynamic_padding_pair` (from the collator probe) collates the shortest of the probed
examples alone and together with the longest; :func:`check_padding_is_invisible` compares the short example's loss in the two (eval mode, no
autocast, TF32 off): equal for a model that ignores its padding, up to float rounding (0 on a CPU), and
different by 2e-4 to 4e-3 relative for the models above. Not checked: a random collator (masked-LM
masking draws differ with the batch shape) and packed rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from dp_hf.batches import padded_length
from dp_hf.random_state import random_state_kept

#: How far the short example's loss padded may be from its loss alone: float32 rounding of batched kernels
#: (a CPU gives 0 for models that ignore their padding), and for bf16/fp16 weights their rounding.
PADDING_PROBE_RTOL_FLOAT32 = 2e-5
PADDING_PROBE_RTOL_REDUCED = 1e-2
PADDING_PROBE_ATOL = 1e-6


def check_padding_is_invisible(
    compute_losses: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
    model: nn.Module,
    pair: tuple[Mapping[str, Any], Mapping[str, Any]],
    prepare: Callable[[Mapping[str, Any]], dict[str, Any]],
) -> None:
    """Raise ``ValueError`` if the short example's loss changes when it is padded to the long one's length."""
    alone, together = (prepare(batch) for batch in pair)
    modes = [(module, module.training) for module in model.modules()]
    devices = [device for device in {p.device for p in model.parameters()} if device.type == "cuda"]
    try:
        model.eval()
        with random_state_kept(devices), torch.no_grad(), _exact_float32():
            own = compute_losses(model, dict(alone)).float()[0]
            padded = compute_losses(model, dict(together)).float()[0]
    finally:
        for module, training in modes:
            module.training = training
    if not (torch.isfinite(own) and torch.isfinite(padded)):  # a check that cannot compare does not pass
        raise ValueError(
            f"dp_hf could not check that the model ignores the padding its collator adds: an example's loss is "
            f"{float(own):.8g} collated alone and {float(padded):.8g} padded to a longer example's length, not "
            "finite (eval mode, float32). Fix what makes the loss non-finite, or pad every example to one fixed "
            "length (padding='max_length' with max_length), which needs no check."
        )
    reduced = any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters() if p.requires_grad)
    rtol = PADDING_PROBE_RTOL_REDUCED if reduced else PADDING_PROBE_RTOL_FLOAT32
    if abs(float(own) - float(padded)) <= rtol * abs(float(own)) + PADDING_PROBE_ATOL:
        return
    raise ValueError(
        f"the model sees the padding its collator adds: an example's loss is {float(own):.8g} collated alone "
        f"({padded_length(pair[0])} positions) and {float(padded):.8g} padded to the length of a longer example of its "
        f"batch ({padded_length(pair[1])} positions, attention_mask 0 on the padding; eval mode, float32). Each "
        "example's gradient then depends on the longest other example of its batch, and the clip bound no longer "
        "bounds one example's influence (wav2vec2/HuBERT/SEW's group-norm feature encoder normalizes over the "
        "padded length: 1.02-1.23 C measured). Pad every example to one fixed length (padding='max_length' "
        "with max_length), use a variant that ignores padding (wav2vec2: feat_extract_norm='layer' with "
        "do_stable_layer_norm=True), or use right padding with position_ids for absolute positions."
    )


@contextlib.contextmanager
def _exact_float32() -> Iterator[None]:
    """No autocast (the training context's is not entered) and no TF32, so float32 rounding is all."""
    precision = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
