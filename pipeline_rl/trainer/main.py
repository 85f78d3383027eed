"""Entry point of one trainer rank. Started by `accelerate launch` (see launch_cmd.trainer_command):

    python -m accelerate.commands.launch --config_file pipeline_rl/conf/accelerate/ddp.yaml --num_processes 2 \\
        --main_process_port 29555 -m pipeline_rl.cli train --config runs/x/config.json

Exit status: 0 after trainer.max_steps or after SIGTERM/SIGINT (a final checkpoint is written first;
a second signal aborts at once); 1 on any failure, with the reason last in the log (e.g. which server
refused a weight push). Heavy imports (torch, transformers, deepspeed) happen after argument parsing.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time


class StopFlag:
    """Set by the first SIGTERM/SIGINT; the loop stops at the next step boundary (all ranks agree)."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        if self.requested:  # second signal: the person (or supervisor) means it
            raise KeyboardInterrupt(f"signal {signum} received twice")
        self.requested = True
        logging.getLogger("pipeline_rl.trainer").warning(
            "signal %d: finishing the current step, then checkpointing and exiting", signum
        )

    def __call__(self) -> bool:
        return self.requested


def exit_with_parent(poll_s: float = 1.0) -> None:
    """Kill this rank when its launcher (torchrun's agent) dies.

    torchrun starts ranks in their own sessions, so a SIGKILL of the launcher's process group leaves
    them running: an orphan would keep training and pushing weights next to the trainer that replaces
    it. A graceful stop is unaffected (the agent stays alive while it forwards SIGTERM and waits).
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        logging.getLogger("pipeline_rl.trainer").error("launcher (pid %d) died: killing this rank", parent)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="pipeline-rl train", description="One trainer rank (run under accelerate launch)."
    )
    parser.add_argument("--config", required=True, help="RUN/config.json written by the launcher")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="resume from the newest checkpoint whatever trainer.resume says (the launcher's restart)",
    )
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s trainer[{rank}] %(name)s %(levelname)s %(message)s",
        force=True,
    )
    try:
        import setproctitle

        setproctitle.setproctitle(f"pipeline-rl train:rank{rank}")
    except ImportError:
        pass
    stop = StopFlag()
    stop.install()
    if "RANK" in os.environ:  # started by a launcher (not a plain single-process run)
        exit_with_parent()
    # Every weight push makes a few HTTP calls; their INFO lines would drown the trainer's own.
    logging.getLogger("httpx").setLevel(logging.WARNING)

    from pipeline_rl.config import load_run_config
    from pipeline_rl.trainer.loop import run

    cfg = load_run_config(args.config)
    if args.resume:
        cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"resume": True})})
    try:
        state = run(cfg, stop)
    except BaseException as e:
        logging.getLogger("pipeline_rl.trainer").error("trainer failed: %s: %s", type(e).__name__, e)
        raise
    logging.getLogger("pipeline_rl.trainer").info("done: step %d, version %d", state.step, state.version)
    if "RANK" in os.environ:
        # Everything is written and every group left. Skip the interpreter's teardown: the C++ side
        # of torch.distributed can abort a rank there ("terminate called without an active exception",
        # SIGABRT, seen on a rank that finished before its peer), which would fail a finished run.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
