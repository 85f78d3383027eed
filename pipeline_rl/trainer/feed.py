"""Rank r's training data: its own partition training_data/<r>, read with a positional reader.

Several preprocessors write into every partition, so packages of different batches interleave and a
rank may see batch B before batch A that another rank sees first. The ranks agree on what to train:

Ordering contract of next_package() (collective: every rank calls it once per step):
  1. each rank reads what is new on its partition into its buffer (blocking briefly when it has nothing);
  2. all ranks exchange (stop requested?, deadline passed?, buffered batch ids in arrival order);
  3. every rank computes the same decision from the same exchanged views: stop if any rank was asked
     to stop; else the first batch id in RANK 0's arrival order that every rank holds (rank 0 picks,
     among complete batches); else fail if the deadline passed on any rank; else go to 1.
  4. each rank takes its package of that batch out of its buffer; the others stay buffered.
A batch missing on some rank (a preprocessor died between writing partitions; it redoes the groups
under a new batch id) is never trained; after being passed over ORPHAN_AFTER times it is dropped with
a warning.

The reader position plus the buffered packages are the feed's checkpoint state: a resumed trainer
continues after the position with the same buffer, so nothing is lost or trained twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pipeline_rl.messages import TrainingPackage
from pipeline_rl.streams import StreamsConfig, make_reader, training_partition
from pipeline_rl.trainer.dist import Comm

log = logging.getLogger("pipeline_rl.trainer.feed")

POLL_S = 0.5  # longest a rank blocks on its partition between two exchanges
READ_COUNT = 16
ORPHAN_AFTER = 32


class DataTimeout(TimeoutError):
    """No batch was complete on every rank within trainer.data_timeout_s."""


def commit_name(rank: int) -> str:
    """Reader name under which rank `rank` commits its position (trimming keeps what follows it)."""
    return f"trainer{rank}"


class PartitionFeed:
    def __init__(
        self,
        streams: StreamsConfig,
        comm: Comm,
        *,
        start_after: str | None = None,
        buffered: list[dict] | None = None,
    ) -> None:
        self.comm = comm
        self.topic = training_partition(comm.rank)
        self.reader = make_reader(streams, self.topic, start_after=start_after)
        self.buffer: dict[str, TrainingPackage] = {}
        self.passed_over: dict[str, int] = {}
        for data in buffered or []:
            package = TrainingPackage.model_validate(data)
            self.buffer[package.batch_id] = package

    # ------------------------------------------------------------------ reading
    def _read(self, block_s: float) -> None:
        for entry in self.reader.read(count=READ_COUNT, block_s=block_s):
            package = entry.message
            if not isinstance(package, TrainingPackage):
                log.warning(
                    "%s: skipping %s entry %s (not a training package)", self.topic, package.kind, entry.id
                )
                continue
            if package.rank != self.comm.rank or package.num_ranks != self.comm.world:
                raise RuntimeError(
                    f"{self.topic} holds package {package.batch_id} for rank {package.rank} of "
                    f"{package.num_ranks}, but this is rank {self.comm.rank} of {self.comm.world}: the "
                    "preprocessors and the trainer disagree on trainer.num_processes (restart them with "
                    "the same config, or use a fresh streams.run_name)"
                )
            if package.batch_id in self.buffer:
                log.warning("%s: batch %s delivered twice; keeping the first", self.topic, package.batch_id)
                continue
            self.buffer[package.batch_id] = package

    # ------------------------------------------------------------------ agreement
    def next_package(self, timeout_s: float, stop_requested: Callable[[], bool]) -> TrainingPackage | None:
        """This rank's package of the next batch every rank holds; None when a stop was requested."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._read(block_s=0.0 if self.buffer else POLL_S)
            mine = {
                "stop": stop_requested(),
                "late": time.monotonic() > deadline,
                "batches": [(b, len(p.micro_batches)) for b, p in self.buffer.items()],
            }
            views = self.comm.all_gather_object(mine)
            if any(v["stop"] for v in views):
                return None
            chosen = _choose(views)
            if chosen is not None:
                self._passed(chosen)
                return self.buffer.pop(chosen)
            if any(v["late"] for v in views):
                held = {r: [b for b, _ in v["batches"]][:5] for r, v in enumerate(views)}
                raise DataTimeout(
                    f"no batch was complete on all {self.comm.world} trainer ranks within {timeout_s:.0f}s "
                    f"(trainer.data_timeout_s); buffered batch ids per rank: {held}. Check that the "
                    "preprocessors and actors are running (their logs in the run directory) and that "
                    "they use this run's streams config"
                )

    def _passed(self, chosen: str) -> None:
        """Count how often older buffered packages were passed over; drop the ones that never complete."""
        for batch_id in list(self.buffer):
            if batch_id == chosen:
                break
            count = self.passed_over.get(batch_id, 0) + 1
            self.passed_over[batch_id] = count
            if count == 1:
                log.warning(
                    "%s: batch %s is not on every rank yet; training a later one", self.topic, batch_id
                )
            if count >= ORPHAN_AFTER:
                log.error(
                    "%s: dropping batch %s: never complete on all ranks (a preprocessor died between "
                    "partitions and redid its groups under a new batch id)",
                    self.topic,
                    batch_id,
                )
                del self.buffer[batch_id]
                del self.passed_over[batch_id]

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> dict:
        """Position and untrained packages: with them a resumed trainer loses and repeats nothing."""
        return {
            "topic": self.topic,
            "position": self.reader.position,
            "buffered": [p.model_dump(mode="json") for p in self.buffer.values()],
        }

    def commit(self, position: str) -> None:
        """Tell the stream this rank's data up to `position` is safe in a checkpoint (trimming may proceed)."""
        self.reader.commit(commit_name(self.comm.rank), position)


def _choose(views: list[dict]) -> str | None:
    """First batch id in rank 0's arrival order that every rank holds (same answer on every rank)."""
    held = [dict(v["batches"]) for v in views]
    for batch_id, _ in views[0]["batches"]:
        if all(batch_id in h for h in held):
            counts = [h[batch_id] for h in held]
            if len(set(counts)) != 1:
                raise RuntimeError(
                    f"batch {batch_id} has {counts} micro-batches on ranks 0..{len(counts) - 1}; every rank "
                    "needs the same number (DDP would hang): the preprocessor's partitioning is broken"
                )
            return batch_id
    return None
