"""DP state in checkpoints and saved models of a :class:`~dp_hf.trainer.DPTrainer`: accountant and sampler in
``dp_state.pt`` (a resume without them is refused), and the privacy card with every saved model.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import secrets
import warnings
from typing import Any

import torch

from dp_hf.distributed import dataset_digest, trainer_model
from dp_hf.fingerprints import callable_name, content_digest, model_digest
from dp_hf.trainer.weights import weights_loaded_under_model_names

logger = logging.getLogger(__name__)


DP_STATE_NAME = "dp_state.pt"


#: The trainer's samplers whose state checkpoints hold: the Poisson one, or the secret shuffle of
#: ``poisson_sampling=False`` (only one of them exists in a run).
_SAMPLERS = ("sampler", "shuffle_sampler")


def _state_of(sampler: Any) -> dict[str, int] | None:
    return sampler.state_dict() if sampler is not None else None


def _position_of(sampler: Any) -> dict[str, int] | None:
    # Its state without the secret seed (compared across ranks, and shown when they differ).
    state = _state_of(sampler)
    return None if state is None else {key: value for key, value in state.items() if key != "seed"}


#: The arguments the learning-rate schedule follows.
_SCHEDULE_FIELDS = (
    "learning_rate",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_steps",
    "warmup_ratio",
    "max_steps",
    "num_train_epochs",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
)


#: The arguments that split a logical batch into forward/backward passes (each draws its dropout masks).
_PASS_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "dp_max_physical_batch_size")


def _dataset_digest(dataset: Any, seed: int | None) -> str | None:
    """:func:`~dp_hf.distributed.dataset_digest` with the secret sampling seed; None for a dataset without
    rows. Rows that cannot be read give a fresh marker: the data cannot be shown unchanged, so a resume
    draws fresh noise (the check that cannot run does not allow the replay)."""
    if dataset is None or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return None
    try:
        return dataset_digest(dataset, seed)
    except Exception as error:  # noqa: BLE001 - unreadable: never equal to another digest
        return f"unreadable ({type(error).__name__}) {secrets.token_hex(16)}"


def progress_fields(trainer: Any, state: Any) -> dict[str, Any]:
    """Where ``trainer``'s rank is in the run, as every rank must agree when ``train()`` begins (compared by
    :func:`~dp_hf.distributed.check_same_progress`): the steps counted, the optimizer's and the Trainer's step,
    whether resuming, the samplers' positions, and a digest of the secret sampling seed (never the seed)."""
    seed = trainer.secret_sampling_seed()
    optimizer = getattr(trainer, "dp_optimizer", None)
    return {
        "accountant history": trainer.accountant.history,
        "optimizer DP step": None if optimizer is None else optimizer.dp_step,
        "Trainer global_step": state.global_step,
        "resuming from a checkpoint": bool(trainer._resuming),
        "sampler position": {name: _position_of(getattr(trainer, name, None)) for name in _SAMPLERS},
        "sampling seed digest": None if seed is None else hashlib.sha256(str(seed).encode()).hexdigest()[:12],
    }


class PrivateCheckpointMixin:
    """Saving and restoring all DP state; the privacy card on every save and Hub push."""

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Why: the accountant and the sampler are DP state too; a resume without them would reset epsilon.
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            torch.save(self.dp_state_dict(), os.path.join(output_dir, DP_STATE_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # Why: the Trainer reads the saved weights without the renamings save_pretrained reverted (ViT's
        # encoder resumed from its initial weights); dp_hf.trainer.weights renames them and checks the load.
        target = model if model is not None else self.model
        with weights_loaded_under_model_names(target, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        # Why: the same read of saved weights as _load_from_checkpoint, for load_best_model_at_end.
        with weights_loaded_under_model_names(self.model, self.state.best_model_checkpoint):
            super()._load_best_model()

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # Why: restore the accountant and sampler with the optimizer (noise generator inside its state).
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        self._resuming = True
        path = os.path.join(checkpoint, DP_STATE_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} is missing: this checkpoint has no DP state (accountant, sampler), so resuming from it "
                "would under-report epsilon. Resume from a checkpoint written by DPTrainer."
            )
        state = torch.load(path, weights_only=False)
        self.load_dp_state_dict(state)
        self._check_optimizer_matches_accountant(checkpoint)
        rekeyed = self._rekey_noise_if_settings_changed(state.get("release"))
        if (rekeyed or self.args.secure_mode) and not self.args.disable_dp:
            # The interrupted run's releases of the steps after this checkpoint are not replayed: the card says so.
            self.fresh_noise_resumes = [*self.fresh_noise_resumes, self.accountant.steps]
        if self.args.secure_mode and not self.args.disable_dp:
            warnings.warn(
                "secure_mode draws fresh noise: the steps after this checkpoint that the interrupted run already "
                "took are taken again with new noise. Whatever that run released from them (logged grad_norm, "
                "evaluations, pushed models) is a second release that epsilon does not count: keep it private.",
                UserWarning,
                stacklevel=2,
            )

    def _release_settings(self) -> dict[str, Any]:
        """What a step's release depends on besides the weights, the batch and the noise drawn for it."""
        args = self.args
        return {
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": getattr(self, "sample_rate", None),
            "dataset_size": self.dataset_size,
            # read with the sampler's seed (the checkpoint's once restored): the same rows before and after
            "dataset_digest": _dataset_digest(self.train_dataset, self.secret_sampling_seed()),
            "per_sample_max_grad_norm": args.per_sample_max_grad_norm,
            "expected_batch_size": args.expected_batch_size,
            "dp_optimizer": args.dp_optimizer,
            "dp_optimizer_kwargs": repr(sorted((args.dp_optimizer_kwargs or {}).items())),
            "schedule": repr(
                [getattr(args, name, None) for name in _SCHEDULE_FIELDS]
            ),  # a changed length or rate moves the weights a replayed step's gradient is taken at
            "world_size": args.world_size,
            "poisson_sampling": args.poisson_sampling,
            "secure_mode": args.secure_mode,
            # Every row (a changed one unseen by the sampled digest), and what else makes a step's gradient:
            # the model's configuration (dropout), how a batch is split into passes (dropout masks), the loss.
            "dataset_content": self._dataset_content_digest(),
            "model_config": model_digest(trainer_model(self)),
            "passes": repr(
                [getattr(args, name, None) for name in _PASS_FIELDS]
                + [
                    callable_name(getattr(self, "per_example_loss_fn", None)),
                    callable_name(self.data_collator),
                ]
            ),
        }

    def _dataset_content_digest(self) -> str | None:
        # Once per dataset object (every checkpoint asks): a digest of every byte reads the whole dataset.
        dataset, cached = getattr(self, "_content_digest_of", (None, None))
        if dataset is not self.train_dataset or dataset is None:
            cached = content_digest(self.train_dataset)
            self._content_digest_of = (self.train_dataset, cached)
        return cached

    def secret_sampling_seed(self) -> int | None:
        """The secret seed of this run's batches: its sampler's (the checkpoint's once a resume restored it), or
        the agreed ``sampling_seed`` before a sampler exists."""
        samplers = [getattr(self, name, None) for name in _SAMPLERS]
        seeds = [sampler.seed for sampler in samplers if sampler is not None]
        return seeds[0] if seeds else getattr(self, "sampling_seed", None)

    def _rekey_noise_if_settings_changed(self, saved: dict[str, Any] | None) -> bool:
        """Re-seed the noise generator from OS entropy when a resume changes what a step releases.

        A resume replays the interrupted run's steps after the checkpoint with the same batches and the same
        noise (the generator is restored): the same releases when nothing changed. When something did (the
        noise multiplier, the clip norm, the data, the learning rate...), the two releases of a replayed step
        share their noise, and their difference is noiseless: ``g + 0.8 C z`` and ``g + 1.5 C z`` gave the
        clipped sum ``g`` to 2e-6 (an audit). So the noise is then drawn afresh.
        """
        if saved is None or self.args.disable_dp or self.dp_optimizer.noise_source.generator is None:
            return False
        current = self._release_settings()
        changed = sorted(key for key in saved if key in current and saved[key] != current[key])
        if not changed:
            return False
        self.dp_optimizer.noise_source.reseed()
        warnings.warn(
            f"resuming with changed settings ({', '.join(changed)}): replaying the steps after this checkpoint with "
            "the restored noise would let the difference of the two runs' releases reveal the noiseless clipped "
            "sums, so the noise generator is re-seeded from fresh OS entropy (this run no longer reproduces the "
            "interrupted one). Whatever that run released from those steps is a second release that epsilon "
            "does not count: keep it private.",
            UserWarning,
            stacklevel=3,
        )
        return True

    @property
    def fresh_noise_resumes(self) -> list[int]:
        """The checkpoint steps at which this run resumed with fresh noise (changed settings, or ``secure_mode``):
        the interrupted runs' releases of the steps after them are second releases that epsilon does not count."""
        return list(self.__dict__.get("_fresh_noise_resumes", []))

    @fresh_noise_resumes.setter
    def fresh_noise_resumes(self, steps: list[int]) -> None:
        self.__dict__["_fresh_noise_resumes"] = [int(step) for step in steps]

    def _check_optimizer_matches_accountant(self, checkpoint: str | None = None) -> None:
        """The optimizer's DP step count (with its noise generator, in ``optimizer.pt``) is the accountant's.

        Checked when the optimizer is built or found (``checkpoint`` None) and after a resume loads both.

        The Trainer resumes without complaint from a checkpoint that lacks ``optimizer.pt``: the noise
        generator would restart from its seed and add again the noise of the first steps, which the
        accountant counts as fresh. An optimizer that took DP steps before this trainer's accountant
        existed spent privacy that no one accounts for.
        """
        optimizer_steps, accounted = self.dp_optimizer.dp_step, self.accountant.steps
        if optimizer_steps == accounted:
            return
        if checkpoint is not None:
            raise ValueError(
                f"{checkpoint}: the optimizer state says {optimizer_steps} DP steps but the accountant "
                f"({DP_STATE_NAME}) {accounted}. The optimizer state (optimizer.pt: the noise generator and the "
                "step count) is missing or from another checkpoint; resuming would add again noise already "
                "added, and the accountant would count it as fresh. Resume from a complete checkpoint written "
                "by DPTrainer."
            )
        raise ValueError(
            f"the optimizer passed to DPTrainer has already taken {optimizer_steps} DP steps, which this "
            f"trainer's accountant ({accounted} steps) does not count. Pass a fresh optimizer, or resume from "
            "the checkpoint of the run that took those steps."
        )

    def dp_state_dict(self) -> dict[str, Any]:
        """Accountant, sampler and the privacy plan, as saved in each checkpoint."""
        return {
            "accountant": self.accountant.state_dict(),
            **{name: _state_of(getattr(self, name)) for name in _SAMPLERS},
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": getattr(self, "sample_rate", None),
            "delta": getattr(self, "delta", None),
            "dataset_size": self.dataset_size,
            "release": self._release_settings(),
            "fresh_noise_resumes": self.fresh_noise_resumes,
        }

    def load_dp_state_dict(self, state: dict[str, Any]) -> None:
        if (
            state.get("shuffle_sampler") is not None
            and self.args.poisson_sampling
            and not self.args.disable_dp
        ):
            raise ValueError(
                "this checkpoint's steps were trained on shuffled batches (poisson_sampling=False), for which the "
                "accounted epsilon does not hold, and this run would resume with Poisson sampling: its card would "
                "claim the guarantee for the whole run. Resume with poisson_sampling=False, or start a new run."
            )
        if state.get("sample_rate") is not None and not math.isclose(state["sample_rate"], self.sample_rate):
            warnings.warn(
                f"resuming with sample rate {self.sample_rate} but the checkpoint used {state['sample_rate']}; "
                "the accountant composes both.",
                UserWarning,
                stacklevel=2,
            )
        # The history (sigma, q, steps) is the same whatever the method: this run's accountant (the
        # one its plan and card name) computes epsilon over all of it.
        saved = dict(state["accountant"])
        if saved.get("accountant") != self.accountant.mechanism:
            warnings.warn(
                f"the checkpoint's epsilon was computed by the {saved.get('accountant')!r} accountant; this run's "
                f"accountant={self.accountant.mechanism!r} now computes it over the whole history.",
                UserWarning,
                stacklevel=2,
            )
        saved["accountant"] = self.accountant.mechanism
        self.accountant.load_state_dict(saved)
        self.fresh_noise_resumes = state.get("fresh_noise_resumes", [])
        for name in _SAMPLERS:
            if state.get(name) is None:
                continue
            if getattr(self, name) is None:
                self.get_train_dataloader()  # builds this run's sampler
            if getattr(self, name) is not None:
                getattr(self, name).load_state_dict(state[name])

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # Why: every saved model (final save and each checkpoint) must carry its privacy card and privacy.json.
        super().save_model(output_dir, _internal_call)
        if not self.args.should_save:
            return
        from dp_hf.card import write_card_files

        target = output_dir if output_dir is not None else self.args.output_dir
        checkpoint = _internal_call and os.path.abspath(target) != os.path.abspath(self.args.output_dir)
        write_card_files(self, target, checkpoint=checkpoint)
        if checkpoint and self.args.push_to_hub and self.args.hub_strategy != "end":
            # A checkpoint push uploads output_dir with this checkpoint's weights copied in: the card goes too.
            write_card_files(self, self.args.output_dir)

    def create_model_card(
        self,
        language: str | None = None,
        license: str | None = None,
        tags: str | list[str] | None = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
    ) -> None:
        # Why: push_to_hub calls this just before uploading; the Trainer's card would replace our privacy card.
        if not self.is_world_process_zero():
            return
        from dp_hf.card import write_card_files

        write_card_files(
            self,
            self.args.output_dir,
            language=language,
            license=license,
            tags=tags,
            model_name=model_name,
            base_model=finetuned_from,
            pipeline_tag=tasks,
            dataset_name=dataset if dataset is not None else dataset_tags,
        )
