"""The OpenAI-compatible HTTP API: completions, chat completions, models, health and metrics."""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specexec.engine import AUTO_METHODS, DEFAULT_BUDGETS, METHODS, GenerationError, sized_by_cost, stream
from specexec.server.metrics import Metrics
from specexec.server.queue import (
    Admission,
    GenerationQueue,
    Job,
    Params,
    QueueFull,
    ShuttingDown,
    random_seed,
)
from specexec.server.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    parse_body,
    reject_unsupported,
    stop_sequences,
)

log = logging.getLogger("specexec.server")

MAX_BODY_BYTES = 4 * 1024 * 1024
BODY_TIMEOUT_SECONDS = 30.0  # a body not received within this is a 408
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
DEFAULT_MAX_TOKENS = 4096  # a chat request without max_tokens generates at most this many
MAX_TOKENS_WITHOUT_WINDOW = 32768  # the context length of a model whose config states none
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30
KEEPALIVE_SECONDS = 15.0  # an SSE comment this often while a streamed request waits for its first token
HEALTH_INTERVAL_SECONDS = 10.0  # /health reuses a forward this recent; older, it runs a probe
HEALTH_TIMEOUT_SECONDS = 60.0  # a probe not answered within this is a 503
STALL_SECONDS = 300.0  # a generation without a forward for this long makes /health a 503
GREEDY_BELOW = 1e-5  # temperatures under this decode greedily (as vLLM does)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def create_app(
    target,
    draft,
    tokenizer,
    *,
    method: str = "specexec",
    budget: int | str | None = None,
    api_key: str | None = None,
    max_queue: int = 16,
    model_name: str = "specexec",
    eos_token_id: list[int] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    engine_options: Mapping[str, Any] | None = None,
    max_model_len: int | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    allowed_hosts: Sequence[str] | None = None,
    body_timeout: float = BODY_TIMEOUT_SECONDS,
    keepalive_seconds: float = KEEPALIVE_SECONDS,
    health_interval: float = HEALTH_INTERVAL_SECONDS,
) -> FastAPI:
    """An ASGI app serving `target` (sped up by `draft`) through the OpenAI API.

    `method` and `budget` are `specexec.stream`'s (budget None: the method's default; "auto": sized per
    step from this pair's calibration, measured here once if not cached, and from what the auto budget
    learnt, kept on disk after every request: `calibration.persisted_policies`); `engine_options` are
    further `stream` arguments, the same for every request (e.g. ``{"lookahead_schedule": "heuristic"}``).
    One generation runs at a time; at most `max_queue` requests wait behind it, and the next one gets a
    429. With `api_key`, every endpoint but /health needs ``Authorization: Bearer <api_key>``.
    `eos_token_id` defaults to every end-of-sequence id of the model and tokenizer.

    Prompt plus completion are at most `max_model_len` tokens (default: the model's context window); a
    request without max_tokens generates at most `default_max_tokens` (16 on /v1/completions, as
    OpenAI). KV buffers grow with each generation instead of being sized for the window, and the last
    generations' KV caches are kept, up to `prefix_cache_bytes`, for requests that begin with the same
    tokens. With `allowed_hosts` (serve sets the loopback names on a loopback bind), a request whose
    Host header names another host is refused (DNS rebinding). A body must arrive within
    `body_timeout` seconds; a streamed request waiting for its first token gets an SSE comment every
    `keepalive_seconds`; /health runs a one-token forward when none ran in the last `health_interval`
    seconds.
    """
    engine_options = _check_engine_config(target, draft, method, budget, max_queue, engine_options)
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if default_max_tokens < 1:
        raise ValueError(f"default_max_tokens must be >= 1, got {default_max_tokens}")
    if eos_token_id is None:
        from specexec.models import eos_token_ids

        eos_token_id = eos_token_ids(target, tokenizer)
    metrics = Metrics()
    engine = GenerationQueue(
        target,
        draft,
        tokenizer,
        method=method,
        budget=budget,
        eos_token_id=eos_token_id,
        max_queue=max_queue,
        metrics=metrics,
        engine_options=engine_options,
        prefix_cache_bytes=prefix_cache_bytes,
    )
    text_config = target.config.get_text_config()
    model_window: int | None = getattr(text_config, "max_position_embeddings", None)
    if max_model_len is not None and model_window is not None and max_model_len > model_window:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's context window of {model_window}"
        )
    window: int = max_model_len or model_window or MAX_TOKENS_WITHOUT_WINDOW
    vocab_size: int = text_config.vocab_size
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()
            app.state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="specexec",
        summary="OpenAI-compatible completions served with speculative decoding",
        lifespan=lifespan,
        # With a key, the schema and its page are served below, behind the key.
        docs_url=None if api_key else "/docs",
        redoc_url=None,
        openapi_url=None if api_key else "/openapi.json",
    )
    app.state.engine = engine
    # Request handlers tokenize here, off the event loop; the worker has its own tokenizer copy.
    app.state.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="specexec-tokenize")
    app.state.metrics = metrics
    app.state.model_name = model_name

    # ---- errors: always the OpenAI shape -------------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        message = {404: f"Unknown endpoint {request.url.path}.", 405: f"Method {request.method} not allowed."}
        body = error_body(message.get(err.status_code, str(err.detail)), code=code)
        return JSONResponse(body, status_code=err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(_ClientGone)
    async def _client_gone(request: Request, err: _ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody is left to read it

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(
            error_body("The server had an error while processing your request.", type="server_error"),
            status_code=500,
        )

    # ---- helpers -------------------------------------------------------------------------------------

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(
                401,
                "Incorrect API key provided."
                if header
                else "Missing API key: send 'Authorization: Bearer KEY'.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            raise _too_large(max_body_bytes)
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > max_body_bytes:
                raise _too_large(max_body_bytes)
        return bytes(body)

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{model_name}'.",
                param="model",
                code="model_not_found",
            )

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def completion_prompt(req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise APIError(
                    400, "Only one prompt per request is supported.", param="prompt", code="unsupported_value"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"Token id {bad[0]} in 'prompt' is out of range [0, {vocab_size}).",
                    param="prompt",
                    code="invalid_value",
                )
        if not ids:
            raise APIError(400, "The prompt is empty.", param="prompt", code="invalid_value")
        return ids

    def chat_prompt(req: ChatCompletionRequest) -> list[int]:
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(
                400,
                "This model's tokenizer has no chat template; use /v1/completions.",
                param="messages",
                code="chat_template_missing",
            )
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as err:
            raise APIError(
                400, f"The messages do not fit the model's chat template: {err}", param="messages"
            ) from None
        ids = encode(text, add_special_tokens=False)
        if not ids:
            raise APIError(
                400, "The messages render to an empty prompt.", param="messages", code="invalid_value"
            )
        return ids

    def engine_params(req, prompt_ids: list[int], max_tokens: int | None, default_max: int) -> Params:
        if len(prompt_ids) >= window:
            raise APIError(
                400,
                f"This model's maximum context length is {window} tokens; the prompt has {len(prompt_ids)} "
                "tokens, which leaves no room to generate.",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        room = window - len(prompt_ids)
        if max_tokens is None:
            max_tokens = min(room, default_max)
        elif max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {window} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} for "
                "the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        temperature = 1.0 if req.temperature is None else req.temperature
        if temperature < GREEDY_BELOW:
            # The limit of sampling as temperature -> 0 is greedy; dividing logits by a denormal
            # temperature would overflow to inf and NaN probabilities instead.
            temperature = 0.0
        seed = req.seed if req.seed is not None else (0 if temperature == 0 else random_seed())
        return Params(
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            seed=seed,
            stop=stop_sequences(req.stop),
        )

    def admit() -> Admission:
        try:
            return engine.admit()
        except QueueFull as full:
            raise APIError(
                429,
                f"The server is busy: {engine.max_queue} requests are already waiting. Retry after "
                f"{full.retry_after} s.",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(full.retry_after)},
            ) from None
        except ShuttingDown as err:
            raise _as_api_error(err) from None

    def check_json(request: Request) -> None:
        # Anything else could come from a web page without a CORS preflight (text/plain, no type).
        media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            raise APIError(
                415,
                f"Content-Type must be application/json, got {media or 'none'}.",
                code="unsupported_media_type",
            )

    def prepare(req: CompletionRequest | ChatCompletionRequest) -> Params:
        """Tokenize and check one request (in the tokenizer thread: long prompts take a while)."""
        if isinstance(req, ChatCompletionRequest):
            max_tokens = (
                req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            )
            return engine_params(req, chat_prompt(req), max_tokens, default_max_tokens)
        return engine_params(req, completion_prompt(req), req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)

    # ---- endpoints -----------------------------------------------------------------------------------

    async def generate(request: Request, chat: bool) -> Response:
        check_key(request)
        check_json(request)
        admission = admit()  # before the body is read: a full queue costs nothing more
        try:
            try:
                raw = await asyncio.wait_for(read_body(request), body_timeout)
            except TimeoutError:
                raise APIError(
                    408, f"The request body did not arrive within {body_timeout:g} s.", code="timeout"
                ) from None
            req = parse_body(ChatCompletionRequest if chat else CompletionRequest, raw)
            check_model(req.model)
            reject_unsupported(req)
            loop = asyncio.get_running_loop()
            params = await loop.run_in_executor(app.state.tokenize_pool, prepare, req)
            try:
                job = admission.submit(params, loop)
            except ShuttingDown as err:
                raise _as_api_error(err) from None
        finally:
            admission.release()
        shape = _Shape(chat, model_name, len(params.prompt_ids))
        watch = _DisconnectWatch(request)
        try:
            # Waits in the queue, then for the first step; a client that leaves meanwhile cancels it. A
            # stream whose first step is slow to come starts at once, with keep-alive comments; one
            # whose first step failed is answered with the error's status.
            first = asyncio.ensure_future(job.next())
            came = await watch.wait(first, keepalive_seconds if req.stream else None)
            if req.stream and not (came and first.result().error is not None):
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                events = _sse(job, first, shape, include_usage, keepalive_seconds)
                return _SSEResponse(events, on_close=job.cancel)
            update = first.result()
            if update.error is not None:
                raise _as_api_error(update.error)
            text = [update.text]
            while update.finish_reason is None:
                update = await watch.result(job.next())
                if update.error is not None:
                    raise _as_api_error(update.error)
                text.append(update.text)
        except BaseException:
            job.cancel()
            raise
        finally:
            watch.close()
        return JSONResponse(shape.full("".join(text), update.finish_reason, update.stats))

    @app.post("/v1/completions", openapi_extra=_openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        check_key(request)
        return {
            "object": "list",
            "data": [_model_card(model_name, created, window, method, budget)],
        }

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request) -> dict:
        check_key(request)
        check_model(name)
        return _model_card(model_name, created, window, method, budget)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when a forward ran in the last `health_interval` seconds (or a probe runs one now), or a
        generation is in progress and made progress in the last STALL_SECONDS; else 503."""
        body = {
            "status": "ok",
            "model": model_name,
            "method": method,
            "running": int(engine.busy),
            "queue_depth": engine.depth,
            "max_queue": engine.max_queue,
        }
        problem = None
        if not engine.ensure_running():
            problem = "the server is shutting down"
        elif time.perf_counter() - engine.last_forward > health_interval:
            stalled = engine.seconds_without_progress()
            if stalled is not None:
                if stalled > STALL_SECONDS:
                    problem = f"no forward pass in the last {STALL_SECONDS:g} s of a generation"
            else:
                probe = asyncio.ensure_future(engine.probe(asyncio.get_running_loop()).next())
                done, _ = await asyncio.wait({probe}, timeout=HEALTH_TIMEOUT_SECONDS)
                if not done:
                    probe.cancel()
                    problem = f"the health probe did not finish within {HEALTH_TIMEOUT_SECONDS:g} s"
                elif probe.result().error is not None:
                    problem = f"the health probe failed: {probe.result().error}"
        if engine.last_forward:
            body["last_forward_seconds_ago"] = round(time.perf_counter() - engine.last_forward, 3)
        if engine.probe_seconds is not None:
            body["probe_seconds"] = round(engine.probe_seconds, 4)
        if problem is not None:
            body.update(status="error", error=problem)
        return JSONResponse(body, status_code=200 if problem is None else 503)

    if api_key:

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi_schema(request: Request) -> JSONResponse:
            check_key(request)
            return JSONResponse(app.openapi())

        @app.get("/docs", include_in_schema=False)
        async def docs(request: Request) -> HTMLResponse:
            check_key(request)
            return get_swagger_ui_html(openapi_url="/openapi.json", title="specexec")

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        check_key(request)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(_Instrument, metrics=metrics)
    if allowed_hosts is not None:
        app.add_middleware(_HostCheck, hosts=allowed_hosts)  # outermost: before anything else runs
    app.openapi = _with_schema_defs(app)
    return app


def _check_engine_config(target, draft, method, budget, max_queue, engine_options) -> dict:
    """Refuse a configuration that would fail every request, before serving anything."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method != "ar" and draft is None:
        raise ValueError(f"method {method!r} needs a draft model")
    if max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue}")
    if budget == "auto" and method not in AUTO_METHODS:
        raise ValueError(f"budget 'auto' is for methods 'specexec' and 'dsl', not {method!r}")
    if budget not in (None, "auto") and (not isinstance(budget, int) or (method != "ar" and budget < 1)):
        raise ValueError(f"budget must be an integer >= 1, 'auto' or None, got {budget!r}")
    options = dict(engine_options or {})
    allowed = set(inspect.signature(stream).parameters) - _PER_REQUEST
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"engine_options not accepted by specexec.stream: {', '.join(unknown)}")
    if sized_by_cost(method, budget):
        from specexec.calibration import cached_cost_model, persisted_policies

        if options.get("cost_model") is None:
            options["cost_model"] = cached_cost_model(target, draft)  # calibrates now if not cached
        # Requests run one at a time: each starts from what the auto budget learnt on the ones before,
        # and the first from what the last server (or `specexec generate`) of this pair learnt.
        options.setdefault("learnt", persisted_policies(target, draft))
    return options


# What the server sets itself for every request, so not an engine option.
_PER_REQUEST = {
    "target", "draft", "input_ids", "method", "budget", "max_new_tokens", "temperature", "top_p", "top_k",
    "seed", "eos_token_id", "stop_strings", "tokenizer",
}  # fmt: skip


# ---- response shapes ---------------------------------------------------------------------------------


class _Shape:
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


async def _sse(
    job: Job, first: asyncio.Future, shape: _Shape, include_usage: bool, keepalive: float
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
                err = _as_api_error(update.error)
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


class _SSEResponse(StreamingResponse):
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


class _ClientGone(Exception):
    """The client disconnected before its response started; nothing is sent."""


class _DisconnectWatch:
    """Races awaits against the client disconnecting, for responses that have not started yet."""

    def __init__(self, request: Request) -> None:
        self._watch = asyncio.ensure_future(self._disconnected(request))

    @staticmethod
    async def _disconnected(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def wait(self, future: asyncio.Future, timeout: float | None = None) -> bool:
        """Whether `future` is done within `timeout` seconds (None: no limit); it is not cancelled if
        not. Raises _ClientGone (cancelling it) as soon as the client disconnects."""
        await asyncio.wait({future, self._watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if self._watch.done():
            future.cancel()
            raise _ClientGone()
        return future.done()

    async def result(self, awaitable):
        """The result of `awaitable`; raises _ClientGone as soon as the client disconnects."""
        future = asyncio.ensure_future(awaitable)
        await self.wait(future)
        return future.result()

    def close(self) -> None:
        self._watch.cancel()


def _as_api_error(err: BaseException) -> APIError:
    if isinstance(err, APIError):
        return err
    if isinstance(err, GenerationError):
        return APIError(400, str(err), code="invalid_value")
    if isinstance(err, ShuttingDown):
        return APIError(503, "The server is shutting down.", type="server_error", code="unavailable")
    return APIError(500, "The server had an error while generating.", type="server_error")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than {limit} bytes.", code="request_too_large")


def _model_card(name: str, created: int, window: int | None, method: str, budget) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "specexec",
        "context_window": window,
        "specexec": {"method": method, "budget": budget if budget is not None else DEFAULT_BUDGETS[method]},
    }


_SCHEMA_DEFS: dict[str, dict] = {}


def _openapi_body(model) -> dict:
    """Document a body that the handler parses itself; its sub-schemas go to `_SCHEMA_DEFS`."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    _SCHEMA_DEFS.update(schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _with_schema_defs(app: FastAPI) -> Callable[[], dict]:
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = base()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(_SCHEMA_DEFS)
        return app.openapi_schema

    return openapi


class _Instrument:
    """Counts requests by endpoint and status, and times them to the end of the response (streams too)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = (
            path if path in _ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")
        )
        status = 500
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.request_latency.labels(endpoint).observe(time.perf_counter() - start)


class _HostCheck:
    """403 for a request whose Host header names a host outside `hosts` (a page on another origin that
    resolves its name to this machine, DNS rebinding, would otherwise reach a loopback server)."""

    def __init__(self, app: ASGIApp, hosts: Sequence[str]) -> None:
        self.app = app
        self.hosts = {h.strip("[]").lower() for h in hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1").lower()
            host = header[1:].partition("]")[0] if header.startswith("[") else header.rpartition(":")[0]
            if (host or header) not in self.hosts:
                body = error_body(f"Host {header or '(none)'} is not served here.", code="invalid_host")
                await JSONResponse(body, status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)
