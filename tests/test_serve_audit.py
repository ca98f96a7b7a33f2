"""The OpenAI front end against bugs public serving engines have had, each through the real
`openai` client and a live server (tests/test_serve.py's `Server`): byte-fallback tokenizers'
unfinished characters in a stream, a chat template that refuses a conversation, a model's
several end tokens, and a client that leaves a non-streamed request."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")

from test_serve import KEY, MODEL, Server, tiny_config  # noqa: E402

from atom_core.demo import oracle_for  # noqa: E402
from atom_core.runtime.reference import TorchReferenceRuntime  # noqa: E402
from atom_core.serve.tokenizer import ByteTokenizer, HFTokenizer, build_tiny_tokenizer  # noqa: E402


def byte_fallback_tokenizer(path: Path) -> HFTokenizer:
    """A Llama-like tokenizer: printable ASCII characters are tokens of their own, every other
    byte is a <0xNN> byte-fallback token, and a token's id is its byte (so the tiny model's
    output is the same as with the byte tokenizer). Its decoder gives one U+FFFD per byte of an
    unfinished character, as Llama's and Gemma's do."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {(chr(b) if 0x20 < b < 0x7F else f"<0x{b:02X}>"): b for b in range(256)}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    raw.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(str(path))
    return HFTokenizer(path)


def test_byte_fallback_characters_are_never_lost_in_a_stream(tmp_path: Path) -> None:
    """"\\xec" decodes to one U+FFFD, "\\xec\\xb7" to two, "\\xec\\xb7\\x82" to the one
    character: streaming must hold the whole trailing run back, not only its last U+FFFD (that
    sent a U+FFFD and lost the character, in the stream and the non-streamed text alike)."""
    tok = byte_fallback_tokenizer(tmp_path / "model")
    prompt = "prompt 143"  # (its greedy reply has a 3-byte character, found by search)
    assert tok.encode(prompt) == list(prompt.encode())
    decoded = [tok.decode(list(b"\xec\xb7\x82")[:k]) for k in (1, 2, 3)]
    assert decoded == ["\ufffd", "\ufffd\ufffd", "\ucdc2"]  # the decoder the bug needs
    with Server(tiny_config(), tokenizer=tok) as s:
        c = s.client()
        args = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0,
                "extra_body": {"return_token_ids": True}}
        res = c.completions.create(**args)
        ids = res.choices[0].token_ids
        assert ids == s.oracle(tok.encode(prompt), 20)
        want = tok.decode(ids)
        assert "\ucdc2" in want  # the reply does have the 3-byte character
        assert res.choices[0].text == want
        chunks = list(c.completions.create(stream=True, **args))
        assert "".join(ch.choices[0].text for ch in chunks) == want
        assert [t for ch in chunks for t in ch.choices[0].token_ids] == ids


def test_chat_template_that_refuses_the_messages_is_a_400(tmp_path: Path) -> None:
    """A template's raise_exception (Gemma: no system role; many: roles must alternate) is the
    client's fault: a 400 naming `messages` with the template's reason, not a bare 500; the
    server goes on serving."""
    from transformers import AutoTokenizer

    path = build_tiny_tokenizer(tmp_path / "model")
    raw = AutoTokenizer.from_pretrained(str(path))
    raw.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    raw.save_pretrained(str(path))
    with Server(tiny_config(), tokenizer=HFTokenizer(path)) as s:
        c = s.client()
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(model=MODEL, max_tokens=3, messages=[
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
        assert exc.value.body["param"] == "messages"
        assert "System role not supported" in exc.value.body["message"]
        res = c.chat.completions.create(model=MODEL, max_tokens=3, temperature=0,
                                        messages=[{"role": "user", "content": "Hi"}])
        assert res.choices[0].finish_reason is not None
        assert s.wait_at_rest()["in_flight"] == 0


def test_every_end_token_of_generation_config_ends_the_reply(tmp_path: Path) -> None:
    """A model directory's generation_config.json may name several end tokens (Llama 3, Qwen):
    each ends the reply with finish_reason "stop" and its text is not sent, streamed or not."""
    path = build_tiny_tokenizer(tmp_path / "model")
    cfg = tiny_config()
    runtime = TorchReferenceRuntime.tiny(cfg, seed=0, vocab_size=320)  # the server's model
    plain = HFTokenizer(path)
    prompt = plain.encode("The quick brown fox")
    full = oracle_for(runtime).generate(prompt, 12, plain.eos_token_id)
    end = full[4]  # an ordinary token of the reply, declared an end token below
    k = full.index(end)
    assert end != plain.eos_token_id and len(full) == 12
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [plain.eos_token_id, end]}))
    tok = HFTokenizer(path)
    assert (tok.eos_token_id, tok.end_token_ids) == (plain.eos_token_id, {end})
    with Server(cfg, tokenizer=tok) as s:
        c = s.client()
        args = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "extra_body": {"return_token_ids": True}}
        res = c.completions.create(**args)
        assert res.choices[0].finish_reason == "stop"
        assert res.choices[0].token_ids == full[:k + 1]
        assert res.choices[0].text == tok.decode(full[:k])
        assert res.usage.completion_tokens == k + 1
        chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True},
                                           **args))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == \
            tok.decode(full[:k])
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens == k + 1
        s.wait_at_rest()  # the request was ended in the batcher too


def test_client_leaving_a_non_streamed_request_aborts_it_and_others_go_on() -> None:
    """A client that gives up on a non-streamed request: the server notices, aborts it in the
    batcher (every block back at rest) while a concurrent stream finishes exactly."""
    with Server(tiny_config(), delay=0.01) as s:
        want = s.oracle(s.tok.encode("keep going"), 40)
        got: list[int] = []

        def other() -> None:
            stream = s.client().completions.create(
                model=MODEL, prompt="keep going", max_tokens=40, temperature=0, stream=True,
                extra_body={"return_token_ids": True})
            got.extend(t for ch in stream for t in ch.choices[0].token_ids)

        thread = threading.Thread(target=other)
        thread.start()
        # (its greedy reply has no end token: unless aborted it runs 230 tokens, over 2 s)
        assert len(s.oracle(s.tok.encode("never stop talking"), 230)) == 230
        body = {"model": MODEL, "prompt": "never stop talking", "max_tokens": 230,
                "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.base + "/v1/completions", json=body, timeout=0.5,
                       headers={"Authorization": f"Bearer {KEY}"})
        thread.join(20)
        st = s.wait_at_rest(timeout=5)
        assert all(own in ("free", "cache") for own in st["blocks"])
        assert got == want

        def left(b):
            req = next(r for r in b.requests.values() if r.max_new_tokens == 230)
            return req.error, len(req.tokens)

        error, n = s.engine.call(left)
        assert error == "aborted" and n < 230, (error, n)


class BrokenTokenizer(ByteTokenizer):
    """Encodes one prompt wrongly: a bug of the server's side, not the client's."""

    def encode(self, text: str) -> list[int]:
        if text == "break":
            raise RuntimeError("tokenizer bug")
        return super().encode(text)


def test_an_unexpected_error_is_a_500_in_the_api_shape_and_the_server_goes_on() -> None:
    with Server(tiny_config(), tokenizer=BrokenTokenizer()) as s:
        c = s.client()
        with pytest.raises(openai.InternalServerError) as err:
            c.completions.create(model=MODEL, prompt="break", max_tokens=3)
        body = err.value.response.json()
        assert body["error"]["type"] == "server_error"
        assert "RuntimeError: tokenizer bug" in body["error"]["message"]
        ok = c.completions.create(model=MODEL, prompt="fine", max_tokens=3, temperature=0)
        assert ok.choices[0].finish_reason in ("stop", "length")
        assert s.engine.call(lambda b: not any(b.state.busy))
