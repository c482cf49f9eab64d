"""PoissonBatchSampler draws what the accountant counts: every example joins every step independently,
with a probability never above the accounted ``q``."""

import pytest
import torch

from dp_hf.sampling import PoissonBatchSampler


def _masks(sampler: PoissonBatchSampler, steps: int) -> torch.Tensor:
    return torch.stack([sampler.mask(step) for step in range(steps)])  # [steps, N] bool


@pytest.mark.parametrize("q", [0.2, 1 / 3, 32 / 51200, 1e-6, 1.5 * 2**-24, 1.0])
def test_inclusion_probability_is_q_rounded_down_to_the_float64_grid(q):
    p = PoissonBatchSampler(dataset_size=10, sample_rate=q, seed=0).inclusion_probability
    assert p <= q and q - p < 2**-53
    assert (p * 2**53).is_integer()  # float64 uniforms are k 2^-53: P(u < p) is exactly p


@pytest.mark.parametrize(
    "q",
    [
        12.5 / 256,  # the first random byte decides 12 of 256 "in"; the other 45 bits half of 1 in 256
        12 / 256,  # the byte alone decides (the 45 bits never include)
        1 / 3,
    ],
)
def test_inclusion_rate_is_exact_where_the_low_bits_decide(q):
    # Drawing the first byte of u alone and ignoring the 45 low bits would give 12/256 for 12.5/256:
    # 4% fewer, ~40 standard deviations over these 2^24 draws.
    n, steps = 1 << 20, 16
    sampler = PoissonBatchSampler(dataset_size=n, sample_rate=q, seed=9)
    included = sum(int(sampler.mask(step).sum()) for step in range(steps))
    expected = q * n * steps
    assert abs(included - expected) < 5 * (expected * (1 - q)) ** 0.5, (included, expected)


def test_rate_one_includes_everyone():
    assert bool(PoissonBatchSampler(dataset_size=1000, sample_rate=1.0, seed=0).mask(3).all())


def test_no_excess_inclusion_below_the_float32_grid():
    # At q = 2^-28, ``torch.rand(n) < q`` (float32 uniforms: multiples of 2^-24) includes an example with
    # probability 2^-24 = 16 q. Over 100 steps of 2^21 examples that is ~12.5 inclusions; at q, ~0.8.
    q, n, steps = 2.0**-28, 1 << 21, 100
    sampler = PoissonBatchSampler(dataset_size=n, sample_rate=q, seed=11)
    included = sum(int(sampler.mask(step).sum()) for step in range(steps))
    assert included <= 5, f"{included} inclusions where q N steps = {q * n * steps}"


def test_masks_are_independent_bernoulli_draws():
    # Poisson sampling, not fixed-size batches: the batch size varies as Binomial(N, q), each example is
    # included at rate q, and examples and steps are independent of each other.
    n, q, steps = 400, 0.05, 2000
    masks = _masks(PoissonBatchSampler(dataset_size=n, sample_rate=q, seed=4), steps).double()
    sizes = masks.sum(dim=1)
    assert abs(sizes.mean().item() - n * q) < 0.5  # 5 standard errors of the mean
    assert 16.0 < sizes.var().item() < 22.0  # N q (1 - q) = 19
    per_example = masks.sum(dim=0)
    chi2 = ((per_example - steps * q) ** 2 / (steps * q * (1 - q))).sum().item()
    assert 300 < chi2 < 500  # ~ chi-squared with 400 degrees of freedom
    neighbours = (masks[:, 1:] * masks[:, :-1]).mean().item()  # examples i and i + 1 in one step
    consecutive = (masks[1:] * masks[:-1]).mean().item()  # one example in steps t and t + 1
    for joint in (neighbours, consecutive):
        assert abs(joint - q * q) < 0.0005, joint  # q^2 = 0.0025 for independent draws


# ----------------------------------------------------------------------------- in a loop of one's own


def _sampler(**overrides) -> PoissonBatchSampler:
    return PoissonBatchSampler(**{"dataset_size": 40, "sample_rate": 0.25, "seed": 5, **overrides})


def test_an_epoch_iterated_again_without_set_epoch_is_refused():
    """Without set_epoch the second epoch drew the first one's batches again (epsilon 1.07 claimed, 4.27 run)."""
    sampler = _sampler()
    first = list(sampler)
    assert len(first) == 4
    with pytest.raises(RuntimeError, match="DP step 0 again.*set_epoch"):
        next(iter(sampler))
    sampler.set_epoch(1)
    second = list(sampler)
    assert first != second
    sampler.start_at(4, epoch=1)  # the caller says step 4 was never trained
    assert list(sampler) == second


@pytest.mark.parametrize("tag_batches", [False, True])
def test_load_state_dict_resumes_at_the_next_untrained_step(tag_batches):
    """The state held no step: a sampler resumed from it drew the counted batches again."""
    whole = _sampler(tag_batches=tag_batches, num_micro_batches=2)
    uninterrupted = []
    for epoch in range(3):
        whole.set_epoch(epoch)
        uninterrupted += list(whole)
    cut = _sampler(tag_batches=tag_batches, num_micro_batches=2)
    trained = list(cut)
    cut.set_epoch(1)
    items = iter(cut)
    trained += [next(items) for _ in range(5)]  # step 6's first micro-batch was drawn: the mark is at 7
    state = cut.state_dict()
    resumed = _sampler(tag_batches=tag_batches, num_micro_batches=2, seed=99)
    resumed.load_state_dict(state)
    assert (resumed.seed, resumed.epoch) == (5, 1)
    rest = []
    for epoch in range(resumed.epoch, 3):
        resumed.set_epoch(epoch)
        rest += list(resumed)
    placeholders = [item for item in rest if tag_batches and item[0].step == -1]
    assert len(placeholders) == (6 if tag_batches else 0)  # steps 4-6 of epoch 1, 2 micro-batches each
    # Step 6's first micro-batch was drawn but never trained: the resumed run goes on at step 7.
    assert trained[:12] == uninterrupted[:12]  # steps 0-5
    assert [item for item in rest if item not in placeholders] == uninterrupted[14:]  # steps 7-11
    with pytest.raises(RuntimeError, match="again"):
        list(resumed)  # epoch 2 a second time


def test_state_saved_without_the_next_step_loads_but_needs_start_at():
    """An older state has no position: iterating its epoch from the start replayed steps trained before."""
    sampler = _sampler()
    sampler.load_state_dict({"seed": 7, "epoch": 2})
    assert (sampler.seed, sampler.epoch) == (7, 2)
    with pytest.raises(RuntimeError, match="without its position .* start_at"):
        next(iter(sampler))
    sampler.start_at(10, epoch=2, skipped=2)  # as DPTrainer does, from its accountant
    assert len(list(sampler)) == 2  # steps 10 and 11: the epoch's last two positions


def test_the_process_group_sets_the_default_replicas(monkeypatch):
    """As torch's DistributedSampler: under torchrun a sampler built without num_replicas/rank takes the
    process group's. Its default was one replica, so each rank drew a mask over the whole dataset with its
    own seed, and the optimizer summed the ranks: an example sampled on two ranks counted twice, at about 2q
    (an own-loop audit, 2 processes)."""
    import torch.distributed as dist

    assert PoissonBatchSampler(dataset_size=40, sample_rate=0.25, seed=5).num_replicas == 1  # no group: 1
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *args: 2)
    monkeypatch.setattr(dist, "get_rank", lambda *args: 1)
    sampler = PoissonBatchSampler(dataset_size=40, sample_rate=0.25, seed=5)
    assert (sampler.num_replicas, sampler.rank) == (2, 1)
    whole = PoissonBatchSampler(dataset_size=40, sample_rate=0.25, seed=5, num_replicas=1, rank=0)
    shares = [sampler.mask(0).nonzero().flatten().tolist(), whole.mask(0).nonzero().flatten().tolist()]
    assert shares[0] == shares[1]  # the same step's mask on every rank, of which this rank takes its share
    first = next(iter(sampler))
    assert list(first) == shares[0][1::2]
