"""The run's experiment trackers, fed with the rows the launcher already writes to stats.jsonl.

    trackers = Trackers.start(cfg, run_dir, resumed=False)   # None when tracking is off
    trackers.rows(rows)                  # every row appended to stats.jsonl (stats, version, eval, sample)
    trackers.servers(health_by_url)      # each poll of the servers' /health (the status page's view)
    trackers.finish(summary, plots)      # the end-of-run summary and plots, then every sink closes

The launcher's loop never waits for a tracker: calls only enqueue (a bounded queue: beyond it rows are
dropped and counted), and one thread opens the sinks, turns rows into metrics and calls them. A sink
that raises is logged once, with the error, and left out for the rest of the run: training never stops
for a tracker, and stats.jsonl keeps every value anyway.

Metrics are coalesced before they reach a sink, once per tracking.flush_every_s: the trainer's values
at each of its steps, and the last value of every other key (actors, preprocessors, servers, weight
versions) at the latest step, in one call per step. A tracker's cost then follows the trainer's steps,
not the rows (a preprocessor reports after every group, many times a second), and a tracker stores per
point (MLflow's store: about a millisecond each). Evaluations are never merged: each is its own call.

What a row becomes (one name scheme for every sink): a `stats` row of source S gives `S/<key>` for
each number (trainer/loss, actor0/reward_mean, ...) at the trainer's step (the trainer's own rows carry
it; the others get the latest step seen); a version event gives weights/*; a preprocessor row
preprocessor<i>/*; an evaluation eval/* (eval/accuracy, eval/reward_mean, ...); each server's health
server<i>/weight_version and server<i>/up. Sampled completions (rows of type `sample`, a few per
tracking.samples_every_steps steps from the actors) become one table per such interval.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from pathlib import Path
from typing import Any

from pipeline_rl.references import resolve_callable
from pipeline_rl.tracking.config import TrackingConfig
from pipeline_rl.tracking.sinks import MlflowSink, RunInfo, Sink, TensorBoardSink, WandbSink

SAMPLE_COLUMNS = ["step", "actor", "prompt", "completion", "reward", "grade", "weight_versions"]
_SECRET_KEY = ("token", "password", "secret", "api_key", "apikey", "credential", "passwd")
REDACTED = "[redacted]"


def redacted(data: Any) -> Any:
    """`data` with the value of every key that names a secret replaced, and passwords cut out of URLs:
    a second guard behind public_config, for anything a task's options or a future field might hold."""
    from pipeline_rl.streams.config import redact_url

    if isinstance(data, dict):
        return {
            k: (REDACTED if v and any(s in str(k).lower() for s in _SECRET_KEY) else redacted(v))
            for k, v in data.items()
        }
    if isinstance(data, list):
        return [redacted(v) for v in data]
    if isinstance(data, str) and "://" in data and "@" in data:
        return redact_url(data)
    return data


def build_sinks(cfg: TrackingConfig, run_dir: Path) -> list[Sink]:
    sinks: list[Sink] = []
    if cfg.tensorboard:
        sinks.append(TensorBoardSink())
    if cfg.wandb:
        sinks.append(WandbSink(cfg))
    if cfg.mlflow:
        sinks.append(MlflowSink(cfg))
    for ref in cfg.sinks:
        sinks.append(resolve_callable(ref, "tracking.sinks")(cfg, run_dir))
    return sinks


def _numbers(values: dict, skip: tuple[str, ...] = ("time",)) -> dict[str, float]:
    out = {}
    for key, value in values.items():
        if key in skip or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


class Trackers:
    def __init__(self, cfg: TrackingConfig, run: RunInfo, sinks: list[Sink]) -> None:
        self.cfg = cfg
        self.run = run
        self.sinks = sinks
        self.failed: dict[str, str] = {}  # sink name -> its first error
        self.dropped = 0
        self.step = 0  # the latest trainer step seen
        self._samples: list[list] = []
        self._samples_bucket: int | None = None
        self._pending: dict[int, tuple[dict[str, float], float]] = {}  # step -> (values, latest wall time)
        self._latest: tuple[dict[str, float], float] = ({}, 0.0)  # the other sources' last values, time
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.queue_size)
        self._thread = threading.Thread(target=self._work, name="trackers", daemon=True)

    @classmethod
    def start(cls, run_cfg, run_dir: Path, resumed: bool) -> Trackers | None:
        """The trackers `run_cfg.tracking` turns on, started; None when none is on."""
        from pipeline_rl.config import public_config

        cfg: TrackingConfig = run_cfg.tracking
        if not cfg.enabled:
            return None
        config = redacted(public_config(run_cfg).model_dump(mode="json"))
        run = RunInfo(
            run_dir=Path(run_dir), name=Path(run_dir).resolve().name, config=config, resumed=resumed
        )
        run.tracking_dir.mkdir(parents=True, exist_ok=True)
        trackers = cls(cfg, run, build_sinks(cfg, run.run_dir))
        trackers._thread.start()
        trackers._put(("open",))
        return trackers

    # -- the launcher's side: enqueue only ---------------------------------------------------------
    def _put(self, item: tuple) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1

    def rows(self, rows: list[dict]) -> None:
        if rows:
            self._put(("rows", rows))

    def servers(self, health: dict[str, dict]) -> None:
        self._put(("servers", dict(health), time.time()))

    def finish(self, summary: dict, images: list[Path]) -> None:
        """Log the summary and plots, close every sink (at most tracking.close_timeout_s), say what failed."""
        self._put(("finish", summary, images))
        self._queue.put(("close",))  # blocking: the end must get through even when the queue is full
        self._thread.join(self.cfg.close_timeout_s)
        if self._thread.is_alive():
            print(
                f"tracking: the trackers did not finish within {self.cfg.close_timeout_s:.0f}s "
                "(tracking.close_timeout_s); their last rows may be missing",
                flush=True,
            )
        if self.dropped:
            print(
                f"tracking: {self.dropped} updates dropped (the trackers fell behind; tracking.queue_size); "
                "stats.jsonl has every row",
                flush=True,
            )

    # -- the trackers' thread ----------------------------------------------------------------------
    def _work(self) -> None:
        next_flush = time.monotonic() + self.cfg.flush_every_s
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, next_flush - time.monotonic()))
            except queue.Empty:
                item = None
            if time.monotonic() >= next_flush:
                self._flush_scalars()
                next_flush = time.monotonic() + self.cfg.flush_every_s
            if item is None:
                continue
            kind = item[0]
            if kind == "open":
                self._each("open", self.run)
            elif kind == "rows":
                for row in item[1]:
                    self._row(row)
            elif kind == "servers":
                self._servers(item[1], item[2])
            elif kind == "finish":
                self._flush_scalars()
                self._flush_samples()
                self._each("finish", item[1], [p for p in item[2] if Path(p).is_file()])
            elif kind == "close":
                self._flush_scalars()
                self._each("close")
                return

    def _each(self, method: str, *args) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as e:
                self.sinks.remove(sink)
                self.failed[sink.name] = f"{type(e).__name__}: {e}"
                print(
                    f"tracking: {sink.name} failed in {method} ({self.failed[sink.name]}): it is off for the "
                    "rest of the run; the run goes on and stats.jsonl has every value",
                    flush=True,
                )
                try:
                    sink.close()
                except Exception:  # already reported: one line per failed sink
                    pass

    def _scalars(self, values: dict[str, float], step: int, wall_time: float) -> None:
        """The trainer's values at their step, sent at the next flush."""
        if values:
            merged, latest = self._pending.get(step, ({}, wall_time))
            merged.update(values)
            self._pending[step] = (merged, max(latest, wall_time))

    def _latest_values(self, values: dict[str, float], wall_time: float) -> None:
        """Another source's values: the last of each key is sent at the next flush, at the latest step."""
        merged, latest = self._latest
        merged.update(values)
        self._latest = (merged, max(latest, wall_time))

    def _flush_scalars(self) -> None:
        values, wall_time = self._latest
        if values:
            self._scalars(values, self.step, wall_time)
            self._latest = ({}, 0.0)
        for step in sorted(self._pending):
            values, wall_time = self._pending[step]
            self._each("scalars", values, step, wall_time)
        self._pending = {}

    def _row(self, row: dict) -> None:
        kind, wall_time = row.get("type"), row.get("time") or time.time()
        if kind == "stats":
            source = row.get("source", "unknown")
            values = _numbers(row, skip=("time", "type", "source"))
            named = {f"{source}/{k}": v for k, v in values.items()}
            if source == "trainer" and "step" in values:
                self.step = max(self.step, int(values["step"]))
                # a resumed trainer redoes steps: they land at their own step
                self._scalars(named, int(values["step"]), wall_time)
            else:
                self._latest_values(named, wall_time)
        elif kind == "version":
            self.step = max(self.step, int(row.get("step", 0)))
            values = _numbers(row, skip=("time", "type"))
            if isinstance(row.get("servers"), list):
                values["servers"] = float(len(row["servers"]))
            self._latest_values({f"weights/{k}": v for k, v in values.items()}, wall_time)
        elif kind == "preprocessor":
            name = str(row.get("preprocessor_id", "preprocessor"))
            values = _numbers(row, skip=("time", "type"))
            self._latest_values({f"{name}/{k}": v for k, v in values.items()}, wall_time)
        elif kind == "eval":  # never merged: what came before goes first, then this evaluation alone
            values = _numbers(row, skip=("time", "type"))
            self._flush_scalars()
            if values:
                self._each("scalars", {f"eval/{k}": v for k, v in values.items()}, self.step, wall_time)
        elif kind == "sample":
            self._sample(row)

    def _servers(self, health: dict[str, dict], wall_time: float) -> None:
        values = {}
        for i, (_url, state) in enumerate(sorted(health.items())):
            values[f"server{i}/up"] = 1.0 if state.get("status") == "ok" else 0.0
            if isinstance(state.get("weight_version"), int):
                values[f"server{i}/weight_version"] = float(state["weight_version"])
        self._latest_values(values, wall_time)

    def _sample(self, row: dict) -> None:
        every = self.cfg.samples_every_steps
        if not every:
            return
        bucket = int(row.get("step", 0)) // every
        if self._samples_bucket is not None and bucket != self._samples_bucket:
            self._flush_samples()
        self._samples_bucket = bucket
        if len(self._samples) >= self.cfg.samples_per_table:
            return
        cut = self.cfg.sample_chars
        self._samples.append(
            [
                int(row.get("step", 0)),
                row.get("source", ""),
                str(row.get("prompt", ""))[:cut],
                str(row.get("completion", ""))[:cut],
                row.get("reward"),
                row.get("grade"),
                ",".join(str(v) for v in row.get("weight_versions", [])),
            ]
        )

    def _flush_samples(self) -> None:
        if self._samples and self._samples_bucket is not None:
            self._flush_scalars()  # a tracker's history stays in step order
            step = self._samples_bucket * self.cfg.samples_every_steps
            self._each("table", "samples", list(SAMPLE_COLUMNS), self._samples, step)
        self._samples = []
