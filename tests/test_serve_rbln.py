"""`atom-core serve --runtime rbln --compiled PATH`: the Config comes from the artifact's
rbln_config.json and tokens through the RBLN binding (a fake `rebel` backed by the reference
model, tests/test_runtime_rbln.py) reach the openai client equal to the oracle."""

from __future__ import annotations

import json
import threading
import time

import attrs
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import test_runtime_rbln as rbln  # noqa: E402

from atom_core.cli import build_parser  # noqa: E402
from atom_core.config import Config, ConfigError  # noqa: E402
from atom_core.serve.main import build  # noqa: E402

world = rbln.world  # the fake `rebel` fixture


def _byte_vocab(world, art):
    """The artifact's model with the byte tokenizer's vocabulary (its end token, 256, must be
    one the model can emit: `serve` refuses a tokenizer whose end token it cannot)."""
    ref = world["ref"]
    world["ref"] = rbln.TorchReferenceRuntime(attrs.evolve(ref.spec, vocab_size=257))
    (art / "config.json").write_text(json.dumps({"vocab_size": 257}))


def test_serve_refuses_a_tokenizer_whose_end_token_the_model_cannot_emit(world, tmp_path):
    art = rbln.write_artifact(tmp_path / "compiled", rbln.ALL)  # vocabulary 0..127
    args = build_parser().parse_args(["serve", "--runtime", "rbln", "--compiled", str(art),
                                      "--api-key", "k"])
    with pytest.raises(ConfigError, match=r"end-of-sequence token id 256 outside the model's "
                                          r"vocabulary 0\.\.127"):
        build(args)


def test_serve_reads_the_artifact_and_serves_through_the_binding(world, tmp_path):
    art = rbln.write_artifact(tmp_path / "compiled", rbln.ALL)
    _byte_vocab(world, art)
    args = build_parser().parse_args(["serve", "--runtime", "rbln", "--compiled", str(art),
                                      "--api-key", "k"])
    app, engine, _settings = build(args)
    assert engine.batcher.config == Config.from_rbln(art)
    assert (engine.batcher.config.kv_blocks, engine.batcher.config.max_seq_len) == (rbln.K, rbln.S)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started:
            assert time.time() < deadline
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        client = openai.OpenAI(api_key="k", base_url=f"http://127.0.0.1:{port}/v1",
                               max_retries=0)
        prompt = [(3 * i + 1) % 128 for i in range(70)]
        res = client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                        temperature=0, extra_body={"return_token_ids": True})
        assert res.choices[0].token_ids == world["ref"].generate(prompt, 6)
        assert world["runtimes"]["prefill"].calls  # it went through the binding
    finally:
        server.should_exit = True
        thread.join(30)
