"""Fine-tuning Swin on the fast path: window attention whose context rows stay per example (dp_hf.per_example.swin).

A tiny Swin with shifted windows (two blocks per stage, the second shifted) on images whose patch grid is
not a multiple of the window (padded), every parameter trainable, the relative position bias tables with or
without (looked up per example, recorded as an embedding with shared ids: factored at ws = 2, dense
``[B, R, heads]`` beyond 1024 positions at ws = 6). The reference is plain autograd one example at a
time: the fast path's per-example norms and clipped sums (ghost and materialize) must equal it. Windows
mixed across examples, before the attention (its rows unverified) or after it (the probes), are refused.
Mutations checked to fail these tests: splitting the window rows as ``[nW, B]`` instead of ``[B, nW]``;
accepting unverified window rows (the replacement then reads rolled rows as example-major); looking the
table up once and broadcasting it over the batch (summed over the examples); looking it up per window
(``B*nW`` rows) instead of per example; the class's broadcast lookup while recording not refused.
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
from dp_hf.per_example.errors import PerSampleGradientError, UnsupportedModuleError
from dp_hf.per_example.swin import is_known_swin_attention
from dp_hf.privatizer import Geometry
from tests.dp_training import one_sgd_step_args

B, IMAGE, LABELS = 3, 10, 3  # 5 x 5 patches, windows of 2: padded to 6 x 6, then 3 x 3 -> 4 x 4


def tiny_swin(
    trainable_bias: bool = False, drop_path: float = 0.0, seed: int = 0, window: int = 2, image: int = IMAGE
) -> nn.Module:
    torch.manual_seed(seed)
    config = tf.SwinConfig(
        image_size=image,
        patch_size=2,
        num_channels=3,
        embed_dim=8,
        depths=[2, 2] if window == 2 else [2],
        num_heads=[1, 2] if window == 2 else [2],
        window_size=window,
        num_labels=LABELS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=drop_path,
    )
    model = tf.SwinForImageClassification(config).train()
    with torch.no_grad():  # Swin initialises the tables to zero: make the bias matter
        for name, p in model.named_parameters():
            if name.endswith("relative_position_bias_table"):
                p.normal_()
                p.requires_grad_(trainable_bias)
    return model


def images(n: int, seed: int = 0, image: int = IMAGE) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randn(n, 3, image, image, generator=g),
        "labels": torch.randint(0, LABELS, (n,), generator=g),
    }


def losses(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(pixel_values=batch["pixel_values"]).logits
    return F.cross_entropy(logits, batch["labels"], reduction="none")


def trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def loop_gradients(model: nn.Module, batch: dict) -> torch.Tensor:
    rows = []
    for i in range(batch["labels"].shape[0]):
        example = {k: v[i : i + 1] for k, v in batch.items()}
        grads = torch.autograd.grad(losses(model, example).sum(), trainable(model))
        rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows).double()


def fast_clipped(model: nn.Module, batch: dict, mode: str, clip: float):
    clipping = attach_fast_clipping(model, mode=mode)
    try:
        losses(model, batch).sum().backward()
        sums, norms = clipping.clipped_sum(trainable(model), Geometry(clip))
    finally:
        clipping.remove()
    return torch.cat([s.flatten() for s in sums]).double(), norms.double()


def test_the_attentions_are_recognised_and_shifted_windows_exist():
    model = tiny_swin()
    attentions = [m for m in model.modules() if is_known_swin_attention(m)]
    assert len(attentions) == 4
    assert [layer.shift_size for stage in model.swin.encoder.layers for layer in stage.blocks] == [0, 1, 0, 1]


def only_tables_trainable(model: nn.Module) -> nn.Module:
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("relative_position_bias_table"))
    return model


def check_against_the_loop(make, batch: dict, mode: str) -> None:
    reference = loop_gradients(make(), batch)
    ref_norms = reference.norm(dim=1)
    clip = float(ref_norms.sort().values[1])  # some examples clipped, some not
    factors = (clip / ref_norms).clamp(max=1.0)
    sums, norms = fast_clipped(make(), batch, mode, clip)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(sums, (factors[:, None] * reference).sum(0), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("tables", ["frozen", "trainable", "only"])
def test_per_example_gradients_match_a_loop_of_single_examples(mode, tables):
    """Shifted windows, padding; the tables frozen, trainable with the rest, or the only trainable tensors
    (their per-example gradients alone: a table summed over the examples or split per window shows)."""
    if tables == "only":
        check_against_the_loop(lambda: only_tables_trainable(tiny_swin(True)), images(B), mode)
    else:
        check_against_the_loop(lambda: tiny_swin(tables == "trainable"), images(B), mode)


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_large_windows_take_the_dense_shared_ids_record(mode):
    """ws = 6: N*N = 1296 > 1024 positions of shared ids, so G_b is formed densely (index_add, [B, 121, 2]);
    a 12 x 12 patch grid: four windows, the second block shifted by 3."""
    model = tiny_swin(True, window=6, image=24)
    assert [layer.shift_size for layer in model.swin.encoder.layers[0].blocks] == [0, 3]
    check_against_the_loop(lambda: tiny_swin(True, window=6, image=24), images(B, image=24), mode)


def test_the_forward_is_unchanged_while_recording():
    model, batch = tiny_swin(), images(B)
    expected = losses(model, batch)
    clipping = attach_fast_clipping(model, probe_batch_dimensions=False)
    try:
        got = losses(model, batch)
    finally:
        clipping.remove()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert all("forward" not in m.__dict__ for m in model.modules())  # adapters removed with the hooks


def test_a_trainable_bias_table_is_hooked_and_gets_no_autograd_grad():
    model = tiny_swin(trainable_bias=True)
    clipping = attach_fast_clipping(model, probe_batch_dimensions=False)
    try:
        hooked = [m for m in model.modules() if type(m).__name__ == "SwinRelativePositionBias"]
        assert len(hooked) == 4 and all("forward" in m.__dict__ for m in hooked)
        losses(model, images(B)).sum().backward()
        assert all(m.relative_position_bias_table.grad is None for m in hooked)  # recorded, not summed
    finally:
        clipping.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_trainable_bias_table_with_an_unrecognised_bias_module_is_refused():
    model = tiny_swin(trainable_bias=True)
    bias = model.swin.encoder.layers[0].blocks[0].attention.relative_position_bias
    bias.register_buffer("extra", torch.zeros(1))  # not the known module any more
    with pytest.raises(UnsupportedModuleError, match="SwinRelativePositionBias"):
        attach_fast_clipping(model)


def test_opacus_hooks_refuse_a_trainable_bias_table_with_the_fix():
    """Only the fast path looks the table up per example; Opacus's hooks have no rule for it (its index buffer)."""
    with pytest.raises(
        UnsupportedModuleError, match=r"SwinRelativePositionBias\): it has trainable parameters and buffers"
    ):
        attach_grad_sample(tiny_swin(trainable_bias=True))
    attach_grad_sample(tiny_swin()).remove()  # the tables frozen: accepted


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_the_class_broadcast_lookup_of_a_trainable_table_is_refused_while_recording(mode):
    """Unverified window rows with only the tables trainable (no layer checks the rows): the class's forward
    runs, whose one lookup is broadcast over every example's windows; the table's hooked forward refuses it."""
    model = only_tables_trainable(rolled_swin("before", trainable_bias=True))
    clipping = attach_fast_clipping(model, mode=mode, probe_batch_dimensions=False)
    try:
        with pytest.raises(
            PerSampleGradientError, match="looked up outside the per-example window attention"
        ):
            losses(model, images(B))
    finally:
        clipping.remove()


class _RollWindows(nn.Module):
    """Wraps a SwinAttention: rolls the ``B*nW`` window rows (mixing examples) before or after it."""

    def __init__(self, attention: nn.Module, where: str) -> None:
        super().__init__()
        self.attention, self.where = attention, where

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if self.where == "before":
            hidden_states = torch.roll(hidden_states, 1, dims=0)
        output, weights = self.attention(hidden_states, attention_mask, **kwargs)
        if self.where == "after":  # half the rows: a batch of 4 swaps examples 0, 1 with 2, 3
            output = torch.roll(output, output.shape[0] // 2, dims=0)
        return output, weights


def rolled_swin(where: str, trainable_bias: bool = False) -> nn.Module:
    model = tiny_swin(trainable_bias)
    layer = model.swin.encoder.layers[0].blocks[1]
    layer.attention = _RollWindows(layer.attention, where)
    return model


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("frozen_qkv", [False, True])
def test_windows_mixed_across_examples_before_the_attention_are_refused(mode, frozen_qkv):
    """Rolled window rows fail q_proj's provenance check; with q/k/v frozen (nothing checks them there) the
    replacement must not take them for example-major rows: the class's forward runs and o_proj refuses."""
    model = rolled_swin("before")
    for name, p in model.named_parameters():
        if frozen_qkv and any(f".{proj}." in name for proj in ("q_proj", "k_proj", "v_proj")):
            p.requires_grad_(False)
    layer = "o_proj" if frozen_qkv else "q_proj"
    clipping = attach_fast_clipping(model, mode=mode, probe_batch_dimensions=False)
    try:
        with pytest.raises(
            PerSampleGradientError, match=rf"{layer} \(Linear\) received an input with leading"
        ):
            losses(model, images(B)).sum().backward()
    finally:
        clipping.remove()


# -- DPTrainer, black box: one DP-SGD step at sigma = 0, one example added moves the update by <= C -----------

CLIP, LR = 1e-3, 1e4


def trainer_sum(
    rows: list[dict], output_dir, mode: str, drop_path: float = 0.0, model=None, tables: bool = False
) -> torch.Tensor:
    model = tiny_swin(tables, drop_path=drop_path) if model is None else model
    before = torch.cat([p.detach().double().flatten() for p in trainable(model)])
    args = one_sgd_step_args(output_dir, len(rows), CLIP, LR, per_sample_gradient_mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0 and delta >= 1/N warn, rightly
        dp = DPTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows))
        dp.train()
    assert dp.state.global_step == 1 and dp.sample_rate == 1.0
    after = torch.cat([p.detach().double().flatten() for p in trainable(model)])
    return (before - after) * len(rows) / LR


def trainer_rows(n: int) -> list[dict]:
    batch = images(n, seed=3)
    return [{k: v[i].tolist() for k, v in batch.items()} for i in range(n)]


@pytest.mark.parametrize("mode", ["auto", "materialize"])
@pytest.mark.parametrize("tables", [False, True], ids=["frozen-tables", "trainable-tables"])
def test_one_example_moves_a_dp_sgd_step_by_at_most_its_clip(mode, tables, tmp_path):
    data = trainer_rows(5)
    without = trainer_sum(data[:4], tmp_path / "without", mode, tables=tables)
    with_one = trainer_sum([data[4], *data[:4]], tmp_path / "with", mode, tables=tables)
    assert (with_one - without).norm().item() / CLIP <= 1 + 1e-4
    batch = {k: torch.tensor([row[k] for row in data]) for k in data[0]}
    reference = loop_gradients(tiny_swin(tables), batch)
    assert (reference.norm(dim=1) > 10 * CLIP).all()
    clipped = CLIP * reference / reference.norm(dim=1, keepdim=True)
    torch.testing.assert_close(without, clipped[:4].sum(0), rtol=0, atol=2e-5 * CLIP)
    torch.testing.assert_close(with_one, clipped.sum(0), rtol=0, atol=2e-5 * CLIP)


@pytest.mark.parametrize("mode", ["auto", "materialize"])
def test_windows_mixed_across_examples_after_the_attention_are_refused_by_the_probes(mode, tmp_path):
    """Rolled after ``o_proj``, the rows pass every shape check; DPTrainer's first-step probes refuse them."""
    with pytest.raises(ValueError, match="credits one example's gradient to another"):
        trainer_sum(trainer_rows(4), tmp_path, mode, model=rolled_swin("after"))


def test_drop_path_trains_and_stays_within_the_clip(tmp_path):
    """Stochastic depth draws one keep/drop per example (dim 0 of ``[B, L, C]``): per example, as dropout."""
    data = trainer_rows(5)
    without = trainer_sum(data[:4], tmp_path / "without", "auto", drop_path=0.3)
    with_one = trainer_sum([data[4], *data[:4]], tmp_path / "with", "auto", drop_path=0.3)
    assert without.norm().item() <= 4 * CLIP * (1 + 1e-4) and with_one.norm().item() <= 5 * CLIP * (1 + 1e-4)
