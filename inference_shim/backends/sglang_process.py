"""SGLang's own HTTP server as a private child process of the shim: its options, argv, start and stop.

The shim starts `<engine_python> -m sglang.launch_server --model-path DIR --host 127.0.0.1 --port <free>
... --api-key <random>` in its own session (stopped with its whole tree, and dying with the shim:
inference_shim/procs.py), waits for its /health, and is the only holder of the API key. SGLang pins
its own torch, so it usually runs from another venv (`engine_python`). docs/sglang.md has the flags.

The API key never appears on a command line (any local user can read /proc/*/cmdline): the child runs
a short bootstrap (`python -c KEY_BOOTSTRAP <target> <flags>`) that takes the key from its environment,
appends `--api-key KEY` to sys.argv in-process and runs the target as `python -m` / `python script`
would. SGLang reads only sys.argv, so it sees the same flags.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from inference_shim.backends.common import served_name
from inference_shim.procs import free_port, start_child, stop_process_tree, wait_healthy

log = logging.getLogger("inference_shim.sglang")

# SGLang computes logprobs after temperature scaling unless told otherwise; the contract promises
# logprobs under the raw distribution (temperature 1), which is what the trainer's ratios need.
ENGINE_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}

API_KEY_ENV = "PIPELINE_RL_ENGINE_API_KEY"
# argv[1:] = ["-m", module, flags...] or [script, flags...]; the key comes from the environment.
# `--api-key=KEY` in one word: a random key may start with '-', which argparse would take for a flag.
KEY_BOOTSTRAP = (
    "import os, runpy, sys\n"
    f"key = os.environ.pop({API_KEY_ENV!r})\n"
    "if sys.argv[1] == '-m':\n"
    "    sys.argv = [sys.argv[2], *sys.argv[3:], '--api-key=' + key]\n"
    "    runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
    "else:\n"
    "    sys.argv = [sys.argv[1], *sys.argv[2:], '--api-key=' + key]\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def _default_engine_python() -> str:
    if os.environ.get("PIPELINE_RL_SGLANG_PYTHON"):
        return os.environ["PIPELINE_RL_SGLANG_PYTHON"]
    nested = Path(sys.prefix) / "sglang" / "bin" / "python"
    return str(nested) if nested.exists() else sys.executable


class SglangOptions(BaseModel):
    """Engine settings of the SGLang backend (CLI flags of `python -m inference_shim --backend sglang`)."""

    model: str = Field(description="Hugging Face model directory (--model-path).")
    served_model_name: str | None = Field(
        default=None, description="Name in /v1/models; default: the directory name."
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="Weights dtype in the engine; pushed tensors must have it."
    )
    max_model_len: int = Field(
        default=4096, ge=16, description="Longest prompt + completion (--context-length)."
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, description="Most sequences decoded at once (--max-running-requests)."
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per server (--tp-size).")
    seed: int = Field(default=0, description="Engine seed (--random-seed).")
    mem_fraction_static: float | None = Field(
        default=None, gt=0, lt=1, description="GPU memory share for weights + KV (SGLang's default if unset)."
    )
    kv_after_update: Literal["recompute", "keep"] = Field(
        default="recompute",
        description="recompute: pause mode 'retract', KV of old weights flushed, in-flight requests re-prefill. "
        "keep: pause mode 'in_place', in-flight requests keep their KV; the radix cache is disabled.",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="More `sglang.launch_server` flags, passed verbatim."
    )
    engine_python: str = Field(
        default_factory=_default_engine_python,
        description="Python that has SGLang: $PIPELINE_RL_SGLANG_PYTHON, else <this venv>/sglang/bin/python "
        "(scripts/setup.sh puts SGLang there: it pins its own torch), else this interpreter.",
    )
    launch_command: list[str] | None = Field(
        default=None,
        description="argv that replaces `<engine_python> -m sglang.launch_server` (tests start a stand-in).",
    )
    start_timeout_s: float = Field(
        default=900, gt=0, description="Deadline for the engine's first healthy /health."
    )
    request_timeout_s: float = Field(default=3600, gt=0, description="Deadline of one generation request.")

    @field_validator("extra_args")
    @classmethod
    def _no_incremental_streaming(cls, value: list[str]) -> list[str]:
        if "--incremental-streaming-output" in value:
            raise ValueError(
                "--incremental-streaming-output changes SGLang's stream chunks from cumulative to deltas, "
                "which the SGLang backend does not read: remove it from extra_args"
            )
        return value

    @property
    def model_name(self) -> str:
        return served_name(self.model, self.served_model_name)


class SglangProcess:
    """One private SGLang server on a free loopback port, driven only by whoever holds `api_key`."""

    def __init__(self, options: SglangOptions) -> None:
        self.options = options
        self.api_key = secrets.token_urlsafe(24)
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def argv(self, port: int) -> list[str]:
        o = self.options
        python, *target = o.launch_command or [o.engine_python, "-m", "sglang.launch_server"]
        argv = [python, "-c", KEY_BOOTSTRAP, *target]  # the API key arrives through the environment
        argv += ["--model-path", o.model, "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--served-model-name", o.model_name, "--dtype", o.dtype]
        argv += ["--context-length", str(o.max_model_len), "--tp-size", str(o.tensor_parallel_size)]
        argv += ["--random-seed", str(o.seed), "--weight-version", "0"]
        if o.max_num_seqs is not None:
            argv += ["--max-running-requests", str(o.max_num_seqs)]
        if o.mem_fraction_static is not None:
            argv += ["--mem-fraction-static", str(o.mem_fraction_static)]
        if o.kv_after_update == "keep":
            # In-flight requests keep KV from the old weights; a radix cache would also hand old-weight
            # prefixes to NEW requests, which "keep" never promises.
            argv += ["--disable-radix-cache"]
        return argv + list(o.extra_args)

    def start(self) -> None:
        """Start SGLang (its output goes to the shim's); wait_ready() waits for it."""
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = self.argv(port)
        log.info("starting SGLang: %s", " ".join(argv[3:]))
        self.proc = start_child(argv, env=dict(os.environ, **ENGINE_ENV, **{API_KEY_ENV: self.api_key}))

    async def wait_ready(self) -> None:
        """Until SGLang's /health answers 200; raises if it exits first or start_timeout_s passes."""
        await asyncio.to_thread(wait_healthy, self.url, self.options.start_timeout_s, self.proc)

    def exit_code(self) -> int | None:
        """SGLang's exit status once it has exited, None while it runs (or before start)."""
        return None if self.proc is None else self.proc.poll()

    async def stop(self) -> None:
        if self.proc is not None:
            await asyncio.to_thread(stop_process_tree, self.proc)
            self.proc = None
