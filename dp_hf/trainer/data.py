"""Poisson-sampled training data for a :class:`~dp_hf.trainer.DPTrainer`: the loader, the sampler's
position (no batch is ever trained twice) and the per-micro-batch checks (step tag, one example per row).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.data import DataLoader

from dp_hf.batches import check_batch_is_per_example, check_collator_is_per_example, row_lengths
from dp_hf.sampling import STEP_TAG_KEY, EmptyBatchCollator, PoissonBatchSampler, StepTaggedDataset
from dp_hf.secret_seeds import seed_worker
from dp_hf.shuffling import SecretShuffleSampler
from dp_hf.trainer.padding import check_padding_is_invisible

logger = logging.getLogger(__name__)


class _DPDataLoader(DataLoader):
    # The Trainer calls `set_epoch` on loaders that have it; the sampler's draws depend on the epoch.
    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def length_extremes(dataset) -> list[int]:
    """Indices of the shortest and the longest row by ``input_ids`` (or ``input_values``) of a ``datasets.Dataset``
    (else none).

    The collator probe reads them besides the first rows: a check of how batches are padded (left padding
    without ``position_ids``, padding without an ``attention_mask``) needs rows of different lengths. When
    the first rows had one length, the check ran only on the first training batch that mixed lengths, and
    stopped the run there: a stop that depends on the examples in that batch.
    """
    lengths = row_lengths(dataset) or row_lengths(dataset, "input_values")  # (text, or audio)
    if not lengths or len(lengths) < 2:
        return []
    return [
        min(range(len(lengths)), key=lengths.__getitem__),
        max(range(len(lengths)), key=lengths.__getitem__),
    ]


class PoissonDataMixin:
    """The Poisson loader and the checks each training micro-batch passes before its forward pass."""

    def get_train_dataloader(self) -> DataLoader:
        # Why: Poisson-sampled logical batches (the accounting's assumption) instead of shuffled ones.
        if self.args.disable_dp:
            return super().get_train_dataloader()
        self._check_dataset_is_planned()
        if not self.args.poisson_sampling:
            loader = super().get_train_dataloader()
            # transformers' worker_init_fn keeps 32 of the secret bits; the loader under accelerate's wrapper
            getattr(loader, "base_dataloader", loader).worker_init_fn = seed_worker
            return loader
        dataset = self.train_dataset
        collator = self.data_collator
        try:
            import datasets

            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:  # pragma: no cover - datasets is a dependency
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        first = list(range(min(4, self.dataset_size)))
        probe = [dataset[i] for i in first + [i for i in length_extremes(dataset) if i not in first]]
        padding_pair = check_collator_is_per_example(collator, probe, packed=self.packed_examples)
        if padding_pair is not None:
            self._check_padding_is_invisible(padding_pair)
        if self.sampler is None:
            self.sampler = PoissonBatchSampler(
                dataset_size=self.dataset_size,
                sample_rate=self.sample_rate,
                steps_per_epoch=self.steps_per_epoch,
                num_micro_batches=self.args.gradient_accumulation_steps,
                num_replicas=self.args.world_size,
                rank=self.args.process_index,
                seed=self.sampling_seed,
                tag_batches=True,
            )
        workers = self.args.dataloader_num_workers
        return _DPDataLoader(
            StepTaggedDataset(dataset),
            batch_sampler=self.sampler,
            collate_fn=EmptyBatchCollator(collator),
            # The Trainer's loader options; the batches are drawn in this process, in order.
            num_workers=workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers if workers else False,
            prefetch_factor=self.args.dataloader_prefetch_factor if workers else None,
            multiprocessing_context=self.args.dataloader_multiprocessing_context if workers else None,
            worker_init_fn=seed_worker,  # 64 bits from the secret torch generator, distinct per rank
        )

    def _check_padding_is_invisible(self, pair: tuple[Any, Any]) -> None:
        # A model that sees the padding added for a batch's longest example (dp_hf.trainer.padding).
        self._probing_losses = True  # side statistics (trl's token metrics) skip the probe's forwards
        try:
            check_padding_is_invisible(
                self.compute_per_example_losses, self.model, pair, self._prepare_inputs
            )
        finally:
            self._probing_losses = False

    def _get_train_sampler(self, train_dataset=None):
        # Why: the Trainer's shuffle follows the public seed (anyone could recompute every batch, and then
        # shuffling amplifies nothing); shuffled DP batches follow the secret sampling seed instead.
        if self.args.disable_dp or self.args.poisson_sampling:
            return super()._get_train_sampler(train_dataset)
        if self.shuffle_sampler is None:
            dataset = train_dataset if train_dataset is not None else self.train_dataset
            self.shuffle_sampler = SecretShuffleSampler(len(dataset), self.sampling_seed)
        return self.shuffle_sampler

    def _start_sampler(self, state) -> None:
        # The next loader item must train DP step accountant.steps, never an earlier one. On resume the
        # Trainer skips the first global_step % steps_per_epoch items of its epoch (unless
        # ignore_data_skip): those positions become empty placeholders, never drawn again.
        self._abandon_unfinished_step()
        self._micro_batch_index = 0
        if self.sampler is None:
            return
        epoch, skipped = 0, 0
        if self._resuming:
            epoch = state.global_step // self.steps_per_epoch
            skipped = 0 if self.args.ignore_data_skip else state.global_step % self.steps_per_epoch
        self._resuming = False
        self.sampler.start_at(self.accountant.steps, epoch=epoch, skipped=skipped)

    def _abandon_unfinished_step(self) -> None:
        """Drop what an earlier ``train()`` accumulated for a DP step it did not finish.

        A stop, an exception or ``KeyboardInterrupt`` between the micro-batches of one step (gradient
        accumulation, or one Poisson draw split into passes) leaves the clipped sums of its first
        micro-batches in the optimizer, and the Trainer's ``model.zero_grad()`` does not reach them. The next
        ``train()`` draws that step again from its first micro-batch; on top of the stale sums its examples
        counted twice in one release (an audit measured 1.5x the step's sensitivity). Never released, the
        sums are discarded, and the step is taken again whole.
        """
        optimizer = getattr(self, "dp_optimizer", None)
        discarded = optimizer.abandon_step() if optimizer is not None else 0
        for hooks in (self.fast_clipping, self.grad_sample_handle):
            if hooks is not None:
                hooks.clear()  # records of a forward or backward pass that was cut off
        if discarded or self._micro_batch_index:
            logger.warning(
                "DP step %d was left unfinished by an earlier train() call (stopped or interrupted after %d "
                "micro-batch(es) of it): its clipped gradients were never released and are discarded, and the "
                "step is taken again from its first micro-batch.",
                self.accountant.steps,
                max(discarded, self._micro_batch_index),
            )

    def _check_step_tag(self, inputs: dict[str, Any]) -> None:
        # Each Poisson micro-batch carries the DP step it was drawn for: a batch of an earlier step
        # (a replay) or of a later one (skipped steps) is refused before its forward pass.
        tag = inputs.pop(STEP_TAG_KEY, None)
        if self.sampler is None:
            return
        expected = (self.accountant.steps, self._micro_batch_index)
        if tag is None or (tag.step, tag.micro_batch) != expected:
            found = "no step tag" if tag is None else f"step {tag.step}, micro-batch {tag.micro_batch}"
            raise RuntimeError(
                f"a training micro-batch drawn for {found} arrived when DP step {expected[0]}, micro-batch "
                f"{expected[1]} was due: Poisson batches must be trained once, in order (a replayed batch would "
                "be counted twice by the accountant as if independent). A callback that sets "
                "control.should_epoch_stop ends an epoch before its last DP step, and the next epoch starts at "
                "its own first step: stop training instead (control.should_training_stop) or let the epoch "
                "finish. Otherwise this is a dp_hf bug or an unsupported custom training loop; please report it."
            )
        optimizer = getattr(self, "dp_optimizer", None)
        if tag.micro_batch == 0 and optimizer is not None and optimizer.privatizer.num_microbatches:
            raise RuntimeError(  # (an invariant: the sums of an unfinished step are dropped when train() begins)
                f"DP step {tag.step} begins while the optimizer holds clipped gradients of "
                f"{optimizer.privatizer.num_microbatches} micro-batch(es) that were never released: they would "
                "be released with this step's batch, counting examples twice. This is a dp_hf bug or an "
                "unsupported custom training loop; please report it."
            )
        if inputs:
            check_batch_is_per_example(
                inputs, tag.num_examples, self.data_collator, packed=self.packed_examples
            )
        self._micro_batch_index += 1

    def _track_num_input_tokens(self, inputs):
        # Why: an empty Poisson micro-batch ({}) has no input_ids, so the Trainer would warn and skip the
        # gather of the token count over ranks that it runs after every micro-batch, leaving the other
        # ranks waiting in an unmatched collective. Count zero tokens, and take part in the gather.
        if not inputs and self.args.include_num_input_tokens_seen != "no":
            if self.args.world_size > 1:
                zero = torch.zeros((), dtype=torch.int64, device=self.args.device)
                self.state.num_input_tokens_seen += self.accelerator.gather(zero).sum().item()
            return
        super()._track_num_input_tokens(inputs)
