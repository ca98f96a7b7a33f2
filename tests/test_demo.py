"""`atom-core demo`, run in-process on a small workload: JSON summary, exactness, text output."""

from __future__ import annotations

import json

import pytest

from atom_core import cli
from atom_core.demo import Oracle, oracle_for, workload
from atom_core.runtime import TorchReferenceRuntime

QUICK = ["demo", "--lanes", "2", "--requests", "6", "--max-new-tokens", "3", "--seed", "5"]
KEYS = {"runtime", "config", "requests", "shared_prefix_requests", "completed", "errors",
        "prompt_tokens", "prefix_hit_tokens", "prefill_tokens", "prefill_tokens_saved",
        "prefill_saved_pct", "decode_steps", "decode_rows_padding", "generated_tokens",
        "wall_s", "tokens_per_s", "exact", "mismatches"}


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code = cli.main([*argv, "--json"])
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1, out
    return code, json.loads(lines[0])


@pytest.mark.parametrize("extra", [[], ["--scratch", "reserved"]])
def test_demo_json_is_exact_and_adds_up(capsys, extra):
    code, out = run_json(capsys, *QUICK, *extra)
    assert code == 0
    assert set(out) == KEYS
    assert out["exact"] is True and out["mismatches"] == []
    assert out["requests"] == 6 == out["completed"] and out["errors"] == 0
    assert out["config"]["lanes"] == 2 and out["config"]["prefix_cache"] is True
    assert out["config"]["scratch"] == (extra[1] if extra else "dynamic")
    assert out["prefill_tokens"] + out["prefix_hit_tokens"] == out["prompt_tokens"]
    assert out["prefill_tokens_saved"] == out["prefix_hit_tokens"] > 0
    assert out["prefill_saved_pct"] == round(100 * out["prefix_hit_tokens"]
                                             / out["prompt_tokens"], 1)
    assert out["generated_tokens"] == 6 * 3
    assert out["decode_steps"] > 0 and out["tokens_per_s"] > 0 and out["wall_s"] > 0


def test_demo_without_prefix_cache_computes_every_prompt_token(capsys):
    code, out = run_json(capsys, *QUICK, "--no-prefix-cache")
    assert code == 0 and out["exact"] is True
    assert out["prefix_hit_tokens"] == 0 and out["prefill_tokens"] == out["prompt_tokens"]
    assert out["config"]["kv_blocks"] == 2  # the minimum: lanes + 0


def test_demo_text_summary(capsys):
    assert cli.main(QUICK) == 0
    out = capsys.readouterr().out
    for label in ("requests", "prefix-hit tokens", "prefill tokens computed",
                  "prefill tokens saved", "decode steps", "tokens/s", "wall time",
                  "token-exact vs oracle"):
        assert label in out, label
    assert "YES" in out


def test_workload_shape():
    items = workload(24, 16, seed=0)
    assert len(items) == 24
    shared = [it for it in items if it.shared]
    assert len(items) // 2 < len(shared) < len(items)  # most share, some are unrelated
    first = shared[0].prompt[:160]
    assert all(it.prompt[:160] == first for it in shared)
    assert all(it.prompt[:64] != first[:64] for it in items if not it.shared)
    assert all(1 <= len(it.prompt) < 256 for it in items)
    assert workload(24, 16, seed=0) == items and workload(24, 16, seed=1) != items


def test_oracle_memo_equals_generate():
    from atom_core.config import Config

    rt = TorchReferenceRuntime.tiny(Config(lanes=1, kv_blocks=1, max_seq_len=128,
                                           prefill_chunk=64))
    o = Oracle(rt)
    p = list(range(0, 120, 3))
    full = rt.generate(p, 6)
    assert o.generate(p, 6) == full and o.calls == 1
    assert o.generate(p, 3) == full[:3] and o.calls == 1
    eos = full[1]
    assert o.generate(p, 6, eos) == rt.generate(p, 6, eos) and o.calls == 1
    long = list(range(125))
    assert o.generate(long, 10) == rt.generate(long, 10)  # capped by max_seq_len: 4 tokens
    assert len(o.generate(long, 10)) == 4
    assert oracle_for(rt) is oracle_for(TorchReferenceRuntime.tiny(
        Config(lanes=2, kv_blocks=2, max_seq_len=128, prefill_chunk=64)))
