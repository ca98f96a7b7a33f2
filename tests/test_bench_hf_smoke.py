"""Smoke test of the HFRuntime benchmark (`python -m bench.hf`), at small sizes: it runs every
method at every thread setting, the ratios are the tokens/s' ratios, and every method generated
the workload's tokens. No timing assertions: performance is measured by `make bench`."""

import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is a top-level directory, not an installed package
    sys.path.insert(0, str(ROOT))

from bench import hf  # noqa: E402


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3"])
def test_quick_json_reports_every_method(capsys, model: str) -> None:
    assert hf.main(["--quick", "--json", "--model", model, "--requests", "3", "--lanes",
                    "2"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["model"] == model and r["requests"] == 3
    assert r["generated_tokens"] == 3 * hf.QUICK_TOKENS
    assert (r["config"]["sliding_window"] is None) == (model == "tiny-llama")
    assert "threads_1" in r["by_threads"]
    assert len(r["by_threads"]) == (1 if r["machine"]["torch_threads_default"] == 1 else 2)
    for s in r["by_threads"].values():
        tps = s["tokens_per_s"]
        assert set(tps) == set(hf.METHODS)
        assert s["tokens"] == {m: r["generated_tokens"] for m in hf.METHODS}
        assert all(math.isfinite(v) and v > 0 for v in tps.values())
        assert s["ratio_vs_generate_serial"] == round(tps["hf_runtime"]
                                                      / tps["generate_serial"], 2)
        assert s["ratio_vs_generate_batched"] == round(tps["hf_runtime"]
                                                       / tps["generate_batched"], 2)
        # every method returned a list of tokens per request (how many equal generate's is
        # reported, not asserted: float32 may flip a near-tie)
        eq = s["requests_equal_to_generate_serial"]
        assert eq["generate_serial"] == 3 and all(0 <= v <= 3 for v in eq.values())


def test_mixed_lengths_differ_and_every_method_generates_them(capsys) -> None:
    """--mixed: the requests' output lengths differ (seeded, within max_seq_len), and every
    method generated exactly those tokens (batched generate truncated to each request's)."""
    from atom_core.demo import Item
    items = [Item([1] * 10, 16, False) for _ in range(40)]
    lengths = [it.max_new_tokens for it in hf.mixed(items, 16, 64)]
    assert set(lengths) == {4, 8, 16, 32}
    assert [it.max_new_tokens for it in hf.mixed(items, 16, 30)] == [min(n, 20) for n in lengths]
    assert hf.main(["--quick", "--mixed", "--json", "--requests", "4", "--lanes", "2"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["lengths"] == "mixed"
    for s in r["by_threads"].values():
        assert s["tokens"] == {m: r["generated_tokens"] for m in hf.METHODS}
