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
* Ties in ``|a|`` at a block's k-th value (ALGORITHMS.md is silent) are broken arbitrarily:
  every choice keeps the same values; the CPU's faster top-k breaks them differently from
  ``torch.topk`` (:func:`~dp_hf.optim.sparse.topk_abs_rows`).
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
from collections.abc import Callable

import torch

from dp_hf.optim._params import FP32Params, advance_steps
from dp_hf.optim.adam import check_adam_hyperparameters
from dp_hf.optim.base import DPOptimizer
from dp_hf.optim.sparse import (
    MAX_BLOCK_SIZE,
    block_layout,
    bucket_layout,
    dequantize_4bit_rows,
    quantize_4bit_rows_,
    topk_of_blocks,
)

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


#: State a batch of same-size tensors keeps as rows of stacked tensors (:class:`StateStacks`).
BATCHED_KEYS = ("win_idx", "win_val", "ef_codes", "ef_min", "ef_max")


class StateStacks:
    """A batch's state as stacks ``[c, ...]`` (one per key of :data:`BATCHED_KEYS`) whose rows *are*
    each tensor's ``state[key]``.

    The first time a batch is seen (and whenever its tensors' state is not such rows: after
    ``load_state_dict``, or when other tensors are batched together) the per-tensor state is stacked
    once and each ``state[p][key]`` becomes a view of its row. Later steps read and write the stacks
    in place: no stacking and copying back of the whole state (five kernels per tensor) every step.
    ``optimizer.state[p]`` keeps its per-tensor layout for ``state_dict``.
    """

    def __init__(self) -> None:
        self.batches: dict[tuple, tuple] = {}  # key -> (stacks, params, data_ptr of each row per key)
        self.seen: dict[tuple, tuple] = {}

    def rows(self, params: list[torch.Tensor], states: list[dict]) -> dict[str, torch.Tensor]:
        key = tuple(id(p) for p in params)
        entry = self.batches.get(key)
        if entry is None or not all(
            state[name].data_ptr() == rows_at[j]
            for name, rows_at in entry[2].items()
            for j, state in enumerate(states)
        ):
            stacks = {name: torch.stack([state[name] for state in states]) for name in BATCHED_KEYS}
            for j, state in enumerate(states):
                for name in BATCHED_KEYS:
                    state[name] = stacks[name][j]
            rows_at = {name: [row.data_ptr() for row in stacks[name]] for name in BATCHED_KEYS}
            entry = (stacks, list(params), rows_at)
        self.seen[key] = entry
        return entry[0]

    def release_unused(self, optimizer_state: dict) -> None:
        """End of a step: the tensors of batches not used in it get their own state again (a frozen
        tensor's view would keep its whole batch's stacks alive)."""
        for key, (_, params, rows_at) in self.batches.items():
            if key in self.seen:
                continue
            for j, p in enumerate(params):
                state = optimizer_state.get(p, {})
                for name in BATCHED_KEYS:
                    if name in state and state[name].data_ptr() == rows_at[name][j]:
                        state[name] = state[name].clone()
        self.batches, self.seen = self.seen, {}


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
        # Validate every group, including per-group overrides (torch's __init__ calls this too), before it
        # is added: a refused group is not kept.
        merged = {**self.defaults, **param_group}
        check_adam_hyperparameters(merged["betas"], merged["eps"], merged["weight_decay"])
        check_microadam_hyperparameters(merged)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["betas"] = tuple(group["betas"])

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
            _, num_buckets = bucket_layout(n, group["quant_block"])
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

    #: Largest stack of equal-size tensors processed at once on an accelerator (elements): bounds the two
    #: float32 work buffers (:meth:`_scratch`; 2 x 128 MiB). Each batch costs ~40 kernel launches from
    #: Python whatever its size: at 2^21, BERT-base's 177 tensors made 47 batches (every 768 x 3072 matrix
    #: its own), at 2^25 they make 9.
    max_batch_numel = 2**25
    #: The same on a CPU: 4 MB buffers stay closer in cache over a batch's ~20 passes (10M parameters
    #: in 169 tensors: update 97 ms against 105 ms at 2^21, 2 threads; 133 against 160 ms, 1 thread).
    max_batch_numel_cpu = 2**20

    def _batch_limit(self, device: torch.device) -> int:
        return self.max_batch_numel_cpu if device.type == "cpu" else self.max_batch_numel

    def _scratch(self, numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Two float32 work buffers of ``numel`` elements (contents undefined).

        On a CPU a batch's buffers are tens of MB: freshly allocated, each step pays their page faults
        (~12,000 per step for 10M parameters) again. Buffers up to ``max_batch_numel_cpu`` plus one block
        are therefore kept between steps (at most ~2 x 4.3 MB; not optimizer state); larger ones, and
        all on an accelerator (whose caching allocator reuses memory), are allocated per batch.
        """
        if device.type != "cpu" or numel > self._batch_limit(device) + MAX_BLOCK_SIZE:
            return tuple(torch.empty(numel, dtype=torch.float32, device=device) for _ in range(2))
        kept = getattr(self, "_cpu_scratch", None)
        if kept is None or kept[0].numel() < numel:
            kept = self._cpu_scratch = tuple(torch.empty(numel, dtype=torch.float32) for _ in range(2))
        return kept[0][:numel], kept[1][:numel]

    def sparse_directions(
        self, group: dict, params: list[torch.Tensor], apply: Callable[[list[int], list[torch.Tensor]], None]
    ) -> None:
        """Advance every tensor's error buffer and window by one step; hand ``mhat / (sqrt(vhat) + eps)`` on.

        ``apply(indices, directions)`` receives each batch's directions (``directions[j]`` of
        ``params[indices[j]]``, in its shape) and must use them before it returns: they live in a
        work buffer that the next batch overwrites.

        Multi-tensor: the tensors of a group are processed in batches of equal size (same ``numel``,
        device and step ``t``; at most :attr:`max_batch_numel` elements, :attr:`max_batch_numel_cpu`
        on a CPU), each batch stacked into ``[c, n]`` so that the blocks, buckets, top-k,
        quantization and window of all its tensors are a handful of batched kernels. Blocks and
        buckets never straddle two tensors, so the result is exactly the per-tensor rule, and the
        state stays per tensor (``self.state[p]``, the layout of the module docstring). The work
        grows with the number of distinct tensor sizes (a few in a transformer), not of tensors.
        """
        states = [self._state(p, group) for p in params]
        step = advance_steps([state["step"] for state in states])
        steps = [step] * len(params) if isinstance(step, float) else step
        batches: dict[tuple, list[int]] = {}
        for index, (p, t) in enumerate(zip(params, steps)):
            batches.setdefault((p.numel(), p.device, t), []).append(index)
        for (n, device, t), members in batches.items():
            per_chunk = max(1, self._batch_limit(device) // n)
            for start in range(0, len(members), per_chunk):
                chunk = members[start : start + per_chunk]
                rows = self._sparse_direction_rows(
                    group, int(t), n, [params[i] for i in chunk], [states[i] for i in chunk]
                )
                apply(chunk, [row.view(params[i].shape) for i, row in zip(chunk, rows.unbind(0))])

    def _sparse_direction_rows(
        self, group: dict, t: int, n: int, params: list[torch.Tensor], states: list[dict]
    ) -> torch.Tensor:
        """The step-``t`` directions ``[c, n]`` of ``c`` tensors of ``n`` elements (state advanced in place).

        Two dense float32 scratch buffers serve every phase (on a CPU, fresh large buffers cost page
        faults and each dense pass is memory-bound): ``a`` in blocks, quantized in place, then the
        first moment; the second moment.
        """
        beta1, beta2 = group["betas"]
        block_size, density = group["block_size"], group["density"]
        count = len(params)
        stacks = self._stacks.rows(params, states)  # rows are the tensors' state: updated in place
        win_idx, win_val = stacks["win_idx"], stacks["win_val"]  # [c, m, nb, k]
        window, num_blocks, k = win_idx.shape[1:]
        block = min(block_size, n)

        # a = gtilde + Qinv(e), written into the zero-padded blocks; top-k per block goes to the
        # window, the rest back to e.
        buffer, second = self._scratch(count * num_blocks * block, params[0].device)
        a_blocks = buffer.view(count, num_blocks * block)
        a_blocks[:, n:].zero_()
        a = a_blocks[:, :n]
        dequantize_4bit_rows(
            stacks["ef_codes"],
            stacks["ef_min"],
            stacks["ef_max"],
            n,
            group["quant_block"],
            out=a,
        )
        torch._foreach_add_(list(a.unbind(0)), [self.privatized_grad(p).reshape(-1) for p in params])
        a_blocks = a_blocks.view(count, num_blocks, block)
        idx = topk_of_blocks(a_blocks, n, block_size, density)
        row = (t - 1) % window
        win_idx[:, row] = idx.to(torch.int16)
        win_val[:, row] = a_blocks.gather(2, idx).to(win_val.dtype)
        a_blocks.scatter_(2, idx, 0.0)
        codes, lo, hi = quantize_4bit_rows_(a, group["quant_block"])
        for key, value in (("ef_codes", codes), ("ef_min", lo), ("ef_max", hi)):
            stacks[key].copy_(value)

        # Moments from the window, all blocks of all c tensors as rows; support[:, j*k:(j+1)*k] is
        # window row j. mt[i] sums its window rows in the order j = 0, 1, ...
        rows = min(t, window)
        support = win_idx[:, :rows].permute(0, 2, 1, 3).reshape(count * num_blocks, rows * k).long()
        values = win_val[:, :rows].permute(0, 2, 1, 3).reshape(count * num_blocks, rows, k).float()
        decay1, decay2 = self._window_decays(beta1, beta2, t, window, values.device)
        weighted_m = (values * decay1).reshape(count * num_blocks, rows * k)
        weighted_v = values.square_().mul_(decay2).reshape(count * num_blocks, rows * k)
        mt = a_blocks.view(count * num_blocks, block).zero_()
        vt = second.view(count * num_blocks, block).zero_()
        if mt.device.type == "cpu":  # one pass: CPU scatter_add visits each row's indices in order
            mt.scatter_add_(1, support, weighted_m)
            vt.scatter_add_(1, support, weighted_v)
        else:  # indices are distinct within a window row: sums stay deterministic with atomics
            for j in range(rows):
                span = slice(j * k, (j + 1) * k)
                mt.scatter_add_(1, support[:, span], weighted_m[:, span])
                vt.scatter_add_(1, support[:, span], weighted_v[:, span])
        # The direction is 0 off the window's support (mhat = 0 there): evaluate it only on the
        # support (<= m k entries per block) instead of the dense tensor.
        mhat = mt.gather(1, support).mul_((1 - beta1) / (1 - beta1**t))
        vhat = vt.gather(1, support).mul_((1 - beta2) / (1 - beta2**t))
        ratio = mhat.div_(vhat.sqrt_().add_(group["eps"]))
        # mt is 0 off the support (scatter_add touched only the support), so writing the ratio on
        # the support makes it the direction. Repeated support entries carry the same ratio.
        direction = mt.scatter_(1, support, ratio)
        return direction.view(count, -1)[:, :n]

    def _window_decays(
        self, beta1: float, beta2: float, t: int, window: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``beta^age_j`` of window rows ``j < min(t, m)``, ``[rows, 1]`` float32, for beta1 and beta2.

        Cached (at most ``2 m`` entries per betas and device: they depend on ``t`` only through
        ``min(t, m)`` and ``(t - 1) mod m``): a tensor made from a Python list is a host-to-device copy
        that waits for the device, once per batch of tensors, every step (on an H100, BERT-base's
        step waited 94 times and took 103 ms; the update's kernels took under 25 ms).
        """
        rows, row = min(t, window), (t - 1) % window
        key = (beta1, beta2, rows, row, window, device)
        cache = self.__dict__.setdefault("_decay_cache", {})  # not state: rebuilt after unpickling
        if key not in cache:
            ages = [(row - j) % window for j in range(rows)]
            cache[key] = tuple(
                torch.tensor([beta**age for age in ages], dtype=torch.float32, device=device).view(rows, 1)
                for beta in (beta1, beta2)
            )
        return cache[key]

    def update(self) -> None:
        if not hasattr(self, "_stacks"):  # also after unpickling (torch pickles state and groups only)
            self._stacks = StateStacks()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            if not params:
                continue
            weights = FP32Params(params)
            lr, weight_decay = group["lr"], group["weight_decay"]
            if weight_decay != 0:
                torch._foreach_mul_(weights.tensors, 1 - lr * weight_decay)

            def apply(indices: list[int], directions: list[torch.Tensor], weights=weights, lr=lr) -> None:
                torch._foreach_add_([weights.tensors[i] for i in indices], directions, alpha=-lr)

            self.sparse_directions(group, params, apply)
            weights.write_back()
        self._stacks.release_unused(self.state)
