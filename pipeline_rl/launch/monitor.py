"""What the launcher watches while a run goes: stats and trainer events from the streams, server health,
a one-line progress display, and `GET /status` (curl-friendly JSON aggregating every process).

Everything read from the streams is also appended to <run_dir>/stats.jsonl, which the end-of-run report
(pipeline_rl/launch/report.py) plots from, and handed to the run's experiment trackers
(pipeline_rl/tracking/hub.py) when tracking is on: `record` is the one place rows are written.
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from inference_shim.client import ShimClient, ShimError
from pipeline_rl.config import RunConfig
from pipeline_rl.messages import CompletionSample, PreprocessorProgress, StatsRecord, WeightVersionEvent
from pipeline_rl.streams import STATS, TRAINER_EVENTS, make_reader

# How long the launcher's own reads retry a lost Redis: they are for display and for noticing the run's
# end, and the supervision loop that would restart a dead Redis waits while one retries, so they give up
# within seconds (the next poll reads on from where they stopped) instead of the children's deadline.
MONITOR_RETRY_S = 2.0


class RunMonitor:
    def __init__(self, cfg: RunConfig, run_dir: Path, trackers=None) -> None:
        self.cfg = cfg
        self.stats_path = run_dir / "stats.jsonl"
        self.trackers = trackers  # a pipeline_rl.tracking.hub.Trackers, or None
        self.started = time.time()
        self.latest: dict[str, dict] = {}  # source -> latest values
        self.version = 0
        self.last_event: dict | None = None
        self.server_health: dict[str, dict] = {}
        # Same connection pool as the launcher's other calls (op_timeout_s keys it), a shorter retry.
        streams = cfg.streams.model_copy(
            update={"retry_deadline_s": min(cfg.streams.retry_deadline_s, MONITOR_RETRY_S)}
        )
        self._readers = [make_reader(streams, STATS), make_reader(streams, TRAINER_EVENTS)]
        self._lock = threading.Lock()

    def poll_streams(self) -> None:
        """Drain new stats / events (non-blocking) into memory and stats.jsonl."""
        rows = []
        for reader in self._readers:
            for entry in reader.read(count=1000, block_s=0):
                message = entry.message
                if isinstance(message, StatsRecord):
                    row = {"type": "stats", "source": message.source, "time": message.time, **message.values}
                    with self._lock:
                        self.latest[message.source] = row
                elif isinstance(message, WeightVersionEvent):
                    row = {"type": "version", **message.model_dump(exclude={"kind"})}
                    with self._lock:
                        self.version = max(self.version, message.version)
                        self.last_event = row
                elif isinstance(message, PreprocessorProgress):
                    row = {"type": "preprocessor", **message.model_dump(exclude={"kind"})}
                elif isinstance(message, CompletionSample):
                    row = {"type": "sample", **message.model_dump(exclude={"kind"})}
                else:
                    continue
                rows.append(row)
        self.record(rows)

    def record(self, rows: list[dict]) -> None:
        """Append rows to stats.jsonl and hand them to the trackers (the evaluations' rows come here too)."""
        if not rows:
            return
        with self._lock, self.stats_path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        if self.trackers is not None:
            self.trackers.rows(rows)

    def poll_servers(self, urls: list[str]) -> None:
        for url in urls:
            client = ShimClient(url, timeout_s=2.0)
            try:
                health = client.health().model_dump()
            except (httpx.HTTPError, ShimError, ValueError) as e:
                health = {"status": "unreachable", "detail": str(e)}
            finally:
                client.close()
            with self._lock:
                self.server_health[url] = health
        if self.trackers is not None:
            with self._lock:
                self.trackers.servers(self.server_health)

    def progress_line(self) -> str:
        with self._lock:
            trainer = self.latest.get("trainer", {})
            actors = [v for k, v in self.latest.items() if k.startswith("actor")]
            versions = [h.get("weight_version", "?") for h in self.server_health.values()]
        elapsed = time.time() - self.started
        reward = trainer.get("reward", _mean(a.get("reward_mean") for a in actors))
        lag = trainer.get("lag_max", max((a.get("lag_max") or 0 for a in actors), default=None))
        sps = trainer.get("samples_per_s")
        parts = [
            f"[{elapsed:6.0f}s]",
            f"step {self.version}/{self.cfg.trainer.max_steps}",
            f"reward {_fmt(reward)}",
            f"lag max {_fmt(lag, 0)}",
            f"samples/s {_fmt(sps, 1)}",
            f"server versions {versions}",
        ]
        return "  ".join(parts)

    def status(self, children: list) -> dict:
        with self._lock:
            return {
                "run_dir": str(self.stats_path.parent),
                "elapsed_s": round(time.time() - self.started, 1),
                "mode": self.cfg.mode,
                "weight_version": self.version,
                "max_steps": self.cfg.trainer.max_steps,
                "processes": [
                    {
                        "name": c.name,
                        "role": c.spec.role,
                        "pid": c.proc.pid if c.proc else None,
                        "alive": c.alive,
                        "exit_code": c.poll(),
                        "port": c.spec.port,
                    }
                    for c in children
                ],
                "servers": dict(self.server_health),
                "latest_stats": dict(self.latest),
                "last_weight_event": self.last_event,
            }

    def close(self) -> None:
        for reader in self._readers:
            reader.close()


def _mean(values) -> float | None:
    values = [v for v in values if isinstance(v, int | float)]
    return sum(values) / len(values) if values else None


def _fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def serve_status(
    port: int,
    snapshot: Callable[[], dict],
    change_servers: Callable[[dict], tuple[int, dict]] | None = None,
    token: str | None = None,
) -> ThreadingHTTPServer:
    """Start `GET /status` (and `POST /servers`, which needs the run's token: it changes the job) on
    127.0.0.1:port in a daemon thread; returns the server (call .shutdown())."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, payload: dict) -> None:
            body = json.dumps(payload, indent=2, default=str).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path.rstrip("/") not in ("/status", ""):
                self._answer(404, {"error": "not_found", "detail": "try GET /status"})
                return
            self._answer(200, snapshot())

        def do_POST(self):
            if self.path.rstrip("/") != "/servers" or change_servers is None:
                self._answer(404, {"error": "not_found", "detail": "POST /servers only"})
                return
            sent = self.headers.get("authorization", "")
            if token and not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
                self._answer(
                    401, {"error": "unauthorized", "detail": "send the run's token as a Bearer token"}
                )
                return
            try:
                length = int(self.headers.get("content-length") or 0)
                if not 0 < length <= 4096:
                    raise ValueError("a JSON body of at most 4096 bytes")
                body = json.loads(self.rfile.read(length))
                if not isinstance(body, dict):
                    raise ValueError("a JSON object")
            except ValueError as e:
                self._answer(400, {"error": "invalid_request", "detail": f"expected {e}"})
                return
            self._answer(*change_servers(body))

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="status-http", daemon=True).start()
    return server


FINAL_PROBE = {"prompt": "12+7=", "max_tokens": 8, "temperature": 0, "logprobs": 0, "ignore_eos": True}


def final_server_states(urls: list[str], api_key: str | None = None) -> list[dict]:
    """What each server serves at the end of a run: its weight version and a greedy completion of
    FINAL_PROBE with token ids and logprobs (written to <run_dir>/servers_final.json, so anyone can check
    every server against the final checkpoint). A server that does not answer gets an `error`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    states = []
    for url in urls:
        try:
            version = httpx.get(f"{url}/health", timeout=10).json()["weight_version"]
            answer = httpx.post(f"{url}/v1/completions", json=FINAL_PROBE, headers=headers, timeout=60)
            answer.raise_for_status()
            body = answer.json()
            choice = body["choices"][0]
            states.append(
                {
                    "url": url,
                    "weight_version": version,
                    "prompt_token_ids": body["prompt_token_ids"],
                    "token_ids": choice["token_ids"],
                    "logprobs": choice["logprobs"]["token_logprobs"],
                }
            )
        except (httpx.HTTPError, KeyError, ValueError) as e:
            states.append({"url": url, "error": f"{type(e).__name__}: {e}"})
    return states


def record_servers_final(urls: list[str], run_dir: Path, api_key: str | None = None) -> None:
    """final_server_states -> <run_dir>/servers_final.json, and one line on stdout."""
    states = final_server_states(urls, api_key)
    (run_dir / "servers_final.json").write_text(json.dumps(states, indent=2) + "\n")
    versions = {s["url"]: s.get("weight_version", s.get("error")) for s in states}
    print(f"servers at the end: {versions}", flush=True)
