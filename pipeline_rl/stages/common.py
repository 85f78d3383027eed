"""What every consumer of rollout groups shares: the preprocessors and the user stages' workers.

totals = last_progress(cfg, "prep0")          # our last published counts, after a restart
ledger_drops(ledger, outcome.dropped, group_id)
"""

from __future__ import annotations

import json
import logging

from pipeline_rl.config import RunConfig
from pipeline_rl.ledger import LedgerWriter
from pipeline_rl.messages import DeadLetter, PreprocessorProgress, decode_message
from pipeline_rl.streams import DEAD_LETTER, TRAINER_EVENTS, Entry, open_store
from pipeline_rl.streams.base import Writer

log = logging.getLogger("pipeline_rl.stages")

RECOVER_EVENTS = 5000  # newest trainer_events searched for a consumer's own last totals after a restart


def last_progress(cfg: RunConfig, consumer_id: str) -> PreprocessorProgress | None:
    """The newest PreprocessorProgress `consumer_id` published: a restarted consumer continues its counts
    from it, so the actors' accounting (the latest value per id) never goes back."""
    store = open_store(cfg.streams, TRAINER_EVENTS)
    for _, payload in store.latest(RECOVER_EVENTS):
        try:
            message = decode_message(store.decode(payload)) if payload is not None else None
        except Exception:  # noqa: BLE001 - malformed events are the consumers' business
            continue
        if isinstance(message, PreprocessorProgress) and message.preprocessor_id == consumer_id:
            log.info("%s: continuing from published totals %s", consumer_id, message)
            return message
    return None


def ledger_drops(ledger: LedgerWriter, dropped: dict[str, str], group_id: str) -> None:
    """One ledger line per reason for the samples of a group dropped (sample id -> reason)."""
    by_reason: dict[str, list[str]] = {}
    for sample_id, reason in dropped.items():
        by_reason.setdefault(reason, []).append(sample_id)
    for reason, ids in by_reason.items():
        ledger.dropped(reason, ids, group=group_id)


def dead_letter(writer: Writer, consumer_id: str, topic: str, entry: Entry, error: str) -> None:
    """Move an entry its reader cannot use to the dead letters (the caller counts it and acks it)."""
    log.warning("%s: entry %s moved to %s: %s", consumer_id, entry.id, DEAD_LETTER, error)
    raw = json.dumps(entry.message.model_dump(mode="json"))[:4096]
    writer.write(DeadLetter(topic=topic, stream_id=entry.id, error=error, raw=raw))
