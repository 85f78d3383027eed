"""Prometheus metrics of one inference server (GET /metrics), on a private registry per app, and the ASGI
middleware that counts every HTTP answer by route template (never by raw path: labels stay bounded)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from inference_shim.protocol import UpdateResult

# The `route` label of a request that matched no route: one label for every unknown path, so a client
# probing random paths cannot grow the registry.
UNMATCHED_ROUTE = "<unmatched>"

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

        self.reprefilled_tokens = Counter(
            "shim_reprefilled_tokens",
            "Tokens of in-flight requests whose KV an update dropped (kv_after_update=recompute)",
            registry=r,
        )

        self.prefix_cached_tokens = Counter(
            "shim_prefix_cached_tokens",
            "Prompt tokens whose KV came from the engine's prefix cache (vLLM; once per request, for n > 1 one sample's)",
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


class RouteMetricsMiddleware:
    """Pure ASGI: counts each answer as shim_requests_total{route, status}, where `route` is the matched
    route's template (starlette's router puts the route in the scope) or UNMATCHED_ROUTE."""

    def __init__(self, app, metrics: ShimMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client sees when the app raises before answering

        async def capture(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            self.metrics.requests.labels(route=_route_label(scope), status=str(status)).inc()


def _route_label(scope) -> str:
    route = scope.get("route")
    if route is not None:
        return route.path
    # Answered before routing (the guard's 401, 413, 503): a path that IS one of the app's routes keeps
    # its name (the routes here have no path parameters, so a template equals its path).
    app = scope.get("app")
    paths = {getattr(r, "path", None) for r in getattr(app, "routes", ())}
    return scope.get("path") if scope.get("path") in paths else UNMATCHED_ROUTE
