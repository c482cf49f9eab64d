"""Your own loop with `PoissonDataLoader`: the optimizer knows the Poisson step of every micro-batch.

Unbound, three loop mistakes released examples twice unrefused (an own-loop audit, session 27):
accumulating two loader items (two Poisson draws) into one ``step()``, a ``step()`` per micro-batch of a
step drawn in several, and abandoning a step with ``model.zero_grad()``. Bound, the first and third are
refused and the second is right (the release waits for the step's last micro-batch), on both engines.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from dp_hf.accounting import PrivacyAccountant
from dp_hf.loader import PoissonDataLoader
from dp_hf.optim import create_dp_optimizer
from dp_hf.optim.step_tags import last_released_step
from dp_hf.per_example import attach_fast_clipping, attach_grad_sample
from dp_hf.sampling import PoissonBatchSampler, StepTag

N, SAMPLE_RATE, STEPS_PER_EPOCH = 40, 0.25, 4
ENGINES = ["opacus", "fast"]


def make_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(N, 4, generator=generator), torch.randint(0, 2, (N,), generator=generator)
    )


class Run:
    """A model on one engine, its DP optimizer, accountant and Poisson loader (noise and sampling seeded)."""

    def __init__(
        self, engine: str, num_micro_batches: int = 1, noise_multiplier: float = 1.0, **loader_kwargs
    ):
        # (noise_multiplier 1.0: the accountants' histories below name it)
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).train()
        self.clipping = attach_fast_clipping(self.model) if engine == "fast" else None
        if engine == "opacus":
            attach_grad_sample(self.model)
        self.optimizer = create_dp_optimizer(
            "dp-sgd",
            self.model.parameters(),
            lr=0.5,
            noise_multiplier=noise_multiplier,
            max_grad_norm=0.1,  # below every example's gradient norm: each clipped to exactly C
            expected_batch_size=SAMPLE_RATE * N,
            noise_seed=3,
        )
        self.accountant = PrivacyAccountant("rdp")
        self.sampler = PoissonBatchSampler(
            N, SAMPLE_RATE, steps_per_epoch=STEPS_PER_EPOCH, num_micro_batches=num_micro_batches, seed=5
        )
        self.loader = PoissonDataLoader(
            make_data(), self.sampler, self.optimizer, accountant=self.accountant, **loader_kwargs
        )

    def backward(self, batch) -> None:
        if batch:  # an empty micro-batch is {}: nothing to differentiate, the step still comes
            x, y = batch
            F.cross_entropy(self.model(x), y, reduction="none").sum().backward()
            if self.clipping is not None:
                self.clipping.accumulate(self.optimizer)

    def train(
        self, epochs: int = 2, step_every: int = 1, first_epoch: int = 0, set_to_none: bool = True
    ) -> None:
        """``step()`` after every ``step_every``-th loader item."""
        for epoch in range(first_epoch, first_epoch + epochs):
            self.sampler.set_epoch(epoch)
            for item, batch in enumerate(self.loader, start=1):
                self.backward(batch)
                if item % step_every == 0:
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=set_to_none)

    def parameters(self) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in self.model.parameters()])


@pytest.mark.parametrize("engine", ENGINES)
def test_a_step_per_micro_batch_releases_once_per_poisson_step(engine):
    whole = Run(engine)
    whole.train()
    for num_micro_batches in (2, 3):
        split = Run(engine, num_micro_batches=num_micro_batches)
        split.train()  # step() after every micro-batch, as with Opacus's BatchMemoryManager
        assert split.optimizer.dp_step == whole.optimizer.dp_step == 2 * STEPS_PER_EPOCH
        assert (
            split.accountant.steps == whole.accountant.steps == 2 * STEPS_PER_EPOCH
        )  # counted once per release
        torch.testing.assert_close(split.parameters(), whole.parameters(), rtol=0, atol=1e-6)
        assert last_released_step(split.optimizer) == 2 * STEPS_PER_EPOCH - 1


@pytest.mark.parametrize("engine", ENGINES)
def test_two_poisson_draws_in_one_release_are_refused(engine):
    run = Run(engine)
    with pytest.raises(RuntimeError, match="begins while Poisson step 0 is unreleased"):
        run.train(step_every=2)  # the old hole: an example drawn into both draws counted twice
    assert run.optimizer.dp_step == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_step_abandoned_with_model_zero_grad_is_refused_and_abandon_step_drops_it(engine):
    run = Run(engine, num_micro_batches=2)
    batches = iter(run.loader)
    run.backward(next(batches))
    run.optimizer.step()  # micro-batch 0 of 2: clipped and accumulated, not released
    assert run.optimizer.privatizer.num_microbatches == 1 and run.optimizer.dp_step == 0
    run.model.zero_grad()  # leaves the clipped sums in the optimizer
    del batches
    run.sampler.set_epoch(1)  # the loop moves on to the next epoch
    with pytest.raises(RuntimeError, match="holds clipped gradients"):
        next(iter(run.loader))

    dropped = Run(engine, num_micro_batches=2)
    batches = iter(dropped.loader)
    dropped.backward(next(batches))
    dropped.optimizer.step()
    assert dropped.optimizer.abandon_step() == 1
    del batches
    dropped.train(epochs=1, first_epoch=1)
    assert dropped.optimizer.dp_step == dropped.accountant.steps  # nothing of the abandoned step released


def test_zero_grad_between_micro_batches_keeps_the_clipped_sums_when_following_a_loader():
    run = Run("opacus", num_micro_batches=2)
    batches = iter(run.loader)
    run.backward(next(batches))
    run.optimizer.step()
    run.optimizer.zero_grad()  # Opacus keeps summed_grad after a skipped step: so do we, bound
    assert run.optimizer.privatizer.num_microbatches == 1


def test_a_sampler_restored_from_an_older_checkpoint_than_the_optimizer_is_refused():
    run = Run("opacus")
    old_sampler = None
    run.sampler.set_epoch(0)
    for item, batch in enumerate(run.loader, start=1):
        run.backward(batch)
        run.optimizer.step()
        run.optimizer.zero_grad()
        if item == 1:
            old_sampler = run.sampler.state_dict()
        if item == 3:
            break
    saved = run.optimizer.state_dict()
    assert saved["state"]["dp"]["released_poisson_step"] == 2

    resumed = Run("opacus")
    resumed.optimizer.load_state_dict(saved)
    resumed.accountant.load_state_dict(run.accountant.state_dict())
    resumed.sampler.load_state_dict(old_sampler)  # would replay steps 1 and 2
    resumed.loader = PoissonDataLoader(
        make_data(), resumed.sampler, resumed.optimizer, accountant=resumed.accountant
    )
    with pytest.raises(RuntimeError, match="is not after Poisson step 2"):
        next(iter(resumed.loader))


def test_a_step_with_no_micro_batch_from_the_loader_is_refused():
    run = Run("opacus")
    run.sampler.set_epoch(0)
    run.backward(next(iter(run.loader)))
    run.optimizer.step()
    with pytest.raises(RuntimeError, match="step\\(\\) with no micro-batch"):
        run.optimizer.step()  # a second release for one Poisson step (noise only, never counted)
    assert run.optimizer.dp_step == run.accountant.steps == 1


def test_micro_batches_out_of_order_are_refused():
    run = Run("opacus", num_micro_batches=3)
    follower = run.optimizer.step_follower
    follower.announce(run.optimizer, StepTag(0, 0, 2, 3))
    with pytest.raises(
        RuntimeError, match="micro-batch 2 of 3 of Poisson step 0 came after micro-batch 0 of 3"
    ):
        follower.announce(run.optimizer, StepTag(0, 2, 2, 3))
    with pytest.raises(RuntimeError, match="came after"):
        follower.announce(run.optimizer, StepTag(1, 1, 2, 3))


def test_loader_workers_give_the_same_run():
    inline = Run("opacus", num_micro_batches=2)
    inline.train(epochs=1)
    workers = Run("opacus", num_micro_batches=2, num_workers=1)  # batches prefetched; tags still in order
    workers.train(epochs=1)
    torch.testing.assert_close(workers.parameters(), inline.parameters(), rtol=0, atol=0)
    assert workers.accountant.steps == inline.accountant.steps == STEPS_PER_EPOCH


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ("accountant behind", ValueError, "the accountant counted 0 steps but the optimizer took 1"),
        ("batch_size", ValueError, "PoissonDataLoader got batch_size"),
        ("in_order", ValueError, "in_order=False"),
        ("no step method", TypeError, "accountant must have step"),
        ("disable_dp", ValueError, "disable_dp=True"),
        ("plain sampler", TypeError, "must be a dp_hf.sampling.PoissonBatchSampler"),
        ("step in progress", RuntimeError, "in the middle of Poisson step 0"),
    ],
)
def test_binding_refusals(change, error, match):
    run = Run("opacus", num_micro_batches=2)
    sampler, optimizer, kwargs = run.sampler, run.optimizer, {"accountant": PrivacyAccountant("rdp")}
    if change == "accountant behind":
        run.train(epochs=1)
        optimizer.state["dp"]["step"] = 1
        kwargs["accountant"] = PrivacyAccountant("rdp")
    elif change == "batch_size":
        kwargs["batch_size"] = 4
    elif change == "in_order":
        kwargs.update(in_order=False, num_workers=1)
    elif change == "no step method":
        kwargs["accountant"] = object()
    elif change == "disable_dp":
        optimizer = create_dp_optimizer(
            "dp-sgd",
            run.model.parameters(),
            lr=0.1,
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            expected_batch_size=10,
            disable_dp=True,
        )
    elif change == "plain sampler":
        sampler = torch.utils.data.BatchSampler(range(N), 4, drop_last=False)
    else:
        run.sampler.set_epoch(0)
        run.backward(next(iter(run.loader)))
        run.optimizer.step()  # micro-batch 0 of 2: the step is unfinished
    with pytest.raises(error, match=match):
        PoissonDataLoader(make_data(), sampler, optimizer, **kwargs)


def test_a_new_sampler_with_the_same_seed_every_epoch_is_refused():
    """The same seed draws the same masks again: epoch 1 would replay epoch 0's batches (counted as new)."""
    run = Run("opacus")
    run.train(epochs=1)
    again = PoissonBatchSampler(N, SAMPLE_RATE, steps_per_epoch=STEPS_PER_EPOCH, seed=5)
    loader = PoissonDataLoader(make_data(), again, run.optimizer, accountant=run.accountant)
    with pytest.raises(RuntimeError, match=f"Poisson step 0 is not after Poisson step {STEPS_PER_EPOCH - 1}"):
        next(iter(loader))


@pytest.mark.parametrize("engine", ENGINES)
def test_abandon_step_mid_step_skips_the_rest_of_that_step_and_the_epoch_goes_on(engine):
    """An out-of-memory error on micro-batch 0 of step 1, caught, abandon_step(): step 1's other micro-batch is
    skipped (not refused, which ended the epoch), and steps 2 and 3 are trained."""
    run = Run(engine, num_micro_batches=2)
    run.sampler.set_epoch(0)
    for item, batch in enumerate(run.loader, start=1):
        if item == 3:  # micro-batch 0 of Poisson step 1
            run.optimizer.abandon_step()
            continue
        run.backward(batch)
        run.optimizer.step()
        run.optimizer.zero_grad()
    assert run.optimizer.dp_step == run.accountant.steps == STEPS_PER_EPOCH - 1
    assert last_released_step(run.optimizer) == STEPS_PER_EPOCH - 1


def test_an_accountant_behind_the_optimizer_is_refused_at_the_release():
    """Bound first, then the optimizer restored but not the accountant: its epsilon would leave steps out."""
    first = Run("opacus")
    first.train(epochs=1)
    resumed = Run("opacus")
    resumed.optimizer.load_state_dict(first.optimizer.state_dict())
    resumed.sampler.load_state_dict(first.sampler.state_dict())  # (the accountant forgotten)
    resumed.sampler.set_epoch(1)
    batch = next(iter(resumed.loader))
    resumed.backward(batch)
    before = [p.detach().clone() for p in resumed.model.parameters()]
    with pytest.raises(RuntimeError, match="counted 0 steps, but the optimizer took 4"):
        resumed.optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, resumed.model.parameters()))
    assert resumed.optimizer.dp_step == STEPS_PER_EPOCH  # nothing released


def test_an_opacus_accountant_counts_each_release():
    """Opacus's accountants take keyword-only arguments (a positional call failed after the noise was drawn)."""
    from opacus.accountants import RDPAccountant

    ours = Run("opacus", num_micro_batches=2)
    ours.train(epochs=1)
    theirs = Run("opacus", num_micro_batches=2)
    theirs.accountant = RDPAccountant()
    theirs.loader = PoissonDataLoader(
        make_data(), theirs.sampler, theirs.optimizer, accountant=theirs.accountant
    )
    theirs.train(epochs=1)
    assert theirs.accountant.history == [(1.0, SAMPLE_RATE, STEPS_PER_EPOCH)]
    assert [tuple(entry) for entry in ours.accountant.history] == [(1.0, SAMPLE_RATE, STEPS_PER_EPOCH)]


def test_a_state_loaded_mid_step_drops_that_step_and_keeps_its_record():
    """Loading a later state between two micro-batches: the step in progress is abandoned (its remaining
    micro-batch skipped), and the next step, already released by the loaded state, is refused."""
    later = Run("opacus", num_micro_batches=2)
    later.train(epochs=1)
    run = Run("opacus", num_micro_batches=2)
    run.sampler.set_epoch(0)
    batches = iter(run.loader)
    run.backward(next(batches))
    run.optimizer.step()  # micro-batch 0 of step 0, accumulated
    run.optimizer.load_state_dict(later.optimizer.state_dict())
    assert run.optimizer.privatizer.num_microbatches == 0
    with pytest.raises(RuntimeError, match=f"Poisson step 1 is not after Poisson step {STEPS_PER_EPOCH - 1}"):
        next(batches)  # (micro-batch 1 of step 0 skipped)


def test_a_state_saved_unbound_counts_its_steps_as_released():
    """An optimizer that never followed a loader (DPTrainer's, a plain DataLoader's) took dp_step steps: a new
    sampler with the same seed would replay them, counted as new."""
    run = Run("opacus")
    state = run.optimizer.state_dict()
    state["state"]["dp"]["step"] = 3
    assert "released_poisson_step" not in state["state"]["dp"]  # (nothing released while bound)
    resumed = Run("opacus")
    resumed.optimizer.load_state_dict(state)
    resumed.loader = PoissonDataLoader(make_data(), resumed.sampler, resumed.optimizer)
    resumed.sampler.set_epoch(0)
    with pytest.raises(RuntimeError, match="Poisson step 0 is not after Poisson step 2"):
        next(iter(resumed.loader))


@pytest.mark.parametrize("engine", ENGINES)
def test_zero_grad_without_set_to_none_is_the_same_run(engine):
    """Fast clipping took the zeros that zero_grad(set_to_none=False) leaves for a gradient outside its hooks."""
    none = Run(engine)
    none.train(epochs=1)
    zeros = Run(engine)
    zeros.train(epochs=1, set_to_none=False)
    torch.testing.assert_close(zeros.parameters(), none.parameters(), rtol=0, atol=0)
