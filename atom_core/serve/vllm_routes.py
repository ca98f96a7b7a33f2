"""The endpoints vLLM's server has beside the OpenAI ones, which vLLM's own clients and tools
call: /version, /v1/tokenize and /v1/detokenize (also without /v1, as vLLM serves them), and
the model card's `created` (the server's start) and `max_model_len` (/v1/models, app.py)."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import FastAPI

from atom_core.serve.asgi import ApiError
from atom_core.serve.protocol import DetokenizeRequest, TokenizeRequest
from atom_core.serve.tokenizer import ChatTemplateError, Tokenizer


def version() -> str:
    try:
        return importlib.metadata.version("atom-core")
    except importlib.metadata.PackageNotFoundError:  # (a source tree that was not installed)
        return "unknown"


def encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """`text`'s ids, without the tokenizer's special tokens (BOS) when asked."""
    if not add_special_tokens and hasattr(tokenizer, "encode_plain"):
        return list(tokenizer.encode_plain(text))
    return tokenizer.encode(text)


def register(app: FastAPI, tokenizer: Tokenizer, model_name: str, max_model_len: int,
             vocab: int | None, message: Any) -> None:
    """Add the routes; `message` turns a chat message into the template's dict (app.py's)."""

    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            raise ApiError(404, f"model '{model[:200]}' does not exist; this server serves "
                                f"'{model_name}' (GET /v1/models)", "model",
                           code="model_not_found")

    @app.get("/version")
    async def version_endpoint() -> dict[str, str]:
        return {"version": version()}

    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if body.messages is not None:
            if not body.add_generation_prompt:
                raise ApiError(400, "add_generation_prompt: only true (the default): the chat "
                                    "template renders the reply's start", "add_generation_prompt")
            try:
                ids = tokenizer.chat([message(m) for m in body.messages])
            except ChatTemplateError as exc:
                raise ApiError(400, f"messages: {exc}", "messages") from None
        else:
            assert body.prompt is not None
            ids = encode(tokenizer, body.prompt, body.add_special_tokens)
        strs = [tokenizer.decode([i]) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                "token_strs": strs}

    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        check_model(body.model)
        if vocab is not None and not all(0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"tokens: ids must be in 0..{vocab - 1}", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    for prefix in ("/v1", ""):
        app.post(prefix + "/tokenize")(tokenize)
        app.post(prefix + "/detokenize")(detokenize)
