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
             only wait for the outcome.
  A failed push raises WeightPushError on rank 0 (naming the servers) and RankFailure on the others:
  the trainer stops, loudly. It never continues with servers that serve other weights.
"""

from __future__ import annotations

import logging
import time

import torch

from inference_shim.client import ShimClient, ShimError
from inference_shim.weight_sender import PushReport, WeightPushError, WeightSender, leave_weight_group
from pipeline_rl.config import RunConfig
from pipeline_rl.trainer.dist import Comm, RankFailure
from pipeline_rl.trainer.model import weight_metas
from pipeline_rl.trainer.strategies import Strategy

log = logging.getLogger("pipeline_rl.trainer.weights")

_DONE = "done"


class WeightPublisher:
    def __init__(self, cfg: RunConfig, strategy: Strategy, comm: Comm) -> None:
        self.cfg = cfg
        self.strategy = strategy
        self.comm = comm
        self.urls = list(cfg.inference.urls)
        self.specs = strategy.weight_specs()
        self.sender: WeightSender | None = None
        self.last_report: PushReport | None = None

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
        for url in self.urls:
            _release_stale_group(url, self.cfg.inference.token, t.push_timeout_s)
        self.sender = WeightSender(
            self.urls,
            token=self.cfg.inference.token,
            backend=self.cfg.inference.weight_transport,
            bucket_bytes=t.bucket_mb * 1024 * 1024,
            timeout_s=t.push_timeout_s,
            # The servers connect to this address: loopback on one host, the trainer host's address on
            # several (pipeline_rl/launch/cluster.py sets it from the cluster file).
            master_address=t.weight_address,
        )
        self.sender.connect()
        log.info("weight group joined with %d server(s): %s", len(self.urls), self.urls)

    def push(self, version: int, *, restore: bool = False) -> PushReport | None:
        """Push the current weights as `version` to every server (collective; see module docstring)."""
        if not self.enabled:
            return None
        if self.comm.is_main:
            error: BaseException | None = None
            try:
                self.last_report = self._push_main(version, restore)
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

    def _push_main(self, version: int, restore: bool) -> PushReport:
        assert self.sender is not None, "push() before connect()"
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

        report = self.sender.push(version, metas, fetch, restore=restore)
        log.info(
            "pushed version %d%s: %.1f MB in %d bucket(s), %.3fs (max server pause %.3fs)",
            version,
            " (restore)" if restore else "",
            report.total_bytes / 1e6,
            report.num_buckets,
            report.total_seconds,
            report.max_pause_seconds,
        )
        return report

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def _release_stale_group(url: str, token: str | None, timeout_s: float) -> None:
    """Ask a server still in a weight group (its trainer died) to leave it, so that we can join.

    A server finishing an update from the dead trainer answers 409 update_in_progress until that update
    fails on its own deadline; we retry until `timeout_s`.
    """
    client = ShimClient(url, token=token, timeout_s=30.0)
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
