"""The OpenAI response objects of one generation, whole or as server-sent events, and the API errors
that engine failures are answered with."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specexec.engine import GenerationError
from specexec.server.pair import RETRY_SECONDS, PairLost
from specexec.server.queue import Job, ShuttingDown
from specexec.server.schemas import APIError


class ResponseShape:
    """Builds the OpenAI response objects for one request."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int) -> None:
        self.chat = chat
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def usage(self, stats: dict | None) -> dict:
        completion = int(stats["new_tokens"]) if stats else 0
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": int(stats["cached_tokens"]) if stats else 0},
        }

    def _envelope(self, obj: str) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def full(self, text: str, finish: str | None, stats: dict | None) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": finish,
            }
            body = self._envelope("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            body = self._envelope("text_completion")
        return {**body, "choices": [choice], "usage": self.usage(stats), "specexec": stats}

    def chunk(
        self, text: str | None, finish: str | None = None, stats: dict | None = None, role=False
    ) -> dict:
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            body = {**self._envelope("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            body = {**self._envelope("text_completion"), "choices": [choice]}
        if stats is not None:
            body["specexec"] = stats
        return body

    def usage_chunk(self, stats: dict | None) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj), "choices": [], "usage": self.usage(stats)}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def event_stream(
    job: Job, first: asyncio.Future, shape: ResponseShape, include_usage: bool, keepalive: float
) -> AsyncIterator[str]:
    """The server-sent events of one streamed generation; the job is cancelled however this ends.

    While the first update (`first`) has not come, a comment line every `keepalive` seconds keeps
    proxies and clients from timing the connection out."""
    try:
        while not first.done():
            await asyncio.wait({first}, timeout=keepalive)
            if not first.done():
                yield ": keep-alive\n\n"
        update = first.result()
        if shape.chat and update.error is None:
            yield _event(shape.chunk("", role=True))
        while True:
            if update.error is not None:
                err = as_api_error(update.error)
                yield _event(err.body())
                break
            if update.text:
                yield _event(shape.chunk(update.text))
            if update.finish_reason is not None:
                yield _event(shape.chunk(None, update.finish_reason, update.stats))
                if include_usage:
                    yield _event(shape.usage_chunk(update.stats))
                break
            update = await job.next()
        yield "data: [DONE]\n\n"
    finally:
        if not first.done():
            first.cancel()
        job.cancel()


class SSEResponse(StreamingResponse):
    """Server-sent events; `on_close` runs when the response ends for any reason, disconnects included."""

    def __init__(self, content, on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def as_api_error(err: BaseException) -> APIError:
    """The API error a failed generation is answered with (its details stay in the log when a 500)."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, GenerationError):
        return APIError(400, str(err), code="invalid_value")
    if isinstance(err, ShuttingDown):
        return APIError(503, "The server is shutting down.", type="server_error", code="unavailable")
    if isinstance(err, PairLost):
        return APIError(
            503,
            f"The model is unavailable: {err}. The server serves again once it is back; retry later.",
            type="server_error",
            code="unavailable",
            headers={"Retry-After": str(math.ceil(RETRY_SECONDS))},  # when the next start is tried
        )
    return APIError(500, "The server had an error while generating.", type="server_error")
