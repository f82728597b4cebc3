"""The OpenAI-compatible HTTP API: completions, chat completions, models, health and metrics.

`create_app` checks the configuration and wires the parts: request normalisation (requests.py), the
endpoints (routes.py), the response shapes (responses.py) and the generation queue (queue.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specexec.methods import Budget
from specexec.server.limits import DEFAULT_MAX_TOKENS
from specexec.server.metrics import Metrics
from specexec.server.pair import ChildPair, LocalPair, check_engine_config
from specexec.server.queue import GenerationQueue
from specexec.server.requests import RequestSettings
from specexec.server.routes import ClientGone, Service, docs_router, router, with_schema_defs
from specexec.server.schemas import APIError, error_body

log = logging.getLogger("specexec.server")

MAX_BODY_BYTES = 4 * 1024 * 1024
BODY_TIMEOUT_SECONDS = 30.0  # a body not received within this is a 408
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30
KEEPALIVE_SECONDS = 15.0  # an SSE comment this often while a streamed request waits for its first token
HEALTH_INTERVAL_SECONDS = 10.0  # /health reuses a forward this recent; older, it runs a probe
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def create_app(
    target,
    draft,
    tokenizer,
    *,
    method: str = "specexec",
    budget: int | str | None = None,
    engine_options: Mapping[str, Any] | None = None,
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    eos_token_id: list[int] | None = None,
    **serving: Any,
) -> FastAPI:
    """An ASGI app serving `target` (sped up by `draft`) through the OpenAI API, the pair in this process.

    `method` and `budget` are `specexec.stream`'s (budget None: the method's default; "auto": sized per
    step from this pair's calibration, measured here once if not cached, and from what the auto budget
    learnt, kept on disk after every request: `calibration.persisted_policies`); `engine_options` are
    further `stream` arguments, the same for every request (e.g. ``{"lookahead_schedule": "heuristic"}``).
    The last generations' KV caches are kept, up to `prefix_cache_bytes`, for requests that begin with
    the same tokens. `eos_token_id` defaults to every end-of-sequence id of the model and tokenizer.
    `serving` are `app_for`'s options (api_key, max_queue, model_name, limits and timeouts).
    """
    options, resolved = check_engine_config(method, budget, dict(engine_options or {}), draft is not None)
    pair = LocalPair(
        target,
        draft,
        tokenizer,
        method=method,
        budget=resolved,
        options=options,
        prefix_cache_bytes=prefix_cache_bytes,
        eos_token_id=eos_token_id,
    )
    return app_for(pair, tokenizer, method=method, budget=resolved, **serving)


def app_for(
    pair: LocalPair | ChildPair,
    tokenizer,
    *,
    method: str,
    budget: Budget,
    api_key: str | None = None,
    max_queue: int = 16,
    model_name: str = "specexec",
    max_body_bytes: int = MAX_BODY_BYTES,
    max_model_len: int | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    allowed_hosts: Sequence[str] | None = None,
    body_timeout: float = BODY_TIMEOUT_SECONDS,
    keepalive_seconds: float = KEEPALIVE_SECONDS,
    health_interval: float = HEALTH_INTERVAL_SECONDS,
) -> FastAPI:
    """An ASGI app serving `pair` (`create_app`'s, or a `ChildPair` for a target on RPC workers).

    One generation runs at a time; at most `max_queue` requests wait behind it, and the next one gets a
    429. With `api_key`, every endpoint but /health needs ``Authorization: Bearer <api_key>``. Prompt
    plus completion are at most `max_model_len` tokens (default: the model's context window); a request
    without max_tokens generates at most `default_max_tokens` (16 on /v1/completions, as OpenAI). KV
    buffers grow with each generation instead of being sized for the window. With `allowed_hosts`
    (serve sets the loopback names on a loopback bind), a request whose Host header names another host
    is refused (DNS rebinding). A body must arrive within `body_timeout` seconds; a streamed request
    waiting for its first token gets an SSE comment every `keepalive_seconds`; /health runs a one-token
    forward when none ran in the last `health_interval` seconds.
    """
    settings = RequestSettings.for_model(pair.facts, model_name, max_model_len, default_max_tokens)
    metrics = Metrics()
    engine = GenerationQueue(pair, tokenizer, max_queue=max_queue, metrics=metrics)
    service = Service(
        settings=settings,
        engine=engine,
        metrics=metrics,
        tokenizer=tokenizer,
        tokenize_pool=ThreadPoolExecutor(1, thread_name_prefix="specexec-tokenize"),
        method=method,
        budget=budget,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        body_timeout=body_timeout,
        keepalive_seconds=keepalive_seconds,
        health_interval=health_interval,
        created=int(time.time()),
    )
    return _asgi_app(service, allowed_hosts)


def _asgi_app(service: Service, allowed_hosts: Sequence[str] | None) -> FastAPI:
    """The FastAPI app serving `service`: its endpoints, errors in the OpenAI shape, metrics, host check."""
    app = FastAPI(
        title="specexec",
        summary="OpenAI-compatible completions served with speculative decoding",
        lifespan=_lifespan,
        # With a key, the schema and its page are served behind the key (routes.docs_router).
        docs_url=None if service.api_key else "/docs",
        redoc_url=None,
        openapi_url=None if service.api_key else "/openapi.json",
    )
    app.state.service = service
    app.state.engine = service.engine
    app.state.model_name = service.settings.model_name
    _add_error_handlers(app)
    app.include_router(router)
    if service.api_key:
        app.include_router(docs_router)
    app.add_middleware(_Instrument, metrics=service.metrics)
    if allowed_hosts is not None:
        app.add_middleware(_HostCheck, hosts=allowed_hosts)  # outermost: before anything else runs
    app.openapi = with_schema_defs(app)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    service: Service = app.state.service
    service.engine.start()
    try:
        yield
    finally:
        service.engine.stop()
        service.tokenize_pool.shutdown(wait=False, cancel_futures=True)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error is answered in the OpenAI shape."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(Exception, _internal_error)


async def _api_error(request: Request, err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
    message = {404: f"Unknown endpoint {request.url.path}.", 405: f"Method {request.method} not allowed."}
    body = error_body(message.get(err.status_code, str(err.detail)), code=code)
    return JSONResponse(body, status_code=err.status_code, headers=getattr(err, "headers", None))


async def _client_gone(request: Request, err: ClientGone) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody is left to read it


async def _internal_error(request: Request, err: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return JSONResponse(
        error_body("The server had an error while processing your request.", type="server_error"),
        status_code=500,
    )


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
