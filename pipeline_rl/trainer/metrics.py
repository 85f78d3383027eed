"""Where the trainer's per-step numbers go (rank 0 only): the `stats` stream and two files in the run dir.

  <run_dir>/trainer_metrics.jsonl   one JSON object per step: step, version, loss, reward, entropy, kl,
                                    clip_frac, ess, logprob_mismatch(_max), lag_min/mean/max, grad_norm,
                                    lr, samples/s, tokens/s, time breakdown, consumption counters
  <run_dir>/trained_samples.jsonl   one line per step: step, version, batch_id, the sample ids trained
  stream `stats`                    StatsRecord(source="trainer", values=<the metrics line>)
A resumed trainer first cuts both files back to the checkpoint's step (it redoes the later steps), so
each file holds every step exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline_rl.messages import StatsRecord
from pipeline_rl.streams import STATS, StreamsConfig, make_writer
from pipeline_rl.trainer.checkpoint import truncate_jsonl

METRICS_FILE = "trainer_metrics.jsonl"
SAMPLES_FILE = "trained_samples.jsonl"


class MetricsLog:
    def __init__(self, run_dir: str | Path, streams: StreamsConfig, *, resume_step: int | None) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            for name in (METRICS_FILE, SAMPLES_FILE):
                truncate_jsonl(self.dir / name, resume_step)
        self.stats = make_writer(streams, STATS)

    def write(self, metrics: dict, *, batch_id: str, sample_ids: list[str]) -> None:
        """Append one step (fsync-free: the checkpoint, not these files, is the source of truth)."""
        self._append(METRICS_FILE, metrics)
        record = {
            "step": metrics["step"],
            "version": metrics["version"],
            "batch_id": batch_id,
            "sample_ids": sample_ids,
        }
        self._append(SAMPLES_FILE, record)
        values = {k: v for k, v in metrics.items() if isinstance(v, int | float | str) or v is None}
        self.stats.write(StatsRecord(source="trainer", values=values))

    def _append(self, name: str, data: dict) -> None:
        with open(self.dir / name, "a") as f:
            f.write(json.dumps(data) + "\n")
