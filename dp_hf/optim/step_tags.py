"""Which Poisson step a DP optimizer's micro-batches were drawn for, in your own training loop.

:class:`DPTrainer` checks the :class:`~dp_hf.sampling.StepTag` of every micro-batch itself. In a loop
of your own, :class:`dp_hf.loader.PoissonDataLoader` hands each micro-batch's tag to the optimizer it
trains (:meth:`StepFollower.announce`) as it yields the batch, and the optimizer then

* releases (noise once, update) only after the **last** micro-batch of a Poisson step: a ``step()``
  after an earlier one clips and accumulates and returns without an update, as Opacus's
  ``BatchMemoryManager`` makes its optimizer skip (so a ``step()`` per micro-batch is right);
* refuses a micro-batch of the next Poisson step while the current one is unreleased: two draws
  accumulated into one release (an example drawn into both counts twice, at about twice the accounted
  ``q``), or a step abandoned with ``model.zero_grad()`` whose sums would go out with the next one
  (``optimizer.abandon_step()`` drops them);
* refuses micro-batches out of order, and a Poisson step that is not after the last one released,
  also across a checkpoint (the last released step is saved in the optimizer's ``state_dict``: a sampler
  restored from an older checkpoint than the optimizer would replay batches);
* counts each release in the bound accountant, at the optimizer's ``sigma`` and the sampler's ``q``, before
  the noise is drawn, refusing an accountant that counted fewer steps than the optimizer took;
* after ``abandon_step()`` (or a state loaded mid-step) skips the rest of the abandoned step's micro-batches.
"""

from __future__ import annotations

from typing import Any

from dp_hf.sampling import StepTag

#: Key of ``optimizer.state["dp"]``: the last Poisson step (the sampler's global index) released.
RELEASED_STEP_KEY = "released_poisson_step"


class StepFollower:
    """Follows the Poisson steps of one optimizer's micro-batches (see the module docstring).

    Args:
        sample_rate: ``q`` of the sampler, for the accountant.
        accountant: a :class:`dp_hf.accounting.PrivacyAccountant` (or anything with
            ``step(noise_multiplier=..., sample_rate=...)``, such as Opacus's accountants) counting each
            release; ``None``: count yourself.
    """

    def __init__(self, sample_rate: float, accountant: Any = None) -> None:
        self.sample_rate = sample_rate
        self.accountant = accountant
        self.current: StepTag | None = None  # the micro-batch being trained (None: between steps)
        self.abandoned_step: int | None = None  # its remaining micro-batches are skipped, not trained

    def announce(self, optimizer: Any, tag: StepTag) -> bool:
        """Micro-batch ``tag`` is about to be handed to the loop: False to skip it (the rest of an abandoned
        step), True to hand it out if it continues the current step in order, or begins a later step than
        the last one released while nothing is unreleased; refused otherwise."""
        if tag.micro_batch > 0 and tag.step == self.abandoned_step:
            return False
        current, released = self.current, last_released_step(optimizer)
        if tag.micro_batch > 0:
            if current is None or (current.step, current.micro_batch + 1) != (tag.step, tag.micro_batch):
                had = "no micro-batch" if current is None else _describe(current)
                raise RuntimeError(
                    f"{_describe(tag)} came after {had}: the micro-batches of a Poisson step must be trained in "
                    "order, each once. Iterate one PoissonDataLoader, once per epoch, after sampler.set_epoch(epoch)."
                )
            self.current = tag
            return True
        if current is not None or optimizer.privatizer.num_microbatches:
            held = (
                "holds clipped gradients of it"
                if optimizer.privatizer.num_microbatches
                else "never released it"
            )
            raise RuntimeError(
                f"{_describe(tag)} begins while Poisson step {_step_of(current)} is unreleased (the optimizer "
                f"{held}): releasing two draws together counts an example drawn into both twice, at about twice "
                "the accounted sampling rate. Call optimizer.step() after each micro-batch (the last one of a step "
                "releases it), or optimizer.abandon_step() to drop an unfinished step (model.zero_grad() leaves "
                "its clipped sums in the optimizer; a loop that leaves its epoch early leaves the step unfinished)."
            )
        if tag.step <= released:
            raise RuntimeError(
                f"{_describe(tag)} is not after Poisson step {released}, which this optimizer already released "
                "(also before a checkpoint it was loaded from): a batch trained twice would be counted as two "
                "independent steps. Restore the sampler from the same checkpoint as the optimizer; a new sampler "
                f"(another seed or sample rate, for a new phase) starts with sampler.start_at({released + 1})."
            )
        self.current, self.abandoned_step = tag, None
        return True

    def due(self, optimizer: Any) -> bool:
        """Whether ``step()`` releases now: the current micro-batch is the last of its Poisson step."""
        if self.current is None:
            raise RuntimeError(
                "step() with no micro-batch from the PoissonDataLoader this optimizer follows: its last Poisson "
                "step was already released or abandoned (call step() once after each micro-batch), or the loop "
                "trains batches that the loader did not draw."
            )
        if self.current.step <= last_released_step(optimizer):  # (a state loaded mid-step, for one)
            raise RuntimeError(
                f"Poisson step {self.current.step} is not after Poisson step {last_released_step(optimizer)}, "
                "which this optimizer already released: it would be counted twice."
            )
        return self.current.micro_batch == self.current.num_micro_batches - 1

    def release(self, optimizer: Any) -> None:
        """The current Poisson step is released now: count it (first: if that fails, nothing goes out) and
        record it (saved with the optimizer)."""
        if self.accountant is not None:
            counted = steps_counted_behind(self.accountant, optimizer)
            if counted is not None:
                raise RuntimeError(
                    f"the accountant bound to this optimizer counted {counted} steps, but the optimizer took "
                    f"{optimizer.dp_step}: its epsilon would leave steps out. Restore the accountant from the "
                    "same checkpoint as the optimizer (accountant.load_state_dict)."
                )
            self.accountant.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=self.sample_rate)
        optimizer.state["dp"][RELEASED_STEP_KEY] = self.current.step
        self.current = None

    def abandoned(self) -> None:
        """The step in progress was dropped (``abandon_step()``, a state loaded): its remaining micro-batches
        are skipped, and a later step may begin."""
        if self.current is not None:
            self.abandoned_step = self.current.step
        self.current = None


def steps_counted_behind(accountant: Any, optimizer: Any) -> int | None:
    """The steps ``accountant`` counted if fewer than ``optimizer`` took (its epsilon would leave steps out), else
    None (also for an accountant that does not say how many it counted, as Opacus's)."""
    counted = getattr(accountant, "steps", None)
    return counted if isinstance(counted, int) and counted < optimizer.dp_step else None


def last_released_step(optimizer: Any) -> int:
    """The last Poisson step ``optimizer`` released while following a loader. A state without it (an optimizer
    that never followed one) took ``dp_step`` steps: at least ``dp_step - 1``, as a sampler's steps count from 0."""
    dp_state = optimizer.state["dp"]
    return int(dp_state.get(RELEASED_STEP_KEY, dp_state["step"] - 1))


def _describe(tag: StepTag) -> str:
    return f"micro-batch {tag.micro_batch} of {tag.num_micro_batches} of Poisson step {tag.step}"


def _step_of(tag: StepTag | None) -> str:
    return "(unknown)" if tag is None else str(tag.step)
