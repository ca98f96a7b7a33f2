"""vLLM's own serving benchmark against `atom-core serve`: `python -m bench.vllm_client` (part of
`make bench`; needs vLLM's venv, `make vllm-venv`, and says so without it).

A client nobody here wrote: `vllm bench serve --backend openai --dataset-name random`, run
from vLLM's venv through its own argument parser (the venv's `vllm` entry point needs package
metadata its CPU build may lack), with the model directory as its tokenizer. The server is the
real one in a subprocess on loopback (`--model DIR`: the built-in reference model behind the
directory's tokenizer, unless `--runtime hf` serves the directory's weights). One table: per
concurrency, requests completed and failed, request and output throughput, TTFT median and
p99, ITL median, as vLLM's benchmark measured them. A failed request is the benchmark's
failure, not a number to report: the exit status says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".vllm-venv" / "bin" / "python"

# run in vLLM's venv: argv[1] the benchmark's flags, argv[2:] the concurrencies; each run's
# result (its scalar fields) as one JSON line
BENCH = """
import argparse, json, sys
from vllm.benchmarks.serve import add_cli_args, main
for conc in sys.argv[2:]:
    p = argparse.ArgumentParser()
    add_cli_args(p)
    r = main(p.parse_args([*sys.argv[1].split(), "--max-concurrency", conc]))
    keep = {k: v for k, v in r.items() if isinstance(v, (int, float, str)) or v is None}
    print("RESULT " + json.dumps({"concurrency": int(conc), **keep}), flush=True)
"""


@contextlib.contextmanager
def served(model: Path, key: str, extra: Sequence[str] = ()) -> Iterator[str]:
    """`atom-core serve MODEL` in a subprocess on a free loopback port; yields its base URL
    once /health answers (60 s at most), and stops it afterwards."""
    import httpx

    with socket.socket() as sock:  # (a free port; uvicorn binds it again with SO_REUSEADDR)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "atom_core.cli", "serve", str(model), "--port", str(port),
         "--log-level", "warning", *extra],
        env={**os.environ, "ATOM_CORE_API_KEY": key}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while True:
            if time.time() > deadline or server.poll() is not None:
                raise RuntimeError(f"atom-core serve {model} did not start (exit status "
                                   f"{server.poll()})")
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield base
    finally:
        server.terminate()
        server.wait(30)


def run(base: str, model: Path, key: str, concurrencies: Sequence[int], *, prompts: int,
        input_len: int, output_len: int, cwd: Path) -> tuple[list[dict[str, Any]], str]:
    """vLLM's benchmark against `base` at each concurrency: its results (one dict each, in
    order) and its output (for a failure's message)."""
    argv = (f"--backend openai --base-url {base} --model {model} --tokenizer {model} "
            f"--dataset-name random --random-input-len {input_len} "
            f"--random-output-len {output_len} --num-prompts {prompts} --seed 0 "
            "--percentile-metrics ttft,itl --metric-percentiles 50,99")
    out = subprocess.run([str(VLLM_PYTHON), "-c", BENCH, argv, *map(str, concurrencies)],
                         cwd=cwd, env={**os.environ, "OPENAI_API_KEY": key},
                         capture_output=True, text=True, timeout=1800)
    results = [json.loads(ln[len("RESULT "):]) for ln in out.stdout.splitlines()
               if ln.startswith("RESULT ")]
    return results, out.stdout + out.stderr[-3000:]


def table(results: list[dict[str, Any]]) -> str:
    head = ("concurrency", "completed", "failed", "req/s", "out tok/s", "TTFT p50 ms",
            "TTFT p99 ms", "ITL p50 ms")
    rows = [(r["concurrency"], r["completed"], r.get("failed", 0),
             f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}",
             f"{r.get('median_ttft_ms', float('nan')):.1f}",
             f"{r.get('p99_ttft_ms', float('nan')):.1f}",
             f"{r.get('median_itl_ms', float('nan')):.2f}") for r in results]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    return "\n".join("  ".join(str(x).rjust(w) for x, w in zip(line, widths, strict=True))
                     for line in (head, *rows))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None,
                    help="a model directory (default: the built-in model's tokenizer, saved "
                         "to a temporary directory, served by the reference runtime)")
    ap.add_argument("--runtime", default=None, help="serve's --runtime (default: serve's)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompts", type=int, default=64, help="requests per concurrency level")
    ap.add_argument("--input-len", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    args = ap.parse_args(argv)
    if not VLLM_PYTHON.exists():
        print("bench.vllm_client: skipped, vLLM's venv is not built (make vllm-venv)")
        return 0
    from atom_core.serve.tokenizer import build_tiny_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_tiny_tokenizer(Path(tmp) / "model")
        extra = ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "512"]
        if args.runtime:
            extra += ["--runtime", args.runtime]
        key = "bench-key"
        with served(model, key, extra) as base:
            results, output = run(base, model, key, args.concurrency, prompts=args.prompts,
                                  input_len=args.input_len, output_len=args.output_len,
                                  cwd=Path(tmp))
    print(f"vLLM's serving benchmark against atom-core serve ({args.prompts} requests per "
          f"level, {args.input_len} prompt tokens, {args.output_len} output tokens, "
          f"--max-num-seqs {args.max_num_seqs})")
    if len(results) != len(args.concurrency):
        print(output)
        print("the benchmark did not finish every level")
        return 1
    print(table(results))
    failed = sum(r.get("failed", 0) for r in results)
    if failed:
        print(f"{failed} requests failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
