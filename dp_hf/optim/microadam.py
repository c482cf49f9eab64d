"""DP-MicroAdam (Hudisteanu et al., on MicroAdam of Modoranu et al.): sparse, memory-frugal Adam on ``gtilde``.

Ordinary privatizer (``c = 0``, ``s = 1``, the user's ``C``), then per parameter
tensor, on its flattened privatized gradient (ALGORITHMS.md §2)::

    a = gtilde + Qinv(e)                           # error feedback, e stored in 4 bits
    split a into blocks of block_size; in each block keep the
        k = ceil(density * block_len) entries of largest |a|
    r = (t - 1) mod m :  I[r] = block-local indices (int16),  V[r] = a[I[r]]  (bf16)
    a[I[r]] = 0 ;  e = Q(a)                        # what was not sent is fed back next step
    mt = sum_{j < min(t, m)} beta1^age_j  * scatter(I_j, V_j)      age_j = (t - 1 - j) mod m
    vt = sum_{j < min(t, m)} beta2^age_j  * scatter(I_j, V_j^2)
    mhat = (1 - beta1) / (1 - beta1^t) * mt ;  vhat = (1 - beta2) / (1 - beta2^t) * vt
    theta *= 1 - lr wd ;  theta -= lr * mhat / (sqrt(vhat) + eps)

``Q`` is 4-bit asymmetric quantization in buckets of ``quant_block`` consecutive
coordinates: per bucket ``lo = min``, ``hi = max``, ``delta = (hi - lo) / 15``,
``code = round((x - lo) / delta)`` (to nearest, as ALGORITHMS.md fixes; the
paper's analysis uses randomized rounding), ``Qinv = lo + code * delta``; a
bucket with ``lo == hi`` gets code 0 and decodes to ``lo`` exactly (no division by
zero). Two codes are packed per ``uint8``.

Choices (documented deviations / freedoms):

* Window values ``V`` are **bfloat16** (MicroAdam's choice as well): with int16
  indices a window entry costs 4 bytes, and the state stays below 1 byte per
  parameter at density 1%, ``m = 10``; fp32 values would make it ~1.1. The bf16
  rounding of ``V`` is not fed back into ``e`` (``a[I] = 0`` as specified).
* ``mt``/``vt`` are rebuilt from the window at every step, never stored densely;
  the update is evaluated only on the window's support (it is 0 elsewhere).
* ``quant_block`` defaults to MicroAdam's library default ``100000``; tensors
  smaller than a bucket form one bucket, and the last bucket may be partial (no
  padding is stored). ``block_size`` (default ``16384``) must be ``<= 32768`` so
  that block-local indices fit int16; a tensor smaller than a block is one block.
  In the last, possibly shorter block ``k = ceil(density * its length)``; unused
  window slots point at padding positions with value 0.
* ``e`` and the window are zeroed at initialisation and ``e`` is overwritten
  every step (the authors' public DP code keeps ``e`` in fp32 and never resets
  its accumulator; ALGORITHMS.md does not follow it).

State per tensor of ``n`` elements (``nb = ceil(n / block_size)`` blocks,
``k`` kept per block): ``step``, ``ef_codes`` (uint8, ``ceil(n / 2)``),
``ef_min``/``ef_max`` (float32, one per bucket), ``win_idx`` (int16,
``[m, nb, k]``), ``win_val`` (bf16, ``[m, nb, k]``): about
``0.5 + m * density * 4`` bytes per parameter (0.9 at density 1%, ``m = 10``)
against 8 for fp32 Adam. ``density``, ``window``, ``block_size`` and
``quant_block`` fix this layout at a tensor's first step.

Privacy: everything after the privatizer is post-processing of ``gtilde``.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from dp_hf.optim._params import FP32Params, advance_steps
from dp_hf.optim.adam import check_adam_hyperparameters
from dp_hf.optim.base import DPOptimizer

#: Largest block for which block-local indices ``0 .. block_size - 1`` fit in int16.
MAX_BLOCK_SIZE = 2**15
#: Number of quantization levels minus one (4 bits).
_LEVELS = 15
#: Below this many top-k selections per coordinate over a run (``density * steps``), most of the model
#: barely moves: 60 steps at density 0.01 (0.6) left the digits ViT at 0.32-0.51 accuracy against
#: 0.65-0.87 for DP-AdamW (bench/fidelity.py).
MIN_SELECTIONS_PER_COORDINATE = 2.0


def sparse_horizon_warning(density: float, total_steps: int) -> str | None:
    """The warning for a ``density`` too low for a run of ``total_steps`` steps, or ``None``.

    Top-k keeps ``density`` of every block per step, so a coordinate is selected about
    ``density * total_steps`` times in the run (error feedback delays the rest, it does not add
    selections); under DP noise the first selections follow the accumulated noise.
    """
    selections = density * total_steps
    if selections >= MIN_SELECTIONS_PER_COORDINATE:
        return None
    return (
        f"DP-MicroAdam with density={density:g} for {total_steps} steps selects each coordinate about "
        f"{selections:.2g} times in the whole run (top-k keeps {density:.2%} of every block per step): most of "
        f"the model barely moves and training stalls. Use density >= "
        f"{min(1.0, MIN_SELECTIONS_PER_COORDINATE / max(total_steps, 1)):.2g} for a run this short (density 1.0 is "
        "close to DP-AdamW), train longer, or use dp-adamw."
    )


# ---------------------------------------------------------------------- 4-bit error buffer
def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes in ``[0, 15]`` two per byte (element ``2i`` low nibble, ``2i+1`` high)."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    return codes[0::2] | (codes[1::2] * 16)  # uint8 multiply: faster than << on CPU, <= 240


def unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: the first ``numel`` codes as uint8."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=1).reshape(-1)[:numel]


def _buckets(numel: int, bucket_size: int) -> tuple[int, int]:
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


def quantize_4bit_rows(x: torch.Tensor, bucket_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_4bit` of each row of ``x`` (``[c, n]``: ``c`` tensors of ``n`` elements) at once.

    Returns ``(packed [c, ceil(n/2)], min [c, nb], max [c, nb])``, row ``i`` equal to
    ``quantize_4bit(x[i], bucket_size)``: the buckets never straddle rows.
    """
    x = x.float()
    rows, n = x.shape
    bucket, num_buckets = _buckets(n, bucket_size)
    pad = num_buckets * bucket - n
    # Pad the last bucket with one of its own values: min/max unchanged, codes dropped.
    xb = (torch.cat([x, x[:, -1:].expand(rows, pad)], dim=1) if pad else x).reshape(rows, num_buckets, bucket)
    lo, hi = xb.amin(dim=2), xb.amax(dim=2)
    delta = (hi - lo) / _LEVELS
    safe_delta = torch.where(delta > 0, delta, torch.ones_like(delta))  # constant bucket: (x - lo) = 0
    codes = (xb - lo[..., None]).div_(safe_delta[..., None]).round_().clamp_(0, _LEVELS).to(torch.uint8)
    codes = codes.view(rows, -1)[:, :n]
    if n % 2:  # one zero code ends an odd row, so that every row packs on its own bytes
        codes = torch.cat([codes, codes.new_zeros(rows, 1)], dim=1)
    return pack_nibbles(codes.reshape(-1)).view(rows, -1), lo, hi


def dequantize_4bit(
    packed: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, numel: int, bucket_size: int
) -> torch.Tensor:
    """Decode :func:`quantize_4bit`'s output to a flat float32 tensor of ``numel`` values."""
    return dequantize_4bit_rows(packed.view(1, -1), lo.view(1, -1), hi.view(1, -1), numel, bucket_size)[0]


def dequantize_4bit_rows(
    packed: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, numel: int, bucket_size: int
) -> torch.Tensor:
    """:func:`dequantize_4bit` of each row (``packed [c, ceil(n/2)]``, ``lo``/``hi`` ``[c, nb]``): ``[c, n]``."""
    rows = packed.shape[0]
    bucket, num_buckets = _buckets(numel, bucket_size)
    codes = unpack_nibbles(packed.reshape(-1), packed.numel() * 2).view(rows, -1)[:, :numel].float()
    pad = num_buckets * bucket - numel
    if pad:
        codes = F.pad(codes, (0, pad))
    delta = (hi - lo) / _LEVELS
    out = torch.addcmul(lo[..., None], codes.reshape(rows, num_buckets, bucket), delta[..., None])
    return out.view(rows, -1)[:, :numel]


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


def blockwise_topk(a: torch.Tensor, block_size: int, density: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block top-k of ``|a|`` for a flat ``a``, all blocks at once.

    Returns ``(indices int64 [nb, k], a_blocks [nb, block])``: block-local indices
    and the zero-padded ``[nb, block]`` view of ``a`` (a copy). In a shorter last
    block only its own ``k_last`` entries are real; its remaining ``k - k_last``
    slots point at distinct padding positions (where ``a_blocks`` is 0).
    """
    idx, a_blocks = blockwise_topk_rows(a.reshape(1, -1), block_size, density)
    return idx[0], a_blocks[0]


def blockwise_topk_rows(
    a: torch.Tensor, block_size: int, density: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`blockwise_topk` of each row of ``a`` (``[c, n]``): ``([c, nb, k], [c, nb, block])``.

    The blocks of one row never straddle into the next: row ``i`` gets exactly the blocks,
    the shorter last block and the padding slots of ``blockwise_topk(a[i])``.
    """
    rows, n = a.shape
    block, num_blocks, k, last_len, k_last = block_layout(n, block_size, density)
    pad = num_blocks * block - n
    a_blocks = F.pad(a, (0, pad)).view(rows, num_blocks, block)
    magnitude = a_blocks.abs()
    if pad:
        magnitude[:, -1, last_len:] = -1.0  # padding never outranks a real entry
    idx = magnitude.view(rows * num_blocks, block).topk(k, dim=1, sorted=False).indices
    idx = idx.view(rows, num_blocks, k)
    if k_last < k:
        idx[:, -1, :k_last] = magnitude[:, -1, :last_len].topk(k_last, dim=1, sorted=False).indices
        # k - k_last <= block - last_len, so these padding positions exist and are distinct.
        idx[:, -1, k_last:] = torch.arange(last_len, last_len + k - k_last, device=a.device)
    return idx, a_blocks


def _check_int(name: str, value, low: int, high: float = math.inf) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        bound = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}.")


def check_microadam_hyperparameters(group: dict) -> None:
    """Validate a group's sparsity/quantization settings, showing the bad value."""
    density = group["density"]
    if not isinstance(density, (int, float)) or isinstance(density, bool) or not 0 < density <= 1:
        raise ValueError(
            f"density (fraction of each block kept by top-k) must be in (0, 1], got {density!r}."
        )
    _check_int("window (number of sparse gradients kept, m)", group["window"], 1)
    _check_int(
        "block_size (top-k block; its local indices are stored in int16)",
        group["block_size"],
        1,
        MAX_BLOCK_SIZE,
    )
    _check_int("quant_block (bucket size of the 4-bit error quantization)", group["quant_block"], 1)


class DPMicroAdam(DPOptimizer):
    """DP-MicroAdam: top-k sparse Adam with 4-bit error feedback and a sliding window of ``m`` gradients.

    Args:
        lr, betas, eps: Adam's.
        weight_decay: decoupled (AdamW-style) weight decay.
        density: fraction of each block kept by top-k (default ``0.01``).
        window: ``m``, number of sparse gradients kept (default ``10``).
        block_size: top-k block length (default ``16384``, at most ``32768``).
        quant_block: bucket size of the 4-bit error quantization (default ``100000``).
        noise_multiplier, max_grad_norm, expected_batch_size, ...: see
            :class:`~dp_hf.optim.base.DPOptimizer`.

    Tuning (docs/optimizers.md): each coordinate must be selected many times over a run (``density * T``
    well above 1; :meth:`check_horizon` warns below 2): the paper's density 0.01 is for thousands of steps.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        density: float = 0.01,
        window: int = 10,
        block_size: int = 16384,
        quant_block: int = 100_000,
        **dp_kwargs,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            density=density,
            window=window,
            block_size=block_size,
            quant_block=quant_block,
        )
        super().__init__(params, defaults, **dp_kwargs)

    def add_param_group(self, param_group: dict) -> None:
        # Validate every group, including per-group overrides (torch's __init__ calls this too).
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        check_adam_hyperparameters(group["betas"], group["eps"], group["weight_decay"])
        group["betas"] = tuple(group["betas"])
        check_microadam_hyperparameters(group)

    def check_horizon(self, total_steps: int) -> None:
        """Warn when a group's ``density`` is too low for ``total_steps`` steps (DPTrainer passes its T)."""
        for density in sorted({group["density"] for group in self.param_groups}):
            message = sparse_horizon_warning(density, total_steps)
            if message is not None:
                warnings.warn(message, UserWarning, stacklevel=2)

    def _state(self, p: torch.Tensor, group: dict) -> dict:
        n = p.numel()
        _, num_blocks, k, _, _ = block_layout(n, group["block_size"], group["density"])
        window = group["window"]
        state = self.state[p]
        if not state:
            _, num_buckets = _buckets(n, group["quant_block"])
            state["step"] = torch.tensor(0.0)
            state["ef_codes"] = torch.zeros((n + 1) // 2, dtype=torch.uint8, device=p.device)
            state["ef_min"] = torch.zeros(num_buckets, dtype=torch.float32, device=p.device)
            state["ef_max"] = torch.zeros(num_buckets, dtype=torch.float32, device=p.device)
            state["win_idx"] = torch.zeros((window, num_blocks, k), dtype=torch.int16, device=p.device)
            state["win_val"] = torch.zeros((window, num_blocks, k), dtype=torch.bfloat16, device=p.device)
        elif tuple(state["win_idx"].shape) != (window, num_blocks, k):
            raise ValueError(
                f"DP-MicroAdam state of a tensor of shape {tuple(p.shape)} has window layout "
                f"{tuple(state['win_idx'].shape)} but the group's density/window/block_size give "
                f"{(window, num_blocks, k)}; these settings cannot change after the first step."
            )
        return state

    #: Largest stack of equal-size tensors processed at once (elements): bounds the float32 scratch
    #: buffers (a few times this size), so the batching never costs much memory, and on CPU keeps them
    #: small enough to be reused by the allocator instead of freshly mapped (page faults) every step.
    max_batch_numel = 2**21

    def sparse_directions(self, group: dict, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Advance every tensor's error buffer and window by one step; return ``mhat / (sqrt(vhat) + eps)``.

        Multi-tensor: the tensors of a group are processed in batches of equal size (same ``numel``,
        device and step ``t``; at most :attr:`max_batch_numel` elements), each batch stacked into ``[c, n]`` so that the blocks, buckets,
        top-k, quantization and window of all its tensors are a handful of batched kernels. Blocks
        and buckets never straddle two tensors, so the result is exactly the per-tensor rule, and the
        state stays per tensor (``self.state[p]``, the layout of the module docstring). The work
        grows with the number of distinct tensor sizes (a few in a transformer), not of tensors.
        """
        states = [self._state(p, group) for p in params]
        step = advance_steps([state["step"] for state in states])
        steps = [step] * len(params) if isinstance(step, float) else step
        batches: dict[tuple, list[int]] = {}
        for index, (p, t) in enumerate(zip(params, steps)):
            batches.setdefault((p.numel(), p.device, t), []).append(index)
        directions: list[torch.Tensor] = [None] * len(params)  # type: ignore[list-item]
        for (n, _, t), members in batches.items():
            per_chunk = max(1, self.max_batch_numel // n)
            for start in range(0, len(members), per_chunk):
                chunk = members[start : start + per_chunk]
                rows = self._sparse_direction_rows(
                    group, int(t), n, [params[i] for i in chunk], [states[i] for i in chunk]
                )
                for i, direction in zip(chunk, rows.unbind(0)):
                    directions[i] = direction.view(params[i].shape)
        return directions

    def _sparse_direction_rows(
        self, group: dict, t: int, n: int, params: list[torch.Tensor], states: list[dict]
    ) -> torch.Tensor:
        """The step-``t`` directions ``[c, n]`` of ``c`` tensors of ``n`` elements (state advanced in place)."""
        beta1, beta2 = group["betas"]
        count = len(params)
        win_idx = torch.stack([state["win_idx"] for state in states])  # [c, m, nb, k]
        win_val = torch.stack([state["win_val"] for state in states])
        window, num_blocks, k = win_idx.shape[1:]

        # a = gtilde + Qinv(e); top-k per block goes to the window, the rest back to e.
        e = dequantize_4bit_rows(
            torch.stack([state["ef_codes"] for state in states]),
            torch.stack([state["ef_min"] for state in states]),
            torch.stack([state["ef_max"] for state in states]),
            n,
            group["quant_block"],
        )
        a = torch.stack([self.privatized_grad(p).reshape(-1) for p in params]).add_(e)
        idx, a_blocks = blockwise_topk_rows(a, group["block_size"], group["density"])
        row = (t - 1) % window
        win_idx[:, row] = idx.to(torch.int16)
        win_val[:, row] = a_blocks.gather(2, idx).to(win_val.dtype)
        torch._foreach_copy_([state["win_idx"][row] for state in states], list(win_idx[:, row].unbind(0)))
        torch._foreach_copy_([state["win_val"][row] for state in states], list(win_val[:, row].unbind(0)))
        a_blocks.scatter_(2, idx, 0.0)
        codes, lo, hi = quantize_4bit_rows(a_blocks.view(count, -1)[:, :n], group["quant_block"])
        for key, value in (("ef_codes", codes), ("ef_min", lo), ("ef_max", hi)):
            torch._foreach_copy_([state[key] for state in states], list(value.unbind(0)))

        # Moments from the window, all blocks of all c tensors as rows. One scatter per window row:
        # indices within a row are distinct, so the sums are deterministic on CUDA too.
        rows = min(t, window)
        rows_idx = win_idx[:, :rows].long().view(count, rows, num_blocks, k)
        block = a_blocks.shape[2]
        mt = torch.zeros(count * num_blocks, block, dtype=torch.float32, device=a.device)
        vt = torch.zeros_like(mt)
        for j in range(rows):
            age = (t - 1 - j) % window
            where = rows_idx[:, j].reshape(count * num_blocks, k)
            values = win_val[:, j].float().reshape(count * num_blocks, k)
            mt.scatter_add_(1, where, values * beta1**age)
            vt.scatter_add_(1, where, values.square_().mul_(beta2**age))
        # The direction is 0 off the window's support (mhat = 0 there): evaluate it only on the
        # support (<= m k entries per block) instead of the dense tensor.
        support = rows_idx.permute(0, 2, 1, 3).reshape(count * num_blocks, rows * k)
        mhat = mt.gather(1, support).mul_((1 - beta1) / (1 - beta1**t))
        vhat = vt.gather(1, support).mul_((1 - beta2) / (1 - beta2**t))
        ratio = mhat.div_(vhat.sqrt_().add_(group["eps"]))
        # Repeated support entries carry the same ratio, so the overwrite order does not matter.
        direction = mt.zero_().scatter_(1, support, ratio)
        return direction.view(count, -1)[:, :n]

    def update(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            if not params:
                continue
            directions = self.sparse_directions(group, params)
            weights = FP32Params(params)
            lr, weight_decay = group["lr"], group["weight_decay"]
            if weight_decay != 0:
                torch._foreach_mul_(weights.tensors, 1 - lr * weight_decay)
            torch._foreach_add_(weights.tensors, directions, alpha=-lr)
            weights.write_back()
