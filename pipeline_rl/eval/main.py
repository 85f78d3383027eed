"""`pipeline-rl eval MODEL... [key=value ...] [--samples K] [--out FILE]`: evaluate checkpoints on a task.

    pipeline-rl eval runs/20261201-120000                       # the run's newest checkpoint, the run's task
    pipeline-rl eval artifacts/tiny-arith runs/20261201-120000  # before and after: one server, both scored
    pipeline-rl eval /models/Qwen2.5-1.5B-Instruct task=gsm8k task.dataset_path=/data/gsm8k --samples 8

A MODEL is a Hugging Face checkpoint directory, or a run directory (its newest verified checkpoint; a
LoRA run's adapter is merged into its base first, into a temporary directory: pipeline_rl/export.py; the
first run directory named also gives the task, evaluation and engine settings, which key=value
overrides change). One inference server starts on the first model (the engine of the configuration,
vLLM by default); every further model is pushed into it through the weight plane, as a trainer pushes,
so N checkpoints cost one engine start. Each is scored on the task's held-out split exactly as the
launcher's own evaluations score it (the same problems, greedy, eval.max_tokens): accuracy (pass@1)
where the task grades correctness, the mean reward with a reward by reference (task.reward); with
--samples K also pass@K, maj@K (tasks that name their final answer) and the samples' mean reward, K
samples per problem at temperature 1. The table is printed and the results written as JSON (--out;
default eval-<time>.json in the first run directory, else in the current one).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

from inference_shim.cli import cpu_engine_env
from inference_shim.procs import free_port, serve_argv, start_child, stop_process_tree, wait_healthy
from pipeline_rl.config import RunConfig
from pipeline_rl.launch.compose import ConfigError, compose, override_dict


def is_run_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "checkpoints").is_dir()


def model_of(target: Path) -> Path:
    """The checkpoint directory a MODEL argument names: itself, or a run's newest verified checkpoint."""
    if is_run_dir(target):
        from pipeline_rl.trainer.checkpoint import latest_checkpoint

        checkpoint = latest_checkpoint(target)
        if checkpoint is None:
            raise SystemExit(f"pipeline-rl eval: {target} has no checkpoint yet (checkpoints/ is empty)")
        return checkpoint / "model"
    if not (target / "config.json").is_file() and not (target / "adapter_config.json").is_file():
        raise SystemExit(
            f"pipeline-rl eval: {target} is neither a checkpoint directory (config.json) nor a run directory "
            "(config.json and checkpoints/)"
        )
    return target


def eval_config(targets: list[Path], overrides: list[str]) -> RunConfig:
    """The settings: the first run directory's config with the overrides, else the composed config."""
    run = next((t for t in targets if is_run_dir(t)), None)
    try:
        if run is None:
            return compose([f"model_path={model_of(targets[0])}", *overrides])
        data = json.loads((run / "config.json").read_text())
        data.pop("secrets_file", None)  # a fresh server gets a token of its own
        data["inference"].update(urls=[], token=None)
        return RunConfig.model_validate(override_dict(data, overrides))
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"pipeline-rl eval: {e}") from None


def _server(cfg: RunConfig, model: Path, log_path: Path, token: str):
    port = free_port()
    extra = [
        "--dtype",
        cfg.inference.dtype,
        "--max-num-seqs",
        str(cfg.inference.max_num_seqs),
        "--seed",
        str(cfg.seed),
    ]
    if cfg.inference.max_model_len is not None:
        extra += ["--max-model-len", str(cfg.inference.max_model_len)]
    env = {**os.environ, **(cpu_engine_env() if cfg.platform == "cpu" else {}), "PIPELINE_RL_TOKEN": token}
    proc = start_child(
        serve_argv(model, port, backend=cfg.inference.backend, extra=extra), env=env, log_path=log_path
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, cfg.inference.startup_timeout_s, proc, log_path)
    return url, proc


def _push(url: str, token: str, model: Path, version: int, timeout_s: float) -> None:
    """Serve `model` on the running server: its weights pushed through the weight plane, as a trainer does."""
    from inference_shim.weight_sender import WeightSender
    from pipeline_rl.testing.models import load_named_tensors

    sender = WeightSender([url], token=token, backend="gloo", timeout_s=timeout_s)
    sender.connect()
    try:
        sender.push_tensors(version, load_named_tensors(model), restore=True)
    finally:
        sender.close()


def _servable(model: Path, scratch: Path) -> Path:
    """`model`, or for a LoRA checkpoint (a peft adapter directory) the adapter merged into its base."""
    from pipeline_rl.export import ExportError, export
    from pipeline_rl.trainer.lora import is_adapter_dir

    if not is_adapter_dir(model):
        return model
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        export(model, scratch, merged=True)
    except ExportError as e:
        raise SystemExit(f"pipeline-rl eval: {e}") from None
    return scratch


def evaluate(targets: list[Path], cfg: RunConfig, samples: int, log_dir: Path) -> list[dict]:
    """Every target's held-out scores, one server for all (each further model pushed into it)."""

    with tempfile.TemporaryDirectory(prefix="pipeline-rl-eval-") as scratch:
        # LoRA checkpoints are merged into their base there, to be served like any checkpoint.
        models = [_servable(model_of(t), Path(scratch) / str(i)) for i, t in enumerate(targets)]
        return _evaluate_models(targets, models, cfg, samples, log_dir)


def _evaluate_models(
    targets: list[Path], models: list[Path], cfg: RunConfig, samples: int, log_dir: Path
) -> list[dict]:
    from pipeline_rl.eval.heldout import evaluate_server

    if len(models) > 1 and cfg.platform != "cpu":
        raise SystemExit(
            "pipeline-rl eval: several models at once push over gloo, on CPU servers; run one per call"
        )
    token = secrets.token_hex(16)
    log_dir.mkdir(parents=True, exist_ok=True)
    url, proc = _server(cfg, models[0], log_dir / "eval-server.log", token)
    results = []
    try:
        for version, (target, model) in enumerate(zip(targets, models, strict=True)):
            if version:
                _push(url, token, model, version, cfg.trainer.push_timeout_s)
            started = time.monotonic()
            scores = evaluate_server(
                url,
                cfg.task,
                cfg.eval.num_problems,
                cfg.eval.max_tokens,
                token,
                str(model),
                cfg.inference.max_model_len or 4096,
                samples,
                cfg.seed,
            )
            results.append(
                {
                    "model": str(target),
                    "checkpoint": str(model),
                    **scores,
                    "seconds": time.monotonic() - started,
                }
            )
    finally:
        stop_process_tree(proc)
    return results


def print_table(results: list[dict]) -> None:
    keys = [k for k in results[0] if k not in ("model", "checkpoint", "weight_version", "seconds")]
    print("model".ljust(48) + "".join(k.rjust(14) for k in keys))
    for row in results:
        cells = "".join(
            (f"{row[k]:.4f}" if isinstance(row[k], float) else str(row[k])).rjust(14) for k in keys
        )
        print(row["model"][-48:].ljust(48) + cells)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pipeline-rl eval", description=__doc__.splitlines()[0])
    parser.add_argument(
        "args", nargs="+", help="MODEL... (checkpoint or run directories), then key=value overrides"
    )
    parser.add_argument(
        "--samples", type=int, default=1, help="K samples per problem at temperature 1: pass@K, maj@K"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where the JSON goes (default eval-<time>.json)"
    )
    args = parser.parse_args(argv)
    targets = [Path(a) for a in args.args if "=" not in a]
    overrides = [a for a in args.args if "=" in a]
    if not targets:
        parser.error("name at least one MODEL (a checkpoint or a run directory)")
    if args.samples < 1:
        parser.error("--samples must be >= 1")
    cfg = eval_config(targets, overrides)
    run = next((t for t in targets if is_run_dir(t)), Path("."))
    results = evaluate(targets, cfg, args.samples, run / "eval-logs")
    print_table(results)
    out = args.out or run / f"eval-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(
        json.dumps(
            {"task": cfg.task.model_dump(), "eval": cfg.eval.model_dump(), "results": results}, indent=2
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
