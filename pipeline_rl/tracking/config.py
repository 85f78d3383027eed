"""The `tracking` section of the run config: which experiment trackers receive the run's metrics.

    pipeline-rl launch ... tracking.tensorboard=true tracking.wandb=true tracking.project=my-rl

Torch-free and import-light: every process validates the whole RunConfig.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline_rl.references import is_reference


class TrackingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    wandb: bool = Field(False, description="Log to Weights & Biases (pip install 'pipeline-rl[wandb]').")
    tensorboard: bool = Field(
        False, description="Write TensorBoard event files to <run_dir>/tracking/tensorboard."
    )
    mlflow: bool = Field(
        False, description="Log to MLflow (default store: SQLite in <run_dir>/tracking/mlflow.db)."
    )
    sinks: list[str] = Field(
        default_factory=list,
        description="Trackers of your own, by reference: pkg.module:factory, called with (TrackingConfig, "
        "run directory) and returning an object with the methods of pipeline_rl.tracking.sinks.Sink.",
    )
    project: str = Field("pipeline-rl", description="W&B project and MLflow experiment name.")
    entity: str | None = Field(None, description="W&B entity (team or user); unset: your default.")
    run_name: str | None = Field(
        None, description="Name of the tracker run; unset: the run directory's name."
    )
    tags: list[str] = Field(default_factory=list, description="W&B tags and MLflow tags.")
    group: str | None = Field(None, description="W&B group (runs shown together).")
    wandb_mode: Literal["auto", "online", "offline"] = Field(
        "auto",
        description="auto: online when an API key or login is configured (WANDB_API_KEY, wandb login), "
        "else offline into <run_dir>/tracking/wandb (upload later with `wandb sync`). WANDB_MODE wins.",
    )
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking server or store; unset: sqlite:///<run_dir>/tracking/mlflow.db."
    )
    samples_every_steps: int = Field(
        10, ge=0, description="A table of sampled completions every N trainer steps (0 = none)."
    )
    samples_per_table: int = Field(8, ge=1, le=256, description="Completions in each such table.")
    sample_chars: int = Field(
        2000, ge=1, description="Prompt and completion text is cut to this many characters in tables."
    )
    queue_size: int = Field(
        20000,
        ge=100,
        description="Rows waiting for the trackers; beyond it rows are dropped (counted, said at the end) "
        "rather than slowing the launcher.",
    )
    flush_every_s: float = Field(
        5.0,
        gt=0,
        le=300,
        description="How often metrics reach the trackers: the trainer's values at each of its steps, and "
        "the last value of every other key at the latest step (stats.jsonl has every value).",
    )
    close_timeout_s: float = Field(
        120.0, gt=0, description="At the end of the run: how long the trackers get to flush and close."
    )

    @field_validator("sinks")
    @classmethod
    def _references(cls, sinks: list[str]) -> list[str]:
        for ref in sinks:
            if not is_reference(ref):
                raise ValueError(f"tracking.sinks: {ref!r} is not a reference: write pkg.module:factory")
        return sinks

    @property
    def enabled(self) -> bool:
        return self.wandb or self.tensorboard or self.mlflow or bool(self.sinks)
