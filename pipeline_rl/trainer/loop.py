"""The trainer's driver loop, run by every rank (see docs/trainer.md for the whole picture).

Per step, in this order on every rank:
  1. feed.next_package     ranks agree on the next batch (rank 0 picks among complete ones), or on stopping
  2. drop_stale, then      samples more than actor.max_lag versions behind the weights in use are
     train_step            taken out (all ranks agree; the ledger records them as too_stale); then
                           forward/backward of this rank's micro-batches, one optimizer step. If no
                           sample is left, no step is taken: the groups count as consumed, the
                           version stays (rank 0 announces the new consumption), next package
  3. publisher.push        new weights -> every server, version = step (rank 0 sends, all ranks gather)
  4. rank 0 publishes WeightVersionEvent(version, step, consumed) on trainer_events — only after 3
     succeeded, so an actor never sees a version its servers do not serve — and logs the metrics
  5. when due (every trainer.checkpoint_every steps, or trainer.checkpoint_every_s seconds after the
     last checkpoint; rank 0's clock decides for all ranks): checkpoint, then each rank commits its
     stream position
At the end (max_steps, or SIGTERM/SIGINT agreed by all ranks at step 1) a final checkpoint is written.
On resume the servers first get the checkpoint's weights (push with restore=True) and a
WeightVersionEvent announces the restored version.
Ledger (rank 0, <run_dir>/ledger/trainer.jsonl, pipeline_rl/ledger.py): a "resume" line at the start
(the checkpoint's step; later steps of a previous life are redone, so their lines are void), then per
step the too_stale drops and, before the push, the trained sample ids.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pipeline_rl.config import RunConfig
from pipeline_rl.ledger import TOO_STALE, LedgerWriter
from pipeline_rl.messages import TrainingPackage, WeightVersionEvent
from pipeline_rl.streams import TRAINER_EVENTS, Writer, make_writer
from pipeline_rl.trainer import checkpoint
from pipeline_rl.trainer.checkpoint import TrainerState
from pipeline_rl.trainer.dist import Comm, init_comm
from pipeline_rl.trainer.feed import PartitionFeed
from pipeline_rl.trainer.metrics import MetricsLog
from pipeline_rl.trainer.model import load_hf_model
from pipeline_rl.trainer.precision import check_mixed_precision
from pipeline_rl.trainer.step import StepResult, custom_mask_form, drop_stale, train_step
from pipeline_rl.trainer.strategies import Strategy, make_strategy
from pipeline_rl.trainer.weights import WeightPublisher

log = logging.getLogger("pipeline_rl.trainer")


def run(cfg: RunConfig, stop_requested: Callable[[], bool]) -> TrainerState:
    """Train until trainer.max_steps or a stop request; returns the final state. Raises on any failure."""
    t = cfg.trainer
    tr = Trainer.start(cfg)
    while tr.state.step < t.max_steps:
        started = time.perf_counter()
        # A push that failed in the background and could not be got past (push_settle=background)
        # stops the loop too: waiting for data could take long, and finish() raises the failure.
        package = tr.feed.next_package(
            t.data_timeout_s, lambda: stop_requested() or tr.publisher.settle_failed
        )
        if package is None:  # 1
            log.info("stop requested: leaving after step %d", tr.state.step)
            break
        waited = time.perf_counter() - started
        step = tr.state.step + 1
        result = tr.train(package, step)  # 2
        if result is None:  # every sample too stale: consumed, not trained, no new version
            tr.state.groups_consumed += package.batch_groups
            tr.publisher.wait_settled()  # one announcer at a time; the version said is one served
            tr.announce()
            continue
        tr.state.step = tr.state.version = step  # weight version = optimizer steps applied
        tr.state.samples_consumed += result.samples
        tr.state.groups_consumed += result.groups
        tr.state.tokens_consumed += result.trained_tokens
        pushed = time.perf_counter()
        # Resumed without a checkpoint: the servers may serve a later version of the lost life.
        background = t.push_settle == "background" and tr.publisher.enabled
        if background:  # 3, and 4 once every server has applied it
            tr.publisher.push(step, restore=tr.restore_next_push, on_settled=tr.announce)
        else:
            tr.publisher.push(step, restore=tr.restore_next_push)  # 3
        tr.restore_next_push = False
        timings = {"wait_data_s": waited, **result.timings, "weight_push_s": time.perf_counter() - pushed}
        announced = time.perf_counter()
        if not background:
            tr.announce(step)  # 4
        timings["events_s"] = time.perf_counter() - announced
        timings["checkpoint_s"] = tr.checkpoint() if tr.checkpoint_due() else 0.0  # 5
        timings["snapshot_s"] = tr.snapshot() if tr.snapshot_due() else 0.0
        timings["step_s"] = time.perf_counter() - started
        tr.log_step(package.batch_id, result, timings)
    tr.finish()
    return tr.state


@dataclass
class Trainer:
    """Everything one rank holds; built by start(), which restores a checkpoint when resuming."""

    cfg: RunConfig
    comm: Comm
    state: TrainerState
    strategy: Strategy
    feed: PartitionFeed
    publisher: WeightPublisher
    ref_model: torch.nn.Module | None
    events: Writer | None  # rank 0 only
    metrics: MetricsLog | None  # rank 0 only
    saved_step: int
    saved_at: float  # time.monotonic() of the last checkpoint (or of the start), for the time cadence
    ledger: LedgerWriter | None = None  # rank 0 only
    restore_next_push: bool = False  # resumed with no checkpoint: the first push may go back in versions
    served_version: int = 0  # the newest version announced (every server in the group serves it)
    snapshot_at: float | None = (
        None  # time.monotonic() of the last weights snapshot (trainer.snapshot_every_s)
    )

    @classmethod
    def start(cls, cfg: RunConfig) -> Trainer:
        t = cfg.trainer
        comm = init_comm(timeout_s=max(t.data_timeout_s, t.push_timeout_s) + 300)
        check_mixed_precision(t.mixed_precision, comm.device)  # before minutes of steps that look hung
        torch.manual_seed(t.seed)
        ckpt, state = _resume_point(cfg, comm)
        strategy = make_strategy(cfg, comm, ckpt / "model" if ckpt else cfg.model_path)
        if t.micro_batch_layout == "shared_prefix":
            custom_mask_form(strategy.module)  # the model's attention must take the layout's mask
        feed_state = checkpoint.read_feed_state(ckpt, comm.rank) if ckpt else {}
        if ckpt:
            strategy.load_optimizer(ckpt / "optimizer")
        feed = PartitionFeed(
            cfg.streams, comm, start_after=feed_state.get("position"), buffered=feed_state.get("buffered")
        )
        publisher = WeightPublisher(cfg, strategy, comm)
        publisher.connect()
        main = comm.is_main
        resume_step = state.step if ckpt else None
        tr = cls(
            cfg=cfg,
            comm=comm,
            state=state,
            strategy=strategy,
            feed=feed,
            publisher=publisher,
            ref_model=_reference_model(cfg, comm),
            events=make_writer(cfg.streams, TRAINER_EVENTS) if main else None,
            metrics=MetricsLog(cfg.run_dir, cfg.streams, resume_step=resume_step) if main else None,
            ledger=LedgerWriter(cfg.run_dir, "trainer") if main else None,
            saved_step=state.step if ckpt else -1,
            saved_at=time.monotonic(),
            restore_next_push=cfg.trainer.resume and ckpt is None,
            served_version=state.version,
        )
        if tr.ledger is not None:
            tr.ledger.resumed(state.step)  # before anything is trained again: voids later steps' lines
        if ckpt:
            publisher.push(state.version, restore=True)  # servers serve exactly the checkpoint's weights
            tr.announce(state.version)  # actors rewind to the restored version
        log.info(
            "rank %d/%d ready: %s, step %d, version %d",
            comm.rank,
            comm.world,
            strategy.name,
            state.step,
            state.version,
        )
        return tr

    def train(self, package: TrainingPackage, step: int) -> StepResult | None:
        """Drop the too-stale samples, then forward/backward of this rank's micro-batches and one optimizer
        step (collective). None when no sample is left (no step taken)."""
        stale = drop_stale(
            package,
            version=step - 1,  # the weights in use while step `step` is computed
            max_lag=self.cfg.actor.max_lag,
            comm=self.comm,
            pad_token_id=self.cfg.preprocess.replace_token_id,
        )
        if stale.dropped_ids:
            if self.ledger is not None:
                self.ledger.dropped(TOO_STALE, stale.dropped_ids, step=step)
            if self.comm.is_main:
                log.warning(
                    "step %d: %d sample(s) of batch %s more than actor.max_lag=%d versions old: dropped",
                    step,
                    len(stale.dropped_ids),
                    package.batch_id,
                    self.cfg.actor.max_lag,
                )
        if stale.package.batch_samples == 0:
            return None
        result = train_step(
            self.strategy,
            stale.package,
            self.cfg.algo,
            step=step,
            temperature=self.cfg.trainer.temperature,
            comm=self.comm,
            ref_model=self.ref_model,
            layout=self.cfg.trainer.micro_batch_layout,
            mixed_precision=self.cfg.trainer.mixed_precision,
        )
        result.metrics["too_stale"] = len(stale.dropped_ids)
        if self.ledger is not None:
            self.ledger.trained(step, result.sample_ids)  # before the push makes the step visible
        return result

    def announce(self, served: int | None = None) -> None:
        """WeightVersionEvent (rank 0): the progress so far and the newest version every server serves:
        `served`, or the one announced before. Called by the loop after a push that waited, by the
        publisher's settle thread after one that did not; never by both at once (the loop waits for
        the settle thread before it announces)."""
        if served is not None:
            self.served_version = served
        if self.events is not None:
            s = self.state
            event = WeightVersionEvent(
                version=self.served_version,
                step=s.step,
                samples_consumed=s.samples_consumed,
                groups_consumed=s.groups_consumed,
                servers=list(self.publisher.members) if self.publisher.enabled else None,
            )
            self.events.write(event)

    def checkpoint_due(self) -> bool:
        """Whether to checkpoint after the current step (collective when the time cadence is on)."""
        t = self.cfg.trainer
        due = checkpoint.checkpoint_due(
            self.state.step, time.monotonic() - self.saved_at, t.checkpoint_every, t.checkpoint_every_s
        )
        if t.checkpoint_every_s > 0:
            # Clocks differ between ranks and save() is collective: every rank takes rank 0's answer.
            due = self.comm.broadcast_object(due)
        return due

    def snapshot_due(self) -> bool:
        """Whether to save a weights snapshot after the current step (collective when on)."""
        every = self.cfg.trainer.snapshot_every_s
        if every <= 0:
            return False
        due = self.snapshot_at is None or time.monotonic() - self.snapshot_at >= every
        return self.comm.broadcast_object(due)  # save_snapshot is collective: rank 0's clock decides

    def snapshot(self) -> float:
        """Save the current version's weights to run_dir/snapshots (collective). Returns seconds."""
        started = time.perf_counter()
        checkpoint.save_snapshot(
            self.cfg.run_dir,
            self.state.version,
            self.strategy,
            self.comm,
            model_path=self.cfg.model_path,
            bucket_bytes=self.cfg.trainer.bucket_mb * 1024 * 1024,
        )
        self.snapshot_at = time.monotonic()
        return time.perf_counter() - started

    def checkpoint(self) -> float:
        """Write a checkpoint (collective), then commit this rank's stream position. Returns seconds."""
        started = time.perf_counter()
        feed_state = self.feed.state()
        path = checkpoint.save(
            self.cfg.run_dir,
            self.state,
            self.strategy,
            feed_state,
            self.comm,
            model_path=self.cfg.model_path,
            bucket_bytes=self.cfg.trainer.bucket_mb * 1024 * 1024,
            keep=self.cfg.trainer.keep_checkpoints,
        )
        checksums = [c for c in self.state.replica_checksums if c is not None]
        if len(set(checksums)) > 1:
            raise RuntimeError(
                f"DDP replicas diverged at step {self.state.step}: weight checksums {checksums}"
            )
        self.feed.commit(feed_state["position"])  # only now: the checkpoint holds everything before it
        self.saved_step = self.state.step
        self.saved_at = time.monotonic()
        if self.comm.is_main:
            log.info("checkpoint %s written (%.2fs)", path, time.perf_counter() - started)
        return time.perf_counter() - started

    def log_step(self, batch_id: str, result: StepResult, timings: dict) -> None:
        if self.metrics is None:
            return
        s, step_s = self.state, max(timings["step_s"], 1e-9)
        line = {"step": s.step, "version": s.version, "batch_id": batch_id, "time": time.time()}
        line.update(result.metrics)
        line.update(
            samples_per_s=result.samples / step_s,
            tokens_per_s=result.tokens / step_s,
            trained_tokens_per_s=result.trained_tokens / step_s,
            **timings,
            **{k: v for k, v in asdict(s).items() if k.endswith("_consumed")},
        )
        report = self.publisher.last_report
        if report is not None:
            # The push's parts, to tell a slow request (the server's arm waits for its current engine
            # step) from a slow transfer or a slow apply. With push_settle=background they are those
            # of the newest settled push (push_version; this step's may still be settling), and
            # push_settle_wait_s is how long this step's push waited for the one before to settle.
            line.update(
                push_version=report.version,
                push_total_s=report.total_seconds,
                push_settle_wait_s=self.publisher.settle_wait_s,
                push_bytes=report.total_bytes,
                push_max_pause_s=report.max_pause_seconds,
                push_request_s=report.request_seconds,
                push_broadcast_s=report.broadcast_seconds,
                push_max_receive_s=max((r.receive_seconds for r in report.results), default=0.0),
                push_max_apply_s=max((r.apply_seconds for r in report.results), default=0.0),
            )
        if self.publisher.enabled:
            line.update(self.publisher.membership_metrics())
        self.metrics.write(line, batch_id=batch_id, sample_ids=result.sample_ids)

    def finish(self) -> None:
        """Final checkpoint (unless the last step has one), then leave the weight and trainer groups."""
        if self.state.step != self.saved_step:
            self.checkpoint()
        p = self.publisher
        if self.comm.is_main:
            p.wait_settled()  # the last version is announced, or its failure waits for catch_up
        # Servers left out of the group (ejected, restarting) get the final weights if they come back in
        # time; rank 0 alone knows the membership, and the push is collective. So does a group whose
        # last update failed while the trainer went on (push_settle=background).
        if p.enabled and self.state.version > 0 and self.comm.broadcast_object(p.needs_catch_up):
            p.catch_up(self.state.version)
        self.publisher.close()
        if self.ledger is not None:
            self.ledger.close()
        self.strategy.close()
        self.comm.close()


def _resume_point(cfg: RunConfig, comm: Comm) -> tuple[Path | None, TrainerState]:
    fresh = TrainerState(world_size=comm.world, strategy=cfg.trainer.strategy)
    if not cfg.trainer.resume:
        return None, fresh
    # Rank 0 chooses (skipping corrupt checkpoints) and every rank resumes from that one: ranks that chose
    # on their own could disagree if a file changed between their looks.
    chosen = comm.on_main(
        lambda: checkpoint.latest_checkpoint(cfg.run_dir), "choosing the checkpoint to resume from"
    )
    chosen = comm.broadcast_object(None if chosen is None else str(chosen))
    ckpt = None if chosen is None else Path(chosen)
    if ckpt is None:
        if comm.is_main:
            log.warning("trainer.resume=true but no checkpoint in %s: starting from step 0", cfg.run_dir)
        return None, fresh
    state = checkpoint.read_state(ckpt)
    if (state.world_size, state.strategy) != (comm.world, cfg.trainer.strategy):
        raise RuntimeError(
            f"checkpoint {ckpt} was written by {state.world_size} rank(s) of {state.strategy}; this trainer runs "
            f"{comm.world} rank(s) of {cfg.trainer.strategy}: resume with the same trainer.strategy and "
            "trainer.num_processes (stream partitions and optimizer shards depend on them)"
        )
    log.info("resuming from %s (step %d, version %d)", ckpt, state.step, state.version)
    return ckpt, state


def _reference_model(cfg: RunConfig, comm: Comm) -> torch.nn.Module | None:
    """Frozen initial policy for the KL term (the contract has no prompt logprobs, so it runs here)."""
    if cfg.algo.kl_coef <= 0:
        return None
    model = load_hf_model(cfg.model_path, comm.device).eval()
    return model.requires_grad_(False)
