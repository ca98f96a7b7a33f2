"""`echo` with `logprobs` on /v1/completions (vLLM's prompt logprobs) and `--max-logprobs`.

The prompt's logprobs come from the prefill calls that fill its KV (the runtime's
`prompt_logits` capability: every real token's logits of a chunk), over several chunks, in
mixed calls beside a decode and in plain prefill calls, and never from the prefix cache (the
entries a request would hit are dropped before it is admitted). Checked against an independent
forward: the reference runtime's cache-free `oracle_logits` exactly, and transformers' own
forward (sdpa attention, its own cache) over the tiny Llama in float64 within 1e-9, through the
batcher and through the real `openai` client, streamed and not."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
uvicorn = pytest.importorskip("uvicorn")

import test_runtime_rbln as rbln  # noqa: E402
from test_serve import KEY, MODEL, Server, tiny_config  # noqa: E402

from atom_core.batcher import AtomBatcher  # noqa: E402
from atom_core.cli import build_parser  # noqa: E402
from atom_core.config import Config  # noqa: E402
from atom_core.runtime.reference import TorchReferenceRuntime  # noqa: E402
from atom_core.serve.app import ServerSettings, create_app  # noqa: E402
from atom_core.serve.engine import Engine  # noqa: E402
from atom_core.serve.main import MAX_LOGPROBS_BOUND, build  # noqa: E402
from atom_core.serve.outputs import FLOOR  # noqa: E402
from atom_core.serve.tokenizer import ByteTokenizer  # noqa: E402

world = rbln.world  # the fake `rebel` fixture
F64 = torch.float64
C = 64
# three prefill chunks of 64 (the last one short), ASCII so each token's text is its character
PROMPT = ("Echo returns the prompt, and with logprobs each prompt token's log-probability "
          "given the tokens before it: the first has none, as vLLM's; the rest come along.")
assert 2 * C < len(PROMPT) < 3 * C


class Collect:
    """A `prompt_logits` hook that keeps what it is given: start -> logits [n, V]."""

    def __init__(self) -> None:
        self.calls: dict[int, torch.Tensor] = {}

    def __call__(self, start: int, logits: torch.Tensor) -> None:
        assert start not in self.calls
        self.calls[start] = logits.clone()

    def every(self) -> torch.Tensor:
        return torch.cat([self.calls[s] for s in sorted(self.calls)])


def ids_of(text: str) -> list[int]:
    return list(text.encode())


def cfg_of(lanes: int = 2) -> Config:
    return tiny_config(lanes)


# ------------------------------------------------------------------ the batcher and runtimes
def test_reference_prompt_logits_are_the_oracle_exactly_and_never_from_the_cache() -> None:
    """Every prompt position's logits through the batcher equal the cache-free oracle's bit for
    bit, chunk by chunk (starts 0, 64, 128); a request without the hook hits the cache its
    prompt left, and one with it computes its whole prompt again (the entries it would hit
    are dropped first)."""
    cfg = cfg_of()
    rt = TorchReferenceRuntime.tiny(cfg, seed=0)
    b = AtomBatcher(cfg, rt)
    prompt = ids_of(PROMPT)[:150]
    hook = Collect()
    rid = b.submit(prompt, 3, None, prompt_logits=hook)
    out = b.run_until_done()
    assert sorted(hook.calls) == [0, 64, 128]
    assert [len(hook.calls[s]) for s in (0, 64, 128)] == [64, 64, 22]
    got = hook.every()
    for p in range(len(prompt)):
        assert torch.equal(got[p], rt.oracle_logits(prompt[:p + 1])), p
    assert out[rid].tokens == rt.generate(prompt, 3)
    b.submit(prompt, 3, None)
    b.run_until_done()
    assert b.stats.prefix_hit_tokens == 128  # the cache holds its first two chunks
    again = Collect()
    rid = b.submit(prompt, 3, None, prompt_logits=again)
    out = b.run_until_done()
    assert b.stats.prefix_hit_tokens == 128 and sorted(again.calls) == [0, 64, 128]
    assert torch.equal(again.every(), got) and out[rid].tokens == rt.generate(prompt, 3)
    b.check_invariants()


def hf_runtime(cfg: Config, **kw):
    from atom_core.runtime.hf import HFRuntime

    return HFRuntime.tiny_llama(cfg, seed=0, dtype=F64, vocab_size=257, **kw)


def forward(rt, seq: list[int]) -> torch.Tensor:
    """transformers' own forward over `seq` (sdpa attention, no block table): logits [L, V]."""
    from atom_core.runtime.hf import GenerateOracle

    model = GenerateOracle(rt).model
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].to(F64)


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed-calls", "prefill-calls"])
def test_hf_prompt_logits_equal_transformers_forward(mixed: bool) -> None:
    """float64: the logits each prompt position gets through the batcher, in mixed calls
    beside another lane's decode or in plain prefill calls, equal transformers' own forward over
    the prompt within 1e-9; the tokens equal generate()'s."""
    pytest.importorskip("transformers")
    from atom_core.runtime.hf import GenerateOracle

    cfg = cfg_of()
    rt = hf_runtime(cfg, **({} if mixed else {"mixed_calls": False, "static_batch": True}))
    b = AtomBatcher(cfg, rt)
    other = b.submit(ids_of("another lane decodes meanwhile"), 12, None)
    b.step()
    b.step()  # (its prefill is done: it decodes beside the chunks below)
    prompt = ids_of(PROMPT)
    hook = Collect()
    rid = b.submit(prompt, 4, None, prompt_logits=hook)
    out = b.run_until_done()
    assert sorted(hook.calls) == [0, 64, 128]
    if mixed:
        assert rt.calls["mixed"] >= 3 and rt.calls["decode"] >= 3
    torch.testing.assert_close(hook.every(), forward(rt, prompt), atol=1e-9, rtol=0)
    oracle = GenerateOracle(rt)
    assert out[rid].tokens == oracle.generate(prompt, 4)
    assert out[other].tokens == oracle.generate(ids_of("another lane decodes meanwhile"), 12)


def test_a_runtime_without_the_capability_refuses(world, tmp_path) -> None:
    """RBLN's compiled prefill graph returns its last position's logits only: the batcher
    refuses a request that wants every position's, and the server answers echo with logprobs
    with a 400 that says why."""
    from fastapi.testclient import TestClient

    art = rbln.write_artifact(tmp_path / "compiled", rbln.ALL)
    rt = rbln.RblnRuntime.from_compiled(art)
    assert getattr(rt, "prompt_logits", False) is False
    b = AtomBatcher(Config.from_rbln(art), rt)
    with pytest.raises(ValueError, match="prompt_logits capability"):
        b.submit([1, 2, 3], 2, None, prompt_logits=Collect())
    assert not b.requests
    app = create_app(Engine(b), ByteTokenizer(), ServerSettings(model_name=MODEL, api_key=KEY))
    r = TestClient(app).post("/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                             json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                   "echo": True, "logprobs": 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "echo"
    assert "returns a prefill's last position's only" in err["message"]
    assert "RBLN" in err["message"]


# ------------------------------------------------------------------ the openai client
class HF64Server(Server):
    """The server over the tiny Llama in float64 (HFRuntime: mixed calls), byte tokenizer."""

    def __init__(self) -> None:
        cfg = cfg_of()
        super().__init__(cfg, runtime=hf_runtime(cfg))


def expected(tok: ByteTokenizer, seq: list[int], n_prompt: int, lp: torch.Tensor,
             k: int) -> dict:
    """vLLM's logprobs object for echo: prompt then completion tokens; the first token's
    logprob and top_logprobs null; each later token's from the position before it (`lp`: the
    reference's log_softmax [L, V]), its top_logprobs the token itself then the k most likely
    others, floored at -9999; text_offset each token's text's start."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    at = 0
    for i, t in enumerate(seq):
        text = tok.decode([t])
        out["tokens"].append(text)
        out["text_offset"].append(at)
        at += len(text)
        if i == 0:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        row = lp[i - 1]
        out["token_logprobs"].append(max(float(row[t]), FLOOR))
        ranked = [t, *(j for j in torch.topk(row, k).indices.tolist() if j != t)][:k + 1]
        out["top_logprobs"].append({tok.decode([j]): max(float(row[j]), FLOOR)
                                    for j in ranked})
    assert n_prompt >= 1
    return out


def assert_logprobs(got, want: dict) -> None:
    assert got.tokens == want["tokens"] and got.text_offset == want["text_offset"]
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(got.token_logprobs[1:], dtype=F64),
                               torch.tensor(want["token_logprobs"][1:], dtype=F64),
                               atol=1e-9, rtol=0)
    for g, w in zip(got.top_logprobs[1:], want["top_logprobs"][1:], strict=True):
        assert list(g) == list(w)
        torch.testing.assert_close(torch.tensor(list(g.values()), dtype=F64),
                                   torch.tensor(list(w.values()), dtype=F64),
                                   atol=1e-9, rtol=0)


def joined(chunks) -> tuple[str, dict]:
    """A stream's text and its logprobs' lists, joined."""
    text, lps = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in chunks:
        for c in ch.choices:
            text += c.text
            if c.logprobs is not None:
                for key in lps:
                    lps[key] += getattr(c.logprobs, key)
    return text, lps


def test_echo_with_logprobs_through_the_openai_client() -> None:
    """echo + logprobs=2, max_tokens=3, over the float64 tiny Llama: the choice's text is the
    prompt's then the reply's; its logprobs cover prompt and reply tokens, equal to
    transformers' own forward over them within 1e-9 (the first prompt token's null), the
    reply's tokens those of generate(); streamed, the same (the prompt with the first token);
    no request with echo and logprobs takes the prefix cache, a plain one after it does."""
    pytest.importorskip("transformers")
    from atom_core.runtime.hf import GenerateOracle

    with HF64Server() as s:
        c = s.client()
        prompt = ids_of(PROMPT)
        gen = GenerateOracle(s.runtime).generate(prompt, 3)
        seq = prompt + gen
        lp = torch.log_softmax(forward(s.runtime, seq), dim=-1)
        want = expected(s.tok, seq, len(prompt), lp, 2)
        res = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                   echo=True, logprobs=2, extra_body={"return_token_ids": True})
        choice = res.choices[0]
        assert choice.token_ids == gen
        assert choice.text == PROMPT + s.tok.decode(gen)
        assert_logprobs(choice.logprobs, want)
        assert res.usage.prompt_tokens_details.cached_tokens == 0
        plain = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
        assert plain.usage.prompt_tokens_details.cached_tokens == 2 * C
        chunks = list(c.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2,
            stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
        first = next(ch for ch in chunks if ch.choices)
        # (the prompt comes with the first token, as vLLM's first chunk)
        assert first.choices[0].text.startswith(PROMPT)
        assert len(first.choices[0].logprobs.tokens) == len(prompt) + 1
        text, lps = joined(chunks)
        assert text == choice.text

        class Joined:
            tokens, token_logprobs = lps["tokens"], lps["token_logprobs"]
            top_logprobs, text_offset = lps["top_logprobs"], lps["text_offset"]

        assert_logprobs(Joined, want)
        # a list of prompts given as ids, two choices each: each choice its prompt's
        res = c.completions.create(model=MODEL, prompt=[prompt[:70], prompt[:5]], max_tokens=2,
                                   temperature=0, echo=True, logprobs=0, n=2)
        for i, p in enumerate([prompt[:70], prompt[:70], prompt[:5], prompt[:5]]):
            got = res.choices[i].logprobs
            assert got.tokens[:len(p)] == [s.tok.decode([t]) for t in p]
            assert got.token_logprobs[0] is None and len(got.tokens) == len(p) + 2
            assert all(len(d) == 1 for d in got.top_logprobs[1:])
        s.wait_at_rest()


# ------------------------------------------------------------------ --max-logprobs
def test_max_logprobs_bounds_requests_with_a_400_naming_the_limit() -> None:
    with Server(tiny_config(), max_logprobs=3) as s:
        c = s.client()
        with pytest.raises(openai.BadRequestError) as exc:
            c.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=4)
        assert exc.value.body["param"] == "logprobs"
        assert "Requested sample logprobs of 4, which is greater than max allowed: 3" in \
            exc.value.body["message"]
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                      max_tokens=2, logprobs=True, top_logprobs=4)
        assert exc.value.body["param"] == "top_logprobs"
        assert "max allowed: 3" in exc.value.body["message"]
        res = c.completions.create(model=MODEL, prompt="hello", max_tokens=2, logprobs=3,
                                   echo=True, temperature=0)
        got = res.choices[0].logprobs
        assert len(got.tokens) == 7 and got.top_logprobs[0] is None
        # each token itself first, then the 3 most likely others (bytes past ASCII all decode
        # to one text, whose entries are one key)
        for t, d in zip(got.tokens[1:], got.top_logprobs[1:], strict=True):
            assert list(d)[0] == t and 1 <= len(d) <= 4
        assert all(len(d) >= 3 for d in got.top_logprobs[1:5])  # (the prompt's: ASCII)
    with Server(tiny_config()) as s:  # the default: vLLM's 20
        with pytest.raises(openai.BadRequestError, match="max allowed: 20"):
            s.client().completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=21)
        res = s.client().completions.create(model=MODEL, prompt="x", max_tokens=1,
                                            logprobs=20)
        got = res.choices[0].logprobs
        assert list(got.top_logprobs[0])[0] == got.tokens[0]
        assert len(got.top_logprobs[0]) <= 21


def test_max_logprobs_flag_is_bounded() -> None:
    p = build_parser()
    args = p.parse_args(["serve", "--max-logprobs", "50", "--api-key", "k"])
    _app, _engine, settings = build(args)
    assert settings.max_logprobs == 50
    assert p.parse_args(["serve", "--api-key", "k"]).max_logprobs == 20
    for bad in ("-1", str(MAX_LOGPROBS_BOUND + 1), "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["serve", "--max-logprobs", bad, "--api-key", "k"])
    with pytest.raises(ValueError):
        ServerSettings(model_name=MODEL, api_key=KEY, max_logprobs=MAX_LOGPROBS_BOUND + 1)


# ------------------------------------------------------------------ max_tokens 0: the prompt alone
def test_max_tokens_0_with_echo_scores_the_prompt_alone() -> None:
    """Evaluation harnesses' log-likelihood request (echo, logprobs, max_tokens 0), as vLLM
    answers it: the choice is the prompt alone (its text, its tokens' logprobs equal to
    transformers' own forward within 1e-9), no generated token anywhere (text, token_ids,
    logprobs, usage), finish_reason that of the one token the core samples and drops;
    streamed the same; n > 1 and a list of prompts too; without logprobs, the text alone."""
    pytest.importorskip("transformers")
    from atom_core.runtime.hf import GenerateOracle

    with HF64Server() as s:
        c = s.client()
        prompt = ids_of(PROMPT)
        lp = torch.log_softmax(forward(s.runtime, prompt), dim=-1)
        want = expected(s.tok, prompt, len(prompt), lp, 2)
        why = s.reason(GenerateOracle(s.runtime).generate(prompt, 1))
        res = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, temperature=0,
                                   echo=True, logprobs=2, extra_body={"return_token_ids": True})
        (choice,) = res.choices
        assert choice.text == PROMPT and choice.token_ids == []
        assert choice.finish_reason == why
        assert len(choice.logprobs.tokens) == len(prompt)
        assert_logprobs(choice.logprobs, want)
        assert (res.usage.prompt_tokens, res.usage.completion_tokens,
                res.usage.total_tokens) == (len(prompt), 0, len(prompt))

        chunks = list(c.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=0, temperature=0, echo=True, logprobs=2,
            stream=True, stream_options={"include_usage": True}))
        text, lps = joined(chunks)
        assert text == PROMPT and len(lps["tokens"]) == len(prompt)
        assert [x.finish_reason for ch in chunks for x in ch.choices][-1] == why
        assert chunks[-1].usage.completion_tokens == 0
        assert chunks[-1].usage.prompt_tokens == len(prompt)

        class Joined:
            tokens, token_logprobs = lps["tokens"], lps["token_logprobs"]
            top_logprobs, text_offset = lps["top_logprobs"], lps["text_offset"]

        assert_logprobs(Joined, want)

        parts = [prompt[:70], prompt[:5]]
        for stream in (False, True):
            res = c.completions.create(model=MODEL, prompt=parts, max_tokens=0, n=2,
                                       temperature=0, echo=True, logprobs=0, stream=stream,
                                       **({"stream_options": {"include_usage": True}}
                                          if stream else {}))
            if stream:
                chunks = list(res)
                by = {}
                for ch in chunks:
                    for ch_c in ch.choices:
                        by.setdefault(ch_c.index, []).append(ch_c)
                got = [("".join(x.text for x in by[i]),
                        [t for x in by[i] if x.logprobs for t in x.logprobs.token_logprobs])
                       for i in range(4)]
                usage = chunks[-1].usage
            else:
                got = [(x.text, x.logprobs.token_logprobs) for x in res.choices]
                usage = res.usage
            for (text, tlp), p in zip(got, [parts[0], parts[0], parts[1], parts[1]],
                                      strict=True):
                assert text == s.tok.decode(p) and len(tlp) == len(p) and tlp[0] is None
                full = torch.log_softmax(forward(s.runtime, p), dim=-1)
                torch.testing.assert_close(
                    torch.tensor(tlp[1:], dtype=F64),
                    full[torch.arange(len(p) - 1), torch.tensor(p[1:])], atol=1e-9, rtol=0)
            # (a prompt counts once however many choices it has, as in vLLM)
            assert (usage.prompt_tokens, usage.completion_tokens) == (70 + 5, 0)

        res = c.completions.create(model=MODEL, prompt="hello", max_tokens=0, echo=True)
        assert res.choices[0].text == "hello" and res.choices[0].logprobs is None
        assert res.usage.completion_tokens == 0
        chunks = list(c.completions.create(model=MODEL, prompt="hello", max_tokens=0,
                                           echo=True, stream=True))
        assert "".join(x.text for ch in chunks for x in ch.choices) == "hello"
        s.wait_at_rest()


def test_max_tokens_0_without_echo_or_in_chat_is_vllms_400() -> None:
    with Server(tiny_config()) as s:
        c = s.client()
        for call in (
                lambda: c.completions.create(model=MODEL, prompt="x", max_tokens=0),
                lambda: c.completions.create(model=MODEL, prompt="x", max_tokens=0,
                                             logprobs=1, stream=True),
                lambda: c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=0)):
            with pytest.raises(openai.BadRequestError) as exc:
                call()
            assert exc.value.body["param"] == "max_tokens"
            assert exc.value.body["message"].startswith("max_tokens must be at least 1, got 0.")
        with pytest.raises(openai.BadRequestError) as exc:
            c.completions.create(model=MODEL, prompt="x", max_tokens=-1, echo=True)
        assert exc.value.body["param"] == "max_tokens"
        assert s.wait_at_rest()["in_flight"] == 0


def test_a_burst_of_prompt_only_requests_leaks_nothing() -> None:
    """Many max_tokens-0 echo requests at once (more than lanes and queue hold: some 429),
    streamed and not, with and without logprobs: each one answered returns its prompt alone;
    afterwards the batcher is idle, every block free or the prefix cache's, its invariants
    hold."""
    import asyncio

    with Server(tiny_config(), max_queue=6) as s:
        c = s.aclient()
        texts = [f"score me {i} " * (1 + i % 5) for i in range(24)]

        async def one(i: int) -> str | None:
            kw = {"model": MODEL, "prompt": texts[i], "max_tokens": 0, "echo": True,
                  "temperature": 0.7, "seed": i, **({"logprobs": 1} if i % 2 else {})}
            try:
                if i % 3 == 0:
                    out = await c.completions.create(**kw, stream=True)
                    return "".join([x.text async for ch in out for x in ch.choices])
                res = await c.completions.create(**kw)
                assert res.usage.completion_tokens == 0
                return res.choices[0].text
            except openai.RateLimitError:
                return None

        async def burst() -> list[str | None]:
            return await asyncio.gather(*(one(i) for i in range(len(texts))))

        got = asyncio.run(burst())
        assert sum(x is not None for x in got) >= 8
        assert all(x in (None, t) for x, t in zip(got, texts, strict=True))
        st = s.wait_at_rest()
        assert all(own in ("free", "cache") for own in st["blocks"]), st["blocks"]

        def check(b):
            b.check_invariants()
            return b.stats.generated_tokens

        assert s.engine.call(check) >= sum(x is not None for x in got)
