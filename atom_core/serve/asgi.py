"""Under the routes: what every request meets before and around its endpoint.

The OpenAI error shape (`ApiError`, `error_response`) and the handler of errors nobody else
took (`Unexpected`); the API key and the body bound, checked before the body is read
(`Guard`); the total parse of a JSON body (`TotalRoute`, over `protocol.parse_body`); the
helpers that word a validation error; and the app noting each connection's transport (`App`).
Apart from the routes (app.py) because none of it knows an endpoint: it is what any endpoint
added later gets as it is.
"""

from __future__ import annotations

import email.message
import hmac
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from atom_core.serve.protocol import BodyError, parse_body

# (the name these errors were always logged under: log settings select it)
log = logging.getLogger("atom_core.serve.app")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = \
            status, message, param, type_, code


class _ErrorResponse(JSONResponse):
    """An error's JSON, whatever its text holds: a message quoting a client's text with a lone
    surrogate in it (which UTF-8 cannot encode) goes out escaped, not as a 500 of its own."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, param: str | None = None,
                   type_: str = "invalid_request_error", code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return _ErrorResponse({"error": {"message": message, "type": type_, "param": param,
                                     "code": code}}, status_code=status, headers=headers)


class Unexpected:
    """An exception no handler took (a bug of ours): the client still gets the API's error
    shape, a 500 its SDK raises as InternalServerError, on a connection that stays usable; the
    log gets the traceback. (Starlette's own handler for Exception answers, then re-raises, and
    uvicorn then resets the connection.) After a response started, only the log can tell."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:  # noqa: BLE001 - the one place every other error ends
            log.exception("unexpected error serving %s", scope.get("path"))
            if not started:
                await error_response(500, f"internal error: {type(exc).__name__}: "
                                          f"{str(exc)[:200]}",
                                     type_="server_error")(scope, receive, send)


# paths anyone may call: a load balancer's probe; and vLLM's paths outside /v1, which vLLM
# serves without its API key and vLLM's clients call without one (its serving benchmark's
# /tokenize): the server's version and the tokenizer's work, no request's data (the /v1/
# tokenize and /v1/detokenize routes keep the key)
_OPEN_PATHS = frozenset({"/health", "/version", "/tokenize", "/detokenize"})


def location(error: Any) -> list[str]:
    """A validation error's location in the request body, as text."""
    return [str(x) for x in error.get("loc", ()) if x != "body"]


def is_type_label(part: str) -> bool:
    """A union member's name in a validation error's location ("str", "list[int]")."""
    return "[" in part or part in ("str", "int", "float", "bool")


JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def is_json(content_type: str) -> bool:
    """Whether FastAPI parses a body of this Content-Type as JSON (none: it does not), decided
    as FastAPI decides it, so `TotalRoute` parses first exactly the bodies FastAPI would."""
    if not content_type:
        return False
    header = email.message.Message()
    header["content-type"] = content_type
    subtype = header.get_content_subtype()
    return header.get_content_maintype() == "application" and \
        (subtype == "json" or subtype.endswith("+json"))


class TotalRequest(Request):
    """A request whose JSON is `parse_body`'s: FastAPI's own parse (json.loads) takes a lone
    surrogate, NaN and 1e999 as values, and answers invalid UTF-8, deep nesting or a
    5000-digit integer with a bare 400 that says nothing of where."""

    async def json(self) -> Any:
        if not hasattr(self, "_total"):
            try:
                self._total = parse_body(await self.body())
            except BodyError as exc:
                raise ApiError(400, exc.message, exc.param, code="invalid_body") from None
        return self._total


class TotalRoute(APIRoute):
    """A route whose body is parsed by `TotalRequest`, before FastAPI reads it: its errors are
    the route's to answer (inside FastAPI's read, any error but a JSONDecodeError becomes that
    bare 400)."""

    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()
        if self.body_field is None:  # (a GET: a body it is sent means nothing to it)
            return handler

        async def total(request: Request) -> Response:
            request = TotalRequest(request.scope, request.receive)
            # (an empty body is FastAPI's to report: "the request body is empty")
            if is_json(request.headers.get("content-type", "")) and await request.body():
                await request.json()
            return await handler(request)

        return total


class _BodyTooLarge(Exception):
    pass


class Guard:
    """The API key and the body bound, checked before anything reads the body: a route's body is
    read and parsed before its dependencies run, so a check there let a client without the key
    have a malformed body answered (400, not 401) and have any body, however large, read into
    memory. A body within the bound is read here and handed on to the app as it came."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.key, self.limit = app, api_key, max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        if self.key is not None and scope["path"] not in _OPEN_PATHS and \
                not self._authorized(headers.get(b"authorization", b"")):
            await error_response(401, "missing or wrong API key: send 'Authorization: Bearer "
                                      "<key>' with the key the server was started with",
                                 code="invalid_api_key")(scope, receive, send)
            return
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0  # (the HTTP parser refuses a malformed length before we see it)
        try:
            if declared > self.limit:
                raise _BodyTooLarge
            body, more = await self._read(receive)
        except _BodyTooLarge:
            await self._too_large(scope, receive, send)
            return
        if not more:  # the client left while sending it
            return
        await self.app(scope, self._replay(body, receive), send)

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("latin-1"), self.key.encode())  # type: ignore[union-attr]

    async def _read(self, receive: Any) -> tuple[bytes, bool]:
        """(the whole body, True), or (_, False) when the client disconnected first; past the
        bound (a chunked body declares no length) `_BodyTooLarge`."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", False
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                raise _BodyTooLarge
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts), True

    @staticmethod
    def _replay(body: bytes, receive: Any) -> Any:
        """The body as one message, then the client's own messages (a disconnect)."""
        sent = False

        async def replay() -> Any:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return replay

    async def _too_large(self, scope: Any, receive: Any, send: Any) -> None:
        await error_response(413, f"the request body is larger than this server takes "
                                  f"({self.limit} bytes, --max-body-bytes): send a shorter "
                                  "prompt or fewer messages",
                             code="request_too_large")(scope, receive, send)


# where `App` puts the connection's transport in the scope (uvicorn's only)
TRANSPORT = "atom_core.transport"


class App(FastAPI):
    """The app, noting each HTTP connection's transport in its scope: the one handle that can
    drop a connection whose client stopped reading. ASGI has no way to: an app that returns
    mid-response has uvicorn *close* the transport, which waits for the client to read what is
    buffered, i.e. for ever. (uvicorn's `send` is a method of the connection's request cycle,
    which holds the transport; under another server there is none, and that close is all.)"""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            cycle = getattr(send, "__self__", None)
            scope[TRANSPORT] = getattr(cycle, "transport", None)
        await super().__call__(scope, receive, send)
