"""The tensor-core ghost path's error bound, exercised on the CPU (tests/test_gpu.py runs it on CUDA).

The bf16 ghost norms and book-keeping sums take a CUDA-only branch (:mod:`dp_hf.per_example.ghost.tensor_cores`):
bf16 GEMMs with float32 accumulation, and clip factors from norms inflated by a proven bound. Machines
without a GPU never ran it. Here ``Tensor.is_cuda`` is made True and ``torch.mm``/``torch.bmm`` accept
``out_dtype=torch.float32`` for bf16 operands, computed as exact bf16 products with float32 accumulation
(``"fp32"``: the CPU's GEMM; ``"truncating"``: tensor-core-like blocks of 8 aligned by truncation and
rounded toward zero, after Fasi et al. 2021). Every example's share of the released sum must stay <= C,
and the book-keeping deviation must stay within (and near) its stated bound ``eta f sqrt(E)``.
"""

from __future__ import annotations

import pytest
import torch

from dp_hf.per_example.ghost import attach_fast_clipping, kernels, norms
from dp_hf.per_example.ghost.grams import U_TENSOR_CORES
from dp_hf.per_example.ghost.kernels import Outer
from dp_hf.per_example.ghost.records import ParamRecord
from dp_hf.per_example.ghost.tensor_cores import ETA
from dp_hf.precision import ieee_float32_matmuls
from dp_hf.privatizer import Geometry


def _truncating_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (bf16 in, float32 out) in blocks of 8 products, aligned by truncation, rounded toward zero."""
    ad, bd = a.double(), b.double()
    acc = torch.zeros(*ad.shape[:-1], bd.shape[-1], dtype=torch.float32)
    for k in range(0, a.shape[-1], 8):
        terms = torch.cat(
            [
                ad[..., :, k : k + 8].unsqueeze(-1) * bd[..., k : k + 8, :].unsqueeze(-3),
                acc.double().unsqueeze(-2),
            ],
            dim=-2,
        )
        top = terms.abs().amax(dim=-2, keepdim=True)
        grid = torch.exp2(torch.floor(torch.log2(torch.where(top > 0, top, torch.ones_like(top)))) - 23)
        total = (torch.trunc(terms / grid) * grid).sum(dim=-2)
        acc = total.float()
        acc = torch.where(acc.double().abs() > total.abs(), torch.nextafter(acc, torch.zeros_like(acc)), acc)
    return acc


@pytest.fixture(params=["fp32", "truncating"])
def fake_tensor_cores(request, monkeypatch):
    emulate = (lambda a, b: a.float() @ b.float()) if request.param == "fp32" else _truncating_gemm
    calls = []

    def with_out_dtype(real):
        def op(a, b, *args, out_dtype=None, out=None, **kwargs):
            if out_dtype is None:
                return real(a, b, *args, out=out, **kwargs)
            assert out_dtype == torch.float32 and a.dtype == b.dtype == torch.bfloat16
            calls.append((real.__name__, a, b))
            return emulate(a, b) if out is None else out.copy_(emulate(a, b))

        return op

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch, "mm", with_out_dtype(torch.mm))
    monkeypatch.setattr(torch, "bmm", with_out_dtype(torch.bmm))
    return calls


def _released(outer: Outer, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The released clipped sum ``[R, C]`` (float64) and the norms used, for one parameter's outer."""
    param = torch.zeros(outer.num_rows, outer.cols.shape[-1])
    with ieee_float32_matmuls():
        (total,), used = norms.clipped_sum(
            [ParamRecord(param, None, [outer])],
            [param],
            Geometry(clip),
            ghost=True,
            batch=outer.batch_size,
            device=torch.device("cpu"),
            budget=256 << 20,
        )
    return total.double(), used.double()


def _true_gradients(outer: Outer) -> torch.Tensor:
    return torch.einsum("btr,btc->brc", outer.rows.double(), outer.cols.double())


def _alternating(positions: int, width: int) -> torch.Tensor:
    x = torch.zeros(positions, width)
    x[:, 0] = 8192.0 * (-1.0) ** torch.arange(positions)
    x[:, 1] = 1.0
    return x


def test_each_example_releases_at_most_c(fake_tensor_cores):
    """Examples with C just above and below their norms, orthogonal positions (mass / norm^2 = T), and
    positions whose gradients cancel (the float32 norm rounds to 0), each released alone."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 32, 64, generator=generator)
    cols = torch.randn(4, 32, 96, generator=generator)
    cols[1] = 3 * torch.eye(32, 96)
    rows[2], cols[2] = _alternating(32, 64), torch.ones(32, 96)
    outer = Outer(rows.bfloat16(), cols.bfloat16(), 64)
    true = _true_gradients(outer).flatten(1).norm(dim=1)
    for i in range(4):
        alone = Outer(outer.rows[i : i + 1], outer.cols[i : i + 1], 64)
        for clip in (float(true[i]) * (1 - 1e-7), float(true[i]) * (1 + 1e-7), float(true[i]) / 3):
            released, used = _released(alone, clip)
            assert float(used[0]) >= float(true[i])  # inflated by the bound, never below the true norm
            assert float(released.norm()) <= clip * (1 + 1e-6), (i, clip)
    assert fake_tensor_cores  # the tensor-core GEMMs ran


@pytest.mark.parametrize("split", ["cols", "rows"])  # the narrower factor takes f and the split
def test_the_book_keeping_deviation_is_within_its_stated_bound_and_near_it(fake_tensor_cores, split):
    """A factor f whose bf16 split leaves nearly the largest remainder: the deviation of the released sum
    from f G must stay below eta f sqrt(E), and above a quarter of it (a bound too small by 4 fails)."""
    wide = torch.ones(1, 2, 256).bfloat16()
    narrow = torch.zeros(1, 2, 64)
    narrow[0, :, 0] = 1.0
    narrow = narrow.bfloat16()
    outer = Outer(wide, narrow, 256) if split == "cols" else Outer(narrow, wide, 64)
    _, used = _released(outer, 1e30)
    target = torch.tensor((1 + 2**-9 + 2**-17) * 2**-12, dtype=torch.float32).item()
    released, _ = _released(outer, target * float(used[0]))
    factor = target  # min(1, C / nu) with C = target * nu
    deviation = float((released - factor * _true_gradients(outer)[0]).norm())
    mass_root = 2 * 256**0.5  # sum_t ||rows_t|| ||cols_t||
    bound = ETA * factor * mass_root
    assert bound / 4 < deviation <= bound
    # the sum's GEMMs multiply the wide factor as recorded (the float32 split is of the narrow one: half
    # the transient memory for an MLP's 3.5x wider gradient)
    sums = [(a, b) for name, a, b in fake_tensor_cores[-2:]]
    assert all(name == "mm" for name, _, _ in fake_tensor_cores[-2:])
    for a, b in sums:
        operand = a.t() if split == "cols" else b
        assert torch.equal(operand, wide.reshape(-1, 256))


def test_the_book_keeping_split_is_two_kernels_without_a_float32_copy(fake_tensor_cores):
    """``hi = bf16(f x)`` and ``-lo = bf16(hi - f x)`` are one kernel each, computed in float32 and written in
    bf16: the narrower factor is read twice and never copied to float32 (on a GPU: 10 bytes of traffic
    per entry in two kernels, against 28 in four with a float32 product, its bf16 cast, the remainder
    and its cast). Their sum is the released sum's (its bits: the float32 product's ``hi + lo``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    generator = torch.Generator().manual_seed(0)
    outer = Outer(
        torch.randn(4, 8, 64, generator=generator).bfloat16(),
        torch.randn(4, 8, 96, generator=generator).bfloat16(),
        64,
    )
    factors = torch.rand(4, generator=generator)
    made = []

    class Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and tuple(out.shape) == (4, 8, 64):
                made.append((func.overloadpacket.__name__, out.dtype))
            return out

    with Outputs():
        total = kernels.outer_weighted_sum(outer, factors, tensor_cores=True)
    assert [(name, dtype) for name, dtype in made if name != "empty"] == [
        ("mul", torch.bfloat16),
        ("addcmul", torch.bfloat16),
    ]
    # Entrywise within the split's 2^-17 and the two GEMMs' accumulation of their abs products.
    scaled = (outer.rows.double() * factors.double()[:, None, None]).reshape(-1, 64)
    cols = outer.cols.double().reshape(-1, 96)
    bound = (2**-17 + 2 * 32 * U_TENSOR_CORES) * (scaled.abs().t() @ cols.abs())
    error = (total.double() - scaled.t() @ cols).abs()
    assert (error <= bound).all() and error.max() > 0


def test_the_guard_and_the_bound_take_each_factors_position_norms_once(fake_tensor_cores):
    """On tensor cores the cancellation guard's mass and the rounding bound's mass read the same position
    norms (every outer of a bf16 model is a tensor-core one): an outer outside a bank has its two factors'
    norms taken once per pass, not once by each."""
    from torch.profiler import ProfilerActivity, profile

    generator = torch.Generator().manual_seed(0)
    outer = Outer(
        torch.randn(4, 8, 64, generator=generator).bfloat16(),
        torch.randn(4, 8, 96, generator=generator).bfloat16(),
        64,
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _released(outer, 1.0)
    norms_taken = sum(1 for e in prof.events() if e.name == "aten::linalg_vector_norm")
    assert norms_taken == 2, norms_taken


def test_each_tensor_bounds_its_own_grams(fake_tensor_cores):
    """delta_t follows each tensor's widest contraction: a 4096-wide tensor (an LM head) does not widen a
    64-wide tensor's term. D_i = sum_t delta_t (sum_k S_k)^2, against a direct computation in float64."""
    from dp_hf.per_example.ghost.tensor_cores import U_TENSOR_CORES, gamma, rounding_bound

    generator = torch.Generator().manual_seed(1)
    narrow = Outer(*(torch.randn(3, 5, 64, generator=generator).bfloat16() for _ in range(2)), 64)
    wide = Outer(
        torch.randn(3, 5, 4096, generator=generator).bfloat16(),
        torch.randn(3, 5, 32, generator=generator).bfloat16(),
        4096,
    )
    records = [
        ParamRecord(torch.zeros(64, 64), None, [narrow]),
        ParamRecord(torch.zeros(4096, 32), None, [wide]),
    ]
    bound = rounding_bound(records, 3, torch.device("cpu"))

    def mass(o: Outer) -> torch.Tensor:
        return (o.rows.double().norm(dim=-1) * o.cols.double().norm(dim=-1)).sum(dim=1).square()

    def delta(width: int) -> float:
        return (1 + gamma(width, U_TENSOR_CORES)) ** 2 * (1 + gamma(3)) - 1

    expected = delta(64) * mass(narrow) + delta(4096) * mass(wide)
    # (the position norms are float32's: 1e-5)
    torch.testing.assert_close(bound.gram_error, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(bound.mass, mass(narrow) + mass(wide), rtol=1e-5, atol=0)
    assert bound.delta == delta(4096) > 50 * delta(64)


def _exact_per_example(record: ParamRecord, batch: int) -> torch.Tensor:
    """``G_i`` of one recorded tensor in float64 from its (exact bf16) factors: ``[B, numel]``."""
    total = torch.zeros(batch, record.param.numel(), dtype=torch.float64)
    if record.dense is not None:
        total += record.dense.double().reshape(batch, -1)
    for o in record.outers:
        cols = o.cols.double()
        if o.rows_are_ids:
            rows = torch.nn.functional.one_hot(o.rows.expand(batch, -1), o.num_rows).double()
        else:
            rows = o.rows.double()
        total += torch.einsum("btr,btc->brc", rows, cols).reshape(batch, -1)
    return total


def _wide_gpt2():
    from tiny_models import tiny_gpt2_lm

    return tiny_gpt2_lm(n_embd=64, n_inner=96)


def _wide_llama():
    from tiny_models import tiny_llama_lm

    return tiny_llama_lm(hidden_size=64, intermediate_size=96)


# (model, its Linear / Conv1D weights that keep (a, g) factors): wide enough for 8 positions that every
# product layer records tensor-core outers
CAUSAL_LMS = {"gpt2": (_wide_gpt2, 9), "llama": (_wide_llama, 15)}


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("name", list(CAUSAL_LMS))
def test_a_bf16_causal_lm_on_the_tensor_core_path_clips_every_example_to_c(fake_tensor_cores, name, mode):
    """The CUDA bf16 paths end to end on real architectures, emulated: ghost norms (the rounding bound) and
    materialized ones (the norm-level slack of a geometry's path). GPT-2: tied LM head and embedding,
    Conv1D, LayerNorm, position embeddings in a bank. Llama: RMSNorm (scale hooks), grouped q/k/v, gated
    MLP, untied head. The norms the clip factors use exceed the float64 norms of the recorded per-example
    gradients, and no example contributes more than C."""
    build, product_layers = CAUSAL_LMS[name]
    torch.manual_seed(0)
    model = build().to(torch.bfloat16)
    clipping = attach_fast_clipping(model, mode=mode)
    ids = torch.randint(0, model.config.vocab_size, (4, 8))
    logits = model(input_ids=ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    loss.sum(dim=1).sum().backward()
    params = [p for p in model.parameters() if p.requires_grad]
    records = [clipping.recorder.records[id(p)] for p in params]
    assert sum(not o.rows_are_ids for r in records for o in r.outers) >= product_layers
    with torch.no_grad():  # (the native path records the layers' inputs themselves, which require grad)
        true = torch.cat([_exact_per_example(r, 4) for r in records], dim=1).norm(dim=1)
    max_grad_norm = float(true.median())
    _, norms = clipping.clipped_sum(params, Geometry(max_grad_norm))
    clipping.remove()
    assert any(name == "bmm" for name, _, _ in fake_tensor_cores)  # the Grams ran on (emulated) tensor cores
    assert (norms.double() > true * (1 + 1e-6)).all(), (norms.double() / true - 1).min()  # inflated
    factors = (max_grad_norm / norms.double()).clamp(max=1.0)
    assert (factors * true <= max_grad_norm * (1 + 1e-12)).all()
    assert (true > max_grad_norm).sum() >= 1 and (true < max_grad_norm).sum() >= 1


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_tied_tensors_embedding_use_never_meets_tensor_cores(fake_tensor_cores):
    """A tied embedding and LM head in a bf16 model: the cross term between the embedding's use (one-hot
    rows, not a tensor-core outer, outside the bound) and the head's multiplies their cols in float32.
    On tensor cores its truncating error would be in no term of the bound."""
    generator = torch.Generator().manual_seed(0)
    batch, positions, vocab, width = 3, 6, 40, 16
    ids = torch.randint(0, vocab, (batch, positions), generator=generator)
    embedding = Outer(ids, torch.randn(batch, positions, width, generator=generator).bfloat16(), vocab, True)
    head = Outer(
        torch.randn(batch, positions, vocab, generator=generator).bfloat16(),
        torch.randn(batch, positions, width, generator=generator).bfloat16(),
        vocab,
    )
    param = torch.zeros(vocab, width)
    record = ParamRecord(param, None, [embedding, head])
    true = _exact_per_example(record, batch).norm(dim=1)
    with ieee_float32_matmuls():
        (total,), used = norms.clipped_sum(
            [record], [param], Geometry(float(true.median())), ghost=True, batch=batch,
            device=torch.device("cpu"), budget=256 << 20,
        )  # fmt: skip
    assert fake_tensor_cores  # the head's own Grams and sum ran on (emulated) tensor cores
    for _, a, b in fake_tensor_cores:
        assert _storage(embedding.cols) not in (_storage(a), _storage(b))
    assert (used.double() >= true).all()


def test_a_geometrys_tensor_core_norms_bound_each_examples_contribution(fake_tensor_cores):
    """A geometry (DP-MacAdam, scale-then-privatize, materialize mode) on bf16 CUDA outers: ``G^_i`` and
    ``A^_i = sum_t |rows_t| (x) |cols_t|`` on tensor cores, and a book-keeping sum split for tensor cores. The
    norm the factor uses is never below the true ``||(G_i - c) / s||``, and each example's contribution in
    w coordinates, ``(f_i (G_i - c) + D_i) / s``, is at most C: C just above and below the true norm, and
    an example whose positions cancel (``||A_i||`` ~2^13 times ``||G_i||``)."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 32, 24, generator=generator)
    cols = torch.randn(4, 32, 16, generator=generator)
    rows[2], cols[2] = _alternating(32, 24), torch.ones(32, 16)
    outer = Outer(rows.bfloat16(), cols.bfloat16(), 24)
    scale = torch.rand(24, 16, generator=generator) + 0.5
    shift = 0.01 * torch.randn(24, 16, generator=generator)
    exact = _true_gradients(outer)
    true = ((exact - shift.double()) / scale.double()).flatten(1).norm(dim=1)
    param = torch.zeros(24, 16)
    for i in range(4):
        alone = Outer(outer.rows[i : i + 1], outer.cols[i : i + 1], 24)
        for clip in (float(true[i]) * (1 - 1e-7), float(true[i]) * (1 + 1e-7), float(true[i]) / 3):
            fake_tensor_cores.clear()
            with ieee_float32_matmuls():
                (total,), used = norms.clipped_sum(
                    [ParamRecord(param, None, [alone])], [param], Geometry(clip, shift=[shift], scale=[scale]),
                    ghost=False, batch=1, device=torch.device("cpu"), budget=256 << 20,
                )  # fmt: skip
            assert {name for name, _, _ in fake_tensor_cores} == {"bmm", "mm"}  # G^, A^; the split sum
            # (the cancelling example is redone in float64 by the cancellation guard: exact up to the cast)
            assert float(used[0]) >= float(true[i]) * (1 - 2.0**-24 if i == 2 else 1)
            assert float(total.double().norm()) <= clip * (1 + 1e-6), (i, clip)
            if i != 2:  # the slack is small where nothing cancels
                assert float(used[0]) <= float(true[i]) * (1 + 1e-3)


def _causal_lm_like(batch: int, positions: int, generator: torch.Generator) -> Outer:
    """Per-position output gradients nearly orthogonal (a token-level loss: each position's own target)
    against dense inputs with a shared component: ``E_i / ||G_i||^2`` near ``T``, as in a causal LM."""
    rows = 0.05 * torch.randn(batch, positions, 64, generator=generator)
    rows[:, torch.arange(positions), torch.arange(positions)] += 1.0
    cols = 1.0 + 0.3 * torch.randn(batch, positions, 256, generator=generator)
    return Outer(rows.bfloat16(), cols.bfloat16(), 64)


@pytest.mark.parametrize("scale", [1.0, 2.0**-37], ids=["normal", "products_below_float32s_range"])
def test_the_frobenius_sums_own_rounding_is_within_its_term(scale):
    """With the Grams taken as exact (``g_r = g_c = 0``), what ``gram_product_error`` adds is the rounding of
    its own float32 products and sums: ``|<R^, C^> computed - exact| <= error``, also where a GPU kernel
    flushes subnormal products to zero. At ``2^-37`` scale the Gram entries are ``~2^-74`` and their
    products below float32's normal range: flushed, they lose far more than the relative term ``u W_c``,
    which only the ``FLUSH`` terms cover."""
    from dp_hf.per_example.ghost.grams import gamma, gram_product_error

    generator = torch.Generator().manual_seed(0)
    factors = [scale * torch.randn(3, 24, 40, generator=generator, dtype=torch.float64) for _ in range(2)]
    grams = [(x @ x.transpose(1, 2)).float() for x in factors]
    norms = [x.norm(dim=-1).float() * (1 + 2**-20) for x in factors]  # upper bounds on ||x_t||
    value, error = gram_product_error(
        grams[0], grams[1], (norms[0], norms[0], norms[1], norms[1]), (0.0, 0.0)
    )
    exact = (grams[0].double() * grams[1].double()).sum(dim=(1, 2))
    products = grams[0] * grams[1]
    flushed = torch.where(products.abs() < 2.0**-126, 0.0, products).double().sum(dim=(1, 2))
    for computed in (value, flushed):
        assert ((computed - exact).abs() <= error).all()
    assert ((value - exact).abs() > 0).all()
    n = norms[1].double()
    relative = 2**-24 * torch.einsum("bs,bst,bt->b", n, grams[0].double().abs(), n) * (1 + 2 * gamma(48))
    if scale < 1:
        assert ((flushed - exact).abs() > relative).all(), (flushed - exact, relative)
    else:  # far inside float32's range the relative term is the bound (the FLUSH terms vanish beside it)
        assert (error <= 1.001 * relative).all() and (error <= 2**-20 * exact.abs()).all()


def test_the_bound_weighs_each_grams_error_by_the_other_grams_entries(fake_tensor_cores):
    """The first-order terms ``g_r n_r^T |C^| n_r + g_c n_c^T |R^| n_c``, computed from the pass's own Grams,
    against a float64 reference; they bound the actual error, and on causal-LM-like factors (nearly
    orthogonal gradients against 4x wider inputs, as an MLP's output projection) they are several times
    below the Gram-free ``delta_t (sum_t S_t)^2``. Two
    outers of one length go through a bank; a third, alone, through the per-layer path: the same terms."""
    from dp_hf.per_example.ghost import kernels
    from dp_hf.per_example.ghost.tensor_cores import U_TENSOR_CORES, gamma, rounding_bound, second_order

    generator = torch.Generator().manual_seed(0)
    batch, positions = 3, 32
    outers = [_causal_lm_like(batch, positions, generator) for _ in range(2)]
    outers.append(_causal_lm_like(batch, 2 * positions, generator))
    records = [ParamRecord(torch.zeros(64, 256), None, [o]) for o in outers]
    params = [r.param for r in records]
    grams = kernels.GramCache()
    with ieee_float32_matmuls():
        sq = norms.sq_norms(
            records, params, Geometry(1.0), ghost=True, batch=batch, device=torch.device("cpu"),
            budget=256 << 20, dtype=torch.float32, grams=grams,
        )  # fmt: skip
        bound = rounding_bound(records, batch, torch.device("cpu"), grams)
    assert len(grams.errors) == 3
    g_r, g_c = gamma(64, U_TENSOR_CORES), gamma(256, U_TENSOR_CORES)
    expected, gram_free, true = [], [], []
    for o, record in zip(outers, records):
        rows_gram = kernels.batched_matmul(o.rows, o.rows.transpose(1, 2), torch.float32, True).double()
        cols_gram = kernels.batched_matmul(o.cols, o.cols.transpose(1, 2), torch.float32, True).double()
        n_r, n_c = o.rows.double().norm(dim=-1), o.cols.double().norm(dim=-1)
        # (the float32 products R^ C^ err by u |R^| |C^|, folded into the |R^| term; the float32 weighted
        # sums' own rounding: 1 + 2 g_(Tx+Ty))
        first = g_r * torch.einsum("bs,bst,bt->b", n_r, cols_gram.abs(), n_r)
        first += (g_c + 2**-24 * (1 + g_c)) * torch.einsum("bs,bst,bt->b", n_c, rows_gram.abs(), n_c)
        first *= 1 + 2 * gamma(2 * o.cols.shape[1])
        mass = (n_r * n_c).sum(dim=1).square()
        torch.testing.assert_close(grams.errors[(o.keys, o.keys)], first, rtol=1e-5, atol=0)
        expected.append(first + second_order(record, [o]) * mass)
        gram_free.append(((1 + g_c) ** 2 * (1 + gamma(3)) - 1) * mass)  # the wider contraction's
        true.append(_exact_per_example(record, batch).square().sum(dim=1))
    torch.testing.assert_close(bound.gram_error, sum(expected), rtol=1e-5, atol=0)
    assert (bound.gram_error < sum(gram_free) / 4).all(), bound.gram_error / sum(gram_free)
    assert ((sq - sum(true)).abs() <= bound.gram_error).all()
    # the per-layer path, one example per chunk, leaves the bank's terms (same Grams, same norms)
    chunked = kernels.GramCache()
    kernels.outer_sq_norm(outers[0], 1, torch.float32, chunked)
    key = (outers[0].keys, outers[0].keys)
    torch.testing.assert_close(chunked.errors[key], grams.errors[key], rtol=1e-6, atol=0)
    # A tensor of one position (its norm is two dot products, no Gram) keeps the Gram-free term.
    single = _causal_lm_like(batch, 1, generator)
    records.append(ParamRecord(torch.zeros(64, 256), None, [single]))
    grams = kernels.GramCache()
    with ieee_float32_matmuls():
        norms.sq_norms(
            records, params + [records[-1].param], Geometry(1.0), ghost=True, batch=batch,
            device=torch.device("cpu"), budget=256 << 20, dtype=torch.float32, grams=grams,
        )  # fmt: skip
        bound = rounding_bound(records, batch, torch.device("cpu"), grams)
    mass = (single.rows.double().norm(dim=-1) * single.cols.double().norm(dim=-1)).sum(dim=1).square()
    alone = ((1 + g_c) ** 2 * (1 + gamma(3)) - 1) * mass
    torch.testing.assert_close(bound.gram_error, sum(expected) + alone, rtol=1e-5, atol=0)


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("budget", [256 << 20, 40_000], ids=["one-chunk", "chunked"])
def test_equal_shape_layers_summed_in_groups_equal_the_per_layer_sums(
    fake_tensor_cores, monkeypatch, mode, budget
):
    """The book-keeping sums of equal-shape bf16 layers run as a few batched GEMMs per group
    (ghost/grouped.py): each layer's sum equals the per-layer split's (same bf16 operands, float32 sums) up to
    the GEMMs' blocking, the norms are unchanged, dropped examples (a NaN gradient) stay out, and the pass
    makes fewer tensor-core GEMM calls. ``chunked``: a budget of ~1.5 layers per chunk."""
    from dp_hf.per_example.ghost import grouped

    build, _ = CAUSAL_LMS["llama"]

    def clip(group: bool):
        if not group:
            monkeypatch.setattr(norms, "grouped_tensor_core_sums", lambda *args: {})
        fake_tensor_cores.clear()
        torch.manual_seed(0)
        model = build().to(torch.bfloat16)
        clipping = attach_fast_clipping(model, mode=mode, chunk_bytes=budget)
        ids = torch.randint(0, model.config.vocab_size, (4, 8))
        embeds = model.get_input_embeddings()(ids).detach()
        embeds[1, 3] = float("nan")  # example 1: NaN inputs and gradients in every layer, dropped
        logits = model(inputs_embeds=embeds).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
        loss.sum(dim=1).sum().backward()
        params = [p for p in model.parameters() if p.requires_grad]
        geometry = Geometry(0.05)
        if mode == "materialize":  # a geometry: the grouped sums must be mapped to w coordinates too
            generator = torch.Generator().manual_seed(1)
            geometry = Geometry(
                0.05,
                shift=[torch.randn(p.shape, generator=generator) * 1e-3 for p in params],
                scale=[torch.rand(p.shape, generator=generator) + 0.5 for p in params],
            )
        sums, used = clipping.clipped_sum(params, geometry)
        clipping.remove()
        return sums, used, len(fake_tensor_cores)

    made = []
    real = grouped.grouped_tensor_core_sums
    monkeypatch.setattr(norms, "grouped_tensor_core_sums", lambda *args: made.append(real(*args)) or made[-1])
    sums, used, gemms = clip(True)
    assert len(made) == 1 and len(made[0]) >= 8  # q/o, k/v, the MLP's weights: groups of two layers or more
    per_layer_sums, per_layer_used, per_layer_gemms = clip(False)
    assert torch.isnan(used[1]) and torch.equal(used[~used.isnan()], per_layer_used[~per_layer_used.isnan()])
    for a, b in zip(sums, per_layer_sums):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    assert gemms < per_layer_gemms, (gemms, per_layer_gemms)
