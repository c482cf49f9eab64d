"""Data-parallel DP training on 2 CPU processes (gloo) against 1-process references.

Two launches, each shared by several tests (module-scoped fixtures):

* ``torchrun`` runs the plain-loop scenarios of ``tests/distributed_worker.py``: DP-AdamW,
  DP-MacAdam and DP-MicroAdam used directly under an accelerate-prepared DDP model, without and
  with noise, and a measurement of the noise of the privatized gradient;
* ``accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml`` runs DPTrainer end
  to end twice (noise 0 with a fixed sampling seed; calibrated noise with the sampling seed drawn
  on rank 0).

Each rank writes its results to files; the assertions are here, against references computed in
this process by the worker's own functions.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import distributed_worker as worker
import pytest
import torch
from accelerate.utils import DistributedType

from dp_hf import DPTrainer
from dp_hf.distributed import agree_on_seed, check_data_parallel_only, check_launched_processes_joined
from dp_hf.sampling import PoissonBatchSampler

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "distributed_worker.py"
CPU_2PROC_CONFIG = REPO / "recipes" / "accelerate_configs" / "cpu_2proc.yaml"
LAUNCH_TIMEOUT_S = 300  # a deadlocked collective fails the test instead of hanging CI


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    for variable in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_MEGATRON_LM"):
        env.pop(variable, None)
    paths = [str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")]
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in paths if p),
        # accelerate's multi-process launcher does not pass `use_cpu` on to the workers; without
        # this each worker on a GPU-less machine would train alone (the worker asserts it does not).
        ACCELERATE_USE_CPU="true",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
    )
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(command: list[str]) -> None:
    try:
        done = subprocess.run(
            command,
            cwd=REPO,
            env=_worker_env(),
            capture_output=True,
            text=True,
            timeout=LAUNCH_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as error:
        tail = (error.stdout or "")[-3000:] if isinstance(error.stdout, str) else ""
        pytest.fail(f"{command} did not finish in {LAUNCH_TIMEOUT_S}s (a collective left unmatched?)\n{tail}")
    if done.returncode != 0:
        pytest.fail(f"{command} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-6000:]}")


@pytest.fixture
def one_thread():
    """References computed with one thread, as each worker rank runs (same float reductions)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def optimizer_runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("optimizers")
    _launch(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(worker.WORLD_SIZE),
            str(WORKER),
            "optimizers",
            str(out),
        ]
    )
    runs = [torch.load(out / f"optimizers_rank{r}.pt", weights_only=False) for r in range(worker.WORLD_SIZE)]
    assert [run["rank"] for run in runs] == [0, 1] and {run["world_size"] for run in runs} == {2}
    return runs


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("trainer")
    _launch(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(CPU_2PROC_CONFIG),
            "--main_process_port",
            str(_free_port()),
            str(WORKER),
            "trainer",
            str(out),
        ]
    )
    results = [json.loads((out / f"trainer_rank{r}.json").read_text()) for r in range(worker.WORLD_SIZE)]
    for label in ("exact", "private"):
        assert [r[label]["rank"] for r in results] == [0, 1]
        assert {r[label]["world_size"] for r in results} == {2}
        # The Trainer's DDP wrap really happened (and was bypassed by the DP training step).
        assert {r[label]["ddp_wrapped"] for r in results} == {"DistributedDataParallel"}
    # Both clipping paths of the Trainer: per-example gradients (exact run), ghost norms (private run).
    assert {r["exact"]["per_sample_gradient_mode"] for r in results} == {"materialize"}
    assert {r["private"]["per_sample_gradient_mode"] for r in results} == {"ghost"}
    return out, results


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


# ----------------------------------------------------------------------------- plain optimizer loop
def test_plain_loop_batches_cover_empty_shares():
    # The scenario is only meaningful if some rank has nothing to clip at some step.
    sizes = [len(selected) for selected in worker.plain_sampler().logical_batches()]
    assert 0 in sizes and 1 in sizes, sizes
    # And the ranks' shares are the logical batch, each example once.
    for step, selected in enumerate(worker.plain_sampler().logical_batches()):
        shares = [worker.rank_micro_batches(2, r, 1)[step][0] for r in range(2)]
        assert sorted(shares[0] + shares[1]) == selected.tolist()


@pytest.mark.parametrize("name", list(worker.PLAIN_OPTIMIZERS))
def test_plain_loop_two_ranks_match_one_process(optimizer_runs, one_thread, name):
    reference = worker.train_plain_loop(name, 0.0, worker.emulated_rank_micro_batches(worker.WORLD_SIZE))
    initial = dict(worker.tiny_bert_classifier(seed=0, num_labels=2).named_parameters())
    assert (
        _max_abs_diff(reference["params"], {k: v.detach() for k, v in initial.items()}) > 1e-2
    )  # it trained
    for run in optimizer_runs:
        result = run[f"{name}/exact"]
        assert result["dp_steps"] == worker.PLAIN_STEPS
        assert _max_abs_diff(result["params"], reference["params"]) <= 1e-5
        assert result["state"].keys() == reference["state"].keys()
        assert _max_abs_diff(result["state"], reference["state"]) <= 1e-5
    _assert_identical(
        optimizer_runs[0][f"{name}/exact"]["params"], optimizer_runs[1][f"{name}/exact"]["params"]
    )


@pytest.mark.parametrize("name", list(worker.PLAIN_OPTIMIZERS))
def test_plain_loop_ranks_stay_identical_with_noise(optimizer_runs, name):
    rank0, rank1 = (run[f"{name}/noisy"] for run in optimizer_runs)
    assert rank0["dp_steps"] == rank1["dp_steps"] == worker.PLAIN_STEPS
    # Bit-identical parameters after every step, and optimizer state (moments, MacAdam's clip
    # geometry, MicroAdam's error feedback codes and top-k window) at the end.
    assert rank0["step_digests"] == rank1["step_digests"]
    _assert_identical(rank0["params"], rank1["params"])
    _assert_identical(rank0["state"], rank1["state"])
    # The noise did change the trajectory (against the noise-0 run from the same start).
    assert rank0["step_digests"][-1] != optimizer_runs[0][f"{name}/exact"]["step_digests"][-1]


def test_noise_enters_once(optimizer_runs):
    expected = worker.NOISE_SIGMA * worker.NOISE_CLIP / worker.NOISE_EXPECTED_BATCH
    rank0, rank1 = (run["noise"] for run in optimizer_runs)
    assert rank0["grad_digests"] == rank1["grad_digests"]  # one gtilde on every rank
    # 2^17 coordinates x 4 steps: the estimate is within ~0.2%; sqrt(2)x (noise from both ranks)
    # or 0 (from none) would be far off.
    assert rank0["std"] == pytest.approx(expected, rel=0.02)


# ----------------------------------------------------------------------------- DPTrainer
def test_trainer_two_ranks_match_one_process(trainer_runs, one_thread, tmp_path):
    out, results = trainer_runs
    exact = [r["exact"] for r in results]
    params = [torch.load(out / f"trainer_exact_params_rank{r}.pt") for r in range(worker.WORLD_SIZE)]
    _assert_identical(params[0], params[1])
    assert exact[0]["step_digests"] == exact[1]["step_digests"]
    assert {e["global_step"] for e in exact} == {e["optimizer_steps"] for e in exact} == {10}
    # Seed 33 leaves rank 1 with one empty micro-batch at one step and nothing at another.
    assert exact[1]["micro_batches"]["empty"] >= 3
    assert {e["sampling_seed"] for e in exact} == {33}

    args = worker.trainer_args(
        str(tmp_path), per_device_train_batch_size=2 * worker.EXACT_PER_DEVICE_2PROC, **worker.EXACT_RUN
    )
    assert args.expected_batch_size == exact[0]["expected_batch_size"]
    reference = DPTrainer(
        model=worker.tiny_bert_classifier(seed=0, num_labels=2),
        args=args,
        train_dataset=worker.trainer_dataset(),
    )
    initial = {n: p.detach().clone() for n, p in reference.model.named_parameters()}
    reference.train()
    final = {n: p.detach() for n, p in reference.model.named_parameters()}
    assert _max_abs_diff(final, initial) > 1e-2
    assert _max_abs_diff(params[0], final) <= 1e-5
    # The token count gathered over ranks (empty micro-batches included) is the whole batch's.
    assert {e["num_input_tokens_seen"] for e in exact} == {reference.state.num_input_tokens_seen}


def test_trainer_private_run_is_identical_on_ranks_and_accounts_as_one_process(trainer_runs, tmp_path):
    out, results = trainer_runs
    private = [r["private"] for r in results]
    # The sampling seed was drawn from OS entropy on rank 0 and shared.
    assert private[0]["sampling_seed"] == private[1]["sampling_seed"]
    assert private[0]["step_digests"] == private[1]["step_digests"]
    params = [torch.load(out / f"trainer_private_params_rank{r}.pt") for r in range(worker.WORLD_SIZE)]
    _assert_identical(params[0], params[1])
    steps = private[0]["accountant_steps"]
    assert {p["global_step"] for p in private} == {p["optimizer_steps"] for p in private} == {steps}
    assert steps >= 4

    # The same logical batch on one process: same sample rate, calibrated noise and epsilon.
    args = worker.trainer_args(
        str(tmp_path), per_device_train_batch_size=2 * worker.PRIVATE_PER_DEVICE_2PROC, **worker.PRIVATE_RUN
    )
    single = DPTrainer(
        model=worker.tiny_bert_classifier(seed=0, num_labels=2),
        args=args,
        train_dataset=worker.trainer_dataset(),
    )
    for _ in range(steps):
        single.accountant.step(single.noise_multiplier, single.sample_rate)
    epsilon, delta = single.privacy_spent()
    for p in private:
        assert p["expected_batch_size"] == args.expected_batch_size
        assert p["sample_rate"] == single.sample_rate
        assert p["noise_multiplier"] == single.noise_multiplier
        assert p["epsilon"] == pytest.approx(epsilon, rel=1e-12)
        assert p["delta"] == delta
        assert p["epsilon"] <= args.target_epsilon
    assert private[0]["logged_epsilons"] == private[1]["logged_epsilons"]


# ----------------------------------------------------------------------------- refusals, seeds
def test_ranks_must_hold_the_same_dataset(trainer_runs):
    # A dataset shuffled per rank trained one example on both ranks in one step (2C of influence); a
    # per-rank shard was accounted with the shard's N. Both were silent.
    _, results = trainer_runs
    for agreement in (r["agreement"] for r in results):
        assert "rows differ" in agreement["rank_shuffled"] and "same sizes" in agreement["rank_shuffled"]
        assert "sizes [64, 64]" in agreement["rank_shuffled"]
        assert "sizes [32, 32]" in agreement["rank_shard"] and "rows differ" in agreement["rank_shard"]
        assert "rows differ" in agreement["spread_rows_kept"]  # only 16 evenly spread rows were compared
        assert "rows differ" in agreement["reordered_after_init"]  # compared again when train() begins
        # a row unreadable on one rank: both ranks refuse, naming it (rank 0 does not hang in the gather)
        assert "failed on rank 1: OSError: shard file missing" in agreement["rank_unreadable"]
        assert agreement["same_images"] is None  # refused as "differs across the 2 ranks" before
        assert agreement["random_transform"] is None and agreement["random_state_kept"]


def test_ranks_must_share_the_privacy_settings(trainer_runs):
    # Per-rank batch sizes trained examples on both ranks or neither; per-rank clip norms let one example
    # move rank 0's released update 91.6x its bound. Both were silent: every rank refuses, naming each value.
    _, results = trainer_runs
    for found in (r["plan_agreement"] for r in results):
        assert "privacy settings differ across the 2 ranks" in found["batch"]
        assert "per_device_train_batch_size (rank 0: 2, rank 1: 4)" in found["batch"]
        assert "sample_rate (rank 0: 0.0625, rank 1: 0.125)" in found["batch"]
        assert "launch every process with the same arguments" in found["batch"]
        assert "per_sample_max_grad_norm (rank 0: 0.01, rank 1: 1.0)" in found["clip"]
        assert "max_grad_norm (rank 0: 0.01, rank 1: 1.0)" in found["clip"]
        assert "noise_multiplier (rank 0: " in found["calibrated"]  # compared after calibration
        assert "delta (rank 0: 0.001, rank 1: 0.0001)" in found["calibrated"]
        assert "disable_dp differs across the 2 ranks (rank 0: False, rank 1: True)" in found["disable_dp"]
        trainable = found["trainable"]  # one tensor frozen on rank 1 only
        assert trainable is not None and "trainable tensors (rank 0: '" in trainable
        assert re.search(r"rank 0: '(\d+) tensors, \w+', rank 1: '(\d+) tensors", trainable)
    # The rank whose plan failed says why; the other refuses instead of waiting in the collective.
    refused = results[0]["plan_agreement"]["rank_fails"]
    assert "the privacy plan could not be made on rank 1: ValueError: expected logical batch" in refused
    assert "exceeds the dataset size" in results[1]["plan_agreement"]["rank_fails"]


def test_a_hand_built_optimizer_that_does_not_reduce_over_ranks_is_refused(trainer_runs):
    # distributed=False with sigma and B as planned was accepted: no all-reduce, each rank its own noise.
    _, results = trainer_runs
    for found in (r["plan_agreement"] for r in results):
        assert "disagrees with the privacy plan" in found["local_optimizer"]
        assert "distributed=False on 2 processes" in found["local_optimizer"]
        assert found["local_optimizer_steps"] == 0


def test_ranks_resumed_from_different_points_are_refused_before_training(trainer_runs):
    """Rank 0 resumes from checkpoint-2, rank 1 starts afresh: every release would sum rank 0's share of one
    Poisson step with rank 1's share of another (an example in both counts twice). Both refuse at train()."""
    _, results = trainer_runs
    for found in (r["progress_agreement"] for r in results):
        refused = found["mixed_resume"]
        assert refused is not None and "the ranks are at different points of the run" in refused
        assert "optimizer DP step (rank 0: 2, rank 1: 0)" in refused
        assert "resuming from a checkpoint (rank 0: True, rank 1: False)" in refused
        assert "Resume every rank from the same checkpoint" in refused
        assert "seed (" not in refused  # a digest of the secret seed is compared, never shown as a seed
        assert found["same_resume"] is None and found["same_resume_steps"] == 4
    assert [r["progress_agreement"]["mixed_resume_steps"] for r in results] == [2, 0]  # nothing released


def test_a_release_of_different_steps_on_the_ranks_is_refused_on_both(optimizer_runs):
    """The per-release check behind the train-start one: optimizers at DP steps 3 and 0 refuse their
    all-reduce together (no rank left waiting), before the update (off CUDA)."""
    for run in optimizer_runs:
        found = run["mixed_steps"]
        assert found["error"] is not None and "released different DP steps" in found["error"]
        assert (
            "rank 0: step 3, rank 1: step 0" in found["error"] and "No update was applied" in found["error"]
        )
        assert found["unchanged"]


def test_shuffled_batches_on_two_ranks_never_repeat_an_example_in_an_epoch(trainer_runs):
    _, results = trainer_runs
    agreements = [r["agreement"] for r in results]
    for agreement in agreements:
        assert (
            "dataloader_drop_last=True" in agreement["shuffled"] and "trained twice" in agreement["shuffled"]
        )
    runs = [a["shuffled_drop_last"] for a in agreements]
    trained = runs[0]["trained_indices"] + runs[1]["trained_indices"]
    # 17 batches of 4: each rank trains 8 (4 steps of 2 micro-batches), the 17th batch is left out.
    assert len(trained) == len(set(trained)) == 64
    assert {r["planned_steps"] for r in runs} == {r["global_step"] for r in runs} == {4}


def test_sharded_training_is_refused(monkeypatch, tmp_path):
    for engine in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, "fsdp"):
        with pytest.raises(ValueError, match="not supported by dp_hf"):
            check_data_parallel_only(engine)
    for engine in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, None):
        check_data_parallel_only(engine)

    # The accelerate-config route: `accelerate launch` with an FSDP config exports this variable.
    args = worker.trainer_args(
        str(tmp_path), per_device_train_batch_size=4, max_steps=1, noise_multiplier=1.0
    )
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="FSDP is not supported by dp_hf"):
        DPTrainer(
            model=worker.tiny_bert_classifier(seed=0, num_labels=2),
            args=args,
            train_dataset=worker.trainer_dataset(),
        )


def test_a_launched_process_that_trains_alone_is_refused(monkeypatch, tmp_path):
    """accelerate's multi-GPU launcher on a machine without GPUs and without use_cpu: each of the processes
    saw a world of 1 and ran its own training on the same data, each with its own privacy claim."""
    check_launched_processes_joined(1)  # not launched
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_launched_processes_joined(2)  # launched, and joined
    with pytest.raises(ValueError, match="WORLD_SIZE=2 processes, but the Trainer sees a world of 1"):
        check_launched_processes_joined(1)
    if torch.cuda.is_available():
        return  # without use_cpu, accelerate would set up a process group on the GPUs
    args = worker.trainer_args(
        str(tmp_path), per_device_train_batch_size=4, max_steps=1, noise_multiplier=1.0, use_cpu=False
    )
    with pytest.raises(ValueError, match="set use_cpu=True"):
        DPTrainer(
            model=worker.tiny_bert_classifier(seed=0, num_labels=2),
            args=args,
            train_dataset=worker.trainer_dataset(),
        )


def test_seed_agreement_without_a_process_group():
    assert agree_on_seed(7) == 7
    drawn = agree_on_seed(None)
    assert isinstance(drawn, int) and drawn != agree_on_seed(None)
    # Replicas cannot share an OS-entropy seed without a process group: refuse instead of letting
    # each draw its own mask.
    with pytest.raises(ValueError, match="same secret seed"):
        PoissonBatchSampler(dataset_size=10, sample_rate=0.5, num_replicas=2, rank=1)
    assert PoissonBatchSampler(dataset_size=10, sample_rate=0.5, num_replicas=2, rank=1, seed=3).seed == 3
