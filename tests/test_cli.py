"""`atom-core` command line, run in-process (and the console script once, as a subprocess)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from atom_core import cli
from atom_core._generated import capacity
from atom_core.cli.proofs import task_progress

SEEDS = ["--lanes", "1", "--prefix-cache", "--scratch", "reserved"]


def run(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr().out
    return code, out


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out = run(capsys, *argv, "--json")
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1, out  # exactly one JSON object on stdout
    return code, json.loads(lines[0])


def test_min_blocks_json(capsys):
    code, out = run_json(capsys, "min-blocks", "--lanes", "4", "--prefix-cache",
                         "--scratch", "reserved")
    assert code == 0
    assert out["lanes"] == 4 and out["min_kv_blocks"] == 5
    assert "prefix-cache-reserved-scratch" in out["rule"]
    assert "with T = 1: kv_blocks >= lanes + 1" in out["rule"]


@pytest.mark.parametrize("prefix", [False, True])
def test_min_blocks_paged(capsys, prefix):
    """--block-size below --max-seq-len: T = 4 blocks per lane's table."""
    argv = ["min-blocks", "--lanes", "3", "--max-seq-len", "4096", "--block-size", "1024",
            "--scratch", "reserved"] + (["--prefix-cache"] if prefix else [])
    code, out = run_json(capsys, *argv)
    assert code == 0 and out["blocks_per_table"] == 4
    assert out["min_kv_blocks"] == 3 * 4 + 1  # a hit's pinned source fits: no extra block
    assert "with T = 4: kv_blocks >= lanes * 4 + 1" in out["rule"]


def test_check_config_paged_unsafe_shows_a_stuck_run(capsys):
    argv = ["check-config", "--lanes", "1", "--kv-blocks", "1", "--max-seq-len", "256",
            "--block-size", "128", "--prefill-chunk", "64"]
    code, out = run_json(capsys, *argv)
    assert code == 1 and not out["safe"] and out["min_kv_blocks"] == 2
    assert out["violated"] == "running_request_advances"
    # the lane filled its first block and there is no block for its second
    assert any(s["action"] == "decode" for s in out["trace"])
    code, text = run(capsys, *argv)
    assert code == 1 and "UNSAFE" in text and "with T = 2" in text


def test_check_config_rejects_a_block_size_that_does_not_divide(capsys):
    code, out = run_json(capsys, "check-config", "--lanes", "1", "--kv-blocks", "4",
                         "--max-seq-len", "256", "--block-size", "96", "--prefill-chunk", "64")
    assert code == 1 and "not a multiple of --block-size 96" in out["error"]


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
def test_min_blocks_every_combination(capsys, prefix, scratch):
    argv = ["min-blocks", "--lanes", "3", "--scratch", scratch] + (
        ["--prefix-cache"] if prefix else [])
    code, out = run_json(capsys, *argv)
    assert code == 0
    assert out["min_kv_blocks"] == 3 + capacity.OFFSETS[(prefix, scratch)]
    code, text = run(capsys, *argv)
    assert code == 0 and f"kv_blocks >= {out['min_kv_blocks']}" in text


def test_check_config_seeds_safe_json(capsys):
    """The seeds' incident configuration (one lane, two blocks, prefix cache, reserved
    scratch) is safe: the lane takes a cache entry over instead of waiting for a second
    block."""
    code, out = run_json(capsys, "check-config", *SEEDS, "--kv-blocks", "2")
    assert code == 0
    assert out["safe"] is True and out["trace"] == []
    assert out["min_kv_blocks"] == 2 and out["kv_blocks"] == 2 and out["lanes"] == 1
    assert "prefix-cache-reserved-scratch" in out["rule"]


TWO_LANES = ["--lanes", "2", "--prefix-cache", "--scratch", "reserved"]


def test_check_config_unsafe_json(capsys):
    """Two lanes and two blocks, one of them the scratch block: the second lane never gets a
    block."""
    code, out = run_json(capsys, "check-config", *TWO_LANES, "--kv-blocks", "2")
    assert code == 1
    assert out["safe"] is False
    assert out["min_kv_blocks"] == 3 and out["kv_blocks"] == 2 and out["lanes"] == 2
    assert "prefix-cache-reserved-scratch" in out["rule"]
    assert out["violated"] == "idle_lane_admits"
    trace = out["trace"]
    assert [s["step"] for s in trace] == list(range(1, len(trace) + 1))
    for s in trace:
        assert set(s) == {"step", "action", "args"}
        assert isinstance(s["args"], dict)
    assert [s["action"] for s in trace] == ["submit", "submit", "admit_miss"]


def test_check_config_text(capsys):
    code, text = run(capsys, "check-config", *TWO_LANES, "--kv-blocks", "2")
    assert code == 1
    assert text.startswith("UNSAFE")
    assert "needs 3, 1 missing" in text
    for i, action in enumerate(["submit", "submit", "admit_miss"], start=1):
        assert f"{i:>3}. {action}(" in text
    assert "idle_lane_admits" in text
    code, text = run(capsys, "check-config", *TWO_LANES, "--kv-blocks", "3")
    assert code == 0 and text.startswith("SAFE") and "needs 3" in text


def test_check_config_many_lanes_lifted(capsys):
    """lanes=6 is above the searched lane counts: the run is lifted from 2 lanes (two steps
    per extra lane) and replayed in z3."""
    code, out = run_json(capsys, "check-config", "--lanes", "6", "--kv-blocks", "6",
                         "--prefix-cache", "--scratch", "reserved")
    assert code == 1 and out["safe"] is False and out["min_kv_blocks"] == 7
    trace = out["trace"]
    assert len(trace) == 3 + 2 * 4  # the B=2 run, plus submit + admit per extra lane
    assert [s["action"] for s in trace[:8]] == ["submit", "admit_miss"] * 4
    assert sorted(s["args"]["l"] for s in trace[:8] if s["action"] == "admit_miss") == [
        2, 3, 4, 5]
    assert out["violated"] == "idle_lane_admits"
    assert [s["step"] for s in trace] == list(range(1, 12))


def test_check_config_above_proved_lanes_safe_mentions_cutoff(capsys):
    lanes = capacity.PROVED_LANES + 2
    code, text = run(capsys, "check-config", "--lanes", str(lanes), "--kv-blocks",
                     str(lanes + 2), "--prefix-cache", "--scratch", "reserved")
    assert code == 0 and "SAFE" in text and f"lanes <= {capacity.PROVED_LANES}" in text


@pytest.mark.parametrize("argv", [
    ["min-blocks", "--lanes", "0"],
    ["min-blocks", "--lanes", "x"],
    ["check-config", "--lanes", "1"],  # --kv-blocks is required
    ["check-config", "--lanes", "1", "--kv-blocks", "-2"],
    ["min-blocks", "--lanes", "1", "--scratch", "fixed"],
    ["verify", "--jobs", "0"],
    [],
])
def test_bad_arguments_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err


def check_verify_json(out: dict) -> None:
    assert {"ok", "seconds", "checks", "jobs", "cpu_seconds_by_kind", "tasks_by_kind"} <= set(out)
    assert isinstance(out["seconds"], (int, float))
    # where the time went: every kind of task that ran, with its CPU seconds
    assert {"nonvacuity", "relational", "bounded", "capacity", "capacity-single-block"} <= set(
        out["tasks_by_kind"])
    assert set(out["tasks_by_kind"]) <= set(out["cpu_seconds_by_kind"])
    assert all(v >= 0 for v in out["cpu_seconds_by_kind"].values())
    assert out["checks"]
    for c in out["checks"]:
        assert {"invariant", "action", "kind", "status", "seconds"} <= set(c)
        assert c["status"] in ("proved", "counterexample", "unknown")


def test_verify_json_small_cutoff(capsys):
    """At K <= 2 every reserved-scratch minimum with T = 2 (a table of two blocks and the
    scratch block) is beyond the cutoff: verify reports exactly those, and the committed table
    cannot be confirmed."""
    code, out = run_json(capsys, "verify", "--max-lanes", "1", "--max-blocks", "2")
    check_verify_json(out)
    assert code == 1 and out["ok"] is False
    bad = {c["invariant"] for c in out["checks"] if c["status"] != "proved"}
    assert bad == {"rule:no cache, reserved scratch, T=2",
                   "rule:prefix cache, reserved scratch, T=2",
                   "rule:prefix cache, reserved scratch, host cache, T=2",
                   "rule:prefix cache, reserved scratch, hybrid, T=2",
                   "capacity-table-matches-proofs"}
    kinds = {c["kind"] for c in out["checks"]}
    assert {"nonvacuity", "base", "step", "transition", "capacity"} <= kinds


def test_verify_json_ok(capsys):
    """Every tight row at this cutoff is certified by its committed witness (no search)."""
    code, out = run_json(capsys, "verify", "--max-lanes", "1", "--max-blocks", "3")
    check_verify_json(out)
    assert code == 0 and out["ok"] is True, [c for c in out["checks"] if c["status"] != "proved"]
    assert all(c["status"] == "proved" for c in out["checks"])
    assert out["stale_witnesses"] == [] and "capacity-tight-search" not in out["tasks_by_kind"]
    assert any(c["invariant"] == "witnesses-current" for c in out["checks"])


def test_verify_progress_bar_only_when_shown(capsys):
    """The progress callback exists only when shown (a terminal, no --json/--quiet), and then
    draws on stderr, never on stdout (which --json keeps to one object)."""
    with task_progress(False) as on_task:
        assert on_task is None
    with task_progress(True) as on_task:
        on_task("capacity", 1, 2)
        on_task("capacity", 2, 2)
    assert capsys.readouterr().out == ""


def test_console_script_help():
    exe = pathlib.Path(sys.executable).parent / "atom-core"
    assert exe.exists(), exe
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for cmd in ("verify", "check-config", "min-blocks"):
        assert cmd in r.stdout


def test_check_config_accepts_a_host_tier(capsys):
    code, out = run(capsys, "check-config", "--lanes", "2", "--kv-blocks", "3", "--prefix-cache",
                    "--host-cache-blocks", "8")
    assert code == 0 and out.startswith("SAFE") and "host cache of 8 blocks" in out
    # the host tier adds no device block to the rule, and below it the stuck run is shown
    code, out = run_json(capsys, "check-config", "--lanes", "3", "--kv-blocks", "2",
                         "--prefix-cache", "--host-cache-blocks", "8")
    assert code == 1 and out["safe"] is False and out["min_kv_blocks"] == 3 and out["trace"]
    # with paged tables too (4 blocks per table): the rule is the one without the host tier
    code, out = run_json(capsys, "check-config", "--lanes", "2", "--kv-blocks", "8",
                         "--prefix-cache", "--host-cache-blocks", "8", "--block-size", "256",
                         "--max-seq-len", "1024")
    assert code == 0 and out["safe"] is True and out["min_kv_blocks"] == 8


@pytest.mark.parametrize("argv,why", [
    (("--host-cache-blocks", "4"), "host_cache_needs_prefix_cache"),
    # (a negative --host-cache-blocks is the option's type's: tests/test_options_round3.py)
    (("--block-size", "384", "--max-seq-len", "1024"), "not a multiple of --block-size 384"),
    (("--max-seq-len", "768", "--block-size", "384", "--prefill-chunk", "256"),
     "must be a multiple of prefill_chunk"),
])
def test_check_config_and_min_blocks_say_what_is_invalid(capsys, argv, why):
    code, out = run_json(capsys, "check-config", "--lanes", "2", "--kv-blocks", "8", *argv)
    assert code == 1 and out["safe"] is False and why in out["error"]
    code, out = run_json(capsys, "min-blocks", "--lanes", "2", *argv)
    assert code == 2 and why in out["error"]
    code = cli.main(["min-blocks", "--lanes", "2", *argv])
    assert code == 2 and why in capsys.readouterr().err
