"""What a choice returns besides its text: log-probabilities in the two OpenAI shapes, as vLLM
fills them (its order and its floor), from the sampler's records (`sampling.TokenLogprobs`).

vLLM's per-token dict holds the chosen token first, then the most likely ones (the chosen one
not again); completions return its first `logprobs` + 1 entries, chat its first
`top_logprobs`. A log-probability is floored at -9999.0 (JSON has no -inf). A token's text is
its own decode."""

from __future__ import annotations

from typing import Any

from atom_core.serve.sampling import TokenLogprobs
from atom_core.serve.tokenizer import Tokenizer

FLOOR = -9999.0


def _ranked(rec: TokenLogprobs) -> list[tuple[int, float]]:
    """The chosen token, then the most likely others."""
    return [(rec.token, rec.logprob), *((i, lp) for i, lp in rec.top if i != rec.token)]


class CompletionLogprobs:
    """A completion choice's `logprobs` object, grown token by token (a stream sends each
    chunk's part: `part`)."""

    def __init__(self, tokenizer: Tokenizer, k: int, offset: int = 0) -> None:
        self.tok, self.k, self.offset = tokenizer, k, offset

    def part(self, records: list[TokenLogprobs]) -> dict[str, Any]:
        return self._entries(zip([rec.token for rec in records], records, strict=True))

    def echo(self, prompt: list[int], records: list[TokenLogprobs | None]) -> dict[str, Any]:
        """The prompt's part (echo with logprobs): each prompt token with its prompt logprobs
        (`sampling.PromptLogprobs`); the first token, which nothing precedes, has null ones,
        as vLLM's."""
        return self._entries(zip(prompt, records, strict=True))

    def _entries(self, pairs: Any) -> dict[str, Any]:
        out: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                                     "top_logprobs": []}
        for token, rec in pairs:
            text = self.tok.decode([token])
            out["tokens"].append(text)
            out["token_logprobs"].append(None if rec is None else max(rec.logprob, FLOOR))
            # (tokens of one text, as bytes of unfinished characters all are, keep the last
            # one's, as vLLM's dict does)
            out["top_logprobs"].append(None if rec is None else {
                self.tok.decode([i]): max(lp, FLOOR) for i, lp in _ranked(rec)[:self.k + 1]})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


class EchoLogprobs:
    """Echo with logprobs: each choice's logprobs begin with its prompt's part (`echo`, its
    text_offset from 0; the reply's go on from the prompt's end), and its text with the prompt's.
    Streamed, both come with the choice's first token, as vLLM's first chunk: the prompt's
    logprobs are known once its prefill ended. (vLLM's later chunks start their text_offset at
    the reply's length, leaving the echoed prompt out; here they go on from where the first
    chunk ended, so a stream's offsets are those of the response unstreamed.)"""

    def __init__(self, offsets: list[CompletionLogprobs], prompts: list[list[int]],
                 records: list[list[TokenLogprobs | None]], texts: list[str]) -> None:
        self.offsets, self.prompts, self.records, self.texts = offsets, prompts, records, texts
        self._owed = set(range(len(offsets)))  # choices whose prompt part is not out yet
        self._unsent = set(range(len(offsets)))  # ... whose prompt text is not

    def logprobs(self, i: int, records: list[TokenLogprobs]) -> dict[str, Any] | None:
        """Choice i's logprobs of `records`, its prompt's first."""
        if i not in self._owed:
            return self.offsets[i].part(records)
        self._owed.discard(i)
        return merge([self.offsets[i].echo(self.prompts[i], self.records[i]),
                      self.offsets[i].part(records)])

    def text(self, i: int, text: str) -> str:
        """Choice i's text, its prompt's first (a stream's first chunk of the choice)."""
        if i not in self._unsent:
            return text
        self._unsent.discard(i)
        return self.texts[i] + text


def chat_logprobs(tokenizer: Tokenizer, records: list[TokenLogprobs],
                  k: int) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs`: {"content": [...]}."""

    def entry(i: int, lp: float) -> dict[str, Any]:
        text = tokenizer.decode([i])
        return {"token": text, "logprob": max(lp, FLOOR),
                "bytes": list(text.encode("utf-8", errors="replace"))}

    return {"content": [{**entry(rec.token, rec.logprob),
                         "top_logprobs": [entry(i, lp) for i, lp in _ranked(rec)[:k]]}
                        for rec in records]}


def merge(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Parts of one choice's logprobs (either shape) as one."""
    if not parts:
        return None
    out: dict[str, list[Any]] = {key: [] for key in parts[0]}
    for p in parts:
        for key, vals in p.items():
            out[key].extend(vals)
    return out
