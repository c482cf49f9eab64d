"""Padding-free DP SFT: each example a segment of one packed row, clipped alone (offline, CPU, tiny Llama)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # noqa: E402

from dp_hf import DPSFTTrainer  # noqa: E402
from dp_hf.batches import check_batch_is_per_example  # noqa: E402
from dp_hf.per_example.ghost import attach_fast_clipping  # noqa: E402
from dp_hf.per_example.ghost.segments import find_segments, split_segments  # noqa: E402
from dp_hf.privatizer import Geometry  # noqa: E402
from dp_hf.sft import sft_per_example_losses  # noqa: E402
from recipes.smoke import chat_tokenizer, chats_like  # noqa: E402
from tests.test_sft import lora_config, prompt_completion, sft_args, tiny_llama  # noqa: E402
from tests.tiny_models import SquaredRMSNorm  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def full_llama(tokenizer):
    """Full fine-tuning, RMSNorm weights included (hook mode, per segment), moved off their init of ones."""
    model = tiny_llama(tokenizer)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=generator))
    return model


def examples(n: int, vocab: int, seed: int = 0, lengths=None) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = lengths[i] if lengths else int(torch.randint(2, 12, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        labels = [-100 if j < length // 3 else t for j, t in enumerate(ids)]  # a "prompt" outside the loss
        out.append({"input_ids": ids, "labels": labels})
    return out


def collate(pad: int, items: list[dict], packed: bool) -> dict:
    return DataCollatorForLanguageModeling(pad_token_id=pad, padding_free=packed)(items)


def clipped(model, clipping, batch: dict, packed: bool, max_grad_norm: float, reduction: str = "mean"):
    """(sums, norms, losses) of one micro-batch through the fast path, packed or one padded row each."""
    model.train()
    segments = find_segments(batch["position_ids"]) if packed else None
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with clipping.packed(segments):
        logits = model(**inputs, use_cache=False).logits
    losses, _, _ = sft_per_example_losses(logits, batch["labels"], reduction=reduction, segments=segments)
    losses.sum().backward()
    params = [p for p in model.parameters() if p.requires_grad]
    sums, norms = clipping.clipped_sum(params, Geometry(max_grad_norm))
    return sums, norms, losses.detach()


def peft_llama(tokenizer):
    from peft import get_peft_model

    return get_peft_model(tiny_llama(tokenizer), lora_config())


# ------------------------------------------------------------------ the model: no attention across segments


def test_packed_segments_do_not_attend_to_each_other(tokenizer):
    model = tiny_llama(tokenizer).eval()
    pad, vocab = tokenizer.pad_token_id, len(tokenizer)
    items = examples(3, vocab, seed=1, lengths=[5, 1, 7])
    changed = [items[0], examples(1, vocab, seed=2, lengths=[4])[0], items[2]]
    with torch.no_grad():
        a = model(
            **{k: v for k, v in collate(pad, items, True).items() if k != "labels"}, use_cache=False
        ).logits
        b = model(
            **{k: v for k, v in collate(pad, changed, True).items() if k != "labels"}, use_cache=False
        ).logits
        alone = model(input_ids=torch.tensor([items[2]["input_ids"]]), use_cache=False).logits
    torch.testing.assert_close(a[0, 6:], b[0, 9:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a[0, 6:], alone[0], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ exactness of the clipped sum


@pytest.mark.parametrize(
    "mode, layer_strategy",
    [("ghost", "auto"), ("ghost", "ghost"), ("ghost", "materialize"), ("materialize", "auto")],
)
@pytest.mark.parametrize("lora", [False, True])
def test_packed_clipped_sum_equals_unpacked(tokenizer, lora, mode, layer_strategy):
    pad, vocab = tokenizer.pad_token_id, len(tokenizer)
    items = examples(5, vocab, seed=3)
    results = {}
    for packed in (False, True):
        model = peft_llama(tokenizer) if lora else full_llama(tokenizer)
        clipping = attach_fast_clipping(model, mode=mode, layer_strategy=layer_strategy)
        _, norms, _ = clipped(model, clipping, collate(pad, items, False), False, 1e9)  # unclipped norms
        max_grad_norm = float(norms.median())  # clipping active for about half of the examples
        results[packed] = clipped(model, clipping, collate(pad, items, packed), packed, max_grad_norm)
        clipping.remove()
    (sums, norms, losses), (psums, pnorms, plosses) = results[False], results[True]
    assert pnorms.shape == (5,) and bool((norms > norms.median()).any())
    assert (
        lora or sum("norm" in n for n, p in model.named_parameters() if p.requires_grad) == 5
    )  # all trained
    torch.testing.assert_close(plosses, losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pnorms, norms, rtol=1e-5, atol=1e-7)
    for s, p in zip(sums, psums):
        scale = float(s.abs().max()) + 1e-12
        torch.testing.assert_close(p, s, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_packed_norm_of_one_example_ignores_the_others(tokenizer, reduction):
    pad, vocab = tokenizer.pad_token_id, len(tokenizer)
    model = full_llama(tokenizer)
    clipping = attach_fast_clipping(model)
    items = examples(4, vocab, seed=4)
    longer = examples(1, vocab, seed=5, lengths=[11])[0]
    _, norms, _ = clipped(model, clipping, collate(pad, items, True), True, 1.0, reduction)
    changed = [items[0], longer, items[2], items[3]]
    _, other, _ = clipped(model, clipping, collate(pad, changed, True), True, 1.0, reduction)
    torch.testing.assert_close(other[[0, 2, 3]], norms[[0, 2, 3]], rtol=1e-5, atol=1e-7)
    _, alone, _ = clipped(model, clipping, collate(pad, items[2:3], True), True, 1.0, reduction)
    torch.testing.assert_close(alone[0], norms[2], rtol=1e-5, atol=1e-7)
    assert torch.all(norms > 0)


# ------------------------------------------------------------------ the Poisson machinery


def test_packed_batch_checks(tokenizer):
    pad, vocab = tokenizer.pad_token_id, len(tokenizer)
    items = examples(3, vocab, seed=6)
    batch = collate(pad, items, True)
    check_batch_is_per_example(batch, 3, packed=True)
    with pytest.raises(ValueError, match="packs examples"):
        check_batch_is_per_example(batch, 3)  # a trainer that does not clip segments refuses it
    with pytest.raises(ValueError, match="3 segments in the packed rows for 2 sampled examples"):
        check_batch_is_per_example(batch, 2, packed=True)  # dataset-level packing: rows != examples
    bad = dict(batch, cu_seq_lens_q=batch["cu_seq_lens_q"].flip(0))
    with pytest.raises(ValueError, match="cu_seq_lens_q does not match"):
        check_batch_is_per_example(bad, 3, packed=True)
    shifted = dict(batch, position_ids=batch["position_ids"] + 1)
    with pytest.raises(ValueError, match="do not start at 0"):
        check_batch_is_per_example(shifted, 3, packed=True)
    # split between whole segments, each piece a valid packed batch of its own examples
    pieces = split_segments(batch, 2)
    assert [find_segments(p["position_ids"]).num_segments for p in pieces] == [2, 1]
    for piece, n in zip(pieces, (2, 1)):
        check_batch_is_per_example(piece, n, packed=True)
    torch.testing.assert_close(torch.cat([p["input_ids"] for p in pieces], 1), batch["input_ids"])


# ------------------------------------------------------------------ DPSFTTrainer


def test_padding_free_training_logs_epsilon(tmp_path, tokenizer):
    trainer = DPSFTTrainer(
        model=tiny_llama(tokenizer),
        args=sft_args(
            tmp_path, padding_free=True, max_length=None, noise_multiplier=None, target_epsilon=4.0
        ),
        train_dataset=chats_like(128, 0),
        processing_class=tokenizer,
        peft_config=lora_config(),
    )
    assert trainer.packed_examples
    trainer.train()
    epsilon, _ = trainer.privacy_spent()
    assert 0 < epsilon <= 4.0 and trainer.accountant.steps == 4
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 4 and all(
        0 < e["epsilon"] <= 4.0 and torch.isfinite(torch.tensor(e["loss"])) for e in logged
    )


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(input_ids=[]), "has no tokens"),  # packs to no segment
        (dict(seq_lengths=[2, 4]), "seq_lengths=[2, 4] for 6 tokens"),  # the collator would cut it in two
        (dict(seq_lengths=[9]), "seq_lengths=[9] for 6 tokens"),
    ],
    ids=["empty", "split", "overlong"],
)
def test_padding_free_refuses_a_row_that_is_not_one_segment_before_training(
    tmp_path, tokenizer, bad, message
):
    """The per-batch check would stop the run only at the first step that samples the row (a stop that
    depends on that example, found by an audit: step 2 of 4 here); every row is checked when the trainer
    is built instead, also far past the rows the collator probe reads. Consistent seq_lengths pass."""
    from datasets import Dataset

    ids = [[5 + (i + j) % 20 for j in range(3 + i % 5)] for i in range(16)]
    rows = dict(input_ids=ids, seq_lengths=[[len(x)] for x in ids])

    def trainer(dataset):
        return DPSFTTrainer(
            model=tiny_llama(tokenizer),
            args=sft_args(tmp_path, padding_free=True, max_length=None),
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=lora_config(),
        )

    assert trainer(Dataset.from_dict(rows)).packed_examples
    rows["input_ids"][15] = list(range(5, 11))
    rows["seq_lengths"][15] = [6]
    for key, value in bad.items():
        rows[key][15] = value
    if "input_ids" in bad:
        rows["seq_lengths"][15] = [0]
    with pytest.raises(ValueError, match=rf"row 15 .*{message}".replace("[", r"\[").replace("]", r"\]")):
        trainer(Dataset.from_dict(rows))
    with pytest.raises(ValueError, match="row 15"):  # a select() of the dataset: the row's own index
        trainer(Dataset.from_dict(rows).select(range(16)))


def test_padding_free_finds_each_micro_batchs_segments_once(tmp_path, tokenizer, monkeypatch):
    """The step, the clipping and the losses share one ``find_segments`` per micro-batch (it reads
    the positions on the host: on a GPU, a synchronization each time)."""
    import dp_hf.per_example.ghost.segments as segments_module

    found, real, in_step = [], segments_module.segments_of, []

    def counted(position_ids):
        if in_step:  # the trainer's step (not the sampler's check of each collated batch)
            found.append(position_ids)
        return real(position_ids)

    monkeypatch.setattr(segments_module, "segments_of", counted)
    trainer = DPSFTTrainer(
        model=tiny_llama(tokenizer),
        args=sft_args(tmp_path, padding_free=True, max_length=None, max_steps=3),
        train_dataset=chats_like(64, 0),
        processing_class=tokenizer,
        peft_config=lora_config(),
    )
    positions, losses_of = [], trainer.compute_per_example_losses

    def recording(model, inputs):
        positions.append(inputs["position_ids"])
        return losses_of(model, inputs)

    def step(*args, **kwargs):
        in_step.append(1)
        try:
            return step_of(*args, **kwargs)
        finally:
            in_step.clear()

    trainer.compute_per_example_losses, step_of, trainer.training_step = (
        recording,
        trainer.training_step,
        step,
    )
    trainer.train()
    assert positions
    assert all(sum(p is q for q in found) == 1 for p in positions)


@pytest.mark.parametrize("lora", [False, True])
def test_padding_free_trains_like_padded(tmp_path, tokenizer, lora):
    def run(output_dir, **options):
        model = tiny_llama(tokenizer) if lora else full_llama(tokenizer)
        trainer = DPSFTTrainer(
            model=model,
            args=sft_args(output_dir, max_length=None, max_steps=3, noise_multiplier=0.3, **options),
            train_dataset=prompt_completion(48, 0),
            processing_class=tokenizer,
            peft_config=lora_config() if lora else None,
        )
        trainer.train()
        return trainer

    padded = run(tmp_path / "padded")
    packed = run(tmp_path / "packed", padding_free=True)
    # the physical cap splits the packed row between whole segments: the same steps again
    split = run(tmp_path / "split", padding_free=True, dp_max_physical_batch_size=3)
    assert padded.privacy_spent() == packed.privacy_spent() == split.privacy_spent()
    before = (tiny_llama(tokenizer) if lora else full_llama(tokenizer)).state_dict()
    moved = False
    for (name, p), q, r in zip(
        padded.model.named_parameters(), packed.model.parameters(), split.model.parameters()
    ):
        # Packed and padded rows sum the same products in another order. Adam turns that rounding into
        # up to ~1e-6 where a coordinate's gradient is near 0 (one weight of 32k, for some sampling
        # seeds); a lost or doubled segment would move whole rows by ~lr = 1e-2.
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(r, p, rtol=1e-5, atol=1e-5, msg=name)
        key = name.replace("base_model.model.", "")
        moved |= key in before and p.requires_grad and not torch.equal(p.detach(), before[key])
        assert lora or "norm" not in name or not torch.equal(p.detach(), before[key]), name  # norms trained
    assert moved or lora


# ------------------------------------------------------------------ refused


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_dataset_packing_is_refused_with_the_alternative(tmp_path, strategy):
    with pytest.raises(ValueError, match="padding_free=True") as err:
        sft_args(tmp_path, packing=True, packing_strategy=strategy)
    assert "Poisson sampling would draw fixed groups of examples" in str(err.value)


def test_padding_free_full_fine_tuning_takes_the_fast_path(tmp_path, tokenizer):
    trainer = DPSFTTrainer(
        model=tiny_llama(tokenizer),  # every parameter trainable, RMSNorm weights included
        args=sft_args(tmp_path, padding_free=True, max_length=None),
        train_dataset=chats_like(16, 0),
        processing_class=tokenizer,
    )
    assert trainer.packed_examples and trainer.fast_clipping is not None
    assert trainer.per_sample_gradient_mode == "ghost"


def test_padding_free_refused_without_the_fast_path(tmp_path, tokenizer):
    # a trainable module without a fast rule: only Opacus's per-row hooks handle it
    model = tiny_llama(tokenizer)
    model.model.norm = SquaredRMSNorm(model.config.hidden_size)
    with pytest.raises(ValueError, match="SquaredRMSNorm") as err:
        DPSFTTrainer(
            model=model,
            args=sft_args(tmp_path, padding_free=True, max_length=None),
            train_dataset=chats_like(16, 0),
            processing_class=tokenizer,
        )
    assert "padding_free=False" in str(err.value)
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        sft_args(tmp_path, padding_free=True, max_length=None, pad_to_multiple_of=8)
    # trl refuses this too, but suggests packing, which DP training refuses: the loop is cut here
    with pytest.raises(ValueError, match="padding_free=True with max_length=32: .* Set max_length=None"):
        sft_args(tmp_path, padding_free=True, max_length=32)
    with pytest.raises(TypeError, match="per_example_loss_fn"):
        DPSFTTrainer(
            model=tiny_llama(tokenizer),
            args=sft_args(tmp_path, padding_free=True, max_length=None),
            train_dataset=chats_like(16, 0),
            processing_class=tokenizer,
            per_example_loss_fn=lambda outputs, labels, inputs: outputs.logits.sum((1, 2)),
        )


def test_packed_losses_never_cross_a_segment_boundary(tokenizer):
    # labels without trl's -100 at each segment start: the last token of a segment must still not be
    # trained to predict the first token of the next one
    model = tiny_llama(tokenizer).eval()
    items = [dict(e, labels=list(e["input_ids"])) for e in examples(3, len(tokenizer), seed=7)]
    packed = collate(tokenizer.pad_token_id, items, True)
    padded = collate(tokenizer.pad_token_id, items, False)
    packed["labels"] = torch.cat([torch.tensor(e["input_ids"]) for e in items])[None]
    segments = find_segments(packed["position_ids"])
    with torch.no_grad():
        logits = model(
            input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False
        ).logits
        reference = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
    for reduction in ("mean", "sum"):
        losses, _, mask = sft_per_example_losses(logits, packed["labels"], reduction, segments=segments)
        expected, _, _ = sft_per_example_losses(reference, padded["labels"], reduction)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
        assert int(mask.sum()) == sum(len(e["input_ids"]) - 1 for e in items)


def test_model_attending_across_segments_is_refused(tokenizer, monkeypatch):
    import transformers.masking_utils

    from dp_hf.sft import check_model_separates_segments

    model = tiny_llama(tokenizer)
    check_model_separates_segments(model)
    assert model.training  # its mode is restored
    # a model that ignores the restarts of position_ids: one causal mask over the whole packed row
    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(ValueError, match="attend to the previous example"):
        check_model_separates_segments(model)


def test_find_segments_remembers_only_an_unmodified_tensor():
    positions = torch.tensor([[0, 1, 2, 3, 4, 5]])
    first = find_segments(positions)
    assert find_segments(positions) is first and first.num_segments == 1
    positions[0, 3:] = torch.arange(3)  # in place: a new segment starts at token 3
    assert find_segments(positions).num_segments == 2
    assert find_segments(positions.clone()).num_segments == 2  # another tensor: found again
