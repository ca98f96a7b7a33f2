"""The OpenAI front end against what real clients send (the `openai` client, LangChain, LiteLLM,
curl scripts), through the real `openai` client (or raw JSON, for what it cannot send) and a
live server (tests/test_serve.py's `Server`): nulls for parameters the server does not know,
`max_completion_tokens` beside `max_tokens`, content given as a list of parts, and, for what is
not supported, one 400 that names the parameter and says what to do."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_serve import KEY, MODEL, Server, tiny_config  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    with Server(tiny_config()) as s:
        yield s


def post(s: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(s.base + path, json=body, headers=AUTH, timeout=30)


def served_exactly(s: Server, messages: list[dict[str, Any]], prompt: list[int], n: int) -> None:
    """The server's chat reply to `messages` (greedy, `n` tokens) counts `prompt` as its prompt
    and is what the batcher's oracle gives for it."""
    res = s.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=n,
                                             temperature=0,
                                             extra_body={"return_token_ids": True})
    assert res.usage.prompt_tokens == len(prompt)
    assert res.choices[0].token_ids == s.oracle(prompt, n)


def bad_request(call: Any) -> dict[str, Any]:
    """The error body of the 400 `call` raises."""
    with pytest.raises(openai.BadRequestError) as exc:
        call()
    return exc.value.body


# ------------------------------------------------------------------ 1. nulls of unknown parameters
def test_unknown_parameters_sent_as_null_mean_not_given(srv: Server) -> None:
    """Clients send `"tools": null`, `"response_format": null`, ... for "not set" (and a
    message read back from a reply carries `"refusal": null`, `"tool_calls": null`); each was a
    400 ('tools: this parameter is not supported by this server')."""
    c = srv.client()
    want = srv.oracle(srv.tok.chat(HI), 5)
    nulls = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
             "response_format", "logit_bias", "metadata", "store", "service_tier",
             "reasoning_effort", "modalities", "audio", "prediction", "some_extension")
    res = c.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=5,
                                    temperature=0, tools=None, response_format=None,
                                    extra_body={"return_token_ids": True,
                                                **dict.fromkeys(nulls)})
    assert res.choices[0].token_ids == want
    # a reply's message sent back as it came (its nulls included), curl-style
    reply = {"role": "assistant", "content": "x", "refusal": None, "tool_calls": None,
             "function_call": None, "audio": None, "annotations": None}
    r = post(srv, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2, "temperature": 0, "tools": None, "logit_bias": None,
        "messages": [*HI, reply, {"role": "user", "content": "again", "name": None}]})
    assert r.status_code == 200, r.text
    res = c.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0,
                               suffix=None, best_of=None, logit_bias=None,
                               extra_body={"return_token_ids": True, "some_extension": None})
    assert res.choices[0].token_ids == srv.oracle(srv.tok.encode("hello"), 4)


def test_an_unknown_or_unsupported_parameter_with_a_value_is_still_a_400(srv: Server) -> None:
    c = srv.client()
    body = bad_request(lambda: c.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=2, extra_body={"some_extension": 1}))
    assert body["param"] == "some_extension"
    assert body["message"].startswith("some_extension: this parameter is not supported")
    body = bad_request(lambda: c.chat.completions.create(
        model=MODEL, messages=[{**HI[0], "tool_calls": []}], max_tokens=2))
    assert body["param"] == "messages" and "messages.0.tool_calls" in body["message"]


@pytest.mark.parametrize(("endpoint", "param", "value", "says"), [
    ("chat", "tools", [{"type": "function", "function": {"name": "f"}}], "tool and function"),
    ("chat", "tool_choice", "auto", "tool and function calling"),
    ("chat", "response_format", {"type": "json_object"}, '{"type": "text"}'),
    ("chat", "logit_bias", {"5": 10}, "logit bias"),
    ("chat", "prompt", "x", "/v1/completions"),
    ("cmpl", "messages", HI, "/v1/chat/completions"),
    ("cmpl", "suffix", "}", "suffix"),
    ("cmpl", "best_of", 2, "best_of=1"),
])
def test_a_known_unsupported_parameter_says_what_to_do(srv: Server, endpoint: str, param: str,
                                                       value: Any, says: str) -> None:
    """They said only 'this parameter is not supported by this server'."""
    body = {"model": MODEL, "max_tokens": 2, param: value,
            **({"messages": HI} if endpoint == "chat" else {"prompt": "x"})}
    r = post(srv, "/v1/chat/completions" if endpoint == "chat" else "/v1/completions", body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: ")
    assert says in err["message"]
    assert "leave it out" in err["message"] or "send" in err["message"]


def test_values_that_ask_for_nothing_are_served(srv: Server) -> None:
    """`logit_bias: {}`, `response_format: {"type": "text"}` (the API's default) and
    `best_of: 1` ask for nothing this server does not do; they were 400s."""
    c = srv.client()
    res = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0,
                                    logit_bias={}, response_format={"type": "text"},
                                    extra_body={"return_token_ids": True})
    assert res.choices[0].token_ids == srv.oracle(srv.tok.chat(HI), 4)
    res = c.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0,
                               best_of=1, logit_bias={}, extra_body={"return_token_ids": True})
    assert res.choices[0].token_ids == srv.oracle(srv.tok.encode("hello"), 4)


# ------------------------------------------------------------------ 2. max_completion_tokens
def test_max_completion_tokens_is_the_chat_limit_and_a_disagreeing_max_tokens_a_400(
        srv: Server) -> None:
    """Both given and different: the server took max_completion_tokens and dropped max_tokens
    without a word."""
    c = srv.client()
    for stream in (False, True):
        res = c.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=3,
                                        temperature=0, stream=stream,
                                        stream_options={"include_usage": True} if stream
                                        else None)
        usage = list(res)[-1].usage if stream else res.usage
        assert usage.completion_tokens == len(srv.oracle(srv.tok.chat(HI), 3))
    body = bad_request(lambda: c.chat.completions.create(
        model=MODEL, messages=HI, max_completion_tokens=3, max_tokens=5))
    assert body["param"] == "max_completion_tokens"
    assert "max_tokens (5)" in body["message"] and "send one of them" in body["message"]
    # the same value twice is no conflict
    res = c.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=3,
                                    max_tokens=3, temperature=0)
    assert res.usage.completion_tokens == 3


# ------------------------------------------------------------------ 3. content as parts
def test_text_parts_are_joined_with_a_newline_for_a_string_template(srv: Server) -> None:
    """The parts were joined with "": "Describe" and "this" reached the model as
    "Describethis". A template that takes a string gets them joined with a newline."""
    parts = [{"type": "text", "text": "Describe"}, {"type": "text", "text": "this"}]
    res = srv.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=6,
        temperature=0, extra_body={"return_token_ids": True})
    prompt = srv.tok.chat([{"role": "user", "content": "Describe\nthis"}])
    assert res.usage.prompt_tokens == len(prompt)
    assert res.choices[0].token_ids == srv.oracle(prompt, 6)


# a template in the style of multimodal models' (Gemma 3's): a string, or a loop over parts
PARTS_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}[{{ p['text'] }}]{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_a_template_that_takes_parts_is_given_them(tmp_path: Path) -> None:
    """A model's own template decides how its parts are joined (here each in brackets)."""
    pytest.importorskip("transformers")
    from atom_core.serve.tokenizer import HFTokenizer, build_tiny_tokenizer

    plain = HFTokenizer(build_tiny_tokenizer(tmp_path / "plain"))
    assert plain.takes_content_parts is False  # its template prints `m['content']`
    path = build_tiny_tokenizer(tmp_path / "parts")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = PARTS_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    tok = HFTokenizer(path)
    assert tok.takes_content_parts is True
    parts = [{"type": "text", "text": "The quick"}, {"type": "text", "text": "brown fox"}]
    messages = [{"role": "user", "content": parts}]
    prompt = tok.chat(messages)
    assert tok.decode(prompt) == "<|user|>\n[The quick][brown fox]\n<|assistant|>\n"
    with Server(tiny_config(), tokenizer=tok) as s:
        served_exactly(s, messages, prompt, 6)


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
    {"type": "file", "file": {"file_id": "f"}},
])
def test_a_part_that_is_not_text_is_a_clear_400(srv: Server, part: dict[str, Any]) -> None:
    """It said 'messages.0.content: must be one of: str, list[TextPart]'."""
    content = [{"type": "text", "text": "what is this?"}, part]
    body = bad_request(lambda: srv.client().chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": content}]))
    assert body["param"] == "messages"
    assert body["message"].startswith(f"messages.0.content: part 1 is of type '{part['type']}'")
    assert "text only" in body["message"]


def test_null_content_is_a_clear_400(srv: Server) -> None:
    """An assistant message with null content (one that only called tools) said 'must be one
    of: str, list[TextPart]'."""
    body = bad_request(lambda: srv.client().chat.completions.create(
        model=MODEL, max_tokens=2,
        messages=[*HI, {"role": "assistant", "content": None}, *HI]))
    assert body["param"] == "messages"
    assert body["message"].startswith("messages.1.content: null content")
    assert "tool calling" in body["message"]


# ------------------------------------------------------------------ 5. the rest of the surface
def test_echo_returns_the_prompt_and_with_logprobs_the_prompts(srv: Server) -> None:
    """echo: the prompt's text before the reply's (vLLM's); with logprobs, the prompt's tokens
    and logprobs before the reply's, the first prompt token's null (tests/test_serve_vllm_echo.py
    checks their values)."""
    c = srv.client()
    plain = c.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    res = c.completions.create(model=MODEL, prompt="x", max_tokens=2, echo=True, temperature=0)
    assert res.choices[0].text == "x" + plain.choices[0].text
    assert res.usage.completion_tokens == 2
    res = c.completions.create(model=MODEL, prompt="xy", max_tokens=2, echo=True, logprobs=1,
                               temperature=0)
    lp = res.choices[0].logprobs
    assert lp.tokens[:2] == ["x", "y"] and len(lp.tokens) == 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and lp.text_offset[:2] == [0, 1]


def test_stop_strings_across_tokens_finish_reasons_and_usage(srv: Server) -> None:
    """(Sound before this audit; checked here as the openai client sees it.) A two-character
    stop string (two tokens of the byte tokenizer) cuts the text before it, streamed and not,
    with finish_reason "stop"; a reply cut by max_tokens is "length"; usage counts every
    generated token, the stop string's included."""
    c = srv.client()
    prompt = "Where does it stop?"
    want = srv.oracle(srv.tok.encode(prompt), 40)
    full = srv.tok.decode(want)
    i = next(i for i in range(3, len(full) - 1) if full[i:i + 2].isascii()
             and full[i:i + 2].isprintable() and full.find(full[i:i + 2]) == i)
    stop = full[i:i + 2]
    for stop_arg in (stop, [stop, "never in it \x01"]):
        res = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                   stop=stop_arg, extra_body={"return_token_ids": True})
        (choice,) = res.choices
        assert choice.text == full[:i] and choice.finish_reason == "stop"
        assert choice.token_ids == want[:len(choice.token_ids)]
        assert srv.tok.decode(choice.token_ids).endswith(stop)
        assert res.usage.completion_tokens == len(choice.token_ids)
        chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=40,
                                           temperature=0, stop=stop_arg, stream=True,
                                           stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full[:i]
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
        assert chunks[-1].choices == [] and chunks[-1].usage == res.usage
    res = c.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert res.choices[0].finish_reason == srv.reason(want[:5]) == "length"
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(prompt), 5)


@pytest.mark.parametrize(("kwargs", "param", "says"), [
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
    ({"top_logprobs": 2}, "top_logprobs", "only with logprobs=true"),
    ({"prompt": ""}, "prompt", "send at least one token"),  # (it said only 'empty')
])
def test_the_rest_is_served_or_a_clear_400(srv: Server, kwargs: dict[str, Any], param: str,
                                           says: str) -> None:
    """(Sound before this audit, but the empty prompt's message, which did not say what to
    do.) Each is refused naming the parameter and what would do."""
    chat = param in ("top_logprobs",)
    args = {"model": MODEL, "max_tokens": 2, **({"messages": HI} if chat else {"prompt": "hi"}),
            **kwargs}
    create = srv.client().chat.completions.create if chat else \
        srv.client().completions.create
    body = bad_request(lambda: create(**args))
    assert body["param"] == param and says in body["message"]


def test_seed_user_top_p_and_a_whitespace_prompt_are_served(srv: Server) -> None:
    """(Sound before this audit.) A seed repeats; `user` is taken (an end-user id); top_p
    samples; a prompt of spaces is a prompt."""
    c = srv.client()
    args = {"model": MODEL, "prompt": "  ", "max_tokens": 6, "temperature": 1.0, "top_p": 0.9,
            "seed": 7, "user": "someone", "extra_body": {"return_token_ids": True}}
    a, b = (c.completions.create(**args).choices[0].token_ids for _ in range(2))
    assert a == b and len(a) >= 1
