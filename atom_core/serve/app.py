"""The FastAPI application: OpenAI-compatible endpoints over an `Engine`.

Every path but /health (and vLLM's /version, /tokenize and /detokenize outside /v1, open in
vLLM too) needs `Authorization: Bearer <api key>` unless the server was started without a key
on purpose (`--insecure-no-auth`), and a request body is at most
`max_body_bytes`: both are checked before the body is read (`asgi.Guard`). A JSON body is
parsed by `protocol.parse_body` (`asgi.TotalRoute`), which takes any bytes. Every error,
FastAPI's and Starlette's own (404, 405, validation) too, uses the OpenAI error shape
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from atom_core.batcher import Event
from atom_core.serve import dashboard, vllm_routes
from atom_core.serve.asgi import (
    JSON_KINDS,
    ApiError,
    App,
    Guard,
    TotalRoute,
    Unexpected,
    error_response,
    is_json,
    is_type_label,
    location,
)
from atom_core.serve.engine import FINAL, Engine, EngineStopped, Handle
from atom_core.serve.hits import HitCounter
from atom_core.serve.main import DEFAULT_MAX_LOGPROBS, DEFAULT_QUEUE, MAX_LOGPROBS_BOUND
from atom_core.serve.metrics import Metrics
from atom_core.serve.outputs import CompletionLogprobs, EchoLogprobs, chat_logprobs
from atom_core.serve.protocol import (
    GENERIC_UNSUPPORTED,
    UNSUPPORTED,
    ChatRequest,
    CompletionRequest,
)
from atom_core.serve.sampling import PromptLogprobs, SamplingParams, sampler_for
from atom_core.serve.streaming import _Frames, _Inbox, _Stream
from atom_core.serve.tokenizer import ChatTemplateError, IncrementalText, Tokenizer

log = logging.getLogger(__name__)


@attrs.frozen
class ServerSettings:
    model_name: str
    api_key: str | None  # None: no authentication (only ever on purpose)
    # requests waiting beyond the lanes; past that: 429 (the default lets a burst wait, as
    # vLLM's unbounded queue does, within host memory: main.DEFAULT_QUEUE says why)
    max_queue: int = DEFAULT_QUEUE
    request_timeout: float | None = 600.0  # seconds; None: no limit
    # A stream sends its first token at once, then every `stream_interval` tokens (and its
    # end at once): fewer, larger writes for burstier tokens. 1: each token as it comes.
    stream_interval: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    # the largest request body read: a prompt of a whole long context as token ids or JSON-escaped
    # text fits many times over; past it a 413, before the body is read into memory
    max_body_bytes: int = attrs.field(default=32 * 2**20, validator=attrs.validators.ge(1))
    # log-probabilities per token a request may ask for (--max-logprobs; main.py: why it is
    # bounded)
    max_logprobs: int = attrs.field(default=DEFAULT_MAX_LOGPROBS, validator=[
        attrs.validators.ge(0), attrs.validators.le(MAX_LOGPROBS_BOUND)])


@attrs.define
class _Job:
    """What one request asked for, after validation."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    stop_ids: set[int]
    reserved: bool = False  # holds one of the in-flight places `_admit` counts
    # the ids the reply's text continues (a completion's prompt: its reply's first word keeps
    # its space); a chat reply is a message of its own, so its text starts afresh
    context: list[int] = attrs.field(factory=list)
    eos: int | None = None  # the end token the batcher stops at (None: ignore_eos)
    sampler: Any = None  # `sampling.Sampler` (its records: the tokens' logprobs), or None
    include_stop: bool = False
    skip_special: bool = True
    logprobs: int | None = None  # per token: the chosen one's and this many more
    # n > 1: a copy is submitted once `after` is set (its prompt is in the prefix cache by
    # then, so the copies share its KV: `_copies`)
    after: asyncio.Event | None = None
    cached: int = 0  # prompt tokens the prefix cache (or host tier) gave it, once it ended
    # echo with logprobs: the prompt's logprobs, from its prefill calls (no prefix hit)
    prompt_lp: PromptLogprobs | None = None
    # max_tokens 0 with echo: runs as 1 (the core needs one), its sampled token dropped
    prompt_only: bool = False


class RequestTimedOut(Exception):
    pass


class RequestFailed(Exception):
    pass


def create_app(engine: Engine, tokenizer: Tokenizer, settings: ServerSettings) -> FastAPI:
    cfg = engine.batcher.config
    metrics = Metrics(engine, settings.model_name, cfg.max_seq_len)
    vocab = engine.batcher.capabilities.vocab_size
    eos = tokenizer.eos_token_id
    state = {"in_flight": 0}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()

        # the engine's events wait here for the loop; at most one wake-up is pending, so a loop
        # slower than the engine takes several steps' events in one wake-up (each costs a
        # syscall and a GIL hand-over) instead of falling further behind
        pending: list[tuple[Handle, Event]] = []
        lock = threading.Lock()

        def fan_out() -> None:  # on the event loop
            nonlocal pending
            with lock:
                batch, pending = pending, []
            for h, ev in batch:
                h.sink(ev)

        def deliver(batch: list[tuple[Handle, Event]]) -> None:  # on the engine thread
            with lock:
                wake = not pending
                pending.extend(batch)
            if wake:
                loop.call_soon_threadsafe(fan_out)

        engine.deliver = deliver
        if not engine.running:
            engine.start()
        try:
            yield
        finally:  # shutdown (SIGINT/SIGTERM): every request in flight ends, then the thread
            await asyncio.to_thread(engine.stop)

    app = App(title="atom-core", lifespan=lifespan)
    app.router.route_class = TotalRoute  # (before the routes are added)
    # (the last added runs first: a bug in the guard is still a 500 in the API's shape)
    app.add_middleware(Guard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(Unexpected)
    app.state.engine, app.state.metrics, app.state.settings = engine, metrics, settings
    app.state.tokenizer = tokenizer
    app.state.started = int(time.time())  # (the model card's `created`)

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, exc: ApiError) -> JSONResponse:
        if exc.status == 400:
            metrics.outcomes.labels("invalid").inc()
        return error_response(exc.status, exc.message, exc.param, exc.type, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's and FastAPI's own errors (an unknown path, a method a path does not
        take, ...), in the API's shape: `{"detail": ...}` is no error an OpenAI client reads."""
        if isinstance(exc.__cause__, ApiError):  # (our parse, wrapped by FastAPI's body read)
            return await _api_error(req, exc.__cause__)
        where = f"{req.method} {req.url.path[:200]}"
        if exc.status_code == 404:
            message = f"no such path: {where}; this server serves " + ", ".join(
                f"{m} {r.path}" for r in app.routes if isinstance(r, APIRoute)
                for m in sorted(r.methods - {"HEAD"}) if r.path.startswith("/v1/"))
        elif exc.status_code == 405:
            # (Starlette's 405 names the methods the path takes in its Allow header)
            allowed = dict(exc.headers or {}).get("Allow", "another method")
            message = f"{req.url.path[:200]} does not take {req.method}: send {allowed}"
        else:
            message = f"{where}: {exc.detail}"
        return error_response(exc.status_code, message,
                              type_="server_error" if exc.status_code >= 500 else
                              "invalid_request_error",
                              headers=dict(exc.headers or {}) or None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(req: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.outcomes.labels("invalid").inc()
        # (a body that is not JSON never gets here: `TotalRequest` answers it)
        first = exc.errors()[0] if exc.errors() else {}
        loc = location(first)
        kind = req.headers.get("content-type", "")
        if not loc and first.get("type") == "missing":
            return error_response(400, "the request body is empty: send a JSON object")
        if not loc and not is_json(kind):
            # FastAPI reads a body of another type, or of none (`curl -d` sends a form's,
            # `requests.post(data=...)` none), as no JSON at all: its own message ('Input
            # should be a valid dictionary') hid why
            return error_response(400, f"the request body must be JSON, sent with "
                                       f"'Content-Type: application/json' (this one came "
                                       f"{f'as {kind[:60]!r}' if kind else 'without one'}); "
                                       "with curl, add -H 'Content-Type: application/json'")
        if not loc:  # JSON, but not an object (a list, a string, a number)
            return error_response(400, f"the request body must be a JSON object "
                                       f"({{\"model\": ...}}), not a JSON "
                                       f"{JSON_KINDS.get(type(exc.body), 'value')}")
        # the parameter is the first name in the location (e.g. messages.0.role -> messages)
        param = next((x for x in loc if not x.isdigit()), None)
        msg = first.get("msg", "invalid request")
        if first.get("type") == "extra_forbidden":
            msg = UNSUPPORTED.get(loc[-1], GENERIC_UNSUPPORTED) if len(loc) == 1 else \
                GENERIC_UNSUPPORTED
        cut = next((i for i, x in enumerate(loc) if is_type_label(x)), None)
        if cut is not None:
            # a value none of a union's types took: pydantic reports each type's failure,
            # located under the type's name ("prompt.str"); say which types would do
            loc, msg = loc[:cut], "must be one of: " + ", ".join(dict.fromkeys(
                x[cut] for x in map(location, exc.errors())
                if len(x) > cut and x[:cut] == loc[:cut]))
        return error_response(400, f"{'.'.join(loc) or 'body'}: {msg}", param)

    # ------------------------------------------------------------------ plain endpoints
    @app.get("/health")
    async def health() -> Response:
        if engine.running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "down", "reason": engine.failure or "stopped"},
                            status_code=503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        # (off the event loop: the batcher's gauges are read on the engine thread, between steps)
        body = await asyncio.to_thread(generate_latest, metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": app.state.started,
            "owned_by": "atom-core", "root": settings.model_name, "parent": None,
            "max_model_len": cfg.max_seq_len}]}

    @app.get("/state")
    async def server_state() -> dict[str, Any]:
        """The batcher's lanes, blocks by owner and queue (taken between two steps)."""
        view = await asyncio.to_thread(engine.call, lambda b: b.describe())
        return {**view, "in_flight": state["in_flight"], "engine_running": engine.running}

    dashboard.register(app, engine, metrics, settings.model_name)  # /dashboard: it reads /state
    hits = HitCounter(engine.batcher.scheduler.view)  # (before the engine starts, as the above)
    engine.batcher.scheduler.listeners.append(hits)

    # ------------------------------------------------------------------ validation
    def _check_common(body: Any) -> None:
        if body.model != settings.model_name:
            raise ApiError(404, f"model '{body.model[:200]}' does not exist; this server serves "
                                f"'{settings.model_name}' (GET /v1/models)", "model",
                           code="model_not_found")
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options: only with stream=true", "stream_options")
        if body.max_tokens == 0 and not getattr(body, "echo", False):  # (vLLM's words)
            raise ApiError(400, "max_tokens must be at least 1, got 0. (0 only with echo on "
                                "/v1/completions: the prompt alone, scored)", "max_tokens")

    def _check_logprobs(k: int | None, param: str) -> None:
        if k is not None and k > settings.max_logprobs:
            # (vLLM's words)
            raise ApiError(400, f"{param}: Requested sample logprobs of {k}, which is greater "
                                f"than max allowed: {settings.max_logprobs} (the server's "
                                "--max-logprobs)", param)

    def _job(body: Any, prompt: list[int], max_tokens: int | None, param: str,
             logprobs: int | None = None, copy: int = 0) -> _Job:
        if not prompt:
            raise ApiError(400, f"{param}: the prompt is empty (no tokens): send at least one "
                                "token", param)
        if vocab is not None and not (min(prompt) >= 0 and max(prompt) < vocab):
            raise ApiError(400, f"{param}: token ids must be in 0..{vocab - 1}", param)
        s = cfg.max_seq_len
        if len(prompt) >= s:
            raise ApiError(400, f"{param}: the prompt has {len(prompt)} tokens, but this "
                                f"model's context (max_seq_len) is {s} tokens: at most {s - 1} "
                                "prompt tokens; shorten it", param,
                           code="context_length_exceeded")
        room = s - len(prompt) + 1  # the last token comes from position max_seq_len - 1
        name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) \
            else "max_tokens"
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"{name}: {max_tokens} tokens after a {len(prompt)}-token "
                                f"prompt exceed the context (max_seq_len={s}): at most {room}",
                           name, code="context_length_exceeded")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4 or any(not x for x in stop):
            raise ApiError(400, "stop: up to 4 non-empty strings", "stop")
        ids = set(body.stop_token_ids or [])
        if vocab is not None and not all(0 <= t < vocab for t in ids):
            raise ApiError(400, f"stop_token_ids: ids must be in 0..{vocab - 1}",
                           "stop_token_ids")
        # the model's other end tokens end it as EOS does (a tokenizer of the protocol before
        # `end_token_ids` has none), unless ignore_eos (vLLM's: they are its EOS ids)
        if not body.ignore_eos:
            ids |= getattr(tokenizer, "end_token_ids", frozenset())
        end = None if body.ignore_eos else eos
        max_tokens = max_tokens if max_tokens is not None else room
        if body.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens ({body.min_tokens}) must be at most max_tokens "
                                f"({max_tokens})", "min_tokens")
        sampling = SamplingParams(
            temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
            # (vLLM's copies of a seeded request: seed, seed + 1, ...)
            seed=None if body.seed is None else (body.seed + copy) % 2**63,
            min_p=body.min_p, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
            end_ids=frozenset(ids | ({end} if end is not None else set())), logprobs=logprobs)
        return _Job(prompt, max_tokens, sampling, stop, ids, eos=end,
                    sampler=sampler_for(sampling, prompt),
                    include_stop=body.include_stop_str_in_output,
                    skip_special=body.skip_special_tokens, logprobs=logprobs)

    def _release(job: _Job) -> None:
        if job.reserved:
            job.reserved = False
            state["in_flight"] -= 1

    def _admit(job: _Job) -> None:
        if not engine.running:
            metrics.outcomes.labels("rejected").inc()
            raise ApiError(503, "the engine is not running: " + (engine.failure or "shut down"),
                           type_="server_error", code="engine_down")
        limit = cfg.lanes + settings.max_queue
        if state["in_flight"] >= limit:
            metrics.outcomes.labels("rejected").inc()
            raise ApiError(429, f"server busy: {state['in_flight']} requests in flight (lanes "
                                f"{cfg.lanes} + queue {settings.max_queue}, --max-queue); retry "
                                "later",
                           type_="rate_limit_exceeded", code="queue_full")
        state["in_flight"] += 1  # released when the request ends (`_release`)
        job.reserved = True

    # ------------------------------------------------------------------ generation
    async def generate(job: _Job, every: int = 1) -> AsyncIterator[
            list[tuple[str, list[int], str | None]]]:
        """Per wake-up, what the engine's events since the last one make: a list of (text
        delta, token ids, finish_reason or None); the last item of the last list has a reason.
        (A list per wake-up, not an item per token: the stream sends it in one write.) `every`:
        see `_Inbox`."""
        loop = asyncio.get_running_loop()
        inbox = _Inbox(every)

        def sink(ev: Event) -> None:  # (the engine hands events over on this loop)
            inbox.put(ev)
            if ev.kind in FINAL:
                # its in-flight place is back once the batcher ended it, not once its client
                # read the end: a stream whose client stops reading held it for good
                _release(job)

        handle = Handle(job.prompt, job.max_tokens, job.eos, job.sampler, sink=sink,
                        prompt_logits=job.prompt_lp)
        text = IncrementalText(decoder(job), job.stop, job.context,
                               include_stop=job.include_stop,
                               min_tokens=job.sampling.min_tokens)
        t0 = last = time.perf_counter()
        n = 0
        metrics.prompt_tokens.inc(len(job.prompt))
        metrics.vllm_prompt_tokens.inc(len(job.prompt))
        if cfg.prefix_cache:  # (vLLM counts queries only with its prefix cache on)
            metrics.vllm_prefix_queries.inc(len(job.prompt))
        outcome = "aborted"  # unless it ends otherwise (a disconnect cancels us mid-wait)
        # one timer for the whole request, not a timeout scope around every wait for a token
        timer = None if settings.request_timeout is None else \
            loop.call_later(settings.request_timeout, inbox.expire)
        try:
            if job.after is not None:
                await job.after.wait()
            try:
                engine.submit(handle)
            except EngineStopped as exc:
                raise ApiError(503, str(exc), type_="server_error") from None
            while True:
                events = await inbox.take()
                if not events:  # (only the timer wakes it with none)
                    outcome = "timeout"
                    raise RequestTimedOut(f"the request did not finish within "
                                          f"{settings.request_timeout} s")
                out: list[tuple[str, list[int], str | None]] = []
                n0 = n
                try:
                    for ev in events:
                        if ev.kind == "token":
                            now = time.perf_counter()
                            if n:
                                metrics.next_token(now - last)
                            else:
                                metrics.first_token(now - t0)
                            last, n = now, n + 1
                            if ev.token in job.stop_ids or ev.token == job.eos:
                                # (its own text only with include_stop_str_in_output, as vLLM)
                                delta = text.add(ev.token) if job.include_stop else ""
                                outcome = "stop"
                                out.append((delta + text.finish(), [ev.token], "stop"))
                                yield out
                                return
                            delta = text.add(ev.token)
                            if text.stopped:
                                outcome = "stop"
                                out.append((delta, [ev.token], "stop"))
                                yield out
                                return
                            out.append((delta, [ev.token], None))
                        elif ev.kind == "finished":
                            last_tok = text.last
                            outcome = "stop" if job.eos is not None and last_tok == job.eos \
                                else "length"
                            out.append((text.finish(), [], outcome))
                            yield out
                            return
                        elif ev.kind in ("error", "aborted"):
                            if out:  # what it generated before still reaches the client
                                yield out
                            outcome = "error"
                            raise RequestFailed(ev.error or "the request was aborted")
                        # "preempted": it resumes where it stopped; nothing to tell the client
                finally:  # (once per wake-up, not per token: each inc takes a lock)
                    metrics.completion_tokens.inc(n - n0)
                    metrics.vllm_generation_tokens.inc(n - n0)
                if out:
                    yield out
        finally:
            if timer is not None:
                timer.cancel()
            _release(job)
            job.cached = hits.take(handle.rid)
            metrics.ended(outcome, time.perf_counter() - t0, len(job.prompt), n)
            if not handle.ended:
                engine.abort(handle)  # a disconnect, a stop string, a timeout: free its lane

    def decoder(job: _Job) -> Tokenizer:
        keep = getattr(tokenizer, "keeping_special", None)
        return tokenizer if job.skip_special or keep is None else keep()

    async def collect(job: _Job) -> tuple[str, list[int], str]:
        parts, ids, reason = [], [], "length"
        # nobody reads the tokens before the end unless a stop string or id may end it early
        every = 1 if job.stop or job.stop_ids else job.max_tokens + 1
        async for items in generate(job, every):
            for delta, toks, why in items:
                parts.append(delta)
                ids.extend(toks)
                if why is not None:
                    reason = why
        return "".join(parts), ids, reason

    async def collect_all(jobs: list[_Job]) -> list[tuple[str, list[int], str]]:
        tasks = [asyncio.create_task(collect(j)) for j in jobs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # (one failed: the others end, their lanes freed)
                t.cancel()

    async def until_disconnect(request: Request, jobs: list[_Job]
                               ) -> list[tuple[str, list[int], str]]:
        """`collect` of each job, cancelled (so their requests aborted) if the client goes
        away first."""
        task = asyncio.create_task(collect_all(jobs))
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                break
            if await request.is_disconnected():
                task.cancel()
                break
        try:
            return await task
        except asyncio.CancelledError:
            raise ApiError(499, "the client disconnected") from None
        except RequestTimedOut as exc:
            raise ApiError(504, str(exc), type_="timeout", code="timeout") from None
        except RequestFailed as exc:
            raise ApiError(500, f"the request failed: {exc}", type_="server_error") from None
        finally:
            for job in jobs:
                _release(job)  # (if the task was cancelled before it ever ran)

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    async def merged(jobs: list[_Job]) -> AsyncIterator[
            tuple[int, list[tuple[str, list[int], str | None]]]]:
        """(choice index, a wake-up's items) of several jobs' `generate`, as they come; a job's
        error ends them all (closing this ends them too)."""
        if len(jobs) == 1:
            async for items in generate(jobs[0], settings.stream_interval):
                yield 0, items
            return
        queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

        async def pump(i: int, job: _Job) -> None:
            try:
                async for items in generate(job, settings.stream_interval):
                    queue.put_nowait((i, items, None))
            except Exception as exc:  # noqa: BLE001 - handed to the stream
                queue.put_nowait((i, None, exc))
            else:
                queue.put_nowait((i, None, None))

        tasks = [asyncio.create_task(pump(i, j)) for i, j in enumerate(jobs)]
        try:
            left = len(jobs)
            while left:
                i, items, exc = await queue.get()
                if exc is not None:
                    raise exc
                if items is None:
                    left -= 1
                else:
                    yield i, items
        finally:
            for t in tasks:
                t.cancel()

    async def stream(jobs: list[_Job], make_chunk: Any, usage_at_end: bool,
                     first: list[dict[str, Any]], want_ids: bool, prompt_tokens: int,
                     logprobs: Any = None) -> AsyncIterator[str]:
        """The SSE body of `jobs` (choice i is jobs[i]): `first` chunks, then each token chunk,
        then usage (if asked) and [DONE]. `logprobs(i, records)`: a chunk's logprobs."""
        counts = [0] * len(jobs)
        # one plain choice: each chunk from the template (see _Frames)
        frame = _Frames(make_chunk) if len(jobs) == 1 and logprobs is None else None
        for obj in first:
            yield sse(obj)
        # (closed with the stream, not when collected: a stream cut mid-write aborts its
        # requests at once)
        gen = merged(jobs)
        try:
            async for i, items in gen:
                frames = []
                for delta, toks, why in items:
                    if jobs[i].prompt_only:  # (nothing to send until it ends)
                        if why is None:
                            continue
                        delta, toks = "", []
                    n0 = counts[i]
                    counts[i] += len(toks)
                    if frame is not None:
                        if delta or why is not None or (toks and want_ids):
                            frames.append(frame(delta, toks, why))
                        continue
                    lp = None if logprobs is None else \
                        logprobs(i, jobs[i].sampler.records[n0:counts[i]])
                    if delta or why is not None or (toks and (want_ids or lp)):
                        frames.append(sse(make_chunk(delta, toks, why, index=i, lp=lp)))
                if frames:  # one body write for all of a wake-up's chunks
                    yield "".join(frames)
        except RequestTimedOut as exc:
            yield sse({"error": {"message": str(exc), "type": "timeout", "param": None,
                                 "code": "timeout"}})
        except RequestFailed as exc:
            yield sse({"error": {"message": f"the request failed: {exc}", "type":
                                 "server_error", "param": None, "code": None}})
        except ApiError as exc:  # (the engine stopped between admission and submission)
            yield sse({"error": {"message": exc.message, "type": exc.type, "param": exc.param,
                                 "code": exc.code}})
        except Exception as exc:  # noqa: BLE001 - a bug of ours, after the response started
            # the status line is out: only the stream can still tell the client, which would
            # otherwise see a connection cut mid-body (no error, no [DONE]) and maybe retry
            log.exception("unexpected error in a stream")
            yield sse({"error": {"message": f"internal error: {type(exc).__name__}: "
                                            f"{str(exc)[:200]}", "type": "server_error",
                                 "param": None, "code": None}})
        finally:
            await gen.aclose()
        if usage_at_end:
            yield sse(make_chunk(None, [], None, usage=_usage(prompt_tokens, sum(counts),
                                                              _cached(jobs))))
        yield "data: [DONE]\n\n"

    def _admit_all(jobs: list[_Job]) -> None:
        try:
            for job in jobs:
                _admit(job)
        except ApiError:
            for job in jobs:
                _release(job)
            raise

    def _copies(jobs: list[_Job], n: int) -> None:
        """n > 1: the copies of a prompt share its KV. A block has one owner at a time (a lane
        or the prefix cache: the proved model), and a lane's blocks enter the cache when its
        request ends; so the prompt is first prefilled alone (a request of one token, which
        ends at once), then every copy starts from its cached chunks instead of computing
        them again (vllm:prefix_cache_hits shows it). Only for a prompt longer than a chunk
        (a hit reuses whole chunks). Called once the jobs are admitted."""
        if n < 2 or not cfg.prefix_cache:
            return
        for i in range(0, len(jobs), n):
            # (a copy that wants its prompt's logprobs takes no hit: it computes its prompt)
            if len(jobs[i].prompt) <= cfg.prefill_chunk or jobs[i].prompt_lp is not None:
                continue
            done = asyncio.Event()
            warm = Handle(jobs[i].prompt, 1, None, None, sink=lambda _ev: None)

            def sink(ev: Event, done: asyncio.Event = done, warm: Handle = warm) -> None:
                if ev.kind in FINAL:
                    hits.take(warm.rid)  # (its own hits, if any, are no client's)
                    done.set()

            warm.sink = sink
            try:
                engine.submit(warm)
            except EngineStopped:
                continue  # (each copy then says so itself)
            for job in jobs[i:i + n]:
                job.after = done

    def _envelope(rid: str, obj: str, created: int, choices: list[dict[str, Any]],
                  usage: dict[str, int] | None = None) -> dict[str, Any]:
        """An OpenAI response or stream chunk around `choices`."""
        out = {"id": rid, "object": obj, "created": created, "model": settings.model_name,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def _usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _cached(jobs: list[_Job]) -> int:
        """The prompts' tokens served from the cache: per prompt its copies' largest."""
        out: dict[int, int] = {}
        for job in jobs:
            out[id(job.prompt)] = max(out.get(id(job.prompt), 0), job.cached)
        return sum(out.values())

    # ------------------------------------------------------------------ /v1/completions
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _check_common(body)
        _check_logprobs(body.logprobs, "logprobs")
        # echo with logprobs: each prompt token's logprob given the ones before it (vLLM's
        # prompt_logprobs, with logprobs' k), from the prefill calls that fill its KV
        prompt_lps = body.echo and body.logprobs is not None
        if prompt_lps and not engine.batcher.capabilities.prompt_logits:
            raise ApiError(400, "echo with logprobs: the prompt's log-probabilities need the "
                                "logits of every prompt position, and this server's runtime "
                                "returns a prefill's last position's only (RBLN's compiled "
                                "prefill graph outputs [1, 1, V]): send echo or logprobs, not "
                                "both", "echo")
        p = body.prompt
        prompts = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        ids = [tokenizer.encode(x) if isinstance(x, str) else [int(t) for t in x]
               for x in prompts]
        jobs = []
        for prompt in ids:
            for copy in range(body.n):
                job = _job(body, prompt, body.max_tokens or 1 if body.max_tokens is not None
                           else min(16, cfg.max_seq_len - len(prompt) + 1), "prompt",
                           body.logprobs, copy)
                job.context, job.prompt_only = prompt, body.max_tokens == 0
                if prompt_lps:
                    job.prompt_lp = PromptLogprobs(prompt, body.logprobs or 0)
                jobs.append(job)
        # echo: the prompt's text before each choice's (as given, or its ids' decode)
        echo = [x if isinstance(x, str) else tokenizer.decode(i)
                for x, i in zip(prompts, ids, strict=True) for _ in range(body.n)] \
            if body.echo else None
        _admit_all(jobs)
        _copies(jobs, body.n)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        n_prompt = sum(map(len, ids))
        offsets = [CompletionLogprobs(tokenizer, body.logprobs or 0) for _ in jobs]

        def chunk(text: str | None, toks: list[int], why: str | None,
                  usage: dict[str, int] | None = None, index: int = 0,
                  lp: dict[str, Any] | None = None) -> dict[str, Any]:
            choices = [] if text is None else [{
                "index": index, "text": text, "logprobs": lp, "finish_reason": why,
                **({"token_ids": toks} if body.return_token_ids else {})}]
            return _envelope(rid, "text_completion", created, choices, usage)

        echoed = EchoLogprobs(offsets, [j.prompt for j in jobs],
                              [j.prompt_lp.records for j in jobs if j.prompt_lp is not None],
                              echo or []) if prompt_lps else None
        lps = None if body.logprobs is None else echoed.logprobs if echoed is not None \
            else (lambda i, recs: offsets[i].part(recs))
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)

            def stream_chunk(text: str | None, toks: list[int], why: str | None,
                             usage: dict[str, int] | None = None, index: int = 0,
                             lp: dict[str, Any] | None = None) -> dict[str, Any]:
                if text is not None and echoed is not None:  # (its first chunk: the prompt's)
                    text = echoed.text(index, text)
                return chunk(text, toks, why, usage, index, lp)

            first = [] if prompt_lps else \
                [chunk(e, [], None, index=i) for i, e in enumerate(echo or [])]
            return _Stream(stream(jobs, stream_chunk, usage, first, body.return_token_ids,
                                  n_prompt, lps), lambda: [_release(j) for j in jobs],
                           settings.request_timeout)
        out = [("", [], x[2]) if j.prompt_only else x
               for j, x in zip(jobs, await until_disconnect(request, jobs), strict=True)]
        choices = [chunk((echo[i] if echo else "") + text, toks, why, index=i,
                         lp=None if lps is None else lps(i, jobs[i].sampler.records[:len(toks)])
                         )["choices"][0] for i, (text, toks, why) in enumerate(out)]
        return _envelope(rid, "text_completion", created, choices,
                         _usage(n_prompt, sum(len(t) for _, t, _ in out), _cached(jobs)))

    # ------------------------------------------------------------------ /v1/chat/completions
    # whether the model's chat template renders a list of content parts itself (multimodal
    # models' templates do: Gemma 3's, Llama 4's, Qwen2-VL's)
    takes_parts = bool(getattr(tokenizer, "takes_content_parts", False))

    def _content(content: str | list[Any]) -> str | list[dict[str, str]]:
        """A message's content for the chat template. Text parts go to a template that takes
        parts as they came, so the model's own template joins them; for one that takes a string
        (and the plain layout) they are joined with a newline, as servers that flatten parts for
        such templates do (vLLM, TensorRT-LLM): "" ran two parts' words together."""
        if isinstance(content, str):
            return content
        if takes_parts:
            return [{"type": "text", "text": part.text} for part in content]
        return "\n".join(part.text for part in content)

    def _message(m: Any) -> dict[str, Any]:
        """A message as the chat template sees it: `name` only when given, so a template that
        tests for the key (not its value) sees the message as before."""
        out = {"role": m.role, "content": _content(m.content)}
        if m.name is not None:
            out["name"] = m.name
        return out

    vllm_routes.register(app, tokenizer, settings.model_name, cfg.max_seq_len, vocab, _message)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        _check_common(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if body.max_completion_tokens is not None and body.max_tokens is not None and \
                body.max_tokens != body.max_completion_tokens:
            raise ApiError(400, f"max_completion_tokens ({body.max_completion_tokens}) and "
                                f"max_tokens ({body.max_tokens}) disagree: send one of them "
                                "(max_tokens is the older name of max_completion_tokens)",
                           "max_completion_tokens")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: only with logprobs=true", "top_logprobs")
        _check_logprobs(body.top_logprobs, "top_logprobs")
        k = (body.top_logprobs or 0) if body.logprobs else None
        messages = [_message(m) for m in body.messages]
        try:
            prompt = tokenizer.chat(messages)
        except ChatTemplateError as exc:
            raise ApiError(400, f"messages: {exc}", "messages") from None
        jobs = [_job(body, prompt, max_tokens, "messages", k, copy) for copy in range(body.n)]
        _admit_all(jobs)
        _copies(jobs, body.n)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        lps = None if k is None else (lambda i, recs: chat_logprobs(tokenizer, recs, k))

        def chunk(text: str | None, toks: list[int], why: str | None,
                  usage: dict[str, int] | None = None, index: int = 0,
                  lp: dict[str, Any] | None = None) -> dict[str, Any]:
            choices = [] if text is None else [{
                "index": index, "delta": {"content": text}, "logprobs": lp,
                "finish_reason": why, **({"token_ids": toks} if body.return_token_ids else {})}]
            return _envelope(rid, "chat.completion.chunk", created, choices, usage)

        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            first = [_envelope(rid, "chat.completion.chunk", created, [{
                "index": i, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}]) for i in range(body.n)]
            return _Stream(stream(jobs, chunk, usage, first, body.return_token_ids,
                                  len(prompt), lps), lambda: [_release(j) for j in jobs],
                           settings.request_timeout)
        out = await until_disconnect(request, jobs)
        return _envelope(rid, "chat.completion", created, [
            {"index": i, "message": {"role": "assistant", "content": text},
             "logprobs": None if lps is None else lps(i, jobs[i].sampler.records[:len(toks)]),
             "finish_reason": why, **({"token_ids": toks} if body.return_token_ids else {})}
            for i, (text, toks, why) in enumerate(out)],
            _usage(len(prompt), sum(len(t) for _, t, _ in out), _cached(jobs)))

    return app
