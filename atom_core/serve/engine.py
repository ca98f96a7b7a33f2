"""The engine loop: one thread owns the AtomBatcher; nothing else touches it.

Clients talk to it through `submit` and `abort` (thread-safe: they put commands on a queue);
the thread applies the commands between steps, steps while anything is busy, and hands each
event to its request's `sink`. The HTTP server sets `deliver`, so that a step's events cross to
the event loop in one call, where each sink puts its event in its request's inbox. A request
that ended (finished, failed or aborted) gets exactly one final event. A batcher bug (an
exception out of `step`, a BaseException such as SystemExit included) fails every request in
flight and stops the engine: `/health` then says so. A command that races the engine's end (a
`submit` or `call` just as it stops) is still answered: both check `running` and queue their
command under one lock, which the thread takes to clear `running` before it drains the queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import attrs

from atom_core.batcher import AtomBatcher, Event

log = logging.getLogger(__name__)

# the kinds of the one final event each request gets (aborted: the engine's own, for requests
# it ends without the batcher)
FINAL = frozenset(("finished", "error", "aborted"))

Sink = Callable[[Event], None]
# hands a batch of (request, event) pairs to the clients' side at once; None: each event goes
# to its request's sink from the engine thread
Deliver = Callable[[list[tuple["Handle", Event]]], None]


@attrs.define(eq=False)
class Handle:
    """One client's request as the engine knows it; `rid` once the batcher accepted it."""

    prompt: list[int]
    max_new_tokens: int
    eos_token_id: int | None
    sampler: Any
    sink: Sink
    rid: int | None = None
    ended: bool = False
    # the batcher's `prompt_logits` hook (`sampling.PromptLogprobs`: echo with logprobs), or None
    prompt_logits: Any = None


class EngineStopped(RuntimeError):
    """The engine is not running (shut down, or stopped by a failure)."""


class Engine:
    def __init__(self, batcher: AtomBatcher, *, idle_wait: float = 0.05,
                 deliver: Deliver | None = None) -> None:
        self.batcher = batcher
        # the HTTP server sets this to one call_soon_threadsafe per step (not one per token):
        # fewer wake-ups of the event loop, each taking the GIL from the engine
        self.deliver = deliver
        self._out: list[tuple[Handle, Event]] = []
        self._cmds: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._live: dict[int, Handle] = {}
        self._idle_wait = idle_wait
        self._thread: threading.Thread | None = None
        # held to check `running` and queue a command at once (`submit`, `call`) and by the
        # thread to clear `running`: a command queued while it still ran is drained after
        self._gate = threading.Lock()
        self.failure: str | None = None  # why the engine stopped on its own
        self.running = False
        self.steps = 0
        # CPU seconds of the engine thread inside `batcher.step` (the batcher's and the model's
        # own work): the rest of the process's CPU is what serving costs on top of it
        self.step_cpu = 0.0
        # wall seconds inside `batcher.step`: beyond step_cpu, the step waited (for the GIL,
        # which the server's event loop holds between the runtime's kernels, or for a core)
        self.step_wall = 0.0

    # ------------------------------------------------------------------ client side
    def start(self) -> None:
        self.running = True
        self._thread = threading.Thread(target=self._loop, name="atom-core-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every request in flight (each gets its final event) and end the thread."""
        if self._thread is None:
            return
        self._cmds.put(("stop", None))
        self._thread.join(timeout)
        self.running = False

    def submit(self, handle: Handle) -> Handle:
        with self._gate:
            if not self.running:
                raise EngineStopped(self.failure or "the engine is shut down")
            self._cmds.put(("submit", handle))
        return handle

    def abort(self, handle: Handle) -> None:
        """End the request early (its lane and blocks are freed); harmless once it ended."""
        if self.running:
            self._cmds.put(("abort", handle))

    def call(self, fn: Callable[[AtomBatcher], Any], timeout: float = 10.0) -> Any:
        """Run `fn(batcher)` on the engine thread between steps (a consistent view)."""
        fut: Future[Any] = Future()
        with self._gate:
            queued = self.running
            if queued:
                self._cmds.put(("call", (fn, fut)))
        if not queued:
            return fn(self.batcher)  # nothing steps any more
        return fut.result(timeout)

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        try:
            while True:
                wait = not self.batcher.busy()
                try:
                    while True:
                        cmd = self._cmds.get(timeout=self._idle_wait) if wait \
                            else self._cmds.get_nowait()
                        wait = False
                        if cmd[0] == "stop":
                            self._abort_all("the server is shutting down")
                            self._flush()
                            return
                        self._apply(*cmd)
                except queue.Empty:
                    pass
                # the commands' own events (an abort's end, a refused submit) go out now: held
                # for the step's, they waited a whole step (a prefill chunk, a slow decode)
                self._flush()
                if self.batcher.busy():
                    # (the wall span holds the CPU span: step_wall >= step_cpu)
                    w0 = time.perf_counter()
                    c0 = time.thread_time()
                    events = self.batcher.step()
                    self.step_cpu += time.thread_time() - c0
                    self.step_wall += time.perf_counter() - w0
                    self.steps += 1
                    for ev in events:
                        self._deliver(ev)
                self._flush()
        except BaseException as exc:  # noqa: BLE001 - a bug in the batcher or the core
            # (BaseException too: a SystemExit or KeyboardInterrupt out of a runtime call, which
            # the batcher re-raises, left every request in flight without an end)
            log.error("the engine stopped: %r", exc, exc_info=exc)
            self.failure = f"engine stopped: {exc!r}"
            self._abort_all(self.failure, abort_in_batcher=False)
        finally:
            try:
                self._flush()
            finally:
                with self._gate:  # no submit or call is queued after this
                    self.running = False
                self._drain_after_stop()

    def _apply(self, kind: str, arg: Any) -> None:
        if kind == "submit":
            h: Handle = arg
            try:
                h.rid = self.batcher.submit(h.prompt, h.max_new_tokens, h.eos_token_id,
                                            sampler=h.sampler, prompt_logits=h.prompt_logits)
            except ValueError as exc:  # the HTTP layer validates first; this is a backstop
                h.ended = True
                self._emit(h, Event("error", -1, error=str(exc)))
                return
            self._live[h.rid] = h
        elif kind == "abort":
            h = arg
            if h.rid is not None and not h.ended and self.batcher.abort(h.rid):
                self._end(h, Event("aborted", h.rid))
        elif kind == "call":
            fn, fut = arg
            try:
                fut.set_result(fn(self.batcher))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    def _deliver(self, ev: Event) -> None:
        h = self._live.get(ev.request_id)
        if h is None:
            return
        if ev.kind in FINAL:
            self._end(h, ev)
        else:  # token, preempted
            self._emit(h, ev)

    def _end(self, h: Handle, ev: Event) -> None:
        h.ended = True
        self._live.pop(h.rid, None)  # type: ignore[arg-type]
        self._emit(h, ev)

    def _emit(self, h: Handle, ev: Event) -> None:
        self._out.append((h, ev))

    def _flush(self) -> None:
        if not self._out:
            return
        out, self._out = self._out, []
        if self.deliver is not None:
            self.deliver(out)
        else:
            for h, ev in out:
                h.sink(ev)

    def _abort_all(self, why: str, abort_in_batcher: bool = True) -> None:
        for h in list(self._live.values()):
            if abort_in_batcher:
                try:
                    self.batcher.abort(h.rid)  # type: ignore[arg-type]
                except Exception:  # noqa: BLE001, S110 - ending anyway
                    pass
            self._end(h, Event("error", h.rid, error=why))  # type: ignore[arg-type]

    def _drain_after_stop(self) -> None:
        """Commands that raced with the stop: their requests end at once."""
        while True:
            try:
                kind, arg = self._cmds.get_nowait()
            except queue.Empty:
                return
            if kind == "submit" and not arg.ended:
                arg.ended = True
                self._emit(arg, Event("error", -1,
                                      error=self.failure or "the server is shutting down"))
                self._flush()
            elif kind == "call":
                fn, fut = arg
                try:
                    fut.set_result(fn(self.batcher))
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)
