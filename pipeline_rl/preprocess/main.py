"""The preprocessor process: rollout groups in, one TrainingPackage per trainer rank out.

    pipeline-rl preprocess --config RUN/config.json --index 0      # the launcher starts one per index

It reads complete groups from `rollouts` (or the topic the graph gives its first stage: docs/graph.md) as
consumer `prep<index>` of the consumer group "preprocess" (several preprocessors share the work; each
group goes to one of them), applies the graph's user stages placed inside it, turns every group into training
samples (advantages, DAPO dynamic sampling, truncation: pipeline_rl.preprocess.ops), accumulates WHOLE
groups until the batch holds at least trainer.batch_size samples (exactly batch_size when no sample was
dropped), packs them into micro-batches of <= preprocess.seq_length tokens, spreads those over the
trainer.num_processes ranks (same number of micro-batches on every rank) and writes one TrainingPackage
per rank to training_data/<rank>, all with the same batch_id.

Ordering contract (each group is trained exactly once):
  1. read groups (they stay pending, unacknowledged, while the batch fills);
  2. write the batch's packages to training_data/0, /1, ... /N-1, in that order;
  3. ack the batch's groups; 4. publish PreprocessorProgress (totals) on trainer_events.
  Groups that dynamic sampling drops (or that are malformed: dead-lettered) produce nothing and are acked
  at once. A crash inside 2 leaves an incomplete batch; trainers only train batch_ids present on every
  rank, so it is never trained, and the restarted preprocessor redoes its groups into a new batch. A crash
  between 2 and 3 leaves complete packages whose groups are still pending: on restart the preprocessor
  reads the group_ids (and entry_ids) of its own packages on the last partition (written last, so
  complete) and acks those entries instead of writing them twice. The trainer counts them as consumed
  when it trains that batch, so acking them uncounted keeps the actors' gate arithmetic exact.
  Duplicates: a second rollouts entry of a group this preprocessor already took (a different entry id
  with the same group_id, e.g. a write retried after a lost reply) is acked and COUNTED as dropped
  (reason duplicate): it is one more entry in the actors' written count W, so it must be one more in
  their consumed count C, or their gate would never open again (pipeline_rl/actor/gate.py).
  Ledger (pipeline_rl/ledger.py, <run_dir>/ledger/prep<index>-<boot>.jsonl): every sample dropped here
  is appended with its reason before its group is acked or packed.
  Pending groups are never claimed by another preprocessor (claim_idle_s=None): a live preprocessor
  holds its groups unacked for as long as a batch takes to fill, so a claim would duplicate them. A
  dead preprocessor's groups wait, pending, until a preprocessor with the same --index reads the same
  stream again. Nothing restarts it automatically: the launcher stops the whole run when any child dies,
  and its private Redis keeps nothing on disk. The groups survive on a stream that outlives the run
  (streams.redis_url, or the files backend): relaunch with trainer.resume=true, or run
  `<run_dir>/cmd/preprocessor<index>.sh`, and they are redone.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from pipeline_rl.config import RunConfig, load_run_config
from pipeline_rl.ledger import DUPLICATE, MALFORMED, LedgerWriter
from pipeline_rl.messages import (
    PreprocessorProgress,
    RolloutGroup,
    StatsRecord,
    TrainingPackage,
    TrainingSample,
)
from pipeline_rl.preprocess.ops import (
    PreprocessConfig,
    assign_partitions,
    convert_group,
    pack_micro_batches,
)
from pipeline_rl.stages.chain import Chain
from pipeline_rl.stages.common import dead_letter, last_progress, ledger_drops
from pipeline_rl.stages.graph import host_input, stages_of_kind
from pipeline_rl.streams import (
    DEAD_LETTER,
    STATS,
    TRAINER_EVENTS,
    Entry,
    make_reader,
    make_writer,
    training_partition,
)

log = logging.getLogger("pipeline_rl.preprocess")

GROUP = "preprocess"  # consumer group of all preprocessors on `rollouts`
READ_COUNT = 64  # most groups taken per read
PROGRESS_EVERY_S = 1.0  # most frequent progress for changes other than drops, and stats rows
HEARTBEAT_EVERY_S = 5.0  # progress + stats even when nothing changed
SEEN_GROUPS = 200_000  # group ids remembered for duplicate detection (~100 bytes each)


@dataclass
class _Held:
    """A group read and turned into samples, waiting for its batch to fill (not acked yet)."""

    entry_id: str
    group: RolloutGroup
    samples: list[TrainingSample]


@dataclass
class Totals:
    """Counts since the run started (restored from trainer_events after a restart)."""

    groups_in: int = 0
    groups_dropped: int = 0
    samples_out: int = 0
    samples_dropped: int = 0  # single samples dropped from groups that went on (the actors' gate counts them)
    batches_out: int = 0
    last_batch: dict[str, float] = field(default_factory=dict)


def resolve_preprocess_config(cfg: RunConfig) -> PreprocessConfig:
    """cfg.preprocess, with vocab_size read from the model's config.json when unset (so out-of-vocabulary
    ids are replaced here instead of crashing the trainer's embedding lookup)."""
    pcfg = cfg.preprocess
    model_config = Path(cfg.model_path) / "config.json"
    if pcfg.vocab_size is None and model_config.is_file():
        vocab = json.loads(model_config.read_text()).get("vocab_size")
        if isinstance(vocab, int) and vocab > pcfg.replace_token_id:
            pcfg = pcfg.model_copy(update={"vocab_size": vocab})
    return pcfg


class Preprocessor:
    """One preprocessor. `poll()` does one read and writes every batch that filled; `run()` loops."""

    def __init__(self, cfg: RunConfig, index: int) -> None:
        self.cfg = cfg
        self.index = index
        self.id = f"prep{index}"
        self.pcfg = resolve_preprocess_config(cfg)
        self.num_ranks = cfg.trainer.num_processes
        self.batch_size = cfg.trainer.batch_size
        streams = cfg.streams
        # The graph's user stages placed inside the advantages stage run here first, on what the first of
        # them reads (rollouts in the shipped graphs).
        (stage,) = stages_of_kind(cfg.graph, "advantages")
        self.chain = Chain.inside(cfg.graph, cfg.placement.stages, stage)
        self.topic = host_input(cfg.graph, cfg.placement.stages, stage)
        self.reader = make_reader(streams, self.topic, group=GROUP, consumer=self.id, claim_idle_s=None)
        self.partitions = [make_writer(streams, training_partition(r)) for r in range(self.num_ranks)]
        self.events = make_writer(streams, TRAINER_EVENTS)
        self.stats = make_writer(streams, STATS)
        self.dead_letters = make_writer(streams, DEAD_LETTER)
        self.held: list[_Held] = []
        # Batch ids must never repeat, also across restarts (even within one millisecond): a random boot id.
        self._boot = uuid.uuid4().hex[:12]
        self._seq = 0
        self.ledger = LedgerWriter(cfg.run_dir, f"{self.id}-{self._boot}")
        self.totals = self._recover_totals()
        # group_id -> rollouts entry id of every group taken (recent ones), or of our packages found at
        # a restart (entry id None: a package written before packages carried entry ids).
        self._seen: OrderedDict[str, str | None] = self._recover_written_groups()
        self._recovered = set(self._seen)  # taken in a package before a restart, entry not acked yet
        self._published: tuple[int, ...] | None = None
        self._last_publish = -math.inf  # the first publish is due (time.monotonic() starts at boot)

    # ------------------------------------------------------------------ main loop
    def run(self, stop: threading.Event) -> None:
        log.info("%s: reading %s, writing %d partitions", self.id, self.topic, self.num_ranks)
        while not stop.is_set():
            self.poll(block_s=1.0)
        self.publish(force=True)
        self.ledger.close()
        log.info("%s: stopped with %d groups held (they stay pending for a restart)", self.id, len(self.held))

    def poll(self, block_s: float = 1.0) -> int:
        """Read once, write every batch that is full; returns the number of batches written."""
        # Read only what the next batch still needs, so several preprocessors share the groups.
        need = math.ceil(max(self.batch_size - self._held_samples(), 1) / self.cfg.actor.attempts)
        for entry in self.reader.read(count=min(need, READ_COUNT), block_s=block_s):
            self._take(entry)
        written = 0
        while self._held_samples() >= self.batch_size:
            self._write_batch()
            written += 1
        self.publish(force=written > 0)
        return written

    # ------------------------------------------------------------------ groups in
    def _take(self, entry: Entry) -> None:
        message = entry.message
        if not isinstance(message, RolloutGroup):
            self._dead_letter(entry, f"expected a rollout_group on {self.topic}, got {message.kind}")
            return
        group_id = message.group_id
        if group_id in self._seen:
            first_entry = self._seen[group_id]
            if group_id in self._recovered and first_entry in (entry.id, None):
                # Written in a package before a crash that came before the ack: ack, never write twice.
                # Not counted: the trainer counts it as consumed when it trains that package.
                log.info("%s: group %s was written before a restart; acking it", self.id, group_id)
                self._recovered.discard(group_id)
                self._seen[group_id] = entry.id
                self.reader.ack([entry.id])
                return
            log.warning(
                "%s: entry %s repeats group %s (first seen as entry %s): dropped as a duplicate",
                self.id,
                entry.id,
                group_id,
                first_entry,
            )
            self.ledger.dropped(DUPLICATE, [s.sample_id for s in message.samples], group=group_id)
            self.totals.groups_in += 1
            self.totals.groups_dropped += 1  # one more entry written, so one more consumed
            self.reader.ack([entry.id])
            return
        self._remember(group_id, entry.id)
        self.totals.groups_in += 1
        outcome = self.chain.apply(message)
        ledger_drops(self.ledger, outcome.dropped, group_id)  # before the ack / the package
        if outcome.error is not None:
            self._dead_letter(entry, outcome.error, counted=True)
            return
        if outcome.group is None:  # every sample dropped by a user stage: consumed, produces nothing
            self.totals.groups_dropped += 1
            self.reader.ack([entry.id])
            return
        message = outcome.group
        try:
            converted = convert_group(message, self.pcfg)
        except ValueError as err:  # malformed group (e.g. logprobs missing): bad data, not a crash
            self.ledger.dropped(MALFORMED, [s.sample_id for s in message.samples], group=group_id)
            self._dead_letter(entry, str(err), counted=True)
            return
        ledger_drops(self.ledger, converted.dropped, group_id)  # before the ack / the package
        if not converted.samples:
            # Dynamic sampling (all rewards equal) or nothing trainable: consumed, produces nothing.
            self.totals.groups_dropped += 1
            self.reader.ack([entry.id])
            return
        self.totals.samples_dropped += len(outcome.dropped) + len(converted.dropped)
        self.held.append(_Held(entry.id, message, converted.samples))

    def _remember(self, group_id: str, entry_id: str) -> None:
        self._seen[group_id] = entry_id
        while len(self._seen) > SEEN_GROUPS:
            self._seen.popitem(last=False)

    def _dead_letter(self, entry: Entry, error: str, counted: bool = False) -> None:
        dead_letter(self.dead_letters, self.id, self.topic, entry, error)
        if not counted:
            self.totals.groups_in += 1
        self.totals.groups_dropped += 1  # consumed: actors must not wait for it
        self.reader.ack([entry.id])

    def _held_samples(self) -> int:
        return sum(len(h.samples) for h in self.held)

    # ------------------------------------------------------------------ batches out
    def _write_batch(self) -> None:
        taken: list[_Held] = []
        count = 0
        while count < self.batch_size:  # whole groups, oldest first (stream order)
            held = self.held.pop(0)
            taken.append(held)
            count += len(held.samples)
        samples = [s for h in taken for s in h.samples]
        # The shared_prefix layout shares a prompt only within a micro-batch: keep each group in one.
        keep_groups = self.cfg.trainer.micro_batch_layout == "shared_prefix"
        micro_batches = pack_micro_batches(samples, self.pcfg.seq_length, keep_groups)
        parts = assign_partitions(micro_batches, self.num_ranks, self.pcfg.replace_token_id)
        batch_id = f"{self.id}:{self._boot}-{self._seq}"
        common = dict(
            batch_id=batch_id,
            num_ranks=self.num_ranks,
            batch_samples=len(samples),
            batch_tokens=sum(sum(s.labels_mask) for s in samples),
            batch_groups=len(taken),
            group_ids=[h.group.group_id for h in taken],
            entry_ids=[h.entry_id for h in taken],
        )
        # Partition order matters: the last partition is written last, so a package found there means
        # the whole batch is out (see the module docstring).
        for rank, writer in enumerate(self.partitions):
            writer.write(TrainingPackage(rank=rank, micro_batches=parts[rank], **common))
        self.reader.ack([h.entry_id for h in taken])
        self._seq += 1
        self.totals.samples_out += len(samples)
        self.totals.batches_out += 1
        rewards = [s.reward for s in samples]
        self.totals.last_batch = {
            "reward_mean": sum(rewards) / len(rewards),
            "zero_advantage_frac": sum(not any(s.advantages) for s in samples) / len(samples),
            "micro_batches_per_rank": len(parts[0]),
            "batch_tokens": common["batch_tokens"],
        }

    # ------------------------------------------------------------------ progress
    def publish(self, force: bool = False) -> None:
        """PreprocessorProgress when the totals changed, at most every PROGRESS_EVERY_S, but at once when
        groups were dropped; stats at most every PROGRESS_EVERY_S.

        Drops go out at once because an actor may be blocked on them: a dropped group frees its place
        under the lag and buffer limits (actor/gate.py), and until the actor hears of it, it cannot start
        the groups that replace it. With max_lag 0 (sync) every refill of a batch that dynamic sampling
        thinned waited for this event; held back for up to PROGRESS_EVERY_S plus one blocking read, it
        cost up to ~2 s per refill round.
        """
        t = self.totals
        now = time.monotonic()
        current = (t.groups_in, t.groups_dropped, t.samples_out, t.samples_dropped)
        changed = current != self._published
        new_drops = self._published is not None and current[1::2] != self._published[1::2]
        due = now - self._last_publish >= (PROGRESS_EVERY_S if changed else HEARTBEAT_EVERY_S)
        if not (force or due or new_drops):
            return
        self.events.write(
            PreprocessorProgress(
                preprocessor_id=self.id,
                groups_in=t.groups_in,
                groups_dropped=t.groups_dropped,
                samples_out=t.samples_out,
                samples_dropped=t.samples_dropped,
            )
        )
        values: dict[str, float | int | str | None] = {
            "groups_in": t.groups_in,
            "groups_dropped": t.groups_dropped,
            "samples_out": t.samples_out,
            "batches_out": t.batches_out,
            "groups_held": len(self.held),
            **t.last_batch,
        }
        if force or due:
            self.stats.write(StatsRecord(source=f"preprocessor{self.index}", values=values))
            self._last_publish = now
        self._published = current

    # ------------------------------------------------------------------ restart recovery
    def _recover_totals(self) -> Totals:
        """Our last published totals, so that actors' accounting (latest value per id) never goes back."""
        last = last_progress(self.cfg, self.id)
        if last is None:
            return Totals()
        return Totals(last.groups_in, last.groups_dropped, last.samples_out, last.samples_dropped)

    def _recover_written_groups(self) -> OrderedDict[str, str | None]:
        """group_id -> entry id of our packages already on the last partition, if we restarted with
        pending groups (entry id None for packages written without entry_ids)."""
        written: OrderedDict[str, str | None] = OrderedDict()
        if not self.reader.pending().get(self.id):
            return written
        reader = make_reader(self.cfg.streams, training_partition(self.num_ranks - 1))
        while entries := reader.read(count=256, block_s=0.0):
            for entry in entries:
                package = entry.message
                if isinstance(package, TrainingPackage) and package.batch_id.startswith(f"{self.id}:"):
                    entry_ids = package.entry_ids or [None] * len(package.group_ids)
                    written.update(zip(package.group_ids, entry_ids, strict=True))
        if written:
            log.info(
                "%s: %d groups of ours were already written; pending ones are acked", self.id, len(written)
            )
        return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="pipeline-rl preprocess", description="Rollout groups -> training packages (one per rank)."
    )
    parser.add_argument("--config", required=True, help="RUN/config.json written by the launcher")
    parser.add_argument(
        "--index", type=int, default=0, help="this preprocessor's stable index (consumer name)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_run_config(args.config)
    if not 0 <= args.index < cfg.num_preprocessors:
        log.warning("--index %d is outside num_preprocessors=%d", args.index, cfg.num_preprocessors)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    Preprocessor(cfg, args.index).run(stop)


if __name__ == "__main__":
    main()
