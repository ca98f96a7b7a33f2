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
        out: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                                     "top_logprobs": []}
        for rec in records:
            text = self.tok.decode([rec.token])
            out["tokens"].append(text)
            out["token_logprobs"].append(max(rec.logprob, FLOOR))
            # (tokens of one text, as bytes of unfinished characters all are, keep the last
            # one's, as vLLM's dict does)
            out["top_logprobs"].append({self.tok.decode([i]): max(lp, FLOOR)
                                        for i, lp in _ranked(rec)[:self.k + 1]})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


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
