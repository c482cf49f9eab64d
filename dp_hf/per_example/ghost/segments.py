"""Examples as segments of packed rows (padding-free batches): :class:`Segments` and :func:`find_segments`.

A padding-free collator (trl's ``DataCollatorForLanguageModeling(padding_free=True)``) concatenates
the examples of a micro-batch into one row, ``position_ids`` restarting at 0 for each example. The
models of transformers then attend within each segment only (a block-diagonal causal mask derived
from ``position_ids``: a new segment wherever two consecutive positions do not differ by 1), so
example ``i``'s tokens are a segment of the row and its per-example gradient is a sum over that
segment's tokens: ``G_i = sum_{t in segment i} g_t (x) a_t``.

:meth:`Segments.regroup` turns a per-token tensor ``[rows, T, ...]`` into ``[S, T_max, ...]`` (one
zero-padded row per segment), so the recorder and the kernels of the fast path see the segments as
the batch: a zero position contributes exactly 0 to every norm, inner product and clipped sum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dp_hf.per_example.errors import PerSampleGradientError

__all__ = ["PACKED_ROW_KEYS", "Segments", "check_packing_keys", "find_segments", "split_segments"]

#: What trl's padding-free collator adds to a packed row, besides ``position_ids``.
PACKED_ROW_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


@dataclass(frozen=True)
class Segments:
    """Which example each token of a packed ``[rows, T]`` batch belongs to.

    ``ids[r, t]`` is the segment (example) index of token ``(r, t)``, ``offsets[r, t]`` its
    position within its segment; segments are numbered in row-major order. ``lengths[s]`` is the
    number of tokens of segment ``s``.
    """

    ids: torch.Tensor  # [rows, T] long
    offsets: torch.Tensor  # [rows, T] long
    lengths: torch.Tensor  # [S] long
    max_length: int

    @property
    def num_segments(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.ids.shape[0]), int(self.ids.shape[1])

    def to(self, device: torch.device) -> Segments:
        if self.ids.device == device:
            return self
        return Segments(
            self.ids.to(device), self.offsets.to(device), self.lengths.to(device), self.max_length
        )

    def _check_per_token(self, x: torch.Tensor, what: str) -> tuple[int, int]:
        """``(rows, T)``, after checking that ``x`` is ``[rows, T, *rest]`` (one entry per token)."""
        rows, length = self.shape
        if x.dim() < 2 or x.shape[0] != rows or x.shape[1] != length:
            raise PerSampleGradientError(
                f"{what} has shape {tuple(x.shape)} but the packed batch is [{rows}, {length}] tokens: only "
                "layers that act token by token on the packed rows can be split into per-example segments."
            )
        return rows, length

    def regroup(self, x: torch.Tensor, what: str = "a layer input") -> torch.Tensor:
        """``x`` ``[rows, T, *rest]`` (one entry per token) as ``[S, T_max, *rest]``, zero-padded."""
        self._check_per_token(x, what)
        ids, offsets = self.ids.to(x.device), self.offsets.to(x.device)
        out = x.new_zeros(self.num_segments, self.max_length, *x.shape[2:])
        out[ids, offsets] = x
        return out

    def sum_tokens(self, x: torch.Tensor, what: str = "a layer gradient") -> torch.Tensor:
        """Sum ``x`` ``[rows, T, *rest]`` (one entry per token) over each segment: ``[S, *rest]``."""
        rows, length = self._check_per_token(x, what)
        flat = x.reshape(rows * length, *x.shape[2:])
        out = x.new_zeros(self.num_segments, *x.shape[2:])
        return out.index_add_(0, self.ids.to(x.device).reshape(-1), flat)

    def reduce(self, per_token: torch.Tensor) -> torch.Tensor:
        """Sum a ``[rows, T]`` per-token tensor over each segment: ``[S]``."""
        out = per_token.new_zeros(self.num_segments)
        return out.index_add_(0, self.ids.to(per_token.device).reshape(-1), per_token.reshape(-1))


def find_segments(position_ids: torch.Tensor) -> Segments:
    """The segments of packed rows from their ``position_ids`` ``[rows, T]``.

    A segment starts wherever the position does not follow the previous one by 1 (transformers'
    rule for its block-diagonal mask, ``find_packed_sequence_indices``), and must start at position
    0 (positions ``0 .. L-1``, as a padding-free collator writes them); otherwise the batch is refused.

    A micro-batch's checks, its split, its clipping and its losses all ask for the same tensor's
    segments, and finding them reads it on the host (on a GPU, a synchronization): the last answer
    is kept for that tensor object, as long as it is not modified in place (its version).
    """
    global _last_found
    last = _last_found
    if last is not None and last[0] is position_ids and last[1] == position_ids._version:
        return last[2]
    segments = segments_of(position_ids)
    _last_found = (position_ids, position_ids._version, segments)
    return segments


_last_found: tuple[torch.Tensor, int, Segments] | None = None


def segments_of(position_ids: torch.Tensor) -> Segments:
    """:func:`find_segments` without its memory of the last tensor."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.numel() == 0:
        shape = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else None
        raise ValueError(f"packed rows need 2-D position_ids, got {shape}.")
    position_ids = position_ids.long()
    starts = torch.ones_like(position_ids, dtype=torch.bool)  # every row starts a segment
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    if bool((position_ids[starts] != 0).any()):
        raise ValueError(
            "position_ids jump to a non-zero position inside a packed row: the segments do not start at 0, "
            "so they cannot be told apart as whole examples."
        )
    ids = starts.reshape(-1).cumsum(0).reshape(position_ids.shape) - 1
    lengths = torch.bincount(ids.reshape(-1))
    return Segments(ids, position_ids, lengths, int(lengths.max()))


def check_packing_keys(batch: Mapping[str, Any], segments: Segments) -> list[str]:
    """What in ``batch``'s packing keys disagrees with ``segments`` (empty: consistent)."""
    problems = []
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), segments.lengths.cumsum(0).cpu()])
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        value = batch.get(key)
        if value is not None and (
            not isinstance(value, torch.Tensor) or not torch.equal(value.cpu().long().reshape(-1), bounds)
        ):
            problems.append(f"{key} does not match the segments of position_ids")
    for key in ("max_length_q", "max_length_k"):
        value = batch.get(key)
        if value is not None and int(value) != segments.max_length:
            problems.append(f"{key}={int(value)} but the longest segment has {segments.max_length} tokens")
    seq_idx = batch.get("seq_idx")
    if seq_idx is not None and (
        not isinstance(seq_idx, torch.Tensor)
        or seq_idx.shape != segments.ids.shape
        or not torch.equal(seq_idx.cpu().long(), segments.ids.cpu())
    ):
        problems.append("seq_idx does not match the segments of position_ids")
    return problems


def split_segments(batch: Mapping[str, Any], max_examples: int) -> list[dict[str, Any]]:
    """Split a packed one-row batch into pieces of at most ``max_examples`` whole segments (memory bound)."""
    segments = find_segments(batch["position_ids"])
    if segments.num_segments <= max_examples:
        return [dict(batch)]
    if segments.shape[0] != 1:
        raise ValueError("only a single packed row can be split by segments.")
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), segments.lengths.cpu().cumsum(0)]).tolist()
    length = segments.shape[1]
    pieces = []
    for first in range(0, segments.num_segments, max_examples):
        last = min(first + max_examples, segments.num_segments)
        start, stop = bounds[first], bounds[last]
        piece: dict[str, Any] = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == length:
                piece[key] = value[:, start:stop]
            elif key not in PACKED_ROW_KEYS:
                piece[key] = value
        own = segments.lengths[first:last].cpu()
        cu = torch.cat([torch.zeros(1, dtype=torch.long), own.cumsum(0)])
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            if key in batch:
                piece[key] = cu.to(dtype=batch[key].dtype, device=batch[key].device)
        for key in ("max_length_q", "max_length_k"):
            if key in batch:
                piece[key] = int(own.max())
        if "seq_idx" in batch:
            piece["seq_idx"] = batch["seq_idx"][:, start:stop] - first
        pieces.append(piece)
    return pieces
