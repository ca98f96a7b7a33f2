"""`atom-core serve` as a vLLM user meets it, with the real `openai` client over a real socket
(tests/test_serve.py's `Server`): a burst waits in the queue instead of getting 429s, vLLM's
extra endpoints (/version, /v1/tokenize, /v1/detokenize, /v1/models' `created` and
`max_model_len`), its `vllm:` metrics beside atom-core's own."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_serve import KEY, MODEL, Server, tiny_config  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def srv():
    with Server(tiny_config()) as s:
        yield s


def test_a_burst_of_300_waits_instead_of_429(srv: Server) -> None:
    """300 requests at once on 4 lanes: each waits for a lane (the default queue is deep
    enough) and gets the oracle's tokens; none is refused."""
    prompts = [f"burst {i}" for i in range(300)]

    async def run() -> list:
        c = srv.aclient()
        try:
            return await asyncio.gather(*(c.completions.create(
                model=MODEL, prompt=p, max_tokens=3, temperature=0,
                extra_body={"return_token_ids": True}) for p in prompts),
                return_exceptions=True)
        finally:
            await c.close()

    out = asyncio.run(run())
    failed = [r for r in out if isinstance(r, BaseException)]
    assert not failed, failed[:3]
    for p, r in zip(prompts, out, strict=True):
        assert r.choices[0].token_ids == srv.oracle(srv.tok.encode(p), 3)[:3]
    srv.wait_at_rest()


def test_a_full_queue_is_still_429() -> None:
    """429 stays, for a queue that is full (here one of depth 1 on one lane)."""
    with Server(tiny_config(lanes=1), delay=0.02, max_queue=1) as s:

        async def run() -> list:
            c = s.aclient()
            try:
                return await asyncio.gather(*(c.completions.create(
                    model=MODEL, prompt="x", max_tokens=20, temperature=0)
                    for _ in range(4)), return_exceptions=True)
            finally:
                await c.close()

        out = asyncio.run(run())
        refused = [r for r in out if isinstance(r, openai.RateLimitError)]
        assert len(refused) == 2 and all("--max-queue" in r.body["message"] for r in refused)
        assert sum(not isinstance(r, BaseException) for r in out) == 2


def test_version_tokenize_detokenize_and_models(srv: Server) -> None:
    import importlib.metadata

    r = httpx.get(srv.base + "/version", headers=AUTH)
    assert r.status_code == 200
    assert r.json() == {"version": importlib.metadata.version("atom-core")}
    r = httpx.post(srv.base + "/v1/tokenize", headers=AUTH,
                   json={"model": MODEL, "prompt": "héllo"})
    assert r.json() == {"tokens": srv.tok.encode("héllo"), "count": len("héllo".encode()),
                        "max_model_len": 256, "token_strs": None}
    r = httpx.post(srv.base + "/v1/tokenize", headers=AUTH,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["tokens"] == srv.tok.chat([{"role": "user", "content": "hi"}])
    r = httpx.post(srv.base + "/v1/detokenize", headers=AUTH,
                   json={"model": MODEL, "tokens": srv.tok.encode("héllo")})
    assert r.json() == {"prompt": "héllo"}
    r = httpx.post(srv.base + "/v1/detokenize", headers=AUTH,
                   json={"model": MODEL, "tokens": [1, 99999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    models = srv.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    m = models[0].model_dump()
    assert m["max_model_len"] == 256 and abs(m["created"] - time.time()) < 3600
    assert m["created"] == srv.app.state.started


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405), ("DELETE", "/version", 405),
    ("POST", "/v1/tokenize", 400)])
def test_errors_have_the_openai_shape(srv: Server, method: str, path: str, status: int) -> None:
    r = httpx.request(method, srv.base + path, headers=AUTH, json={"model": MODEL})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def scrape(s: Server) -> dict:
    r = httpx.get(s.base + "/metrics", headers=AUTH)
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def test_vllm_metrics_beside_atom_ones() -> None:
    with Server(tiny_config()) as s:
        c = s.client()
        prompt = "a shared prefix that is long enough to fill a whole chunk of 64 tokens: yes"
        assert len(s.tok.encode(prompt)) > 64
        for _ in range(2):  # the second one hits the prefix cache
            c.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
        s.wait_at_rest()
        m = scrape(s)
        lab = (("engine", "0"), ("model_name", MODEL))
        n = len(s.tok.encode(prompt))
        assert m[("vllm:prompt_tokens_total", lab)] == 2 * n
        assert m[("vllm:generation_tokens_total", lab)] == 10
        assert m[("vllm:prefix_cache_queries_total", lab)] == 2 * n
        hits = m[("vllm:prefix_cache_hits_total", lab)]
        assert hits == 64 and hits == m[("atom_prefix_hit_tokens_total", ())]
        assert m[("vllm:num_requests_running", lab)] == 0
        assert m[("vllm:num_requests_waiting", lab)] == 0
        assert m[("vllm:kv_cache_usage_perc", lab)] == 0.0
        assert m[("vllm:request_success_total", (*lab[:1], ("finished_reason", "length"),
                                                 lab[1]))] == 2
        for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
            assert m[(f"vllm:{h}_count", lab)] == 2
        assert m[("vllm:inter_token_latency_seconds_count", lab)] == 8
        assert m[("vllm:time_to_first_token_seconds_bucket", (*lab[:1], ("le", "0.001"),
                                                              lab[1]))] >= 0
        assert ("atom_busy_lanes", ()) in m  # atom-core's own stay


def test_vllms_paths_outside_v1_are_open_as_in_vllm(srv: Server) -> None:
    """vLLM serves /version, /tokenize and /detokenize without its API key (its serving
    benchmark calls /tokenize without one); the /v1 routes keep the key."""
    assert httpx.get(srv.base + "/version").status_code == 200
    r = httpx.post(srv.base + "/tokenize", json={"model": MODEL, "prompt": "ab",
                                                 "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["tokens"] == [97, 98]
    assert httpx.post(srv.base + "/detokenize", json={"tokens": [97]}).json() == {"prompt": "a"}
    r = httpx.post(srv.base + "/v1/tokenize", json={"model": MODEL, "prompt": "ab"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(srv.base + "/v1/models").status_code == 401
