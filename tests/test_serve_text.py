"""`IncrementalText` (the server's streamed text) against the plain definition it replaces:
decode every token list from scratch, cut at the first stop string, hold back what may still
change. Same text, same stop, for three kinds of tokenizer (bytes, byte-level BPE, SentencePiece
-like byte fallback) and token lists that split characters, hold invalid bytes and end tokens;
and a stream's decoding work grows linearly with its length, not with its square."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from atom_core.serve.tokenizer import ByteTokenizer, IncrementalText, Tokenizer

FFFD = "\ufffd"


class Reference:
    """The definition: the whole list decoded at every token."""

    def __init__(self, tok: Tokenizer, stop: Sequence[str]) -> None:
        self.tok, self.stop, self.ids, self.text, self.stopped = tok, list(stop), [], "", False

    def add(self, token: int) -> None:
        self.ids.append(token)
        self.text = self.tok.decode(self.ids)
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True


class Counting:
    """A tokenizer that counts the ids it is asked to decode."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.decoded = inner, 0
        self.vocab_size, self.eos_token_id = inner.vocab_size, inner.eos_token_id

    def decode(self, ids: Sequence[int]) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out: dict[str, Any] = {"bytes": ByteTokenizer()}
    try:  # (transformers and tokenizers are the serve extra's)
        from test_serve_audit import byte_fallback_tokenizer

        from atom_core.serve.tokenizer import HFTokenizer, build_tiny_tokenizer
    except (ImportError, pytest.skip.Exception):
        return out
    base = tmp_path_factory.mktemp("tok")
    out["bpe"] = HFTokenizer(build_tiny_tokenizer(base / "bpe"))
    out["fallback"] = byte_fallback_tokenizer(base / "fallback")
    out["metaspace"] = HFTokenizer(metaspace_tokenizer(base / "metaspace"))
    return out


def metaspace_tokenizer(path: Any) -> Any:
    """A SentencePiece-like tokenizer (Llama 2's, Gemma's, Mistral's kind): words carry their
    leading space as "▁", characters outside the vocabulary are byte tokens, and the decoder
    strips the space the first token of a text begins with (so a lone space token decodes to
    nothing at the start of a text)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ["▁", "a", "b", ",", ".", "é", "▁a", "▁b", "ab", "▁ab", "▁é"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b"), ("▁", "é")]
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(str(path))
    return path


def stream(tok: Tokenizer, ids: list[int], stop: list[str]) -> tuple[str, int | None]:
    """What a stream of `ids` sends (every delta, then `finish` unless a stop string ended it)
    and the index of the token that ended it (None: none did)."""
    text = IncrementalText(tok, stop)
    out = []
    for i, t in enumerate(ids):
        out.append(text.add(t))
        if text.stopped:
            return "".join(out), i
    return "".join(out) + text.finish(), None


def expected(tok: Tokenizer, ids: list[int], stop: list[str]) -> tuple[str, int | None]:
    ref = Reference(tok, stop)
    for i, t in enumerate(ids):
        ref.add(t)
        if ref.stopped:
            return ref.text, i
    return ref.text, None


# Replies as text: ASCII words and characters of two, three and four UTF-8 bytes (a byte-fallback
# tokenizer spells each of their bytes as a token of its own, a byte-level BPE splits them).
TEXT = st.text(st.sampled_from(list("ab ,.") + ["é", "€", "😀"]), max_size=40)
# (no stop string holds U+FFFD: the definition would match an unfinished character)
STOPS = st.lists(st.sampled_from(["a", "b ", "ab", "é", "€a", ". a", "😀"]), max_size=3)


@pytest.mark.parametrize("name", ["bytes", "bpe", "fallback", "metaspace"])
@given(text=TEXT, stop=STOPS, cut=st.integers(0, 3))
def test_stream_is_the_whole_decode_cut_at_the_first_stop(
        tokenizers: dict[str, Any], name: str, text: str, stop: list[str], cut: int) -> None:
    """A reply's tokens, whole or cut short by a few (maybe inside a character), with stop
    strings: what the stream sends is what decoding every prefix from scratch gives."""
    if name not in tokenizers:
        pytest.skip(f"{name}: transformers not installed")
    tok = tokenizers[name]
    whole = [t for t in tok.encode(text) if t != tok.eos_token_id]
    ids = whole[:max(0, len(whole) - cut)]
    got = stream(tok, ids, stop)
    if cut and got[1] is None and got[0] != tok.decode(ids):
        # ended inside a character: a byte-fallback decoder spells the unfinished bytes'
        # whole run (the characters before them included) as U+FFFD; the stream had sent
        # those characters already, and sends the unfinished ones as U+FFFD
        assert name in ("fallback", "metaspace") and tok.decode(ids).endswith(FFFD), \
            (got, tok.decode(ids))
        assert tok.decode(whole).startswith(got[0].rstrip(FFFD))
        return
    assert got == expected(tok, ids, stop)


@given(ids=st.lists(st.integers(0, 255), max_size=60))
def test_any_bytes_stream_as_they_decode(ids: list[int]) -> None:
    """Bytes that are not UTF-8 (stray continuation bytes, truncated characters) stream as
    Python decodes the whole reply, U+FFFD and all."""
    tok = ByteTokenizer()
    assert stream(tok, ids, [])[0] == tok.decode(ids)


@pytest.mark.parametrize("name", ["bytes", "bpe", "fallback", "metaspace"])
def test_a_stream_decodes_each_token_a_bounded_number_of_times(tokenizers: dict[str, Any],
                                                               name: str) -> None:
    if name not in tokenizers:
        pytest.skip(f"{name}: transformers not installed")
    inner = tokenizers[name]
    text = "The quick brown fox jumps, é and € and 😀. " * 40
    ids = [t for t in inner.encode(text) if t != inner.eos_token_id]
    assert len(ids) > 1000
    tok = Counting(inner)
    got, _ = stream(tok, ids, ["never there"])
    assert got == inner.decode(ids)
    # two windows of at most 2 (PENDING + 1) tokens per token: linear, where decoding
    # the whole list at every token is quadratic (len(ids) ** 2 / 2 ids, > 500,000 here)
    assert tok.decoded <= 4 * (IncrementalText.PENDING + 1) * len(ids)


def test_unfinished_characters_wait_and_invalid_bytes_do_not_stall_the_stream() -> None:
    tok = ByteTokenizer()
    text = IncrementalText(tok)
    assert [text.add(b) for b in "€".encode()] == ["", "", "€"]  # held until its last byte
    # bytes that never make a character: once more than PENDING wait, all but the last three
    # (which might still start one) are sent, not held forever
    sent = "".join(text.add(0xFF) for _ in range(IncrementalText.PENDING + 1))
    assert sent == FFFD * (IncrementalText.PENDING + 1 - 3)
    assert text.add(ord("a")) == FFFD * 3 + "a"
    assert text.finish() == ""
