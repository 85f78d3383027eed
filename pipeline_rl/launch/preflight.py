"""What the launcher checks before it starts anything: the checkpoint, the engine, the task's data and the
user's reward, so that a run that cannot work fails in seconds saying what to change, not minutes later
inside a child's log.

    cfg = with_model_length(cfg)            # inference.max_model_len from the checkpoint when unset
    problems = run_problems(cfg, share)     # [] when the run can start; each problem says what to change

Checked: model_path is a Hugging Face checkpoint directory (config.json, weights, tokenizer); the
engine serves its architecture and, on CPU, its head size (inference_shim/engine_check.py, read from the
installed vLLM's own source) and the installed vLLM is the supported version; transformers knows its
model type (the trainer loads it with AutoModelForCausalLM); the task builds, which loads and checks a
dataset task's data (its fields, its splits against task.test_size) and imports a task or reward given
by reference. Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from inference_shim.backends.common import model_positions
from inference_shim.engine_check import checkpoint_problems, read_model_config, vllm_version_problem
from pipeline_rl.config import RunConfig
from pipeline_rl.launch.compose import ConfigError
from pipeline_rl.launch.plan import NodeShare


def revalidated(cfg: RunConfig, **sections: dict) -> RunConfig:
    """`cfg` with some sections' fields updated, validated again (its cross-field rules and defaults)."""
    data = cfg.model_dump(exclude_unset=True)
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return RunConfig.model_validate(data)


def with_model_length(cfg: RunConfig) -> RunConfig:
    """inference.max_model_len from the checkpoint's config.json when unset (what vLLM itself would take);
    ConfigError when it is unset and the checkpoint does not say."""
    if cfg.inference.max_model_len is not None:
        return cfg
    positions = model_positions(cfg.model_path)
    if positions is None:
        raise ConfigError(
            f"inference.max_model_len is unset and {cfg.model_path}/config.json states no length "
            "(max_position_embeddings): set inference.max_model_len"
        )
    try:
        return revalidated(cfg, inference={"max_model_len": positions})
    except ValueError as e:
        raise ConfigError(f"with inference.max_model_len={positions} (the checkpoint's): {e}") from None


def transformers_causal_lm_types() -> set[str] | None:
    """The model types transformers' AutoModelForCausalLM builds, read from its source (no import)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "models" / "auto" / "modeling_auto.py"
    if not path.is_file():
        return None
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES" for t in node.targets
        ):
            call = node.value  # OrderedDict([("llama", "LlamaForCausalLM"), ...])
            if isinstance(call, ast.Call) and call.args:
                try:
                    return {name for name, _ in ast.literal_eval(call.args[0])}
                except ValueError:
                    return None
    return None


def checkpoint_run_problems(cfg: RunConfig, share: NodeShare) -> list[str]:
    """The checkpoint against what this node starts: the engine's servers and the trainer's ranks."""
    if not (share.servers or share.trainer):
        return []
    if not Path(cfg.model_path).exists():
        return [
            f"model_path {cfg.model_path!r} does not exist: point model_path at a Hugging Face checkpoint "
            "directory (or run `make demo` once to build the demo's model)"
        ]
    problems = []
    if share.servers:
        backend = cfg.inference.backend
        if backend == "vllm" and (version := vllm_version_problem()):
            problems.append(version)
        problems += checkpoint_problems(cfg.model_path, backend, on_gpu=cfg.platform == "gpu")
    elif share.trainer:
        problems += checkpoint_problems(cfg.model_path, "torch", on_gpu=cfg.platform == "gpu")
    if share.trainer and not any("config.json" in p for p in problems):
        model_type = read_model_config(cfg.model_path).get("model_type")
        known = transformers_causal_lm_types()
        if known is not None and model_type not in known:
            problems.append(
                f"model_type {model_type!r} ({cfg.model_path}/config.json) is not one transformers' "
                "AutoModelForCausalLM builds, so the trainer cannot load it: use a causal LM checkpoint"
            )
    return problems


def task_problems(cfg: RunConfig) -> list[str]:
    """Build the task: a dataset task loads and checks its data; references import."""
    from pipeline_rl.tasks import make_task

    try:
        make_task(cfg.task)
    except (ValueError, FileNotFoundError) as e:
        return [f"task {cfg.task.name!r}: {e}"]
    return []


def run_problems(cfg: RunConfig, share: NodeShare) -> list[str]:
    """Everything that keeps this node's share of the run from starting, each saying what to change."""
    problems = checkpoint_run_problems(cfg, share)
    if share.actors or share.evaluates:
        problems += task_problems(cfg)
    if share.trainer is not None:
        problems += tracking_problems(cfg)
    if share.preprocessors or share.stages:
        problems += stage_problems(cfg)
    return problems


def stage_problems(cfg: RunConfig) -> list[str]:
    """The graph's user stages whose function does not import or cannot take the stage's options."""
    from pipeline_rl.stages.chain import resolve_stage_fn

    problems = []
    for name, spec in cfg.graph.stages.items():
        if spec.kind in ("filter", "map"):
            try:
                resolve_stage_fn(name, spec)
            except ValueError as e:
                problems.append(str(e))
    return problems


TRACKER_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}


def tracking_problems(cfg: RunConfig) -> list[str]:
    """Trackers turned on without their package, and sink references that do not resolve."""
    import importlib.util

    from pipeline_rl.references import resolve_callable

    problems = []
    for name, module in TRACKER_PACKAGES.items():
        if getattr(cfg.tracking, name) and importlib.util.find_spec(module) is None:
            problems.append(
                f"tracking.{name}=true needs the {module} package: pip install 'pipeline-rl[{name}]' "
                f"(or turn it off: tracking.{name}=false)"
            )
    for ref in cfg.tracking.sinks:
        try:
            resolve_callable(ref, "tracking.sinks")
        except ValueError as e:
            problems.append(str(e))
    return problems
