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

import copy
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from dp_hf.noise import NoiseSource
from dp_hf.optim.completeness import (
    check_complete_grad_samples,
    describe_parameter,
    drop_gradients,
    mark_released,
    refuse_unhooked_gradients,
)
from dp_hf.optim.step_tags import StepFollower
from dp_hf.privatizer import Geometry, Privatizer
from dp_hf.validation import check_max_grad_norm, check_noise_multiplier, check_positive_finite


class PrivacyBudgetExceededError(RuntimeError):
    """Raised when a step would spend more privacy than the budget allows."""


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
        noise_multiplier, max_grad_norm, expected_batch_size = _checked_dp_arguments(
            noise_multiplier, max_grad_norm, expected_batch_size, disable_dp
        )
        super().__init__(params, defaults)  # add_param_group checks each group's lr
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
        # Set by dp_hf.loader.PoissonDataLoader: the Poisson step of each micro-batch (your own loop).
        self.step_follower: StepFollower | None = None

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

    @property
    def noise_multiplier(self) -> float:  # sigma and B live in the privatizer (noises, divides): read here
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
        (see :func:`dp_hf.optim.completeness.check_complete_grad_samples`).
        """
        params = self.trainable_params()
        if not self._pending_grad_samples(params):
            refuse_unhooked_gradients(self, params)
            return None
        grad_samples = []
        for index, p in enumerate(params):
            gs = getattr(p, "grad_sample", None)
            if gs is None and p.grad is not None:
                drop_gradients(params)
                raise RuntimeError(
                    f"trainable parameter {describe_parameter(self, index, p)} has a gradient but no per-example "
                    "gradient: its module has no per-sample hook, so it cannot be clipped. Freeze it "
                    "(requires_grad=False) or use a supported module."
                )
            grad_samples.append(gs)  # None: unused in this forward pass, zero gradient for every example
        try:
            check_complete_grad_samples(self, params, grad_samples)
        except RuntimeError:
            drop_gradients(params)
            raise
        geometry = self.current_geometry(params)
        norms = self.privatizer.accumulate(grad_samples, geometry, [p.shape for p in params])
        drop_gradients(params)
        return norms

    @torch.no_grad()
    def accumulate_clipped_sum(self, clipped_sums: list, num_examples: int, owned: bool = False) -> None:
        """Add a clipped per-tensor sum (aligned with :meth:`trainable_params`; ``owned``: handed over)."""
        self.privatizer.accumulate_clipped_sum(clipped_sums, num_examples, owned=owned)
        for p in self.trainable_params():
            p.grad = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Privatize the logical batch accumulated so far and apply the update rule (following a
        :class:`~dp_hf.loader.PoissonDataLoader`: only after the last micro-batch of a Poisson step)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.budget_guard is not None and not self.budget_guard():
            self.abandon_step()
            raise PrivacyBudgetExceededError(
                f"step {self.dp_step + 1} would exceed the privacy budget; no update was made. "
                "Stop training (DPTrainer stops before this point) or allow a larger target_epsilon."
            )
        if self.disable_dp:  # the rule on p.grad (the ordinary mean gradient): no clipping, no noise
            self._privatized = _mean_gradients(self.trainable_params())
            self.state["dp"]["step"] = self.dp_step + 1
            try:
                self.update()
            finally:
                self._privatized = {}
            return loss
        params = self.trainable_params()
        follower = self.step_follower  # (due() refuses a step() with no micro-batch)
        due = follower is None or follower.due(self)
        if self._pending_grad_samples(params):
            self.clip_and_accumulate()
        else:
            refuse_unhooked_gradients(self, params)
        if not due:
            return loss
        if follower is not None:
            follower.release(self)  # counted before the noise: a failed count releases nothing
        geometry = self.current_geometry(params)
        privatized = self.privatizer.release(params, geometry, step=self.dp_step)
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
                mark_released(p.grad)
        self.noise_source.draw_ahead()  # overlaps the next forward/backward, not this update
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # Why: torch checks only the default lr; and a group's own DP value would be silently ignored.
        _check_param_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    def privatized_grad(self, p: torch.Tensor) -> torch.Tensor:
        """``gtilde`` of ``p`` in float32 during :meth:`update` (``p.grad`` holds it in ``p``'s dtype)."""
        return self._privatized[p]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """:meth:`abandon_step` (with a warning if it discards clipped sums), as Opacus drops ``summed_grad``: they
        never go out with a later step's batch. Following a loader, only the gradients (Opacus after a skipped step)."""
        if self.step_follower is not None:
            _drop_gradients(self, set_to_none)
        elif self.abandon_step(set_to_none=set_to_none):  # (dropped first: a filter may make this an error)
            warnings.warn(
                "zero_grad() discarded the clipped gradients accumulated since the last step(): they will not "
                "be released. Call zero_grad() after step(), not between the micro-batches of one logical batch.",
                UserWarning,
                stacklevel=2,
            )

    def abandon_step(self, set_to_none: bool = True) -> int:
        """Drop the logical step in progress: ``p.grad``, ``p.grad_sample`` and the clipped sums accumulated
        since the last :meth:`step` (never released). Returns how many micro-batches were discarded. After an
        error inside forward or backward, also drop the engine's records (``handle.clear()``/``clipping.clear()``)."""
        _drop_gradients(self, set_to_none)
        discarded = self.privatizer.num_microbatches
        self.privatizer.reset()
        self._geometry_cache = None
        if self.step_follower is not None:
            self.step_follower.abandoned()
        return discarded

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        dp_state = self.state["dp"]
        dp_state["noise"], dp_state["optimizer"] = self.noise_source.state_dict(), type(self).__name__
        for key in ("noise_multiplier", "max_grad_norm", "expected_batch_size"):
            dp_state[key] = getattr(self, key)
        return _snapshot_dp_entry(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _check_saved_by(state_dict, type(self).__name__)
        _warn_noise_rollback(self, state_dict)
        super().load_state_dict(state_dict)
        _restore_state_dtypes(self, state_dict)
        _restore_dp_entry(self)
        self.abandon_step()  # (the sums of a step in progress: not the loaded state's)

    def __repr__(self) -> str:
        head = super().__repr__()
        return (
            f"{head}\n(noise_multiplier={self.noise_multiplier}, max_grad_norm={self.max_grad_norm}, "
            f"expected_batch_size={self.expected_batch_size}, step={self.dp_step})"
        )


def _drop_gradients(optimizer: DPOptimizer, set_to_none: bool) -> None:
    """torch's ``zero_grad`` and the transient ``p.grad_sample`` (the clipped sums are the caller's to keep)."""
    torch.optim.Optimizer.zero_grad(optimizer, set_to_none=set_to_none)
    for p in optimizer.trainable_params():
        p.grad_sample = None


def _mean_gradients(params: list[torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
    """``disable_dp``'s ``gtilde``: each ``p.grad`` in float32 (zeros where there is none)."""
    return {
        p: (p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
        for p in params
    }


def _checked_dp_arguments(
    noise_multiplier: float, max_grad_norm: float, expected_batch_size: float, disable_dp: bool
) -> tuple[float, float, float]:
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
    return noise_multiplier, max_grad_norm, expected_batch_size


#: Optimizer-wide: the per-example norm is one flat norm over every parameter, noised once.
_OPTIMIZER_WIDE = ("max_grad_norm", "noise_multiplier", "expected_batch_size", "noise_seed", "secure_mode")


def _check_param_group(param_group: dict[str, Any]) -> None:
    lr = param_group.get("lr")
    if lr is not None and (not isinstance(lr, (int, float)) or not 0 <= lr < math.inf):
        raise ValueError(f"Invalid learning rate lr={lr!r}: it must be a finite number >= 0.")
    wide = [key for key in _OPTIMIZER_WIDE if key in param_group]
    if wide:
        raise ValueError(
            f"a param group sets {', '.join(wide)}: a DP optimizer clips each example's gradient over all its "
            "parameters together (one flat norm) and adds the noise once, so these are arguments of the "
            "optimizer, not of a group. Pass them to the optimizer (a group would silently not use them)."
        )


def _snapshot_dp_entry(saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` with a copy of its DP entry: torch hands out the live dict, so a state_dict held in memory kept
    counting steps while its generator state stayed put (loading it paired a later step with old noise)."""
    saved["state"]["dp"] = copy.deepcopy(saved["state"]["dp"])
    return saved


def _restore_dp_entry(optimizer: DPOptimizer) -> None:
    """After torch's load: the DP entry (step count, noise generator) as the optimizer's own copy."""
    dp_state = optimizer.state.get("dp")
    if not isinstance(dp_state, dict) or "step" not in dp_state:
        raise ValueError(
            "this state_dict has no 'dp' entry (step count and noise generator): it was not saved by a "
            "dp_hf optimizer, so resuming from it would lose DP state."
        )
    # A copy: torch keeps the caller's dict, and two optimizers loaded from one state shared it.
    optimizer.state["dp"] = dp_state = copy.deepcopy(dp_state)
    if "noise" in dp_state:
        optimizer.noise_source.load_state_dict(dp_state["noise"])
    _warn_changed_dp_values(optimizer, dp_state)


def _warn_noise_rollback(optimizer: DPOptimizer, state_dict: dict[str, Any]) -> None:
    """Loading an earlier state into an optimizer that already took DP steps rewinds its noise generator."""
    saved = state_dict.get("state", {}).get("dp")
    taken = optimizer.dp_step
    if not isinstance(saved, dict) or "step" not in saved or taken == 0 or int(saved["step"]) >= taken:
        return
    if optimizer.noise_source.generator is None:  # secure_mode: fresh noise, but the steps are taken again
        warnings.warn(
            f"loading a state saved at DP step {int(saved['step'])} into an optimizer that took {taken}: steps "
            f"{int(saved['step']) + 1}-{taken} will be released again (with fresh noise, secure_mode). Their first "
            "releases are a second release of those steps that an accountant rolled back with the optimizer does "
            "not count: keep them private, or keep counting them.",
            UserWarning,
            stacklevel=3,
        )
        return
    warnings.warn(
        f"loading a state saved at DP step {int(saved['step'])} into an optimizer that took {taken}: its noise "
        f"generator is rewound, so steps {int(saved['step']) + 1}-{taken} draw the same noise again. Released "
        "again with other batches or from other weights, two releases of a step differ by their clipped sums "
        "without noise (an audit recovered them to 1e-7). Replay those steps exactly (same weights, same "
        "batches), or call optimizer.noise_source.reseed() after loading (loading sets the saved generator "
        "state, also in a fresh optimizer with another noise_seed).",
        UserWarning,
        stacklevel=3,
    )


def _warn_changed_dp_values(optimizer: DPOptimizer, saved: dict[str, Any]) -> None:
    """A resume may change sigma, C or B on purpose (the accountant counts each phase): say so, not silently."""
    changed = [
        f"{key}={saved[key]!r} (now {getattr(optimizer, key)!r})"
        for key in ("noise_multiplier", "max_grad_norm", "expected_batch_size")
        if key in saved and saved[key] != getattr(optimizer, key)
    ]
    if changed:
        warnings.warn(
            f"this optimizer state was saved with {', '.join(changed)}; the steps ahead use the new values, not the "
            "saved ones, and the accountant counts them at the new values. Steps of the saved run that are taken "
            "again draw the same noise: call optimizer.noise_source.reseed() (DPTrainer does).",
            UserWarning,
            stacklevel=4,
        )


def _check_saved_by(state_dict: dict[str, Any], name: str) -> None:
    """Refuse the state of another update rule: its moments and its param_groups' hyperparameters would
    fail later with a bare KeyError, or worse, run as state that means something else."""
    saved = state_dict.get("state", {}) if isinstance(state_dict, dict) else {}
    dp_state = saved.get("dp") if isinstance(saved, dict) else None  # torch keeps non-tensor keys as they are
    saved_by = dp_state.get("optimizer", name) if isinstance(dp_state, dict) else name
    if saved_by != name:
        raise ValueError(
            f"this state_dict was saved by {saved_by}, not {name}: its state and hyperparameters belong to "
            "another update rule. Resume with the optimizer that saved it (DPTrainingArguments.dp_optimizer), "
            "or start a new run."
        )


def _restore_state_dtypes(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    # torch.optim.Optimizer.load_state_dict casts every per-parameter state tensor
    # (but "step") to the parameter's dtype. That would round the float32 moments of
    # bf16 parameters to bf16 (a resumed run would then differ from an uninterrupted
    # one) and turn integer state (packed 4-bit codes, int16 indices) into floats.
    # Put back the saved tensors with their saved dtype, on the parameter's device.
    saved_state = state_dict.get("state", {})
    saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for saved_id, p in zip(saved_ids, params):
        for key, value in saved_state.get(saved_id, {}).items():
            if isinstance(value, torch.Tensor) and key != "step":
                optimizer.state[p][key] = value.to(device=p.device)
