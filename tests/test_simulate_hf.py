"""`atom-core simulate --runtime hf`: the seeded fault simulation over HFRuntime (tiny-llama, or
tiny-gemma3 with the seed's window), every finished request checked against transformers'
`generate()`. A few seeds across colocated, PD and hybrid pass; the runtime really is HFRuntime;
a planted wrong token is caught; the seed never draws hf by itself (so every reference seed's
configuration is what it was)."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("transformers")

from atom_core import cli, simulate  # noqa: E402
from atom_core.runtime.hf import HFRuntime  # noqa: E402

STEPS = 30
CASES = {  # name -> fixed dimensions; together colocated, PD, a hybrid window, prefix cache
    "colocated": {"mode": "colocated", "max_seq_len": 128, "sliding_window": None},
    "pd": {"mode": "pd", "max_seq_len": 128, "sliding_window": None},
    "hybrid-prefix": {"mode": "colocated", "max_seq_len": 128, "sliding_window": 16,
                      "prefix_cache": True},
    "hybrid-pd": {"mode": "pd", "max_seq_len": 128, "sliding_window": 16},
}


class Seen:
    """wrap_runtime: records the runtimes the simulation built, unchanged."""

    def __init__(self) -> None:
        self.runtimes: list[Any] = []

    def __call__(self, rt: Any, side: str) -> Any:
        self.runtimes.append(rt)
        return rt


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_seeds_pass_on_hf(name: str, seed: int) -> None:
    seen = Seen()
    rep = simulate.run(seed, STEPS, wrap_runtime=seen, runtime="hf", **CASES[name])
    assert rep.ok, simulate.render(rep)
    assert rep.config["runtime"] == "hf"
    assert rep.completed > 0 and rep.token_mismatches == 0
    assert seen.runtimes and all(isinstance(rt, HFRuntime) for rt in seen.runtimes)
    window = CASES[name]["sliding_window"]
    assert all(rt.sliding_window == window for rt in seen.runtimes)
    assert all(rt.dtype.is_floating_point and rt.num_threads == 1 for rt in seen.runtimes)


class CorruptOneToken:
    """A runtime bug: the 5th decode call returns, for every row, a token one above the right
    one (as in tests/test_simulate.py)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def decode(self, *args: Any) -> Any:
        logits = self.inner.decode(*args)
        self.calls += 1
        if self.calls == 5:
            logits = logits.clone()
            for row, tok in enumerate(logits[:, -1, :].argmax(dim=-1).tolist()):
                logits[row, -1, (tok + 1) % logits.shape[-1]] = logits[row, -1, tok] + 1
        return logits


def test_a_corrupted_token_is_caught_on_hf() -> None:
    rep = simulate.run(1, STEPS, wrap_runtime=lambda rt, side: CorruptOneToken(rt),
                       runtime="hf", mode="colocated", max_seq_len=128)
    assert not rep.ok and rep.token_mismatches > 0 and rep.invariant_violations == 0
    assert "--set runtime=hf" in rep.replay_command()


def test_the_seed_never_draws_hf() -> None:
    assert {simulate.draw_config(seed).runtime for seed in range(60)} == {"reference"}


def test_cli_simulate_runtime_hf(capsys: Any) -> None:
    code = cli.main(["simulate", "--runtime", "hf", "--seeds", "2..3", "--steps", "20",
                     "--set", "max_seq_len=128", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["ok"] is True and out["seeds_run"] == 2
    code = cli.main(["simulate", "--runtime", "hf", "--seed", "2", "--steps", "20",
                     "--set", "max_seq_len=128", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert code == 0 and rep["config"]["runtime"] == "hf" and rep["completed"] > 0
