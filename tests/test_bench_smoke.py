"""Smoke test of the core benchmark (`python -m bench.core`): it runs and reports every
measurement. No timing assertions: performance is measured by `make bench`, not by tests."""

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is a top-level directory, not an installed package
    sys.path.insert(0, str(ROOT))

from bench import core  # noqa: E402

STATS = ("median_us", "q1_us", "q3_us", "min_us", "max_us")


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_quick_json_reports_every_measurement(capsys) -> None:
    assert core.main(["--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"] == {"lanes": 32, "kv_blocks": 34, "prefill_chunk": 128,
                                "max_seq_len": 4096, "prefix_cache": True,
                                "scratch": "dynamic"}
    rows = report["measurements"]
    assert set(rows) == set(core.ROWS)
    for name, row in rows.items():
        for mode in ("ghost_off", "ghost_on"):
            stats = row[mode]
            for k in STATS:
                assert _positive(stats[k]), (name, mode, k, stats[k])
            assert stats["q1_us"] <= stats["median_us"] <= stats["q3_us"], (name, mode)
            assert stats["iqr_us"] >= 0
            target = row["target_us"]
            if target is None:
                assert row[f"ratio_{mode}"] is None
            else:
                assert _positive(row[f"ratio_{mode}"])
    for name in ("admit_miss", "admit_hit_total", "decode_step", "decode_per_lane", "finish"):
        assert _positive(rows[name]["target_us"]), name
        assert rows[name]["vllm_v1_reference_us"], name


def test_batcher_bench_quick_json(capsys) -> None:
    from bench import batcher

    assert batcher.main(["--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["decode_overhead"]
    assert rows and all(_positive(r["ghost_off"]["median_us_per_step"]) for r in rows.values())
    share = report["scheduler_share"]
    assert 0 < share["runtime_decode_us"] < share["step_us"]
    assert 0 < share["scheduler_share"] < 1


def test_prefix_bench_reports_tokens_saved(capsys) -> None:
    """A small run of `bench.prefix`: the prefix cache saves prefill tokens for the plain and the
    hybrid model alike, and computed + copied tokens add up to the workload's prompt tokens."""
    from bench import prefix

    assert prefix.main(["--requests", "6", "--system", "140", "--lanes", "2", "--window", "16",
                        "--block", "64", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["models"]) == {"plain", "plain, blocks of 64", "hybrid W=16"}
    # the 128-token hits span two 64-token blocks and save what one-block sequences save
    paged, plain = report["models"]["plain, blocks of 64"], report["models"]["plain"]
    assert paged["cache_on"]["prefix_hit_tokens"] == plain["cache_on"]["prefix_hit_tokens"] > 0
    for row in report["models"].values():
        off, on = row["cache_off"], row["cache_on"]
        assert off["prefill_tokens"] == report["prompt_tokens"]
        assert on["prefill_tokens"] + on["prefix_hit_tokens"] == report["prompt_tokens"]
        assert row["saved"] == on["prefix_hit_tokens"] > 0
    assert report["models"]["hybrid W=16"]["cache_on"]["snapshots"] > 0
    # the host tier, with one block per sequence and with paged tables: every prompt token is
    # computed, copied or loaded once, and loads replace computed tokens
    ht = report["host_tier"]
    assert set(ht["tables"]) == {"one block", "blocks of 64"}
    for row in ht["tables"].values():
        runs = list(row["runs"].values())
        for r in runs:
            assert r["prefill_tokens"] + r["prefix_hit_tokens"] + r["host_hit_tokens"] \
                == ht["prompt_tokens"]
        assert runs[0]["host_hit_tokens"] == 0
        assert row["saved"] == runs[1]["host_hit_tokens"] - (
            runs[0]["prefix_hit_tokens"] - runs[1]["prefix_hit_tokens"])


def test_preempt_bench_reports_recomputation(capsys) -> None:
    """A small run of `bench.preempt`: at the preemption minimum the lanes preempt and recompute,
    every run generates the workload's tokens (the bench itself fails if preemption changes
    one), and at the rule without preemption nothing is preempted."""
    from bench import preempt

    assert preempt.main(["--requests", "4", "--lanes", "2", "--rounds", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["budgets"]
    assert [r["kv_blocks"] for r in rows][0] == report["rule_with_preemption"]
    assert rows[-1]["kv_blocks"] == report["rule_without_preemption"]
    low, high = rows[0]["with_preemption"], rows[-1]["with_preemption"]
    assert low["preemptions"] > 0 and low["recomputed_tokens"] > 0
    assert low["prefill_tokens"] > report["prompt_tokens"]
    assert high["preemptions"] == 0 and high["prefill_tokens"] == report["prompt_tokens"]
    for r in rows:
        runs = [r["with_preemption"], r["without_preemption"]]
        assert all(x["generated_tokens"] == report["max_new_tokens"] for x in runs if x)
        assert all(_positive(x["tokens_per_s"]) for x in runs if x)
