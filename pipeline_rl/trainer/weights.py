"""Getting the trainer's weights into every inference server after every optimizer step.

Rank 0 owns the WeightSender (one standalone weight-transfer group with all servers' workers); the other
ranks only help gather sharded weights. Ordering contract (collective: every rank calls connect() and
push() at the same point of the loop):

  connect(): rank 0 asks every server that still holds a weight group (a previous trainer that died)
             to leave it, then WeightSender.connect(). Every rank learns the outcome; a failure raises on
             every rank (rank 0's message names the servers).
  push(v):   rank 0 runs WeightSender.push(v, metas, fetch). For a sharded strategy every bucket's gather
             is a collective: inside fetch(indices) rank 0 first broadcasts the indices, then all ranks
             gather them together; the others loop on that broadcast until rank 0 broadcasts "done"
             together with the push's outcome (so a refused push, where fetch is never called, cannot
             leave them waiting in a gather). Replicated strategies gather nothing and the other ranks
             only wait for the outcome. With on_settled (trainer.push_settle=background) rank 0 returns
             once the bytes are sent; a thread of its own waits for the servers' results, handles a
             failure there (eject) and calls on_settled, which announces the version. Every later
             use of the sender or the membership on rank 0 first waits for that thread.

Membership (rank 0; trainer.eject_failed_servers, on by default). torch.distributed groups have a fixed
size, so the set of servers changes only when a group forms (the choice and its cost: docs/decisions.md
"Servers that fail, rejoin, join"):
  eject:   a push fails -> every member is probed (GET /health, 3 s: client.answers_http); those that do not
           answer (killed, stopped, cut off) leave the membership, the others form a new group and get
           the same version again (restore: some may hold it already). No trainer restart; the lag gate
           and the version events (they name the servers in the group; actors use only those) keep
           anyone from sampling the ejected server's old weights.
  rejoin:  at a step boundary, at most every trainer.rejoin_check_s, the configured servers outside the
           group are probed; one that answers leaves any stale group and the group forms again with it,
           so the push that follows gives it the current weights (a restarted server answers 503
           awaiting_weights until then).
  The first push after any re-formation (rejoin, eject, fleet change) is a restore: a returning server
  that missed a resumed trainer's restore push (stopped, cut off) still serves the dead trainer's newer
  version, and an ordinary push of an older version number would be refused as stale.
  Without a member (every server down) the push waits for one to come back, up to
  inference.startup_timeout_s, then raises. With ejection off, a failed push raises WeightPushError on
  rank 0 (naming the servers) and RankFailure on the others: the trainer stops, loudly.
In every case the trainer announces a version only once every member serves it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import torch

from inference_shim.client import ShimClient, ShimError, answers_http, leave_weight_group
from inference_shim.procs import wait_healthy
from inference_shim.protocol import AdapterSpec
from inference_shim.weight_sender import (
    PushReport,
    WeightPushError,
    WeightSender,
)
from pipeline_rl.config import LoraConfig, RunConfig
from pipeline_rl.fleet import SERVERS_STARTING_UNTIL_ENV, FleetWatch
from pipeline_rl.trainer.dist import Comm, RankFailure
from pipeline_rl.trainer.lora import adapter_spec as lora_adapter_spec
from pipeline_rl.trainer.model import weight_metas
from pipeline_rl.trainer.strategies import Strategy

log = logging.getLogger("pipeline_rl.trainer.weights")


def adapter_spec(lora: LoraConfig | None) -> AdapterSpec | None:
    """What every push of a LoRA trainer says of its tensors (None: full weights)."""
    return None if lora is None else AdapterSpec(**lora_adapter_spec(lora))


_DONE = "done"
REJOIN_RELEASE_S = 5.0  # a returning server still busy with a stale update is retried at the next check


class WeightPublisher:
    def __init__(self, cfg: RunConfig, strategy: Strategy, comm: Comm) -> None:
        self.cfg = cfg
        self.strategy = strategy
        self.comm = comm
        self.urls = list(cfg.inference.urls)  # the job's servers (fleet.json may change them)
        self.fleet = FleetWatch(cfg.run_dir, self.urls)
        self.members = list(self.urls)  # servers of the current weight group (rank 0)
        self.specs = strategy.weight_specs()
        self.sender: WeightSender | None = None
        self.last_report: PushReport | None = None
        self.ejected_total = 0  # servers taken out of the group after a failed push or join
        self.rejoined_total = 0  # servers (re)admitted after that
        self.rebuild_seconds = 0.0  # time spent re-forming the group (the cost of a membership change)
        self._restore_after_rebuild = False  # a re-formed group's first push may go back in versions
        self._next_rejoin_check = 0.0
        # A push settling in the background (rank 0, push(on_settled=...)): its thread, and a failure
        # that thread could not get past (_recover_from_settle), raised by the next push or catch_up.
        self._settler: threading.Thread | None = None
        self._settle_error: BaseException | None = None
        self.settle_wait_s = 0.0  # how long the last push waited for the one before it to settle
        self._members_behind = False  # a member did not apply the newest version (see _recover_from_settle)

    @property
    def enabled(self) -> bool:
        return bool(self.urls)

    def connect(self) -> None:
        if not self.enabled:
            if self.comm.is_main:
                log.warning("inference.urls is empty: weights are not pushed anywhere (training only)")
            return
        self.comm.on_main(self._connect_main, "joining the weight group")

    def _connect_main(self) -> None:
        t = self.cfg.trainer
        self._wait_servers_started()
        if t.eject_failed_servers:
            # A server that is down now (or cannot leave a dead trainer's group yet) joins later.
            self.members = self._release(self.urls, t.push_timeout_s)
            if not self.members:
                self._wait_for_a_server()
        else:
            for url in self.urls:
                _release_stale_group(url, self.cfg.inference.token, t.push_timeout_s)
        self.sender = WeightSender(
            self.members,
            token=self.cfg.inference.token,
            backend=self.cfg.inference.weight_transport,
            bucket_bytes=t.bucket_mb * 1024 * 1024,
            timeout_s=t.push_timeout_s,
            # The servers connect to this address: loopback on one host, the trainer host's address on
            # several (pipeline_rl/launch/cluster.py sets it from the cluster file).
            master_address=t.weight_address,
            # trainer.lora: the strategy's weights are the adapter's tensors (its weight_specs), pushed as one.
            adapter=adapter_spec(t.lora),
        )
        try:
            self.sender.connect()
        except WeightPushError as e:
            if not t.eject_failed_servers:
                raise
            self._eject(e, "joining", joining=True)
        # The push after connect says itself whether it restores (a resume does); an ejection while
        # joining must not decide that by chance.
        self._restore_after_rebuild = False
        log.info("weight group joined with %d server(s): %s", len(self.members), self.members)

    def _wait_servers_started(self) -> None:
        """The launcher starts the trainer while its servers start (the model load overlaps the engine's
        start-up), with the time by which they must be up: until then, wait for each to answer /health
        with 200 (or 503 awaiting_weights: a resumed run's servers wait for this trainer's push), so the
        group forms with every server. One still not up is then handled as a down server is (left out
        and admitted when it answers, or the join fails)."""
        until = float(os.environ.get(SERVERS_STARTING_UNTIL_ENV) or 0)
        if until <= time.time():  # a trainer restarted later: a down server is left out, not waited for
            return
        for url in self.urls:
            try:
                # awaiting_weights counts: a resumed run's servers wait for this trainer's restore push.
                wait_healthy(url, max(0.0, until - time.time()), awaiting_ok=True)
            except TimeoutError:
                log.warning("%s not healthy by the servers' start-up deadline: joining without it", url)

    def push(
        self,
        version: int,
        *,
        restore: bool = False,
        on_settled: Callable[[int | None], None] | None = None,
    ) -> PushReport | None:
        """Push the current weights as `version` to every server (collective; see module docstring).

        Without `on_settled`, returns once every member serves `version`. With it (rank 0 calls it; the
        trainer announces the version there), returns once the bytes are sent: the servers load and
        swap them while the trainer goes on, and a thread waits for their results and then calls
        on_settled(version). When the results say a server failed, that thread ejects the servers
        that no longer answer at once (see _recover_from_settle); a failure it cannot get past sets
        settle_failed and is raised by the next push (or catch_up)."""
        if not self.enabled:
            return None
        if self.comm.is_main:
            error: BaseException | None = None
            try:
                report = self._push_main(version, restore, settle=on_settled is None)
                if on_settled is None:
                    self.last_report = report
                else:
                    self._settle_in_background(version, on_settled)
            except BaseException as e:  # noqa: BLE001 - reported to the other ranks, then re-raised
                error = e
            if self.comm.distributed:
                outcome = None if error is None else f"{type(error).__name__}: {error}"
                self.comm.broadcast_object((_DONE, outcome))
            if error is not None:
                raise error
            return self.last_report
        while True:
            message = self.comm.broadcast_object(None)
            if message[0] == _DONE:
                if message[1] is not None:
                    raise RankFailure(f"weight push of version {version} failed on rank 0: {message[1]}")
                return None
            self.strategy.gather(message[1])  # our share of a sharded gather

    def _settle_in_background(self, version: int, on_settled: Callable[[int | None], None]) -> None:
        sender = self.sender
        assert sender is not None

        def settle() -> None:
            try:
                report = sender.settle()
            except WeightPushError as e:
                self._recover_from_settle(version, e, on_settled)
                return
            if report is not None:
                self.last_report = report
                self._members_behind = False
                log.info(
                    "version %d applied by every server, %.3fs after its request (max server pause %.3fs)",
                    report.version,
                    report.total_seconds,
                    report.max_pause_seconds,
                )
                on_settled(version)

        def settle_or_keep_the_error() -> None:
            # Anything else that goes wrong here (the announcement's stream write past its retries, a
            # bug) must stop the trainer as it would in the loop: kept, and raised by the next push.
            try:
                settle()
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                log.error("the weight settle thread failed: %s: %s", type(e).__name__, e)
                self._settle_error = e

        self._settler = threading.Thread(target=settle_or_keep_the_error, name="weight-settle", daemon=True)
        self._settler.start()

    def _recover_from_settle(
        self, version: int, error: WeightPushError, on_settled: Callable[[int | None], None]
    ) -> None:
        """In the settle thread, at once (the trainer may be waiting for data that the failed server's
        requests hold up, and actors learn whom to leave from the next announcement): eject the
        servers that do not answer and re-form the group with the rest, as a failed push of the main
        thread does. When every server left reported `version` applied, it is announced with the new
        membership; otherwise the previous version is, and the next push (a restore) brings them up
        to date. When nobody can be ejected (every server answers: retrying cannot help) or ejection
        is off, the error stays (settle_failed): the loop stops waiting for data, and finish() raises
        it through catch_up, so the trainer stops with it, as after a failed push that waited."""
        try:
            if not self.cfg.trainer.eject_failed_servers:
                raise error
            self._eject(error, f"settling version {version}")
        except WeightPushError as e:
            self._settle_error = e
            return
        failed = [u for u in self.members if any(s.startswith(u) for s in error.servers)]
        if failed:
            # They answer, but did not apply it (e.g. their receive broke when a peer died): the next
            # push, a restore to the new group, gives them its version. Meanwhile the actors learn the
            # new membership, with the version every member serves.
            log.warning("version %d did not reach %s: the next push gives them its own", version, failed)
            self._members_behind = True  # at the end of the run, catch_up pushes the last version again
            on_settled(None)
            return
        log.info("version %d is served by every server left in the group: %s", version, self.members)
        on_settled(version)

    @property
    def settle_failed(self) -> bool:
        """Rank 0: the last push settling in the background failed and could not be got past."""
        return self._settle_error is not None

    @property
    def needs_catch_up(self) -> bool:
        """Rank 0, at the end of the run: some configured server may not serve the last version (out of
        the group, a member that did not apply it, or a failure that the catch_up push raises)."""
        return self.members != self.urls or self.settle_failed or self._members_behind

    def wait_settled(self) -> None:
        """Rank 0: wait for a push settling in the background; its failure stays for the next push.
        The settle has its own deadlines (the results: trainer.push_timeout_s; re-forming the group
        after an ejection, waiting for a server when none is left: inference.startup_timeout_s);
        this one only bounds a stuck thread."""
        settler, self._settler = self._settler, None
        if settler is None:
            return
        started = time.perf_counter()
        limit_s = 2 * self.cfg.trainer.push_timeout_s + self.cfg.inference.startup_timeout_s + 60
        settler.join(limit_s)
        self.settle_wait_s = time.perf_counter() - started
        if settler.is_alive():
            raise WeightPushError(
                f"the last weight update did not settle within {limit_s:.0f}s (trainer.push_timeout_s "
                f"twice + inference.startup_timeout_s + 60 s); its servers: {self.members}",
                self.members,
            )

    def _push_main(self, version: int, restore: bool, settle: bool = True) -> PushReport:
        assert self.sender is not None, "push() before connect()"
        self.wait_settled()  # before anything touches the sender or the group
        metas = [
            m.model_copy(update={"dtype": self.sender.target_dtype or m.dtype})
            for m in weight_metas(self.specs)
        ]

        def fetch(indices: list[int]) -> list[torch.Tensor]:
            if self.strategy.gather_is_collective and self.comm.distributed:
                self.comm.broadcast_object(("gather", indices))
            tensors = self.strategy.gather(indices)
            assert tensors is not None
            return tensors

        self._follow_fleet()
        self._admit_returning()
        restore = restore or self._restore_after_rebuild
        try:
            if self._settle_error is not None:  # the previous version failed in the background
                error, self._settle_error = self._settle_error, None
                raise error
            report = self.sender.push(version, metas, fetch, restore=restore, settle=settle)
        except WeightPushError as e:
            if not self.cfg.trainer.eject_failed_servers:
                raise
            self._eject(e, f"pushing version {version}")
            restore = True  # the members get the same version again; some may hold it already
            report = self.sender.push(version, metas, fetch, restore=restore, settle=settle)
        self._restore_after_rebuild = False
        if report.settled:
            self._members_behind = False
        log.info(
            "pushed version %d%s: %.1f MB in %d bucket(s), %.3fs%s",
            version,
            " (restore)" if restore else "",
            report.total_bytes / 1e6,
            report.num_buckets,
            report.total_seconds,
            f" (max server pause {report.max_pause_seconds:.3f}s)" if report.settled else ", settling",
        )
        return report

    # ------------------------------------------------------------------ membership (rank 0)
    def _eject(self, error: WeightPushError, what: str, joining: bool = False) -> None:
        """After a failed push or join: drop the members that do not answer (joining: also those that
        answer but failed to join; they are tried again at the next rejoin check) and re-form the group
        with the rest (waiting for a server when none is left). Raises the error when nobody is to blame
        (every member answers: retrying a push cannot help) or when nobody comes back in time."""
        gone = [u for u in self.members if not answers_http(u)]
        if not gone and joining:
            gone = [u for u in self.members if any(s.startswith(u) for s in error.servers)]
        if not gone or (joining and len(gone) == len(self.members) and all(map(answers_http, gone))):
            raise error  # nobody to blame, or every member answers yet none can join: a restart may help
        log.warning(
            "%s failed (%s): ejecting %s (not answering); going on with %s",
            what,
            error,
            gone,
            [u for u in self.members if u not in gone],
        )
        self.ejected_total += len(gone)
        self.members = [u for u in self.members if u not in gone]
        self._next_rejoin_check = time.monotonic() + self.cfg.trainer.rejoin_check_s
        if not self.members:
            self._wait_for_a_server()
        try:
            self._rebuild(self.members)
        except WeightPushError as e:  # another one failed meanwhile: each round ejects at least one
            self._eject(e, "re-forming the weight group", joining=True)

    def _wait_for_a_server(self) -> None:
        deadline = time.monotonic() + self.cfg.inference.startup_timeout_s
        log.warning("no server left in the weight group: waiting for one to answer")
        why: dict[str, str] = {}
        while time.monotonic() < deadline:
            answering = [u for u in self.urls if answers_http(u)]
            why = {u: "unreachable (GET /health does not answer)" for u in self.urls if u not in answering}
            back = self._release(answering, REJOIN_RELEASE_S, why)
            if back:
                self.members = back
                self.rejoined_total += len(back)
                return
            time.sleep(1.0)
        reasons = "; ".join(f"{u}: {why.get(u, 'never answered')}" for u in self.urls)
        raise WeightPushError(
            f"no inference server could join the weight group for "
            f"{self.cfg.inference.startup_timeout_s:.0f}s (inference.startup_timeout_s), nothing to push "
            f"to: {reasons}. Are the servers up, and is inference.urls right?",
            self.urls,
        )

    def _follow_fleet(self) -> None:
        """Servers added to or removed from the job (fleet.json): removed ones leave the group now, added
        ones are admitted by _admit_returning."""
        urls = self.fleet.poll()
        if urls is None:
            return
        removed = [u for u in self.members if u not in urls]
        log.info(
            "the job's servers are now %s (added %s, removed %s)",
            urls,
            [u for u in urls if u not in self.urls],
            removed,
        )
        self.urls = urls
        self._next_rejoin_check = 0.0
        if not removed:
            return
        self.members = [u for u in self.members if u in urls]
        for url in removed:  # best effort: a removed server may be gone already
            client = ShimClient(url, token=self.cfg.inference.token, timeout_s=REJOIN_RELEASE_S)
            try:
                leave_weight_group(client, time.monotonic() + REJOIN_RELEASE_S)
            except Exception as e:
                log.info("%s (removed) did not leave the weight group: %s", url, e)
            finally:
                client.close()
        if not self.members:
            self._wait_for_a_server()
        try:
            self._rebuild(self.members)
        except WeightPushError as e:
            self._eject(e, "re-forming the weight group")

    def _admit_returning(self) -> None:
        """At a step boundary: re-form the group with the configured servers that answer again."""
        if len(self.members) == len(self.urls) or time.monotonic() < self._next_rejoin_check:
            return
        self._next_rejoin_check = time.monotonic() + self.cfg.trainer.rejoin_check_s
        outside = [u for u in self.urls if u not in self.members and answers_http(u)]
        back = self._release(outside, REJOIN_RELEASE_S)
        if not back:
            return
        log.info("servers %s answer again: the weight group forms again with them", back)
        self.members = [u for u in self.urls if u in self.members or u in back]
        try:
            self._rebuild(self.members)
        except WeightPushError as e:
            self._eject(e, "re-forming the weight group", joining=True)
        self.rejoined_total += len([u for u in back if u in self.members])

    def _release(self, urls: list[str], timeout_s: float, why: dict[str, str] | None = None) -> list[str]:
        """Ask servers outside our group to leave any old one; those that could (the others: next time,
        with the reason in `why`)."""
        ready = []
        for url in urls:
            try:
                _release_stale_group(url, self.cfg.inference.token, timeout_s)
                ready.append(url)
            except WeightPushError as e:
                log.warning("%s cannot join the weight group now: %s", url, e)
                if why is not None:
                    why[url] = str(e)
        return ready

    def _rebuild(self, members: list[str]) -> None:
        assert self.sender is not None
        started = time.perf_counter()
        self.sender.reconnect(members)
        # A member may come back from before a trainer restart, serving a version newer than ours.
        self._restore_after_rebuild = True
        took = time.perf_counter() - started
        self.rebuild_seconds += took
        log.info("weight group formed again with %s in %.2fs", members, took)

    def catch_up(self, version: int) -> None:
        """At the end of the run (collective): servers outside the group that answer within
        inference.startup_timeout_s (a restart takes that long at most) rejoin and get `version`, so
        every live server ends on the final weights."""
        if not self.enabled:
            return
        if self.comm.is_main:
            self.wait_settled()  # its failure, if any, is raised by the push below
        if self.comm.is_main and self.sender is not None and len(self.members) < len(self.urls):
            deadline = time.monotonic() + self.cfg.inference.startup_timeout_s
            while len(self.members) < len(self.urls) and time.monotonic() < deadline:
                before = len(self.members)
                self._next_rejoin_check = 0.0
                self._admit_returning()
                if len(self.members) == before:
                    time.sleep(1.0)
            log.info("end of run: %d of %d server(s) in the weight group", len(self.members), len(self.urls))
        self.push(version, restore=True)  # members that already hold it load it again: cheap, and simple

    def membership_metrics(self) -> dict[str, float]:
        """For the trainer's metrics line: servers in the group, ejections, rejoins, rebuild time."""
        return {
            "servers_in_group": len(self.members),
            "servers_ejected_total": self.ejected_total,
            "servers_rejoined_total": self.rejoined_total,
            "group_rebuild_s_total": self.rebuild_seconds,
        }

    def close(self) -> None:
        if self._settler is not None:
            try:
                self.wait_settled()
            except WeightPushError as e:  # closing anyway
                log.warning("%s", e)
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def _release_stale_group(url: str, token: str | None, timeout_s: float) -> None:
    """Ask a server still in a weight group (its trainer died) to leave it, so that we can join.

    A server finishing an update from the dead trainer answers 409 update_in_progress until that update
    fails on its own deadline; we retry until `timeout_s`.
    """
    client = ShimClient(url, token=token, timeout_s=min(30.0, timeout_s))
    try:
        if client.debug_state().group is None:
            return
        log.warning("%s still holds a weight group from an earlier trainer: asking it to leave", url)
        leave_weight_group(client, time.monotonic() + timeout_s, poll_s=1.0)
    except ShimError as e:
        raise WeightPushError(f"{url} cannot leave its old weight group: {e}", [url]) from e
    except Exception as e:
        raise WeightPushError(
            f"{url} is unreachable ({type(e).__name__}: {e}); is the server up?", [url]
        ) from e
    finally:
        client.close()
