"""A client nobody here wrote: vLLM's own serving benchmark (`vllm bench serve --backend openai
--dataset-name random`, run from vLLM's venv, `make vllm-venv`, with the model directory's
tokenizer) against `atom-core serve` in a subprocess: every request completes, at concurrency
1 and 16, and its /tokenize alignment finds the server's tokenizer. Skipped without vLLM's
venv."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from bench.vllm_client import VLLM_PYTHON, run, served  # noqa: E402


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's venv is not built (make vllm-venv)")
def test_vllm_bench_serve_completes_every_request(tmp_path: Path) -> None:
    from atom_core.serve.tokenizer import build_tiny_tokenizer

    model = build_tiny_tokenizer(tmp_path / "model")
    key = "bench-key"
    with served(model, key, ["--max-num-seqs", "8", "--max-model-len", "512"]) as base:
        results, output = run(base, model, key, (1, 16), prompts=16, input_len=24,
                              output_len=8, cwd=tmp_path)
    assert [(r["concurrency"], r["completed"], r.get("failed", 0)) for r in results] \
        == [(1, 16, 0), (16, 16, 0)], output
    assert "/tokenize unavailable" not in output
