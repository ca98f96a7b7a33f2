"""Request bodies of the OpenAI endpoints (pydantic). A field this server does not know is a
400 naming it (extra="forbid"), so a client never silently loses a parameter it relies on.
Values have their JSON types (strict): `true` is no token id or token count and "3" no number.
A null means "not given", as in OpenAI's schema, where the optional parameters are nullable
(clients send `"temperature": null` or `"tools": null` for "not set"): a known parameter's null
is its default and an unknown one's is dropped; only a required parameter's null is an error.
A value the API defines as "nothing asked" (`logit_bias: {}`, `response_format: {"type":
"text"}`, `best_of: 1`) is dropped as its null is; any other value of a parameter this server
does not implement is a 400 that says so (`UNSUPPORTED`).

A body is parsed by `parse_body`, which takes any bytes: what is not JSON text a request could
mean (not UTF-8, a lone surrogate, nesting or a number past any request's) is a `BodyError`
naming where it is, never an exception from deeper down (an encoder's, a recursion's): the
reading is `atom_core.jsonvalue`'s, shared with every other reader of outside JSON."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from atom_core import jsonvalue

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
# the most choices a request may ask for (n)
MAX_N = 128
# (log-probabilities per token: the server's --max-logprobs, checked by the app, main.py)

# A request is a few levels deep (messages.0.content.0.text); past this it is no request, and
# the validation and error reporting after the parse need not be recursion-safe for it.
MAX_DEPTH = 64
# The largest integer any parameter takes is a seed below 2**63 (19 digits); a longer literal
# is refused as it is parsed, before Python's int() spends quadratic time on it (or refuses
# one past 4300 digits with a ValueError that names no parameter).
MAX_DIGITS = 20

# every string Unicode text (no lone surrogate, which no encoder takes later), every number
# finite, a leading BOM dropped as json.loads of bytes does
_BODY = jsonvalue.Reader(max_depth=MAX_DEPTH, max_digits=MAX_DIGITS)


class BodyError(ValueError):
    """A body that is no JSON a request could be: `message` says what and where; `param` is
    the top-level parameter it is in, if any."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def _why(flaw: jsonvalue.JsonFlaw) -> str:
    """What is wrong with a value in the body, in a client's words (`flaw.where` says where)."""
    if isinstance(flaw, jsonvalue.TooManyDigits):
        return (f"a {flaw.digits}-digit integer is larger than any value a parameter takes "
                f"(at most {MAX_DIGITS} digits)")
    if isinstance(flaw, jsonvalue.NotFinite):
        if flaw.literal is None:
            return "a number too large for a 64-bit float (it overflows to infinity)"
        return f"{flaw.literal} is not JSON (a JSON number is finite): send a number"
    if isinstance(flaw, jsonvalue.LoneSurrogate):
        return (f"{'this key' if flaw.in_key else 'the text'} has a lone surrogate "
                f"(\\u{flaw.codepoint:04x} at character {flaw.index}), which is no Unicode "
                "character: send the text as UTF-8, or a character past U+FFFF as its "
                "surrogate pair")
    return str(flaw)


def parse_body(body: bytes) -> Any:
    """A request body's JSON value: strict UTF-8 (a leading BOM is dropped, as json.loads of
    bytes does), then JSON, with every string Unicode text (no lone surrogate, which no encoder
    takes later), nesting at most MAX_DEPTH deep and every number finite and of at most
    MAX_DIGITS digits; else `BodyError`."""
    try:
        return _BODY.read(body)
    except jsonvalue.NotUtf8 as exc:
        raise BodyError(f"the request body is not UTF-8 text: {exc.reason} (byte "
                        f"0x{exc.byte:02x} at offset {exc.start}); send the JSON as "
                        "UTF-8") from None
    except jsonvalue.NotJson as exc:
        raise BodyError(f"the request body is not valid JSON: {exc.msg} at character "
                        f"{exc.pos}; send a JSON object") from None
    except jsonvalue.TooDeep:
        raise BodyError(f"the request body nests arrays and objects more than {MAX_DEPTH} "
                        "deep; a request nests a few levels") from None
    except jsonvalue.JsonFlaw as exc:
        # the parameter is the first name in the location (messages.0.content -> messages)
        param = next((x for x in exc.where if not x.isdigit()), None)
        raise BodyError(f"{'.'.join(exc.where) or 'the request body'}: {_why(exc)}",
                        param) from None


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
    # 0: completions' echo only (the prompt alone, scored); else a 400 (app's `_check_common`)
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: off
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # the generated token ids in each choice (`token_ids`), as vLLM's return_token_ids does
    return_token_ids: bool = False
    # vLLM's sampling parameters beyond OpenAI's (its extra_body)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class CompletionRequest(_Sampling):
    _NOTHING: ClassVar[dict[str, Any]] = {"logit_bias": {}, "best_of": 1}

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)


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
    top_logprobs: int | None = Field(default=None, ge=0)


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a `prompt` (completions' text) or `messages` (rendered by the chat
    template, as /v1/chat/completions does)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("tokenize_input", "send exactly one of `prompt` (text) and "
                                                        "`messages` (a chat)")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
