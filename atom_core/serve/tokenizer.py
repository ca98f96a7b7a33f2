"""Text <-> token ids for the server.

`HFTokenizer`: a model directory's own tokenizer through transformers' AutoTokenizer (its chat
template too), loaded offline: nothing is fetched. `ByteTokenizer`: UTF-8 bytes as token ids
(256 of them plus an end token), for the built-in tiny reference model, which has no tokenizer
of its own. `IncrementalText` turns a growing list of ids into text deltas for streaming.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

# a plain chat layout for tokenizers without a template of their own
_PLAIN_ROLES = ("system", "user", "assistant", "tool", "developer")


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def chat(self, messages: list[dict[str, str]]) -> list[int]: ...


def plain_chat(messages: list[dict[str, str]]) -> str:
    """'<|role|>\\ncontent\\n' per message, then '<|assistant|>\\n' for the reply."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


class ByteTokenizer:
    """Token id b < 256 is the byte b; 256 is the end token (never produced by `encode`)."""

    vocab_size = 257
    eos_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        try:  # (bytes() of the list in C; a stream decodes its ids again at every token)
            raw = bytes(ids)
        except ValueError:  # the end token (or an id out of range) is no byte
            raw = bytes(i for i in ids if 0 <= i < 256)
        return raw.decode("utf-8", errors="replace")

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(plain_chat(messages))


class HFTokenizer:
    """A transformers tokenizer loaded from a local directory (offline)."""

    def __init__(self, path: str | Path) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: never the network
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError("a model directory's tokenizer needs transformers: "
                              "pip install 'atom-core[serve]'") from None
        self._tok: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.vocab_size = len(self._tok)
        self.eos_token_id = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True,
                                clean_up_tokenization_spaces=False)

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        if getattr(self._tok, "chat_template", None):
            out = self._tok.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True)
            if isinstance(out, dict) or hasattr(out, "keys"):  # a BatchEncoding
                out = out["input_ids"]
            return [int(t) for t in out]
        return list(self._tok.encode(plain_chat(messages), add_special_tokens=True))


class IncrementalText:
    """Text deltas of a growing token list, cut at the first stop string.

    Each delta is a prefix-extension of the final text: a trailing replacement character (an
    incomplete UTF-8 sequence that later tokens may complete) and the last len(stop) - 1
    characters (a stop string may still be forming) are held back until `finish`.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0  # characters already handed out
        self.text = ""
        self.stopped = False
        self._hold = max((len(s) - 1 for s in self.stop), default=0)

    def add(self, token: int) -> str:
        self.ids.append(token)
        self.text = self.tok.decode(self.ids)
        if self.stop:
            hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True
                return self._take(len(self.text))
        safe = len(self.text) - self._hold
        if self.text.endswith("\ufffd"):
            safe = min(safe, len(self.text) - 1)
        return self._take(safe)

    def finish(self) -> str:
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:upto], upto
        return out


def build_tiny_tokenizer(path: str | Path, vocab_size: int = 320) -> Path:
    """Train a small byte-level BPE tokenizer (the `tokenizers` library) on a fixed English text
    and save it with transformers' `save_pretrained` (tokenizer.json, its config and a chat
    template) into `path`: a model directory whose text path is the real one, built offline."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "A formally verified scheduler serves many requests at once.",
        "Hello, world! How are you today? I am fine, thank you.",
        "Blocks of the key value cache move between lanes and the prefix cache.",
    ] * 20
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    raw.train_from_iterator(corpus, trainer=trainer)
    template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|end|>",
                                  chat_template=template)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return out
