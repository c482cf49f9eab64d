"""A DP step cut off between its micro-batches, then ``train()`` again on the same trainer (a notebook's retry).

The clipped sums of the step's first micro-batches stayed in the optimizer (the Trainer's ``model.zero_grad()``
does not reach them), and the next ``train()`` draws the step again from its first micro-batch: its examples
were released twice in one step (an audit measured 1.5x the step's sensitivity after a callback's stop, 1.33x
after an out-of-memory error in a later pass). Also: ``enable_jit_checkpoint`` (a checkpoint in the middle of a
step, which is then still taken) is refused, and an epoch ended early names the callback's flag.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import TrainerCallback

from dp_hf import DPTrainer, DPTrainingArguments
from tests.dp_training import bert_classifier, classification_data, dp_args, params_of

STEPS = 3


class StopOnSubstep(TrainerCallback):
    """After the first micro-batch of DP step 1: stop training, or raise (a KeyboardInterrupt in a notebook)."""

    def __init__(self, how: str) -> None:
        self.how, self.armed = how, True

    def on_substep_end(self, args, state, control, **kwargs):
        if self.armed and state.global_step == 1:
            self.armed = False
            if self.how == "stop":
                control.should_training_stop = True
            else:
                raise KeyboardInterrupt


class StopAfterStep(TrainerCallback):
    """A clean stop at the end of DP step 0 (between steps): the reference of a second train() call."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1 and not getattr(self, "done", False):
            self.done = control.should_training_stop = True


def _trainer(tmp_path, name: str, **overrides) -> DPTrainer:
    args = dp_args(
        tmp_path / name,
        max_steps=STEPS,
        noise_multiplier=0.5,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        **overrides,
    )
    return DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(64))


def _out_of_memory_in_a_later_pass(trainer: DPTrainer) -> None:
    """The second forward/backward pass of DP step 1 (one Poisson draw split by dp_max_physical_batch_size)
    raises once, as an out-of-memory error would."""
    compute = trainer.compute_per_example_losses
    passes = []

    def failing(model, inputs):
        if not trainer._probing_losses and trainer.accountant.steps == 1:
            passes.append(len(passes))
            if len(passes) == 2:
                raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return compute(model, inputs)

    trainer.compute_per_example_losses = failing


INTERRUPTIONS = {
    # name: (trainer options, how the step is cut off, the exception train() ends with)
    "callback stop between accumulated micro-batches": (
        dict(per_device_train_batch_size=4, gradient_accumulation_steps=2),
        lambda trainer: trainer.add_callback(StopOnSubstep("stop")),
        None,
    ),
    "KeyboardInterrupt between accumulated micro-batches": (
        dict(per_device_train_batch_size=4, gradient_accumulation_steps=2),
        lambda trainer: trainer.add_callback(StopOnSubstep("raise")),
        KeyboardInterrupt,
    ),
    "out of memory in a later pass of one draw": (
        dict(per_device_train_batch_size=8, dp_max_physical_batch_size=2),
        _out_of_memory_in_a_later_pass,
        torch.OutOfMemoryError,
    ),
}


@pytest.mark.parametrize("name", list(INTERRUPTIONS))
def test_train_again_after_an_interrupted_step_is_the_uninterrupted_run(tmp_path, name, caplog):
    options, interrupt, raised = INTERRUPTIONS[name]
    # The reference: stopped cleanly after DP step 0, then train() again (it takes max_steps more steps).
    whole = _trainer(tmp_path, "whole", **options)
    whole.add_callback(StopAfterStep())
    whole.train()
    assert whole.accountant.steps == 1
    whole.train()

    cut = _trainer(tmp_path, "cut", **options)
    interrupt(cut)
    if raised is None:
        cut.train()
    else:
        with pytest.raises(raised):
            cut.train()
    assert cut.accountant.steps == 1 and cut.dp_optimizer.privatizer.num_microbatches >= 1  # sums left over
    with caplog.at_level(logging.WARNING, logger="dp_hf"):
        cut.train()
    assert cut.accountant.steps == whole.accountant.steps == 1 + STEPS
    # The same batches, dropout masks and noise: bit for bit (before, the first micro-batch's examples
    # were added twice to step 1's release).
    for (param, expected), actual in zip(params_of(whole.model).items(), params_of(cut.model).values()):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=param)
    assert "DP step 1 was left unfinished by an earlier train() call" in caplog.text


def test_a_step_that_finds_unreleased_sums_is_refused(tmp_path):
    """The invariant behind the fix: a DP step's first micro-batch finds the optimizer's sums empty."""

    class Leftover(TrainerCallback):
        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            dp_optimizer = getattr(optimizer, "optimizer", optimizer)
            params = dp_optimizer.trainable_params()
            dp_optimizer.privatizer.accumulate_clipped_sum([torch.zeros_like(p) for p in params], 1)

    trainer = _trainer(tmp_path, "leftover")
    trainer.add_callback(Leftover())
    with pytest.raises(
        RuntimeError, match=r"DP step 0 begins while the optimizer holds clipped gradients of 1"
    ):
        trainer.train()
    assert trainer.accountant.steps == 0


def test_jit_checkpoints_are_refused(tmp_path):
    message = r"enable_jit_checkpoint=True is not supported with DP: .* save_steps"
    with pytest.raises(ValueError, match=message):
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, enable_jit_checkpoint=True)
    args = dp_args(tmp_path)
    args.enable_jit_checkpoint = True  # set after the arguments were checked: refused by the trainer
    with pytest.raises(ValueError, match=message):
        DPTrainer(model=bert_classifier(), args=args, train_dataset=classification_data(32))
    DPTrainingArguments(
        output_dir=str(tmp_path), disable_dp=True, enable_jit_checkpoint=True
    )  # the baseline may


def test_an_epoch_ended_early_names_the_callbacks_flag(tmp_path):
    class EndEpoch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                control.should_epoch_stop = True

    trainer = _trainer(tmp_path, "epoch", per_device_train_batch_size=16)  # 4 steps an epoch
    trainer.add_callback(EndEpoch())
    with pytest.raises(
        RuntimeError, match=r"control.should_epoch_stop ends an epoch before its last DP step"
    ):
        trainer.train()
    assert trainer.accountant.steps == 1


def test_a_second_train_call_says_how_much_epsilon_it_will_add(tmp_path, caplog):
    """A second train() on one trainer continues its run for max_steps more steps (as the Trainer does): its
    epsilon grows, and a newcomer re-running a notebook cell saw nothing but a larger number at the end."""
    from dp_hf.accounting.display import significant

    trainer = _trainer(tmp_path, "again")
    trainer.train()
    first = trainer.privacy_spent()[0]
    with caplog.at_level(logging.WARNING, logger="dp_hf"):
        trainer.train()
    assert trainer.accountant.steps == 2 * STEPS
    expected = (
        f"continues the private run of this trainer: {STEPS} more DP steps after the {STEPS} already taken, so "
        f"epsilon grows from {significant(first, 4)} to {significant(trainer.privacy_spent()[0], 4)}"
    )
    assert expected in caplog.text


@pytest.mark.parametrize("flag", ["fp16_full_eval", "bf16_full_eval"])
def test_a_model_cast_by_evaluate_before_train_is_refused(tmp_path, flag):
    """evaluate() outside train() with fp16_full_eval/bf16_full_eval casts the model in place (transformers'
    evaluation loop), and DP training then ran on float16 weights, which fp16=True is refused for (an audit of
    Trainer options). After training, evaluating so is fine."""
    trainer = _trainer(tmp_path, flag, **{flag: True})
    trainer.eval_dataset = classification_data(16, seed=3)
    trainer.evaluate()
    with pytest.raises(
        RuntimeError, match=rf"changed dtype since the trainer was built, e.g. .*torch.float32 -> .*{flag}"
    ):
        trainer.train()
    assert trainer.accountant.steps == 0
    trainer.model.float()  # cast back: trains
    trainer.train()
    assert trainer.accountant.steps == STEPS
    trainer.evaluate()  # after training: the Trainer's own business
