"""The exact command that starts the trainer ranks: `accelerate launch` with the strategy's config file.

    from pipeline_rl.trainer.launch_cmd import trainer_command
    argv = trainer_command(cfg, "runs/x/config.json")    # the launcher runs this (and writes it to a file)

Contract (what the launcher can rely on):
  * argv[0] is this interpreter; the command is `python -m pipeline_rl.launch.trainer_agent`, which is
    `accelerate launch` (same arguments, no dependence on PATH) except that torchrun's rendezvous store
    listens on the main process address only, not on every interface (see that module);
  * `--config_file conf/accelerate/<trainer.strategy>.yaml` (absolute path) picks the launcher
    (torchrun for ddp/fsdp, accelerate's DeepSpeed launcher for deepspeed_*), `--num_processes` is
    trainer.num_processes, `--main_process_ip 127.0.0.1` and `--main_process_port` a port of it that
    was free when the command was built (the ranks' rendezvous; it is not the weight-transfer port,
    which the trainer picks itself);
  * DeepSpeed strategies also get `--deepspeed_config_file conf/deepspeed/zero{2,3}.json` (absolute);
  * the ranks run `python -m pipeline_rl.cli train --config <config_path>` (pipeline_rl.trainer.main);
  * exit status: 0 after trainer.max_steps; non-zero on any failure (e.g. a server refused a weight push:
    the log's last "trainer failed:" line names it). SIGTERM/SIGINT to the command: torchrun's agent
    forwards it to the ranks, which finish the current step, write a final checkpoint and exit 0 (log:
    "done: step N"), but the agent then re-raises the signal, so the command itself exits 1 with
    "SignalException ... got signal: 15". Treat that as a clean stop when you sent the signal; the agent
    SIGKILLs ranks that take longer than ~30 s. If the command is SIGKILLed, the ranks (own sessions)
    notice within a second and kill themselves (no checkpoint; resume from the previous one).
Environment is the caller's: set OMP_NUM_THREADS per rank (torchrun sets 1 when it is unset).
"""

from __future__ import annotations

import sys
from pathlib import Path

from inference_shim.procs import free_port
from pipeline_rl.config import RunConfig
from pipeline_rl.paths import CONF_DIR


def accelerate_config_file(strategy: str) -> Path:
    path = CONF_DIR / "accelerate" / f"{strategy}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no accelerate config for trainer.strategy={strategy!r} at {path}")
    return path


def trainer_command(cfg: RunConfig, config_path: str) -> list[str]:
    """argv that starts all trainer ranks for `cfg` (config.json already written at `config_path`)."""
    t = cfg.trainer
    argv = [
        sys.executable,
        "-m",
        "pipeline_rl.launch.trainer_agent",
        "--config_file",
        str(accelerate_config_file(t.strategy)),
        "--num_processes",
        str(t.num_processes),
        "--num_machines",
        "1",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(free_port()),
    ]
    if t.strategy.startswith("deepspeed_"):
        stage = t.strategy.removeprefix("deepspeed_zero")
        argv += ["--deepspeed_config_file", str(CONF_DIR / "deepspeed" / f"zero{stage}.json")]
    else:
        # accelerate warns about unset defaults otherwise; with a DeepSpeed config file these two are
        # rejected (they belong in the JSON).
        argv += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    return argv + ["-m", "pipeline_rl.cli", "train", "--config", str(config_path)]
