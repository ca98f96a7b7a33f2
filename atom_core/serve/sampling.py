"""Host-side sampling from a request's logits: the batcher's `sampler` hook.

Greedy requests (temperature 0, or below GREEDY_BELOW) pass no sampler at all, so they take the
batcher's own argmax path and equal the oracle token for token. A sampled request owns a seeded
torch.Generator and draws exactly once per generated token, so the same seed gives the same
tokens whatever else is batched with it (the reference runtime's logits do not depend on the
batch).
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

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class Sampler:
    """Temperature, then top-k, then top-p (nucleus), then one multinomial draw."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._gen = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        # float64: the same logits give the same probabilities in every process
        x = logits.to(torch.float64) / p.temperature
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


def sampler_for(params: SamplingParams) -> Sampler | None:
    """None for greedy (the batcher's argmax), else a fresh seeded Sampler."""
    return None if params.greedy else Sampler(params)
