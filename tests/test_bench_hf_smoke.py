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
