"""Regression tests for the audit's privacy holes (issue: packing, batch replay, secrets in logs,
planning that overspends, the unnoised training loss). Each fails on the code before the fix."""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import pickle
import re
import warnings

import datasets
import numpy as np
import pytest
import torch
from transformers import DataCollatorWithFlattening, TrainerCallback, default_data_collator

from dp_hf import DPTrainer, cli, plan
from dp_hf.accounting import compute_epsilon
from dp_hf.accounting.display import shown
from dp_hf.batches import check_batch_is_per_example, check_collator_is_per_example
from dp_hf.per_example.errors import UnsupportedModuleError
from dp_hf.sampling import STEP_TAG_KEY, PoissonBatchSampler
from dp_hf.training_args import OWN_OPTIMIZER_ARGUMENTS
from tests.dp_training import bert_classifier, classification_data, dp_args, pad_token_rows, params_of

# ----------------------------------------------------------------------------- packing


def _token_features(n: int = 4) -> list[dict]:
    return [{"input_ids": list(range(5, 8 + i)), "labels": list(range(5, 8 + i))} for i in range(n)]


def test_flattening_collator_is_refused_by_the_probe():
    # One row holding every example: its probe used to hit an IndexError that meant "allowed".
    with pytest.raises(ValueError, match="packs examples"):
        check_collator_is_per_example(DataCollatorWithFlattening(), _token_features())


@pytest.mark.parametrize(
    ("batch", "why"),
    [
        ({"input_ids": torch.ones(1, 9, dtype=torch.long)}, "has 1 rows"),
        ({"input_ids": torch.ones(3, 4), "cu_seq_lens_q": torch.tensor([0, 4, 8])}, "cu_seq_lens_q"),
        ({"input_ids": torch.ones(3, 4), "seq_idx": torch.zeros(3, 4)}, "seq_idx"),
        (
            {"input_ids": torch.ones(3, 6), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]] * 3)},
            "restarting",
        ),
    ],
)
def test_packed_batches_are_refused(batch, why):
    with pytest.raises(ValueError, match=why):
        check_batch_is_per_example(batch, 3)


def test_padded_position_ids_are_not_mistaken_for_packing():
    batch = {"input_ids": torch.ones(2, 5), "position_ids": torch.tensor([[0, 1, 2, 0, 0], [0, 1, 2, 3, 4]])}
    check_batch_is_per_example(batch, 2)


def test_collator_that_fails_on_the_probe_is_an_error_not_a_pass():
    def broken(features):
        raise KeyError("needs a tokenizer")

    with pytest.raises(ValueError, match="failed on"):
        check_collator_is_per_example(broken, _token_features())


def test_packing_collator_is_refused_before_training(tmp_path):
    import datasets
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    ids = (torch.arange(8) + torch.randint(5, 30, (64, 1))).tolist()
    data = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    trainer = DPTrainer(
        model=model,
        args=dp_args(tmp_path, max_steps=1),
        train_dataset=data,
        data_collator=DataCollatorWithFlattening(),
    )
    before = params_of(trainer.model)
    with pytest.raises(ValueError, match="packs examples"):
        trainer.train()
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_random_packing_collator_is_refused_at_its_first_batch(tmp_path):
    # A random collator skips the probe's row comparison; the check on every micro-batch still holds.
    def random_packer(features):
        batch = default_data_collator(features)
        batch["input_ids"] = batch["input_ids"] * 0 + torch.randint(3, 9, (1,))  # random: two calls differ
        if len(features) > 1:  # packs pairs of examples into one row
            half = len(features) // 2
            for key in ("input_ids", "attention_mask"):
                batch[key] = batch[key][:half].repeat(1, 2)
        return batch

    trainer = DPTrainer(
        model=bert_classifier(),
        args=dp_args(tmp_path, max_steps=1),
        train_dataset=classification_data(64),
        data_collator=random_packer,
    )
    with pytest.raises(ValueError, match="packs examples"):
        trainer.train()


# ----------------------------------------------------------------------------- batch replay


def _resume_run(tmp_path, name: str, ignore_data_skip: bool):
    data = classification_data(96)
    # 96 / 16 = 6 steps per epoch; 8 steps cross an epoch boundary; checkpoint at step 4 (mid-epoch).
    common = dict(
        max_steps=8,
        save_strategy="steps",
        save_steps=4,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=1,
        ignore_data_skip=ignore_data_skip,
    )
    first = DPTrainer(model=bert_classifier(), args=dp_args(tmp_path / name, **common), train_dataset=data)
    first.train()
    resumed = DPTrainer(
        model=bert_classifier(seed=7), args=dp_args(tmp_path / name, **common), train_dataset=data
    )
    resumed.train(resume_from_checkpoint=os.path.join(tmp_path / name, "checkpoint-4"))
    return first, resumed


@pytest.mark.slow
@pytest.mark.parametrize("ignore_data_skip", [False, True])
def test_resume_never_replays_a_batch(tmp_path, ignore_data_skip):
    # With ignore_data_skip the sampler used to restart the epoch's masks: steps 0-3 were trained again while
    # the accountant counted them as fresh. Now step t always trains the mask of (seed, t), and a resumed run
    # equals the uninterrupted one bit for bit, whatever ignore_data_skip says.
    first, resumed = _resume_run(tmp_path, f"skip{ignore_data_skip}", ignore_data_skip)
    assert resumed.accountant.steps == first.accountant.steps == 8
    assert resumed.privacy_spent() == first.privacy_spent()
    for (name, p), q in zip(first.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def _checkpointed_run(tmp_path, **overrides) -> str:
    """A 4-step run with checkpoints at steps 2 and 4; returns the run's folder."""
    args = dp_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, **overrides)
    DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(64)).train()
    return str(tmp_path)


@pytest.mark.parametrize("damage", ["missing", "from another checkpoint"])
def test_a_checkpoint_without_its_optimizer_state_is_refused(tmp_path, damage):
    # optimizer.pt holds the noise generator. The Trainer resumes without it: the generator restarted from
    # noise_seed and added again the first steps' noise, which the accountant counted as fresh.
    run = _checkpointed_run(tmp_path)
    checkpoint = os.path.join(run, "checkpoint-4")
    if damage == "missing":
        os.remove(os.path.join(checkpoint, "optimizer.pt"))
    else:
        os.replace(
            os.path.join(run, "checkpoint-2", "optimizer.pt"), os.path.join(checkpoint, "optimizer.pt")
        )
    resumed = DPTrainer(
        model=bert_classifier(), args=dp_args(tmp_path, max_steps=6), train_dataset=classification_data(64)
    )
    before = params_of(resumed.model)
    with pytest.raises(ValueError, match="optimizer state says (0|2) DP steps but the accountant") as error:
        resumed.train(resume_from_checkpoint=checkpoint)
    assert "dp_state.pt) 4" in str(error.value)
    assert resumed.accountant.steps == 4
    assert resumed.state.global_step == 4  # the weights are the checkpoint's; no step was taken
    assert any(not torch.equal(p, before[n]) for n, p in resumed.model.named_parameters())


def test_an_optimizer_that_already_took_steps_is_refused(tmp_path):
    first = DPTrainer(
        model=bert_classifier(),
        args=dp_args(tmp_path / "a", max_steps=2),
        train_dataset=classification_data(64),
    )
    first.train()
    used = first.dp_optimizer
    first.fast_clipping.remove()  # the model's hooks, so that a second trainer can attach its own
    second = DPTrainer(
        model=first.model,
        args=dp_args(tmp_path / "b", max_steps=2),
        train_dataset=classification_data(64),
        optimizers=(used, None),
    )
    with pytest.raises(ValueError, match="already taken 2 DP steps, which this trainer's accountant"):
        second.train()
    assert used.dp_step == 2


def test_a_resume_with_another_accountant_uses_it_over_the_whole_history(tmp_path):
    run = _checkpointed_run(tmp_path, accountant="pld")
    resumed = DPTrainer(
        model=bert_classifier(),
        args=dp_args(tmp_path, max_steps=6, accountant="rdp"),
        train_dataset=classification_data(64),
    )
    with pytest.warns(UserWarning, match="computed by the 'pld' accountant; this run's accountant='rdp'"):
        resumed.train(resume_from_checkpoint=os.path.join(run, "checkpoint-4"))
    assert resumed.accountant.mechanism == "rdp" and resumed.accountant.steps == 6
    ((sigma, q, steps),) = resumed.accountant.history
    assert steps == 6
    assert resumed.privacy_spent()[0] == pytest.approx(
        compute_epsilon(q, sigma, 6, resumed.delta, "rdp"), rel=1e-9
    )


def test_masks_are_drawn_per_step_not_per_epoch():
    sampler = PoissonBatchSampler(dataset_size=50, sample_rate=0.2, seed=3)
    epoch0 = [b.tolist() for b in sampler.logical_batches()]
    sampler.set_epoch(1)
    epoch1 = [b.tolist() for b in sampler.logical_batches()]
    assert epoch0 != epoch1
    assert epoch1[0] == sampler.mask(sampler.steps_per_epoch).nonzero().squeeze(1).tolist()
    # A resumed sampler told that position 2 of epoch 1 trains step 7: positions 0-1 are empty placeholders.
    sampler.start_at(7, epoch=1, skipped=2)
    resumed = [b.tolist() for b in sampler.logical_batches()]
    assert resumed[:2] == [[], []]
    assert resumed[2] == epoch1[2]  # step 7 = 1 * 5 + 2: the same mask the uninterrupted run drew


def test_tagged_items_name_their_step():
    sampler = PoissonBatchSampler(
        dataset_size=40, sample_rate=0.25, num_micro_batches=2, seed=1, tag_batches=True
    )
    sampler.start_at(10, epoch=0, skipped=1)
    items = list(sampler)
    assert [(it[0].step, it[0].micro_batch) for it in items[:4]] == [(-1, 0), (-1, 1), (10, 0), (10, 1)]
    assert all(it[0].num_examples == len(it) - 1 for it in items)


@pytest.mark.slow
def test_second_train_call_continues_the_sampler(tmp_path):
    data = classification_data(64)
    trainer = DPTrainer(model=bert_classifier(), args=dp_args(tmp_path, max_steps=3), train_dataset=data)
    seen: list[tuple[int, int]] = []
    check = trainer._check_step_tag

    def record(inputs):
        tag = inputs[STEP_TAG_KEY]
        seen.append((tag.step, tag.micro_batch))
        return check(inputs)

    trainer._check_step_tag = record
    trainer.train()
    trainer.train()  # the Trainer restarts its epoch numbering at 0; the sampler must not restart its draws
    assert trainer.accountant.steps == 6
    assert seen == [(t, m) for t in range(6) for m in range(2)]


def _resume_from_step_2(tmp_path, name, model_overrides=None, data=None, **changes):
    """A DP-SGD run resumed from the first run's ``checkpoint-2`` (in ``tmp_path / "a"``) for its third step."""
    common = dict(
        dp_optimizer="dp-sgd", lr_scheduler_type="constant", max_steps=3, save_strategy="steps", save_steps=1
    )
    args = dp_args(tmp_path / name, **{**common, "noise_multiplier": 0.8, **changes})
    model = bert_classifier(**(model_overrides or {}))
    trainer = DPTrainer(
        model=model, args=args, train_dataset=classification_data(64) if data is None else data
    )
    if name == "a":
        trainer.train()
        return trainer, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    return trainer, [w for w in caught if "re-seeded from fresh OS entropy" in str(w.message)]


def test_a_resume_with_changed_settings_draws_fresh_noise(tmp_path):
    """A resume replays the steps after its checkpoint with the restored noise generator. With a changed noise
    multiplier the two runs' third steps, ``-lr (S + 0.8 C z) / B`` and ``-lr (S + 1.5 C z) / B``, shared ``z``:
    their difference, scaled, equalled the noise ``z`` that a third, noiseless run exposes, and so revealed the
    clipped sum ``S`` (an audit recovered it to 2e-6). The resumed run now re-seeds the noise (and warns) when a
    setting changed, and still replays the interrupted run exactly when none did."""
    first, _ = _resume_from_step_2(tmp_path, "a")
    same, same_warnings = _resume_from_step_2(tmp_path, "same")
    louder, louder_warnings = _resume_from_step_2(tmp_path, "louder", noise_multiplier=1.5)
    silent, _ = _resume_from_step_2(tmp_path, "silent", noise_multiplier=1e-9, accountant="rdp")
    assert not same_warnings and louder_warnings
    # The card says what epsilon leaves out: the interrupted run's releases of the steps taken again.
    from dp_hf.card import build_privacy_report

    assert same.fresh_noise_resumes == [] and louder.fresh_noise_resumes == [2]
    assert louder.dp_state_dict()["fresh_noise_resumes"] == [2]  # (in every later checkpoint)
    not_covered = build_privacy_report(louder)["not_covered"]
    assert any("released from the steps after step 2, where this run resumed" in item for item in not_covered)
    assert not any("where this run resumed" in item for item in build_privacy_report(same)["not_covered"])
    a, b, s = (
        torch.cat([p.detach().flatten() for p in t.model.parameters()]) for t in (first, louder, silent)
    )
    assert torch.equal(a, torch.cat([p.detach().flatten() for p in same.model.parameters()]))
    noise_from_the_pair = (a - b) / (1.5 - 0.8)  # = lr C z / B if the third steps shared z
    noise_itself = (s - a) / 0.8
    assert float((noise_from_the_pair - noise_itself).norm() / noise_itself.norm()) > 0.5


def test_a_secure_mode_resume_is_recorded_for_the_card(tmp_path):
    """secure_mode takes the steps after the checkpoint again with fresh noise: the interrupted run's releases
    of them are second releases (a warning said so; the card did not)."""
    _resume_from_step_2(tmp_path, "a", secure_mode=True, noise_seed=None)
    resumed, _ = _resume_from_step_2(tmp_path, "b", secure_mode=True, noise_seed=None)
    assert resumed.fresh_noise_resumes == [2] and resumed.accountant.steps == 3


def _one_row_flipped(n: int, row: int):
    data = classification_data(n)
    flipped = data[row]
    flipped["labels"] = 1 - flipped["labels"]
    return datasets.concatenate_datasets(
        [data.select(range(row)), datasets.Dataset.from_list([flipped]), data.select(range(row + 1, n))]
    ).flatten_indices()


@pytest.mark.parametrize(
    ("changes", "setting"),
    [
        (dict(per_sample_max_grad_norm=0.5), "per_sample_max_grad_norm"),
        (dict(learning_rate=2e-2), "schedule"),
        (dict(max_steps=4), "schedule"),
        (dict(poisson_sampling=False), "poisson_sampling"),  # the same noise over other batches (an audit)
        # What a card audit found unseen (each dropout mask, or one example, differs: 1.7-2.5 C noiseless):
        (dict(per_device_train_batch_size=8, gradient_accumulation_steps=4), "passes"),
        (dict(dp_max_physical_batch_size=8), "passes"),
        (dict(model_overrides=dict(hidden_dropout_prob=0.1)), "model_config"),
        (dict(data="one row flipped"), "dataset_content"),  # a row the sampled digest does not read
    ],
    ids=["clip", "lr", "max_steps", "shuffled", "split", "physical", "dropout", "one_row"],
)
def test_every_setting_a_release_depends_on_rekeys_the_noise(tmp_path, changes, setting):
    data = None
    if changes.get("data"):
        data, changes = classification_data(2000), {**changes, "data": _one_row_flipped(2000, 1001)}
    _resume_from_step_2(tmp_path, "a", data=data)
    _, rekeyed = _resume_from_step_2(tmp_path, "b", **changes)
    assert rekeyed, changes
    assert setting in str(rekeyed[0].message)


def test_a_dataset_whose_rows_cannot_be_read_never_compares_unchanged():
    """The resume check's digest of the data: rows it cannot read must not count as unchanged data (a check
    that cannot run does not allow the noise replay)."""
    from dp_hf.trainer.checkpoint import _dataset_digest

    class Unreadable(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, index):
            raise OSError("shard missing")

    first, second = _dataset_digest(Unreadable(), 3), _dataset_digest(Unreadable(), 3)
    assert first != second and first.startswith("unreadable (OSError)")
    data = classification_data(16)
    assert _dataset_digest(data, 3) == _dataset_digest(data, 3)


def test_a_shuffled_run_resumed_with_poisson_sampling_is_refused(tmp_path):
    """Steps trained on shuffled batches do not have the accounted guarantee; resumed with Poisson sampling, the
    card claimed it for the whole run (``guarantee_holds: true``, an audit)."""
    _resume_from_step_2(tmp_path, "a", poisson_sampling=False)
    with pytest.raises(ValueError, match="trained on shuffled batches"):
        _resume_from_step_2(tmp_path, "b")


def test_a_replayed_batch_is_refused(tmp_path):
    trainer = DPTrainer(
        model=bert_classifier(), args=dp_args(tmp_path, max_steps=4), train_dataset=classification_data(64)
    )
    trainer.train()
    loader = trainer.get_train_dataloader()
    trainer.sampler.start_at(0)  # as the old sampler did on a restart: step 0's batch again
    batch = next(iter(loader))
    with pytest.raises(RuntimeError, match="trained once, in order"):
        trainer.training_step(trainer.model, batch)


# ----------------------------------------------------------------------------- secrets


SECRET_NOISE_SEED, SECRET_SAMPLING_SEED = 918273645, 564738291


@pytest.mark.parametrize(
    "serialize",
    [
        lambda a: json.dumps(a.to_dict()),
        lambda a: a.to_json_string(),
        lambda a: json.dumps(a.to_sanitized_dict(), default=str),
        str,
        repr,
        lambda a: str(vars(pickle.loads(pickle.dumps(a)))),
    ],
    ids=["to_dict", "to_json_string", "to_sanitized_dict", "str", "repr", "pickle"],
)
def test_seeds_never_appear_in_serialized_arguments(tmp_path, serialize):
    args = dp_args(tmp_path, noise_seed=SECRET_NOISE_SEED, sampling_seed=SECRET_SAMPLING_SEED)
    text = serialize(args)
    assert str(SECRET_NOISE_SEED) not in text and str(SECRET_SAMPLING_SEED) not in text
    assert args.noise_seed == SECRET_NOISE_SEED  # the live object keeps them


def test_seeds_never_reach_an_experiment_logger(tmp_path):
    # What TensorBoard/W&B/MLflow callbacks read: args.to_dict() / to_json_string() / to_sanitized_dict().
    class Tracker(TrainerCallback):
        logged: list[str] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.logged += [json.dumps(args.to_dict()), args.to_json_string(), str(args.to_sanitized_dict())]

    args = dp_args(tmp_path, max_steps=1, noise_seed=SECRET_NOISE_SEED, sampling_seed=SECRET_SAMPLING_SEED)
    trainer = DPTrainer(
        model=bert_classifier(), args=args, train_dataset=classification_data(64), callbacks=[Tracker]
    )
    trainer.train()
    assert Tracker.logged
    for text in Tracker.logged:
        assert str(SECRET_NOISE_SEED) not in text and str(SECRET_SAMPLING_SEED) not in text


# ----------------------------------------------------------------------------- planning


_STEP_COMMENT = re.compile(
    r"round\((\d[\d,]*) ?/ ?(\d[\d,]*)\) = (\d+)[^;\n]*; (\d+(?:\.\d+)?) epochs -> (?:T = )?(?:[^=\n]*= )?([\d,]+) steps"
)
_RECIPE_FILES = sorted(
    glob.glob(os.path.join(os.path.dirname(__file__), "..", "recipes", "**", "*.*"), recursive=True)
)


def _step_comments() -> list[tuple[str, tuple[int, int, int, float, int]]]:
    found = []
    for path in _RECIPE_FILES:
        if path.endswith((".yaml", ".py")):
            with open(path) as handle:
                for m in _STEP_COMMENT.finditer(handle.read()):
                    n, b, per_epoch, epochs, steps = (g.replace(",", "") for g in m.groups())
                    found.append(
                        (os.path.basename(path), (int(n), int(b), int(per_epoch), float(epochs), int(steps)))
                    )
    return found


def test_recipe_comments_count_steps_as_the_trainer_does():
    comments = _step_comments()
    names = {name for name, _ in comments}
    assert {"demo.py", "bert_qnli.yaml", "deit_cifar10.yaml", "deit_cifar100.yaml", "llm_lora.yaml"} <= names
    for name, (n, b, per_epoch, epochs, steps) in comments:
        assert plan.steps_per_epoch(dataset_size=n, expected_batch_size=b) == per_epoch, name
        assert plan.planned_steps(per_epoch, num_train_epochs=epochs) == steps, name


def test_steps_from_a_sample_rate_are_the_trainers():
    """Given only ``q = B / N`` (``dp-hf --sample-rate``), steps per epoch are the trainer's ``round(N / B)``. At
    a tie the decimal of ``q`` rounded the other way: 1852 of the pairs below disagreed, 861 with fewer steps
    (N 1100, B 200, 3 epochs: 15 planned against the trainer's 18), so the CLI's sigma missed its target."""
    for n in range(2, 3000):
        for b in (2, 3, 8, 10, 64, 100, 200, 256):
            if b <= n:
                trainer = plan.steps_per_epoch(dataset_size=n, expected_batch_size=b)
                assert plan.steps_per_epoch(sample_rate=b / n) == trainer, (n, b)
    assert plan.steps_per_epoch(sample_rate=0.001) == 1000 and plan.steps_per_epoch(sample_rate=1e-9) == 10**9


@pytest.mark.slow
def test_cli_noise_multiplier_meets_the_budget_in_dptrainer(tmp_path, capsys):
    # The demo's shape: 1437 examples, expected batch 256, 15 epochs. The CLI used to plan T = 85 steps
    # (ceil(E / q)) while DPTrainer takes 90: its sigma then spent epsilon 8.24 for a target of 8.
    n, batch, epochs, target = 1437, 256, 15, 8.0
    cli.main(["noise", "--target-epsilon", str(target), "--batch-size", str(batch), "--dataset-size", str(n),
              "--epochs", str(epochs), "--delta", "1e-5", "--json"])  # fmt: skip
    planned = json.loads(capsys.readouterr().out)
    assert planned["steps"] == 90
    data = classification_data(n)
    args = dp_args(
        tmp_path,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_train_epochs=epochs,
        noise_multiplier=planned["noise_multiplier"],
        target_delta=1e-5,
        logging_steps=1000,
    )
    trainer = DPTrainer(model=bert_classifier(), args=args, train_dataset=data)
    trainer.train()
    assert trainer.accountant.steps == planned["steps"] == trainer.planned_steps
    epsilon, delta = trainer.privacy_spent()
    assert epsilon <= target
    assert epsilon == pytest.approx(
        compute_epsilon(batch / n, planned["noise_multiplier"], 90, 1e-5), rel=1e-9
    )


# ----------------------------------------------------------------------------- training loss


@pytest.mark.parametrize("log_loss", [True, False])
def test_training_loss_can_be_kept_out_of_logs_and_the_card_says_which(tmp_path, log_loss):
    from dp_hf.card import build_privacy_report, render_card

    trainer = DPTrainer(
        model=bert_classifier(),
        args=dp_args(tmp_path, max_steps=2, dp_log_train_loss=log_loss, skip_memory_metrics=False),
        train_dataset=classification_data(64),
    )
    output = trainer.train()
    # The summary's run time, rates and memory follow the realized (private) batch sizes: dropped with the loss
    # (an audit found them in a pushed trainer_state.json)
    summary = trainer.state.log_history[-1]
    measured = {
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "train_mem_cpu_peaked_delta",
    }
    assert (measured <= set(summary)) == log_loss and (measured <= set(output.metrics)) == log_loss
    assert any("_mem_" in key for key in summary) == log_loss
    # train()'s return value too: its training_loss is the unnoised mean loss
    assert math.isnan(output.training_loss) == (not log_loss)
    assert ("train_loss" in output.metrics) == log_loss
    logged = [entry for entry in trainer.state.log_history if "epsilon" in entry]
    assert logged, "epsilon must still be logged"
    has_loss = any("loss" in entry or "train_loss" in entry for entry in trainer.state.log_history)
    assert has_loss == log_loss
    # total_flos counts the private batches' padded tokens: dropped from the logs and the state too
    assert any("total_flos" in entry for entry in trainer.state.log_history) == log_loss
    assert (trainer.state.total_flos > 0) == log_loss
    report = build_privacy_report(trainer)
    assert any("training loss" in item for item in report["not_covered"]) == log_loss
    assert "docs/threat-model.md" in render_card(report)


# ----------------------------------------------------------------------------- what a user sees


def test_plan_is_printed_and_epsilon_is_in_the_progress_bar(tmp_path, capsys):
    args = dp_args(tmp_path, max_steps=3, disable_tqdm=False, logging_steps=500, target_delta=None)
    trainer = DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(64))
    trainer.train()
    captured = capsys.readouterr()
    plan_text = captured.out[captured.out.index("dp_hf privacy plan:") :]
    assert f"q = {trainer.sample_rate:.4g}" in plan_text and "expected batch 32 of N = 64" in plan_text
    assert f"{shown(trainer.noise_multiplier, 4, up=False)} (given)" in plan_text
    assert "3 (" in plan_text and "default: 1/(10 N)" in plan_text
    planned = compute_epsilon(trainer.sample_rate, trainer.noise_multiplier, 3, trainer.delta)
    assert re.search(rf"planned epsilon +{planned:.4g} after 3 steps", plan_text)
    assert f"epsilon={trainer.privacy_spent()[0]:.3f}" in captured.err  # tqdm's bar, on stderr


def test_the_plan_rounds_each_figure_the_safe_way(tmp_path, capsys):
    """A plan printed "delta 1.25e-05" for 1.2549e-05 (.3g: a smaller delta than the epsilon is for) and a
    calibrated sigma 0.782080 as 0.7821 (more noise than there is): delta and q now round up, sigma down."""
    args = dp_args(tmp_path, max_steps=3, target_epsilon=3.0, target_delta=1.2549e-5, noise_multiplier=None)
    trainer = DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(64))
    plan_text = trainer.privacy_plan_text()
    assert re.search(r"delta +1\.2549e-05 \(given\)", plan_text)
    sigma = float(re.search(r"noise multiplier +([0-9.]+) \(calibrated", plan_text).group(1))
    q = float(re.search(r"q = ([0-9.e-]+) ", plan_text).group(1))
    assert sigma <= trainer.noise_multiplier and q >= trainer.sample_rate
    assert sigma != trainer.noise_multiplier  # (a calibrated sigma has more than 4 digits: rounded, down)


def test_logged_grad_norm_is_the_released_gradients_norm(tmp_path):
    trainer = DPTrainer(
        model=bert_classifier(), args=dp_args(tmp_path, max_steps=3), train_dataset=classification_data(64)
    )
    released = []
    on_step = trainer._on_optimizer_step

    def record(optimizer, args, kwargs):
        grads = [p.grad.flatten() for p in optimizer.trainable_params() if p.grad is not None]
        released.append(float(torch.cat(grads).norm()))
        on_step(optimizer, args, kwargs)

    trainer._on_optimizer_step = record
    trainer.train()
    logged = [entry["grad_norm"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 3 and all(n > 0 for n in logged)
    assert logged == pytest.approx(released, rel=1e-5)


@pytest.mark.parametrize("first_step", [False, True])
def test_grad_norm_is_taken_only_for_logged_steps_and_matches_them(tmp_path, first_step):
    args = dp_args(tmp_path, max_steps=5, logging_steps=2, logging_first_step=first_step)
    trainer = DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(64))
    released, taken = [], []
    on_step = trainer._on_optimizer_step

    def record(optimizer, args, kwargs):
        grads = [p.grad.flatten() for p in optimizer.trainable_params() if p.grad is not None]
        released.append(float(torch.cat(grads).norm()))
        on_step(optimizer, args, kwargs)
        taken.append(trainer._released_grad_norm is not None)

    trainer._on_optimizer_step = record
    trainer.train()
    logged_steps = [1, 2, 4] if first_step else [2, 4]
    assert taken == [step in logged_steps for step in range(1, 6)]
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logs] == logged_steps
    assert [entry["grad_norm"] for entry in logs] == pytest.approx(
        [released[s - 1] for s in logged_steps], rel=1e-5
    )


@pytest.mark.parametrize("name", ["gradient_checkpointing", "activation_checkpointing"])
def test_gradient_checkpointing_is_refused_before_training(tmp_path, name):
    # The Trainer would turn it on at train(), after the per-example hooks are attached.
    with pytest.raises(
        ValueError, match=r"^gradient_checkpointing \(activation_checkpointing, .*\) is not supported"
    ):
        dp_args(tmp_path, **{name: True})


@pytest.mark.parametrize("setting", [dict(torch_compile=True), dict(torch_compile_backend="aot_eager")])
def test_torch_compile_is_refused_before_training(tmp_path, setting):
    # Dynamo would trace the per-example hooks: a graph break per layer, a recompile per Poisson batch size.
    with pytest.raises(ValueError, match=r"torch_compile=True \(backend .*\) is not supported with DP"):
        dp_args(tmp_path, **setting)
    dp_args(tmp_path, disable_dp=True, **setting)  # the non-private baseline may compile


@pytest.mark.parametrize("compile_in_place", [False, True])
def test_a_compiled_model_is_refused_before_training(tmp_path, compile_in_place):
    model = bert_classifier()
    if compile_in_place:
        model.bert.encoder.compile()  # Module.compile on a submodule
        where = "bert.encoder (BertEncoder)"
    else:
        model = torch.compile(model)
        where = "(OptimizedModule)"
    with pytest.raises(UnsupportedModuleError, match="it is compiled") as error:
        DPTrainer(model=model, args=dp_args(tmp_path), train_dataset=classification_data())
    assert where in str(error.value)


_HALF_HEAD = 8  # tiny Llama: head size 16, half of it per rotary factor list


@pytest.mark.parametrize(
    "rope, refused",
    [
        ({"rope_type": "default"}, False),
        ({"rope_type": "linear", "factor": 2.0}, False),
        ({"rope_type": "dynamic", "factor": 8.0}, True),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0] * _HALF_HEAD,
                "long_factor": [4.0] * _HALF_HEAD,
                "original_max_position_embeddings": 8,
            },
            True,
        ),
    ],
    ids=["default", "linear", "dynamic", "longrope"],
)
def test_rotary_frequencies_that_follow_the_batch_are_refused(rope, refused):
    """transformers' ``dynamic_rope_update`` sets "dynamic" and "longrope" frequencies from the longest position
    of the forward pass: the batch's longest example (or a packed row's longest segment) moved every other
    example's angles, 1.7-2.9 C on a tiny Llama (an audit, through DPSFTTrainer). Static types pass."""
    from dp_hf.per_example import attach_fast_clipping
    from tests.tiny_models import tiny_llama_lm

    model = tiny_llama_lm(rope_parameters={"rope_theta": 10000.0, **rope})
    if not refused:
        attach_fast_clipping(model).remove()
        return
    with pytest.raises(
        UnsupportedModuleError, match=rf"rope_type '{rope['rope_type']}'.*follow the longest position"
    ):
        attach_fast_clipping(model)


@pytest.mark.parametrize("tokens_seen", ["all", "non_padding", True])
def test_token_counts_are_unnoised_statistics(tmp_path, tokens_seen):
    from dp_hf.card import build_privacy_report

    # Logs promised free of unnoised statistics cannot also carry the private batches' token count.
    with pytest.raises(ValueError, match="include_num_input_tokens_seen=.* dp_log_train_loss=False"):
        dp_args(tmp_path, dp_log_train_loss=False, include_num_input_tokens_seen=tokens_seen)
    # Allowed with the training loss, and then the card lists the count as not covered.
    trainer = DPTrainer(
        model=bert_classifier(),
        args=dp_args(tmp_path, max_steps=2, include_num_input_tokens_seen=tokens_seen),
        train_dataset=classification_data(64),
    )
    trainer.train()
    assert any("num_input_tokens_seen" in entry for entry in trainer.state.log_history)
    not_covered = build_privacy_report(trainer)["not_covered"]
    assert any("number of input tokens seen" in item for item in not_covered)


def test_no_token_count_no_card_item(tmp_path):
    from dp_hf.card import build_privacy_report

    trainer = DPTrainer(
        model=bert_classifier(), args=dp_args(tmp_path, max_steps=1), train_dataset=classification_data(64)
    )
    assert not any("tokens seen" in item for item in build_privacy_report(trainer)["not_covered"])


@pytest.mark.parametrize("strategy", ["sequential", "group_by_length"])
@pytest.mark.parametrize("poisson", [True, False])
def test_batches_chosen_by_order_or_length_are_refused(tmp_path, strategy, poisson):
    # Poisson batches would silently ignore the strategy; shuffled ones would follow it, unaccounted.
    with pytest.raises(ValueError, match=f"train_sampling_strategy='{strategy}' is not supported with DP"):
        dp_args(tmp_path, train_sampling_strategy=strategy, poisson_sampling=poisson)
    dp_args(tmp_path, train_sampling_strategy=strategy, disable_dp=True)  # the non-private baseline may


@pytest.mark.parametrize("setting", [dict(optim="sgd"), dict(optim="adafactor"), dict(optim_args="foo=1")])
@pytest.mark.parametrize("disable_dp", [False, True])
def test_the_trainers_optimizer_choice_is_refused_not_ignored(tmp_path, setting, disable_dp):
    # DPTrainer builds args.dp_optimizer, also for the non-private baseline: optim would be ignored.
    with pytest.raises(ValueError, match=r"optim=.* is not used: DPTrainer builds the DP optimizer"):
        dp_args(tmp_path, disable_dp=disable_dp, **setting)
    dp_args(tmp_path, optim="adamw_torch", disable_dp=disable_dp)  # the default AdamW names are fine


@pytest.mark.parametrize("key", sorted(OWN_OPTIMIZER_ARGUMENTS))
def test_dp_optimizer_kwargs_cannot_override_the_plan(tmp_path, key):
    # {"max_grad_norm": 0.1} clipped at 0.1 while the printed plan said C = 1; a seed there would be logged.
    with pytest.raises(ValueError, match=f"dp_optimizer_kwargs sets {key}, which DPTrainer takes") as error:
        dp_args(tmp_path, dp_optimizer_kwargs={key: 12345})
    assert "12345" not in str(error.value)  # the value may be a seed
    assert f"{OWN_OPTIMIZER_ARGUMENTS[key]} instead of dp_optimizer_kwargs[{key!r}]" in str(error.value)


def test_the_trainers_default_learning_rate_with_dp_sgd_is_pointed_out(tmp_path, caplog):
    # Each run spends privacy: DP-SGD at the Trainer's 5e-5 barely moved (a newcomer's run spent epsilon 3 at
    # a constant loss). An Adam at that rate, or DP-SGD at a chosen one, is not pointed at.
    with caplog.at_level(logging.WARNING, logger="dp_hf"):
        dp_args(tmp_path, dp_optimizer="dp-adamw", learning_rate=5e-5)
        dp_args(tmp_path, dp_optimizer="dp-sgd", learning_rate=0.5)
        assert "Trainer's default" not in caplog.text
        dp_args(tmp_path, dp_optimizer="dp-sgd", learning_rate=5e-5)
    assert "learning_rate=5e-05 is the Trainer's default, tuned for non-private Adam: DP-SGD" in caplog.text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ("{bad", r"dp_optimizer_kwargs='\{bad' is not valid JSON"),
        ("[1, 2]", r"dp_optimizer_kwargs=\[1, 2\] must be a dict"),
        (
            {"not_an_option": 1},
            r"has 'not_an_option', which dp-adamw does not take; its options: none beyond",
        ),
        (
            {"distributed": False},
            r"has 'distributed', which dp-adamw does not take",
        ),  # ranks would not reduce
        # another optimizer's option is named as such (it read "the optimizer's name sets decoupled weight decay")
        (
            {"momentum": 0.9},
            r"has 'momentum', which dp-adamw does not take \(momentum is an option of dp-sgd\)",
        ),
    ],
)
def test_dp_optimizer_kwargs_are_checked_when_the_arguments_are_built(tmp_path, kwargs, message):
    # Bad JSON raised json's bare message; an unknown key failed at train() in the optimizer's constructor.
    with pytest.raises(ValueError, match=message):
        dp_args(tmp_path, dp_optimizer_kwargs=kwargs)
    assert dp_args(
        tmp_path, dp_optimizer="dp-sgd", dp_optimizer_kwargs='{"momentum": 0.9}'
    ).dp_optimizer_kwargs == {"momentum": 0.9}


@pytest.mark.parametrize("name", ["dp-adam-stp", "dp-adamw-stp", "dp-microadam", "dp-adamw"])
def test_adam_betas_and_epsilon_reach_every_adam(tmp_path, name):
    """Scale-then-privatize takes DP-Adam's betas and eps through **kwargs, which the signature check missed:
    adam_beta2 and adam_epsilon were silently not used."""
    args = dp_args(
        tmp_path, dp_optimizer=name, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, max_steps=1
    )
    trainer = DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(32))
    trainer.create_optimizer()
    group = trainer.dp_optimizer.param_groups[0]
    assert tuple(group["betas"]) == (0.8, 0.95) and group["eps"] == 1e-6


@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(label_smoothing_factor=0.1), "label_smoothing_factor=0.1 is not applied by DP training"),
        (dict(neftune_noise_alpha=5.0), "neftune_noise_alpha=5.0 is not supported with DP"),
        (dict(auto_find_batch_size=True), "auto_find_batch_size=True is not supported with DP"),
        (dict(train_sampling_strategy="sequential"), "train_sampling_strategy='sequential' is not supported"),
        (dict(torch_compile=True), r"torch_compile=True \(backend .*\) is not supported with DP"),
    ],
)
def test_trainer_options_that_break_the_guarantee_are_refused(tmp_path, setting, message):
    # In the arguments, and again in DPTrainer when they were switched on after the arguments were built.
    with pytest.raises(ValueError, match=message):
        dp_args(tmp_path, **setting)
    args = dp_args(tmp_path)
    for key, value in setting.items():
        setattr(args, key, value)
    with pytest.raises(ValueError, match=message):
        DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(64))
    dp_args(tmp_path, disable_dp=True, **setting)  # the non-private baseline may use them


def test_compute_loss_func_is_refused_not_ignored(tmp_path):
    with pytest.raises(TypeError, match="compute_loss_func is not used by DPTrainer"):
        DPTrainer(
            model=bert_classifier(),
            args=dp_args(tmp_path),
            train_dataset=classification_data(64),
            compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum(),
        )


def test_model_init_is_refused_by_name(tmp_path):
    # The Trainer calls model_init again in train(): the new model had no hooks, and the gradient check
    # refused it naming "trainable parameter #0" (an audit), not model_init.
    with pytest.raises(TypeError, match=r"model_init is not supported by DPTrainer: .* model=model_init\(\)"):
        DPTrainer(model_init=bert_classifier, args=dp_args(tmp_path), train_dataset=classification_data(64))


# ----------------------------------------------------------------------------- a user's Trainer habits


def _padded_text(n: int = 32):
    import datasets

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 9, (n,), generator=g).tolist()
    return datasets.Dataset.from_dict(
        {
            "input_ids": [torch.randint(5, 40, (k,), generator=g).tolist() for k in lengths],
            "labels": torch.randint(0, 2, (n,), generator=g).tolist(),
        }
    )


class _PadCollator:
    """Dynamic padding to the batch's longest example, on either side (as DataCollatorWithPadding does)."""

    def __init__(self, side: str, mask: bool = True) -> None:
        self.side, self.mask = side, mask

    def __call__(self, features):
        batch = pad_token_rows(features, self.side)
        batch["labels"] = torch.tensor([f["labels"] for f in features])
        if not self.mask:
            del batch["attention_mask"]
        return batch


@pytest.mark.parametrize("side", ["left", "right"])
def test_left_padding_is_refused_before_any_step(tmp_path, side):
    # BERT's absolute positions: a short example's gradient changed by 0.5 (norm 1.1) when a longer example
    # joined its batch under left padding; 0 under right padding.
    trainer = DPTrainer(
        model=bert_classifier(),
        args=dp_args(tmp_path, max_steps=2, per_device_train_batch_size=8, gradient_accumulation_steps=1),
        train_dataset=_padded_text(),
        data_collator=_PadCollator(side),
    )
    if side == "right":
        trainer.train()
        assert trainer.accountant.steps == 2
        return
    with pytest.raises(ValueError, match="pads on the left: an example's tokens then sit at positions"):
        trainer.train()
    assert trainer.accountant.steps == 0


@pytest.mark.parametrize("collator", ["left", "unmasked"])
def test_padding_checks_see_rows_of_different_lengths_even_when_the_first_rows_agree(tmp_path, collator):
    """The collator probe read the first 4 rows; with those of one length, left padding (or padding without
    an attention_mask) was found only by the first training batch that mixed lengths, which stopped the run
    there: whether and when the run stopped depended on the one long example (an audit's finding for
    padding-free SFT, the same here). The probe also reads the shortest and the longest row."""
    import datasets

    rows = _padded_text(32)
    ids = [[7, 8, 9, 10, 11] for _ in range(32)]
    ids[20] = [7, 8, 9, 10, 11, 12, 13, 14]  # the one longer example, far from the first rows
    data = datasets.Dataset.from_dict({"input_ids": ids, "labels": rows["labels"]})
    trainer = DPTrainer(
        model=bert_classifier(),
        args=dp_args(tmp_path, max_steps=3, per_device_train_batch_size=8, gradient_accumulation_steps=1),
        train_dataset=data,
        data_collator=_PadCollator("left") if collator == "left" else _PadCollator("right", mask=False),
    )
    with pytest.raises(ValueError, match="pads on the left" if collator == "left" else "no attention_mask"):
        trainer.train()
    assert trainer.accountant.steps == 0  # before any step


def test_left_padding_detection():
    from dp_hf.batches import check_batch_is_per_example

    right = {"attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])}
    check_batch_is_per_example(right, 3)
    with pytest.raises(ValueError, match="pads on the left"):
        check_batch_is_per_example({"attention_mask": torch.tensor([[1, 1, 1], [0, 1, 1]])}, 2)
    # position_ids counting each example's own tokens make the side irrelevant
    check_batch_is_per_example(
        {"attention_mask": torch.tensor([[0, 1, 1]]), "position_ids": torch.tensor([[0, 0, 1]])}, 1
    )


@pytest.mark.parametrize("mask", [False, True])
def test_dynamic_padding_without_an_attention_mask_is_refused_before_any_step(tmp_path, mask):
    # Without a mask BERT attends to the padding, so each example's gradient depended on its batch's padded
    # length (the longest other example): replacing one example moved the update 1.67x the replace-one
    # bound (0.67x with the mask). The loss probe compared rows of one padded batch and the collator probe
    # took a right-padded row for the example alone, so both passed.
    trainer = DPTrainer(
        model=bert_classifier(),
        args=dp_args(tmp_path, max_steps=1, per_device_train_batch_size=8, gradient_accumulation_steps=1),
        train_dataset=_padded_text(),
        data_collator=_PadCollator("right", mask=mask),
    )
    if mask:
        trainer.train()
        assert trainer.accountant.steps == 1
        return
    before = params_of(trainer.model)
    with pytest.raises(ValueError, match="pads examples to the longest of their batch .* no attention_mask"):
        trainer.train()
    assert trainer.accountant.steps == 0
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_unmasked_batches_of_one_length_pass_the_collator_check():
    # Fixed-length padding, or examples of one length: no row's length depends on the other examples.
    same = [{"input_ids": [5, 6, 7], "labels": 0}, {"input_ids": [8, 9, 10], "labels": 1}]
    check_collator_is_per_example(_PadCollator("right", mask=False), same)
    images = [{"pixel_values": torch.full((3, 4, 4), float(i)), "labels": i} for i in range(3)]
    check_collator_is_per_example(default_data_collator, images)
    mixed = same + [{"input_ids": [5, 6], "labels": 0}]
    check_collator_is_per_example(_PadCollator("right", mask=True), mixed)
    with pytest.raises(ValueError, match="'input_ids' of example 0: \\(3,\\) alone, \\(6,\\) in a batch"):
        check_collator_is_per_example(
            _PadCollator("right", mask=False), mixed + [{"input_ids": [5] * 6, "labels": 1}]
        )


def test_an_unseeded_masked_lm_collator_passes_the_collator_check():
    # It draws its masks from torch's generator, which the probe reseeded to 0 before every call: two calls
    # agreed, so the rows were compared with differently masked examples and the collator was refused.
    features = [{"input_ids": list(range(5, 5 + k))} for k in (6, 9, 7, 8)]
    check_collator_is_per_example(_masked_lm_collator(), features)


class _NumpyMasking:
    """Random masks from NumPy's global generator (reseeded by DPTrainer like torch's): accepted."""

    def __call__(self, features):
        ids = torch.tensor([f["input_ids"] for f in features])
        return {"input_ids": ids, "labels": torch.from_numpy(np.random.randint(0, 2, ids.shape))}


class _OwnGenerator:
    """Random masks from a generator of its own, seeded with a public number (or not: dp_hf cannot tell)."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(0)

    def __call__(self, features):
        ids = torch.tensor([f["input_ids"] for f in features])
        return {"input_ids": ids, "labels": torch.randint(0, 2, ids.shape, generator=self.generator)}


def _masked_lm_collator(**kwargs):
    from tokenizers import Tokenizer, models
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[MASK]": 2, **{f"w{i}": i for i in range(3, 40)}}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")),
        pad_token="[PAD]",
        unk_token="[UNK]",
        mask_token="[MASK]",
    )
    return DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.5, **kwargs)


@pytest.mark.parametrize(
    "make, refused",
    [
        (
            lambda: _masked_lm_collator(seed=42),
            "DataCollatorForLanguageModeling \\(seed=42\\) draws random numbers",
        ),
        (_OwnGenerator, "_OwnGenerator draws random numbers from a generator of its own"),
        (lambda: _masked_lm_collator(), None),
        (_NumpyMasking, None),
    ],
    ids=["hf-seeded", "own-generator", "hf-unseeded", "numpy-global"],
)
def test_a_collator_with_a_generator_of_its_own_is_refused(make, refused):
    """An audit: the MLM recipe's collator was seeded with the public args.seed, so its masks came from a
    generator that DPTrainer's secret reseed never reaches: known to anyone, and whether example 2 was sampled
    at one step changed examples 7 and 8's masks at the next. Collated twice under the same global seeds, such
    a collator's output differs; one drawing from the global generators (torch's or NumPy's) repeats."""
    features = [{"input_ids": list(range(5, 13))} for _ in range(4)]
    state = np.random.get_state()
    if refused is None:
        check_collator_is_per_example(make(), features)
    else:
        with pytest.raises(ValueError, match=refused):
            check_collator_is_per_example(make(), features)
    assert np.array_equal(np.random.get_state()[1], state[1])  # the probe leaves NumPy's stream as it was


def test_a_compute_loss_override_is_refused_not_ignored(tmp_path):
    class WeightedTrainer(DPTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            raise AssertionError("never called in training")

    with pytest.raises(TypeError, match="WeightedTrainer.compute_loss is not used to train"):
        WeightedTrainer(
            model=bert_classifier(), args=dp_args(tmp_path), train_dataset=classification_data(32)
        )
    WeightedTrainer(  # the non-private baseline trains with it
        model=bert_classifier(),
        args=dp_args(tmp_path, disable_dp=True, noise_multiplier=None),
        train_dataset=classification_data(32),
    )


@pytest.mark.parametrize("later", [None, 16, 64])
def test_a_train_dataset_set_after_construction_is_refused(tmp_path, later):
    built_with = None if later is None else classification_data(32)
    trainer = DPTrainer(
        model=bert_classifier(), args=dp_args(tmp_path, max_steps=1), train_dataset=built_with
    )
    trainer.train_dataset = classification_data(later or 32)
    with pytest.raises(ValueError, match=r"but the trainer was built (without one|with one of 32 examples)"):
        trainer.train()
    assert trainer.accountant.steps == 0


def test_a_batch_level_loss_fn_is_told_how_to_make_one_loss_per_example(tmp_path):
    import torch.nn.functional as F

    def mean_loss(outputs, labels, inputs):
        return F.cross_entropy(outputs.logits, labels)  # reduction="mean": one number for the batch

    trainer = DPTrainer(
        model=bert_classifier(),
        args=dp_args(tmp_path, max_steps=1),
        train_dataset=classification_data(32),
        per_example_loss_fn=mean_loss,
    )
    with pytest.raises(
        ValueError, match=r"must have shape \[\d+\] \(one per example\), got \(\): .*reduction='none'"
    ):
        trainer.train()
    assert trainer.accountant.steps == 0


def test_a_secure_mode_resume_warns_that_replayed_steps_get_new_noise(tmp_path):
    """Fresh OS-entropy noise cannot be replayed: steps the interrupted run took after the checkpoint are
    released again with other noise, which epsilon does not count. Without secure_mode: no warning."""
    common = dict(max_steps=2, save_strategy="steps", save_steps=1)
    data = classification_data(32)
    for secure in (True, False):
        out = tmp_path / str(secure)
        common["noise_seed"] = None if secure else 1
        DPTrainer(
            model=bert_classifier(), args=dp_args(out, secure_mode=secure, **common), train_dataset=data
        ).train()
        resumed = DPTrainer(
            model=bert_classifier(), args=dp_args(out, secure_mode=secure, **common), train_dataset=data
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed.train(resume_from_checkpoint=str(out / "checkpoint-1"))
        replayed = [w for w in caught if "taken again with new noise" in str(w.message)]
        assert len(replayed) == (1 if secure else 0)


def test_evaluating_on_the_training_set_warns(tmp_path):
    """Its metrics go to the logs, the card's evaluation table and load_best_model_at_end's choice without noise
    (an audit saw eval_loss move with one swapped training example): not covered by epsilon, so say so."""
    data, held_out = classification_data(32), classification_data(16, seed=1)
    args = dp_args(tmp_path, max_steps=1)
    with pytest.warns(UserWarning, match="eval_dataset is the training dataset"):
        DPTrainer(
            model=bert_classifier(), args=args, train_dataset=data, eval_dataset={"a": held_out, "b": data}
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        try:
            DPTrainer(model=bert_classifier(), args=args, train_dataset=data, eval_dataset=held_out)
        except UserWarning as warning:
            assert "eval_dataset is the training dataset" not in str(warning)
