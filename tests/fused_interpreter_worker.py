"""Runs dp_hf's fused geometry-norm kernel in Triton's interpreter for tests/test_fused_norms.py.

Never collected by pytest (the name does not start with ``test_``). A process of its own: Triton decides
between compiling and interpreting when its modules are imported (its library's own ``@jit`` functions,
``tl.sum`` among them), so ``TRITON_INTERPRET=1`` must be set before the first ``import triton``, which the
pytest process cannot do without turning every later test's Triton into the interpreter::

    TRITON_INTERPRET=1 python tests/fused_interpreter_worker.py OUT.pt

Writes a dict of tensors (the cases' inputs and outputs) that the tests compare with float64 references.
"""

from __future__ import annotations

import os
import sys
import warnings

os.environ["TRITON_INTERPRET"] = "1"
os.environ.pop("DP_HF_FUSED_NORMS", None)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from dp_hf.per_example.ghost import attach_fast_clipping, fused  # noqa: E402
from dp_hf.privatizer import Geometry  # noqa: E402

# Shapes off the 64 x 64 x 32 blocks and more examples than one program takes (8).
BATCH, POSITIONS, NUM_ROWS, NUM_COLS = 11, 37, 70, 130
KERNEL_CASES = {
    "float32-shift-scale": (torch.float32, True, True, False),
    "float32-scale-strided": (torch.float32, False, True, True),
    "float32-identity": (torch.float32, False, False, False),
    "bf16-shift-scale": (torch.bfloat16, True, True, False),
    "bf16-identity-strided": (torch.bfloat16, False, False, True),
}


def kernel_case(dtype: torch.dtype, shift: bool, scale: bool, strided: bool) -> dict:
    """One launch on random factors (a transposed, strided ``cols`` if asked; example 3 all zeros)."""
    rows = torch.randn(BATCH, POSITIONS, NUM_ROWS).to(dtype)
    cols = torch.randn(BATCH, POSITIONS, NUM_COLS).to(dtype)
    if strided:
        cols = torch.randn(BATCH, NUM_COLS, POSITIONS).to(dtype).transpose(1, 2)
    rows[3] = 0
    c = torch.randn(NUM_ROWS, NUM_COLS) * 3 if shift else None
    s = torch.rand(NUM_ROWS, NUM_COLS) + 0.1 if scale else None
    fused._checked.clear()
    sq, ident, absolute = fused.fused_outer_norms(rows, cols, c, s, absolute=True)
    return {
        "rows": rows, "cols": cols, "shift": c, "scale": s, "strided": not cols.is_contiguous(),
        "sq": sq, "ident": ident, "abs": absolute, "checked": bool(fused._checked), "disabled": list(fused._disabled),
    }  # fmt: skip


class TokenMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 24)
        self.up = nn.Linear(24, 80)
        self.down = nn.Linear(80, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.down(torch.relu(self.up(self.emb(ids))))).sum(dim=(1, 2))


def clip_in_geometry() -> tuple[list[torch.Tensor], torch.Tensor]:
    """A materialize-mode clipping pass of a fixed model and batch in a fixed random geometry."""
    torch.manual_seed(0)
    model = TokenMLP()
    ids = torch.randint(0, 30, (10, 9))
    params = list(model.parameters())
    geometry = Geometry(
        max_grad_norm=0.5,
        shift=[torch.randn_like(p) * 0.1 for p in params],
        scale=[torch.rand_like(p) + 0.05 for p in params],
    )
    clipping = attach_fast_clipping(model, mode="materialize")
    model(ids).sum().backward()
    sums, norms = clipping.clipped_sum(params, geometry)
    clipping.remove()
    return sums, norms


def clipping_cases() -> dict:
    """The clipping pass with the kernel, with the torch path, and with a lossy kernel (caught, then off)."""
    out = {}
    launches = []
    launch = fused._launch
    fused._launch = lambda *a, **k: launches.append(tuple(a[0].shape)) or launch(*a, **k)
    fused._checked.clear()
    out["kernel"] = clip_in_geometry()
    out["launches"] = list(launches)
    os.environ[fused.FUSED_NORMS_ENV] = "0"
    out["torch"] = clip_in_geometry()
    out["launches_when_off"] = len(launches) - len(out["launches"])
    del os.environ[fused.FUSED_NORMS_ENV]

    def lossy(rows, cols, shift, scale, absolute):  # loses a tenth of every norm
        sq, ident, a = launch(rows, cols, shift, scale, absolute)
        return sq * 0.9, ident, a

    fused._launch = lossy
    fused._checked.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["lossy"] = clip_in_geometry()
        out["lossy_again"] = clip_in_geometry()
    out["lossy_warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    out["disabled"] = list(fused._disabled)

    def broken(*args):  # a Triton that cannot build the kernel
        raise RuntimeError("PassManager::run failed")

    fused._launch = broken
    fused._checked.clear()
    fused._disabled.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["broken"] = clip_in_geometry()
    out["broken_warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    fused._launch = launch
    return out


def main(path: str) -> None:
    torch.manual_seed(0)
    results = {"kernel": {name: kernel_case(*case) for name, case in KERNEL_CASES.items()}}
    results["clipping"] = clipping_cases()
    torch.save(results, path)


if __name__ == "__main__":
    main(sys.argv[1])
