"""`DPOptimizer`: a `torch.optim.Optimizer` whose `step()` privatizes first.

Use it like any torch optimizer, with per-example gradients in ``p.grad_sample``
(``[B, *p.shape]``, as Opacus's ``GradSampleModule`` or
:func:`dp_hf.per_example.attach_grad_sample` leave them)::

    loss = per_example_losses.sum()
    loss.backward()
    optimizer.clip_and_accumulate()   # optional: once per micro-batch
    optimizer.step()                  # clip (rest), noise once, update
    optimizer.zero_grad()

``step()`` forms ``gtilde`` with the :class:`~dp_hf.privatizer.Privatizer` in the
geometry the subclass returns from :meth:`DPOptimizer.geometry`, writes it to
``p.grad`` and calls :meth:`DPOptimizer.update`, the subclass's rule.

Completeness: before clipping a micro-batch, :meth:`DPOptimizer.clip_and_accumulate` checks that
the per-example gradients sum to ``p.grad``, the ordinary gradient autograd computed alongside
them. Per-sample hooks only see a parameter's uses inside its own module's ``forward``; any other
use (``F.linear(x, self.child.weight)`` in a parent, a weight shared with a functional call) is
missing from ``p.grad_sample`` but present in ``p.grad``, and is refused rather than silently
clipped away.

State: per-parameter tensors in ``self.state[p]`` as in torch; the optimizer-wide
DP state (step count, noise generator) in ``self.state["dp"]``, which torch's own
``state_dict()``/``load_state_dict()`` carry as a non-parameter key. Nothing is
stored on the parameters except the transient ``grad_sample`` that the
per-sample hooks write and ``clip_and_accumulate`` consumes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from dp_hf.noise import NoiseSource
from dp_hf.privatizer import Geometry, Privatizer
from dp_hf.validation import check_max_grad_norm, check_noise_multiplier, check_positive_finite


class PrivacyBudgetExceededError(RuntimeError):
    """Raised when a step would spend more privacy than the budget allows."""


# Tolerance of the completeness check in clip_and_accumulate: ||sum_i g_i - p.grad|| must stay below
# tol * (||p.grad|| + ||sum_i g_i|| + ||G||_F), where ||G||_F is the Frobenius norm of all per-example
# gradients of the micro-batch (every tensor, every example). The last term is the absolute floor
# that tensors whose exact gradient is ~0 need (e.g. attention key biases, which softmax ignores:
# their p.grad is pure rounding noise). tol = max(_SUM_CHECK_MIN_TOL, _SUM_CHECK_EPS_FACTOR * eps)
# for the least precise of the two dtypes (bf16: 3.1e-2). Measured on the tiny BERT/RoBERTa/GPT-2/
# Llama/ViT/DeiT/LoRA models of tests/test_grad_sample.py, the ratio is <= 1.4e-7 in float32 and
# <= 3e-3 with bf16 weights or autocast: a margin of 10x (bf16) to 7000x (float32) for larger
# batches, longer sequences and other summation orders, while a use the hooks missed is found as
# soon as it is above ~0.1% (float32) / ~3% (bf16) of that scale.
_SUM_CHECK_MIN_TOL = 1e-3
_SUM_CHECK_EPS_FACTOR = 4.0


def _compute_eps(dtype: torch.dtype, device: torch.device) -> float:
    """Machine epsilon of the arithmetic that produced a tensor of ``dtype`` on ``device``."""
    eps = torch.finfo(dtype).eps
    if dtype == torch.float32 and device.type != "cpu":
        # CUDA matmuls/convolutions may run in TF32 (10-bit mantissa), or in bf16 when the float32
        # matmul precision is "medium", while the tensors stay float32.
        low = torch.bfloat16 if torch.get_float32_matmul_precision() == "medium" else None
        eps = max(eps, torch.finfo(low).eps if low is not None else 2.0**-10)
    return eps


# The p.grad tensors that step() wrote (weak keys) -> their version then. A p.grad that is still one
# of them, unmodified, is a privatized gradient left from the last step (zero_grad() not called yet),
# not autograd's: the completeness check has nothing to compare it with. A backward pass that
# accumulates into it in place bumps its version, and is then compared (and refused).
_RELEASED_GRADS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _parts(grad_sample: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    # Opacus stores a list when backward ran several times before the grads were consumed.
    return list(grad_sample) if isinstance(grad_sample, (list, tuple)) else [grad_sample]


class DPOptimizer(torch.optim.Optimizer):
    """Base class of the dp_hf optimizers (not used directly).

    Args:
        params: parameters or param groups, as in torch.
        defaults: the rule's per-group hyperparameters (``lr`` etc.).
        noise_multiplier: ``sigma`` (>= 0).
        max_grad_norm: clip norm ``C`` (> 0; ``float('inf')`` with ``sigma = 0``
            disables clipping, for checks against non-private optimizers).
        expected_batch_size: ``B = q * N``, the expected logical batch over all ranks.
        noise_seed / generator / secure_mode: see :class:`dp_hf.noise.NoiseSource`.
        distributed: sum clipped sums over ``torch.distributed`` ranks
            (``None``: when a process group of size > 1 is initialized).
        disable_dp: non-private baseline through the same update rule: ``step()``
            uses ``p.grad`` (the ordinary mean gradient) as ``gtilde``; no
            clipping, no noise. Requires ``noise_multiplier=0``.
    """

    def __init__(
        self,
        params: Iterable,
        defaults: dict[str, Any],
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
        noise_seed: int | None = None,
        generator: torch.Generator | None = None,
        secure_mode: bool = False,
        distributed: bool | None = None,
        disable_dp: bool = False,
    ) -> None:
        lr = defaults.get("lr")
        if lr is not None and (not isinstance(lr, (int, float)) or not lr >= 0):
            raise ValueError(f"Invalid learning rate lr={lr!r}: it must be a number >= 0.")
        noise_multiplier = check_noise_multiplier(noise_multiplier)
        max_grad_norm = check_max_grad_norm(max_grad_norm)
        if math.isinf(max_grad_norm) and noise_multiplier > 0:
            raise ValueError(
                f"max_grad_norm=inf with noise_multiplier={noise_multiplier!r} gives infinite noise; "
                "set a finite clip norm."
            )
        expected_batch_size = check_positive_finite(
            "expected_batch_size", expected_batch_size, "sample_rate * dataset_size"
        )
        if disable_dp and noise_multiplier != 0:
            raise ValueError(
                f"disable_dp=True trains without noise, but noise_multiplier={noise_multiplier!r} was given; "
                "pass noise_multiplier=0 for the non-private baseline."
            )
        super().__init__(params, defaults)
        self.disable_dp = bool(disable_dp)
        self.max_grad_norm = float(max_grad_norm)
        first = next((p for g in self.param_groups for p in g["params"]), None)
        device = first.device if first is not None else None
        self.noise_source = NoiseSource(
            seed=noise_seed, secure_mode=secure_mode, device=device, generator=generator
        )
        self.privatizer = Privatizer(noise_multiplier, expected_batch_size, self.noise_source, distributed)
        self.state["dp"] = {"step": 0}
        self._geometry_cache: Geometry | None = None
        # Optional callable returning False when one more step would exceed the privacy budget.
        self.budget_guard: Callable[[], bool] | None = None

    #: Whether :meth:`geometry` is always the identity (``c = 0``, ``s = 1``): the clipped sum then
    #: needs only per-example norms, so DPTrainer can use ghost clipping (:mod:`dp_hf.per_example.ghost`).
    #: Optimizers with an adaptive geometry (DP-MacAdam, scale-then-privatize) set it to False;
    #: :func:`dp_hf.per_example.has_identity_geometry` also refuses any class that overrides ``geometry``.
    identity_geometry: bool = True

    # ------------------------------------------------------------------ subclass API
    def geometry(self, params: list[torch.Tensor]) -> Geometry:
        """The clipping geometry for this step from the state at ``t-1``.

        Default: ``c = 0``, ``s = 1``, ``C = max_grad_norm``. Subclasses with an
        adaptive geometry override it; it must read only earlier privatized state.
        """
        return Geometry(max_grad_norm=self.max_grad_norm)

    def update(self) -> None:
        """Apply the rule to every parameter with a privatized ``p.grad``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers
    @property
    def dp_step(self) -> int:
        """Number of privatized steps taken (``t`` of the last step)."""
        return int(self.state["dp"]["step"])

    def trainable_params(self) -> list[torch.Tensor]:
        """Parameters that are privatized and updated, in a stable order."""
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    # sigma and B live in the privatizer, which adds the noise and divides: one copy, read from here.
    @property
    def noise_multiplier(self) -> float:
        """``sigma``: the noise std on the clipped sum is ``sigma * C``."""
        return self.privatizer.noise_multiplier

    @property
    def expected_batch_size(self) -> float:
        """``B = q * N``, the expected logical batch over all ranks (the privatizer divides by it)."""
        return self.privatizer.expected_batch_size

    def current_geometry(self, params: list[torch.Tensor] | None = None) -> Geometry:
        """The clipping geometry of the logical step in progress (the same for all its micro-batches).

        Computed from the state at ``t-1`` on first use in a step; per-example clipping done outside
        the optimizer (:mod:`dp_hf.per_example.ghost`) clips in it and hands the sum to :meth:`accumulate_clipped_sum`.
        """
        if self._geometry_cache is None:
            self._geometry_cache = self.geometry(self.trainable_params() if params is None else params)
        return self._geometry_cache

    def _pending_grad_samples(self, params: list[torch.Tensor]) -> bool:
        return any(getattr(p, "grad_sample", None) is not None for p in params)

    # ------------------------------------------------------------------ DP API
    @torch.no_grad()
    def clip_and_accumulate(self) -> torch.Tensor | None:
        """Clip the per-example gradients now in ``p.grad_sample`` and add them to the logical batch.

        Call once per physical micro-batch; ``step()`` calls it for the last one
        if it was not called. Consumes ``p.grad_sample`` and the non-private
        ``p.grad`` (which must never reach the update). Returns per-example norms.

        Raises ``RuntimeError`` (and drops ``p.grad`` and ``p.grad_sample``, so the
        unclipped gradient cannot be used by mistake; nothing is accumulated) when a
        gradient was not fully seen by the per-sample hooks: a tensor with a ``p.grad``
        but no ``p.grad_sample``, or per-example gradients that do not sum to ``p.grad``
        (see :meth:`_check_complete_grad_samples`).
        """
        params = self.trainable_params()
        if not self._pending_grad_samples(params):
            self._refuse_unhooked_gradients(params)
            return None
        grad_samples = []
        for index, p in enumerate(params):
            gs = getattr(p, "grad_sample", None)
            if gs is None and p.grad is not None:
                self._drop_gradients(params)
                raise RuntimeError(
                    f"trainable parameter {self._describe(index, p)} has a gradient but no per-example "
                    "gradient: its module has no per-sample hook, so it cannot be clipped. Freeze it "
                    "(requires_grad=False) or use a supported module."
                )
            grad_samples.append(gs)  # None: unused in this forward pass, zero gradient for every example
        try:
            self._check_complete_grad_samples(params, grad_samples)
        except RuntimeError:
            self._drop_gradients(params)
            raise
        geometry = self.current_geometry(params)
        norms = self.privatizer.accumulate(grad_samples, geometry, [p.shape for p in params])
        self._drop_gradients(params)
        return norms

    def _refuse_unhooked_gradients(self, params: list[torch.Tensor]) -> None:
        """Refuse a ``p.grad`` from a backward pass that no per-sample hook recorded.

        With nothing in ``p.grad_sample``, a non-zero ``p.grad`` other than the one the last
        ``step()`` left is an autograd gradient nobody can clip (backward ran with the hooks
        disabled or removed, or the model in eval mode): its examples would silently be dropped
        from the step (before any micro-batch was clipped, or after the last one). Zeros, as
        ``zero_grad(set_to_none=False)`` leaves, are fine. Only tensors that have a ``p.grad``
        are looked at: the usual path (``p.grad`` cleared by clipping) costs nothing.
        """
        candidates = [
            (index, p)
            for index, p in enumerate(params)
            if p.grad is not None and _RELEASED_GRADS.get(p.grad) != p.grad._version
        ]
        stray = [(index, p) for index, p in candidates if bool(p.grad.ne(0).any())]
        if stray:
            names = ", ".join(self._describe(index, p) for index, p in stray[:5])
            more = f" and {len(stray) - 5} more" if len(stray) > 5 else ""
            self._drop_gradients(params)
            raise RuntimeError(
                f"trainable parameter(s) {names}{more} have gradients but no per-example gradients: the "
                "backward pass ran without per-sample hooks (not attached, disabled or removed, or the model in "
                "eval mode), so nothing could be clipped. Attach them with "
                "dp_hf.per_example.attach_grad_sample(model) (or Opacus's GradSampleModule) and train in "
                "train() mode. p.grad was dropped."
            )

    def _drop_gradients(self, params: list[torch.Tensor]) -> None:
        for p in params:
            p.grad_sample = None
            p.grad = None

    def _describe(self, index: int, p: torch.Tensor) -> str:
        """``'name' (shape ...)`` for error messages, or ``#index (shape ...)`` when no name is known."""
        name = None
        for group in self.param_groups:  # torch optimizers built from named_parameters() keep the names
            names = group.get("param_names")
            if names is not None:
                name = next((n for n, q in zip(names, group["params"]) if q is p), name)
        if name is None:
            from dp_hf.per_example.opacus_hooks import (
                hooked_parameter_name,  # imports Opacus: only when raising
            )

            name = hooked_parameter_name(p)
        where = repr(name) if name is not None else f"#{index}"
        return f"{where} (shape {tuple(p.shape)})"

    def _check_complete_grad_samples(
        self, params: list[torch.Tensor], grad_samples: list[torch.Tensor | list[torch.Tensor] | None]
    ) -> None:
        """Refuse per-example gradients that do not sum to ``p.grad``: some use of ``p`` was not hooked.

        Per-sample hooks (Opacus's, as attached by :func:`dp_hf.per_example.attach_grad_sample`)
        only see how a parameter is used inside its own module's ``forward``. A parent that calls
        ``F.linear(x, self.child.weight)``, or a weight shared with a functional call, also sends
        gradient to ``p`` that no hook records: ``p.grad_sample`` then misses that part and
        clipping it would privatize a wrong gradient (the fast paths of :mod:`dp_hf.per_example.ghost` refuse
        the same thing). ``p.grad`` is the ordinary gradient that autograd computes anyway, with
        every use, so ``sum_i grad_sample[i] == p.grad`` is an exact test of completeness at the
        cost of one reduction over the per-example gradients. (Counting gradient contributions
        with tensor hooks during backward would miss the case of one autograd node mixing hooked
        and unhooked uses, and depends on the order in which autograd fires hooks.)

        * Several backward passes before clipping: Opacus keeps a list, ``p.grad`` accumulates;
          the list's parts are summed.
        * Opacus's ``loss_reduction="mean"`` scales each backward's rows by its batch size ``b``,
          so they sum to ``b`` times its share of ``p.grad``. The reduction is not recorded on the
          parameters; the check accepts the micro-batch when every tensor agrees under "sum", or
          every tensor agrees under "mean" (a missed use cannot mimic that for all tensors at once).
        * Tied weights hooked in each of their modules (GPT-2's ``lm_head``/``wte``, BERT's MLM
          decoder/word embeddings) get per-example gradients from both modules: complete, accepted.
        * No ``p.grad`` (per-example gradients set by hand), or a ``p.grad`` that is still the
          one the last ``step()`` left, untouched since (no backward reached it): nothing to compare.
        * bf16/fp16 tensors, TF32 matmuls: the tolerance follows the precision (see
          ``_SUM_CHECK_MIN_TOL``).
        """
        to_check = [
            (index, p, _parts(gs))
            for index, (p, gs) in enumerate(zip(params, grad_samples))
            if gs is not None and p.grad is not None and _RELEASED_GRADS.get(p.grad) != p.grad._version
        ]
        if not to_check:
            return
        device = to_check[0][2][0].device
        rows = []  # per checked tensor: |sum - grad|, |mean - grad|, |grad| + |sum|, |grad| + |mean|, |grad|
        tolerances = []
        for _, p, parts in to_check:
            accum = torch.promote_types(parts[0].dtype, torch.float32)
            sums = [part.sum(dim=0, dtype=accum) for part in parts]
            total, mean_total = sums[0], sums[0] / max(parts[0].shape[0], 1)
            for part_sum, part in zip(sums[1:], parts[1:]):
                total = total + part_sum
                mean_total = mean_total + part_sum / max(part.shape[0], 1)
            grad = p.grad.to(accum)
            grad_norm = torch.linalg.vector_norm(grad)
            row = [
                torch.linalg.vector_norm(total - grad),
                torch.linalg.vector_norm(mean_total - grad),
                grad_norm + torch.linalg.vector_norm(total),
                grad_norm + torch.linalg.vector_norm(mean_total),
                grad_norm,
            ]
            rows.append(torch.stack(row).to(device=device, dtype=torch.float32))
            eps = max(
                _compute_eps(parts[0].dtype, parts[0].device), _compute_eps(p.grad.dtype, p.grad.device)
            )
            tolerances.append(max(_SUM_CHECK_MIN_TOL, _SUM_CHECK_EPS_FACTOR * eps))
        # Absolute floor: the Frobenius norm of every per-example gradient of the micro-batch.
        floor_sq = torch.zeros(
            (), dtype=torch.float64, device=device
        )  # float64: finite outliers must not overflow
        for gs in grad_samples:
            for part in _parts(gs) if gs is not None else []:
                accum = torch.promote_types(part.dtype, torch.float32)
                floor_sq += torch.linalg.vector_norm(part, dtype=accum).square().to(floor_sq)
        stats = torch.stack(rows)
        tolerance = torch.tensor(tolerances, dtype=torch.float32, device=device)
        floor = floor_sq.sqrt().float()
        bad_sum = stats[:, 0] > tolerance * (stats[:, 2] + floor)
        bad_mean = stats[:, 1] > tolerance * (stats[:, 3] + floor)
        # One device synchronisation per micro-batch. (Non-finite gradients compare as agreeing:
        # they are not a missed use, and this check is not the place to refuse them.)
        bad_sum_list, complete_as_mean = bad_sum.tolist(), not bool(bad_mean.any())
        if not any(bad_sum_list) or complete_as_mean:
            return
        offenders = [(k, to_check[k][0]) for k, bad in enumerate(bad_sum_list) if bad]
        details = []
        for k, index in offenders[:5]:
            relative = float(stats[k, 0] / stats[k, 4].clamp_min(torch.finfo(torch.float32).tiny))
            details.append(f"{self._describe(index, params[index])}: off by {relative:.1%} of |p.grad|")
        more = f" and {len(offenders) - 5} more" if len(offenders) > 5 else ""
        raise RuntimeError(
            f"per-example gradients do not sum to p.grad for trainable parameter(s) {'; '.join(details)}{more}. "
            "Part of their gradient was computed outside the per-sample hooks, so it cannot be clipped per "
            "example. The usual cause is a module's weight used outside that module's own forward (e.g. a "
            "parent calling F.linear(x, self.child.weight), or a weight shared with a functional call): use "
            "the weight only by calling its module, or freeze it (requires_grad=False). Also check that p.grad "
            "was zeroed after the last step() (optimizer.zero_grad()) and that the backward pass did not go "
            "through a DistributedDataParallel wrapper (it averages p.grad over ranks). Nothing was "
            "accumulated; p.grad and p.grad_sample were dropped."
        )

    @torch.no_grad()
    def accumulate_clipped_sum(self, clipped_sums: list[torch.Tensor], num_examples: int) -> None:
        """Add an already clipped per-tensor sum (aligned with :meth:`trainable_params`)."""
        self.privatizer.accumulate_clipped_sum(clipped_sums, num_examples)
        for p in self.trainable_params():
            p.grad = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Privatize the logical batch accumulated so far and apply the update rule."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.budget_guard is not None and not self.budget_guard():
            self.privatizer.reset()
            raise PrivacyBudgetExceededError(
                f"step {self.dp_step + 1} would exceed the privacy budget; no update was made. "
                "Stop training (DPTrainer stops before this point) or allow a larger target_epsilon."
            )
        params = self.trainable_params()
        if self.disable_dp:
            self._privatized = {
                p: (p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
                for p in params
            }
            self.state["dp"]["step"] = self.dp_step + 1
            try:
                self.update()
            finally:
                self._privatized = {}
            return loss
        if self._pending_grad_samples(params):
            self.clip_and_accumulate()
        else:
            self._refuse_unhooked_gradients(params)
        geometry = self.current_geometry(params)
        privatized = self.privatizer.release(params, geometry)
        for p, g in zip(params, privatized):
            p.grad = g if p.dtype == torch.float32 else g.to(p.dtype)
        self.state["dp"]["step"] = self.dp_step + 1
        self._privatized = dict(zip(params, privatized))  # float32 copies for rules that want them
        try:
            self.update()
        finally:
            self._privatized = {}
            self._geometry_cache = None
        for p in params:
            if p.grad is not None:
                _RELEASED_GRADS[p.grad] = p.grad._version
        return loss

    def privatized_grad(self, p: torch.Tensor) -> torch.Tensor:
        """``gtilde`` of ``p`` in float32 during :meth:`update` (``p.grad`` holds it in ``p``'s dtype)."""
        return self._privatized[p]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for p in self.trainable_params():
            p.grad_sample = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        self.state["dp"]["noise"] = self.noise_source.state_dict()
        self.state["dp"]["noise_multiplier"] = self.noise_multiplier
        self.state["dp"]["max_grad_norm"] = self.max_grad_norm
        self.state["dp"]["expected_batch_size"] = self.expected_batch_size
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._restore_state_dtypes(state_dict)
        dp_state = self.state.get("dp")
        if not isinstance(dp_state, dict) or "step" not in dp_state:
            raise ValueError(
                "this state_dict has no 'dp' entry (step count and noise generator): it was not saved by a "
                "dp_hf optimizer, so resuming from it would lose DP state."
            )
        if "noise" in dp_state:
            self.noise_source.load_state_dict(dp_state["noise"])
        self._geometry_cache = None
        self.privatizer.reset()

    def _restore_state_dtypes(self, state_dict: dict[str, Any]) -> None:
        # torch.optim.Optimizer.load_state_dict casts every per-parameter state tensor
        # (but "step") to the parameter's dtype. That would round the float32 moments of
        # bf16 parameters to bf16 (a resumed run would then differ from an uninterrupted
        # one) and turn integer state (packed 4-bit codes, int16 indices) into floats.
        # Put back the saved tensors with their saved dtype, on the parameter's device.
        saved_state = state_dict.get("state", {})
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(saved_ids, params):
            for key, value in saved_state.get(saved_id, {}).items():
                if isinstance(value, torch.Tensor) and key != "step":
                    self.state[p][key] = value.to(device=p.device)

    def __repr__(self) -> str:
        head = super().__repr__()
        return (
            f"{head}\n(noise_multiplier={self.noise_multiplier}, max_grad_norm={self.max_grad_norm}, "
            f"expected_batch_size={self.expected_batch_size}, step={self.dp_step})"
        )
