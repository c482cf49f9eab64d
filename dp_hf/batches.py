"""Collated batches: one row per example, and micro-batches of bounded size.

Per-example clipping bounds one example's influence only if each row of a batch is one example,
built from that example alone. :func:`check_collator_is_per_example` probes the collator before
training; :func:`check_batch_is_per_example` checks every training micro-batch (no packing markers,
one row per sampled example, no left padding without ``position_ids``). :func:`split_microbatch`
bounds the memory of an unusually large Poisson draw, as Opacus's ``BatchMemoryManager`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from dp_hf.random_state import random_state_kept, seed_every_generator


def batch_size_of(batch: Mapping[str, Any]) -> int:
    """Number of examples in a collated batch (its first tensor's leading dimension)."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ValueError(f"cannot tell the batch size of a batch with keys {sorted(batch)}: no tensor in it.")


def split_microbatch(batch: Mapping[str, Any], max_size: int) -> list[dict[str, Any]]:
    """Split a collated batch into pieces of at most ``max_size`` examples (memory bound)."""
    size = batch_size_of(batch)
    if size <= max_size:
        return [dict(batch)]
    return [
        _per_example(batch, size, lambda value, start=start: value[start : start + max_size])
        for start in range(0, size, max_size)
    ]


def take_examples(batch: Mapping[str, Any], rows: Sequence[int]) -> dict[str, Any]:
    """The batch of the examples ``rows`` of ``batch``, in that order (an example may repeat)."""
    return select_rows(batch, batch_size_of(batch), rows)


def select_rows(values: Mapping[Any, Any], size: int, rows: Sequence[int]) -> dict[Any, Any]:
    """``values`` with every tensor whose first dimension is ``size`` cut to ``rows`` (the rest as is)."""
    index = torch.tensor(list(rows))
    return _per_example(values, size, lambda value: value.index_select(0, index.to(value.device)))


def cuda_devices(values: Iterable[Any]) -> list[torch.device]:
    """The CUDA devices of the tensors among ``values`` (whose generators ``torch.random.fork_rng`` must keep)."""
    return sorted(
        {v.device for v in values if isinstance(v, torch.Tensor) and v.device.type == "cuda"}, key=str
    )


def row_lengths(dataset: Any, column: str = "input_ids") -> list[int] | None:
    """Each row's length of ``column`` in a ``datasets.Dataset``, read from its Arrow column (after any select or
    shuffle; no row is decoded); None for another dataset or one without the column."""
    names = getattr(dataset, "column_names", None)
    if not hasattr(dataset, "with_format") or not names or column not in names:
        return None
    import pyarrow.compute as pc

    return pc.list_value_length(dataset.with_format("arrow")[column]).to_pylist()


def _per_example(
    batch: Mapping[str, Any], size: int, take: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, Any]:
    """``batch`` with ``take`` applied to each tensor whose first dimension is the batch (the rest as is)."""
    return {
        key: take(value)
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size
        else value
        for key, value in batch.items()
    }


def _rows_match(row: torch.Tensor, single: torch.Tensor) -> bool:
    """``row`` (from a batch, maybe padded longer) holds ``single`` right- or left-aligned."""
    if row.shape == single.shape:
        return torch.equal(row, single)
    if row.dim() != single.dim() or any(r < s for r, s in zip(row.shape, single.shape)):
        return False
    head = row[tuple(slice(0, s) for s in single.shape)]
    tail = row[tuple(slice(r - s, r) for r, s in zip(row.shape, single.shape))]
    return torch.equal(head, single) or torch.equal(tail, single)


#: Keys by which Hugging Face collators and models mark packed rows (several examples in one row).
PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "cu_seqlens")


def _position_restarts(position_ids: torch.Tensor) -> bool:
    """Whether some row of ``position_ids`` starts a new sequence after its first token (packing)."""
    if position_ids.dim() != 2 or position_ids.shape[1] < 3:
        return False
    prev, cur, nxt = position_ids[:, :-2], position_ids[:, 1:-1], position_ids[:, 2:]
    # ... a, 0, 1 ... with a > 0: a sequence ended and a new one began in the same row. (Padding with
    # zeros, ... a, 0, 0, never has a 1 after the 0.)
    return bool(((prev > 0) & (cur == 0) & (nxt == 1)).any())


def packed_batch_problems(batch: Mapping[str, Any], num_examples: int) -> list[str]:
    """Why a padding-free batch is not ``num_examples`` whole examples as segments (empty: it is).

    The segments are those of ``position_ids`` (transformers' block-diagonal mask, each starting at
    position 0; :func:`~dp_hf.per_example.ghost.segments.find_segments`); there must be one per
    sampled example, the packing keys (``cu_seq_lens_*``, ``max_length_*``, ``seq_idx``) must agree
    with them, and every other tensor must be token-aligned with the packed rows.
    """
    from dp_hf.per_example.ghost.segments import PACKED_ROW_KEYS, check_packing_keys, find_segments

    position_ids = batch.get("position_ids")
    if not isinstance(position_ids, torch.Tensor):
        return ["no position_ids to tell the packed examples apart"]
    try:
        segments = find_segments(position_ids)
    except ValueError as err:
        return [str(err)]
    problems = check_packing_keys(batch, segments)
    if segments.num_segments != num_examples:
        problems.append(
            f"{segments.num_segments} segments in the packed rows for {num_examples} sampled examples"
        )
    for key, value in batch.items():
        if key in PACKED_ROW_KEYS or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        if tuple(value.shape[:2]) != tuple(position_ids.shape):
            problems.append(
                f"{key!r} of shape {tuple(value.shape)} is not token-aligned with the packed rows"
            )
    problems += [
        f"{key!r} is not a padding-free packing key"
        for key in PACKING_KEYS
        if key not in PACKED_ROW_KEYS and key in batch
    ]
    return problems


def check_batch_is_per_example(
    batch: Mapping[str, Any], num_examples: int, collator: Any = None, *, packed: bool = False
) -> None:
    """Refuse a collated batch whose rows are not one example each.

    Per-example clipping clips each *row*'s gradient: a row holding several examples (packing,
    e.g. ``transformers.DataCollatorWithFlattening``) would be clipped as one unit, so one example's
    influence would not be bounded. Checked on every training micro-batch: every tensor's leading
    dimension is the number of examples sampled into it, and no packing marker is present.

    ``packed=True`` (a trainer that clips each segment of a packed row as one example: padding-free
    SFT): the batch must instead be packed rows holding exactly the ``num_examples`` sampled
    examples as segments (:func:`packed_batch_problems`).
    """
    name = type(collator).__name__ if collator is not None else "the data collator"
    if packed:
        problems = packed_batch_problems(batch, num_examples)
        if problems:
            raise ValueError(
                f"{name} returned a padding-free batch for {num_examples} examples whose segments are not those "
                f"examples ({'; '.join(problems)}). Each example must be one whole segment of the packed row "
                "(trl's padding_free collator, without packing=True or pad_to_multiple_of)."
            )
        return
    packing = [key for key in PACKING_KEYS if key in batch]
    position_ids = batch.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and _position_restarts(position_ids):
        packing.append("position_ids restarting inside a row")
    rows = {
        key: int(value.shape[0])
        for key, value in batch.items()
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] != num_examples
    }
    if packing or rows:
        found = ", ".join(packing + [f"{key!r} has {n} rows" for key, n in rows.items()])
        raise ValueError(
            f"{name} packs examples: it returned a batch for {num_examples} examples whose rows are not one "
            f"example each ({found}). DP clips per row, so a packed row would be clipped as one unit and one "
            "example's influence would not be bounded. Use a padding collator (e.g. DataCollatorWithPadding, "
            "or padding_free=False / packing=False) so that each example has its own row."
        )
    mask = batch.get("attention_mask")
    if position_ids is None and isinstance(mask, torch.Tensor) and _left_padded(mask):
        raise ValueError(
            f"{name} pads on the left: an example's tokens then sit at positions that depend on the longest "
            "example of its batch, and models with absolute position embeddings (BERT, GPT-2, ...) see them "
            "there, so one example changes the others' gradients and the clip bound no longer bounds its "
            "influence. Pad on the right for training (tokenizer.padding_side = 'right'), or pass "
            "position_ids that count each example's own tokens."
        )


def _left_padded(attention_mask: torch.Tensor) -> bool:
    """Whether some row of a ``[b, T]`` mask has padding (0) before one of its tokens (1)."""
    if attention_mask.dim() != 2 or attention_mask.shape[1] < 2:
        return False
    real = (attention_mask != 0).int()  # a 0 with a 1 later in its row: the reversed cummax is 1 there
    return bool(((real[:, :-1] == 0) & (real.flip(1).cummax(1).values.flip(1)[:, 1:] == 1)).any())


def check_collator_is_per_example(
    collator, features: list, *, packed: bool = False
) -> tuple[Mapping[str, Any], Mapping[str, Any]] | None:
    """Refuse a collator whose output rows are not the examples' own, before training starts.

    Per-example clipping bounds one example's influence only if its row of the batch holds that
    example alone, built from it alone: a collator that packs several examples in a row, normalizes
    by batch statistics or mixes examples (mixup, cutmix) breaks the guarantee. Probe on the first
    examples: the batch must have one row per example (:func:`check_batch_is_per_example`) and each
    row must equal the example collated alone, and a row padded longer than the example alone needs an
    ``attention_mask`` (:func:`_check_padding_is_masked`). A random collator (masked-LM masking) is not compared
    row by row (every training micro-batch still passes :func:`check_batch_is_per_example`). A collator
    failing on these examples is an error, not a pass. With ``packed=True`` (padding-free batches) each
    example must be one whole segment instead, equal to the example collated alone.

    Returns :func:`dynamic_padding_pair` of these examples, for the model's padding check
    (:mod:`dp_hf.trainer.padding`): None for a random collator, packed rows or fewer than two examples.
    """
    if len(features) < 2:
        return None
    name = type(collator).__name__

    def collate(items: list, seed: int = 0) -> Mapping[str, Any]:
        seed_every_generator([], seed)  # torch's, NumPy's and Python's: each a source DPTrainer reseeds
        try:
            batch = collator(items)
        except Exception as err:
            raise ValueError(
                f"the data collator {name} failed on {len(items)} of the first training examples while dp_hf "
                f"checked that it keeps examples apart: {type(err).__name__}: {err}. This is the collator's own "
                "error (the plain Trainer would stop on it too): give it what it needs (a tokenizer to pad with), "
                "or make the examples collatable (input_ids of one length with an attention_mask)."
            ) from err
        if not isinstance(batch, Mapping):
            raise ValueError(
                f"the data collator {name} returned a {type(batch).__name__}; DPTrainer needs a dict."
            )
        return batch

    with random_state_kept([]):
        return _probe_collator(collator, collate, features, packed)


def _probe_collator(
    collator, collate: Callable[..., Mapping[str, Any]], features: list, packed: bool
) -> tuple[Mapping[str, Any], Mapping[str, Any]] | None:
    from dp_hf.per_example.ghost.segments import PACKED_ROW_KEYS

    name = type(collator).__name__
    joint = collate(features)
    check_batch_is_per_example(joint, len(features), collator, packed=packed)
    singles = [collate([feature]) for feature in features]
    for single in singles:
        check_batch_is_per_example(single, 1, collator, packed=packed)
    if not packed:
        _check_padding_is_masked(joint, singles, name)
    if not _same_batch(joint, collate(features)):
        raise ValueError(_own_generator_message(collator))
    # A random collator (from the global generators, which training reseeds from the secret seed): its
    # rows cannot be compared.
    if not _same_batch(joint, collate(features, seed=1)):
        return None
    start = 0
    for index, single in enumerate(singles):
        length = int(single["position_ids"].shape[1]) if packed else 0
        for key, value in single.items():
            other = joint.get(key)
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or (packed and key in PACKED_ROW_KEYS):
                continue
            if packed:  # the example's segment of the (single) packed row
                same = isinstance(other, torch.Tensor) and torch.equal(
                    other[:, start : start + length], value
                )
            else:
                same = isinstance(other, torch.Tensor) and _rows_match(other[index], value[0])
            if not same:
                raise ValueError(
                    f"the data collator {name} mixes examples: field {key!r} of example "
                    f"{index} differs when it is collated with other examples. Per-example clipping then "
                    "does not bound one example's influence. Use a collator that only pads/stacks (and do "
                    "batch-level augmentation such as mixup without DP, or per example)."
                )
        start += length
    return None if packed else dynamic_padding_pair(collate, features, singles)


def _own_generator_message(collator: Any) -> str:
    """Why a collator that draws from a generator of its own is refused (dp_hf cannot tell whether its seed
    is secret), and the fix."""
    name = type(collator).__name__
    seed = getattr(collator, "seed", None)
    given = f" (seed={seed!r})" if seed is not None else ""
    return (
        f"the data collator {name}{given} draws random numbers from a generator of its own: the same examples "
        "collated twice under the same global seeds came out different. DPTrainer reseeds torch's, NumPy's and "
        "Python's global generators from the secret sampling seed, but not a collator's own, and cannot tell "
        "whether its seed is secret. Seeded with a public seed, its masks are known to anyone, and which examples "
        "were sampled earlier shifts every later example's masks (one example then changes other examples' "
        "gradients, beyond the clip bound). Draw from "
        "the global generators instead: for DataCollatorForLanguageModeling (and its subclasses) pass seed=None."
    )


def dynamic_padding_pair(
    collate: Callable[[list], Mapping[str, Any]], features: list, singles: list
) -> tuple[Mapping[str, Any], Mapping[str, Any]] | None:
    """``(shortest alone, shortest with the longest)`` collated (``singles``: each feature collated alone), if
    the collator pads the shortest example longer next to the longest one; None when it does not (equal
    lengths, padding to one fixed length) or the batches have no padded dimension."""
    lengths = [padded_length(single) for single in singles]
    if any(length is None for length in lengths):
        return None
    short = min(range(len(features)), key=lengths.__getitem__)
    long = max(range(len(features)), key=lengths.__getitem__)
    together = collate([features[short], features[long]])
    return None if padded_length(together) == lengths[short] else (singles[short], together)


def padded_length(batch: Mapping[str, Any]) -> int | None:
    """The padded length of a batch: its ``attention_mask``'s (or its first 2-D tensor's) second dimension."""
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return int(mask.shape[1])
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[1])
    return None


#: Keys by which collators tell models which positions are padding (text, audio; DETR-style images).
PADDING_MASK_KEYS = ("attention_mask", "pixel_mask", "padding_mask")


def _check_padding_is_masked(joint: Mapping[str, Any], singles: list, name: str) -> None:
    """Refuse a collator that pads examples to their batch's longest without telling the model.

    A row longer than the example collated alone is padded to a length set by the other examples of
    its batch. Without an ``attention_mask`` the model sees those padding tokens (BERT attends to
    them), so each example's output depends on the longest other example and one example changes the
    others' gradients. The loss probe cannot see it: it compares rows of one padded batch.
    """
    if any(isinstance(joint.get(key), torch.Tensor) for key in PADDING_MASK_KEYS):
        return
    for index, single in enumerate(singles):
        for key, value in single.items():
            other = joint.get(key)
            if (
                isinstance(value, torch.Tensor)
                and isinstance(other, torch.Tensor)
                and value.dim() > 1
                and other.dim() == value.dim()
                and other.shape[1:] != value.shape[1:]
            ):
                raise ValueError(
                    f"the data collator {name} pads examples to the longest of their batch ({key!r} of example "
                    f"{index}: {tuple(value.shape[1:])} alone, {tuple(other.shape[1:])} in a batch) and returns no "
                    "attention_mask: the model then sees the padding, so each example's output depends on the "
                    "length of the longest other example of its batch, and one example changes the others' "
                    "gradients (the clip bound no longer bounds its influence). Return an attention_mask (1 for "
                    "tokens, 0 for padding; DataCollatorWithPadding does), or pad every example to one fixed length."
                )


def _same_batch(a, b) -> bool:
    if not isinstance(a, Mapping) or not isinstance(b, Mapping) or a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or not torch.equal(x, y):
                return False
    return True
