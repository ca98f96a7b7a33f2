"""Request bodies of the OpenAI endpoints (pydantic). A field this server does not know is a
400 naming it (extra="forbid"), so a client never silently loses a parameter it relies on.
Values have their JSON types (strict): `true` is no token id or token count and "3" no number.
A null means "not given", as in OpenAI's schema, where the optional parameters are nullable
(clients send `"temperature": null` or `"tools": null` for "not set"): a known parameter's null
is its default and an unknown one's is dropped; only a required parameter's null is an error.
A value the API defines as "nothing asked" (`logit_bias: {}`, `response_format: {"type":
"text"}`, `best_of: 1`) is dropped as its null is; any other value of a parameter this server
does not implement is a 400 that says so (`UNSUPPORTED`)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

# OpenAI parameters this server does not implement: what its 400 says beyond the name
_LEAVE_OUT = "not supported by this server: leave it out (or send null)"
UNSUPPORTED = {
    **dict.fromkeys(("tools", "tool_choice", "parallel_tool_calls", "functions",
                     "function_call"),
                    "tool and function calling is " + _LEAVE_OUT),
    "response_format": "structured output is " + _LEAVE_OUT.replace(
        "leave it out", 'leave it out, or send {"type": "text"}'),
    "logit_bias": "logit bias is " + _LEAVE_OUT.replace("leave it out", "leave it out, or "
                                                                          "send {}"),
    "best_of": "only best_of=1 (the default) is supported: leave it out",
    "suffix": "inserting before a suffix is " + _LEAVE_OUT,
    **dict.fromkeys(("modalities", "audio"), "this server's models answer in text only: leave "
                                             "it out"),
    "messages": "/v1/completions takes a `prompt`: send `messages` to /v1/chat/completions",
    "prompt": "/v1/chat/completions takes `messages`: send a `prompt` to /v1/completions",
}
GENERIC_UNSUPPORTED = "this parameter is " + _LEAVE_OUT


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # parameter -> the value that asks for nothing (dropped, as a null is)
    _NOTHING: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        # (a required field's null stays an error)
        if not isinstance(data, dict):
            return data
        fields, nothing = cls.model_fields, cls._NOTHING
        return {k: v for k, v in data.items()
                if (v is not None or (k in fields and fields[k].is_required()))
                and not (k in nothing and k not in fields and v == nothing[k])}


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: off
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # the generated token ids in each choice (`token_ids`), as vLLM's return_token_ids does
    return_token_ids: bool = False


class CompletionRequest(_Sampling):
    _NOTHING: ClassVar[dict[str, Any]] = {"logit_bias": {}, "best_of": 1}

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    # the author's name (OpenAI's, on any role): chat templates that render it get it
    name: str | None = None

    @field_validator("name", mode="before")
    @classmethod
    def _name_is_text(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, str):
            raise PydanticCustomError(
                "name_type", "a message's name must be a string (its author's name), not "
                             "{kind}: send it as a string or leave it out",
                {"kind": type(v).__name__})
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        """A clear 400 for what a text-only server cannot take, before the union's own
        ('must be one of: str, list[TextPart]') says nothing of why."""
        if v is None:
            raise PydanticCustomError(
                "content_null", "null content (an assistant message that only calls tools) is "
                                "not supported, as tool calling is not: send the message's "
                                "text")
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise PydanticCustomError(
                        "content_part", "part {i} is of type '{kind}': this server takes text "
                                        "only; send only text parts ({\"type\": \"text\", "
                                        "\"text\": ...}) or the content as a string",
                        {"i": i, "kind": kind[:40]})
        return v


class ChatRequest(_Sampling):
    _NOTHING: ClassVar[dict[str, Any]] = {"logit_bias": {}, "response_format": {"type": "text"}}

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
