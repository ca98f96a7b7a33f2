"""A response's stream: the SSE response that bounds its sending (`_Stream`), the inbox a
request's events wait in on the event loop (`_Inbox`) and the template its token chunks are
rendered from (`_Frames`). Apart from the routes (app.py), which use them."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from atom_core.batcher import Event
from atom_core.serve.asgi import TRANSPORT

# (the name these were always logged under: log settings select it)
log = logging.getLogger("atom_core.serve.app")


# How long past its request's deadline a stream may still take to send its end (the timeout's
# error event and [DONE]: a client that reads gets them in far less); past that its client is
# not reading, and the connection is dropped. (main.py's --request-timeout help names it.)
SEND_GRACE = 1.0


class _Stream(StreamingResponse):
    """An SSE response that gives its request's in-flight place back however it ends, even when
    the client left before the body was ever iterated. With a `timeout`, sending is bounded
    too: a write the client does not read blocks the stream, where the request's own timer
    cannot see it, so past `timeout` + SEND_GRACE the stream stops and its connection is
    dropped (with what it buffered): a client that stops reading holds nothing of the server's
    past its request's deadline."""

    def __init__(self, body: AsyncIterator[str], release: Any,
                 timeout: float | None = None) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._release = release
        self._timeout = timeout

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            if self._timeout is None:
                await super().__call__(scope, receive, send)
                return
            deadline = asyncio.timeout(self._timeout + SEND_GRACE)
            try:
                async with deadline:
                    await super().__call__(scope, receive, send)
            except TimeoutError:
                if not deadline.expired():
                    raise
                await self._cut(scope)
        finally:
            self._release()

    async def _cut(self, scope: Any) -> None:
        log.warning("a stream's client read nothing past its request's deadline: dropping "
                    "the connection")
        # (ends the request in the engine, if it still runs: `generate` aborts it on close)
        await self.body_iterator.aclose()  # type: ignore[attr-defined]
        transport = scope.get(TRANSPORT)
        if transport is not None:
            transport.abort()  # (close() would wait for the client to read the buffer)


class _Inbox:
    """One request's events on the event loop. The engine's fan-out appends and wakes the one
    reader, which takes everything that arrived at once: one future per wake-up (an
    asyncio.Queue costs a get per event); the request's timer wakes it with nothing. With
    `every` > 1 tokens wake the reader only at the first and then every `every`-th (anything
    else at once): a reader that sends each wake-up in one write sends 1/`every` as many."""

    __slots__ = ("events", "expired", "_waiter", "_every", "_due", "_first")

    def __init__(self, every: int = 1) -> None:
        self.events: list[Event] = []
        self.expired = False
        self._waiter: asyncio.Future[None] | None = None
        self._every = every
        self._due = False  # the reader has something to take
        self._first = True  # no token yet: the first goes out at once (time to first token)

    def put(self, ev: Event) -> None:
        self.events.append(ev)
        if ev.kind != "token" or self._first or len(self.events) >= self._every:
            self._first = False
            self._due = True
            self._wake()

    def expire(self) -> None:
        self.expired = True
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def take(self) -> list[Event]:
        """The events since the last call (waiting for one); [] once the timer expired."""
        while not self._due and not self.expired:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        out, self.events, self._due = self.events, [], False
        return out


_SLOTS = {"text": "\x00atom-text", "why": "\x00atom-why", "ids": "\x00atom-ids"}


class _Frames:
    """The SSE frame of a stream's token chunk, from a template: `make_chunk`'s JSON is
    rendered once with markers where the text, finish_reason and token ids go, so a token costs
    one string escape and a `str.format` instead of encoding the whole envelope again. The
    frames are the very text `sse(make_chunk(...))` gives (tests check it)."""

    def __init__(self, make_chunk: Any) -> None:
        marked = json.dumps(make_chunk(_SLOTS["text"], _SLOTS["ids"], _SLOTS["why"]),
                            separators=(",", ":"))
        template = f"data: {marked}\n\n".replace("{", "{{").replace("}", "}}")
        # the markers encode as "\u0000atom-..." (a NUL never appears in a model name or id)
        for name, mark in _SLOTS.items():
            template = template.replace(json.dumps(mark), "{" + name + "}")
        self._format = template.format
        self._ids = "{ids}" in template

    def __call__(self, text: str, toks: list[int], why: str | None) -> str:
        ids = "[" + ",".join(map(str, toks)) + "]" if self._ids else ""
        return self._format(text=json.dumps(text), why=_WHY.get(why) or json.dumps(why),
                            ids=ids)


_WHY = {None: "null", "stop": '"stop"', "length": '"length"'}
