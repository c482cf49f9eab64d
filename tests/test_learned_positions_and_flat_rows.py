"""Full fine-tuning of OPT and BART on the fast path: learned position embeddings and flattened token rows.

* OPT's and BART's ``embed_positions`` compute their ids in their own forward (OPT: per example, from the
  attention mask) and look them up once (dp_hf.per_example.positions routes that lookup to the recording).
* OPT's MLP runs on ``hidden_states.reshape(-1, H)``: ``[B*T, H]`` rows, accepted only with a verified
  provenance (dp_hf.per_example.flat_rows) and recorded as ``[B, T, H]``.

The reference is a loop of plain autograd, one example at a time: the fast path's per-example norms and
clipped sums (ghost and materialize) must equal it, with left and right padding. Flattened rows whose order
is not example-major (a transpose, a gather) or that a non-unary op mixes before a Linear are refused.
Mutations checked to fail these tests: viewing the flattened rows as ``[T, B, ...]``, accepting any leading
dimension that is a multiple of ``B``, and dropping the unary-op walk's node check.
"""

from __future__ import annotations

import warnings

import datasets
import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn

from dp_hf import DPTrainer
from dp_hf.per_example import attach_fast_clipping, attach_grad_sample
from dp_hf.per_example.errors import PerSampleGradientError
from dp_hf.per_example.ghost.support import native_kind, unsupported_modules
from dp_hf.per_example.positions import is_learned_position_embedding
from dp_hf.privatizer import Geometry
from tests.dp_training import Gain, one_sgd_step_args

B, T, VOCAB, H = 3, 7, 50, 16  # B != T: a [T, B, ...] view of the rows would misattribute them
NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


def tiny_opt() -> nn.Module:
    torch.manual_seed(0)
    config = tf.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=24,
        word_embed_proj_dim=H,
        max_position_embeddings=32,
        pad_token_id=1,
        layerdrop=0.0,
        **NO_DROPOUT,
    )
    return tf.OPTForCausalLM(config).train()


def tiny_bart() -> nn.Module:
    torch.manual_seed(0)
    config = tf.BartConfig(
        vocab_size=VOCAB,
        d_model=H,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        max_position_embeddings=32,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        **NO_DROPOUT,
    )
    return tf.BartForConditionalGeneration(config).train()


def text_batch(batch: int, padding: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids with lengths T, T-3, T-1, ... padded on ``padding`` ("left", "right" or "none")."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (batch, T), generator=g)
    mask = torch.ones(batch, T, dtype=torch.long)
    if padding != "none":
        for i in range(batch):
            pad = (0, 3, 1, 2)[i % 4]
            if pad:
                (mask[i, :pad] if padding == "left" else mask[i, T - pad :]).zero_()
    ids = ids.masked_fill(mask == 0, 1)
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def opt_losses(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], reduction="none").sum(1)


def bart_batch(batch: dict) -> dict:
    """``batch`` with targets other than the source (its ids reversed) and BART's decoder inputs for them."""
    labels = batch["labels"].flip(1)
    decoder_input_ids = tf.models.bart.modeling_bart.shift_tokens_right(labels, 1, 2)
    return {**batch, "labels": labels, "decoder_input_ids": decoder_input_ids}


def bart_losses(model: nn.Module, batch: dict) -> torch.Tensor:
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "decoder_input_ids")}
    logits = model(**inputs).logits
    return F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none").sum(1)


class FlatMLP(nn.Module):
    """Embedding -> ``[B*T, H]`` rows (made as ``how`` says) -> LayerNorm -> Linear -> (mix) -> ReLU -> Linear."""

    def __init__(self, how: str = "reshape") -> None:
        super().__init__()
        self.how = how
        self.embed = nn.Embedding(VOCAB, H)
        self.norm = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, 24)
        self.fc2 = nn.Linear(24, H)
        self.head = nn.Linear(H, 3)

    def forward(self, input_ids: torch.Tensor) -> dict:
        h = self.embed(input_ids)
        batch, length, width = h.shape
        if self.how == "transpose":  # sequence-major rows: example i's tokens are strided
            flat = h.transpose(0, 1).reshape(-1, width)
        elif self.how == "transpose-contiguous":
            flat = h.transpose(0, 1).contiguous().view(-1, width)
        elif self.how == "gather":  # a token subset of exactly B*T rows (here: all, shifted by one)
            flat = h.reshape(-1, width)[torch.arange(batch * length).roll(1)]
        else:
            flat = h.reshape(-1, width)
        z = self.fc1(self.norm(flat))
        if self.how == "roll":
            z = z.roll(1, dims=0)
        elif self.how == "matmul":
            z = torch.ones(z.shape[0], z.shape[0]) @ z / z.shape[0]
        elif self.how == "product":
            z = z * z.flip(0)
        z = self.fc2(F.relu(z))
        if self.how.startswith("transpose"):
            z = z.view(length, batch, width).transpose(0, 1)
        return {"logits": self.head(z.view(batch, length, width).mean(1))}


def flat_mlp_losses(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(
        model(batch["input_ids"])["logits"], batch["input_ids"][:, 0] % 3, reduction="none"
    )


def tiny_flat_mlp() -> nn.Module:
    torch.manual_seed(0)
    return FlatMLP()


CASES = {  # name -> (model factory, per-example losses, padding)
    "opt-right-padded": (tiny_opt, opt_losses, "right"),
    "opt-left-padded": (tiny_opt, opt_losses, "left"),
    "bart-padded": (tiny_bart, bart_losses, "right"),
    "flat-mlp": (tiny_flat_mlp, flat_mlp_losses, "none"),
}


def trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def loop_gradients(factory, losses, batch: dict) -> torch.Tensor:
    """``[B, d]``: each example's gradient alone (plain autograd, a batch of one)."""
    model, rows = factory(), []
    for i in range(batch["input_ids"].shape[0]):
        example = {k: v[i : i + 1] for k, v in batch.items()}
        grads = torch.autograd.grad(losses(model, example).sum(), trainable(model), allow_unused=True)
        rows.append(
            torch.cat(
                [(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(grads, trainable(model))]
            )
        )
    return torch.stack(rows).double()


def fast_clipped(factory, losses, batch: dict, mode: str, clip: float):
    model = factory()
    clipping = attach_fast_clipping(model, mode=mode)
    try:
        losses(model, batch).sum().backward()
        sums, norms = clipping.clipped_sum(trainable(model), Geometry(clip))
    finally:
        clipping.remove()
    return torch.cat([s.flatten() for s in sums]).double(), norms.double()


def test_the_learned_position_embeddings_are_recognised():
    opt, bart = tiny_opt(), tiny_bart()
    for module in (opt.model.decoder.embed_positions, bart.model.encoder.embed_positions):
        assert is_learned_position_embedding(module) and native_kind(module) == "embedding"
    assert unsupported_modules(opt) == [] and unsupported_modules(bart) == []
    assert not is_learned_position_embedding(nn.Embedding(4, 2))
    blenderbot = tf.models.blenderbot.modeling_blenderbot.BlenderbotLearnedPositionalEmbedding(8, 4)
    assert not is_learned_position_embedding(blenderbot)  # 1-D [T] ids, no batch dimension: refused


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("name", list(CASES))
def test_per_example_gradients_match_a_loop_of_single_examples(name, mode):
    factory, losses, padding = CASES[name]
    batch = text_batch(B, padding)
    batch = bart_batch(batch) if losses is bart_losses else batch
    reference = loop_gradients(factory, losses, batch)
    ref_norms = reference.norm(dim=1)
    assert (ref_norms > 0).all()
    clip = float(ref_norms.sort().values[1])  # some examples clipped, some not
    factors = (clip / ref_norms).clamp(max=1.0)
    sums, norms = fast_clipped(factory, losses, batch, mode, clip)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(sums, (factors[:, None] * reference).sum(0), rtol=1e-4, atol=1e-6)


REFUSED = {  # FlatMLP variant -> the layer refused
    "transpose": "norm",
    "transpose-contiguous": "norm",
    "gather": "norm",
    "roll": "fc2",
    "matmul": "fc2",
    "product": "fc2",
}


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("how", list(REFUSED))
def test_rows_not_example_major_or_mixed_are_refused(how, mode):
    model = FlatMLP(how)
    clipping = attach_fast_clipping(model, mode=mode, probe_batch_dimensions=False)
    try:
        with pytest.raises(
            PerSampleGradientError, match=rf"{REFUSED[how]} \(\w+\) received an input with leading"
        ):
            flat_mlp_losses(model, text_batch(B, "none")).sum().backward()
    finally:
        clipping.remove()


def test_opacus_hooks_refuse_flattened_rows_and_say_why():
    """A trainable module without a fast rule sends the model to Opacus's hooks, which take rows for examples."""
    model = FlatMLP()
    model.head = nn.Sequential(model.head, Gain(3))
    handle = attach_grad_sample(model)
    try:
        with pytest.raises(PerSampleGradientError, match="flattened batch rows .* only the fast path"):
            flat_mlp_losses(model, text_batch(B, "none")).sum().backward()
    finally:
        handle.remove()


# -- DPTrainer, black box: one DP-SGD step at sigma = 0, one example added moves the update by <= C -----------

CLIP, LR = 1e-3, 1e4


def trainer_data(n: int, bart: bool) -> list[dict]:
    batch = text_batch(n, "right", seed=3)
    batch = bart_batch(batch) if bart else batch
    return [{k: v[i].tolist() for k, v in batch.items()} for i in range(n)]


def trainer_sum(factory, losses, rows, output_dir, mode) -> torch.Tensor:
    model = factory()
    before = torch.cat([p.detach().double().flatten() for p in trainable(model)])

    def loss_fn(outputs, labels, inputs):  # opt_losses / bart_losses on the trainer's outputs
        logits = outputs["logits"]
        if losses is opt_losses:
            return F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none").sum(1)
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").sum(1)

    args = one_sgd_step_args(
        output_dir, len(rows), CLIP, LR, remove_unused_columns=False, per_sample_gradient_mode=mode
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0 and delta >= 1/N warn, rightly
        dp = DPTrainer(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_list(rows),
            per_example_loss_fn=loss_fn,
        )
        dp.train()
    assert dp.state.global_step == 1 and dp.sample_rate == 1.0
    after = torch.cat([p.detach().double().flatten() for p in trainable(model)])
    return (before - after) * len(rows) / LR


@pytest.mark.parametrize("mode", ["auto", "materialize"])
@pytest.mark.parametrize("name", ["opt", "bart"])
def test_one_example_moves_a_dp_sgd_step_by_at_most_its_clip(name, mode, tmp_path):
    factory, losses = (tiny_opt, opt_losses) if name == "opt" else (tiny_bart, bart_losses)
    data = trainer_data(5, bart=name == "bart")
    without = trainer_sum(factory, losses, data[:4], tmp_path / "without", mode)
    with_one = trainer_sum(factory, losses, [data[4], *data[:4]], tmp_path / "with", mode)
    assert (with_one - without).norm().item() / CLIP <= 1 + 1e-4
    batch = {k: torch.tensor([row[k] for row in data]) for k in data[0]}
    reference = loop_gradients(factory, losses, batch)
    assert (reference.norm(dim=1) > 10 * CLIP).all()
    clipped = CLIP * reference / reference.norm(dim=1, keepdim=True)
    torch.testing.assert_close(without, clipped[:4].sum(0), rtol=0, atol=2e-5 * CLIP)
    torch.testing.assert_close(with_one, clipped.sum(0), rtol=0, atol=2e-5 * CLIP)
