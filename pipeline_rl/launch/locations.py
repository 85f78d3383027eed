"""Where a run's untrained samples wait, read by the launcher at a clean stop (before Redis stops):
the places of the ledger's positive accounting (pipeline_rl/ledger.py, "Positive accounting").

    rollouts (not acknowledged by the preprocessors)   pending or undelivered group entries (and the
                                                      same for every topic a user stage's workers read)
    carried (not acknowledged by the actor)           answers a sync round cut (partial rollouts)
    training_data/<r> (after rank r's checkpoint)       packages the rank had not read when it saved
    trainer rank <r> checkpoint (read, not trained)     packages its last checkpoint holds in its buffer

An acknowledged rollouts entry does not count: its preprocessor wrote the packages (or the drop) first.
What cannot be read (a stream that does not answer, a checkpoint that does not verify) is listed as not
established, so the report never calls a sample lost that may be waiting there.
"""

from __future__ import annotations

from pathlib import Path

from pipeline_rl.config import RunConfig
from pipeline_rl.ledger import CARRIED_PLACE, write_locations
from pipeline_rl.messages import CarriedGroup, RolloutGroup, TrainingPackage
from pipeline_rl.preprocess.main import GROUP as PREPROCESS_GROUP
from pipeline_rl.preprocess.ops import is_padding
from pipeline_rl.stages.graph import RUNTIME, stream_consumers
from pipeline_rl.streams import CARRIED, CARRY_GROUP, open_store, training_partition
from pipeline_rl.streams.base import decode_entry


def _package_ids(package: TrainingPackage) -> list[str]:
    return [s.sample_id for mb in package.micro_batches for s in mb if not is_padding(s)]


def _message_ids(message) -> list[str]:
    if isinstance(message, RolloutGroup):
        return [s.sample_id for s in message.samples]
    if isinstance(message, CarriedGroup):
        return message.sample_ids()
    if isinstance(message, TrainingPackage):
        return _package_ids(message)
    return []


def _stream_ids(
    cfg: RunConfig, topic: str, entries: str, position: str | None = None, group: str = PREPROCESS_GROUP
) -> list[str]:
    store = open_store(cfg.streams, topic)
    try:
        if entries == "unacked":
            raw = store.unacked(group)
        else:
            raw, after = [], position if position is not None else store.start_position
            while page := store.read_after(after, 1000, 0.0):
                raw += page
                after = page[-1][0]
        ids: list[str] = []
        for _, payload in raw:
            try:
                ids += _message_ids(decode_entry(store, payload))
            except Exception:  # noqa: BLE001 - a malformed entry was dead-lettered (and dropped) by its reader
                continue
        return ids
    finally:
        store.close()


def snapshot_locations(cfg: RunConfig, run_dir: Path) -> Path:
    """Write <run_dir>/ledger/locations.json; the path."""
    from pipeline_rl.trainer.checkpoint import latest_checkpoint, read_feed_state

    places: dict[str, list[str]] = {}
    unknown: list[str] = []
    for stage, topic in stream_consumers(cfg.graph, cfg.placement.stages):
        # The preprocessors' consumer group keeps its name; a user stage's workers are the stage's group.
        advantages = RUNTIME[cfg.graph.stages[stage].kind] == "preprocessor"
        group, readers = (PREPROCESS_GROUP, "the preprocessors") if advantages else (stage, f"stage {stage}")
        try:
            places[f"{topic} (not acknowledged by {readers})"] = _stream_ids(
                cfg, topic, "unacked", group=group
            )
        except Exception as e:  # noqa: BLE001 - named in the report instead
            unknown.append(f"{topic}: {type(e).__name__}: {e}")
    if cfg.actor.round_tokens is not None:
        try:
            places[CARRIED_PLACE] = _stream_ids(cfg, CARRIED, "unacked", group=CARRY_GROUP)
        except Exception as e:  # noqa: BLE001 - named in the report instead
            unknown.append(f"{CARRIED}: {type(e).__name__}: {e}")
    try:
        checkpoint = latest_checkpoint(run_dir)
    except Exception as e:  # noqa: BLE001
        checkpoint = None
        unknown.append(f"the trainer's checkpoint: {type(e).__name__}: {e}")
    for rank in range(cfg.trainer.num_processes):
        topic = training_partition(rank)
        position = None
        if checkpoint is not None:
            try:
                feed = read_feed_state(checkpoint, rank)
            except (OSError, ValueError) as e:
                unknown.append(f"trainer rank {rank}'s feed state in {checkpoint.name}: {e}")
                continue
            position = feed.get("position")
            buffered = [TrainingPackage.model_validate(p) for p in feed.get("buffered", [])]
            held = [i for p in buffered for i in _package_ids(p)]
            places[f"trainer rank {rank} checkpoint {checkpoint.name} (read, not trained)"] = held
        try:
            after = "its checkpoint" if position is not None else "its start"
            places[f"{topic} (after {after})"] = _stream_ids(cfg, topic, "after", position)
        except Exception as e:  # noqa: BLE001
            unknown.append(f"{topic}: {type(e).__name__}: {e}")
    return write_locations(run_dir, places, unknown)
