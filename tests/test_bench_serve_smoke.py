"""Smoke test of the server load generator (`python -m bench.serve --quick`): it starts the real
server, reports every level, and every streamed token equals the batcher driven directly. No
timing assertions: performance is measured by `make bench`."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is a top-level directory, not an installed package
    sys.path.insert(0, str(ROOT))

from bench import serve  # noqa: E402


def test_quick_run_is_exact_and_reports_every_level(capsys) -> None:
    assert serve.main(["--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["server_exit_code"] == 0
    assert [r["concurrency"] for r in report["levels"]] == list(serve.QUICK_LEVELS)
    for r in report["levels"]:
        assert r["exact"] and r["tokens"] == report["direct"]["tokens"]
        assert r["tokens_per_s"] > 0 and r["ttft_ms"]["p50"] > 0


def test_quick_run_with_the_small_llama_is_exact(capsys) -> None:
    """`--model small-llama`: the server on the transformers runtime with a model directory
    (`serve --runtime hf --model DIR`) against HFRuntime driven directly, token for token."""
    pytest.importorskip("transformers")
    assert serve.main(["--quick", "--json", "--model", "small-llama"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["model"] == "small-llama" and report["server_exit_code"] == 0
    for r in report["levels"]:
        assert r["exact"] and r["tokens"] == report["direct"]["tokens"] > 0
