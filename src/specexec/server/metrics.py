"""Prometheus metrics, in a registry of their own so that several apps can live in one process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_STEP_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "specexec_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.request_latency = Histogram(
            "specexec_request_latency_seconds",
            "Time from request to the end of the response, by endpoint",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generations = Counter(
            "specexec_generations",
            "Generations ended, by finish reason (stop, length, cancelled, error)",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("specexec_prompt_tokens", "Prompt tokens processed", registry=r)
        self.completion_tokens = Counter("specexec_completion_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter(
            "specexec_cached_prompt_tokens", "Prompt tokens whose KV came from the prefix cache", registry=r
        )
        self.target_calls = Counter(
            "specexec_target_calls", "Target model verification passes (one per decoding step)", registry=r
        )
        self.tokens_per_step = Histogram(
            "specexec_tokens_per_step",
            "Tokens committed per target verification pass, one observation per generation",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.prefix_cache_bytes = Gauge(
            "specexec_prefix_cache_bytes", "KV bytes kept for prefix reuse", registry=r
        )
        self.queue_depth = Gauge("specexec_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge("specexec_running", "Generations running now (0 or 1)", registry=r)
        self.queue_wait = Histogram(
            "specexec_queue_wait_seconds",
            "Time a request waited in the queue before its generation started",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            "specexec_time_to_first_token_seconds",
            "Time from a generation's start (after the queue) to its first committed tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generation_time = Histogram(
            "specexec_generation_seconds",
            "Time a generation held the engine",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            "specexec_rejected", "Requests refused with 429 because the queue was full", registry=r
        )
