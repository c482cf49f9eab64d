"""DP-MicroAdam's sparse kernels: the 4-bit error buffer and the per-block top-k, all rows at once.

Each function works on ``[c, n]`` stacks of ``c`` flattened tensors of ``n`` elements; blocks and
buckets never straddle two rows, so a row's result is that of the tensor alone. The rule itself,
its state and the formulas are in :mod:`dp_hf.optim.microadam`.
"""

from __future__ import annotations

import math

import torch

#: Largest block for which block-local indices ``0 .. block_size - 1`` fit in int16.
MAX_BLOCK_SIZE = 2**15
#: Number of quantization levels minus one (4 bits).
_LEVELS = 15


# ---------------------------------------------------------------------- 4-bit error buffer
def bucket_layout(numel: int, bucket_size: int) -> tuple[int, int]:
    """``(bucket, num_buckets)`` of a flat tensor: a tensor smaller than a bucket is one bucket."""
    bucket = min(bucket_size, numel)
    return bucket, math.ceil(numel / bucket)


def quantize_4bit(x: torch.Tensor, bucket_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit asymmetric round-to-nearest quantization of a flat tensor in buckets.

    Returns ``(packed codes uint8 [ceil(n/2)], min float32 [nb], max float32 [nb])``.
    Decoding error is at most half a level, ``(max - min) / 30``, per bucket (up to
    float rounding); a constant bucket decodes exactly.
    """
    packed, lo, hi = quantize_4bit_rows(x.reshape(1, -1), bucket_size)
    return packed[0], lo[0], hi[0]


def _bucket_regions(numel: int, bucket_size: int) -> list[tuple[int, int, int, int]]:
    """``(start, first_bucket, count, size)``: the whole buckets, then the shorter last one (if any).

    Quantization works on ``[rows, count, size]`` views of each region, so a partial last bucket
    needs neither a padded copy of the data nor padding in the state.
    """
    bucket, _ = bucket_layout(numel, bucket_size)
    full = numel // bucket
    regions = [(0, 0, full, bucket)]
    if full * bucket < numel:
        regions.append((full * bucket, full, 1, numel - full * bucket))
    return regions


def quantize_4bit_rows(x: torch.Tensor, bucket_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_4bit` of each row of ``x`` (``[c, n]``: ``c`` tensors of ``n`` elements) at once.

    Returns ``(packed [c, ceil(n/2)], min [c, nb], max [c, nb])``, row ``i`` equal to
    ``quantize_4bit(x[i], bucket_size)``: the buckets never straddle rows.
    """
    return quantize_4bit_rows_(x.float().clone(), bucket_size)


def quantize_4bit_rows_(x: torch.Tensor, bucket_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_4bit_rows` of a float32 ``x`` whose rows have unit stride, overwriting ``x``.

    The optimizer's step quantizes its scratch buffer in place: no float32 temporaries. The codes
    are paired while still floats (``even + 16 odd`` is exact up to 255) and converted once,
    through int16: float -> uint8 conversion is ~3x slower on a CPU.
    """
    rows, n = x.shape
    lows, highs = [], []
    for start, _, count, size in _bucket_regions(n, bucket_size):
        xb = x[:, start : start + count * size].view(rows, count, size)
        lo, hi = xb.amin(dim=2), xb.amax(dim=2)
        delta = (hi - lo) / _LEVELS
        safe_delta = torch.where(delta > 0, delta, torch.ones_like(delta))  # constant bucket: (x - lo) = 0
        xb.sub_(lo[..., None]).div_(safe_delta[..., None]).round_().clamp_(0, _LEVELS)
        lows.append(lo)
        highs.append(hi)
    lo, hi = (torch.cat(v, dim=1) if len(v) > 1 else v[0] for v in (lows, highs))
    half = n // 2
    packed = torch.empty(rows, (n + 1) // 2, dtype=torch.uint8, device=x.device)
    pairs = torch.add(x[:, 0 : 2 * half : 2], x[:, 1 : 2 * half : 2], alpha=16)
    packed[:, :half] = pairs.to(torch.int16)
    if n % 2:  # the last code of an odd row is alone in its byte (high nibble 0)
        packed[:, half] = x[:, n - 1].to(torch.int16)
    return packed, lo, hi


def dequantize_4bit(
    packed: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, numel: int, bucket_size: int
) -> torch.Tensor:
    """Decode :func:`quantize_4bit`'s output to a flat float32 tensor of ``numel`` values."""
    return dequantize_4bit_rows(packed.view(1, -1), lo.view(1, -1), hi.view(1, -1), numel, bucket_size)[0]


def dequantize_4bit_rows(
    packed: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    numel: int,
    bucket_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`dequantize_4bit` of each row (``packed [c, ceil(n/2)]``, ``lo``/``hi`` ``[c, nb]``): ``[c, n]``.

    ``out`` (float32 ``[c, n]``, rows of unit stride) receives the result instead of a new tensor.
    """
    rows = packed.shape[0]
    if out is None:
        out = torch.empty(rows, numel, dtype=torch.float32, device=packed.device)
    half = numel // 2
    out[:, 0 : 2 * half : 2] = packed[:, :half] & 0x0F  # codes straight into float, no uint8 copy
    out[:, 1 : 2 * half : 2] = packed[:, :half] >> 4
    if numel % 2:
        out[:, numel - 1] = packed[:, half] & 0x0F
    delta = (hi - lo) / _LEVELS
    for start, first, count, size in _bucket_regions(numel, bucket_size):
        buckets = slice(first, first + count)
        # lo + code * delta as a multiply then an add: a broadcast addcmul is ~6x slower on a CPU
        out[:, start : start + count * size].view(rows, count, size).mul_(delta[:, buckets, None]).add_(
            lo[:, buckets, None]
        )
    return out


# ---------------------------------------------------------------------- top-k layout
def topk_count(density: float, length: int) -> int:
    """``k = ceil(density * length)``, in ``[1, length]`` (rounded first so 0.07 * 100 gives 7, not 8)."""
    return min(length, max(1, math.ceil(round(density * length, 9))))


def block_layout(numel: int, block_size: int, density: float) -> tuple[int, int, int, int, int]:
    """``(block, num_blocks, k, last_len, k_last)`` of a flat tensor of ``numel`` elements."""
    block = min(block_size, numel)
    num_blocks = math.ceil(numel / block)
    last_len = numel - (num_blocks - 1) * block
    return block, num_blocks, topk_count(density, block), last_len, topk_count(density, last_len)


def topk_lanes(length: int, k: int) -> int | None:
    """Lanes ``r`` of :func:`topk_abs_rows`'s two rounds for a row of ``length``, or None (one round).

    The rounds cost about ``length / r + r k``, least near ``r = sqrt(length / k)``: 8 at density 1%.
    """
    for lanes in (16, 8, 4):
        if length % lanes == 0 and lanes * lanes * k <= length:
            return lanes
    return None


def topk_abs_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[R, k]`` of the ``k`` entries of largest ``|x|`` in each row of ``x`` (``[R, L]``, unit
    inner stride), in no order; ties at the k-th value broken arbitrarily (NaN ranks highest, as in
    ``torch.topk``).

    On a CPU, when ``k`` is a small fraction of ``L``, in two rounds (about 2x faster than one
    ``topk`` at density 1%, and ``|x|`` is never written out): a row is split into ``G = L / r``
    strided groups ``{j, j + G, ..., j + (r - 1) G}``; then the top ``k`` of the ``r k`` entries of
    the ``k`` groups with the largest maxima. Exact: with ``tau`` the k-th largest group maximum and
    ``v`` the row's k-th largest value, ``v >= tau`` (k groups have a maximum >= tau); every entry
    above ``tau`` is in a group with a maximum above ``tau``, and fewer than ``k`` such groups exist,
    so all are chosen; the chosen groups hold at least ``k`` entries >= ``tau``. Hence their top ``k``
    has the row's top-k values. On an accelerator ``topk`` is a radix select, one round.
    """
    rows, length = x.shape
    lanes = topk_lanes(length, k) if x.device.type == "cpu" else None
    if lanes is None:
        return x.abs().topk(k, dim=1, sorted=False).indices
    groups = length // lanes
    strided = x.reshape(rows, lanes, groups)
    group_max = torch.maximum(strided.amax(dim=1), strided.amin(dim=1).neg_())  # max |x|; NaN stays
    best = group_max.topk(k, dim=1, sorted=False).indices  # [R, k] groups
    candidates = strided.gather(2, best.unsqueeze(1).expand(rows, lanes, k)).view(rows, lanes * k).abs_()
    pick = candidates.topk(k, dim=1, sorted=False).indices  # lane pick // k of group best[pick % k]
    return best.gather(1, pick % k) + (pick // k) * groups


def topk_of_blocks(a_blocks: torch.Tensor, n: int, block_size: int, density: float) -> torch.Tensor:
    """Top-k indices ``[c, nb, k]`` of ``|a_blocks|`` (``[c, nb, block]``, zero past ``n``)."""
    rows = a_blocks.shape[0]
    block, num_blocks, k, last_len, k_last = block_layout(n, block_size, density)
    idx = topk_abs_rows(a_blocks.view(rows * num_blocks, block), k).view(rows, num_blocks, k)
    if num_blocks * block > n:  # the padded last block again, on its real entries only
        idx[:, -1, :k_last] = topk_abs_rows(a_blocks[:, -1, :last_len], k_last)
        # k - k_last <= block - last_len, so these padding positions exist and are distinct.
        idx[:, -1, k_last:] = torch.arange(last_len, last_len + k - k_last, device=a_blocks.device)
    return idx
