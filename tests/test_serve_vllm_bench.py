"""A client nobody here wrote: vLLM's own serving benchmark (`vllm bench serve --backend openai
--dataset-name random`, run from vLLM's venv, `make vllm-venv`, with the model directory's
tokenizer) against `atom-core serve` in a subprocess: every request completes, at concurrency
1 and 16, and its /tokenize alignment finds the server's tokenizer. Skipped without vLLM's
venv."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".vllm-venv" / "bin" / "python"

# vLLM's benchmark, through its own argument parser (the venv's `vllm` entry point needs the
# package's metadata, which its CPU build may not have); each run's result as one JSON line
BENCH = """
import argparse, json, sys
from vllm.benchmarks.serve import add_cli_args, main
for conc in sys.argv[2:]:
    p = argparse.ArgumentParser()
    add_cli_args(p)
    args = p.parse_args([*sys.argv[1].split(), "--max-concurrency", conc])
    r = main(args)
    print("RESULT " + json.dumps({"concurrency": int(conc), "completed": r["completed"],
                                  "failed": r.get("failed", 0)}), flush=True)
"""


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's venv is not built (make vllm-venv)")
def test_vllm_bench_serve_completes_every_request(tmp_path: Path) -> None:
    from atom_core.serve.tokenizer import build_tiny_tokenizer

    model = build_tiny_tokenizer(tmp_path / "model")
    key = "bench-key"
    with socket.socket() as sock:  # (a free port; uvicorn binds it again with SO_REUSEADDR)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "atom_core.cli", "serve", str(model), "--port", str(port),
         "--max-num-seqs", "8", "--max-model-len", "512", "--log-level", "warning"],
        env={**os.environ, "ATOM_CORE_API_KEY": key}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while True:
            assert time.time() < deadline and server.poll() is None, "the server did not start"
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        argv = (f"--backend openai --base-url {base} --model {model} --tokenizer {model} "
                "--dataset-name random --random-input-len 24 --random-output-len 8 "
                "--num-prompts 16 --seed 0")
        out = subprocess.run([str(VLLM_PYTHON), "-c", BENCH, argv, "1", "16"], cwd=tmp_path,
                             env={**os.environ, "OPENAI_API_KEY": key}, capture_output=True,
                             text=True, timeout=300)
        results = [json.loads(ln[len("RESULT "):]) for ln in out.stdout.splitlines()
                   if ln.startswith("RESULT ")]
        assert results == [{"concurrency": c, "completed": 16, "failed": 0} for c in (1, 16)], \
            out.stdout[-2000:] + out.stderr[-2000:]
        assert "/tokenize unavailable" not in out.stdout
    finally:
        server.terminate()
        server.wait(30)
