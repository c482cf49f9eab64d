"""`PoissonDataLoader`: Poisson batches bound to the DP optimizer that trains them, for your own loop.

``DataLoader(dataset, batch_sampler=PoissonBatchSampler(...))`` draws the right batches, but the
optimizer never learns which Poisson step a micro-batch was drawn for, so a loop that accumulates two
loader items into one ``step()``, or abandons a step with ``model.zero_grad()``, releases examples
twice unrefused. This loader hands each micro-batch's :class:`~dp_hf.sampling.StepTag` to the
optimizer as it yields the batch (in the main process, also with loader workers, which see the tag
only as data), and the optimizer checks it (:mod:`dp_hf.optim.step_tags`)::

    sampler = PoissonBatchSampler(len(train_set), q, num_micro_batches=4)
    loader = PoissonDataLoader(train_set, sampler, optimizer, accountant=accountant)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            if batch:                       # an empty micro-batch still belongs to its (noise) step
                per_example_losses(model, batch).sum().backward()
            optimizer.step()                # releases after the step's last micro-batch; counts it
            optimizer.zero_grad()

A ``step()`` after each micro-batch is right: the optimizer releases (noise once, update) after the
last micro-batch of each Poisson step and only clips and accumulates before it, as Opacus's
``BatchMemoryManager`` makes its optimizer skip. The bound accountant counts each release.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, default_collate

from dp_hf.optim.base import DPOptimizer
from dp_hf.optim.step_tags import StepFollower, steps_counted_behind
from dp_hf.sampling import EmptyBatchCollator, PoissonBatchSampler, StepTaggedDataset

#: DataLoader arguments that the Poisson sampler decides; passing one would replace or contradict it.
_SAMPLER_ARGUMENTS = ("sampler", "batch_sampler", "batch_size", "shuffle", "drop_last")


class PoissonDataLoader:
    """Iterates ``dataset`` in the Poisson micro-batches of ``sampler``, announcing each to ``optimizer``.

    Args:
        dataset: a map-style dataset (``dataset[i]``, or ``__getitems__``).
        sampler: the :class:`~dp_hf.sampling.PoissonBatchSampler` (``set_epoch`` before each epoch; its
            ``state_dict`` in every checkpoint). It is set to tag its batches: use it with this loader only.
        optimizer: the :class:`~dp_hf.optim.base.DPOptimizer` that trains them; it then releases once per
            Poisson step and refuses micro-batches of another step while one is unreleased.
        collate_fn: collates a non-empty micro-batch (default: torch's ``default_collate``); an empty
            one is ``{}``.
        accountant: counts each release at ``(optimizer.noise_multiplier, sampler.sample_rate)``, before its
            noise is drawn (``None``: count yourself, once per release). It must have counted every step the
            optimizer took (``accountant.steps >= optimizer.dp_step``: both restored from one checkpoint),
            checked at every release.
        **loader_kwargs: other ``torch.utils.data.DataLoader`` arguments (``num_workers``, ``pin_memory``...).
    """

    def __init__(
        self,
        dataset: Any,
        sampler: PoissonBatchSampler,
        optimizer: DPOptimizer,
        *,
        collate_fn: Callable[[list], Any] | None = None,
        accountant: Any = None,
        **loader_kwargs: Any,
    ) -> None:
        _check_binding(sampler, optimizer, accountant, loader_kwargs)
        sampler.tag_batches = True
        self.dataset, self.sampler, self.optimizer, self.accountant = dataset, sampler, optimizer, accountant
        optimizer.step_follower = StepFollower(sampler.sample_rate, accountant)
        self.loader = DataLoader(
            StepTaggedDataset(dataset),
            batch_sampler=sampler,
            collate_fn=_TagFirst(default_collate if collate_fn is None else collate_fn),
            **loader_kwargs,
        )

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        follower = self.optimizer.step_follower
        for tag, batch in self.loader:
            if tag.step < 0:
                continue  # a placeholder for a position before the sampler's start (see start_at)
            if self.optimizer.step_follower is not follower:
                raise RuntimeError(
                    "this optimizer now follows another PoissonDataLoader: iterate that one (one loader per optimizer)."
                )
            if follower.announce(self.optimizer, tag):  # (False: the rest of an abandoned step, skipped)
                yield batch


class _TagFirst:
    """Collates ``[tag, *examples]`` (a tagging sampler's item) into ``(tag, batch)``; ``{}`` when empty."""

    def __init__(self, collate_fn: Callable[[list], Any]) -> None:
        self.collate = EmptyBatchCollator(collate_fn)

    def __call__(self, features: list) -> tuple:
        return features[0], self.collate(features[1:])


def _check_binding(sampler: Any, optimizer: Any, accountant: Any, loader_kwargs: dict[str, Any]) -> None:
    if not isinstance(sampler, PoissonBatchSampler):
        raise TypeError(
            f"sampler must be a dp_hf.sampling.PoissonBatchSampler, got {type(sampler).__name__}."
        )
    if not isinstance(optimizer, DPOptimizer):
        raise TypeError(
            f"optimizer must be a dp_hf DP optimizer (dp_hf.optim.create_dp_optimizer), got {type(optimizer).__name__}."
        )
    if optimizer.disable_dp:
        raise ValueError(
            "this optimizer has disable_dp=True (no clipping, no noise): there is no Poisson step to follow. Use a "
            "plain torch DataLoader for the non-private baseline."
        )
    if loader_kwargs.get("in_order") is False:
        raise ValueError(
            "PoissonDataLoader got in_order=False: the micro-batches of a Poisson step must reach the optimizer in "
            "order. Leave in_order out (True)."
        )
    passed = [key for key in _SAMPLER_ARGUMENTS if key in loader_kwargs]
    if passed:
        raise ValueError(
            f"PoissonDataLoader got {', '.join(passed)}: the PoissonBatchSampler decides every batch. Leave them out."
        )
    follower = optimizer.step_follower
    if follower is not None and follower.current is not None:
        raise RuntimeError(
            f"this optimizer is in the middle of Poisson step {follower.current.step} of another PoissonDataLoader: "
            "finish it (step() after its last micro-batch) or drop it (optimizer.abandon_step()) first."
        )
    if accountant is not None and not callable(getattr(accountant, "step", None)):
        raise TypeError(
            f"accountant must have step(noise_multiplier=..., sample_rate=...) (dp_hf.accounting.PrivacyAccountant, "
            f"or Opacus's accountants), got {type(accountant).__name__}."
        )
    counted = steps_counted_behind(accountant, optimizer)
    if counted is not None:
        raise ValueError(
            f"the accountant counted {counted} steps but the optimizer took {optimizer.dp_step}: the epsilon it "
            "reports would leave steps out. Restore both from the same checkpoint (accountant.load_state_dict, "
            "optimizer.load_state_dict); a new optimizer for a later phase keeps the run's accountant."
        )
