"""The exact command that starts the trainer ranks: `accelerate launch` with the strategy's config file.

    from pipeline_rl.launch.trainer_cmd import trainer_command
    argv = trainer_command(cfg, "runs/x/config.json")    # the launcher runs this (and writes it to a file)
    argv = trainer_command(cfg, path, Rendezvous(num_machines=2, machine_rank=1, main_ip="10.0.0.1", port=29500))

Contract (what the launcher can rely on):
  * argv[0] is this interpreter; the command is `python -m pipeline_rl.launch.trainer_agent`, which is
    `accelerate launch` (same arguments, no dependence on PATH) except that torchrun's rendezvous store
    listens on the main process address only, not on every interface (see that module);
  * `--config_file pipeline_rl/conf/accelerate/<trainer.strategy>.yaml` (absolute path) picks the launcher
    (torchrun for ddp/fsdp, accelerate's DeepSpeed launcher for deepspeed_*), `--num_processes` is
    trainer.num_processes (ALL ranks: accelerate starts num_processes / num_machines on each machine),
    `--num_machines`, `--machine_rank` and `--main_process_ip` from the rendezvous (default: one
    machine, 127.0.0.1), `--main_process_port` the rendezvous port or, on one machine, a port that was
    free when the command was built (the ranks' rendezvous; it is not the weight-transfer port, which
    the trainer picks itself). Several machines use accelerate's own multi-node launch (torchrun's
    static rendezvous at main_process_ip:port, served by machine rank 0), nothing home-made;
  * DeepSpeed strategies also get `--deepspeed_config_file pipeline_rl/conf/deepspeed/zero{2,3}.json` (absolute),
    and on several machines `--deepspeed_multinode_launcher standard` (torchrun on each node);
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
from dataclasses import dataclass
from pathlib import Path

from inference_shim.procs import free_port
from pipeline_rl.config import RunConfig
from pipeline_rl.paths import CONF_DIR


@dataclass
class Rendezvous:
    """accelerate's multi-node arguments for this node's trainer ranks (one machine: the defaults)."""

    num_machines: int = 1
    machine_rank: int = 0
    main_ip: str = "127.0.0.1"  # host of machine rank 0; torchrun's store listens there only
    port: int | None = None  # None: a free port of this machine (one machine only)


def accelerate_config_file(strategy: str) -> Path:
    path = CONF_DIR / "accelerate" / f"{strategy}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no accelerate config for trainer.strategy={strategy!r} at {path}")
    return path


def trainer_command(cfg: RunConfig, config_path: str, rendezvous: Rendezvous | None = None) -> list[str]:
    """argv that starts this machine's trainer ranks for `cfg` (config.json already written at
    `config_path`); `rendezvous` None: all ranks on this machine."""
    t = cfg.trainer
    machines = rendezvous.num_machines if rendezvous else 1
    if t.num_processes % machines:
        raise ValueError(
            f"trainer.num_processes={t.num_processes} must split evenly over {machines} machines"
        )
    port = rendezvous.port if rendezvous and rendezvous.port else free_port()
    argv = [
        sys.executable,
        "-m",
        "pipeline_rl.launch.trainer_agent",
        "--config_file",
        str(accelerate_config_file(t.strategy)),
        "--num_processes",
        str(t.num_processes),
        "--num_machines",
        str(machines),
        "--machine_rank",
        str(rendezvous.machine_rank if rendezvous else 0),
        "--main_process_ip",
        rendezvous.main_ip if rendezvous else "127.0.0.1",
        "--main_process_port",
        str(port),
    ]
    if t.strategy.startswith("deepspeed_"):
        stage = t.strategy.removeprefix("deepspeed_zero")
        argv += ["--deepspeed_config_file", str(CONF_DIR / "deepspeed" / f"zero{stage}.json")]
        if machines > 1:
            # One launcher per node, as for ddp/fsdp (torchrun), instead of accelerate's default
            # multi-node DeepSpeed launcher, which would ssh (pdsh) into the other nodes itself.
            argv += ["--deepspeed_multinode_launcher", "standard"]
    else:
        # accelerate warns about unset defaults otherwise; with a DeepSpeed config file these two are
        # rejected (they belong in the JSON).
        argv += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    return argv + ["-m", "pipeline_rl.cli", "train", "--config", str(config_path)]
