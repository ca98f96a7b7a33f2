"""check-config's search for a stuck run is bounded (issue 49, item 6): two configurations it
hung on (11 minutes and 1.9 GB; 5 min 41 s) answer with a run, a search that reaches its
bound (--search-states, --search-seconds) gives the rule's verdict with a note saying so and
how to raise it, and the bounds refuse what is no bound. Bounds in the tests are small state
counts, not times."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from atom_core import cli
from atom_core._generated import core as g
from atom_core.cli.proofs import search_progress
from atom_core.proofs import search

pytestmark = pytest.mark.usefixtures("fresh_z3")

# 4 lanes of 2 blocks (paged: max_seq_len = 2 * block size), 7 blocks: one short
ARTIFACT = {"batch_size": 4, "max_seq_len": 8192, "kvcache_block_size": 4096,
            "kvcache_num_blocks": 8, "prefill_chunk_size": 128, "model_id": "x"}
TWO_PAGED = ["--lanes", "2", "--kv-blocks", "3", "--max-seq-len", "8192",
             "--block-size", "4096"]


def run_json(capsys: Any, *argv: str) -> tuple[int, dict, str]:
    code = cli.main([*argv, "--json"])
    out, err = capsys.readouterr()
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1, out
    return code, json.loads(lines[0]), err


def artifact(tmp_path: Path) -> list[str]:
    (tmp_path / "rbln_config.json").write_text(json.dumps(ARTIFACT))
    return ["check-config", "--rbln-config", str(tmp_path), "--kv-blocks", "7"]


def paged_consts(lanes: int, blocks: int) -> Any:
    return g.Consts(B=lanes, K=blocks, C=search.TRACE_CHUNK, S=search.TRACE_SEQ_LEN, T=2,
                    PREFIX=False, RESERVED=False, SCRATCH=0)


def test_four_paged_lanes_show_a_stuck_run(tmp_path, capsys):
    """Before: a breadth-first search at 4 lanes, 11 minutes and 1.9 GB with no end in sight.
    Now the depth-first search finds the run of every lane filling its first block, three of
    them growing into the last three, within a few dozen states."""
    code, out, err = run_json(capsys, *artifact(tmp_path))
    assert code == 1 and out["safe"] is False and out["min_kv_blocks"] == 8
    assert out["violated"] == "running_request_advances" and "note" not in out
    actions = [s["action"] for s in out["trace"]]
    assert actions.count("admit_miss") == 4 and actions.count("grow") == 3
    assert out["stuck_state"]["lanes"] == ["r0", "r1", "r2", "r3"]
    assert err == ""  # (no terminal: no progress bar)


def test_four_paged_lanes_at_a_small_state_bound_give_the_rules_verdict(tmp_path, capsys):
    code, out, _ = run_json(capsys, *artifact(tmp_path), "--search-states", "10")
    assert code == 1 and out["safe"] is False and out["min_kv_blocks"] == 8
    assert out["trace"] == [] and out["violated"] is None
    assert out["search"]["stopped_by"] == "states" and out["search"]["states"] == 10
    assert "stopped by its states bound" in out["note"]
    assert "--search-states raises the bound" in out["note"]
    code = cli.main([*artifact(tmp_path), "--search-states", "10"])
    text = capsys.readouterr().out
    assert code == 1 and text.startswith("UNSAFE") and "needs 8, 1 missing" in text
    assert "no stuck run shown" in text and "--search-states" in text


def test_the_seconds_bound_gives_the_rules_verdict(tmp_path, capsys):
    code, out, _ = run_json(capsys, *artifact(tmp_path), "--search-seconds", "1e-9")
    assert code == 1 and out["violated"] is None and out["trace"] == []
    assert out["search"]["stopped_by"] == "seconds"
    assert "--search-seconds raises the bound" in out["note"]


def test_two_paged_lanes_replay_the_committed_run(capsys):
    """Before: 5 min 41 s of breadth-first search for the run `verify` replays from
    atom_core/_generated/witnesses.py. Now that run is replayed: no state searched, so even
    a bound of one state shows it."""
    code, out, _ = run_json(capsys, "check-config", *TWO_PAGED, "--search-states", "1")
    assert code == 1 and out["violated"] == "running_request_advances"
    assert [s["action"] for s in out["trace"]] == (
        ["submit"] * 2 + ["admit_miss"] * 2 + ["prefill"] * 4 + ["decode"] * 5 + ["grow"])


def test_the_breadth_first_search_stops_at_its_state_bound():
    """The search that hung, at 4 lanes: with a budget it stops where it says, its queue
    within the states it keeps."""
    budget = search.Budget(max_states=300, max_seconds=1e9)
    with pytest.raises(search.SearchBound) as exc:
        search.shortest_stuck_run(paged_consts(4, 7), max_depth=None, budget=budget)
    assert exc.value.bound == "states" and exc.value.states == 300


def test_progress_is_reported_while_searching():
    seen: list[tuple[int, int]] = []
    # (started a second ago: the first report is due at the first state, not a tenth of a
    # second into the search, which may be over by then)
    budget = search.Budget(max_states=10**6, max_seconds=1e9,
                           on_progress=lambda b: seen.append((b.states, b.depth)),
                           started=time.monotonic() - 1)
    assert search.shortest_stuck_run(paged_consts(2, 2), max_depth=None, budget=budget)
    assert seen and seen[0] == (0, 0)


def test_search_progress_draws_nothing_without_a_terminal():
    with search_progress(False) as on_progress:
        assert on_progress is None
    with search_progress(True) as on_progress:  # (rich is a dev dependency)
        assert on_progress is not None
        on_progress(search.Budget(max_states=10, max_seconds=1.0))


@pytest.mark.parametrize(("argv", "actions"), [
    # two lanes, a scratch block and one more: the committed run
    (["--lanes", "2", "--prefix-cache", "--scratch", "reserved", "--kv-blocks", "2"],
     ["submit", "submit", "admit_miss"]),
    # six lanes: lifted from two (a submit and an admission per extra lane)
    (["--lanes", "6", "--prefix-cache", "--scratch", "reserved", "--kv-blocks", "6"],
     ["submit", "admit_miss"] * 4 + ["submit", "submit", "admit_miss"]),
    # two paged lanes, two blocks below the minimum: a shortest run, breadth-first
    (["--lanes", "2", "--kv-blocks", "2", "--max-seq-len", "256", "--block-size", "128",
      "--prefill-chunk", "64"], None),
])
def test_small_configurations_still_show_their_stuck_runs(capsys, argv, actions):
    code, out, _ = run_json(capsys, "check-config", *argv)
    assert code == 1 and out["trace"] and out["violated"] and "note" not in out
    if actions is not None:
        assert [s["action"] for s in out["trace"]] == actions
    else:
        assert len(out["trace"]) == 10


def test_preemption_runs_take_no_detour(capsys):
    """Depth-first with preemption first left out: without that, a run of 571 steps through
    preemptions (B=2, K=4, T=4) where one of 28 exists."""
    code, out, _ = run_json(capsys, "check-config", "--lanes", "2", "--kv-blocks", "4",
                            "--max-seq-len", "512", "--block-size", "128",
                            "--prefill-chunk", "64", "--preemption")
    assert code == 1 and out["violated"] == "lone_lane_is_never_preempted"
    assert len(out["trace"]) <= 30
    assert "preempt" not in {s["action"] for s in out["trace"]}


@pytest.mark.parametrize(("flag", "value"), [
    ("--search-states", "0"), ("--search-states", "-5"), ("--search-states", "x"),
    ("--search-states", "1000000000"),
    ("--search-seconds", "0"), ("--search-seconds", "-1"), ("--search-seconds", "nan"),
    ("--search-seconds", "inf"),
])
def test_the_bounds_refuse_what_is_no_bound(capsys, flag, value):
    with pytest.raises(SystemExit) as exc:
        cli.main(["check-config", *TWO_PAGED, f"{flag}={value}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and ("positive" in err or "in 1.." in err or "seconds > 0" in err), err
