"""The harness's options and sizes: the layers, the bmc and z3 sizes, the simulated runs."""

from __future__ import annotations

from typing import Any

import attrs

LAYERS = ("z3", "bmc", "hypothesis", "simulation")

# Small sizes keep the explicit-state search exhaustive at one lane: chunk 2, block 4 tokens
# (a 3-token prompt prefills in two chunks, is a prefix-hit candidate and reaches the block end).
BMC_CHUNK, BMC_SEQ_LEN = 2, 4
Z3_BOUNDED_SIZE = (2, 4)  # lanes, blocks: bounded invariants per size (as tests/test_proofs.py)

# One simulated run per entry (seed = index): colocated and PD, with and without the prefix
# cache, each at the proved minimum of blocks, where a planted bug has the least slack to hide
# in. The other dimensions (scratch, lanes, hybrid, faults) come from the seed.
SIM_RUNS: tuple[dict[str, Any], ...] = (
    {"mode": "colocated", "prefix_cache": True, "extra_blocks": 0},
    {"mode": "colocated", "prefix_cache": False, "extra_blocks": 0},
    {"mode": "pd", "prefix_cache": True, "extra_blocks": 0},
    {"mode": "pd", "prefix_cache": False, "extra_blocks": 0},
)


@attrs.frozen
class Options:
    layers: tuple[str, ...] = LAYERS
    all_layers: bool = False
    examples: int = 200  # hypothesis examples per mutant
    bmc_states: int = 50_000  # one lane: enough to exhaust every combination of the model
    bmc_wide_states: int = 5_000  # two lanes: a bounded prefix of breadth-first order
    sim_runs: int = len(SIM_RUNS)
    sim_steps: int = 100
    sim_timeout: float = 600.0
