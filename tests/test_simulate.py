"""`atom-core simulate`: seeded runs over every feature pass (the host cache tier with stores,
host hits and failed stores and loads actually happening); runs replay exactly; the JSON report
and exit codes; deep mode; and teeth: planted bugs (a corrupted token, a skipped KV copy, a host
load that writes nothing, a mutant core, a lost transfer nobody times out, an adapter that
forgets a block, a host store or a snapshot buffer) are caught, with a shortest failing prefix
shorter than the run."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from atom_core import cli, simulate
from atom_core._generated import core
from atom_core.batcher import AtomBatcher
from atom_core.config import Config
from atom_core.runtime import TorchReferenceRuntime
from atom_core.scheduler import Scheduler
from atom_core.simulate import FAULTS, SimEvent, deep, driver, run, servers
from atom_core.simulate.checks.blocks import block_leaks
from atom_core.simulate.checks.host_tier import host_tier_leaks
from atom_core.snapshots import SnapshotStore

ROOT = Path(__file__).resolve().parents[1]
STEPS = 50

# Each a feature combination; together every feature, and both scratch disciplines on each side.
# The hybrid prefix cache (sliding-window snapshots) only where the spec allows it.
HYBRID_PREFIX = simulate.hybrid_prefix_cache_allowed()
COMBOS = {
    "colocated-prefix-reserved": dict(mode="colocated", sliding_window=None, prefix_cache=True,
                                      scratch="reserved", lanes=2, max_seq_len=128),
    "colocated-prefix-dynamic-min": dict(mode="colocated", sliding_window=None,
                                         prefix_cache=True, scratch="dynamic", lanes=3,
                                         extra_blocks=0, max_seq_len=128),
    "colocated-single-block": dict(mode="colocated", prefix_cache=False, scratch="dynamic",
                                   lanes=1, extra_blocks=0, max_seq_len=128),
    "colocated-hybrid": dict(mode="colocated", sliding_window=16, prefix_cache=HYBRID_PREFIX,
                             scratch="reserved", lanes=2, max_seq_len=128, blocks_per_table=1),
    # a hybrid model with paged tables: hits past the first block restore the sliding state
    "colocated-paged-hybrid": dict(mode="colocated", sliding_window=100, prefix_cache=True,
                                   scratch="dynamic", lanes=2, extra_blocks=0, max_seq_len=256,
                                   blocks_per_table=4),
    "pd-prefix": dict(mode="pd", sliding_window=None, prefill_prefix_cache=True,
                      prefill_scratch="reserved", scratch="dynamic", prefetch=2,
                      max_seq_len=128, blocks_per_table=1),
    "pd-hybrid": dict(mode="pd", sliding_window=64, scratch="reserved",
                      prefill_scratch="dynamic", prefetch=1, lanes=2, max_seq_len=128,
                      blocks_per_table=1),
    # the host cache tier: more shared prefixes than the device cache holds; both PD sides
    "colocated-host": dict(mode="colocated", sliding_window=None, prefix_cache=True,
                           host_cache_blocks=2, lanes=2, max_seq_len=128, blocks_per_table=1),
    "pd-host": dict(mode="pd", sliding_window=None, prefix_cache=True, host_cache_blocks=1,
                    prefill_prefix_cache=True, prefill_host_cache_blocks=3,
                    fallback_local=True, max_seq_len=128, blocks_per_table=1),
    # PD with paged tables: multi-block imports and exports under transfer faults
    "pd-paged": dict(mode="pd", sliding_window=None, prefix_cache=False,
                     prefill_prefix_cache=True, scratch="reserved", prefill_scratch="dynamic",
                     lanes=2, extra_blocks=0, prefetch=1, max_seq_len=256, blocks_per_table=4),
    "pd-paged-hybrid": dict(mode="pd", sliding_window=64, prefix_cache=False, scratch="dynamic",
                            prefill_prefix_cache=True, prefill_scratch="reserved", lanes=2,
                            extra_blocks=0, max_seq_len=256, blocks_per_table=2),
    # paged block tables at the proved minimum: lanes grow their tables under faults
    "colocated-paged-prefix": dict(mode="colocated", sliding_window=None, prefix_cache=True,
                                   scratch="reserved", lanes=2, extra_blocks=0, max_seq_len=256,
                                   blocks_per_table=4, preemption=False, host_cache_blocks=0),
    "colocated-paged-dynamic": dict(mode="colocated", sliding_window=None, prefix_cache=False,
                                    scratch="dynamic", lanes=3, extra_blocks=0,
                                    max_seq_len=128, blocks_per_table=2, preemption=False),
    # the host tier with paged tables: entries of every position stored and loaded back
    "colocated-paged-host": dict(mode="colocated", sliding_window=None, prefix_cache=True,
                                 host_cache_blocks=3, scratch="dynamic", lanes=2,
                                 extra_blocks=0, max_seq_len=256, blocks_per_table=4),
    # preemption at its proved minimum (one table and a block): lanes are preempted and
    # resume under faults
    "colocated-preempt-prefix": dict(mode="colocated", sliding_window=None, prefix_cache=True,
                                     scratch="reserved", lanes=3, extra_blocks=0,
                                     max_seq_len=256, blocks_per_table=4, preemption=True),
    "colocated-preempt-dynamic": dict(mode="colocated", sliding_window=None, prefix_cache=False,
                                      scratch="dynamic", lanes=3, extra_blocks=0,
                                      max_seq_len=128, blocks_per_table=2, preemption=True),
    # a hybrid model with its prefix cache: preempted lanes drop their snapshots
    "colocated-preempt-hybrid": dict(mode="colocated", sliding_window=64, prefix_cache=True,
                                     scratch="dynamic", lanes=3, extra_blocks=0,
                                     max_seq_len=256, blocks_per_table=4, preemption=True),
    # the host tier: entries stored and loaded back between preemptions
    "colocated-preempt-host": dict(mode="colocated", sliding_window=None, prefix_cache=True,
                                   host_cache_blocks=3, scratch="reserved", lanes=3,
                                   extra_blocks=0, max_seq_len=256, blocks_per_table=4,
                                   preemption=True),
}
# seeds whose host stores and loads also fail
# (re-picked when a fault kind is added: each kind draws from the seed's one stream)
SEEDS = {"colocated-host": 6, "pd-host": 16, "colocated-paged-host": 1,
         "colocated-preempt-host": 11, "colocated-prefix-dynamic-min": 0,
         "colocated-preempt-hybrid": 0}
HOST_STATS = ("host_stores", "host_store_failures", "host_hit_tokens", "host_load_failures")


@pytest.fixture(scope="module")
def combo_reports() -> dict[str, simulate.Report]:
    return {name: run(SEEDS.get(name, 7), STEPS, **fixed) for name, fixed in COMBOS.items()}


def total(rep: simulate.Report, *keys: str) -> dict[str, int]:
    return {k: sum(st.get(k, 0) for st in rep.batcher_stats.values()) for k in keys}


@pytest.mark.parametrize("name", list(COMBOS))
def test_every_feature_combination_passes(combo_reports: dict[str, simulate.Report],
                                          name: str) -> None:
    rep = combo_reports[name]
    assert rep.ok, simulate.render(rep)
    for key, value in COMBOS[name].items():
        assert rep.config.get(key) == value, key  # the fixed dimensions were honoured
    assert rep.requests >= 10 and rep.completed >= 5
    assert rep.completed + rep.errors + rep.aborted == rep.requests  # each ended once
    assert rep.faults_injected > 0 and rep.failing_prefix is None
    # the features were exercised, not just configured
    got = total(rep, "prefix_hit_tokens", "snapshots", "imported_tokens", "decode_steps",
                "host_stores", "table_grows", "preemptions")
    cached = rep.config.get("prefix_cache") or rep.config.get("prefill_prefix_cache")
    assert (got["prefix_hit_tokens"] > 0) == bool(cached)
    if cached and rep.config.get("sliding_window"):
        assert got["snapshots"] > 0
    assert (got["imported_tokens"] > 0) == (rep.config["mode"] == "pd")
    assert got["decode_steps"] > 0
    host = rep.config.get("host_cache_blocks") or rep.config.get("prefill_host_cache_blocks")
    assert (got["host_stores"] > 0) == bool(host)
    assert (got["table_grows"] > 0) == (rep.config.get("blocks_per_table", 1) > 1)
    assert (got["preemptions"] > 0) == bool(rep.config.get("preemption"))


def test_host_tier_seeds_store_hit_and_fail(combo_reports: dict[str, simulate.Report]) -> None:
    """With a host tier, evicted entries are stored and hit on the host, and the fetch and
    update fault kinds reach its stores and loads (on each PD side with a host tier too), while
    everything stays token-exact and leak-free (`rep.ok`)."""
    for name in ("colocated-host", "pd-host", "colocated-paged-host", "colocated-preempt-host"):
        rep = combo_reports[name]
        assert rep.ok, simulate.render(rep)
        assert rep.faults_by_kind["fetch"] > 0 and rep.faults_by_kind["update"] > 0
        got = total(rep, *HOST_STATS)
        assert all(n > 0 for n in got.values()), (name, got)
    pd = combo_reports["pd-host"].batcher_stats
    assert pd["decode"]["host_stores"] > 0 and pd["prefill"]["host_stores"] > 0


def test_fault_kinds_all_fire_across_the_combinations(
        combo_reports: dict[str, simulate.Report]) -> None:
    fired = {kind: sum(r.faults_by_kind.get(kind, 0) for r in combo_reports.values())
             for kind in FAULTS}
    # kill fires only in some runs (once, late); it has its own test below; the worker_ kinds
    # are cluster mode's (the cluster tests below)
    assert {k for k, n in fired.items() if n == 0} <= {"kill", "worker_kill", "worker_start",
                                                       "worker_ready"}, fired


def test_seed_picks_different_configurations() -> None:
    configs = {simulate.draw_config(seed) for seed in range(40)}
    assert {c.mode for c in configs} == {"colocated", "pd"}
    assert {c.scratch for c in configs} == {"reserved", "dynamic"}
    assert {c.prefix_cache for c in configs} == {False, True}
    assert len({c.sliding_window for c in configs}) >= 3
    hybrid_cached = {c.sliding_window is not None and bool(c.prefix_cache or
                                                           c.prefill_prefix_cache)
                     for c in configs}
    # the spec decides whether a hybrid model may have a prefix cache; the draw follows it
    assert hybrid_cached == ({False, True} if simulate.hybrid_prefix_cache_allowed()
                             else {False})
    assert simulate.draw_config(5) == simulate.draw_config(5)
    # a host tier sometimes, only where Config accepts one: off most of the time
    hosts = [(c.host_cache_blocks, c.prefix_cache) for c in configs] + \
        [(c.prefill_host_cache_blocks, c.prefill_prefix_cache) for c in configs if c.pd]
    assert {h for h, _ in hosts} - {0} and {h for h, _ in hosts} <= {0, 1, 2, 3, 4}
    assert sum(h == 0 for h, _ in hosts) > len(hosts) / 2
    for c in configs:
        if c.host_cache_blocks or c.prefill_host_cache_blocks:
            assert c.sliding_window is None or simulate.host_cache_allowed(c.sliding_window)
        assert not c.host_cache_blocks or c.prefix_cache
        assert not c.prefill_host_cache_blocks or c.prefill_prefix_cache
    # fixing a host tier turns on the prefix cache it needs (and picks a model it is allowed on)
    fixed = simulate.draw_config(3, {"host_cache_blocks": 2})
    assert fixed.prefix_cache and fixed.host_cache_blocks == 2
    assert fixed.sliding_window is None or simulate.host_cache_allowed(fixed.sliding_window)


def test_prefill_worker_lost_mid_run_falls_back_or_fails_cleanly() -> None:
    """A recorded event list with a kill: replay takes any list, not only drawn ones."""
    events = [SimEvent.of("submit", request=i) for i in range(4)]
    events += [SimEvent("step")] * 3 + [SimEvent.of("kill", end="prefill")]
    events += [SimEvent.of("submit", request=4)] + [SimEvent("step")] * 4
    for fallback in (True, False):
        rep = simulate.replay(3, 10, events, mode="pd", max_seq_len=128,
                              fallback_local=fallback)
        assert rep.ok, simulate.render(rep)
        assert rep.faults_by_kind["kill"] == 1 and rep.requests == 5
        assert rep.completed >= 1
        if not fallback:  # nothing prefills request 4 any more: it fails at once
            assert rep.errors >= 1


# --------------------------------------------------------------------------- replay
def test_same_seed_same_events_same_report() -> None:
    a = run(11, 30, max_seq_len=128)
    b = run(11, 30, max_seq_len=128)
    assert a.events == b.events and len(a.events) > 30
    assert a == b  # every field but the timings
    again = simulate.replay(11, 30, a.events, max_seq_len=128)
    assert again.events == a.events and again.failures == a.failures
    assert (again.completed, again.errors, again.aborted, again.faults_by_kind) == \
        (a.completed, a.errors, a.aborted, a.faults_by_kind)
    assert run(12, 30, max_seq_len=128).events != a.events


# --------------------------------------------------------------------------- teeth
class CorruptOneToken:
    """A runtime bug: the `at`-th decode call returns, for every row, a token one above the
    right one."""

    def __init__(self, inner: Any, at: int) -> None:
        self.inner, self.at, self.calls = inner, at, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def decode(self, *args: Any) -> torch.Tensor:
        logits = self.inner.decode(*args)
        self.calls += 1
        if self.calls == self.at:
            logits = logits.clone()
            for row, tok in enumerate(logits[:, -1, :].argmax(dim=-1).tolist()):
                logits[row, -1, (tok + 1) % logits.shape[-1]] = logits[row, -1, tok] + 1
        return logits


class SkipCopy:
    """A runtime bug: copy_kv_cache silently writes nothing (prefix hits read stale KV)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def copy_kv_cache(self, src: int, dst: int, num_tokens: int) -> None:
        pass


def corrupt(rt: Any, side: str) -> Any:
    return CorruptOneToken(rt, 5) if side in ("local", "decode") else rt


def test_a_corrupted_token_is_caught_with_a_short_failing_prefix() -> None:
    rep = run(1, 40, wrap_runtime=corrupt, shrink=True, mode="colocated", max_seq_len=128)
    assert not rep.ok and rep.token_mismatches > 0
    assert rep.invariant_violations == 0  # the core's state is fine: only the tokens are wrong
    prefix = rep.failing_prefix
    assert prefix is not None and 0 < len(prefix) < len(rep.events)
    assert rep.events[:len(prefix)] == prefix
    assert any(f.kind == "token" for f in rep.prefix_failures)
    # the prefix is minimal: one event fewer passes, and the prefix alone fails again
    shorter = simulate.replay(1, 40, prefix[:-1], wrap_runtime=corrupt, mode="colocated",
                              max_seq_len=128)
    assert shorter.ok
    text = simulate.render(rep)
    assert "shortest failing prefix" in text and "replay: atom-core simulate --seed 1" in text
    assert str(rep).startswith("seed 1, 40 steps: FAILED tick")  # the one-line summary


def test_a_skipped_kv_copy_is_caught() -> None:
    # (a block over the minimum: hits copy; at the minimum the last reusable entry is taken
    # over, which copies nothing)
    rep = run(1, 60, wrap_runtime=lambda rt, side: SkipCopy(rt), mode="colocated",
              prefix_cache=True, max_seq_len=128, extra_blocks=1)
    assert not rep.ok and rep.token_mismatches > 0, simulate.render(rep)


class SkipHostLoad:
    """A runtime bug: update_kv_cache writes nothing (colocated and not hybrid, only host loads
    call it): a host hit decodes on whatever the block held before."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def update_kv_cache(self, host_tensor: Any, block: int) -> None:
        pass


def test_a_host_load_that_writes_nothing_is_caught() -> None:
    rep = run(SEEDS["colocated-host"], STEPS, wrap_runtime=lambda rt, side: SkipHostLoad(rt),
              **COMBOS["colocated-host"])
    assert not rep.ok and rep.token_mismatches > 0, simulate.render(rep)
    assert rep.invariant_violations == rep.leaks == 0  # the core cannot see it: only the tokens


def test_an_adapter_that_forgets_to_finish_a_host_store_is_caught(monkeypatch: Any) -> None:
    """The adapter stores a spilled entry but never tells the core it is done: the block stays
    pinned and the slot storing past the step, which the leak checks report at once."""
    apply = Scheduler._apply  # (the scheduler applies every transition)

    def forgetful(self: Scheduler, action: str, **args: Any) -> Any:
        return None if action == "store_done" else apply(self, action, **args)

    monkeypatch.setattr(Scheduler, "_apply", forgetful)
    rep = run(0, 20, shrink=True, **COMBOS["colocated-host"])
    assert not rep.ok and rep.leaks > 0 and rep.crash is None, simulate.render(rep)
    problems = [f.detail for f in rep.failures]
    assert any("is still spilling into host slot" in p for p in problems)
    assert any("is still storing" in p for p in problems)
    assert rep.failing_prefix is not None and 0 < len(rep.failing_prefix) < len(rep.events)


@pytest.mark.skipif(not HYBRID_PREFIX, reason="the spec allows no hybrid prefix cache")
def test_snapshot_buffers_the_adapter_keeps_too_long_are_caught(monkeypatch: Any) -> None:
    """The snapshot store forgets to drop an evicted entry's snapshots: host memory leaks."""
    sync = SnapshotStore.sync

    def leaky(self: SnapshotStore, s: Any) -> None:
        entries = dict(self.entries)
        sync(self, s)
        self.entries = {**entries, **self.entries}

    monkeypatch.setattr(SnapshotStore, "sync", leaky)
    rep = run(0, 30, mode="colocated", sliding_window=16, prefix_cache=True, max_seq_len=128)
    assert not rep.ok and rep.leaks > 0, simulate.render(rep)
    assert "(neither a cache entry nor a full lane block) at [64], the core []" \
        in str(rep.failures[0])


def test_pd_decode_side_corruption_is_caught() -> None:
    rep = run(2, 30, wrap_runtime=corrupt, mode="pd", max_seq_len=128)
    assert not rep.ok and rep.token_mismatches > 0


MUTANT = """
import json, sys
from atom_core.spec import codegen
from atom_core.spec.model import MODEL
import atom_core._generated as generated
mutant = codegen.load_inplace(MODEL.without_update("finish", "key"),
                             "atom_core._generated.inplace")
sys.modules["atom_core._generated.core"] = generated.core = mutant._core
sys.modules["atom_core._generated.inplace"] = generated.inplace = mutant
from atom_core import simulate
rep = simulate.run(0, 30, shrink=True, mode="colocated", prefix_cache=True, max_seq_len=128)
print(json.dumps(rep.as_json()))
"""


def test_a_mutant_core_swapped_in_before_import_is_caught() -> None:
    """The mutation harness's way: the mutant (the in-place core the batcher runs and the pure
    one it was generated with) replaces the core modules before the batcher is imported.
    Finishing into the cache without setting the entry's key breaks cache_key_is_content,
    which the per-tick invariant check reports."""
    out = subprocess.run([sys.executable, "-c", MUTANT], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout.strip().splitlines()[-1])
    assert rep["ok"] is False and rep["invariant_violations"] > 0
    assert any("cache_key_is_content" in f for f in rep["failures"])
    assert 0 < rep["failing_prefix_events"] < rep["events"]


def test_a_transfer_nobody_times_out_hits_the_drain_cap(monkeypatch: Any) -> None:
    """A dropped KV message with no transfer timeout leaves its request waiting forever: the
    drain's cap turns that into a failure instead of a hang."""
    monkeypatch.setattr(servers, "TRANSFER_TIMEOUT", 1e9)
    monkeypatch.setattr(driver, "DRAIN_BASE", 60)
    events = [SimEvent.of("submit", request=0), SimEvent.of("drop", end="prefill"),
              SimEvent("step"), SimEvent("step")]
    rep = simulate.replay(4, 2, events, mode="pd", max_seq_len=128, prefetch=0)
    assert not rep.ok and rep.drain_cap_hit
    assert rep.faults_by_kind["drop"] == 1
    assert any("unfinished requests [0]" in str(f) for f in rep.failures)
    monkeypatch.setattr(servers, "TRANSFER_TIMEOUT", 20.0)  # with a timeout it ends
    assert simulate.replay(4, 2, events, mode="pd", max_seq_len=128, prefetch=0).ok


def test_leak_checks_see_an_adapter_that_forgets() -> None:
    cfg = Config(lanes=1, kv_blocks=2, max_seq_len=128, prefill_chunk=64)
    b = AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), ghost=True)
    rid = b.submit([1, 2, 3], 4)
    waiting = b.submit([4, 5], 4)
    b.step()
    assert block_leaks("local", b) == []
    # the core says it ended while a lane still holds its block
    b.view.phase[rid] = core.PHASE_FINISHED  # written behind the core's back
    b._frozen = None  # (so `state` shows it)
    b.waiting.clear()  # and a request the core has waiting is in no queue
    problems = block_leaks("local", b)
    assert any(f"for request {rid}, which has ended" in p for p in problems)
    assert any("waiting, the queue []" in p and str(waiting) in p for p in problems)


def test_host_tier_checks_see_a_describe_that_disagrees_with_the_core() -> None:
    cfg = Config(lanes=1, kv_blocks=3, max_seq_len=128, prefill_chunk=64, prefix_cache=True,
                 host_cache_blocks=2)
    b = AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), ghost=True)
    server = servers.Colocated.__new__(servers.Colocated)
    server.b = b
    assert host_tier_leaks(server) == []
    real = b.describe()
    forgets = {**real, "host_cache": real["host_cache"][:1]}  # a slot left out
    b.describe = lambda: forgets  # type: ignore[method-assign]
    assert host_tier_leaks(server) == [
        "local: describe() reports host slot 1 as None, the core has "
        "{'slot': 1, 'state': 'empty', 'tokens': 0}"]


# --------------------------------------------------------------------------- CLI
def cli_json(capsys: Any, *argv: str) -> tuple[int, dict[str, Any]]:
    code = cli.main(["simulate", *argv, "--json"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert len(lines) == 1, lines  # exactly one JSON object on stdout
    return code, json.loads(lines[0])


def test_cli_json_fields_exit_0_and_replay_in_a_fresh_process() -> None:
    """The console command in its own process prints one JSON object, equal to the same run
    in this process (timings aside): a seed replays across processes."""
    out = subprocess.run([sys.executable, "-m", "atom_core.cli", "simulate", "--seed", "5",
                          "--steps", "20", "--set", "max_seq_len=128", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1  # exactly one JSON object on stdout
    got = json.loads(lines[0])
    assert {"seed", "steps", "requests", "faults_injected", "faults_by_kind",
            "invariant_violations", "leaks", "token_mismatches", "ok", "config",
            "steps_per_second", "replay"} <= set(got)
    assert got["ok"] is True and got["seed"] == 5 and got["steps"] == 20
    assert got["requests"] > 0 and got["steps_per_second"] > 0
    assert got["faults_injected"] == sum(got["faults_by_kind"].values()) > 0
    assert got["invariant_violations"] == got["leaks"] == got["token_mismatches"] == 0
    here = run(5, 20, max_seq_len=128).as_json()
    timing = {"seconds", "steps_per_second"}
    assert {k: v for k, v in got.items() if k not in timing} == \
        {k: v for k, v in here.items() if k not in timing}


def test_cli_failing_run_exits_1_and_prints_the_prefix(capsys: Any, monkeypatch: Any) -> None:
    reports: dict[str, simulate.Report] = {}

    def corrupt_run(*args: Any, **kwargs: Any) -> simulate.Report:
        # runs are deterministic (tested above): the text run reuses the JSON run's report
        key = repr((args, sorted(kwargs.items())))
        if key not in reports:
            reports[key] = run(*args, wrap_runtime=corrupt, **kwargs)
        return reports[key]

    monkeypatch.setattr(simulate, "run", corrupt_run)
    argv = ["--seed", "1", "--steps", "12", "--mode", "colocated", "--set", "max_seq_len=128"]
    code, out = cli_json(capsys, *argv)
    assert code == 1 and out["ok"] is False and out["token_mismatches"] > 0
    assert 0 < out["failing_prefix_events"] < out["events"]
    assert out["failing_prefix"][0] == {"kind": "submit", "request": 0}
    assert out["replay"].startswith("atom-core simulate --seed 1 --steps 12")
    assert cli.main(["simulate", *argv]) == 1
    text = capsys.readouterr().out
    assert "FAILED" in text and "shortest failing prefix" in text


@pytest.mark.parametrize("argv", [
    ["--faults", "prefill,bogus"],
    ["--set", "no_such_thing=1"],
    ["--set", "lanes"],
    ["--sliding-window", "0"],  # Config refuses it
    ["--sliding-window", "wide"],
    ["--mode", "colocated", "--set", "prefetch=2"],  # a PD-only dimension
    ["--set", "max_seq_len=32"],  # shorter than the chunk: Config refuses it
    ["--set", "host_cache_blocks=2", "--no-prefix-cache"],  # the host tier needs it
    ["--set", "host_cache_blocks=2", "--sliding-window", "16"],  # refused for hybrid models
    ["--mode", "colocated", "--set", "prefill_host_cache_blocks=1"],  # a PD-only dimension
])
def test_cli_bad_usage_exits_2(capsys: Any, argv: list[str]) -> None:
    assert cli.main(["simulate", *argv]) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--steps", "x"], ["--seeds", "3..1"],
                                  ["--minutes", "0"], ["--minutes", "1", "--seeds", "0..1"]])
def test_cli_argparse_errors_exit_2(capsys: Any, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["simulate", *argv])
    assert e.value.code == 2


def test_cli_deep_mode_runs_seeds_and_stops_at_the_first_failure(capsys: Any,
                                                                  monkeypatch: Any) -> None:
    code, out = cli_json(capsys, "--seeds", "0..1", "--steps", "8", "--set", "max_seq_len=128")
    assert code == 0 and out["ok"] and out["seeds_run"] == 2 and out["last_seed"] == 1
    monkeypatch.setattr(deep, "run", functools.partial(run, wrap_runtime=corrupt))
    code, out = cli_json(capsys, "--seeds", "1..9", "--steps", "12", "--mode", "colocated",
                         "--set", "max_seq_len=128")
    assert code == 1 and not out["ok"]
    assert out["seeds_run"] == 1 and out["failing_seed"] == 1
    assert out["replay"].startswith("atom-core simulate --seed 1 --steps 12")
    assert out["report"]["failing_prefix_events"] > 0


# --------------------------------------------------------------------------- cluster mode
# seeds that together kill, restart and late-join workers of both roles, retry a killed
# prefill worker's requests, refuse for backpressure (retried elsewhere and prefilled
# locally), fall back to local prefill with every prefill worker gone, and fail a killed
# decode worker's requests
CLUSTER_SEEDS, CLUSTER_STEPS = (9, 20, 24), 60


@pytest.fixture(scope="module")
def cluster_reports() -> dict[int, simulate.Report]:
    return {seed: run(seed, CLUSTER_STEPS, mode="cluster") for seed in CLUSTER_SEEDS}


def test_cluster_mode_seeds_pass_and_exercise_every_fault(
        cluster_reports: dict[int, simulate.Report]) -> None:
    for rep in cluster_reports.values():
        assert rep.ok, simulate.render(rep)
        assert rep.config["mode"] == "cluster" and rep.router_errors == 0
        assert rep.completed + rep.errors + rep.aborted == rep.requests  # each ended once
        assert rep.cluster["late_events"] == 0
        assert rep.cluster["busy_refused"] == rep.cluster["busy_retried"] + \
            rep.cluster["busy_local"]  # no refusal for backpressure failed its request
    got = {k: sum(r.cluster[k] for r in cluster_reports.values())
           for k in next(iter(cluster_reports.values())).cluster}
    for key in ("kills", "restarts", "late_joins", "retried", "busy_retried", "busy_local",
                "local_fallbacks", "affinity_hits", "exports"):
        assert got[key] > 0, (key, got)
    assert sum(r.errors for r in cluster_reports.values()) > 0  # a killed decode worker's
    workers = {(r.config["prefill_workers"], r.config["decode_workers"])
               for r in cluster_reports.values()}
    assert len(workers) > 1


def test_cluster_mode_same_seed_byte_identical_report() -> None:
    def text(rep: simulate.Report) -> str:
        return json.dumps({k: v for k, v in rep.as_json().items()
                           if k not in ("seconds", "steps_per_second")}, sort_keys=True)

    a, b = run(24, 60, mode="cluster"), run(24, 60, mode="cluster")
    assert a.cluster["kills"] > 0 and a.cluster["busy_refused"] > 0
    assert text(a) == text(b) and a == b
    # and in a fresh process (another hash seed): the same JSON
    out = subprocess.run([sys.executable, "-m", "atom_core.cli", "simulate", "--seed", "24",
                          "--steps", "60", "--mode", "cluster", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["replay"] == "atom-core simulate --seed 24 --steps 60 --set mode=cluster"
    assert json.dumps({k: v for k, v in got.items() if k not in ("seconds", "steps_per_second")},
                      sort_keys=True) == text(a)


def test_cluster_mode_draws_its_dimensions_and_never_unless_fixed() -> None:
    assert all(simulate.draw_config(s).mode != "cluster" for s in range(40))
    cfgs = [simulate.draw_config(s, {"mode": "cluster"}) for s in range(40)]
    assert {c.prefill_workers for c in cfgs} == {1, 2, 3} == {c.decode_workers for c in cfgs}
    assert {c.prefill_max_queued for c in cfgs} == {1, 2, 4, 64}
    assert all(c.fallback_local for c in cfgs)
    fixed = simulate.draw_config(3, {"mode": "cluster", "prefill_workers": 2,
                                     "decode_workers": 1})
    assert (fixed.prefill_workers, fixed.decode_workers) == (2, 1)
    with pytest.raises(simulate.UsageError):
        simulate.draw_config(3, {"mode": "cluster", "prefill_workers": 0})
    with pytest.raises(simulate.UsageError):
        simulate.draw_config(3, {"mode": "pd", "decode_workers": 2})


def _not_retried(monkeypatch: Any) -> None:
    """A cluster bug: a request a full prefill worker refused fails instead of being retried."""
    from atom_core.pd import cluster, links

    monkeypatch.setattr(links.PrefillLinks, "_ask_another", lambda self, wire, peer: False)
    resubmit = cluster.DecodeNode._resubmit

    def no_local(self: Any, wid: int, cid: int) -> bool:
        req = self.worker.requests.get(wid)
        return False if req is not None and req.kind == "prefill_busy" else \
            resubmit(self, wid, cid)

    monkeypatch.setattr(cluster.DecodeNode, "_resubmit", no_local)


def _ignores_ready(monkeypatch: Any) -> None:
    """A router bug: workers that have not reported ready are chosen too."""
    from atom_core.pd import router

    pick = router.Router.pick

    def pick_any(self: Any, role: str, keys: Any, exclude: Any = frozenset()) -> Any:
        saved = {w: ld.ready for w, ld in self.loads[role].items()}
        for ld in self.loads[role].values():
            ld.ready = True
        try:
            return pick(self, role, keys, exclude)
        finally:
            for w, ready in saved.items():
                self.loads[role][w].ready = ready

    monkeypatch.setattr(router.Router, "pick", pick_any)


def _keeps_lost_requests(monkeypatch: Any) -> None:
    """A frontend bug: a lost decode worker's requests stay open (they never end)."""
    from atom_core.pd import cluster

    monkeypatch.setattr(cluster.Frontend, "_lost",
                        lambda self, role, rank, why: self.router.mark_lost(role, rank))


def _remembers_lost(monkeypatch: Any) -> None:
    """A router bug: a lost worker's prefixes are remembered (affinity to a new, empty cache)."""
    from atom_core.pd import router

    def mark_lost(self: Any, role: str, worker: int) -> None:
        self.lost[role].add(worker)
        self.loads[role].pop(worker, None)

    monkeypatch.setattr(router.Router, "mark_lost", mark_lost)


def _asks_not_ready(monkeypatch: Any) -> None:
    """A cluster bug: decode workers ask any linked prefill worker, ready or not."""
    from atom_core.pd import links

    monkeypatch.setattr(links.PrefillLinks, "set_ready", lambda self, ready: None)


@pytest.mark.parametrize("plant, seed, steps, kind", [
    (_not_retried, 9, 20, "lifecycle"),
    (_asks_not_ready, 3, 20, "router"),
    (_ignores_ready, 1, 20, "router"),
    (_keeps_lost_requests, 4, 40, "router"),
    (_remembers_lost, 2, 70, "router"),
])
def test_cluster_bugs_are_caught(monkeypatch: Any, plant: Any, seed: int, steps: int,
                                 kind: str) -> None:
    plant(monkeypatch)
    rep = run(seed, steps, mode="cluster")
    assert not rep.ok and rep.failures[0].kind == kind, rep.failures[:3]
