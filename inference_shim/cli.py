"""The inference server's command line: one HTTP contract in front of an engine.

    python -m inference_shim --model DIR [--port 8000] [--backend vllm|sglang|torch|capture] [--token T]
    pipeline-rl serve ...          (the same flags: that command delegates here)

Heavy modules (torch, vLLM, FastAPI) are imported only once the flags are parsed, so --help is instant.
The control-route token may come from $PIPELINE_RL_TOKEN instead of --token, the generation API key from
$PIPELINE_RL_API_KEY instead of --api-key (keeps them out of argv, where `ps` shows them to every user).
"""

from __future__ import annotations

import argparse
import os

# What every engine process on a CPU box needs (see docs/decisions.md): a bounded KV cache instead of
# ~90% of RAM, loopback addresses, no hub access, no usage reporting. Explicit settings win. Applied by a
# server without a GPU, and by the launcher to every process of a platform=cpu run, never on GPU.
ENGINE_ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# A server survives a trainer that dies mid-broadcast on an nccl weight group. Torch's NCCL watchdog
# by default (TORCH_NCCL_ASYNC_ERROR_HANDLING=1, "TearDown") ends the whole process when a collective
# times out or fails, which would take every server down with its trainer. 2 ("CleanUpOnly") aborts
# the communicator and leaves the error to the waiting call; TORCH_NCCL_BLOCKING_WAIT=1 makes that
# wait() raise at the group's timeout instead of returning while a kernel that will never finish still
# hangs the stream. The worker's receive then fails the update like a gloo timeout does: staged weights
# dropped, old weights served, /health ok. Blocking wait costs nothing there (the receive needs each
# bucket before it goes on). Servers only: a trainer keeps torch's defaults, where dying loudly is right
# and blocking waits would cost its compute/communication overlap. UNTESTED HERE: this machine has no
# GPU (nccl cannot run); scripts/gpu_contract_tests.sh is where it can be exercised. Explicit settings win.
SERVER_NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_BLOCKING_WAIT": "1",
}
# The start method of a vLLM server's engine processes when --start-method is not given (unset: the
# backend's default, spawn). Test suites and short-lived servers that start often set it to fork.
START_METHOD_ENV = "PIPELINE_RL_VLLM_START_METHOD"


def cpu_engine_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """ENGINE_ENV_DEFAULTS that `environ` (default: this process's) does not set already."""
    environ = os.environ if environ is None else environ
    return {key: value for key, value in ENGINE_ENV_DEFAULTS.items() if key not in environ}


def apply_engine_env() -> None:
    """On a machine without a visible GPU, set ENGINE_ENV_DEFAULTS where they are not set already (a GPU
    server keeps vLLM's own defaults: its KV cache is GPU memory, and it may fetch from the hub)."""
    from inference_shim.engine_check import gpu_visible

    if not gpu_visible():
        os.environ.update(cpu_engine_env())


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The server's flags, on `p` (this module's parser, and `pipeline-rl serve`)."""
    p.add_argument(
        "--backend",
        choices=["vllm", "sglang", "torch", "capture"],
        default="vllm",
        help="engine behind the contract; capture: receive weight pushes only, no engine (tests, dry runs)",
    )
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address; loopback unless you mean to expose it")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument(
        "--token",
        default=os.environ.get("PIPELINE_RL_TOKEN"),
        help="Bearer token required on control routes (default: $PIPELINE_RL_TOKEN)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("PIPELINE_RL_API_KEY") or None,
        help="Bearer key required on /v1/ (generation) routes; default $PIPELINE_RL_API_KEY, else none",
    )
    p.add_argument(
        "--allow-open-v1",
        action="store_true",
        help="serve /v1/ without an API key on a non-loopback --host (behind a gateway that authenticates)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="name in /v1/models (default: the directory name)"
    )
    p.add_argument(
        "--dtype", default="float32", help="weights dtype in the engine: float32 (CPU), bfloat16 (GPU)"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + completion, in tokens (default: the model's max_position_embeddings)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences decoded at once")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vllm backend on a GPU: share of the GPU's memory the engine may take (default vLLM's, 0.9)",
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per server (1 on CPU)")
    p.add_argument("--seed", type=int, default=0, help="engine seed")
    p.add_argument(
        "--kv-after-update",
        choices=["recompute", "keep"],
        default="recompute",
        help="recompute: drop KV computed by old weights after an update; keep: in-flight requests keep it",
    )
    p.add_argument(
        "--update-mode",
        choices=["inflight", "drain"],
        default="inflight",
        help="inflight: an update lands between two decode steps, requests in flight go on with the new "
        "weights; drain: stop admitting (503 draining), let the requests in flight end on the old weights, "
        "then apply, so no response mixes versions; the servers of one update drain one at a time "
        '(docs/engines.md, "Drain-then-swap"; not the sglang backend, which cannot stage an update)',
    )
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=60.0,
        help="--update-mode drain: the longest the server waits for its turn, then for its requests in "
        "flight, before it ends those still running (503 drain_timeout) and applies; both waits also end "
        "by 3/4 of the update's timeout_s",
    )
    p.add_argument(
        "--apply-weights",
        choices=["prepared", "reload"],
        default=None,
        help="vllm backend: prepared (default) builds an update's weights and CPU prepacks beside the "
        "live model while decoding goes on, and the pause only swaps them in (CPU engines; elsewhere and "
        "where a model is not supported it falls back to reload); reload: vLLM's reload path inside the pause",
    )
    p.add_argument(
        "--start-method",
        choices=["fork", "spawn"],
        default=None,
        help="vllm backend: how the engine starts its engine-core and worker processes. spawn (default, "
        "vLLM-CPU's own choice): each imports vLLM and torch anew; fork: they inherit the server's imports, "
        "so a vLLM-CPU server is ready in under half the time, but its engine then decodes slower "
        '(docs/engines.md, "Starting by fork"); vLLM keeps spawn where fork is unsafe (CUDA initialised). '
        f"Default ${START_METHOD_ENV}, else spawn",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help="vllm backend: the format of tool calls the model writes, read for tool_choice auto (a vLLM "
        "tool parser name: hermes, llama3_json, mistral, ...; default hermes, the tiny model's format; "
        "none: refuse tool_choice auto)",
    )
    p.add_argument(
        "--capture-dir",
        default=None,
        help="capture backend only: write each received update to DIR/weights.safetensors + history.jsonl",
    )
    p.add_argument(
        "--await-weights",
        action="store_true",
        help="answer 503 awaiting_weights on /health and generation until the first weight update "
        "(a server started mid-run, or for a resumed run, must not serve the start-up weights)",
    )
    p.add_argument(
        "--lora-max-rank",
        type=int,
        default=None,
        help="serve a LoRA adapter trained by the trainer: take adapter updates of at most this rank, "
        "in memory (vllm, torch, capture backends); the served model is then the base plus the newest "
        "adapter, and the base alone is `MODEL:base` on vllm (docs/lora.md)",
    )
    p.add_argument("--log-level", default="info", help="uvicorn / logging level")
    add_limit_arguments(p)


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per field of inference_shim.limits.Limits (--max-body-bytes, ...), help from its docs."""
    from inference_shim.limits import Limits  # light: pydantic and starlette, no engine

    for name, field in Limits.model_fields.items():
        flag = "--" + name.replace("_", "-")
        p.add_argument(
            flag, type=int, default=field.default, help=f"{field.description} (default {field.default})"
        )


def limits_of(args: argparse.Namespace):
    """The Limits of parsed flags."""
    from inference_shim.limits import Limits

    return Limits(**{name: getattr(args, name) for name in Limits.model_fields})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m inference_shim",
        description="Inference server: the pipeline-rl HTTP contract (docs/contract.md) in front of an engine.",
    )
    add_serve_arguments(parser)
    return parser


def engine_options(args: argparse.Namespace) -> dict:
    """The backend's options (VllmOptions, SglangOptions or CaptureOptions fields) from parsed flags."""
    lora = {}
    if args.lora_max_rank is not None:
        if args.lora_max_rank < 1:
            raise SystemExit(f"--lora-max-rank {args.lora_max_rank}: give a rank of 1 or more")
        if args.backend == "sglang":
            raise SystemExit(
                "--lora-max-rank: the sglang backend cannot take adapters in memory (docs/lora.md, Engines)"
            )
        lora["lora_max_rank"] = args.lora_max_rank
    if args.backend == "capture":
        return {
            "model": args.model,
            "served_model_name": args.served_model_name,
            "capture_dir": args.capture_dir,
            **lora,
        }
    if args.capture_dir is not None:
        raise SystemExit("--capture-dir needs --backend capture")
    if args.update_mode == "drain" and args.backend == "sglang":
        # SGLang receives an update inside its own scheduler, paused, as the trainer broadcasts it: a
        # drain there would hold every server of the group in the broadcast.
        raise SystemExit(
            "--update-mode drain: the sglang backend cannot stage an update while it finishes its "
            "requests; use --update-mode inflight (or the vllm backend)"
        )
    tools = {}
    if args.apply_weights is not None:
        if args.backend != "vllm":
            raise SystemExit("--apply-weights needs --backend vllm (the other engines have one way to apply)")
        tools["apply_weights"] = args.apply_weights
    if args.start_method is not None:
        if args.backend != "vllm":
            raise SystemExit("--start-method needs --backend vllm (the other engines start their own way)")
        tools["start_method"] = args.start_method
    elif args.backend == "vllm" and os.environ.get(START_METHOD_ENV):
        method = os.environ[START_METHOD_ENV]
        if method not in ("fork", "spawn"):
            raise SystemExit(f"{START_METHOD_ENV}={method!r}: use fork or spawn (or leave it unset: spawn)")
        tools["start_method"] = method
    if args.tool_call_parser is not None:
        if args.backend != "vllm":
            raise SystemExit(
                "--tool-call-parser needs --backend vllm (docs/contract.md: features per backend)"
            )
        tools["tool_call_parser"] = None if args.tool_call_parser == "none" else args.tool_call_parser
        from inference_shim.backends.vllm_tools import vllm_tool_parser_class

        try:  # before any engine starts: an unknown name fails here, listing the known ones
            vllm_tool_parser_class(tools["tool_call_parser"])
        except ValueError as e:
            raise SystemExit(f"pipeline-rl serve: {e}") from None
    from inference_shim.backends.common import resolve_max_model_len  # light: no engine
    from inference_shim.engine_check import checkpoint_problems, gpu_visible, vllm_version_problem

    # Before any engine starts: a vLLM we do not support, a checkpoint the engine cannot serve (an
    # architecture it does not know, a head size its CPU attention lacks) or a length the model cannot
    # take fails here, in seconds, saying what works.
    problems = []
    if args.backend == "vllm" and (version := vllm_version_problem()):
        problems.append(version)
    if args.backend in ("vllm", "torch"):
        problems += checkpoint_problems(args.model, args.backend, on_gpu=gpu_visible())
    if problems:
        raise SystemExit("pipeline-rl serve: " + "\n  ".join(problems))
    try:
        max_model_len = resolve_max_model_len(args.model, args.max_model_len)
    except ValueError as e:
        raise SystemExit(f"pipeline-rl serve: {e}") from None
    common = {
        "model": args.model,
        "served_model_name": args.served_model_name,
        "dtype": args.dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "seed": args.seed,
        "kv_after_update": args.kv_after_update,
        **lora,
    }
    if args.backend == "torch":
        return common
    engine = {**common, "tensor_parallel_size": args.tensor_parallel_size, **tools}
    if args.gpu_memory_utilization is not None:
        if args.backend != "vllm":
            raise SystemExit("--gpu-memory-utilization needs --backend vllm")
        engine["gpu_memory_utilization"] = args.gpu_memory_utilization
    return engine


def run(args: argparse.Namespace) -> None:
    """Serve with parsed flags until SIGINT/SIGTERM."""
    apply_engine_env()
    for key, value in SERVER_NCCL_ENV.items():  # before the engine spawns its workers: they inherit it
        os.environ.setdefault(key, value)
    try:
        import setproctitle

        setproctitle.setproctitle(f"pipeline-rl serve:{args.port}")
    except ImportError:
        pass
    from inference_shim.server import ServeConfig, serve

    engine = engine_options(args)
    try:
        cfg = ServeConfig(
            backend=args.backend,
            host=args.host,
            port=args.port,
            token=args.token or None,  # an empty $PIPELINE_RL_TOKEN means none
            api_key=args.api_key or None,
            allow_open_v1=args.allow_open_v1,
            limits=limits_of(args),
            log_level=args.log_level,
            await_weights=args.await_weights,
            update_mode=args.update_mode,
            drain_timeout_s=args.drain_timeout_s,
        )
    except ValueError as e:  # pydantic's message says which flag to fix
        raise SystemExit(f"pipeline-rl serve: {e}") from None
    serve(cfg, engine)


def main(argv: list[str] | None = None) -> None:
    run(build_parser().parse_args(argv))
