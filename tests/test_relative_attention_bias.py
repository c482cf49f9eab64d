"""Full fine-tuning with a trainable relative attention bias (T5, UMT5, MPNet): exact per-example gradients.

The bias ``E`` is looked up with a ``[q, k]`` bucket tensor without a batch dimension and broadcast over the
batch, so its backprop arrives summed over the examples. ``dp_hf.per_example.relative_bias`` replaces the
known bias methods, while recording, by a lookup with the buckets expanded to ``[B, q, k]`` before it. Here:
per-example gradients (every tensor trainable) equal a micro-batch loop of plain autograd on all three paths;
one DP-SGD step at sigma 0 moves by at most the bound when one example is added; logits and bias values are
bit-identical; unknown relative-bias lookups are still refused; and the tests fail when the expansion is done
after the lookup (the broadcast's summed gradient) or when the ghost record sums over the batch.
"""

from __future__ import annotations

import time
import warnings

import datasets
import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn

import dp_hf.per_example.ghost.records as records_module
import dp_hf.per_example.relative_bias as relative_bias
from dp_hf import DPTrainer
from dp_hf.per_example import attach_fast_clipping, attach_grad_sample
from dp_hf.per_example.errors import PerSampleGradientError
from dp_hf.per_example.ghost.norms import materialize
from dp_hf.per_example.ghost.shared_ids import PAIRWISE_POSITIONS, shared_ids_dense
from dp_hf.per_example.relative_bias import known_bias_method
from dp_hf.privatizer import Geometry
from tests.dp_training import Gain, one_sgd_step_args

VOCAB, B = 40, 4
T5_SIZES = dict(
    vocab_size=VOCAB,
    d_model=16,
    d_kv=8,
    d_ff=24,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=2,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    dropout_rate=0.0,
    decoder_start_token_id=0,
    pad_token_id=0,
)


def tiny_t5(attn: str = "sdpa", **overrides) -> nn.Module:
    torch.manual_seed(0)
    config = tf.T5Config(**{**T5_SIZES, **overrides})
    config._attn_implementation = attn
    return tf.T5ForConditionalGeneration(config).train()


def tiny_umt5(attn: str = "sdpa") -> nn.Module:  # a relative bias in every layer, buckets from its config
    torch.manual_seed(0)
    config = tf.UMT5Config(**T5_SIZES)
    config._attn_implementation = attn
    return tf.UMT5ForConditionalGeneration(config).train()


def tiny_mpnet(attn: str = "eager") -> nn.Module:
    torch.manual_seed(0)
    config = tf.MPNetConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=32,
        pad_token_id=1,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    return tf.MPNetForSequenceClassification(config).train()


#: family -> (factory, task): "s2s" (token losses summed per example) or "cls".
FAMILIES = {"t5": (tiny_t5, "s2s"), "umt5": (tiny_umt5, "s2s"), "mpnet": (tiny_mpnet, "cls")}


def batch_of(task: str, n: int = B, source: int = 7, target: int = 5, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, source), generator=g)
    if task == "cls":
        return dict(
            input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.randint(0, 3, (n,), generator=g)
        )
    labels = torch.randint(3, VOCAB, (n, target), generator=g)
    decoder = torch.cat([torch.zeros(n, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    return dict(input_ids=ids, decoder_input_ids=decoder, labels=labels)


def losses(model: nn.Module, batch: dict) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    if logits.dim() == 2:
        return F.cross_entropy(logits, batch["labels"], reduction="none")
    return F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none").sum(dim=1)


def rows(batch: dict, i: int) -> dict:
    return {k: v[i : i + 1] for k, v in batch.items()}


def trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def bias_weights(model: nn.Module) -> list[torch.Tensor]:
    return [
        m.relative_attention_bias.weight for m in model.modules() if hasattr(m, "relative_attention_bias")
    ]


def loop_gradients(model: nn.Module, batch: dict) -> list[list[torch.Tensor]]:
    """Each example's gradient by plain autograd on a batch of one (no hooks)."""
    n = batch["input_ids"].shape[0]
    return [
        list(torch.autograd.grad(losses(model, rows(batch, i)).sum(), trainable(model))) for i in range(n)
    ]


def flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def check_per_example_gradients(family: str, path: str, *, probe: bool = True, **sizes) -> None:
    """Per-example gradients on ``path`` equal the micro-batch loop (AssertionError otherwise)."""
    factory, task = FAMILIES[family]
    model, batch = factory(), batch_of(task, **sizes)
    assert bias_weights(model) and all(p.requires_grad for p in model.parameters())
    reference = loop_gradients(model, batch)
    ref = torch.stack([flat(g) for g in reference])
    params = trainable(model)
    if path == "opacus":
        handle = attach_grad_sample(model, probe_batch_dimensions=probe)
        losses(model, batch).sum().backward()
        got = torch.cat([p.grad_sample.flatten(1) for p in params], dim=1)
        handle.remove()
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        return
    clipping = attach_fast_clipping(model, mode=path, probe_batch_dimensions=probe)
    losses(model, batch).sum().backward()
    index = {id(p): k for k, p in enumerate(params)}
    for weight in bias_weights(model):  # the bias's own per-example gradients, as recorded
        record = clipping.recorder.records[id(weight)]
        expected = torch.stack([grads[index[id(weight)]] for grads in reference])
        positions = record.outers[0].rows.shape[1] if record.outers else None
        assert (record.dense is not None) == (positions is None)  # dense beyond PAIRWISE_POSITIONS (B > 1)
        assert positions is None or positions <= PAIRWISE_POSITIONS or len(expected) == 1
        torch.testing.assert_close(materialize(record, 0, len(expected)), expected, rtol=1e-4, atol=1e-6)
    clip = float(ref.norm(dim=1).median())  # examples on both sides of C
    sums, norms = clipping.clipped_sum(params, Geometry(clip))
    clipping.remove()
    torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-4, atol=1e-6)
    expected = (ref * (clip / ref.norm(dim=1)).clamp(max=1)[:, None]).sum(0)
    torch.testing.assert_close(flat(sums), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("path", ["ghost", "materialize", "opacus"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_per_example_gradients_equal_a_micro_batch_loop(family, path):
    check_per_example_gradients(family, path)


@pytest.mark.parametrize("path", ["ghost", "materialize"])
def test_a_long_source_records_the_dense_gradient(path):
    """``40 x 40 = 1600`` encoder positions, beyond ``PAIRWISE_POSITIONS``: ``G_i`` formed by ``index_add``."""
    check_per_example_gradients("t5", path, source=40)


@pytest.mark.parametrize("path", ["ghost", "opacus"])
def test_one_target_token_and_a_batch_of_one(path):
    """A ``[1, 1]`` bucket tensor (one decoder position) was expanded by the hooks as if it were broadcast ids,
    which broke T5's shapes; and the probes run one example alone. Both now look the bias up per example."""
    check_per_example_gradients("t5", path, target=1)
    check_per_example_gradients("t5", path, n=1)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_bias_values_are_unchanged(family, attn):
    factory, task = FAMILIES[family]
    model, batch = factory(attn=attn), batch_of(task)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    before = model(**inputs).logits  # (grad enabled and the bias trainable, as when recorded)
    clipping = attach_fast_clipping(model)
    checked, names = [], ("compute_bias", "compute_position_bias")
    installed = [(m, name, m.__dict__[name]) for m in model.modules() for name in names if name in m.__dict__]
    assert len(installed) == len(bias_weights(model))  # every known bias method replaced

    def spy(module, name, adapter):  # the bias as built inside the forward: B copies of the class's
        def call(*args, **kwargs):
            out = adapter(*args, **kwargs)
            with torch.no_grad():  # (not recorded: the class's [q, k] lookup would be refused)
                shared = getattr(type(module), name)(module, *args, **kwargs)
            batch = clipping.batch_recorder.batch_size  # B, or 1 and 2 in the probe's forwards
            checked.append(out.shape[0] == batch and torch.equal(out, shared.expand_as(out)))
            return out

        return call

    for module, name, adapter in installed:
        setattr(module, name, spy(module, name, adapter))
    after = model(**inputs).logits
    assert torch.equal(before, after) and len(checked) >= 3 * len(installed) and all(checked)
    for module, name, adapter in installed:
        setattr(module, name, adapter)
    clipping.remove()
    assert not any(
        name in m.__dict__ for m in model.modules() for name in ("compute_bias", "compute_position_bias")
    )


def test_the_known_bodies_of_transformers_are_recognized_and_no_others():
    from transformers.models.longt5 import modeling_longt5
    from transformers.models.wavlm import modeling_wavlm

    def owner(cls):
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.relative_attention_bias = nn.Embedding(8, 2)
        return module

    known = [
        tf.models.t5.modeling_t5.T5Attention,
        tf.models.mt5.modeling_mt5.MT5Attention,
        tf.models.umt5.modeling_umt5.UMT5Attention,
        tf.models.pop2piano.modeling_pop2piano.Pop2PianoAttention,
        tf.models.switch_transformers.modeling_switch_transformers.SwitchTransformersAttention,
        tf.models.udop.modeling_udop.UdopAttention,
        tf.models.pix2struct.modeling_pix2struct.Pix2StructTextAttention,
        modeling_longt5.LongT5Attention,
        tf.models.mpnet.modeling_mpnet.MPNetEncoder,
    ]
    for cls in known:
        assert known_bias_method(owner(cls)) is not None, cls
    # LongT5's local/transient-global attention (block-wise buckets), WavLM's gated bias: not known, refused.
    unknown = [modeling_longt5.LongT5LocalAttention, modeling_longt5.LongT5TransientGlobalAttention]
    for cls in [*unknown, modeling_wavlm.WavLMAttention]:
        assert known_bias_method(owner(cls)) is None, cls

    class Edited(tf.models.t5.modeling_t5.T5Attention):  # one token differs: unknown
        def compute_bias(self, query_length, key_length, device=None, past_seen_tokens=0):
            return super().compute_bias(query_length, key_length, device, past_seen_tokens) * 2

    assert known_bias_method(owner(Edited)) is None
    shadowed = owner(tf.models.t5.modeling_t5.T5Attention)
    shadowed.compute_bias = shadowed.compute_bias  # an instance override: unknown code
    assert known_bias_method(shadowed) is None


class PlainRelativeBias(nn.Module):
    """An unknown module: a plain Embedding looked up with ``[T, T]`` ids, broadcast over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.relative_attention_bias, self.head = (
            nn.Embedding(VOCAB, 8),
            nn.Embedding(16, 1),
            nn.Linear(8, 3),
        )

    def compute_bias(self, length: int) -> torch.Tensor:
        positions = torch.arange(length)
        return self.relative_attention_bias((positions[None, :] - positions[:, None]).abs().clamp(max=15))[
            ..., 0
        ]

    def forward(self, input_ids):
        h = self.embed(input_ids)
        attention = torch.softmax(h @ h.transpose(1, 2) + self.compute_bias(input_ids.shape[1]), -1)
        return self.head((attention @ h).mean(1))


@pytest.mark.parametrize("length", [6, B])  # T != B: the shape check; T == B: the probe
@pytest.mark.parametrize("path", ["ghost", "materialize", "opacus"])
def test_an_unknown_relative_bias_lookup_is_still_refused(path, length):
    torch.manual_seed(0)
    model, ids = PlainRelativeBias().train(), torch.randint(0, VOCAB, (B, length))
    if path == "opacus":
        handle = attach_grad_sample(model)
        if length == B:  # (the own-loop Opacus hooks have no probe: DPTrainer runs its own)
            handle.remove()
            return
        with pytest.raises(PerSampleGradientError, match=r"relative_attention_bias \(Embedding\) received"):
            model(ids)
        handle.remove()
        return
    clipping = attach_fast_clipping(model, mode=path)
    with pytest.raises(PerSampleGradientError, match=r"relative_attention_bias \(Embedding\) received"):
        model(ids)
    clipping.remove()


def _lookup_after_the_broadcast(embedding, bucket, batch):
    """The mutation: one lookup, then the broadcast (whose backprop is summed over the batch)."""
    values = embedding(bucket)
    return values.unsqueeze(0).expand(batch, *values.shape)


@pytest.mark.parametrize("path", ["ghost", "materialize", "opacus"])
def test_a_lookup_expanded_after_the_broadcast_fails_the_tests(path, monkeypatch):
    """With ``q == k == B`` the bucket tensor passes the per-call shape check; without the probe only the
    gradient comparison can see that its rows are positions, not examples. With the probe it is refused."""
    monkeypatch.setattr(relative_bias, "per_example_lookup", _lookup_after_the_broadcast)
    with pytest.raises(AssertionError):
        check_per_example_gradients("t5", path, probe=False, source=B, target=B)
    with pytest.raises(PerSampleGradientError, match="alone and the first two together"):
        check_per_example_gradients("t5", path, source=B, target=B)  # (Opacus's hooks probe too now)


@pytest.mark.parametrize("path", ["ghost", "materialize"])
def test_a_shared_ids_record_summed_over_the_batch_fails_the_tests(path, monkeypatch):
    def summed(ids, grad, num_rows):
        dense = shared_ids_dense(ids, grad, num_rows)
        return dense.sum(0, keepdim=True).expand_as(dense).clone()

    monkeypatch.setattr(records_module, "shared_ids_dense", summed)
    with pytest.raises(AssertionError):
        check_per_example_gradients("t5", path, source=40)


def test_long_sequences_take_the_linear_path():
    """``q = k = 512``: 262k positions of 8 buckets. The factored ghost norm of shared ids compared every pair
    of positions (``[T, T]``, 275 GB); the dense record is ``[B, 8, H]``, formed in ``O(B q k H)``."""
    model, batch = tiny_t5(num_layers=1, num_decoder_layers=1), batch_of("s2s", n=2, source=512, target=4)
    clipping = attach_fast_clipping(model, mode="ghost")
    losses(model, batch).sum().backward()
    encoder_bias = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    assert clipping.recorder.records[id(encoder_bias)].dense.shape == (2, 8, 2)
    start = time.perf_counter()
    clipping.clipped_sum(trainable(model), Geometry(1.0))
    assert time.perf_counter() - start < 20
    clipping.remove()


# ---------------------------------------------------------------- black box: one DP-SGD step at sigma 0

CLIP, LR, POOL = 1e-3, 1e4, 9


def sensitivity_model(family: str, opacus: bool) -> nn.Module:
    model = FAMILIES[family][0]()
    if opacus:  # a module without a fast rule: DPTrainer takes Opacus's hooks
        if family == "mpnet":
            model.classifier.out_proj = nn.Sequential(model.classifier.out_proj, Gain(3))
        else:
            model.lm_head = nn.Sequential(model.lm_head, Gain(VOCAB))
    return model


def dp_step_sum(family: str, opacus: bool, data: list[dict], output_dir, **overrides) -> torch.Tensor:
    model = sensitivity_model(family, opacus)
    before = flat([p.detach().double() for p in trainable(model)])
    args = one_sgd_step_args(output_dir, len(data), CLIP, LR, remove_unused_columns=False, **overrides)
    dataset = datasets.Dataset.from_list([{k: v.tolist() for k, v in row.items()} for row in data])

    def loss_fn(outputs, labels, inputs):
        logits = outputs["logits"]
        if logits.dim() == 2:
            return F.cross_entropy(logits, labels, reduction="none")
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").sum(dim=1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0 and delta >= 1/N warn, rightly
        trainer = DPTrainer(model=model, args=args, train_dataset=dataset, per_example_loss_fn=loss_fn)
        trainer.train()
    assert trainer.state.global_step == 1 and trainer.sample_rate == 1.0
    return (before - flat([p.detach().double() for p in trainable(model)])) * len(data) / LR


def clipped_alone(family: str, opacus: bool, row: dict) -> torch.Tensor:
    model = sensitivity_model(family, opacus)
    grads = torch.autograd.grad(losses(model, {k: v[None] for k, v in row.items()}).sum(), trainable(model))
    gradient = flat([g.double() for g in grads])
    assert gradient.norm() > 10 * CLIP  # every example clipped
    return CLIP * gradient / gradient.norm()


@pytest.mark.parametrize(
    "family, mode",
    [("t5", "auto"), ("mpnet", "auto"), ("mpnet", "materialize"), ("mpnet", "opacus"), ("t5", "opacus")],
)
def test_one_example_moves_the_update_by_at_most_its_clipped_gradient(family, mode, tmp_path):
    opacus = mode == "opacus"
    pool = batch_of(FAMILIES[family][1], n=POOL, seed=3)
    data = [{k: v[i] for k, v in pool.items()} for i in range(POOL)]
    overrides = {} if opacus else dict(per_sample_gradient_mode=mode)
    s_without = dp_step_sum(family, opacus, data[:8], tmp_path / "without", **overrides)
    s_with = dp_step_sum(family, opacus, [data[8], *data[:8]], tmp_path / "with", **overrides)
    clipped = [clipped_alone(family, opacus, row) for row in data]
    assert (s_with - s_without).norm().item() / CLIP <= 1 + 1e-4  # the black-box bound
    for s, examples in ((s_without, range(8)), (s_with, range(9))):  # each example its own C g / |g|
        expected = torch.stack([clipped[i] for i in examples]).sum(0)
        torch.testing.assert_close(s, expected, rtol=0, atol=2e-5 * CLIP)
