"""The actor process: what `pipeline-rl actor` (and the launcher, one per actor) runs.

    pipeline-rl actor --config RUN/config.json --index 0 [--max-groups N]
    python -m pipeline_rl.actor.main --config RUN/config.json --index 0

SIGTERM/SIGINT stop the actor starting groups; an ActorError or StreamsError exits 1 with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="pipeline-rl actor", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="RUN/config.json written by the launcher")
    parser.add_argument("--index", type=int, required=True, help="this actor's shard, 0..num_actors-1")
    parser.add_argument("--max-groups", type=int, default=None, help="stop after this many groups")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise

    from pipeline_rl.actor.errors import ActorError
    from pipeline_rl.actor.loop import ActorSummary, run_actor
    from pipeline_rl.config import load_run_config
    from pipeline_rl.streams import StreamsError

    cfg = load_run_config(args.config)

    async def run() -> ActorSummary:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await run_actor(cfg, args.index, stop=stop, max_groups=args.max_groups)

    try:
        summary = asyncio.run(run())
    except (ActorError, StreamsError) as err:
        raise SystemExit(f"actor{args.index}: {type(err).__name__}: {err}") from None
    logging.getLogger("pipeline_rl.actor").info(
        "actor%d done: %d groups, %d samples in %.1fs",
        args.index,
        summary.groups_written,
        summary.samples,
        summary.elapsed_s,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
