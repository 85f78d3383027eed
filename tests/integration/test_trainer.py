"""Trainer pieces against real components, in this process: the partition feed's batches and its
checkpoint state (real Redis), the capture server (tests/support/capture.py) against the real
WeightSender, and the weight group's membership against real servers (SIGSTOP; the torch engine).
The step itself runs server-free in tests/unit/trainer/; multi-rank runs with the real `accelerate
launch` command are test_trainer_dist.py, test_trainer_resume.py and test_trainer_e2e.py.
"""

from __future__ import annotations

import json
import signal
import time

import pytest
import torch
from support.training import CPU, build_packages, hf_model, make_groups, run_config, write_batches

from pipeline_rl.preprocess.ops import group_to_training_samples
from pipeline_rl.trainer.dist import Comm
from pipeline_rl.trainer.feed import PartitionFeed


@pytest.mark.slow  # starts redis-server and, below, real servers
def test_feed_takes_complete_batches_in_order_and_resumes_exactly(redis_server, tiny_model, tmp_path):
    cfg = run_config(tmp_path, redis_server.url, tiny_model)
    comm = Comm(rank=0, world=1, local_rank=0, device=CPU)
    samples = [
        s for g in make_groups(tiny_model, 2, seed=2) for s in group_to_training_samples(g, cfg.preprocess)
    ]
    batches = [build_packages(cfg, samples, f"prep{k % 2}:{k}") for k in range(4)]  # two preprocessors
    write_batches(cfg, batches[:3])
    feed = PartitionFeed(cfg.streams, comm)
    never = lambda: False  # noqa: E731
    assert feed.next_package(5, never).batch_id == "prep0:0"
    feed._read(block_s=0.0)  # prep1:1 and prep0:2 are now buffered, read but untrained
    state = json.loads(json.dumps(feed.state()))  # what a checkpoint holds
    assert [p["batch_id"] for p in state["buffered"]] == ["prep1:1", "prep0:2"]
    feed.commit(state["position"])

    write_batches(cfg, batches[3:])
    resumed = PartitionFeed(cfg.streams, comm, start_after=state["position"], buffered=state["buffered"])
    assert [resumed.next_package(5, never).batch_id for _ in range(3)] == ["prep1:1", "prep0:2", "prep1:3"]
    assert resumed.next_package(5, lambda: True) is None  # a stop request wins over waiting
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="trainer.data_timeout_s"):
        resumed.next_package(0.5, never)
    assert time.monotonic() - start < 5


@pytest.mark.slow
def test_capture_server_receives_pushes_and_refuses_stale_versions(tiny_model):
    from support.capture import CaptureServer

    from inference_shim.weight_sender import WeightPushError, WeightSender

    named = list(hf_model(tiny_model).named_parameters())
    with CaptureServer(tiny_model) as capture:
        sender = WeightSender([capture.url], backend="gloo", timeout_s=30)
        sender.connect()
        try:
            sender.push_tensors(1, named)
            with pytest.raises(WeightPushError, match="stale_version") as raised:
                sender.push_tensors(1, named)
            assert raised.value.servers == [capture.url]
            sender.push_tensors(1, named, restore=True)  # a resumed trainer may go back
        finally:
            sender.close()
        assert [h["version"] for h in capture.history] == [1, 1] and capture.history[1]["restore"]
        assert all(torch.equal(capture.received[n], p.detach()) for n, p in named)


@pytest.mark.slow
def test_a_server_that_missed_a_resumed_trainers_restore_push_rejoins(tiny_model, tmp_path):
    """A trainer pushes version 12 and dies; its successor resumes from an older checkpoint (version 8)
    while one server is SIGSTOPped, so only the other gets the restore push. The stopped server comes back
    still serving version 12: at the next push it rejoins and must take version 9 (the first push to a
    re-formed group is a restore), not refuse it as stale and stop the trainer. Real servers (the torch
    engine: the same contract, quick to start); versions are what is checked, the weights are the same."""
    from support.servers import SERVER_START_S, start_server, stop_process_tree, wait_healthy

    from inference_shim.client import served_version
    from inference_shim.procs import signal_group
    from inference_shim.weight_sender import WeightPushError
    from pipeline_rl.trainer.strategies.ddp import DDPStrategy
    from pipeline_rl.trainer.weights import WeightPublisher

    started = [start_server(tiny_model, tmp_path / f"server{i}.log", backend="torch") for i in range(2)]
    publishers: list[WeightPublisher] = []
    try:
        for i, (url, proc) in enumerate(started):
            wait_healthy(url, SERVER_START_S, proc, tmp_path / f"server{i}.log")
        urls = [url for url, _ in started]
        # push_timeout_s also bounds how long connect waits on the stopped server
        cfg = run_config(tmp_path, "redis://unused:1/0", tiny_model, push_timeout_s=3, rejoin_check_s=0.1)
        cfg.inference.urls = urls
        comm = Comm(rank=0, world=1, local_rank=0, device=CPU)

        def publisher() -> WeightPublisher:
            publishers.append(WeightPublisher(cfg, DDPStrategy(cfg, comm, tiny_model), comm))
            return publishers[-1]

        def served() -> list[int]:
            return [served_version([url]) for url in urls]

        dead_trainer = publisher()
        dead_trainer.connect()
        dead_trainer.push(12)
        dead_trainer.close()
        assert served() == [12, 12]

        stopped = started[1][1]
        signal_group(stopped, signal.SIGSTOP)
        try:
            resumed = publisher()
            resumed.connect()  # the stopped server cannot answer: the group forms without it
            assert resumed.members == urls[:1]
            resumed.push(8, restore=True)
        finally:
            signal_group(stopped, signal.SIGCONT)
        assert served() == [8, 12]
        resumed._next_rejoin_check = 0.0  # the next push looks for returning servers
        resumed.push(9)  # the returning server is admitted first, then gets version 9
        assert resumed.members == urls and resumed.rejoined_total == 1
        assert served() == [9, 9]
        resumed.push(10)
        with pytest.raises(WeightPushError, match="stale_version"):  # ordinary pushes check again
            resumed.push(10)
        assert served() == [10, 10]
    finally:
        for p in publishers:
            p.close()
        for _, proc in started:
            stop_process_tree(proc)
