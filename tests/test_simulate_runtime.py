"""The simulation's runtimes come from the runtime registry (atom_core/runtime/registry.py), by
the run's `runtime` name, like every command's: each server's runtime is the registered kind's
`load` for that server's Config, the run's tokens are checked against the kind's `oracle`, and a
name the registry does not hold (or a kind without a model or an oracle) is refused naming the
ones there are."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from atom_core import simulate
from atom_core.config import Config
from atom_core.runtime import registry
from atom_core.runtime.registry import RuntimeRequest, UnknownRuntimeError
from atom_core.simulate import driver
from atom_core.simulate.dimensions import batcher_configs

STEPS = 30


class Loads:
    """The registered reference kind's `load`, recording each (Config, request, runtime)."""

    def __init__(self) -> None:
        self.real = registry.get("reference")
        self.made: list[tuple[Config, RuntimeRequest, Any]] = []

    def __call__(self, conf: Config, req: RuntimeRequest) -> Any:
        assert self.real.load is not None
        rt = self.real.load(conf, req)
        self.made.append((conf, req, rt))
        return rt


@pytest.mark.parametrize("mode", ["colocated", "pd"])
def test_each_server_runtime_is_the_registered_kinds(scratch_registry: None, mode: str) -> None:
    loads = Loads()
    registry.register(attrs.evolve(loads.real, load=loads))
    wrapped: list[Any] = []

    def seen(rt: Any, side: str) -> Any:  # the runtimes the servers got, unchanged
        wrapped.append(rt)
        return rt

    report = simulate.run(3, STEPS, mode=mode, wrap_runtime=seen)
    assert report.ok, report
    assert report.completed > 0
    # one load per server, for that server's Config, and it is what the server runs on
    assert len(loads.made) == (2 if mode == "pd" else 1)
    assert [rt for _, _, rt in loads.made] == wrapped
    assert all(a is b for (_, _, a), b in zip(loads.made, wrapped, strict=True))
    configs = batcher_configs(simulate.draw_config(3, {"mode": mode}))
    assert sorted(map(repr, (c for c, _, _ in loads.made))) == \
        sorted(map(repr, configs.values()))
    # the seeded model every seed shares, at the workload's vocabulary
    assert {req for _, req, _ in loads.made} == {RuntimeRequest(seed=0, vocab_size=128)}


def test_the_tokens_are_checked_against_the_registered_kinds_oracle(
        scratch_registry: None) -> None:
    real = registry.get("reference")
    assert real.load is not None and real.oracle is not None

    def other_model(rt: Any) -> Any:  # the oracle of the same shapes, other weights
        conf = Config(lanes=1, kv_blocks=1, max_seq_len=rt.max_seq_len,
                      prefill_chunk=rt.prefill_chunk, sliding_window=rt.sliding_window)
        return real.oracle(real.load(conf, RuntimeRequest(seed=1, vocab_size=rt.vocab_size)))

    registry.register(attrs.evolve(real, oracle=other_model))
    report = simulate.run(3, STEPS, mode="colocated", faults=frozenset())
    assert not report.ok and report.token_mismatches > 0


@pytest.mark.parametrize("name", ["nope", "rbln"])
def test_a_runtime_the_simulation_cannot_run_is_refused_by_name(name: str) -> None:
    # rbln is registered but has no oracle (nor a model the simulation could load)
    cfg = attrs.evolve(simulate.draw_config(0), runtime=name)
    with pytest.raises(UnknownRuntimeError,
                       match=rf"^runtime {name}: unknown; give one of \['hf', 'reference'\]$"):
        driver.Sim(cfg, frozenset(), STEPS)
