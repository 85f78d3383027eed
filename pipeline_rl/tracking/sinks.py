"""The one interface every experiment tracker implements, and the three shipped: TensorBoard, W&B, MLflow.

A sink receives what the hub (pipeline_rl/tracking/hub.py) derives from the run's rows, on the hub's
thread, one call at a time:

    open(run)                          the run starts (or resumes): its name, directory and redacted config
    scalars(values, step, wall_time)   metrics at a trainer step; wall_time is when they were measured
    table(key, columns, rows, step)    sampled completions
    finish(summary, images)            the run's summary.json values and its plots (PNG files)
    close()                            flush and let go; also called after a failure

Each tracker's own package is imported in `open` only, so a run without it never imports it. A sink
keeps what it needs to continue the same tracker run after a resume in <run_dir>/tracking/.
"""

from __future__ import annotations

import json
import netrc
import os
import re
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from pipeline_rl.tracking.config import TrackingConfig


@dataclass(frozen=True)
class RunInfo:
    run_dir: Path
    name: str
    config: dict  # the resolved run config, secrets redacted
    resumed: bool  # the trainer resumes from a checkpoint: continue the tracker run

    @property
    def tracking_dir(self) -> Path:
        return self.run_dir / "tracking"


class Sink(Protocol):
    name: str

    def open(self, run: RunInfo) -> None: ...
    def scalars(self, values: dict[str, float], step: int, wall_time: float) -> None: ...
    def table(self, key: str, columns: list[str], rows: list[list], step: int) -> None: ...
    def finish(self, summary: dict, images: list[Path]) -> None: ...
    def close(self) -> None: ...


def _ids_file(run: RunInfo, name: str) -> Path:
    return run.tracking_dir / f"{name}.json"


def _load_id(run: RunInfo, name: str) -> str | None:
    path = _ids_file(run, name)
    if run.resumed and path.is_file():
        return json.loads(path.read_text()).get("run_id")
    return None


def _save_id(run: RunInfo, name: str, run_id: str) -> None:
    _ids_file(run, name).write_text(json.dumps({"run_id": run_id}) + "\n")


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    head = path.read_bytes()[:24]
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG file")
    return struct.unpack(">II", head[16:24])


def markdown_table(columns: list[str], rows: list[list]) -> str:
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class TensorBoardSink:
    """Event files in <run_dir>/tracking/tensorboard (`tensorboard --logdir <run_dir>/tracking`): scalars at
    the trainer step with their wall time, the config and the sampled completions as text, the plots as
    images. Written with TensorBoard's own event writer and protos; TensorFlow is not needed."""

    name = "tensorboard"

    def open(self, run: RunInfo) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._pb = (event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2)
        self.logdir = run.tracking_dir / "tensorboard"
        self.writer = EventFileWriter(str(self.logdir))  # a resumed run adds a file beside the first
        self._text("config", "```\n" + json.dumps(run.config, indent=2) + "\n```", 0)

    def _event(self, step: int, values: list, wall_time: float | None = None) -> None:
        event_pb2, summary_pb2, *_ = self._pb
        summary = summary_pb2.Summary(value=values)
        self.writer.add_event(event_pb2.Event(wall_time=wall_time or time.time(), step=step, summary=summary))

    def _text(self, tag: str, text: str, step: int) -> None:
        _, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2 = self._pb
        plugin = summary_pb2.SummaryMetadata.PluginData(plugin_name="text")
        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING,
            string_val=[text.encode()],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(),
        )
        metadata = summary_pb2.SummaryMetadata(plugin_data=plugin)
        self._event(step, [summary_pb2.Summary.Value(tag=tag, metadata=metadata, tensor=tensor)])

    def scalars(self, values: dict[str, float], step: int, wall_time: float) -> None:
        _, summary_pb2, *_ = self._pb
        self._event(
            step, [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in values.items()], wall_time
        )

    def table(self, key: str, columns: list[str], rows: list[list], step: int) -> None:
        self._text(key, markdown_table(columns, rows), step)

    def finish(self, summary: dict, images: list[Path]) -> None:
        _, summary_pb2, *_ = self._pb
        self._text("summary", "```\n" + json.dumps(summary, indent=2) + "\n```", 0)
        for path in images:
            width, height = _png_size(path)
            image = summary_pb2.Summary.Image(
                height=height, width=width, colorspace=4, encoded_image_string=path.read_bytes()
            )
            self._event(0, [summary_pb2.Summary.Value(tag=f"plots/{path.stem}", image=image)])
        self.writer.flush()

    def close(self) -> None:
        if getattr(self, "writer", None) is not None:
            self.writer.close()


def wandb_logged_in() -> bool:
    """An API key in the environment, or `wandb login`'s entry in ~/.netrc for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbSink:
    """A W&B run: scalars with `trainer/step` as their x-axis (and `elapsed_s`; W&B keeps wall time
    itself), the redacted config, a wandb.Table per sampled-completions table, the plots as images and
    the summary at the end. Offline into <run_dir>/tracking/wandb when no API key or login is configured
    (it says so, and how to upload). Console capture, code and git state are off: the run's output and
    remotes stay out of the tracker. A resumed run continues the same W&B run (its id is kept)."""

    name = "wandb"

    def __init__(self, cfg: TrackingConfig) -> None:
        self.cfg = cfg
        self.run = None
        self.offline_dir: Path | None = None

    def _mode(self) -> str:
        if os.environ.get("WANDB_MODE"):
            return os.environ["WANDB_MODE"]
        if self.cfg.wandb_mode != "auto":
            return self.cfg.wandb_mode
        return "online" if wandb_logged_in() else "offline"

    def open(self, run: RunInfo) -> None:
        root = run.tracking_dir
        # W&B stages artifacts and caches under the home directory by default: keep them in the run.
        os.environ.setdefault("WANDB_DATA_DIR", str(root / "wandb-data"))
        os.environ.setdefault("WANDB_CACHE_DIR", str(root / "wandb-cache"))
        import wandb

        mode = self._mode()
        if mode == "offline":
            print(
                f"tracking: W&B offline (no API key or login found: WANDB_API_KEY or `wandb login`), "
                f"writing to {root / 'wandb'}",
                flush=True,
            )
        run_id = _load_id(run, self.name) or uuid.uuid4().hex[:12]
        settings = wandb.Settings(
            mode=mode,
            console="off",
            save_code=False,
            disable_git=True,
            disable_code=True,
            disable_job_creation=True,
            x_save_requirements=False,
            silent=True,
        )
        self.run = wandb.init(
            project=self.cfg.project,
            entity=self.cfg.entity,
            name=self.cfg.run_name or run.name,
            tags=self.cfg.tags or None,
            group=self.cfg.group,
            config=run.config,
            dir=str(root),
            id=run_id,
            resume="allow",
            settings=settings,
        )
        _save_id(run, self.name, run_id)
        self.run.define_metric("trainer/step")
        self.run.define_metric("*", step_metric="trainer/step")
        self.offline_dir = Path(self.run.dir).parent if mode == "offline" else None

    def scalars(self, values: dict[str, float], step: int, wall_time: float) -> None:
        self.run.log({**values, "trainer/step": step})

    def table(self, key: str, columns: list[str], rows: list[list], step: int) -> None:
        import wandb

        self.run.log({key: wandb.Table(columns=columns, data=rows), "trainer/step": step})

    def finish(self, summary: dict, images: list[Path]) -> None:
        import wandb

        if images:
            self.run.log({f"plots/{p.stem}": wandb.Image(str(p)) for p in images})
        for key, value in summary.items():
            self.run.summary[key] = value

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
            if self.offline_dir is not None:
                print(f"tracking: upload the W&B run with: wandb sync {self.offline_dir}", flush=True)


_MLFLOW_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")


class MlflowSink:
    """An MLflow run in experiment `tracking.project`: every scalar as a metric at its step and time, the
    config flattened into params (and whole, as config.json), sampled completions and the summary as
    JSON artifacts, the plots as artifacts. The store defaults to SQLite in the run directory
    (`mlflow ui --backend-store-uri sqlite:///<run_dir>/tracking/mlflow.db`, with the full mlflow
    package); a resumed run continues the same MLflow run."""

    name = "mlflow"

    def __init__(self, cfg: TrackingConfig) -> None:
        self.cfg = cfg
        self.client = None
        self.run_id: str | None = None

    def open(self, run: RunInfo) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = self.cfg.mlflow_tracking_uri or f"sqlite:///{(run.tracking_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(self.cfg.project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            local = self.cfg.mlflow_tracking_uri is None  # a server chooses its own artifact store
            location = (run.tracking_dir / "mlflow-artifacts").resolve().as_uri() if local else None
            experiment_id = self.client.create_experiment(self.cfg.project, artifact_location=location)
        self.run_id = _load_id(run, self.name)
        if self.run_id is None:
            tags = {t: "true" for t in self.cfg.tags}
            created = self.client.create_run(experiment_id, run_name=self.cfg.run_name or run.name, tags=tags)
            self.run_id = created.info.run_id
            _save_id(run, self.name, self.run_id)
            params = [Param(k[:250], str(v)[:6000]) for k, v in _flatten(run.config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a call
                self.client.log_batch(self.run_id, params=params[i : i + 100])
            self.client.log_dict(self.run_id, run.config, "config.json")
        else:
            self.client.update_run(self.run_id, status="RUNNING")

    def scalars(self, values: dict[str, float], step: int, wall_time: float) -> None:
        from mlflow.entities import Metric

        ms = int(wall_time * 1000)
        metrics = [Metric(_MLFLOW_KEY.sub("_", k), v, ms, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def table(self, key: str, columns: list[str], rows: list[list], step: int) -> None:
        self.client.log_dict(self.run_id, {"columns": columns, "data": rows}, f"{key}/step_{step:08d}.json")

    def finish(self, summary: dict, images: list[Path]) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")
        for path in images:
            self.client.log_artifact(self.run_id, str(path), "plots")
        numbers = {k: v for k, v in summary.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if numbers:
            self.scalars({f"summary/{k}": float(v) for k, v in numbers.items()}, 0, time.time())

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, "FINISHED")
            self.client = None


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat
