"""Prometheus metrics of one server (prometheus-client, a registry per app), at GET /metrics.

Every name starts with `rapid_`. Acceptance is `rapid_accepted_tokens_total /
rapid_drafted_tokens_total` (docs/algorithm.md section 2: draft tokens the target kept);
`rapid_acceptance_rate` is its distribution over requests.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rapid_integrations.output.outputs import RapidOutput

Scope = MutableMapping[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]
]
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
"""Paths counted by name; any other path is counted as "other" (bounded label values)."""


class Metrics:
    """The server's counters, gauges and histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "rapid_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "rapid_prompt_tokens", "Prompt tokens read by the target", registry=r
        )
        self.completion_tokens = Counter("rapid_completion_tokens", "Tokens generated", registry=r)
        self.drafted_tokens = Counter(
            "rapid_drafted_tokens", "Tokens proposed by the draft", registry=r
        )
        self.accepted_tokens = Counter(
            "rapid_accepted_tokens", "Draft tokens the target accepted", registry=r
        )
        self.cached_prefix_tokens = Counter(
            "rapid_cached_prefix_tokens",
            "Prompt tokens whose KV came from the prefix cache",
            registry=r,
        )
        self.acceptance = Histogram(
            "rapid_acceptance_rate",
            "Accepted / drafted tokens per request",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "rapid_time_to_first_token_seconds",
            "From the request's arrival (queue wait included) to its first text",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.duration = Histogram(
            "rapid_request_duration_seconds", "From arrival to the last token", registry=r
        )
        self.queue_depth = Gauge("rapid_queue_depth", "Requests waiting for a slot", registry=r)
        self.running = Gauge(
            "rapid_running_requests",
            "Sequences holding a slot (a request holds one per choice, n)",
            registry=r,
        )
        self.open_streams = Gauge(
            "rapid_open_streams",
            "Engine calls not yet ended or closed (their KV caches alive)",
            registry=r,
        )
        self.batch_size = Gauge(
            "rapid_batch_size",
            "Calls in the batch (decoding together; prefilling ones included)",
            registry=r,
        )
        self.step_tokens = Histogram(
            "rapid_step_tokens",
            "Tokens one batch step's forward passes read, every call's together "
            "(prefill chunks, pending tokens, drafts)",
            buckets=tuple(2**i for i in range(14)),  # 1 to 8192
            registry=r,
        )

    def queue_changed(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.queue_depth.set(waiting)

    def finished(self, output: RapidOutput, seconds: float) -> None:
        """Count a completed generation."""
        s = output.stats
        self.prompt_tokens.inc(output.prompt_tokens)
        self.completion_tokens.inc(len(output.token_ids))
        self.drafted_tokens.inc(s.drafted_tokens)
        self.accepted_tokens.inc(s.accepted_tokens)
        self.cached_prefix_tokens.inc(s.cached_prefix_tokens)
        if s.drafted_tokens:
            self.acceptance.observe(s.acceptance_rate)
        self.duration.observe(seconds)


class RequestCounter:
    """ASGI middleware counting each HTTP response by route and status (plain ASGI: it leaves
    streaming and disconnect detection alone)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def sending(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.requests.labels(route, str(status)).inc()
