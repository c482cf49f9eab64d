"""Constants and types shared by the accounting modules (grid, search and size limits)."""

from __future__ import annotations

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

ACCOUNTANTS = ("pld", "rdp", "prv")

# PLD grid: spacing (in nats) of the discretised privacy loss. dp_accounting's default
# 1e-4 is accurate while one step's privacy loss is spread much wider than the grid, but
# overstates epsilon when it is not (small q, large sigma: +87% at q = 1e-4, sigma = 4,
# T = 1e5). So the grid is a tenth of that spread, at most 1e-4; see pld_grid.
PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-4
PLD_GRID_PER_STEP_SPREAD = 0.1

# Searches (calibration, step budgets) first narrow the answer on a 10x coarser grid
# (10x faster, still a valid upper bound, typically 0.1-5% looser), then settle it on the
# accounting grid.
SEARCH_GRID_COARSENING = 10.0

# PLD needs less noise than RDP for the same budget: 0.84-0.95 of it over bench_accounting's settings
# (epsilon 1-10, q 1e-3-0.2, T 10-1e5). The calibration's coarse PLD stage starts its secant steps there
# (where it starts does not change the answer, only how many evaluations find it).
PLD_OVER_RDP_NOISE = 0.9

# The PLD's epsilon is monotone in sigma up to discretisation noise (relative ~1e-8 in epsilon, and
# about as much in sigma). A search infers a sigma's verdict from an evaluated one only when they are
# at least this far apart (relative); closer, it evaluates, as plain bisection would.
MONOTONE_GUARD = 1e-6

# Calibration gives up beyond this noise multiplier (the budget is then unreachable).
MAX_NOISE_MULTIPLIER = 1e6

# The PLD accountant refuses runs whose privacy loss distribution needs more grid points than this
# (one step, a self-composition's FFT or a composition): 2**22 points keep one evaluation within about
# a second and 0.5 GiB. Ordinary runs (epsilon <= 10 at q >= 1e-3) need at most ~1e6; runs beyond the
# limit have an epsilon in the tens or more at small q and T (hundreds otherwise). RDP handles them.
PLD_MAX_POINTS = 1 << 22

RDP_ORDERS = np.array(rdp_privacy_accountant.DEFAULT_RDP_ORDERS)  # RdpAccountant's default orders

# A training history: ((noise_multiplier, sample_rate, num_steps), ...).
History = tuple[tuple[float, float, int], ...]
