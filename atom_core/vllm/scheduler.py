"""`AtomScheduler`: vLLM's `SchedulerInterface` over atom-core's `Scheduler`.

One vLLM step is one atom-core step. `schedule()` runs the core's step up to its forward call,
answering its block work on the way (a prefix hit's copy becomes one of vLLM's
`kv_cache_block_copies`, which the model runner applies before the forward), and turns the
call into a `SchedulerOutput`: a prompt chunk of one request, or one decode token for every
decoding request. `update_from_output()` hands the sampled tokens back (`StepResult`), ends the
step, and lets vLLM decide, as its own scheduler does (`check_stop`), which requests stopped;
the core hears of those as normal finishes, so their blocks go to its prefix cache.

What this module keeps is what vLLM's side needs and the core has no word for: vLLM's `Request`
objects, the string ids they carry, and which blocks the model runner already knows of each
request. Lanes, tables, phases and the waiting queue are read from the core, never copied.

Hybrid sliding-window models (Gemma3: full-attention and sliding-window KV cache groups) run
on a hybrid Config: the full-attention groups get the core's tables, each sliding group a ring
of blocks per lane (its local slot; `atom_core/vllm/hybrid.py`), without the prefix cache.

Not supported, refused at construction with the flag to change: speculative decoding,
pipeline parallelism, KV connectors (disaggregated prefill), LoRA, KV cache groups other than
full attention and sliding windows (or windows of different sizes), prefix caching with a
hybrid model, pooling models, prompt embeddings and multimodal inputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.core.sched.interface import PauseState, SchedulerInterface
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.core.sched.utils import check_stop
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats
from vllm.v1.request import Request, RequestStatus

from atom_core._generated import core
from atom_core.policy import Policy
from atom_core.scheduler import (
    CopyWork,
    DecodeCall,
    MixedCall,
    PrefillCall,
    Scheduler,
    StepOutput,
    StepResult,
)
from atom_core.vllm.config import config_from_vllm, ring_blocks
from atom_core.vllm.hybrid import Groups, Rings, read_groups

log = logging.getLogger(__name__)

_NULL = 1  # vLLM's block ids are the core's plus one: block 0 is vLLM's null block


def _vllm_ids(table: list[int]) -> list[int]:
    """A core block table in vLLM's block ids."""
    return [b + _NULL for b in table]


class AtomScheduler(SchedulerInterface):
    def __init__(self, vllm_config: Any, kv_cache_config: Any, structured_output_manager: Any,
                 block_size: int, hash_block_size: int | None = None, mm_registry: Any = None,
                 include_finished_set: bool = False, log_stats: bool = False) -> None:
        groups = _refuse_unsupported(vllm_config, kv_cache_config, block_size)
        self.vllm_config = vllm_config
        self.config = config_from_vllm(vllm_config, kv_cache_config.num_blocks,
                                       groups.sliding_window, groups.sliding)
        if block_size != self.config.block_size:
            raise ValueError(f"vLLM's scheduler block size {block_size} differs from its cache "
                             f"block size {self.config.block_size}; atom-core needs one size")
        w = self.config.sliding_window
        # the sliding groups' rings: the pool's ids past the core's blocks
        self.rings = Rings(groups.kinds, self.config.lanes,
                           ring_blocks(w, block_size, self.config.prefill_chunk) if w else 0,
                           first=self.config.kv_blocks + _NULL)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.structured_output_manager = structured_output_manager
        self.log_stats = log_stats
        self.include_finished_set = include_finished_set
        # the engine reads these of any scheduler
        self.connector = None
        self.ec_connector = None
        # ended requests leave the core at once: vLLM keeps what a client reads (its Request)
        # vLLM's runner takes decode rows and prompt chunks of several requests in one forward
        # (no static batch shape, no padding rows): a step asks for all it can (`MixedCall`),
        # chunks within vLLM's token budget per step
        # (hybrid: the Config's spare lane stays idle, see config_from_vllm)
        policy = Policy(spare_local_slot=True) if w is not None else None
        self.core = Scheduler(
            self.config, policy=policy, keep_ended=0, mixed=True,
            prefill_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            vocab_size=vllm_config.model_config.get_vocab_size())
        self.requests: dict[str, Request] = {}  # vLLM's live requests (structured output reads)
        self._structured: set[str] = set()  # those with structured output (grammars)
        self._rid: dict[str, int] = {}  # vLLM's id -> the core's
        self._vid: dict[int, str] = {}  # and back
        self._grammar_wait: list[Request] = []  # structured output: its grammar compiles
        self._sent: dict[str, int] = {}  # blocks of each lane's table the model runner knows
        self._known: set[str] = set()  # requests the model runner has (NewRequestData sent)
        self._resumed: set[str] = set()  # preempted since: the runner replaces their table
        self._last_scheduled: set[str] = set()
        self._finished: set[str] = set()  # ended since the last output (the runner frees them)
        self._finished_by_client: dict[int, set[str]] = {}
        self._ended_outputs: list[EngineCoreOutput] = []  # ended outside a step's tokens
        self._client_of: dict[str, int] = {}  # and the client each of those goes to
        self._call: PrefillCall | DecodeCall | MixedCall | None = None
        self._seen = 0  # events of the step in progress already acted on
        self._deferred: dict[str, RequestStatus] = {}  # finished while a call was out
        self._pause = PauseState.UNPAUSED
        self._prefix_stats = PrefixCacheStats()

    # --------------------------------------------------------------- requests in
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use: streaming "
                             "input sessions are not supported by atom-core's scheduler")
        self.requests[request.request_id] = request
        if request.use_structured_output:
            self._structured.add(request.request_id)
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED)
        if request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
            self._grammar_wait.append(request)
        else:
            self._submit(request)

    def _submit(self, request: Request) -> None:
        vid = request.request_id
        try:
            if request.prompt_token_ids is None:
                raise ValueError("prompt embeddings are not supported by atom-core's scheduler")
            # vLLM decides when a request stops (`check_stop`); the core's own limit is the
            # same max_tokens, so its length cap and vLLM's agree
            # prompt logprobs (vLLM's `skip_reading_prefix_cache`): the runner computes them
            # for the positions it is given, so the request takes no prefix hit
            rid = self.core.submit(request.prompt_token_ids, request.max_tokens,
                                   uncached=bool(request.skip_reading_prefix_cache))
        except ValueError as e:
            request.status = RequestStatus.FINISHED_ERROR
            log.warning("request %s refused: %s", vid, e)
            self._ended(request, None)
            return
        self._rid[vid], self._vid[rid] = rid, vid

    def _promote_grammars(self) -> None:
        """Requests whose grammar has compiled join the core's queue; a failed compile ends
        its request alone."""
        still = []
        for req in self._grammar_wait:
            if req.is_finished():
                continue
            grammar = req.structured_output_request.grammar if req.structured_output_request \
                else None
            if grammar is None:
                still.append(req)
            elif isinstance(grammar, Exception):
                req.status = RequestStatus.FINISHED_ERROR
                self._ended(req, None)
            else:
                req.status = RequestStatus.WAITING
                self._submit(req)
        self._grammar_wait = still

    # --------------------------------------------------------------- the step
    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        if self._call is not None:
            raise RuntimeError("schedule() before the last step's update_from_output(): "
                               "AtomScheduler runs one step at a time (async scheduling and "
                               "pipeline parallelism are off for it)")
        if self._grammar_wait:
            self._promote_grammars()
        copies: list[KVCacheBlockCopy] = []
        if self._pause == PauseState.PAUSED_ALL:
            return self._output(None, copies)
        out = self.core.schedule()
        self._seen = 0
        while not out.done and out.call is None:
            out = self.core.update(StepResult(work=tuple(
                self._work(w, copies) for w in out.work)))
        self._act(out)
        if out.done:
            return self._output(None, copies)
        self._call = out.call
        return self._output(out.call, copies)

    @staticmethod
    def _work(work: Any, copies: list[KVCacheBlockCopy]) -> str | None:
        if isinstance(work, CopyWork):
            # the whole block: the positions past the hit are rewritten before they are read
            copies.append(KVCacheBlockCopy(work.src + _NULL, work.dst + _NULL))
            return None
        # (no host tier and no hybrid prefix cache reach here: the Config has neither)
        return f"{type(work).__name__} is not supported under vLLM"

    def _output(self, call: PrefillCall | DecodeCall | MixedCall | None,
                copies: list[KVCacheBlockCopy]) -> SchedulerOutput:
        new: list[NewRequestData] = []
        cached = CachedRequestData.make_empty()
        tokens: dict[str, int] = {}
        # (lane, first position, tokens, local slot)
        rows: list[tuple[int, int, int, int | None]] = []
        dec = call.decode if isinstance(call, MixedCall) else call
        if isinstance(dec, DecodeCall):
            positions, locals_ = dec.positions, dec.local
            for ln in dec.lanes:
                rows.append((ln, positions[ln], 1, locals_[ln] if locals_ else None))
        for p in call.prefills if isinstance(call, MixedCall) else (call,):
            if isinstance(p, PrefillCall):
                rows.append((p.lane, p.start, p.end - p.start, p.local))
        lane_req, held, vids, requests = (self.core.view.lane_req, self.core.tables, self._vid,
                                          self.requests)
        known, resumed_, sent_ = self._known, self._resumed, self._sent
        now: float | None = None  # (read once, and only in a step that schedules a request anew)
        for lane, start, n, local in rows:
            if local is not None and local != lane:
                # the ring a lane's sliding tables name is its own (tables sent never change)
                raise RuntimeError(f"lane {lane}'s row runs in local slot {local}: under vLLM "
                                   "a lane's sliding KV is its own ring")
            vid = vids[lane_req[lane]]
            req = requests[vid]
            req.num_computed_tokens = start
            req.is_prefill_chunk = start + n < req.num_tokens
            table = held[lane]  # the core's ids (vLLM's are one more: `_vllm_ids`)
            if req.status != RequestStatus.RUNNING:  # admitted (again) this step
                req.status = RequestStatus.RUNNING
                if self.log_stats:
                    if now is None:
                        now = time.monotonic()
                    req.record_event(EngineCoreEventType.SCHEDULED, now)
                if req.num_preemptions == 0 and req.prefill_stats is not None:
                    req.prefill_stats.set(req.num_prompt_tokens, start, 0)
                    req.num_cached_tokens = start
                self._prefix_stats.record(num_tokens=req.num_tokens, num_hits=start,
                                          preempted=req.num_preemptions > 0)
            if vid not in known:
                new.append(NewRequestData.from_request(
                    req, self.rings.block_ids(lane, _vllm_ids(table), 0)))
                known.add(vid)
                resumed_.discard(vid)
            else:
                resumed = vid in resumed_
                sent = 0 if resumed else sent_.get(vid, 0)
                cached.req_ids.append(vid)
                if resumed:
                    cached.resumed_req_ids.add(vid)
                    resumed_.discard(vid)
                if vid not in self._last_scheduled:
                    cached.all_token_ids[vid] = list(req.all_token_ids)
                # (most steps send no block: a decode grows a table once per block_size tokens)
                cached.new_block_ids.append(self.rings.block_ids(lane, _vllm_ids(table), sent)
                                            if len(table) > sent else None)
                cached.num_computed_tokens.append(start)
                cached.num_output_tokens.append(req.num_output_tokens)
            sent_[vid] = len(table)
            tokens[vid] = n
        self._last_scheduled = set(tokens)
        finished, self._finished = self._finished, set()
        out = SchedulerOutput(
            scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=tokens,
            total_num_scheduled_tokens=sum(tokens.values()), scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={}, finished_req_ids=finished, free_encoder_mm_hashes=[],
            preempted_req_ids=None, kv_cache_block_copies=copies or None)
        out.has_structured_output_requests = bool(self._structured) and any(
            v in self._structured for v in tokens)
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: Any) -> dict[int, EngineCoreOutputs]:
        call, self._call = self._call, None
        outputs: dict[int, list[EngineCoreOutput]] = {}
        if call is not None:
            result = self._result(call, model_runner_output)
            requests = self.requests
            for vid, n in scheduler_output.num_scheduled_tokens.items():
                req = requests.get(vid)
                if req is not None:
                    req.num_computed_tokens += n
            out = self.core.update(result)
            while not out.done:  # (block work after a call: none without hybrid models)
                out = self.core.update(StepResult(work=tuple(
                    self._work(w, []) for w in out.work)))
            self._act(out, model_runner_output, outputs)
        if self._deferred:
            for vid, status in self._deferred.items():
                self._finish_one(vid, status)
            self._deferred.clear()
        if self._ended_outputs:
            for o in self._ended_outputs:
                outputs.setdefault(self._client(o.request_id), []).append(o)
            self._ended_outputs.clear()
        result_: dict[int, EngineCoreOutputs] = {
            c: EngineCoreOutputs(outputs=outs) for c, outs in outputs.items()}
        if self.include_finished_set and self._finished_by_client:
            for c, ids in self._finished_by_client.items():
                result_.setdefault(c, EngineCoreOutputs()).finished_requests = ids
            self._finished_by_client = {}
        stats = self.make_stats()
        if stats is not None:
            client = next(iter(result_), 0)
            if client not in result_:  # (an empty one made only when no output goes out)
                result_[client] = EngineCoreOutputs()
            result_[client].scheduler_stats = stats
        return result_

    def _client(self, vid: str) -> int:
        return self._client_of.pop(vid, 0)

    def _result(self, call: PrefillCall | DecodeCall | MixedCall, mro: Any) -> StepResult:
        """The sampled tokens as the core's `StepResult`: one per row of the call (a prompt
        chunk that does not end its prompt samples nothing: its token is not read)."""
        if isinstance(call, MixedCall):
            parts = [self._result(c, mro) for c in (call.decode, *call.prefills)
                     if c is not None]
            return StepResult(tokens=tuple(t for p in parts for t in p.tokens),
                              row_errors=tuple(e for p in parts
                                               for e in p.row_errors or (None,) * len(p.tokens)))
        index, sampled = mro.req_id_to_index, mro.sampled_token_ids
        if isinstance(call, PrefillCall):
            vid = self._vid[call.request]
            toks = sampled[index[vid]] if vid in index and sampled else []
            if call.emits and len(toks) == 0:
                return StepResult(tokens=(0,), row_errors=(
                    "the model runner sampled no token for the prompt's last chunk",))
            return StepResult(tokens=(int(toks[0]) if len(toks) else 0,))
        rows = len(call.ids)
        tokens = [0] * rows
        errors: list[str | None] | None = None  # (none: the core reads () as no row's error)
        vids, requests = self._vid, call.requests
        for ln in call.lanes:
            vid = vids[requests[ln]]  # type: ignore[index]
            toks = sampled[index[vid]] if vid in index and sampled else []
            if len(toks):
                tokens[ln] = int(toks[0])
            else:
                if errors is None:
                    errors = [None] * rows
                errors[ln] = "the model runner sampled no token for this request"
        return StepResult(tokens=tuple(tokens), row_errors=() if errors is None else tuple(errors))

    def _act(self, out: StepOutput, mro: Any = None,
             outputs: dict[int, list[EngineCoreOutput]] | None = None) -> None:
        """Act on the step's events not yet acted on: preemptions (the runner drops the
        request's table; vLLM counts it), tokens (vLLM's stop rules), ends."""
        events = out.events[self._seen:] if self._seen else out.events
        self._seen = len(out.events)
        if not events:
            return
        new_tokens: dict[str, list[int]] = {}
        # the requests the events name, in their order (a dict: one output each, in that order)
        touched: dict[str, None] = {}
        vids, requests = self._vid, self.requests
        for ev in events:
            vid = vids.get(ev.request_id)
            if vid is None:
                continue
            touched[vid] = None
            req = requests.get(vid)
            if req is None:
                continue
            if ev.kind == "preempted":
                req.status = RequestStatus.PREEMPTED
                req.num_computed_tokens = 0
                req.num_preemptions += 1
                self._resumed.add(vid)
                if self.log_stats:
                    req.record_event(EngineCoreEventType.PREEMPTED)
            elif ev.kind == "token":
                if req.is_finished():  # finished by the client while the call was out
                    continue
                assert ev.token is not None
                req.append_output_token_ids(ev.token)
                new_tokens.setdefault(vid, []).append(ev.token)
                if check_stop(req, self.max_model_len):
                    # vLLM's stop: the core hears a normal finish (its blocks are filed)
                    self.core.finish(ev.request_id)
            elif ev.kind == "finished":
                if not req.is_finished():  # the core's own length cap, as vLLM's would be
                    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            elif ev.kind == "error":
                log.error("request %s failed: %s", vid, ev.error)
                req.status = RequestStatus.FINISHED_ERROR
        if outputs is None:
            for vid in touched:
                req = self.requests.get(vid)
                if req is not None and req.is_finished():
                    self._ended(req, outputs)
            return
        # the prompt's logprobs (`prompt_logprobs`), which the runner hands back with the
        # prompt's last chunk, computed over every prompt position (the request took no
        # prefix hit: `skip_reading_prefix_cache`); (most steps: none, no lookup)
        lps = None if mro is None else mro.prompt_logprobs_dict
        ids_lps = None if mro is None else mro.prompt_token_id_logprobs_dict
        for vid in touched:
            req = requests.get(vid)
            if req is None or vid in self._deferred:  # (the client ended it: it knows)
                continue
            toks = new_tokens.get(vid, [])
            prompt = None if mro is None else (lps.get(vid) if lps else None,
                                               ids_lps.get(vid) if ids_lps else None)
            if not toks and not req.is_finished() and (prompt is None or prompt == (None, None)):
                continue
            logprobs = None
            if (mro is not None and mro.logprobs is not None and toks
                    and req.sampling_params is not None
                    and req.sampling_params.num_logprobs is not None):
                logprobs = mro.logprobs.slice_request(mro.req_id_to_index[vid], len(toks))
            self._emit(req, toks, logprobs, outputs, prompt)

    def _emit(self, req: Request, toks: list[int], logprobs: Any,
              outputs: dict[int, list[EngineCoreOutput]],
              prompt: tuple[Any, Any] | None = None) -> None:
        finished = req.is_finished()
        prefill_stats = req.take_prefill_stats() if toks or finished else None
        prompt_lps, prompt_ids_lps = prompt or (None, None)
        outputs.setdefault(req.client_index, []).append(EngineCoreOutput(
            request_id=req.request_id, new_token_ids=toks, new_logprobs=logprobs,
            new_prompt_logprobs_tensors=prompt_lps, prompt_token_id_logprobs=prompt_ids_lps,
            finish_reason=req.get_finished_reason() if finished else None,
            stop_reason=req.stop_reason, events=req.take_events(), prefill_stats=prefill_stats,
            trace_headers=req.trace_headers, num_nans_in_logits=req.num_nans_in_logits))
        if finished:
            self._release(req)

    def _ended(self, req: Request, outputs: dict[int, list[EngineCoreOutput]] | None) -> None:
        """A request that ended with no token to report (refused, failed, its grammar did not
        compile): its final output goes out with the next step's."""
        self._ended_outputs.append(EngineCoreOutput(
            request_id=req.request_id, new_token_ids=[], finish_reason=req.get_finished_reason(),
            events=req.take_events(), trace_headers=req.trace_headers))
        self._client_of[req.request_id] = req.client_index
        self._release(req)

    def _release(self, req: Request) -> None:
        vid = req.request_id
        self.requests.pop(vid, None)
        self._structured.discard(vid)
        rid = self._rid.pop(vid, None)
        if rid is not None:
            self._vid.pop(rid, None)
        self._sent.pop(vid, None)
        self._resumed.discard(vid)
        if vid in self._known:
            self._known.discard(vid)
            self._finished.add(vid)
        if self.include_finished_set:
            self._finished_by_client.setdefault(req.client_index, set()).add(vid)

    # --------------------------------------------------------------- requests out
    def finish_requests(self, request_ids: str | Iterable[str] | None,
                        finished_status: RequestStatus) -> list[Request]:
        """An abort, or a stop string the frontend found: the request ends now. A stop
        (FINISHED_STOPPED) is a normal finish for the core (its blocks are filed in the prefix
        cache); anything else an abort. While a call is out, the core hears of it after the
        call's outcome (`update_from_output`), and the call's tokens for it are dropped."""
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            ids: Iterable[str] = (request_ids,)
        elif request_ids is None:
            ids = list(self.requests)
        else:
            ids = set(request_ids)
        done = []
        for vid in ids:
            req = self.requests.get(vid)
            if req is None or req.is_finished():
                continue
            req.status = finished_status
            done.append(req)
            if self._call is not None:
                self._deferred[vid] = finished_status
            else:
                self._finish_one(vid, finished_status)
        return done

    def _finish_one(self, vid: str, status: RequestStatus) -> None:
        req = self.requests.get(vid)
        if req is None:
            return
        rid = self._rid.get(vid)
        if rid is not None:
            if status == RequestStatus.FINISHED_STOPPED:
                self.core.finish(rid)
            else:
                self.core.abort(rid)
        if req in self._grammar_wait:
            self._grammar_wait.remove(req)
        self._release(req)

    # --------------------------------------------------------------- counts and stats
    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_finished_requests(self) -> bool:
        return bool(self._finished) or bool(self._ended_outputs)

    def get_request_counts(self) -> tuple[int, int]:
        return _request_counts(self.core.view, len(self.requests))

    def get_kv_cache_usage(self) -> float:
        """Blocks held by requests (as vLLM counts: cache entries are reusable, not used)."""
        return _usage(self.core.view, self.config.kv_blocks)

    def make_stats(self, *args: Any, **kwargs: Any) -> SchedulerStats | None:
        if not self.log_stats:
            return None
        view = self.core.view  # (asked every step: the state read once)
        running, waiting = _request_counts(view, len(self.requests))
        stats, self._prefix_stats = self._prefix_stats, PrefixCacheStats()
        return SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting,
                              kv_cache_usage=_usage(view, self.config.kv_blocks),
                              prefix_cache_stats=stats)

    def check_invariants(self) -> None:
        """The core's invariants and its tables (see `Scheduler.check_invariants`)."""
        self.core.check_invariants()

    # --------------------------------------------------------------- the rest of the surface
    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> Any:
        from vllm.v1.core.sched.output import GrammarOutput

        if not scheduler_output.has_structured_output_requests:
            return None
        ids = [v for v in scheduler_output.num_scheduled_tokens
               if (r := self.requests.get(v)) is not None and r.use_structured_output
               and not r.is_prefill_chunk]
        if not ids:
            return None
        bitmask = self.structured_output_manager.grammar_bitmask(self.requests, ids, {})
        return GrammarOutput(ids, bitmask, [0] * len(ids))

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        raise NotImplementedError("speculative decoding is not supported by AtomScheduler")

    def update_draft_token_ids_in_output(self, draft_token_ids: Any,
                                         scheduler_output: Any) -> None:
        raise NotImplementedError("speculative decoding is not supported by AtomScheduler")

    @property
    def pause_state(self) -> PauseState:
        return self._pause

    def set_pause_state(self, pause_state: PauseState) -> None:
        self._pause = pause_state

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        # (the core has no action that empties its cache without a lane's need: answered
        # honestly as not done, as vLLM's own scheduler answers while requests hold blocks)
        log.warning("AtomScheduler cannot reset the prefix cache; its entries are evicted "
                    "only as lanes need blocks")
        return False

    def reset_encoder_cache(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _request_counts(view: Any, requests: int) -> tuple[int, int]:
    """(running, waiting) of vLLM's `requests` live ones: running those on a lane."""
    running = view.busy.count(True)
    return running, requests - running


def _usage(view: Any, kv_blocks: int) -> float:
    owner = view.owner  # (counted at C speed: vLLM asks every step)
    return (len(owner) - owner.count(core.OWNER_FREE) - owner.count(core.OWNER_CACHE)) / kv_blocks


def _refuse_unsupported(vllm_config: Any, kv_cache_config: Any, block_size: int) -> Groups:
    """vLLM features atom-core's scheduler does not model, each named with what to change;
    else the KV cache groups it serves."""
    refused = []
    if vllm_config.speculative_config is not None:
        refused.append("speculative decoding (drop --speculative-config)")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        refused.append("pipeline parallelism (--pipeline-parallel-size 1)")
    if vllm_config.kv_transfer_config is not None:
        refused.append("KV connectors (drop --kv-transfer-config)")
    if vllm_config.lora_config is not None:
        refused.append("LoRA (drop --enable-lora)")
    if vllm_config.scheduler_config.async_scheduling:
        refused.append("async scheduling (--no-async-scheduling)")
    groups = read_groups(kv_cache_config, block_size)
    if isinstance(groups, str):
        refused.append(groups)
    model = vllm_config.model_config
    if getattr(model, "runner_type", "generate") != "generate":
        refused.append(f"{model.runner_type} models (generation only)")
    if refused:
        raise ValueError("AtomScheduler does not support " + "; ".join(refused))
    assert not isinstance(groups, str)
    return groups
