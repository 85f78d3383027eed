"""An actor's stats records land in the stream in the order it made them (pipeline_rl/actor/loop.py).

A periodic stats write runs in a thread; when the actor stops, the await on it is cancelled but the
thread goes on, and before the fix its older record could land after the final one (CI saw
groups_written 2 of 3 last in the stream). Here the periodic write is made slow and cancelled while it
runs, as stopping does, and the final record must still be the last in the real (files) stream."""

from __future__ import annotations

import asyncio
import threading

from pipeline_rl.actor.loop import Actor
from pipeline_rl.config import RunConfig
from pipeline_rl.streams import STATS, make_reader


def test_a_cancelled_slow_stats_write_cannot_land_after_the_final_one(tmp_path) -> None:
    cfg = RunConfig.model_validate(
        {
            "run_dir": str(tmp_path / "run"),
            "model_path": "/nonexistent/model",
            "streams": {"backend": "files", "files_dir": str(tmp_path / "streams")},
            "inference": {"urls": ["http://127.0.0.1:9"]},  # never contacted here
        }
    )
    actor = Actor(cfg, 0, asyncio.Event(), max_groups=1)
    write = actor.stats.write
    started, release = threading.Event(), threading.Event()

    def slow_first_write(record):
        if not started.is_set():
            started.set()
            release.wait(10)  # the periodic write, stuck in the store while the actor stops
        write(record)

    actor.stats.write = slow_first_write

    async def stop_while_a_write_runs():
        actor.summary.groups_written = 2
        periodic = asyncio.ensure_future(actor._write_stats(actor._stats_record()))
        await asyncio.to_thread(started.wait, 10)
        periodic.cancel()  # what stopping does to the stats loop
        actor.summary.groups_written = 3
        final = asyncio.ensure_future(actor._write_stats(actor._stats_record()))
        await asyncio.sleep(0.2)
        release.set()
        await asyncio.wait_for(final, 10)

    try:
        asyncio.run(stop_while_a_write_runs())
    finally:
        actor.stats_thread.shutdown(wait=True)
    reader = make_reader(cfg.streams, STATS)
    written = [e.message.values["groups_written"] for e in reader.read(count=10, block_s=0)]
    assert written == [2, 3]
