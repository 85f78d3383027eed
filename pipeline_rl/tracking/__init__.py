"""Experiment tracking: TensorBoard, Weights & Biases, MLflow, or a sink of your own, fed from the rows
the launcher writes to stats.jsonl (config: pipeline_rl/tracking/config.py; the interface and the
shipped sinks: sinks.py; the fan-out on a thread of its own: hub.py)."""

from pipeline_rl.tracking.config import TrackingConfig

__all__ = ["TrackingConfig"]
