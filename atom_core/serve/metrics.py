"""Prometheus metrics of one server (its own registry, so several servers in one process, as in
the tests, never share counters): atom-core's own (`atom_*`: lanes, blocks by owner, the host
tier, preemptions) and, beside them, the `vllm:` metrics a vLLM Grafana dashboard reads, with
vLLM's names, types, label sets (`model_name`, `engine`) and histogram buckets (vLLM 0.32's
v1/metrics), so such a dashboard works on atom-core unchanged."""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Iterator
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from atom_core._generated import core

OUTCOMES = ("stop", "length", "aborted", "error", "timeout", "rejected", "invalid")
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# vLLM's buckets (vllm/v1/metrics/buckets.py) for its histograms of the same name
VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
             7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0)
VLLM_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's finished reasons (its request_success_total label values), and ours as them
VLLM_FINISHED = ("stop", "length", "abort", "error", "repetition")
AS_VLLM_REASON = {"stop": "stop", "length": "length", "aborted": "abort", "timeout": "abort",
                  "error": "error"}
# the blocks a lane's request holds (vLLM's kv_cache_usage_perc counts blocks in use; a prefix
# cache entry no lane holds is reusable space, as vLLM's free-but-cached blocks are)
_IN_USE = ("lane", "draining", "spilling")


def tokens_buckets(max_len: int) -> list[float]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_len`."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return out
            out.append(float(m * scale))
        scale *= 10


def _reading(b: Any) -> tuple[int, int, Tally[str], Any]:
    """What a scrape reports of the batcher, read at once: its queue, busy lanes, blocks by
    owner and a copy of its stats."""
    s = b.view
    return (len(b.waiting), sum(1 for x in s.busy if x),
            Tally(core.OWNER_NAMES[o].lower() for o in s.owner), attrs.evolve(b.stats))


class _BatcherCollector(Collector):
    """Read at scrape time from the batcher, on the engine thread between two steps (the core
    state changes in place during a step), and from the engine's counters."""

    def __init__(self, engine: Any, labels: dict[str, str]) -> None:
        self.engine = engine
        self.names, self.values = list(labels), list(labels.values())

    def _vllm(self, kind: Any, name: str, doc: str, value: float) -> Any:
        fam = kind(name, doc, labels=self.names)
        fam.add_metric(self.values, value)
        return fam

    def collect(self) -> Iterator[Any]:
        waiting, busy, tally, st = self.engine.call(_reading)
        total = sum(tally.values())
        yield self._vllm(GaugeMetricFamily, "vllm:num_requests_running",
                         "Number of requests in model execution batches.", busy)
        yield self._vllm(GaugeMetricFamily, "vllm:num_requests_waiting",
                         "Number of requests waiting to be processed.", waiting)
        yield self._vllm(GaugeMetricFamily, "vllm:kv_cache_usage_perc",
                         "KV-cache usage. 1 means 100 percent usage.",
                         sum(tally.get(o, 0) for o in _IN_USE) / total if total else 0.0)
        yield self._vllm(CounterMetricFamily, "vllm:prefix_cache_hits",
                         "Prefix cache hits, in terms of number of cached tokens.",
                         st.prefix_hit_tokens)
        yield self._vllm(CounterMetricFamily, "vllm:num_preemptions",
                         "Cumulative number of preemption from the engine.", st.preemptions)
        yield GaugeMetricFamily("atom_queue_depth", "requests waiting for a lane",
                                value=waiting)
        yield GaugeMetricFamily("atom_busy_lanes", "lanes holding a request", value=busy)
        blocks = GaugeMetricFamily("atom_kv_blocks", "KV blocks by owner", labels=["owner"])
        for name in core.OWNER_NAMES:
            blocks.add_metric([name.lower()], tally.get(name.lower(), 0))
        yield blocks
        for name, help_, value in (
                ("atom_prefix_hit_tokens", "prompt tokens reused from the prefix cache",
                 st.prefix_hit_tokens),
                ("atom_host_hit_tokens", "prompt tokens loaded from the host tier",
                 st.host_hit_tokens),
                ("atom_preemptions", "requests preempted to free blocks", st.preemptions),
                ("atom_prefill_tokens", "prompt tokens computed by prefill", st.prefill_tokens),
                ("atom_decode_steps", "decode calls", st.decode_steps),
                ("atom_generated_tokens", "tokens generated by the batcher",
                 st.generated_tokens)):
            yield CounterMetricFamily(name, help_, value=value)
        yield GaugeMetricFamily("atom_engine_up", "1 while the engine loop runs",
                                value=1 if self.engine.running else 0)
        yield CounterMetricFamily("atom_engine_steps", "batcher steps the engine ran",
                                  value=self.engine.steps)
        yield CounterMetricFamily("atom_engine_step_cpu_seconds",
                                  "CPU time of the engine thread inside the batcher's steps",
                                  value=self.engine.step_cpu)
        yield CounterMetricFamily("atom_engine_step_seconds",
                                  "wall time of the batcher's steps (beyond their CPU time: "
                                  "waits for the GIL or a core)",
                                  value=self.engine.step_wall)


class LoopHistogram(Collector):
    """A latency histogram observed and scraped on the event loop only, so without a lock:
    prometheus-client's Histogram takes its lock twice per observation, once per streamed token
    here. Exported as an ordinary Prometheus histogram (_bucket, _count, _sum)."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...] = _LATENCY,
                 labels: dict[str, str] | None = None) -> None:
        self.name, self.doc, self.bounds = name, doc, list(buckets)
        self.labels = dict(labels or {})
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1  # (`le`: bounds are inclusive)
        self.sum += seconds

    def collect(self) -> Iterator[Any]:
        total, buckets = 0, []
        for bound, count in zip([*map(floatToGoString, self.bounds), "+Inf"], self.counts,
                                strict=True):
            total += count
            buckets.append((bound, total))
        fam = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        fam.add_metric(list(self.labels.values()), buckets, self.sum)
        yield fam


class Metrics:
    def __init__(self, engine: Any, model_name: str = "", max_model_len: int = 1) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # vLLM's label set (one engine: "0")
        lab = {"model_name": model_name, "engine": "0"}
        names = list(lab)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=r).labels(**lab)

        self.vllm_prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens "
                                                                "processed.")
        self.vllm_generation_tokens = counter("vllm:generation_tokens",
                                              "Number of generation tokens processed.")
        self.vllm_prefix_queries = counter("vllm:prefix_cache_queries",
                                           "Prefix cache queries, in terms of number of "
                                           "queried tokens.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=r)
        self.vllm_success = {why: success.labels(**lab, finished_reason=why)
                             for why in VLLM_FINISHED}
        self.vllm_ttft = LoopHistogram("vllm:time_to_first_token_seconds",
                                       "Histogram of time to first token in seconds.",
                                       VLLM_TTFT, lab)
        self.vllm_itl = LoopHistogram("vllm:inter_token_latency_seconds",
                                      "Histogram of inter-token latency in seconds.",
                                      VLLM_ITL, lab)
        self.vllm_e2e = LoopHistogram("vllm:e2e_request_latency_seconds",
                                      "Histogram of e2e request latency in seconds.",
                                      VLLM_LATENCY, lab)
        toks = tuple(tokens_buckets(max_model_len))
        self.vllm_prompt_hist = LoopHistogram("vllm:request_prompt_tokens",
                                              "Number of prefill tokens processed.", toks, lab)
        self.vllm_generation_hist = LoopHistogram("vllm:request_generation_tokens",
                                                  "Number of generation tokens processed.",
                                                  toks, lab)
        for h in (self.vllm_ttft, self.vllm_itl, self.vllm_e2e, self.vllm_prompt_hist,
                  self.vllm_generation_hist):
            r.register(h)
        self.outcomes = Counter("atom_requests", "requests by outcome", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.outcomes.labels(o)
        self.prompt_tokens = Counter("atom_prompt_tokens", "prompt tokens of served requests",
                                     registry=r)
        self.completion_tokens = Counter("atom_completion_tokens",
                                         "tokens returned to clients", registry=r)
        self.ttft = LoopHistogram("atom_time_to_first_token_seconds",
                                  "from the request's arrival to its first token")
        self.itl = LoopHistogram("atom_inter_token_latency_seconds",
                                 "between two tokens of one request")
        r.register(self.ttft)
        r.register(self.itl)
        r.register(_BatcherCollector(engine, lab))

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.vllm_ttft.observe(seconds)

    def next_token(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.vllm_itl.observe(seconds)

    def ended(self, outcome: str, seconds: float, prompt: int, generated: int) -> None:
        """A request that reached the engine ended (`outcome`: one of OUTCOMES)."""
        self.outcomes.labels(outcome).inc()
        why = AS_VLLM_REASON.get(outcome)
        if why is not None:
            self.vllm_success[why].inc()
            self.vllm_e2e.observe(seconds)
            self.vllm_prompt_hist.observe(prompt)
            self.vllm_generation_hist.observe(generated)
