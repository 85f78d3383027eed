"""A user stage with worker processes of its own: groups in from one topic, through the stage's function
(and those of the stages placed inside it), out to the next topic.

    pipeline-rl stage --config RUN/config.json --stage short --index 0    # the launcher starts these

Workers of one stage share its input as consumers `<stage><index>` of the consumer group `<stage>`, so
each group goes to one of them (placement.stages.<stage>.replicas of them).

Ordering contract (each group goes on exactly once, or is dropped with its reason):
  1. read groups; a group_id already taken is a second entry of the same group (an actor's write
     retried after a lost reply): acked and counted as dropped (duplicate), as the preprocessors do;
  2. apply the chain (stages/chain.py) and write its drops to the ledger (`<stage>:<reason>`);
  3. write the group that is left to the output topic, stamped with this worker and its input entry
     (metadata["hops"][stage]); 4. ack the input entry; 5. publish progress on trainer_events (a
     PreprocessorProgress under id `<stage><index>`: the actors count its dropped groups as consumed;
     after a read that dropped any, at once, since a blocked actor may wait on them).
A worker killed between 3 and 4 finds, when it restarts with pending entries, the groups it already
wrote on its output topic (by their stamp) and acks those entries instead of writing them again.
Pending entries are never claimed by another worker: a dead worker's groups wait for its restart, as the
preprocessors' do.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import threading
import time
import uuid
from collections import OrderedDict

from inference_shim.faults import fault_point
from pipeline_rl.config import RunConfig, load_run_config
from pipeline_rl.ledger import DUPLICATE, LedgerWriter
from pipeline_rl.messages import PreprocessorProgress, RolloutGroup, StatsRecord
from pipeline_rl.stages.chain import Chain
from pipeline_rl.stages.common import dead_letter, last_progress, ledger_drops
from pipeline_rl.stages.graph import host_input
from pipeline_rl.streams import DEAD_LETTER, STATS, TRAINER_EVENTS, Entry, make_reader, make_writer

log = logging.getLogger("pipeline_rl.stages")

READ_COUNT = 4  # most groups taken per read: few, so that a stage's workers share a burst
PROGRESS_EVERY_S = 1.0
HEARTBEAT_EVERY_S = 5.0
SEEN_GROUPS = 200_000  # group ids remembered for duplicate detection


class StageWorker:
    """One worker of a user stage. `poll()` reads once and passes on what it read; `run()` loops."""

    def __init__(self, cfg: RunConfig, stage: str, index: int) -> None:
        where = cfg.placement.stages.get(stage)
        if stage not in cfg.graph.stages or where is None or not where.replicas:
            raise ValueError(f"no stage {stage!r} with workers of its own in graph {cfg.graph.name!r}")
        if index >= where.replicas:
            log.warning("--index %d is outside placement.stages.%s.replicas=%d", index, stage, where.replicas)
        self.cfg, self.stage, self.index = cfg, stage, index
        self.id = f"{stage}{index}"
        self.chain = Chain.inside(cfg.graph, cfg.placement.stages, stage)
        self.topic = host_input(cfg.graph, cfg.placement.stages, stage)
        self.output = cfg.graph.stages[stage].outputs[0]
        streams = cfg.streams
        self.reader = make_reader(streams, self.topic, group=stage, consumer=self.id, claim_idle_s=None)
        self.writer = make_writer(streams, self.output)
        self.events = make_writer(streams, TRAINER_EVENTS)
        self.stats = make_writer(streams, STATS)
        self.dead_letters = make_writer(streams, DEAD_LETTER)
        self.ledger = LedgerWriter(cfg.run_dir, f"{self.id}-{uuid.uuid4().hex[:12]}")
        self.seen: OrderedDict[str, str] = OrderedDict()
        self.written = self._recover_written()  # input entry id -> group_id, written before a restart
        last = last_progress(cfg, self.id)
        self.groups_in, self.groups_dropped, self.samples_out, self.samples_dropped = (
            (last.groups_in, last.groups_dropped, last.samples_out, last.samples_dropped)
            if last
            else (0, 0, 0, 0)
        )
        self._published: tuple[int, ...] | None = None
        self._last_publish = -math.inf

    def run(self, stop: threading.Event) -> None:
        log.info("%s: reading %s, writing %s", self.id, self.topic, self.output)
        while not stop.is_set():
            self.poll(block_s=1.0)
        self.publish(force=True)
        self.ledger.close()

    def poll(self, block_s: float = 1.0) -> int:
        """Read once and pass every group on; returns the number of groups written."""
        written = 0
        for entry in self.reader.read(count=READ_COUNT, block_s=block_s):
            written += self._take(entry)
        self.publish()
        return written

    def _take(self, entry: Entry) -> int:
        message = entry.message
        if not isinstance(message, RolloutGroup):
            self._dead_letter(entry, f"expected a rollout_group on {self.topic}, got {message.kind}")
            return 0
        if self.written.pop(entry.id, None) == message.group_id:
            # Written on before a restart that came before the ack: ack, never write twice.
            log.info("%s: group %s was written before a restart; acking it", self.id, message.group_id)
            self.seen[message.group_id] = entry.id
            self.reader.ack([entry.id])
            return 0
        if message.group_id in self.seen:
            log.warning(
                "%s: entry %s repeats group %s: dropped as a duplicate", self.id, entry.id, message.group_id
            )
            self.ledger.dropped(DUPLICATE, [s.sample_id for s in message.samples], group=message.group_id)
            self.groups_in += 1
            self.groups_dropped += 1  # one more entry written upstream, so one more consumed
            self.reader.ack([entry.id])
            return 0
        self.seen[message.group_id] = entry.id
        while len(self.seen) > SEEN_GROUPS:
            self.seen.popitem(last=False)
        self.groups_in += 1
        outcome = self.chain.apply(message)
        ledger_drops(self.ledger, outcome.dropped, message.group_id)  # before the ack
        if outcome.error is not None:
            self._dead_letter(entry, outcome.error, counted=True)
            return 0
        if outcome.group is None:
            self.groups_dropped += 1
            self.reader.ack([entry.id])
            return 0
        hops = {**outcome.group.metadata.get("hops", {}), self.stage: {"worker": self.id, "entry": entry.id}}
        self.writer.write(
            outcome.group.model_copy(update={"metadata": {**outcome.group.metadata, "hops": hops}})
        )
        fault_point("stage.written")  # chaos tests: the group is written on, its entry not acked
        self.reader.ack([entry.id])
        self.samples_out += len(outcome.group.samples)
        self.samples_dropped += len(outcome.dropped)
        return 1

    def _recover_written(self) -> dict[str, str]:
        """Input entry id -> group_id of the groups this worker wrote on its output topic, if it restarted
        with pending entries (it may have died between a write and its ack)."""
        written: dict[str, str] = {}
        if not self.reader.pending().get(self.id):
            return written
        reader = make_reader(self.cfg.streams, self.output)
        while entries := reader.read(count=256, block_s=0.0):
            for entry in entries:
                hop = getattr(entry.message, "metadata", {}).get("hops", {}).get(self.stage, {})
                if hop.get("worker") == self.id and "entry" in hop:
                    written[hop["entry"]] = entry.message.group_id
        log.info(
            "%s: restarted with pending entries; %d groups of ours are already written", self.id, len(written)
        )
        return written

    def _dead_letter(self, entry: Entry, error: str, counted: bool = False) -> None:
        dead_letter(self.dead_letters, self.id, self.topic, entry, error)
        if not counted:
            self.groups_in += 1
        self.groups_dropped += 1
        self.reader.ack([entry.id])

    def publish(self, force: bool = False) -> None:
        """Progress when the counts changed (at once for drops: an actor may wait on them), at most every
        PROGRESS_EVERY_S otherwise, and a heartbeat every HEARTBEAT_EVERY_S."""
        now = time.monotonic()
        current = (self.groups_in, self.groups_dropped, self.samples_out, self.samples_dropped)
        new_drops = self._published is not None and current[1::2] != self._published[1::2]
        due = now - self._last_publish >= (
            PROGRESS_EVERY_S if current != self._published else HEARTBEAT_EVERY_S
        )
        if not (force or due or new_drops):
            return
        self.events.write(
            PreprocessorProgress(
                preprocessor_id=self.id,
                groups_in=self.groups_in,
                groups_dropped=self.groups_dropped,
                samples_out=self.samples_out,
                samples_dropped=self.samples_dropped,
            )
        )
        if force or due:
            values = {
                "groups_in": self.groups_in,
                "groups_dropped": self.groups_dropped,
                "samples_out": self.samples_out,
            }
            self.stats.write(StatsRecord(source=self.id, values=values))
            self._last_publish = now
        self._published = current


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pipeline-rl stage", description="One worker of a user stage.")
    parser.add_argument("--config", required=True, help="RUN/config.json written by the launcher")
    parser.add_argument("--stage", required=True, help="the stage's name in the graph")
    parser.add_argument("--index", type=int, default=0, help="this worker's stable index (consumer name)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_run_config(args.config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    StageWorker(cfg, args.stage, args.index).run(stop)


if __name__ == "__main__":
    main()
