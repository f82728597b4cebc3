"""Request bodies of the OpenAI API subset the server implements, and the OpenAI error shape.

Bodies are validated strictly: a JSON string where a number belongs, a float where an integer belongs,
or a field the OpenAI API does not define is a 400, as it is on api.openai.com. Parameters the API
defines but this server cannot honour (logprobs, tools, penalties, ...) are accepted only at their
default values, and otherwise answered with a 400 that names them.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_STOP_SEQUENCES = 4
MAX_STOP_LENGTH = 256  # characters per stop sequence: each is searched for in every step's new text


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted and ignored: nothing here needs padding


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # an extension (as in vLLM): 0 = off
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # What the API returns in an assistant message, so a client can send its history back unchanged;
    # only null values are accepted (the server has no tools or audio).
    refusal: str | None = None
    tool_calls: list[Any] | None = None
    function_call: Any = None
    tool_call_id: str | None = None
    audio: Any = None
    annotations: list[Any] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None


def parse_body(model: type[_Strict], raw: bytes) -> Any:
    """Validate a raw JSON body, raising APIError(400) with the first problem's parameter path."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as err:
        raise _as_api_error(err) from None


_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|[A-Z]\w*)$|[\[\]]")


def _as_api_error(err: ValidationError) -> APIError:
    errors = err.errors(include_url=False)
    first = errors[0]
    kind = first["type"]
    if kind == "json_invalid":
        return APIError(
            400,
            f"We could not parse the JSON body of your request ({first['msg']}). The body must be a "
            "JSON object.",
            code="invalid_json",
        )
    path = [str(p) for p in first["loc"] if isinstance(p, int) or not _TYPE_TAG.search(str(p))]
    param = ".".join(path) or None
    if kind in ("model_type", "dict_type") and not path:
        return APIError(400, "The request body must be a JSON object.", code="invalid_json")
    if kind == "extra_forbidden":
        return APIError(
            400, f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter"
        )
    if kind == "missing":
        return APIError(
            400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
        )
    if kind.endswith(("_type", "_parsing")) or kind in ("union_tag_invalid", "is_instance_of"):
        expected = {e["msg"] for e in errors if [str(p) for p in e["loc"]][:1] == [str(first["loc"][0])]}
        detail = " or ".join(sorted(expected)) if len(expected) > 1 else first["msg"]
        return APIError(400, f"Invalid type for '{param}': {detail}.", param=param, code="invalid_type")
    return APIError(400, f"Invalid value for '{param}': {first['msg']}.", param=param, code="invalid_value")


def reject_unsupported(request: _Sampling) -> None:
    """400 for parameters the API defines but this server cannot honour at non-default values."""
    if request.n not in (None, 1):
        raise APIError(400, "Only n=1 is supported.", param="n", code="unsupported_value")
    if request.stream_options is not None and not request.stream:
        raise APIError(
            400,
            "stream_options is only allowed when stream is true.",
            param="stream_options",
            code="invalid_value",
        )
    checks: list[tuple[str, bool]] = [
        ("presence_penalty", request.presence_penalty not in (None, 0.0)),
        ("frequency_penalty", request.frequency_penalty not in (None, 0.0)),
        ("logit_bias", bool(request.logit_bias)),
    ]
    if isinstance(request, CompletionRequest):
        checks += [
            ("echo", bool(request.echo)),
            ("logprobs", request.logprobs is not None),
            ("best_of", request.best_of not in (None, 1)),
            ("suffix", request.suffix is not None),
        ]
    if isinstance(request, ChatCompletionRequest):
        response_type = (request.response_format or {}).get("type", "text")
        checks += [
            ("logprobs", bool(request.logprobs)),
            ("top_logprobs", request.top_logprobs is not None),
            ("response_format", response_type != "text"),
            ("tools", bool(request.tools)),
            ("tool_choice", request.tool_choice not in (None, "none", "auto")),
            ("functions", bool(request.functions)),
            ("function_call", request.function_call not in (None, "none", "auto")),
            ("modalities", request.modalities not in (None, ["text"])),
            ("audio", request.audio is not None),
            ("prediction", request.prediction is not None),
            ("web_search_options", request.web_search_options is not None),
        ]
        for i, message in enumerate(request.messages):
            for field in ("tool_calls", "function_call", "audio"):
                if getattr(message, field):
                    param = f"messages.{i}.{field}"
                    raise APIError(
                        400, f"'{param}' is not supported.", param=param, code="unsupported_parameter"
                    )
            if message.content is None:  # OpenAI allows it only beside tool calls, which are refused
                param = f"messages.{i}.content"
                raise APIError(
                    400,
                    f"Missing required parameter: '{param}'.",
                    param=param,
                    code="missing_required_parameter",
                )
    for name, unsupported in checks:
        if unsupported:
            raise APIError(
                400,
                f"'{name}' is not supported by this server (only its default value is).",
                param=name,
                code="unsupported_parameter",
            )


def stop_sequences(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise APIError(
            400,
            f"'stop' may hold at most {MAX_STOP_SEQUENCES} sequences.",
            param="stop",
            code="invalid_value",
        )
    if any(s == "" for s in stops):
        raise APIError(400, "'stop' sequences must not be empty.", param="stop", code="invalid_value")
    if any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise APIError(
            400,
            f"'stop' sequences may be at most {MAX_STOP_LENGTH} characters long.",
            param="stop",
            code="invalid_value",
        )
    return stops
