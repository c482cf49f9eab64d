"""Secret randomness: the seeds never reach an experiment tracker, however it reads the arguments, and
the global generators (dropout masks, a collator's random masking) are not those of the public seed."""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from dp_training import bert_classifier, classification_data, dp_args
from transformers import TrainerCallback, set_seed
from transformers.integrations.integration_utils import ClearMLCallback

from dp_hf import DPTrainer
from dp_hf.card import build_privacy_report

NOISE_SEED, SAMPLING_SEED = 918273645, 564738291


def _clearml_hparams(args) -> str:
    # transformers' own code, with a fake ClearML task that records what it would upload.
    uploaded = {}
    fake = SimpleNamespace(
        _clearml=SimpleNamespace(
            utilities=SimpleNamespace(proxy_object=SimpleNamespace(flatten_dictionary=dict))
        ),
        _clearml_task=SimpleNamespace(
            _arguments=SimpleNamespace(copy_from_dict=lambda d, prefix: uploaded.update(d))
        ),
    )
    ClearMLCallback._copy_training_args_as_hparams(fake, args, "Transformers")
    return str(uploaded)


#: Every way transformers' integrations (and a tracker of one's own) read the arguments.
READERS = {
    "clearml": _clearml_hparams,
    "getattr_fields": lambda a: str({f.name: getattr(a, f.name) for f in dataclasses.fields(a)}),
    "vars": lambda a: str(vars(a)),
    "__dict__": lambda a: str(a.__dict__),
    "asdict": lambda a: str(dataclasses.asdict(a)),
    "to_dict": lambda a: json.dumps(a.to_dict()),
    "to_json_string": lambda a: a.to_json_string(),
    "to_sanitized_dict": lambda a: str(a.to_sanitized_dict()),
    "str": str,
    "repr": repr,
    "dir": lambda a: str({name: getattr(a, name, None) for name in dir(a) if not name.startswith("__")}),
    "pickle": lambda a: str(vars(pickle.loads(pickle.dumps(a)))),
}


class _Reader(TrainerCallback):
    def __init__(self):
        self.seen: dict[str, str] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.seen = {name: read(args) for name, read in READERS.items()}


def _seeded_args(tmp_path, **overrides):
    return dp_args(tmp_path, max_steps=1, noise_seed=NOISE_SEED, sampling_seed=SAMPLING_SEED, **overrides)


def test_trackers_never_read_the_seeds(tmp_path):
    reader = _Reader()
    args = _seeded_args(tmp_path)
    trainer = DPTrainer(
        model=bert_classifier(), args=args, train_dataset=classification_data(64), callbacks=[reader]
    )
    trainer.train()
    assert set(reader.seen) == set(READERS)
    for name, text in reader.seen.items():
        assert str(NOISE_SEED) not in text and str(SAMPLING_SEED) not in text, name
    # ... and the run used them: the sampler's and the noise generator's seeds, the card's "fixed".
    assert trainer.sampler.seed == SAMPLING_SEED
    assert trainer.dp_optimizer.noise_source.generator.initial_seed() == NOISE_SEED
    assert args.secret_seed("noise_seed") == NOISE_SEED and args.secret_seed("sampling_seed") == SAMPLING_SEED
    report = build_privacy_report(trainer)
    assert report["noise_seed_fixed"] and report["sampling_seed_fixed"]


def test_same_arguments_same_seeds_in_a_second_trainer(tmp_path):
    args = _seeded_args(tmp_path)
    first = DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(64))
    second = DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(64))
    assert first.sampling_seed == second.sampling_seed == SAMPLING_SEED
    args.noise_seed = 7  # set again after a trainer took them: the new value counts
    third = DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(64))
    assert args.secret_seed("noise_seed") == 7 and third.sampling_seed == SAMPLING_SEED
    assert "7" not in str(args.noise_seed)


def test_placeholder_without_the_seed_is_refused(tmp_path):
    args = dp_args(tmp_path, max_steps=1, noise_seed="<NOISE_SEED>")  # e.g. rebuilt from to_dict()
    with pytest.raises(ValueError, match="placeholder"):
        DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(64))


# ----------------------------------------------------------------------------- global generators


class _GeneratorStates(TrainerCallback):
    """The global generators' states when training begins (after DPTrainer's own callback)."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.states = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())


def _start_states(tmp_path, dropout=0.0, **seeds):
    model = bert_classifier(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    args = dp_args(tmp_path, max_steps=2, seed=0, **seeds)
    trainer = DPTrainer(model=model, args=args, train_dataset=classification_data(64))
    recorder = _GeneratorStates()
    trainer.add_callback(recorder)  # after PrivacyCallback, which begins DP training
    trainer.train()
    return recorder.states, torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def test_global_generators_are_secret_when_training_starts(tmp_path):
    fresh_1, _ = _start_states(tmp_path / "a", noise_seed=None, sampling_seed=None)
    fresh_2, _ = _start_states(tmp_path / "b", noise_seed=None, sampling_seed=None)
    set_seed(0)  # what the Trainer sets from the public args.seed
    public = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    # Same public seed, fresh secret seeds: the dropout masks of the two runs are independent.
    assert not torch.equal(fresh_1[0], fresh_2[0])
    assert not np.array_equal(fresh_1[1], fresh_2[1]) and fresh_1[2] != fresh_2[2]
    for states in (fresh_1, fresh_2):
        assert not torch.equal(states[0], public[0])
        assert not np.array_equal(states[1], public[1]) and states[2] != public[2]


def test_fixed_secret_seeds_reproduce_dropout(tmp_path):
    states_1, params_1 = _start_states(tmp_path / "a", dropout=0.5)  # dp_args fixes both seeds
    states_2, params_2 = _start_states(tmp_path / "b", dropout=0.5)
    assert _same(states_1, states_2) and torch.equal(params_1, params_2)
    # Another sampling seed (same public seed, same noise seed): other masks.
    other, _ = _start_states(tmp_path / "c", dropout=0.5, sampling_seed=3)
    assert not torch.equal(other[0], states_1[0])


def test_a_resume_with_dropout_continues_the_uninterrupted_run(tmp_path):
    # The checkpoint's seeds (sampler, noise generator) and generators (rng_state.pth) are restored:
    # a resume whose arguments fix no seed trains exactly as the run that never stopped.
    data = classification_data(128)
    common = dict(max_steps=5, save_strategy="steps", save_steps=3, seed=0)

    def model(seed=0):
        return bert_classifier(seed, hidden_dropout_prob=0.5, attention_probs_dropout_prob=0.5)

    full = DPTrainer(model=model(), args=dp_args(tmp_path / "full", **common), train_dataset=data)
    full.train()
    first = DPTrainer(model=model(), args=dp_args(tmp_path / "cut", **common), train_dataset=data)
    first.train()
    resumed_args = dp_args(tmp_path / "cut", noise_seed=None, sampling_seed=None, **common)
    resumed = DPTrainer(model=model(123), args=resumed_args, train_dataset=data)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-3"))
    assert resumed.sampler.seed == full.sampler.seed
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
