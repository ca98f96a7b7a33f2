"""vLLM's request parameters with the real `openai` client over a real socket: each sampled
output equals a small reference implementation of vLLM's logits processors written here (plain
Python over the oracle's logits, the same seeded draw), each greedy one the oracle's; greedy
outputs with every new parameter at its neutral value equal transformers' `generate()`."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from test_serve import KEY, MODEL, Server, tiny_config  # noqa: E402

from atom_core.demo import oracle_for  # noqa: E402
from atom_core.serve.tokenizer import (  # noqa: E402
    HFTokenizer,
    IncrementalText,
    build_tiny_tokenizer,
)

EOS = 256  # the byte tokenizer's


@pytest.fixture(scope="module")
def srv():
    with Server(tiny_config()) as s:
        yield s


def reference(s: Server, prompt: list[int], n: int, *, temperature: float = 1.0,
              top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
              presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
              repetition_penalty: float = 1.0, min_tokens: int = 0,
              end_ids: tuple[int, ...] = (EOS,), seed: int = 0, stop_at: int | None = EOS
              ) -> list[int]:
    """vLLM's processors, one at a time, in plain Python floats, over the oracle's logits; the
    draw is torch.multinomial with a generator seeded as the server's."""
    gen = torch.Generator().manual_seed(seed)
    seq, out = list(prompt), []
    while len(out) < n:
        x = [float(v) for v in s.runtime.oracle_logits(seq).tolist()]
        if len(out) < min_tokens:
            for i in end_ids:
                x[i] = -math.inf
        for i in set(prompt) | set(out):
            x[i] = x[i] / repetition_penalty if x[i] > 0 else x[i] * repetition_penalty
        for i, c in Counter(out).items():
            x[i] -= frequency_penalty * c + presence_penalty
        if temperature < 1e-5:
            t = max(range(len(x)), key=lambda i: (x[i], -i))
        else:
            x = [v / temperature for v in x]
            top = max(x)
            probs = [math.exp(v - top) for v in x]
            if min_p:
                probs = [p if p >= min_p * max(probs) else 0.0 for p in probs]
            if top_k:
                kth = sorted((v for v, p in zip(x, probs, strict=True) if p), reverse=True)
                kth = kth[min(top_k, len(kth)) - 1]
                probs = [p if v >= kth else 0.0 for v, p in zip(x, probs, strict=True)]
            total = sum(probs)
            probs = [p / total for p in probs]
            if top_p < 1.0:
                kept, acc = [0.0] * len(probs), 0.0
                for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
                    if acc >= top_p:
                        break
                    kept[i], acc = probs[i], acc + probs[i]
                probs = kept
            t = int(torch.multinomial(torch.tensor(probs, dtype=torch.float64), 1,
                                      generator=gen))
        out.append(t)
        seq.append(t)
        if t == stop_at:
            break
    return out


def ids(res) -> list[int]:
    return res.choices[0].token_ids


PROCESSORS = [
    {"presence_penalty": 1.5}, {"frequency_penalty": 1.0}, {"repetition_penalty": 1.3},
    {"min_p": 0.2}, {"top_k": 5}, {"top_p": 0.8},
    {"presence_penalty": -0.5, "frequency_penalty": 0.4, "repetition_penalty": 0.8,
     "min_p": 0.05, "top_k": 40, "top_p": 0.9}]


@pytest.mark.parametrize("params", PROCESSORS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_each_processor_equals_the_reference(srv: Server, params: dict,
                                             temperature: float) -> None:
    prompt = "penalise me, penalise me"
    extra = {k: v for k, v in params.items() if k not in ("presence_penalty",
                                                           "frequency_penalty", "top_p")}
    res = srv.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=temperature, seed=7,
        presence_penalty=params.get("presence_penalty"),
        frequency_penalty=params.get("frequency_penalty"), top_p=params.get("top_p"),
        extra_body={"return_token_ids": True, **extra})
    want = reference(srv, srv.tok.encode(prompt), 12, temperature=temperature, seed=7,
                     **params)
    assert ids(res) == want


def test_penalties_change_greedy_output(srv: Server) -> None:
    """(The processors are not vacuous here: a penalty moves the greedy choice.)"""
    prompt = srv.tok.encode("penalise me, penalise me")
    assert reference(srv, prompt, 12, temperature=0, repetition_penalty=1.3) != \
        srv.oracle(prompt, 12)


def test_ignore_eos_and_min_tokens(srv: Server) -> None:
    """'hello' ends greedily at EOS after 8 tokens: ignore_eos goes on past it (the oracle
    without an end), min_tokens holds EOS back until then (the reference's mask)."""
    c, prompt = srv.client(), srv.tok.encode("hello")
    plain = c.completions.create(model=MODEL, prompt="hello", max_tokens=12, temperature=0,
                                 extra_body={"return_token_ids": True})
    assert ids(plain)[-1] == EOS and len(ids(plain)) == 8
    assert plain.choices[0].finish_reason == "stop"
    res = c.completions.create(model=MODEL, prompt="hello", max_tokens=12, temperature=0,
                               extra_body={"return_token_ids": True, "ignore_eos": True})
    assert ids(res) == oracle_for(srv.runtime).generate(prompt, 12, None)  # (no end token)
    assert len(ids(res)) == 12 and res.choices[0].finish_reason == "length"
    res = c.completions.create(model=MODEL, prompt="hello", max_tokens=14, temperature=0,
                               extra_body={"return_token_ids": True, "min_tokens": 10})
    assert ids(res) == reference(srv, prompt, 14, temperature=0, min_tokens=10)
    assert EOS not in ids(res)[:10]
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=MODEL, prompt="x", max_tokens=2,
                             extra_body={"min_tokens": 3})
    assert exc.value.body["param"] == "min_tokens"


def test_stop_token_ids_and_include_stop_str(srv: Server) -> None:
    c = srv.client()
    want = srv.oracle(srv.tok.encode("Bursts"), 20)
    stop_id = want[4]
    res = c.completions.create(model=MODEL, prompt="Bursts", max_tokens=20, temperature=0,
                               extra_body={"return_token_ids": True,
                                           "stop_token_ids": [stop_id]})
    cut = want.index(stop_id) + 1
    assert ids(res) == want[:cut] and res.choices[0].finish_reason == "stop"
    assert res.choices[0].text == srv.tok.decode(want[:cut - 1])
    text = srv.tok.decode(want)
    stop = text[5:7]
    for stream in (False, True):
        got = c.completions.create(model=MODEL, prompt="Bursts", max_tokens=20, temperature=0,
                                   stop=[stop], stream=stream,
                                   extra_body={"include_stop_str_in_output": True})
        got = "".join(ch.choices[0].text for ch in got) if stream else got.choices[0].text
        assert got == text[:text.index(stop) + len(stop)]


def log_softmax(s: Server, seq: list[int]) -> list[float]:
    x = [float(v) for v in s.runtime.oracle_logits(seq).float().tolist()]
    top = max(x)
    z = top + math.log(sum(math.exp(v - top) for v in x))
    return [v - z for v in x]


def test_completion_logprobs_streamed_and_not(srv: Server) -> None:
    c, prompt = srv.client(), srv.tok.encode("log me")
    res = c.completions.create(model=MODEL, prompt="log me", max_tokens=6, temperature=0,
                               logprobs=3, extra_body={"return_token_ids": True})
    toks = ids(res)
    assert toks == srv.oracle(prompt, 6)
    lp = res.choices[0].logprobs
    offset = 0
    for i, t in enumerate(toks):
        lps = log_softmax(srv, prompt + toks[:i])
        assert lp.tokens[i] == srv.tok.decode([t])
        assert lp.token_logprobs[i] == pytest.approx(lps[t], abs=1e-4)
        best = sorted(range(len(lps)), key=lambda j: (-lps[j], j))[:3]
        want = {srv.tok.decode([j]): lps[j] for j in [t, *(j for j in best if j != t)]}
        assert lp.top_logprobs[i] == pytest.approx(want, abs=1e-4)
        assert lp.text_offset[i] == offset
        offset += len(lp.tokens[i])
    chunks = list(c.completions.create(model=MODEL, prompt="log me", max_tokens=6,
                                       temperature=0, logprobs=3, stream=True))
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def test_chat_logprobs_streamed_and_not(srv: Server) -> None:
    c, msgs = srv.client(), [{"role": "user", "content": "hi"}]
    prompt = srv.tok.chat(msgs)
    res = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0,
                                    logprobs=True, top_logprobs=2,
                                    extra_body={"return_token_ids": True})
    toks = ids(res)
    content = res.choices[0].logprobs.content
    assert len(content) == len(toks) == 5
    for i, (t, e) in enumerate(zip(toks, content, strict=True)):
        lps = log_softmax(srv, prompt + toks[:i])
        assert e.token == srv.tok.decode([t]) and e.logprob == pytest.approx(lps[t], abs=1e-4)
        assert e.bytes == list(e.token.encode())
        assert [x.token for x in e.top_logprobs][0] == e.token  # (vLLM's: the chosen first)
        assert len(e.top_logprobs) == 2
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5,
                                            temperature=0, logprobs=True, top_logprobs=2,
                                            stream=True))
    streamed = [x.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.content]
    assert streamed == [e.logprob for e in content]


def scrape_hits(s: Server) -> float:
    text = httpx.get(s.base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:prefix_cache_hits_total"))
    return float(line.split()[-1])


def test_n_copies_share_the_prompt_through_the_prefix_cache() -> None:
    with Server(tiny_config()) as s:
        c = s.client()
        prompt = "a long shared prompt, " * 5  # 110 bytes: one whole 64-token chunk
        before = scrape_hits(s)
        res = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0.9,
                                   seed=11, n=3, extra_body={"return_token_ids": True})
        assert [ch.index for ch in res.choices] == [0, 1, 2]
        p = s.tok.encode(prompt)
        for i, ch in enumerate(res.choices):  # (vLLM's copies: seeds 11, 12, 13)
            assert ch.token_ids == reference(s, p, 6, temperature=0.9, seed=11 + i)
        assert res.usage.prompt_tokens == len(p) and res.usage.completion_tokens == 18
        assert scrape_hits(s) - before == 3 * 64  # each copy took the cached chunk
        chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                           temperature=0.9, seed=11, n=3, stream=True))
        texts = ["".join(ch.choices[0].text for ch in chunks if ch.choices
                         and ch.choices[0].index == i) for i in range(3)]
        assert texts == [ch.text for ch in res.choices]
        s.wait_at_rest()


def test_a_list_of_prompts(srv: Server) -> None:
    prompts = ["first", "second one"]
    res = srv.client().completions.create(model=MODEL, prompt=prompts, max_tokens=4,
                                          temperature=0, n=2,
                                          extra_body={"return_token_ids": True})
    assert [ch.index for ch in res.choices] == [0, 1, 2, 3]
    for ch in res.choices:
        want = srv.oracle(srv.tok.encode(prompts[ch.index // 2]), 4)
        assert ch.token_ids == want and ch.text == srv.tok.decode(want)
    assert res.usage.prompt_tokens == sum(len(p.encode()) for p in prompts)


def test_echo_streamed_and_not(srv: Server) -> None:
    c = srv.client()
    for prompt in ("echo me", [101, 99, 104, 111]):
        res = c.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                   echo=True)
        text = prompt if isinstance(prompt, str) else srv.tok.decode(prompt)
        ids_ = srv.tok.encode(prompt) if isinstance(prompt, str) else prompt
        assert res.choices[0].text == text + srv.tok.decode(srv.oracle(ids_, 5))
        chunks = c.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                      echo=True, stream=True)
        assert "".join(ch.choices[0].text for ch in chunks) == res.choices[0].text


def test_response_format_json_object_stays_a_clear_400(srv: Server) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        srv.client().chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                     "content": "x"}],
                                             response_format={"type": "json_object"})
    assert exc.value.body["param"] == "response_format"


def test_skip_special_tokens_keeps_their_text(tmp_path) -> None:
    tok = HFTokenizer(build_tiny_tokenizer(tmp_path / "model"))
    end = tok.eos_token_id
    some = tok.encode("Hello world")
    assert IncrementalText(tok).tok.decode([*some, end]) == "Hello world"
    keep = IncrementalText(tok.keeping_special())
    text = "".join(keep.add(t) for t in [*some, end]) + keep.finish()
    assert text == "Hello world<|end|>"


# ------------------------------------------------------------------ greedy vs generate()
class HFServer(Server):
    """Server over transformers' tiny Llama (HFRuntime), byte tokenizer."""

    def __init__(self) -> None:
        from atom_core.runtime.hf import GenerateOracle, HFRuntime

        cfg = tiny_config(lanes=2)
        super().__init__(cfg, runtime=HFRuntime.tiny_llama(cfg, seed=0, vocab_size=257))
        self.generate_oracle = GenerateOracle(self.runtime)


def test_greedy_with_every_new_parameter_neutral_equals_generate() -> None:
    pytest.importorskip("transformers")
    neutral = {"return_token_ids": True, "repetition_penalty": 1.0, "min_p": 0.0,
               "min_tokens": 0, "ignore_eos": False, "skip_special_tokens": True,
               "include_stop_str_in_output": False, "top_k": -1}
    with HFServer() as s:
        c = s.client()
        for prompt in ("The quick brown fox", "hello"):
            want = s.generate_oracle.generate(s.tok.encode(prompt), 10, EOS)
            res = c.completions.create(model=MODEL, prompt=[prompt], max_tokens=10,
                                       temperature=0, n=1, presence_penalty=0,
                                       frequency_penalty=0, top_p=1, logprobs=None,
                                       echo=False, extra_body=neutral)
            assert ids(res) == want
            chat = c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=10,
                temperature=0, logprobs=False, extra_body=neutral)
            assert chat.choices[0].token_ids == s.generate_oracle.generate(
                s.tok.chat([{"role": "user", "content": prompt}]), 10, EOS)


def test_a_burst_with_n_and_logprobs_leaves_the_server_at_rest(srv: Server) -> None:
    async def run() -> list:
        c = srv.aclient()
        try:
            return await asyncio.gather(*(c.completions.create(
                model=MODEL, prompt=f"p{i}", max_tokens=3, temperature=0.5, seed=i, n=2,
                logprobs=1) for i in range(20)))
        finally:
            await c.close()

    out = asyncio.run(run())
    assert all(len(r.choices) == 2 and len(r.choices[1].logprobs.tokens) == 3 for r in out)
    time.sleep(0.05)
    srv.wait_at_rest()


def test_cached_tokens_in_usage() -> None:
    """usage.prompt_tokens_details.cached_tokens: the prompt tokens a request took from the
    prefix cache (0 the first time, a whole chunk the second), streamed and not."""
    with Server(tiny_config()) as s:
        c = s.client()
        prompt = "a prompt longer than one chunk of sixty-four tokens, to be cached whole!"
        assert len(prompt) > 64
        first = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        again = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == 64
        chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 64
        chat = c.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                         messages=[{"role": "user", "content": prompt}])
        assert chat.usage.prompt_tokens_details.cached_tokens == 0
        chat = c.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                         messages=[{"role": "user", "content": prompt}])
        assert chat.usage.prompt_tokens_details.cached_tokens == 64


def test_chat_n_with_logprobs_streams_what_it_returns(srv: Server) -> None:
    """Chat, n=2, seeded, logprobs: the streamed choices (interleaved, by index) are the
    non-streamed ones, text and logprobs; usage counts the prompt once."""
    c, msgs = srv.client(), [{"role": "user", "content": "hi"}]
    args = {"model": MODEL, "messages": msgs, "max_tokens": 4, "n": 2, "temperature": 0.7,
            "seed": 3, "logprobs": True, "top_logprobs": 1}
    res = c.chat.completions.create(**args)
    chunks = list(c.chat.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True}))
    for ch in res.choices:
        mine = [x.choices[0] for x in chunks if x.choices and x.choices[0].index == ch.index]
        assert "".join(d.delta.content or "" for d in mine) == ch.message.content
        assert [e.logprob for d in mine if d.logprobs for e in d.logprobs.content] == \
            [e.logprob for e in ch.logprobs.content]
    assert chunks[-1].usage.prompt_tokens == len(srv.tok.chat(msgs)) == res.usage.prompt_tokens
    assert res.usage.completion_tokens == 8
