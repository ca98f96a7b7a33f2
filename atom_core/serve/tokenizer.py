"""Text <-> token ids for the server.

`HFTokenizer`: a model directory's own tokenizer through transformers' AutoTokenizer (its chat
template too), loaded offline: nothing is fetched. `ByteTokenizer`: UTF-8 bytes as token ids
(256 of them plus an end token), for the built-in tiny reference model, which has no tokenizer
of its own. `IncrementalText` turns a growing list of ids into text deltas for streaming.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

# a plain chat layout for tokenizers without a template of their own
_PLAIN_ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatTemplateError(ValueError):
    """The model's chat template refused the conversation (e.g. Gemma's 'roles must alternate'
    via raise_exception): the client's request is at fault, so a 400, not a 500."""


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None
    # more ids that end a reply as the end token does (a model's generation_config.json may
    # list several: Llama 3's <|eot_id|> and <|end_of_text|>, Qwen's <|im_end|> and
    # <|endoftext|>); the batcher knows one end token, the server stops at these
    end_token_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    # a message's content is a string; it is a list of {"type": "text", "text": ...} parts only
    # for a tokenizer whose `takes_content_parts` is true (HFTokenizer's, for some templates);
    # a message may carry a "name" (its author's, a string) for templates that render one
    def chat(self, messages: list[dict[str, Any]]) -> list[int]: ...


def end_ids(tok: Tokenizer) -> list[int]:
    """Every id that ends a reply: the end token, then the model's others (a tokenizer of the
    protocol before `end_token_ids` has none)."""
    ends = [tok.eos_token_id, *sorted(getattr(tok, "end_token_ids", ()) or ())]
    return [i for i in ends if i is not None]


def plain_chat(messages: list[dict[str, str]]) -> str:
    """'<|role|>\\ncontent\\n' per message, then '<|assistant|>\\n' for the reply."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def generation_end_ids(model_dir: Path) -> list[int]:
    """The end ids generate() stops at for a model directory: its generation_config.json's
    `eos_token_id` (one id or a list); without that file, config.json's (its text config's,
    for a multimodal model), as transformers derives a generation config from the model
    config; [] without either."""
    try:
        cfg = json.loads((model_dir / "generation_config.json").read_text())
    except FileNotFoundError:
        try:
            cfg = json.loads((model_dir / "config.json").read_text())
        except FileNotFoundError:
            return []
        if isinstance(cfg, dict) and cfg.get("eos_token_id") is None:
            cfg = cfg.get("text_config")
    return id_list(cfg.get("eos_token_id") if isinstance(cfg, dict) else None)


def id_list(ids: Any) -> list[int]:
    """An `eos_token_id` as transformers' configs give it (None, one id, or a list) as a
    list of ids."""
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]


class ByteTokenizer:
    """Token id b < 256 is the byte b; 256 is the end token (never produced by `encode`)."""

    vocab_size = 257
    eos_token_id = 256
    end_token_ids: frozenset[int] = frozenset()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_plain(self, text: str) -> list[int]:
        return self.encode(text)  # (no special tokens to leave out)

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
        ends = generation_end_ids(Path(path))
        self.eos_token_id = self._tok.eos_token_id
        if self.eos_token_id is None and ends:
            self.eos_token_id = ends[0]
        self.end_token_ids = frozenset(ends) - {self.eos_token_id}

    def set_chat_template(self, template: str) -> None:
        """Use `template` (Jinja text, as --chat-template gives it) instead of the tokenizer's
        own chat template."""
        self._tok.chat_template = template
        self.__dict__.pop("takes_content_parts", None)  # (cached for the template before)

    @functools.cached_property
    def takes_content_parts(self) -> bool:
        """Whether the chat template renders a message's content given as a list of text
        parts ({"type": "text", "text": ...}) itself, as multimodal models' templates do
        (Gemma 3's, Llama 4's, Qwen2-VL's), rather than only a string (a list it would print as
        Python's repr of it, or fail on). Tried once, on one user message."""
        if not getattr(self._tok, "chat_template", None):
            return False
        probe = "atom-core content part probe"
        try:
            out = self._tok.apply_chat_template(
                [{"role": "user", "content": [{"type": "text", "text": probe}]}],
                add_generation_prompt=True, tokenize=False)
        except Exception:  # noqa: BLE001 - whatever a template raises, it takes no parts
            return False
        return isinstance(out, str) and probe in out and "'type'" not in out \
            and '"type"' not in out

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def encode_plain(self, text: str) -> list[int]:
        """`text`'s ids without the special tokens `encode` adds (BOS)."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True,
                                clean_up_tokenization_spaces=False)

    def keeping_special(self) -> Tokenizer:
        """This tokenizer, decoding special tokens as their text (skip_special_tokens=false)."""
        return _KeepSpecial(self)


    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if getattr(self._tok, "chat_template", None):
            from jinja2 import TemplateError

            try:
                out = self._tok.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=True)
            except (TemplateError, TypeError, ValueError) as exc:
                raise ChatTemplateError(f"the model's chat template refused these messages: "
                                        f"{exc}") from exc
            if isinstance(out, dict) or hasattr(out, "keys"):  # a BatchEncoding
                out = out["input_ids"]
            return [int(t) for t in out]
        return list(self._tok.encode(plain_chat(messages), add_special_tokens=True))


class _KeepSpecial:
    """An HFTokenizer whose `decode` keeps special tokens' text."""

    def __init__(self, inner: HFTokenizer) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def decode(self, ids: Sequence[int]) -> str:
        return self._inner._tok.decode(list(ids), skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False)


class IncrementalText:
    """Text deltas of a growing token list, cut at the first stop string.

    Each delta is a prefix-extension of the final text: trailing replacement characters (an
    incomplete UTF-8 sequence that later tokens may complete) and the last len(stop) - 1
    characters (a stop string may still be forming) are held back until `finish`.

    A token costs O(1), not O(tokens so far): each step decodes a window, the tokens not yet
    in the text and, as context, at least CONTEXT tokens before them, and the text they add is
    what the window decodes to beyond what its context alone does. (Context, because a decoder
    may spell a token differently by what precedes it: SentencePiece's strips the space a text
    begins with, others clean up spaces around punctuation; the context and the window start
    alike, so such a difference cancels out. The context starts where the text was cut before,
    so at a character's start: a byte-fallback decoder turns a whole run of byte tokens into
    U+FFFD when the run starts inside a character.) Decoding the whole list at every token made a
    4,096-token stream take 2.4 s of the event loop's time for the tiny tokenizer, growing with
    the square of its length.
    """

    # The fewest tokens of context a window decodes before the new ones.
    CONTEXT = 4
    # The most tokens that wait for a character's last byte (a UTF-8 character is at most 4
    # bytes): more never make one, and waiting on would make each step's window grow.
    PENDING = 8

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (),
                 prompt: Sequence[int] = (), *, include_stop: bool = False,
                 min_tokens: int = 0) -> None:
        """`prompt`: the ids the text continues, whose last few are the first tokens' context:
        a decoder that strips the space a text begins with (SentencePiece's) then keeps the
        space of a reply that continues the prompt with a new word ("Hello," -> " world").
        `include_stop`: the text keeps the stop string it ends at (vLLM's
        include_stop_str_in_output); `min_tokens`: no stop string ends it before that many
        tokens (as vLLM checks them only from then on)."""
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.include_stop, self.min_tokens, self.added = include_stop, min_tokens, 0
        self._base = self._context(prompt)
        self.ids: list[int] = list(prompt[len(prompt) - self._base:]) if self._base else []
        self.sent = 0  # characters already handed out
        self.text = ""
        self.stopped = False
        self._hold = max((len(s) - 1 for s in self.stop), default=0)
        self._done = self._base  # ids[:_done] are in `text`; later ones wait for more bytes
        # where the text was cut (whole characters before each), the oldest the latest one at
        # least CONTEXT tokens before `_done`: the window's context starts there
        self._cuts = [0]

    def _context(self, prompt: Sequence[int]) -> int:
        """How many of the prompt's last ids to keep as context: CONTEXT, fewer if those start
        inside a character (a byte-fallback decoder would spell the run they start as U+FFFD,
        the reply's first characters with it), more (up to a character's other three bytes)
        if no fewer make text of whole characters (a prompt ending in a 4-byte character's
        bytes and a lone "▁", which a Metaspace decoder spells as nothing: without context the
        reply's own leading space was stripped), none if the prompt ends inside one."""
        n = len(prompt)
        for k in [*range(min(self.CONTEXT, n), 0, -1), *range(self.CONTEXT + 1,
                                                               min(self.CONTEXT + 3, n) + 1)]:
            text = self.tok.decode(list(prompt[len(prompt) - k:]))
            if text.endswith("\ufffd"):
                return 0
            if text and not text.startswith("\ufffd"):
                return k
        return 0

    @property
    def last(self) -> int | None:
        """The last token added (None before the first)."""
        return self.ids[-1] if len(self.ids) > self._base else None

    def add(self, token: int) -> str:
        self.ids.append(token)
        self.added += 1
        searched = len(self.text)
        self._extend(final=False)
        if self.stop and len(self.text) > searched and self.added >= self.min_tokens:
            # a stop string in the text ends in the part just added (an earlier one would
            # have stopped an earlier call), so the search starts len(stop) - 1 before it
            at = max(0, searched - self._hold)
            hits = [(i, i + len(s) * self.include_stop)
                    for i, s in ((self.text.find(s, at), s) for s in self.stop) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)[1]], True
                return self._take(len(self.text))
        return self._take(len(self.text) - self._hold)

    def finish(self) -> str:
        self._extend(final=True)
        return self._take(len(self.text))

    def _extend(self, final: bool) -> None:
        """Add the text of the tokens past `_done` when they make whole characters (a decoder
        gives U+FFFD for each byte of an unfinished one, as many as its bytes so far with a
        byte-fallback tokenizer, Llama's or Gemma's), or whatever they make at the end."""
        if self._done == len(self.ids) or self.stopped:
            return
        end = len(self.ids)
        if not final and end - self._done > self.PENDING:
            # that many tokens never make a character: take all but the last three, which
            # may still start one (three bytes of a four-byte character at most)
            self._take_tokens(end - 3, force=True)
        self._take_tokens(end, force=final)

    def _take_tokens(self, end: int, force: bool) -> None:
        """Add the text ids[_done:end] make, if they end on a whole character or `force`."""
        lo = self._cuts[0]
        before = self.tok.decode(self.ids[lo:self._done]) if lo < self._done else ""
        now = self.tok.decode(self.ids[lo:end])
        if not force and now.endswith("\ufffd"):
            return  # (a byte-fallback decoder may spell the context as U+FFFD meanwhile too)
        if not now.startswith(before):
            # the new tokens respelled their context (bytes that never make a character, in
            # a byte-fallback decoder): the whole list, as a last resort, past the text so far
            now, before = self.tok.decode(self.ids[self._base:end]), self.text
        self.text += now[len(before):]
        self._done = end
        self._cuts.append(end)
        while len(self._cuts) > 1 and end - self._cuts[1] >= self.CONTEXT:
            del self._cuts[0]

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
