"""vLLM's OpenAI server with `--scheduler-cls atom_core.vllm.AtomScheduler` on its command
line, answered through the real `openai` client: the same tokens as vLLM's offline engine with
its own scheduler, streamed and not."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from test_engine import BLOCK, BLOCKS, MAX_LEN, SEQS, engine, greedy, prompts, run

KEY = secrets.token_hex(16)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # as a user runs it
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
             str(tiny_llama), "--served-model-name", "tiny", "--host", "127.0.0.1",
             "--port", str(port), "--api-key", KEY, "--dtype", "float32", "--enforce-eager",
             "--max-num-seqs", str(SEQS), "--max-model-len", str(MAX_LEN), "--block-size",
             str(BLOCK), "--num-gpu-blocks-override", str(BLOCKS), "--seed", "0",
             "--scheduler-cls", "atom_core.vllm.AtomScheduler"],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        client = openai.OpenAI(api_key=KEY, base_url=base, max_retries=0)
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the server did not come up:\n{log.read_text()[-4000:]}")
                time.sleep(1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "AtomScheduler" in log.read_text()  # the engine did run the class it was given


def test_openai_client_gets_vllms_tokens(server: str, tiny_llama: Path) -> None:
    ps = prompts()[:6]
    want = [list(o[0][0]) for o in run(engine(tiny_llama, None), ps, greedy(16))]
    client = openai.OpenAI(api_key=KEY, base_url=server, max_retries=0)
    for p, w in zip(ps, want, strict=True):
        res = client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True,
                                                    "return_token_ids": True})
        assert res.choices[0].token_ids == w
        assert res.usage.completion_tokens == 16 and res.usage.prompt_tokens == len(p)
    stream = client.completions.create(model="tiny", prompt=ps[3], max_tokens=16,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [t for ch in stream for c in ch.choices for t in (c.token_ids or [])] == want[3]
    # vLLM's own metrics read atom-core's numbers (its KV cache manager is not there)
    req = urllib.request.Request(server.removesuffix("/v1") + "/metrics",
                                 headers={"Authorization": f"Bearer {KEY}"})
    metrics = urllib.request.urlopen(req, timeout=30).read().decode()
    queries = [float(ln.split()[-1]) for ln in metrics.splitlines()
               if ln.startswith("vllm:prefix_cache_queries_total")]
    assert queries and queries[0] >= sum(map(len, ps))
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="wrong", base_url=server, max_retries=0).completions.create(
            model="tiny", prompt=ps[0], max_tokens=1)
