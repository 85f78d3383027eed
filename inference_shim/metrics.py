"""Prometheus metrics of one inference server (GET /metrics), on a private registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from inference_shim.protocol import UpdateResult

_UPDATE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ShimMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "shim_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.generated_tokens = Counter("shim_generated_tokens", "Completion tokens generated", registry=r)
        self.in_flight = Gauge("shim_in_flight_requests", "Generation requests in flight", registry=r)
        self.weight_version = Gauge("shim_weight_version", "Weight version being served", registry=r)
        self.updates = Counter("shim_weight_updates", "Weight updates by result", ["result"], registry=r)
        self.update_bytes = Counter(
            "shim_weight_update_bytes", "Bytes received in weight updates", registry=r
        )
        self.receive_seconds = Histogram(
            "shim_update_receive_seconds",
            "Time receiving an update (generation continues)",
            buckets=_UPDATE_BUCKETS,
            registry=r,
        )
        self.pause_seconds = Histogram(
            "shim_update_pause_seconds",
            "Time generation was paused to apply an update",
            buckets=_UPDATE_BUCKETS,
            registry=r,
        )

    def record_update(self, result: UpdateResult) -> None:
        self.updates.labels(result="ok").inc()
        self.update_bytes.inc(result.total_bytes)
        self.receive_seconds.observe(result.receive_seconds)
        self.pause_seconds.observe(result.pause_seconds)
        self.weight_version.set(result.version)

    def render(self) -> bytes:
        return generate_latest(self.registry)
