"""Multi-tensor optimizer steps (issue 16): one flat noise draw per step, batched MicroAdam.

Each test would fail if the multi-tensor path drew noise per tensor, mixed up the tensors' slices
of a flat buffer, let a top-k block or quantization bucket straddle two tensors, or lost state in
a checkpoint.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from dp_hf.noise import NoiseSource
from dp_hf.optim import create_dp_optimizer
from dp_hf.optim._params import FP32Params, advance_steps
from dp_hf.privatizer import Geometry, Privatizer

# Odd sizes: smaller than a block, odd element counts (half-filled last byte of the 4-bit codes),
# partial last blocks and buckets, and repeated sizes (tensors batched together).
ODD_SHAPES = [(7,), (3, 11), (33,), (7,), (5, 8), (3, 11), (61,), (1,), (2, 3, 5), (33,), (16,), (17, 3)]
BATCH = 4
HP = dict(density=0.2, window=3, block_size=16, quant_block=10)


def odd_params(dtype=torch.float32, seed=0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((0.1 * torch.randn(s, generator=gen)).to(dtype)) for s in ODD_SHAPES]


def feed(params, step: int) -> None:
    gen = torch.Generator().manual_seed(500 + step)
    for p in params:
        p.grad_sample = (1e-2 * torch.randn((BATCH, *p.shape), generator=gen)).to(p.dtype)


def microadam(params, **kw):
    kw = dict(
        dict(lr=1e-2, weight_decay=0.05, noise_multiplier=0.7, max_grad_norm=1.0, expected_batch_size=BATCH),
        **dict(dict(noise_seed=5, **HP), **kw),
    )
    return create_dp_optimizer("dp-microadam", params, **kw)


# ---------------------------------------------------------------------- noise
class NormalSpy:
    """Counts ``torch.normal`` calls and the elements they drew."""

    def __init__(self, monkeypatch):
        self.calls: list[int] = []
        real = torch.normal

        def spy(*args, **kwargs):
            out = real(*args, **kwargs)
            self.calls.append(out.numel())
            return out

        monkeypatch.setattr(torch, "normal", spy)


@pytest.mark.parametrize("name", ["dp-sgd", "dp-adamw", "dp-adamw-stp", "dp-microadam"])
def test_one_flat_normal_call_per_step_for_all_tensors(monkeypatch, name):
    params = odd_params()
    kwargs = dict(HP) if name == "dp-microadam" else {}
    opt = create_dp_optimizer(
        name, params, lr=1e-3, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=BATCH, **kwargs
    )
    spy = NormalSpy(monkeypatch)
    for t in range(3):
        feed(params, t)
        opt.step()
        opt.zero_grad()
        total = sum(p.numel() for p in params)
        assert spy.calls == [total] * (t + 1), spy.calls  # one call of the total size, per step
    assert opt.noise_source.num_draws == 3


@pytest.mark.parametrize(
    "name, kw",
    [("dp-adamw-stp", {}), ("dp-adamw-stp", {"scale_mode": "raw"}), ("dp-macadam", {})],
    ids=["stp-rms", "stp-raw", "macadam"],
)
def test_the_geometry_takes_the_same_ops_for_any_number_of_tensors(name, kw):
    """An adaptive geometry (shifts and scales from the optimizer's state, every step) is a few
    multi-tensor ops for all tensors, not ~3 per tensor (STP's ~15 with its RMS normalization: on a GPU,
    ~3000 launches per step for BERT-base); the same values as per tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    def geometry_ops(copies: int):
        params = [p for _ in range(copies) for p in odd_params()]
        clip = {} if name == "dp-macadam" else {"max_grad_norm": 1.0}  # (DP-MacAdam fixes C = 1)
        opt = create_dp_optimizer(
            name, params, lr=1e-3, noise_multiplier=1.0, expected_batch_size=BATCH, **clip, **kw
        )
        for t in range(2):
            feed(params, t)
            opt.step()
            opt.zero_grad()
        with Ops() as ops:
            geometry = opt.geometry(params)
        return ops.count, geometry, opt, params

    few, _, _, _ = geometry_ops(1)
    many, geometry, opt, params = geometry_ops(4)
    assert many == few, (few, many)
    scales = geometry.scale
    if name == "dp-macadam":  # s = b_{t-1}, c = mhat_{t-1}
        for p, s, c in zip(params, scales, geometry.shift):
            state = opt.state[p]
            assert torch.equal(s, state["clip_scale"])
            torch.testing.assert_close(c, state["exp_avg"] / (1 - 0.9**2), rtol=0, atol=0)
        return
    u = [(opt.state[p]["exp_avg_sq"] / (1 - 0.999**2)).sqrt() + 1e-8 for p in params]
    if kw.get("scale_mode") == "raw":
        expected = u
    else:  # (u / RMS(u) + floor) / RMS(u / RMS(u) + floor), every tensor's u in one RMS
        flat = torch.cat([x.reshape(-1) for x in u]).double()
        rms = flat.square().mean().sqrt()
        floored = flat / rms + opt.scale_floor
        expected = [
            ((x.double() / rms + opt.scale_floor) / floored.square().mean().sqrt()).float() for x in u
        ]
    for s, e in zip(scales, expected):
        torch.testing.assert_close(s, e, rtol=1e-6, atol=0)


def test_secure_mode_sums_four_flat_draws(monkeypatch):
    params = odd_params()
    opt = create_dp_optimizer(
        "dp-sgd",
        params,
        lr=0.0,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=1.0,
        secure_mode=True,
    )
    spy = NormalSpy(monkeypatch)
    opt.step()  # empty logical batch: pure noise, (z1 + z2 + z3 + z4) / 2 has std sigma C
    total = sum(p.numel() for p in params)
    assert spy.calls == [total] * 4
    big = NoiseSource(secure_mode=True).normal((200_000,), 1.5, torch.device("cpu"))
    assert abs(big.std().item() / 1.5 - 1) < 0.02


def test_release_equals_per_tensor_formula_with_geometry():
    """(sum + N(0, sigma^2 C^2)) / B, then * s, then + c, each tensor on its own slice of the flat draw."""
    sigma, clip, expected = 0.6, 2.0, 7.0
    gen = torch.Generator().manual_seed(0)
    shapes = ODD_SHAPES[:5]
    sums = [torch.randn(s, generator=gen) for s in shapes]
    scale = [torch.rand(s, generator=gen) + 0.5 if k % 2 else None for k, s in enumerate(shapes)]
    shift = [torch.randn(s, generator=gen) if k % 3 == 0 else None for k, s in enumerate(shapes)]
    privatizer = Privatizer(sigma, expected, NoiseSource(seed=9))
    privatizer.accumulate_clipped_sum([s.clone() for s in sums], 3)
    params = [torch.zeros(s) for s in shapes]
    out = privatizer.release(params, Geometry(clip, shift=shift, scale=scale))
    flat = torch.normal(
        0.0, sigma * clip, size=(sum(s.numel() for s in sums),), generator=torch.Generator().manual_seed(9)
    )
    for k, (s, z) in enumerate(zip(sums, flat.split([s.numel() for s in sums]))):
        want = (s + z.view(s.shape)) / expected
        if scale[k] is not None:
            want = want * scale[k]
        if shift[k] is not None:
            want = want + shift[k]
        torch.testing.assert_close(out[k], want, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------- helpers
def test_advance_steps_common_and_mixed():
    steps = [torch.tensor(3.0), torch.tensor(3.0)]
    assert advance_steps(steps) == 4.0 and all(float(s) == 4.0 for s in steps)
    mixed = [torch.tensor(3.0), torch.tensor(0.0), torch.tensor(3.0)]
    assert advance_steps(mixed) == [4.0, 1.0, 4.0]


def test_fp32_params_copy_and_write_back_bf16():
    params = [torch.randn(3, 5).bfloat16(), torch.randn(4), torch.randn(7).bfloat16()]
    weights = FP32Params(params)
    assert weights.tensors[1].data_ptr() == params[1].data_ptr()  # float32 tensors are updated in place
    assert all(t.dtype == torch.float32 for t in weights.tensors)
    assert torch.equal(weights.tensors[0], params[0].float())
    torch._foreach_add_(weights.tensors, 1.0)
    weights.write_back()
    assert params[2].dtype == torch.bfloat16
    assert torch.equal(params[2], (weights.tensors[2]).bfloat16())


def test_adamw_with_unequal_steps_equals_torch():
    """A tensor unfrozen after 3 steps has its own step count (per-tensor bias correction)."""
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen) for s in ODD_SHAPES[:4]]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    ours[1].requires_grad_(False)
    opt = create_dp_optimizer(
        "dp-adamw",
        ours,
        lr=1e-2,
        weight_decay=0.1,
        noise_multiplier=0.0,
        max_grad_norm=math.inf,
        expected_batch_size=BATCH,
    )
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    for t in range(6):
        if t == 3:
            ours[1].requires_grad_(True)
        feed([p for p in ours if p.requires_grad], t)
        for p, q in zip(ours, theirs):
            q.grad = p.grad_sample.sum(0) / BATCH if p.requires_grad else None
        opt.step()
        ref.step()
        opt.zero_grad()
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    assert float(opt.state[ours[1]]["step"]) == 3.0 and float(opt.state[ours[0]]["step"]) == 6.0


# ---------------------------------------------------------------------- MicroAdam batched
@pytest.mark.parametrize("batch_limit", [None, 40], ids=["one-batch-per-size", "chunked"])
def test_microadam_batched_equals_one_tensor_at_a_time(batch_limit):
    """All tensors in one group (same-size tensors batched) == each tensor alone in its group; also when
    a size's tensors are split into several chunks that share the kept work buffers."""
    batched = odd_params()
    alone = odd_params()
    opt = microadam(batched)
    if batch_limit is not None:
        opt.max_batch_numel_cpu = batch_limit  # (3, 11) and (33,): one tensor a chunk; (7,): five a chunk
    ref = microadam([{"params": [p]} for p in alone])
    for t in range(7):  # > window: the ring buffer wraps
        for params, optimizer in ((batched, opt), (alone, ref)):
            feed(params, t)
            optimizer.step()
            optimizer.zero_grad()
        for p, q in zip(batched, alone):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
            for key, value in ref.state[q].items():
                assert torch.equal(opt.state[p][key], value), key


def test_microadam_makes_no_tensor_from_host_values_once_its_window_is_full(monkeypatch):
    """On an accelerator a tensor made from a Python list is a copy that waits for the device: the
    window's decay weights are made once per window position (at most 2 m), not once per batch of
    tensors per step (on an H100 BERT-base's step then waited 94 times: 103 ms for 25 ms of kernels).
    The cached weights are those of the formula: the same run with the cache cleared every step is
    bitwise equal."""
    window = HP["window"]
    made = []
    real_tensor = torch.tensor

    def counting_tensor(*args, **kwargs):
        made.append(1)
        return real_tensor(*args, **kwargs)

    params, fresh = odd_params(), odd_params()
    opt, ref = microadam(params), microadam(fresh)
    for t in range(4 * window):
        feed(params, t)
        with monkeypatch.context() as patch:
            if t >= 2 * window:
                patch.setattr(torch, "tensor", counting_tensor)
            opt.step()
        opt.zero_grad()
        feed(fresh, t)
        ref.step()
        ref.zero_grad()
        ref.__dict__.pop("_decay_cache", None)
    assert not made, f"{len(made)} torch.tensor calls in {2 * window} steps after the window filled"
    assert len(opt._decay_cache) == 2 * window - 1  # t < m: rows t at row t - 1; then m rows at each row
    for p, q in zip(params, fresh):
        assert torch.equal(p, q)


def _rows(kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 2048, generator=gen).abs()  # non-negative unless "signed"
    if kind == "ties":  # 9 distinct values: the k-th value is shared by hundreds of entries
        x = (x * 4).round().clamp(max=8)
    elif kind == "nan":  # NaN ranks above every number, as in torch.topk
        x[0, ::97] = float("nan")
        x[1, ::3] = float("nan")  # more NaNs than k
    elif kind == "signed":  # |x| ranks: the largest entries are negative ones
        x = x * torch.where(torch.rand(6, 2048, generator=gen) < 0.5, -1.0, 1.0)
    elif kind == "constant":
        x = torch.zeros(6, 2048)
    return x


@pytest.mark.parametrize("kind", ["random", "ties", "nan", "signed", "constant"])
@pytest.mark.parametrize("k", [21, 100])
def test_two_round_topk_has_the_top_k_values(kind, k):
    """topk_abs_rows (groups' maxima first, then the chosen groups) keeps exactly torch.topk's values."""
    from dp_hf.optim.sparse import topk_abs_rows, topk_lanes

    x = _rows(kind)
    assert topk_lanes(x.shape[1], k) is not None  # the two-round path is the one tested
    ours = topk_abs_rows(x, k)
    ref = x.abs().topk(k, dim=1).indices
    for row, (o, r) in enumerate(zip(ours, ref)):
        assert len(set(o.tolist())) == k, row  # k distinct entries
        # NaN != NaN: compare sorted values with NaNs mapped to +inf
        a, b = (x[row, i].abs().nan_to_num(nan=float("inf")).sort().values for i in (o, r))
        assert torch.equal(a, b), (kind, row)


def test_microadam_batch_state_is_stacked_views_and_a_frozen_tensor_gets_its_own_back():
    """Same-size tensors keep their state as rows of one stack (read and written in place each step);
    a tensor that leaves the batch gets its own copy, so its view does not pin the stack."""
    params = [torch.nn.Parameter(0.1 * torch.randn(64)) for _ in range(3)]
    opt = microadam(params)

    def storage(p, key="ef_codes"):
        return opt.state[p][key].untyped_storage()

    for t in range(2):
        feed(params, t)
        opt.step()
        opt.zero_grad()
    assert len({storage(p).data_ptr() for p in params}) == 1  # one stack, three views
    params[0].requires_grad_(False)
    feed(params[1:], 2)
    opt.step()
    for key in ("ef_codes", "ef_min", "ef_max", "win_idx", "win_val"):
        own = opt.state[params[0]][key]
        assert storage(params[0], key).nbytes() == own.nbytes, key  # its own storage now
        assert storage(params[1], key).data_ptr() == storage(params[2], key).data_ptr(), key


def test_microadam_unequal_steps_match_tensors_alone():
    """A tensor unfrozen later is batched apart (its own t) and follows its own schedule."""
    batched, alone = odd_params(), odd_params()
    late = 3  # (3, 11): shares its size with index 5
    batched[late].requires_grad_(False)
    alone[late].requires_grad_(False)
    opt = microadam(batched)
    ref = microadam([{"params": [p]} for p in alone])
    for t in range(5):
        if t == 2:
            batched[late].requires_grad_(True)
            alone[late].requires_grad_(True)
        for params, optimizer in ((batched, opt), (alone, ref)):
            feed([p for p in params if p.requires_grad], t)
            optimizer.step()
            optimizer.zero_grad()
        for p, q in zip(batched, alone):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
    assert float(opt.state[batched[late]]["step"]) == 3.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_microadam_many_odd_tensors_resume_exactly(dtype):
    steps, cut = 6, 4
    ref_params = odd_params(dtype)
    ref = microadam(ref_params)
    for t in range(steps):
        feed(ref_params, t)
        ref.step()
        ref.zero_grad()
    params = odd_params(dtype)
    opt = microadam(params)
    for t in range(cut):
        feed(params, t)
        opt.step()
        opt.zero_grad()
    buffer = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    resumed_params = [torch.nn.Parameter(t.clone()) for t in checkpoint["params"]]
    resumed = microadam(resumed_params, noise_seed=123)
    resumed.load_state_dict(checkpoint["optimizer"])
    for t in range(cut, steps):
        feed(resumed_params, t)
        resumed.step()
        resumed.zero_grad()
    for p_ref, p in zip(ref_params, resumed_params):
        assert torch.equal(p_ref, p)
        for key, value in ref.state[p_ref].items():
            assert resumed.state[p][key].dtype == value.dtype and torch.equal(resumed.state[p][key], value), (
                key
            )


# ---------------------------------------------------------------------- fused Adam
def counted_fused_kernels() -> tuple[list, dict]:
    """``(calls, kernels)``: dp_hf's fused Adam kernels wrapped to append to ``calls`` when run."""
    import dp_hf.optim.adam as adam

    calls: list = []

    def counted(kernel):
        def run(*args, **kwargs):
            calls.append(1)
            return kernel(*args, **kwargs)

        return run

    return calls, {flag: counted(kernel) for flag, kernel in adam._FUSED.items()}


@pytest.mark.parametrize(
    ("name", "kw"),
    [
        ("dp-adamw", dict(weight_decay=0.05)),
        ("dp-adam", dict(weight_decay=0.05)),  # L2 decay added to gtilde (coupled)
        ("dp-adam", dict(weight_decay=0.05, decoupled_weight_decay=True)),
        ("dp-adamw", dict(weight_decay=0.0, betas=(0.8, 0.99), eps=1e-6)),
    ],
)
def test_fused_adam_kernel_matches_the_multi_tensor_step(monkeypatch, name, kw):
    """float32 parameters take torch's fused Adam kernel: the same updates as the multi-tensor ops."""
    import dp_hf.optim.adam as adam

    calls, fused = counted_fused_kernels()
    results = []
    for kernels in (fused, {}):
        monkeypatch.setattr(adam, "_FUSED", kernels)
        params = odd_params()
        opt = create_dp_optimizer(
            name,
            params,
            lr=1e-2,
            noise_multiplier=0.7,
            max_grad_norm=1.0,
            expected_batch_size=BATCH,
            noise_seed=5,
            **kw,
        )
        for step in range(3):
            feed(params, step)
            opt.step()
            opt.zero_grad()
        results.append([p.detach().clone() for p in params])
    assert len(calls) == 3  # the fused run took the kernel at every step, the other never
    for with_kernel, without in zip(*results):
        torch.testing.assert_close(with_kernel, without, rtol=1e-6, atol=1e-7)


def test_bf16_parameters_and_bias_corrected_rules_do_not_take_the_fused_kernel(monkeypatch):
    import dp_hf.optim.adam as adam

    calls = []
    monkeypatch.setattr(adam, "_FUSED", {flag: lambda *a, **k: calls.append(1) for flag in (True, False)})
    for name, dtype in (("dp-adamw", torch.bfloat16), ("dp-adamw-bc", torch.float32)):
        params = odd_params(dtype)
        opt = create_dp_optimizer(
            name, params, lr=1e-2, noise_multiplier=0.7, max_grad_norm=1.0, expected_batch_size=BATCH
        )
        feed(params, 0)
        opt.step()
    assert calls == []


# ---------------------------------------------------------------------- noise prefetch (CPU)
BIG = (1 << 17,)  # above PREFETCH_MIN_NUMEL: drawn ahead on the worker thread


def reference_draws(seed: int, sizes) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.normal(0.0, 0.5, size=(n,), generator=gen) for n in sizes]


def draw_then_ahead(source: NoiseSource, size, std: float) -> torch.Tensor:
    """One step's draw, then the draw ahead the optimizer starts at the end of its step."""
    sample = source.normal(size, std, torch.device("cpu"))
    source.draw_ahead()
    return sample


def test_prefetched_noise_is_the_generators_next_draw():
    """Drawing ahead changes nothing: the same stream as one torch.normal after another, also when a
    step asks for another size (the prefetch is undone) or a small draw (not prefetched) comes between."""
    import dp_hf.noise as noise

    assert BIG[0] >= noise.PREFETCH_MIN_NUMEL
    sizes = [BIG[0], BIG[0], BIG[0] + 3, 100, BIG[0] + 3, BIG[0]]
    source = NoiseSource(seed=11)
    draws = [draw_then_ahead(source, (n,), 0.5) for n in sizes]
    assert source._pending is not None  # the last draw left one pending
    for ours, ref in zip(draws, reference_draws(11, sizes)):
        assert torch.equal(ours, ref)


def test_a_checkpoint_taken_with_a_draw_pending_resumes_the_same_stream():
    size = (BIG[0],)
    source = NoiseSource(seed=3)
    draw_then_ahead(source, size, 1.0)
    source._pending[2].result()  # the prefetch has advanced the generator by now
    state = source.state_dict()  # ...and the checkpoint holds the state from before it
    later = [draw_then_ahead(source, size, 1.0) for _ in range(2)]
    resumed = NoiseSource(seed=999)
    draw_then_ahead(resumed, size, 1.0)  # its own pending draw must be dropped on load
    resumed.load_state_dict(state)
    assert all(torch.equal(a, draw_then_ahead(resumed, size, 1.0)) for a in later)
    assert resumed.num_draws == source.num_draws


def test_user_generators_and_secure_mode_are_never_drawn_ahead():
    gen = torch.Generator().manual_seed(0)
    shared = NoiseSource(generator=gen)
    draw_then_ahead(shared, BIG, 1.0)
    secure = NoiseSource(secure_mode=True)
    draw_then_ahead(secure, BIG, 1.0)
    assert shared._pending is None and secure._pending is None
    # the user's generator advanced by exactly one draw
    twin = torch.Generator().manual_seed(0)
    torch.normal(0.0, 1.0, size=BIG, generator=twin)
    assert torch.equal(gen.get_state(), twin.get_state())


def test_the_optimizer_draws_ahead_after_its_update_not_during_it(monkeypatch):
    """The next step's noise is started at the end of step(): during the update the worker is idle
    (it would compete for the cores with the update's own threads)."""
    params = [torch.nn.Parameter(torch.zeros(BIG))]
    opt = create_dp_optimizer(
        "dp-microadam", params, lr=1e-3, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=2.0
    )
    pending_during_update = []
    real_update = opt.update
    monkeypatch.setattr(
        opt, "update", lambda: (pending_during_update.append(opt.noise_source._pending), real_update())
    )
    for _ in range(3):
        params[0].grad_sample = torch.randn(2, *BIG)
        opt.step()
        opt.zero_grad()
        assert opt.noise_source._pending is not None  # the next draw is under way
    assert pending_during_update == [None, None, None]
