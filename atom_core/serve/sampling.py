"""Host-side sampling from a request's logits: the batcher's `sampler` hook.

Greedy requests (temperature 0, or below GREEDY_BELOW) with every other parameter at its
neutral value pass no sampler at all, so they take the batcher's own argmax path and equal the
oracle token for token. Any other request owns a `Sampler`, called once per generated token
with its logits [V], which processes them as vLLM's sampler does, in vLLM's order:

1. the log-probabilities a request asked for (`logprobs`) are those of the raw logits, before
   any processing (vLLM's default logprobs mode, "raw_logprobs");
2. `min_tokens`: until that many tokens were generated, the end tokens (EOS unless
   `ignore_eos`, and `stop_token_ids`) get -inf;
3. penalties: `repetition_penalty` r on every token of the prompt or the output (a positive
   logit divided by r, a negative one multiplied by it), then `frequency_penalty` times the
   token's count in the output and `presence_penalty` once for a token in the output, both
   subtracted;
4. greedy: the argmax (ties to the lowest id, as the batcher's); else the temperature, then
   `min_p` (tokens whose probability is below min_p times the largest one's are dropped), then
   `top_k`, then `top_p`, then one multinomial draw from the request's seeded generator (so
   the same seed gives the same tokens whatever else is batched with it: the reference
   runtime's logits do not depend on the batch).
"""

from __future__ import annotations

import secrets

import attrs
import torch

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): the distribution is the
# argmax's anyway, and dividing the logits by a temperature near 0 overflows them to inf, whose
# softmax is NaN (a failed request instead of the most likely token).
GREEDY_BELOW = 1e-5


@attrs.frozen
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): no top-k cut
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    # the ids `min_tokens` holds back (the end tokens and stop_token_ids)
    end_ids: frozenset[int] = frozenset()
    # log-probabilities of each chosen token and of the `logprobs` most likely ones; None: none
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def processes(self) -> bool:
        """Whether anything changes the logits before the choice (else greedy is argmax)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0
                    or (self.min_tokens and self.end_ids))


@attrs.frozen
class TokenLogprobs:
    """One generated token's log-probability and the `logprobs` most likely tokens' (id,
    log-probability), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class Sampler:
    """See the module's docstring. `prompt`: the ids the repetition penalty also counts.
    `records`: each generated token's `TokenLogprobs` when `params.logprobs` is not None (the
    engine thread appends before the token's event is sent, so a reader that has the event has
    its record)."""

    def __init__(self, params: SamplingParams, prompt: list[int] | tuple[int, ...] = ()) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._gen = torch.Generator().manual_seed(seed)
        self._prompt = torch.tensor(sorted(set(prompt)), dtype=torch.long)
        self._counts: dict[int, int] = {}
        self.generated = 0
        self.records: list[TokenLogprobs] = []

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        # float64 of the float32 logits: the same logits give the same probabilities in every
        # process (the logprobs keep a float64 model's own: `log_probs`)
        x = logits.to(torch.float32).to(torch.float64)
        x = self._penalised(x)
        if p.greedy:
            tok = int(x.max(dim=-1)[1])
        else:
            tok = self._draw(x)
        if p.logprobs is not None:
            self._record(logits, tok)
        self._counts[tok] = self._counts.get(tok, 0) + 1
        self.generated += 1
        return tok

    def _penalised(self, x: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p.min_tokens and self.generated < p.min_tokens and p.end_ids:
            ids = torch.tensor([i for i in p.end_ids if i < x.numel()], dtype=torch.long)
            x = x.index_fill(0, ids, float("-inf"))
        if not (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0):
            return x
        out = torch.tensor(list(self._counts), dtype=torch.long)
        counts = torch.tensor(list(self._counts.values()), dtype=torch.float64)
        if p.repetition_penalty != 1.0:
            seen = torch.cat([self._prompt[self._prompt < x.numel()], out]).unique()
            vals = x[seen]
            x = x.index_copy(0, seen, torch.where(vals > 0, vals / p.repetition_penalty,
                                                  vals * p.repetition_penalty))
        if out.numel():
            x = x.index_add(0, out, -(p.frequency_penalty * counts + p.presence_penalty))
        return x

    def _draw(self, x: torch.Tensor) -> int:
        p = self.params
        x = x / p.temperature
        if p.min_p > 0.0:
            probs = torch.softmax(x, dim=-1)
            x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if 0 < p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            # drop a token when the ones before it already reach top_p (the first always stays)
            drop = torch.cumsum(sorted_p, dim=-1) - sorted_p >= p.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=self._gen))

    def _record(self, raw: torch.Tensor, tok: int) -> None:
        lp = log_probs(raw)
        k = min(self.params.logprobs or 0, lp.numel())
        top: tuple[tuple[int, float], ...] = ()
        if k:
            vals, ids = torch.topk(lp, k)  # (as vLLM picks them; O(V), not a sort)
            top = tuple(zip(ids.tolist(), vals.tolist(), strict=True))
        self.records.append(TokenLogprobs(tok, float(lp[tok]), top))


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dimension in float32 (vLLM's), or float64 for a model that
    computes in float64 (a cast to float32 would lose what it computed)."""
    x = logits if logits.dtype == torch.float64 else logits.to(torch.float32)
    return torch.log_softmax(x, dim=-1)


class PromptLogprobs:
    """A request's prompt logprobs (vLLM's `prompt_logprobs`, which echo with logprobs returns):
    the batcher's `prompt_logits` hook, given the logits of each prompt chunk from the prefill
    call that fills its KV. `records[i]`: prompt token i's log-probability given the tokens
    before it and the `k` most likely tokens' there (a `TokenLogprobs`); `records[0]` stays None
    (nothing precedes the first token). Position p's logits are token p + 1's distribution; the
    last prompt position's give the first generated token, the sampler's. Filled on the engine
    thread before the prompt's last chunk reports its token."""

    def __init__(self, prompt: list[int] | tuple[int, ...], k: int) -> None:
        self.prompt = torch.tensor(list(prompt), dtype=torch.long)
        self.k = k
        self.records: list[TokenLogprobs | None] = [None] * len(prompt)

    def __call__(self, start: int, logits: torch.Tensor) -> None:
        # (a request preempted and resumed computes its prompt again, and its generated tokens
        # as prompt: the positions recorded before, and those past the prompt, are kept as
        # they are)
        n = min(int(logits.shape[0]), len(self.records) - 1 - start)
        if n <= 0:
            return
        if start and self.records[start] is None:
            # (the batcher drops the entries such a request would hit: a bug if it gets here)
            raise ValueError(f"prompt positions before {start} were not computed (a prefix "
                             "cache hit): their log-probabilities are unknown")
        if self.records[start + n] is not None:
            return
        lp = log_probs(logits[:n])
        nxt = self.prompt[start + 1:start + 1 + n]
        chosen = lp.gather(1, nxt[:, None])[:, 0].tolist()
        k = min(self.k, lp.shape[-1])
        vals, ids = torch.topk(lp, k, dim=-1)
        for i, (tok, got, top_ids, top_vals) in enumerate(zip(
                nxt.tolist(), chosen, ids.tolist(), vals.tolist(), strict=True)):
            self.records[start + 1 + i] = TokenLogprobs(
                tok, got, tuple(zip(top_ids, top_vals, strict=True)))


def sampler_for(params: SamplingParams, prompt: list[int] | tuple[int, ...] = ()
                ) -> Sampler | None:
    """None for plain greedy (the batcher's argmax), else a fresh seeded Sampler."""
    if params.greedy and not params.processes and params.logprobs is None:
        return None
    return Sampler(params, prompt)
