"""The HTTP endpoints: completions, chat completions, models, health, metrics (and, behind an API key,
the OpenAPI schema and its page). Each handler finds what it serves in ``request.app.state.service``."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from specexec.methods import Budget
from specexec.server.metrics import Metrics
from specexec.server.pair import STALL_SECONDS, PairLost
from specexec.server.queue import Admission, GenerationQueue, Job, QueueFull, ShuttingDown
from specexec.server.requests import RequestSettings, check_model, check_request, prepare
from specexec.server.responses import ResponseShape, SSEResponse, as_api_error, event_stream
from specexec.server.schemas import APIError, ChatCompletionRequest, CompletionRequest, parse_body

HEALTH_TIMEOUT_SECONDS = 60.0  # a probe not answered within this is a 503


@dataclass(frozen=True)
class Service:
    """What the endpoints serve and how, built once by `create_app`."""

    settings: RequestSettings
    engine: GenerationQueue
    metrics: Metrics
    tokenizer: Any
    # Request handlers tokenize here, off the event loop; the worker has its own tokenizer copy.
    tokenize_pool: ThreadPoolExecutor
    method: str
    budget: Budget  # resolved once, for every request
    api_key: str | None
    max_body_bytes: int
    body_timeout: float
    keepalive_seconds: float
    health_interval: float
    created: int


class ClientGone(Exception):
    """The client disconnected before its response started; nothing is sent."""


_SCHEMA_DEFS: dict[str, dict] = {}


def _openapi_body(model) -> dict:
    """Document a body that the handler parses itself; its sub-schemas go to `_SCHEMA_DEFS`."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    _SCHEMA_DEFS.update(schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def with_schema_defs(app: FastAPI) -> Callable[[], dict]:
    """`app.openapi`, with the sub-schemas of the bodies the handlers parse themselves."""
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = base()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(_SCHEMA_DEFS)
        return app.openapi_schema

    return openapi


router = APIRouter()
docs_router = APIRouter()  # with an API key, the schema and its page are served here, behind the key


def _service(request: Request) -> Service:
    return request.app.state.service


@router.post("/v1/completions", openapi_extra=_openapi_body(CompletionRequest))
async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


@router.post("/v1/chat/completions", openapi_extra=_openapi_body(ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    service = _service(request)
    _check_key(request, service.api_key)
    return {"object": "list", "data": [_model_card(service)]}


@router.get("/v1/models/{name:path}")
async def get_model(name: str, request: Request) -> dict:
    service = _service(request)
    _check_key(request, service.api_key)
    check_model(name, service.settings)
    return _model_card(service)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when a forward ran in the last `health_interval` seconds (or a probe runs one now), or a
    generation is in progress and made progress in the last STALL_SECONDS; else 503."""
    service = _service(request)
    engine = service.engine
    body = {
        "status": "ok",
        "model": service.settings.model_name,
        "method": service.method,
        "running": int(engine.busy),
        "queue_depth": engine.depth,
        "max_queue": engine.max_queue,
    }
    problem = await _health_problem(engine, service.health_interval)
    if engine.last_forward:
        body["last_forward_seconds_ago"] = round(time.perf_counter() - engine.last_forward, 3)
    if engine.probe_seconds is not None:
        body["probe_seconds"] = round(engine.probe_seconds, 4)
    if problem is not None:
        body.update(status="error", error=problem)
    return JSONResponse(body, status_code=200 if problem is None else 503)


async def _health_problem(engine: GenerationQueue, interval: float) -> str | None:
    """Why the engine is unhealthy, or None; probes it when nothing ran a forward in `interval` s."""
    if not engine.ensure_running():
        return "the server is shutting down"
    if engine.pair.unavailable is not None:
        return f"the model is unavailable: {engine.pair.unavailable}"
    if time.perf_counter() - engine.last_forward <= interval:
        return None
    stalled = engine.seconds_without_progress()
    if stalled is not None:  # a generation runs: it must have made progress lately
        if stalled > STALL_SECONDS:
            return f"no forward pass in the last {STALL_SECONDS:g} s of a generation"
        return None
    probe = asyncio.ensure_future(engine.probe(asyncio.get_running_loop()).next())
    done, _ = await asyncio.wait({probe}, timeout=HEALTH_TIMEOUT_SECONDS)
    if not done:
        probe.cancel()
        return f"the health probe did not finish within {HEALTH_TIMEOUT_SECONDS:g} s"
    if probe.result().error is not None:
        return f"the health probe failed: {probe.result().error}"
    return None


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    service = _service(request)
    _check_key(request, service.api_key)
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@docs_router.get("/openapi.json", include_in_schema=False)
async def openapi_schema(request: Request) -> JSONResponse:
    _check_key(request, _service(request).api_key)
    return JSONResponse(request.app.openapi())


@docs_router.get("/docs", include_in_schema=False)
async def docs(request: Request) -> HTMLResponse:
    _check_key(request, _service(request).api_key)
    return get_swagger_ui_html(openapi_url="/openapi.json", title="specexec")


# ---- generation ----------------------------------------------------------------------------------------


async def _generate(request: Request, chat: bool) -> Response:
    service = _service(request)
    req, job = await _submit(request, service, chat)
    shape = ResponseShape(chat, service.settings.model_name, len(job.params.prompt_ids))
    keepalive = service.keepalive_seconds
    watch = _DisconnectWatch(request)
    try:
        # Waits in the queue, then for the first step; a client that leaves meanwhile cancels it. A
        # stream whose first step is slow to come starts at once, with keep-alive comments; one
        # whose first step failed is answered with the error's status.
        first = asyncio.ensure_future(job.next())
        came = await watch.wait(first, keepalive if req.stream else None)
        if req.stream and not (came and first.result().error is not None):
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = event_stream(job, first, shape, include_usage, keepalive)
            return SSEResponse(events, on_close=job.cancel)
        update = first.result()
        if update.error is not None:
            raise as_api_error(update.error)
        text = [update.text]
        while update.finish_reason is None:
            update = await watch.result(job.next())
            if update.error is not None:
                raise as_api_error(update.error)
            text.append(update.text)
    except BaseException:
        job.cancel()
        raise
    finally:
        watch.close()
    return JSONResponse(shape.full("".join(text), update.finish_reason, update.stats))


async def _submit(
    request: Request, service: Service, chat: bool
) -> tuple[CompletionRequest | ChatCompletionRequest, Job]:
    """Check, read, parse and tokenize a request, and queue its generation."""
    _check_key(request, service.api_key)
    _check_json(request)
    admission = _admit(service.engine)  # before the body is read: a full queue costs nothing more
    try:
        raw = await _read_body(request, service.max_body_bytes, service.body_timeout)
        req = parse_body(ChatCompletionRequest if chat else CompletionRequest, raw)
        check_request(req, service.settings)
        loop = asyncio.get_running_loop()
        params = await loop.run_in_executor(
            service.tokenize_pool, prepare, req, service.tokenizer, service.settings
        )
        try:
            return req, admission.submit(params, loop)
        except ShuttingDown as err:
            raise as_api_error(err) from None
    finally:
        admission.release()


def _check_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(
            401,
            "Incorrect API key provided." if header else "Missing API key: send 'Authorization: Bearer KEY'.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def _check_json(request: Request) -> None:
    # Anything else could come from a web page without a CORS preflight (text/plain, no type).
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise APIError(
            415,
            f"Content-Type must be application/json, got {media or 'none'}.",
            code="unsupported_media_type",
        )


def _admit(engine: GenerationQueue) -> Admission:
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
    except (ShuttingDown, PairLost) as err:
        raise as_api_error(err) from None


async def _read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, at most `limit` bytes (else 413), received within `timeout` seconds (else 408)."""

    async def read() -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _too_large(limit)
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise _too_large(limit)
        return bytes(body)

    try:
        return await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise APIError(
            408, f"The request body did not arrive within {timeout:g} s.", code="timeout"
        ) from None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than {limit} bytes.", code="request_too_large")


def _model_card(service: Service) -> dict:
    return {
        "id": service.settings.model_name,
        "object": "model",
        "created": service.created,
        "owned_by": "specexec",
        "context_window": service.settings.window,
        "specexec": {"method": service.method, "budget": service.budget.option},
    }


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
        not. Raises ClientGone (cancelling it) as soon as the client disconnects."""
        await asyncio.wait({future, self._watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if self._watch.done():
            future.cancel()
            raise ClientGone()
        return future.done()

    async def result(self, awaitable):
        """The result of `awaitable`; raises ClientGone as soon as the client disconnects."""
        future = asyncio.ensure_future(awaitable)
        await self.wait(future)
        return future.result()

    def close(self) -> None:
        self._watch.cancel()
