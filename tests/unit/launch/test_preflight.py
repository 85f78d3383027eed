"""Before any engine starts, a run that cannot work fails in seconds saying what to change: a checkpoint
the engine cannot serve (an architecture vLLM does not know, a head size vLLM-CPU's attention lacks), a
vLLM other than the supported one, a dataset whose fields are not the configured ones. Also: the CPU
engine environment only on platform=cpu, neutral defaults with the checkpoint's own length, and every
shipped recipe planned for its GPU count by --dry-run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline_rl.launch.compose import compose
from pipeline_rl.testing.models import build_checkpoint

REPO = Path(__file__).resolve().parents[3]
SMALL = ["inference.max_model_len=96", "actor.max_tokens=8", "trainer.batch_size=8", "actor.attempts=4"]


def _launch(
    *args: str, env: dict | None = None, timeout: float = 60
) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pipeline_rl.cli", "launch", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return result, time.monotonic() - started


@pytest.fixture(scope="module")
def llama16(tmp_path_factory) -> Path:
    """A Llama whose head_dim is 16: transformers trains it, vLLM-CPU's attention cannot serve it."""
    return build_checkpoint("llama", tmp_path_factory.mktemp("llama16") / "m", hidden_size=64, head_dim=16)


def test_a_head_size_vllm_cpu_cannot_serve_fails_before_any_engine_starts(llama16, tmp_path):
    result, seconds = _launch(f"model_path={llama16}", f"run_dir={tmp_path / 'run'}", *SMALL)
    assert result.returncode != 0 and seconds <= 10, (seconds, result.stderr)
    assert "LlamaForCausalLM: head_dim=16 is not supported by vLLM's CPU attention" in result.stderr, (
        result.stderr
    )
    assert "head sizes 32, 64, 80, 96, 112, 128" in result.stderr and "inference=torch" in result.stderr
    assert not (tmp_path / "run" / "logs").exists(), "nothing started"


def test_an_architecture_vllm_does_not_serve_fails_naming_it(llama16, tmp_path):
    model = tmp_path / "unknown"
    model.mkdir()
    for f in llama16.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(
        json.dumps(
            {**config, "architectures": ["WonderForCausalLM"], "head_dim": 32, "num_attention_heads": 2}
        )
    )
    result, seconds = _launch(f"model_path={model}", f"run_dir={tmp_path / 'run'}", *SMALL)
    assert result.returncode != 0 and seconds <= 10, (seconds, result.stderr)
    assert "architecture WonderForCausalLM is not one vLLM 0.32.0 serves" in result.stderr, result.stderr


def test_a_missing_checkpoint_and_wrong_dataset_fields_fail_together_at_startup(tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"q": f"{i}?", "a": str(i)}) + "\n" for i in range(20)))
    result, seconds = _launch(
        f"model_path={tmp_path / 'nothing'}", f"run_dir={tmp_path / 'run'}", "task=dataset",
        f"task.dataset_path={data}", "task.test_size=4", *SMALL,
    )  # fmt: skip
    assert result.returncode != 0 and seconds <= 10, (seconds, result.stderr)
    assert "model_path" in result.stderr and "does not exist" in result.stderr
    assert "no field 'answer', 'prompt'; they have 'a', 'q'" in result.stderr, result.stderr


def test_a_vllm_other_than_the_supported_one_is_refused_naming_the_one_needed(tmp_path):
    """A distribution record of vLLM 0.31.0 ahead of the installed one on the path: what
    importlib.metadata reports is what the check reads (the same as a real install of 0.31)."""
    fake = tmp_path / "site"
    info = fake / "vllm-0.31.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.31.0\n")
    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code = "from inference_shim.engine_check import vllm_version_problem; print(vllm_version_problem())"
    said = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    ).stdout
    assert "vLLM 0.31.0 is installed" in said and "supports vLLM 0.32.0 only" in said, said
    model = build_checkpoint("qwen3", tmp_path / "qwen3")
    serve = subprocess.run(
        [sys.executable, "-m", "inference_shim", "--model", str(model), "--port", "1"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert serve.returncode != 0 and "pip install vllm==0.32.0" in serve.stderr, serve.stderr


def test_the_cpu_engine_environment_is_given_on_platform_cpu_only(tmp_path):
    from pipeline_rl.launch.plan import plan, resolve

    def env_of(*overrides):
        cfg = resolve(
            compose(["model_path=/m", *SMALL, *overrides]),
            tmp_path,
            {"servers", "trainer"},
        )
        return {s.name: s.env for s in plan(cfg, tmp_path, {"servers", "trainer"})}

    cpu, gpu = env_of("platform=cpu"), env_of("platform=gpu", "placement.num_gpus=2")
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # an explicit setting of the launcher's wins
        assert (
            cpu["server0"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
            and cpu["trainer"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
        )
    assert not any("VLLM_CPU_KVCACHE_SPACE" in e or "HF_HUB_OFFLINE" in e for e in gpu.values()), gpu


def test_defaults_suit_a_real_model_and_the_length_comes_from_the_checkpoint(tmp_path):
    from pipeline_rl.launch.preflight import with_model_length

    cfg = compose([f"model_path={tmp_path}"])
    assert cfg.trainer.learning_rate == 1e-6 and cfg.actor.max_tokens == 1024 and cfg.eval.max_tokens == 1024
    assert cfg.inference.max_model_len is None
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    resolved = with_model_length(cfg)
    assert resolved.inference.max_model_len == 4096 and resolved.preprocess.seq_length == 4096
    assert compose(["recipe=demo"]).model_path == "artifacts/tiny-arith"  # the demo is a recipe


def _config_only(tmp_path: Path, **config) -> Path:
    """A checkpoint's config.json without weights: all a plan reads (a dry run warns about the rest)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **config})
    )
    return tmp_path


def _rows(stdout: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in stdout.splitlines() if line.split()}


def test_the_one_gpu_recipe_plans_trainer_and_server_on_one_gpu(tmp_path):
    model = _config_only(
        tmp_path / "qwen", hidden_size=1536, num_attention_heads=12, max_position_embeddings=32768
    )
    result, _ = _launch(
        "--dry-run",
        "recipe=gsm8k-1gpu",
        f"model_path={model}",
        "placement.num_gpus=1",
        f"run_dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr
    rows = _rows(result.stdout)
    assert rows["trainer"][3] == "0" and rows["server0"][3] == "0", result.stdout  # colocated on GPU 0
    memory = next(line for line in result.stdout.splitlines() if line.startswith("memory:"))
    for setting in ("ddp, 1 rank(s)", "mixed precision bf16", "activation checkpointing", "max_model_len 2048",
                    "gpu_memory_utilization 0.3"):  # fmt: skip
        assert setting in memory, memory
    assert "no weights" in result.stderr  # a dry run away from the checkpoint warns, and plans


def test_the_eight_gpu_recipe_plans_four_zero3_ranks_and_four_servers(tmp_path):
    model = _config_only(
        tmp_path / "qwen7", hidden_size=3584, num_attention_heads=28, max_position_embeddings=131072
    )
    result, _ = _launch(
        "--dry-run",
        "recipe=math-7b-8gpu",
        f"model_path={model}",
        "placement.num_gpus=8",
        f"run_dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr
    rows = _rows(result.stdout)
    assert rows["trainer"][3] == "0-3" and [rows[f"server{i}"][3] for i in range(4)] == ["4", "5", "6", "7"]
    assert {"preprocessor1", "actor1"} <= set(rows)
    memory = next(line for line in result.stdout.splitlines() if line.startswith("memory:"))
    assert "deepspeed_zero3, 4 rank(s)" in memory and "max_model_len 10240" in memory and "0.9" in memory
    trainer_cmd = tmp_path / "run" / "cmd" / "trainer.sh"
    assert not trainer_cmd.exists(), "a dry run writes nothing"


def test_the_multi_host_recipe_plans_both_nodes(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pipeline_rl.cli", "launch", "--cluster",
         str(REPO / "pipeline_rl" / "conf" / "cluster" / "math-7b-2x8gpu.yaml"), "--dry-run"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "PIPELINE_RL_TOKEN": ""},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "== node train0 (10.0.0.10" in out and "== node infer0 (10.0.0.20" in out
    assert (
        "deepspeed_zero3, 8 rank(s)" in out
        and "http://10.0.0.20:8007" in out
        and "redis://10.0.0.10:6390/0" in out
    )
    train0 = out.split("== node infer0")[0]
    assert _rows(train0)["trainer"][3] == "0-7", train0
