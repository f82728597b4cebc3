"""The OpenAI-compatible server, end to end: real uvicorn servers on free loopback ports, tiny CPU models.

Covers the official `openai` client (both endpoints, streaming and not, equal to `specexec.generate`),
32 concurrent clients against a small queue, client disconnects, a table of malformed requests, a
property-based fuzz of request bodies, and `serve` itself in a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from server_helpers import (
    CONTEXT_WINDOW,
    SlowModel,
    byte_tokenizer,
    live_server,
    sse_events,
    tiny_pair,
    wait_serving,
)

import specexec
from specexec.server import add_serve_arguments, create_app
from specexec.server.routes import STALL_SECONDS

API_KEY = "sk-test-key"
MODEL = "tiny"
METHOD = "specexec"
BUDGET = 8
EOS = [256, 258]  # <|endoftext|> (the model's) and <|im_end|> (the tokenizer's)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one thread, and the test machine is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def pair(tok):
    return tiny_pair(len(tok), eos_id=256)


def make_app(pair, tok, **kwargs):
    target, draft = pair
    options = {"method": METHOD, "budget": BUDGET, "model_name": MODEL, "eos_token_id": EOS, **kwargs}
    return create_app(target, draft, tok, **options)


@pytest.fixture(scope="module")
def server(pair, tok):
    with live_server(make_app(pair, tok, api_key=API_KEY, max_queue=64)) as live:
        yield live


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def reference(pair, tok, ids, max_tokens, stop=(), **kwargs) -> tuple[str, specexec.GenerationOutput]:
    """What `specexec.generate` gives, as text with OpenAI stop semantics (the stop text cut off)."""
    target, draft = pair
    out = specexec.generate(
        target,
        draft,
        ids,
        method=METHOD,
        budget=BUDGET,
        max_new_tokens=max_tokens,
        eos_token_id=EOS,
        stop_strings=list(stop),
        tokenizer=tok,
        **kwargs,
    )
    text = tok.decode(out.tokens, skip_special_tokens=True)
    cuts = [text.find(s) for s in stop if s in text]
    return (text[: min(cuts)] if cuts else text), out


# One plain client for the checks: each top-level httpx.get/post builds a client (and an SSL context).
PLAIN = httpx.Client(timeout=60)


def assert_healthy(url: str) -> None:
    r = PLAIN.get(url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text


def assert_error_shape(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def wait_idle(engine, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.busy or engine.depth:
        assert time.monotonic() < deadline, "the engine never became idle"
        time.sleep(0.01)


# ---- the official client ---------------------------------------------------------------------------------


def test_completions_non_streaming_equals_generate(client, pair, tok):
    prompt = "The quick brown fox"
    text, out = reference(pair, tok, tok(prompt)["input_ids"], 24)
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert resp.object == "text_completion"
    assert resp.choices[0].text == text
    assert resp.choices[0].finish_reason == out.finish_reason
    assert resp.usage.prompt_tokens == out.stats.prompt_tokens
    assert resp.usage.completion_tokens == len(out.tokens)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    stats = resp.model_extra["specexec"]
    assert stats["target_calls"] == out.stats.target_calls
    assert stats["tokens_per_step"] == pytest.approx(out.stats.tokens_per_step)
    assert {"draft_calls", "prefill_seconds", "draft_seconds", "target_seconds", "queue_seconds"} <= set(
        stats
    )


def test_completions_streaming_equals_generate(client, pair, tok):
    prompt = "Once upon a time"
    text, out = reference(pair, tok, tok(prompt)["input_ids"], 40)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == out.finish_reason and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(out.tokens)
    assert chunks[-2].model_extra["specexec"]["target_calls"] == out.stats.target_calls


def test_completions_token_id_prompt(client, pair, tok):
    ids = tok("token ids")["input_ids"]
    text, _ = reference(pair, tok, ids, 12)
    assert (
        client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0).choices[0].text
        == text
    )


def test_chat_non_streaming_equals_generate(client, pair, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text, out = reference(pair, tok, chat_ids(tok, messages), 32)
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == text
    assert resp.choices[0].finish_reason == out.finish_reason
    assert resp.usage.prompt_tokens == len(chat_ids(tok, messages))
    assert resp.usage.completion_tokens == len(out.tokens)
    assert resp.model_extra["specexec"]["method"] == METHOD


def test_chat_streaming_equals_generate(client, pair, tok):
    messages = [{"role": "user", "content": "Tell me a story"}]
    text, out = reference(pair, tok, chat_ids(tok, messages), 48)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=48, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == out.finish_reason
    assert all(c.usage is None for c in chunks)  # usage only with stream_options.include_usage


def test_chat_accepts_its_own_history(client):
    first = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=4, temperature=0
    )
    history = [
        {"role": "user", "content": "a"},
        first.choices[0].message.model_dump(),
        {"role": "user", "content": [{"type": "text", "text": "b"}]},
    ]
    assert client.chat.completions.create(model=MODEL, messages=history, max_tokens=4).choices


def test_seeded_sampling_equals_generate(client, pair, tok):
    prompt = "sampling"
    text, _ = reference(pair, tok, tok(prompt)["input_ids"], 24, temperature=0.9, top_p=0.95, seed=1234)
    for _ in range(2):
        resp = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0.9, top_p=0.95, seed=1234
        )
        assert resp.choices[0].text == text


def test_stop_sequences_are_cut(client, pair, tok):
    prompt = "stop here"
    full, _ = reference(pair, tok, tok(prompt)["input_ids"], 40)
    clean = [i for i in range(4, len(full) - 2) if "\ufffd" not in full[i : i + 2]]
    assert clean, f"no usable stop string in {full!r}"
    stop = full[clean[0] : clean[0] + 2]
    expected = full[: full.find(stop)]
    text, out = reference(pair, tok, tok(prompt)["input_ids"], 40, stop=[stop])
    assert text == expected
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop)
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == len(out.tokens)
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=["zzzz", stop], stream=True
    )
    pieces = [c.choices[0].text for c in streamed]
    assert "".join(pieces) == expected
    assert not any(stop in p for p in pieces)


def test_models_health_and_metrics(client, http, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = PLAIN.get(server.url + "/health").json()  # no key needed
    assert health["status"] == "ok" and health["queue_depth"] == 0
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=4, temperature=0)
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in (
        "specexec_requests_total",
        "specexec_completion_tokens_total",
        "specexec_prompt_tokens_total",
        "specexec_tokens_per_step_bucket",
        "specexec_queue_depth",
        "specexec_request_latency_seconds_bucket",
        "specexec_time_to_first_token_seconds_bucket",
        "specexec_queue_wait_seconds_bucket",
        "specexec_generation_seconds_bucket",
    ):
        assert name in text, name
    done = re.search(r'specexec_requests_total\{endpoint="/v1/completions",status="200"\} (\d+)', text)
    assert done and float(done.group(1)) >= 1
    assert float(re.search(r"^specexec_completion_tokens_total (\S+)$", text, re.M).group(1)) >= 4


def test_openapi_schema_is_served(http):
    schema = http.get("/openapi.json").json()
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "prompt" in body["properties"]
    assert "ChatMessage" in schema["components"]["schemas"]


def test_api_key(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert_error_shape(PLAIN.get(server.url + "/metrics"), 401, "invalid_api_key")
    r = PLAIN.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.headers["www-authenticate"] == "Bearer"
    assert_error_shape(r, 401, "invalid_api_key")


# ---- load ------------------------------------------------------------------------------------------------


def test_32_concurrent_clients(pair, tok):
    """Every request completes exactly as it would alone, or gets a 429; nothing leaks between streams."""
    clients, per_client = 32, 3
    jobs = []
    for i in range(clients):
        for j in range(per_client):
            chat, streaming = (i + j) % 2 == 0, (i * per_client + j) % 3 != 0
            sampling = {"temperature": 0.8, "seed": i * 10 + j} if (i + j) % 4 == 1 else {"temperature": 0}
            content = f"client {i} request {j}"
            body = {"model": MODEL, "max_tokens": 10 + (i + j) % 6, "stream": streaming, **sampling}
            if chat:
                body["messages"] = [{"role": "user", "content": content}]
            else:
                body["prompt"] = content
            jobs.append((i, chat, body))

    async def one(http: httpx.AsyncClient, chat: bool, body: dict):
        url = "/v1/chat/completions" if chat else "/v1/completions"
        if not body["stream"]:
            r = await http.post(url, json=body)
            if r.status_code != 200:
                return r.status_code, r.headers.get("retry-after"), r.json()
            data = r.json()
            choice = data["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            return 200, data["usage"]["completion_tokens"], text
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return r.status_code, r.headers.get("retry-after"), json.loads(await r.aread())
            pieces, ids = [], set()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                ids.add(event["id"])
                choice = event["choices"][0]
                pieces.append((choice["delta"].get("content") if chat else choice["text"]) or "")
            assert len(ids) == 1  # every event of a stream belongs to that stream
            return 200, None, "".join(pieces)

    async def client_session(http, mine):
        return [await one(http, chat, body) for _, chat, body in mine]

    async def run_all(url):
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
            sessions = [[job for job in jobs if job[0] == i] for i in range(clients)]
            results = await asyncio.gather(*(client_session(http, s) for s in sessions))
        return [r for session in results for r in session]

    app = make_app(pair, tok, max_queue=12)
    with live_server(app) as live:
        start = time.perf_counter()
        results = asyncio.run(run_all(live.url))
        elapsed = time.perf_counter() - start
        wait_idle(app.state.engine)  # the last response can arrive just before the worker lets go
        assert_healthy(live.url)
        health = PLAIN.get(live.url + "/health").json()
        assert health["queue_depth"] == 0 and health["running"] == 0
        metrics = PLAIN.get(live.url + "/metrics").text

    completed = rejected = 0
    for (_, chat, body), (status, extra, payload) in zip(jobs, results, strict=True):
        if status == 429:
            rejected += 1
            assert int(extra) >= 1  # Retry-After
            assert payload["error"]["code"] == "queue_full"
            continue
        assert status == 200, payload
        completed += 1
        ids = chat_ids(tok, body["messages"]) if chat else tok(body["prompt"])["input_ids"]
        sampling = {"temperature": body["temperature"], "seed": body.get("seed", 0)}
        text, out = reference(pair, tok, ids, body["max_tokens"], **sampling)
        assert payload == text, body
        if extra is not None:
            assert extra == len(out.tokens)
    assert completed >= 5 and rejected >= 1, (completed, rejected)
    assert f"specexec_rejected_total {float(rejected)}" in metrics
    print(f"load: {completed} completed, {rejected} got 429, {elapsed:.1f} s")


# ---- disconnects -----------------------------------------------------------------------------------------

STEP = 0.1  # seconds added to every target forward in the slow server


@pytest.fixture(scope="module")
def slow_server(tok):
    target, draft = tiny_pair(len(tok), eos_id=9999, seed=1)  # no end-of-sequence: generations run long
    app = create_app(
        target, draft, tok, method="sd", budget=2, model_name=MODEL, eos_token_id=[], max_queue=1
    )
    slow = SlowModel(target, STEP)
    with live_server(app) as live:
        yield live, app.state.engine
    slow.remove()


def test_stream_disconnect_frees_engine(slow_server):
    live, engine = slow_server
    wait_idle(engine)
    body = {"model": MODEL, "prompt": "long", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(base_url=live.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events(r)
            for _ in range(2):
                next(events)
            closed_at = time.perf_counter()
        # The connection is closed; the next request must start within about one generation step.
        quick = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 1})
        assert quick.status_code == 200
    wait_idle(engine)  # the worker records a job just after sending its last update
    cancelled = next(rec for rec in reversed(engine.history) if rec.finish_reason == "cancelled")
    following = next(rec for rec in engine.history if rec.id == cancelled.id + 1)
    print(
        f"disconnect: cancelled after {cancelled.steps} steps, {cancelled.ended_at - closed_at:.3f} s after "
        f"the close; the next request started {following.started_at - closed_at:.3f} s after it"
    )
    assert cancelled.steps < 10  # 400 tokens at <= 3 per step would take >= 134 steps
    assert cancelled.ended_at - closed_at < 3 * STEP + 0.5
    assert following.started_at - closed_at < 3 * STEP + 0.5
    assert_healthy(live.url)


def test_non_streaming_disconnect_frees_engine(slow_server):
    live, engine = slow_server
    wait_idle(engine)
    body = {"model": MODEL, "prompt": "long", "max_tokens": 400, "temperature": 0}
    with httpx.Client(base_url=live.url) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=1.0)  # the client gives up and closes
    gave_up = time.perf_counter()
    wait_idle(engine)
    record = engine.history[-1]
    assert record.finish_reason == "cancelled" and record.started_at is not None
    assert record.ended_at - gave_up < 3 * STEP + 0.5
    assert_healthy(live.url)


def test_queue_full_gets_429_and_a_waiting_client_can_leave(slow_server):
    live, engine = slow_server
    wait_idle(engine)
    body = {"model": MODEL, "prompt": "long", "max_tokens": 400, "temperature": 0}
    with (
        httpx.Client(base_url=live.url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json={**body, "stream": True}) as running,
    ):
        events = sse_events(running)  # (dropping this generator would close the connection)
        next(events)  # the engine is busy with this one now
        # A waiting client that gives up leaves the queue at once, without ever running.
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 2
        while not (engine.history and engine.history[-1].started_at is None) and time.monotonic() < deadline:
            time.sleep(0.01)
        left = engine.history[-1]
        assert left.finish_reason == "cancelled" and left.started_at is None, list(engine.history)
        assert engine.depth == 0 and engine.busy
        # max_queue=1: one request may wait behind the running one; the next gets a 429.
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(http.post, "/v1/completions", json={**body, "max_tokens": 2})
            deadline = time.monotonic() + 5
            while engine.depth < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            full = http.post("/v1/completions", json=body)
            error = assert_error_shape(full, 429, "queue_full")
            assert error["type"] == "rate_limit_error" and int(full.headers["retry-after"]) >= 1
            running.close()  # the stream's client leaves; the waiting request runs next
            assert waiting.result(timeout=20).status_code == 200
    wait_idle(engine)
    assert_healthy(live.url)


# ---- bad input -------------------------------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def with_(base: dict, **changes) -> dict:
    body = {**base, **changes}
    return {k: v for k, v in body.items() if v is not ...}


# (name, method, path, body: dict | str | bytes, headers, status, error code)
BAD_REQUESTS = [
    ("invalid json", "POST", C, '{"model": "tiny", "prompt": ', None, 400, "invalid_json"),
    ("empty body", "POST", C, "", None, 400, "invalid_json"),
    ("not utf-8", "POST", C, b"\xff\xfe{", None, 400, "invalid_json"),
    ("body is an array", "POST", C, "[1, 2]", None, 400, "invalid_json"),
    ("body is a string", "POST", CHAT, '"hello"', None, 400, "invalid_json"),
    ("missing model", "POST", C, with_(OK_COMPLETION, model=...), None, 400, "missing_required_parameter"),
    ("missing prompt", "POST", C, with_(OK_COMPLETION, prompt=...), None, 400, "missing_required_parameter"),
    ("unknown model", "POST", C, with_(OK_COMPLETION, model="gpt-4"), None, 404, "model_not_found"),
    ("model not a string", "POST", C, with_(OK_COMPLETION, model=7), None, 400, "invalid_type"),
    ("prompt a number", "POST", C, with_(OK_COMPLETION, prompt=123), None, 400, "invalid_type"),
    ("prompt mixed list", "POST", C, with_(OK_COMPLETION, prompt=[1, "a"]), None, 400, "invalid_type"),
    ("empty prompt list", "POST", C, with_(OK_COMPLETION, prompt=[]), None, 400, "invalid_value"),
    ("two prompts", "POST", C, with_(OK_COMPLETION, prompt=["a", "b"]), None, 400, "unsupported_value"),
    ("token id out of range", "POST", C, with_(OK_COMPLETION, prompt=[1, 10**6]), None, 400, "invalid_value"),
    ("negative token id", "POST", C, with_(OK_COMPLETION, prompt=[-1]), None, 400, "invalid_value"),
    ("max_tokens a string", "POST", C, with_(OK_COMPLETION, max_tokens="10"), None, 400, "invalid_type"),
    ("max_tokens a float", "POST", C, with_(OK_COMPLETION, max_tokens=2.5), None, 400, "invalid_type"),
    ("max_tokens a bool", "POST", C, with_(OK_COMPLETION, max_tokens=True), None, 400, "invalid_type"),
    ("max_tokens negative", "POST", C, with_(OK_COMPLETION, max_tokens=-5), None, 400, "invalid_value"),
    ("max_tokens zero", "POST", CHAT, with_(OK_CHAT, max_tokens=0), None, 400, "invalid_value"),
    (
        "max_tokens huge",
        "POST",
        C,
        with_(OK_COMPLETION, max_tokens=10**12),
        None,
        400,
        "context_length_exceeded",
    ),
    ("max_tokens astronomic", "POST", C, with_(OK_COMPLETION, max_tokens=10**40), None, 400, None),
    (
        "max_tokens past window",
        "POST",
        CHAT,
        with_(OK_CHAT, max_tokens=CONTEXT_WINDOW),
        None,
        400,
        "context_length_exceeded",
    ),
    (
        "prompt past window",
        "POST",
        C,
        with_(OK_COMPLETION, prompt="x" * 600),
        None,
        400,
        "context_length_exceeded",
    ),
    (
        "messages past window",
        "POST",
        CHAT,
        with_(OK_CHAT, messages=[{"role": "user", "content": "y" * 600}]),
        None,
        400,
        "context_length_exceeded",
    ),
    ("temperature negative", "POST", C, with_(OK_COMPLETION, temperature=-0.5), None, 400, "invalid_value"),
    ("temperature too high", "POST", C, with_(OK_COMPLETION, temperature=5), None, 400, "invalid_value"),
    ("temperature a string", "POST", CHAT, with_(OK_CHAT, temperature="hot"), None, 400, "invalid_type"),
    ("temperature NaN", "POST", C, '{"model": "tiny", "prompt": "a", "temperature": NaN}', None, 400, None),
    ("top_p zero", "POST", C, with_(OK_COMPLETION, top_p=0), None, 400, "invalid_value"),
    ("top_p above one", "POST", CHAT, with_(OK_CHAT, top_p=1.5), None, 400, "invalid_value"),
    ("top_k negative", "POST", C, with_(OK_COMPLETION, top_k=-1), None, 400, "invalid_value"),
    ("n is 2", "POST", C, with_(OK_COMPLETION, n=2), None, 400, "unsupported_value"),
    ("n is 0", "POST", CHAT, with_(OK_CHAT, n=0), None, 400, "unsupported_value"),
    ("unknown field", "POST", C, with_(OK_COMPLETION, foo=1), None, 400, "unknown_parameter"),
    (
        "unknown field in message",
        "POST",
        CHAT,
        with_(OK_CHAT, messages=[{"role": "user", "content": "a", "x": 1}]),
        None,
        400,
        "unknown_parameter",
    ),
    ("stream a string", "POST", C, with_(OK_COMPLETION, stream="yes"), None, 400, "invalid_type"),
    (
        "stream_options without stream",
        "POST",
        C,
        with_(OK_COMPLETION, stream_options={"include_usage": True}),
        None,
        400,
        "invalid_value",
    ),
    ("stop a number", "POST", C, with_(OK_COMPLETION, stop=42), None, 400, "invalid_type"),
    ("five stop sequences", "POST", C, with_(OK_COMPLETION, stop=list("abcde")), None, 400, "invalid_value"),
    ("empty stop sequence", "POST", CHAT, with_(OK_CHAT, stop=[""]), None, 400, "invalid_value"),
    ("stop sequence too long", "POST", CHAT, with_(OK_CHAT, stop=["x" * 257]), None, 400, "invalid_value"),
    ("seed a string", "POST", C, with_(OK_COMPLETION, seed="abc"), None, 400, "invalid_type"),
    ("seed too large", "POST", C, with_(OK_COMPLETION, seed=2**70), None, 400, "invalid_value"),
    ("logprobs", "POST", C, with_(OK_COMPLETION, logprobs=5), None, 400, "unsupported_parameter"),
    ("echo", "POST", C, with_(OK_COMPLETION, echo=True), None, 400, "unsupported_parameter"),
    (
        "presence penalty",
        "POST",
        CHAT,
        with_(OK_CHAT, presence_penalty=1.0),
        None,
        400,
        "unsupported_parameter",
    ),
    ("tools", "POST", CHAT, with_(OK_CHAT, tools=[{"type": "function"}]), None, 400, "unsupported_parameter"),
    ("empty messages", "POST", CHAT, with_(OK_CHAT, messages=[]), None, 400, "invalid_value"),
    ("missing messages", "POST", CHAT, with_(OK_CHAT, messages=...), None, 400, "missing_required_parameter"),
    ("messages not a list", "POST", CHAT, with_(OK_CHAT, messages="hi"), None, 400, "invalid_type"),
    (
        "message without role",
        "POST",
        CHAT,
        with_(OK_CHAT, messages=[{"content": "hi"}]),
        None,
        400,
        "missing_required_parameter",
    ),
    (
        "message without content",
        "POST",
        CHAT,
        with_(OK_CHAT, messages=[{"role": "user"}]),
        None,
        400,
        "missing_required_parameter",
    ),
    (
        "message with null content",
        "POST",
        CHAT,
        with_(OK_CHAT, messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]),
        None,
        400,
        "missing_required_parameter",
    ),
    (
        "unknown role",
        "POST",
        CHAT,
        with_(OK_CHAT, messages=[{"role": "wizard", "content": "hi"}]),
        None,
        400,
        "invalid_value",
    ),
    (
        "content a number",
        "POST",
        CHAT,
        with_(OK_CHAT, messages=[{"role": "user", "content": 5}]),
        None,
        400,
        "invalid_type",
    ),
    (
        "image content part",
        "POST",
        CHAT,
        with_(
            OK_CHAT,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        ),
        None,
        400,
        None,
    ),
    ("bad api key", "POST", C, OK_COMPLETION, {"Authorization": "Bearer nope"}, 401, "invalid_api_key"),
    ("no api key", "GET", "/v1/models", None, {"Authorization": ""}, 401, "invalid_api_key"),
    (
        "basic auth",
        "GET",
        "/v1/models",
        None,
        {"Authorization": "Basic c2stdGVzdC1rZXk6"},
        401,
        "invalid_api_key",
    ),
    ("unknown endpoint", "POST", "/v1/embeddings", OK_COMPLETION, None, 404, "not_found"),
    ("unknown model path", "GET", "/v1/models/gpt-4", None, None, 404, "model_not_found"),
    ("wrong method", "GET", C, None, None, 405, "method_not_allowed"),
    (
        "body too large",
        "POST",
        C,
        b'{"model": "tiny", "prompt": "' + b"a" * (5 << 20) + b'"}',
        None,
        413,
        "request_too_large",
    ),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status", "code"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_request(http, server, method, path, body, headers, status, code):
    kwargs = {"headers": headers or {}}
    if isinstance(body, dict):
        kwargs["json"] = body
    elif body is not None:
        kwargs["content"] = body
        kwargs["headers"] = {"Content-Type": "application/json", **kwargs["headers"]}
    response = http.request(method, path, **kwargs)
    error = assert_error_shape(response, status, code)
    if status == 400 and error["code"] not in ("invalid_json",):
        assert error["param"], error
    assert_healthy(server.url)


def test_bad_requests_table_is_large_and_the_server_still_works(http, client):
    assert len(BAD_REQUESTS) >= 20
    r = http.post(C, json=OK_COMPLETION)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


# ---- property-based fuzz of the request body ------------------------------------------------------------

FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "n", "stream", "stream_options", "stop", "seed", "user", "logprobs", "echo", "tools", "response_format",
]  # fmt: skip
DELETE = object()
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers(min_value=-3, max_value=12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant"]),
            "content": st.text(max_size=10)
            | st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=5)}), max_size=2
            ),
        }
    ),
    min_size=1,
    max_size=3,
)
# Valid values only: the mutations below bring the invalid ones.
sampling = {
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 300),
    "seed": st.integers(0, 2**63),
    "n": st.just(1),
    "stream": st.booleans(),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=4),
}


def request_bodies(chat: bool):
    """Mostly well-formed bodies with a few random mutations: unknown keys, wrong types, deleted fields."""
    prompt = st.text(max_size=20) | st.lists(st.integers(-2, 300), max_size=5)
    required = {
        "model": st.just(MODEL),
        ("messages" if chat else "prompt"): messages if chat else prompt,
    }
    base = st.fixed_dictionaries(required, optional=sampling)
    mutation = st.tuples(st.sampled_from(FIELDS) | st.text(max_size=10), st.just(DELETE) | json_values)

    def mutate(args):
        body, changes = args
        for key, value in changes:
            if value is DELETE:
                body.pop(key, None)
            else:
                body[key] = value
        return json.dumps(body).encode()

    return st.tuples(base, st.lists(mutation, max_size=3)).map(mutate)


@pytest.fixture(scope="module")
def fuzz_server(tok):
    """Plain decoding (no draft: validation is what is fuzzed), a short window to bound each answer."""
    target, _ = tiny_pair(len(tok), eos_id=256, seed=2, window=48)
    with live_server(create_app(target, None, tok, method="ar", model_name=MODEL, eos_token_id=EOS)) as live:
        yield live


@settings(
    max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)
@given(st.data())
def test_fuzz_request_body(fuzz_server, data):
    chat = data.draw(st.booleans(), label="chat")
    content = data.draw(request_bodies(chat) | st.binary(max_size=64), label="body")
    url = fuzz_server.url + (CHAT if chat else C)
    r = PLAIN.post(url, content=content, headers={"Content-Type": "application/json"}, timeout=60)
    event(f"status {r.status_code}")
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200:
        assert_error_shape(r, r.status_code)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2]).get("usage") or json.loads(events[-2])["choices"][0]["finish_reason"]
    else:
        data = r.json()
        assert data["choices"][0]["finish_reason"] in ("stop", "length")
        assert (
            data["usage"]["total_tokens"]
            == data["usage"]["prompt_tokens"] + data["usage"]["completion_tokens"]
        )
    health = PLAIN.get(fuzz_server.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["running"] in (0, 1)


# ---- operating limits: memory, admission, origins, prefill, prefix reuse, health ------------------------


def raw_call(app, method: str, path: str, headers: dict, receive) -> tuple[int, dict, bytes]:
    """Drive the ASGI app directly: status, headers and body of its response to one request."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 8000),
    }
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def test_a_request_without_max_tokens_holds_kv_for_what_it_generates(tok):
    window = 1 << 17  # a 128k-token context: 64 MB of KV per model if buffers were sized for it
    target, draft = tiny_pair(len(tok), eos_id=9999, seed=5, window=window)
    app = create_app(target, draft, tok, budget=4, model_name=MODEL, eos_token_id=[], max_model_len=4096)
    engine = app.state.engine
    with live_server(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        assert http.get("/v1/models").json()["data"][0]["context_window"] == 4096
        body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "stream": True}
        with http.stream("POST", CHAT, json=body) as r:
            events = sse_events(r)
            for _ in range(4):
                next(events)
        wait_idle(engine)
        held = engine.pair.prefix_cache.nbytes  # the cancelled generation's target and draft KV
        too_long = {"model": MODEL, "prompt": "x", "max_tokens": 4096}
        assert_error_shape(http.post(C, json=too_long), 400, "context_length_exceeded")
    config = target.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_slot = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    print(f"KV held by a request without max_tokens: {held} bytes (window-sized: {2 * window * per_slot})")
    assert 0 < held <= 2 * 2 * 256 * per_slot
    with pytest.raises(ValueError, match="max_model_len"):
        create_app(target, draft, tok, budget=4, max_model_len=window + 1)


def test_a_full_queue_answers_429_before_reading_the_body(pair, tok):
    app = make_app(pair, tok, max_queue=0, body_timeout=0.3)
    held = app.state.engine.admit()  # the one place there is: a request still sending its body
    reads = 0

    async def endless_body() -> dict:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b" " * 65536, "more_body": True}

    headers = {"content-type": "application/json", "content-length": str(4 << 20)}
    status, response_headers, body = raw_call(app, "POST", C, headers, endless_body)
    assert status == 429 and json.loads(body)["error"]["code"] == "queue_full"
    assert int(response_headers["retry-after"]) >= 1
    assert reads == 0  # refused before a byte of the 4 MiB body was read
    held.release()

    async def stalled_body() -> dict:
        await asyncio.sleep(3600)

    status, _, body = raw_call(app, "POST", C, headers, stalled_body)
    assert status == 408 and json.loads(body)["error"]["code"] == "timeout"
    assert app.state.engine._admitted == 0  # the slow client's place was given back
    app.state.engine.stop()


def test_only_json_bodies_and_only_served_host_names(pair, tok):
    from specexec.server.app import LOOPBACK_HOSTS

    app = make_app(pair, tok, allowed_hosts=LOOPBACK_HOSTS)
    with live_server(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        body = json.dumps(OK_COMPLETION).encode()
        # A web page can POST these cross-origin without a CORS preflight: they must not be parsed.
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None):
            headers = {"Content-Type": content_type} if content_type else {}
            r = http.post(C, content=body, headers=headers)
            assert_error_shape(r, 415, "unsupported_media_type")
        ok = http.post(C, content=body, headers={"Content-Type": "application/json; charset=utf-8"})
        assert ok.status_code == 200
        # DNS rebinding: a page served from another name that resolves to this machine.
        for host in ("evil.example", "evil.example:8000", "localhost.evil.example"):
            r = http.get("/v1/models", headers={"Host": host})
            assert_error_shape(r, 403, "invalid_host")
        for host in ("localhost", f"localhost:{live.port}", f"127.0.0.1:{live.port}", "[::1]:80"):
            assert http.get("/v1/models", headers={"Host": host}).status_code == 200, host


PREFILL_STEP = 0.05  # seconds added to every target forward of the slow-prefill server


def test_a_long_prefill_is_cancelled_within_a_chunk_and_streams_wait_with_keep_alives(tok, monkeypatch):
    from specexec.backends import base as runner_module

    monkeypatch.setattr(runner_module, "PREFILL_CHUNK", 16)
    target, draft = tiny_pair(len(tok), eos_id=9999, seed=1)
    app = create_app(
        target, draft, tok, method="sd", budget=2, model_name=MODEL, eos_token_id=[], keepalive_seconds=0.1
    )
    engine = app.state.engine
    slow = SlowModel(target, PREFILL_STEP)
    prompt = "a long prompt " * 20  # 280 tokens: 18 prefill chunks, about 0.9 s
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    try:
        with live_server(app) as live, httpx.Client(base_url=live.url, timeout=30) as http:
            with pytest.raises(httpx.ReadTimeout):
                http.post(C, json=body, timeout=0.3)  # gives up during the prefill
            gave_up = time.perf_counter()
            wait_idle(engine)
            record = engine.history[-1]
            assert record.finish_reason == "cancelled" and record.steps == 0
            assert record.ended_at - gave_up < 2 * PREFILL_STEP + 0.3
            # A streamed request waiting for its first token gets comments, then its events.
            with http.stream("POST", C, json={**body, "stream": True}) as r:
                lines = [line for line in r.iter_lines() if line]
            assert lines[0] == ": keep-alive", lines[:3]
            assert lines[-1] == "data: [DONE]"
            text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines if line[6:7] == "{")
            slow.remove()
            ids = tok(prompt)["input_ids"]
            out = specexec.generate(
                target, draft, ids, method="sd", budget=2, max_new_tokens=3, eos_token_id=[]
            )
            assert text == tok.decode(out.tokens)
    finally:
        slow.remove()


def test_a_second_chat_turn_prefills_only_what_is_new(pair, tok):
    app = make_app(pair, tok)
    target, _ = pair
    embedded: list[int] = []
    hook = target.get_input_embeddings().register_forward_hook(
        lambda _m, args, _out: embedded.append(args[0].numel())
    )
    try:
        with live_server(app) as live:
            client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)
            messages = [{"role": "user", "content": "write a long story about a cat " * 4}]
            turns = []
            for question in ("and then?", "why?"):
                resp = client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=8, temperature=0
                )
                turns.append(resp)
                messages += [
                    {"role": "assistant", "content": resp.choices[0].message.content},
                    {"role": "user", "content": question},
                ]
            embedded.clear()
            resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    finally:
        hook.remove()
    assert turns[0].usage.prompt_tokens_details.cached_tokens == 0
    cached = resp.usage.prompt_tokens_details.cached_tokens
    assert cached >= turns[1].usage.prompt_tokens  # the whole earlier conversation, and some of its answer
    prefilled = embedded[0]  # the first target forward of the turn is its prefill
    assert prefilled == resp.usage.prompt_tokens - 1 - cached
    text, _ = reference(pair, tok, chat_ids(tok, messages), 8)
    assert resp.choices[0].message.content == text  # reuse changes nothing in the output


def test_health_runs_a_forward_when_none_ran_lately_and_docs_need_the_key(pair, tok):
    target, _ = pair
    forwards: list[int] = []
    hook = target.get_input_embeddings().register_forward_hook(lambda *_: forwards.append(1))
    try:
        app = make_app(pair, tok, api_key=API_KEY, health_interval=0.0)
        with live_server(app) as live:
            for expected in (1, 2):
                health = PLAIN.get(live.url + "/health").json()
                assert health["status"] == "ok" and health["probe_seconds"] > 0
                assert len(forwards) == expected  # one target forward per probe
        app = make_app(pair, tok, api_key=API_KEY, health_interval=3600.0)
        with live_server(app) as live:
            PLAIN.get(live.url + "/health")
            probed = len(forwards)
            assert PLAIN.get(live.url + "/health").json()["status"] == "ok"
            assert len(forwards) == probed  # a recent forward answers for the engine
            for path in ("/docs", "/openapi.json"):
                assert_error_shape(PLAIN.get(live.url + path), 401, "invalid_api_key")
                keyed = PLAIN.get(live.url + path, headers={"Authorization": f"Bearer {API_KEY}"})
                assert keyed.status_code == 200
    finally:
        hook.remove()


# ---- pieces ----------------------------------------------------------------------------------------------


def test_serve_arguments_default_to_loopback():
    import argparse

    from specexec.server.cli import DEFAULT_HOST, DEFAULT_MAX_QUEUE, _bind

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([])
    assert (
        (args.host, args.port, args.max_queue)
        == ("127.0.0.1", 8000, DEFAULT_MAX_QUEUE)
        == (DEFAULT_HOST, 8000, 16)
    )
    assert parser.parse_args(["--api-key", "k", "--max-queue", "0"]).max_queue == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-queue", "-1"])
    taken = _bind("127.0.0.1", 0)
    taken.listen()
    try:
        with pytest.raises(OSError, match="cannot bind"):
            _bind("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()


SERVE_SCRIPT = """
import argparse, sys
from specexec.cli_args import add_model_args
from specexec.server import add_serve_arguments, serve
parser = argparse.ArgumentParser()
add_model_args(parser)
add_serve_arguments(parser)
parser.add_argument("--method")
parser.add_argument("--budget", type=int)
sys.exit(serve(parser.parse_args(sys.argv[1:])))
"""


def test_serve_loads_safetensors_folders_and_answers(tmp_path, pair, tok):
    """`serve` as the CLI runs it: models from safetensors folders, a real port, a bearer key."""
    target, draft = pair
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-c",
        SERVE_SCRIPT,
        "--target",
        str(tmp_path / "target"),
        "--draft",
        str(tmp_path / "draft"),
    ]
    cmd += [
        "--method",
        "specexec",
        "--budget",
        str(BUDGET),
        "--dtype",
        "float32",
        "--port",
        str(port),
        "--api-key",
        "k",
        "--model-name",
        MODEL,
    ]
    env = {**os.environ, "SPECEXEC_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_serving(proc, url, 120)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        ids = tok("served")["input_ids"]
        text, _ = reference(pair, tok, ids, 8)
        resp = client.completions.create(model=MODEL, prompt="served", max_tokens=8, temperature=0)
        assert resp.choices[0].text == text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_an_engine_failure_is_a_500_and_the_server_goes_on(tok):
    target, draft = tiny_pair(len(tok), eos_id=256, seed=3)
    broken = {"on": True}

    def explode(*_):
        if broken["on"]:
            raise RuntimeError("simulated device failure")

    target.register_forward_pre_hook(explode)
    app = create_app(target, draft, tok, budget=4, model_name=MODEL, eos_token_id=EOS)
    with live_server(app) as live, httpx.Client(base_url=live.url, timeout=30) as http:
        for stream in (False, True):
            error = assert_error_shape(http.post(C, json={**OK_COMPLETION, "stream": stream}), 500)
            assert error["type"] == "server_error" and "simulated" not in error["message"]
        health = PLAIN.get(live.url + "/health", timeout=10)  # its probe runs a forward, which fails
        assert health.status_code == 503 and "simulated device failure" in health.json()["error"]
        broken["on"] = False
        assert_healthy(live.url)
        assert http.post(C, json=OK_COMPLETION).status_code == 200
        assert app.state.engine.history[0].finish_reason == "error"


def test_health_probes_while_the_worker_records_a_finished_job(pair, tok, monkeypatch):
    """The worker records a job just after its last update. /health in that window must probe the
    engine, not take the answered job for a generation in progress (CI's race, made certain here)."""
    target, _ = pair
    forwards: list[int] = []
    hook = target.get_input_embeddings().register_forward_hook(lambda *_: forwards.append(1))
    app = make_app(pair, tok, health_interval=0.0)
    engine = app.state.engine
    record = engine._record

    def slow_record(*args) -> None:
        time.sleep(1.0)
        record(*args)

    monkeypatch.setattr(engine, "_record", slow_record)
    try:
        with live_server(app) as live:
            assert PLAIN.post(live.url + C, json=OK_COMPLETION).status_code == 200
            assert engine.busy  # still recording
            before = len(forwards)
            health = PLAIN.get(live.url + "/health").json()
            assert health["status"] == "ok" and len(forwards) == before + 1  # a probe ran
    finally:
        hook.remove()


def test_a_stall_counts_from_the_generations_start_not_the_last_forward(tok):
    """A server idle for longer than the stall limit starts a generation whose first forward is slow:
    /health says ok; only a generation without progress for the limit is a 503."""
    target, draft = tiny_pair(len(tok), eos_id=256, seed=5)
    release = threading.Event()

    def hold(*_) -> None:  # every target forward waits for the test
        release.wait(30)

    hook = target.register_forward_pre_hook(hold)
    app = create_app(target, draft, tok, budget=4, model_name=MODEL, eos_token_id=EOS, health_interval=0.0)
    engine = app.state.engine
    try:
        with live_server(app) as live, ThreadPoolExecutor(1) as pool:
            engine.last_forward = time.perf_counter() - 2 * STALL_SECONDS  # idle since long ago
            answer = pool.submit(PLAIN.post, live.url + C, json=OK_COMPLETION)
            deadline = time.monotonic() + 10
            while engine.seconds_without_progress() is None:
                assert time.monotonic() < deadline, "the generation never started"
                time.sleep(0.01)
            assert PLAIN.get(live.url + "/health").status_code == 200
            engine._running.started_at -= 2 * STALL_SECONDS  # the same generation, stuck that long
            health = PLAIN.get(live.url + "/health")
            assert health.status_code == 503 and "no forward pass" in health.json()["error"]
            release.set()
            assert answer.result(timeout=30).status_code == 200
    finally:
        release.set()
        hook.remove()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "beam"}, "unknown method"),
        ({"draft": None}, "needs a draft"),
        ({"method": "sd", "budget": "auto"}, "budget 'auto'"),
        ({"budget": 0}, "budget must be"),
        ({"budget": "big"}, "budget must be"),
        ({"max_queue": -1}, "max_queue"),
        ({"engine_options": {"seed": 3}}, "engine_options"),
        ({"engine_options": {"beam_width": 3}}, "engine_options"),
    ],
)
def test_create_app_refuses_a_configuration_that_cannot_serve(pair, tok, kwargs, message):
    target, draft = pair
    kwargs = {"draft": draft, **kwargs}
    with pytest.raises(ValueError, match=message):
        create_app(target, kwargs.pop("draft"), tok, **kwargs)


def test_auto_budget_calibrates_once_at_startup(pair, tok, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path))
    app = make_app(pair, tok, budget="auto")
    assert list((tmp_path / "calibration").glob("*.json"))  # measured before the first request
    prompt = "auto budget"
    text, _ = reference(pair, tok, tok(prompt)["input_ids"], 16)  # greedy: the budget changes speed only
    with live_server(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        assert http.get("/v1/models").json()["data"][0]["specexec"] == {
            "method": "specexec",
            "budget": "auto",
        }
        r = http.post(C, json={"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
    # What the auto budget learnt is on disk, and a restarted server starts from it.
    (saved,) = (tmp_path / "learnt").glob("*.json")
    learnt = app.state.engine.pair.options["learnt"]
    (policy,) = learnt._policies.values()
    restarted = make_app(pair, tok, budget="auto").state.engine.pair.options["learnt"]
    assert restarted.path == saved and restarted is not learnt
    assert json.loads(saved.read_text())["policies"] == restarted._saved
    (state,) = restarted._saved.values()
    assert state["gate"] == policy.gate.state()


def test_a_learnt_file_that_cannot_be_written_costs_the_request_nothing(pair, tok, tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    learnt = specexec.LearntPolicies(blocked / "learnt.json")  # its folder would be a file: OSError
    cost = specexec.budget.costs.CostModel({1: 1.0, 1024: 1.2}, {1: 0.05, 128: 0.06})
    app = make_app(pair, tok, budget="auto", engine_options={"learnt": learnt, "cost_model": cost})
    prompt = "unwritable"
    text, _ = reference(pair, tok, tok(prompt)["input_ids"], 8)
    with live_server(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        for _ in range(2):
            r = http.post(C, json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
    assert "could not save what the auto budget learnt" in caplog.text


def test_the_served_model_is_named_after_its_source():
    from specexec.server.cli import _model_id

    assert _model_id("qwen2.5-coder-1.5b") == "qwen2.5-coder-1.5b"
    assert _model_id("/models/Qwen2.5-72B-Instruct-Q4_K_M.gguf") == "Qwen2.5-72B-Instruct-Q4_K_M"
    # A split GGUF is given by its first file; clients call it by the name its files share.
    assert _model_id("/models/qwen2.5-72b-q4_k_m-00001-of-00012.gguf") == "qwen2.5-72b-q4_k_m"
    assert _model_id("/models/my-hf-folder/") == "my-hf-folder"
