"""How long a vLLM-CPU server takes to start, by how its engine starts its processes: `--start-method
fork` against `spawn` (vLLM-CPU's own choice and the server's default), interleaved, one server at a time.

    .venv/bin/python -m benchmarks.diag.server_start                  # 3 starts each, the tiny model
    .venv/bin/python -m benchmarks.diag.server_start --repeats 5 --model PATH

Timed per start: from the process's start to its /health answering 200 (ready), then one greedy chat
answer (its first generation), then 32 concurrent sampled answers of 64 tokens (decode tokens/s: the
forked engine must decode as fast as the spawned one), then SIGTERM to the process tree's end (stop). Printed: the medians
per start method and their ratio, measured in the same run (docs/engines.md, "Starting by fork").
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import markdown_table
from inference_shim.procs import free_port, serve_argv, start_child, stop_process_tree, wait_healthy

METHODS = ("fork", "spawn")


def _one_start(model: Path, method: str, log_dir: Path, i: int) -> dict:
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"{method}-{i}.log"
    started = time.monotonic()
    proc = start_child(serve_argv(model, port, extra=("--start-method", method)), log_path=log_path)
    try:
        wait_healthy(url, 600, proc, log_path)
        ready = time.monotonic()
        body = {"messages": [{"role": "user", "content": "2+3="}], "max_tokens": 8, "temperature": 0}
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).raise_for_status()
        answered = time.monotonic()
        tokens_per_s = _decode_rate(url)
    finally:
        stopping = time.monotonic()
        stop_process_tree(proc)
    return {
        "ready_s": ready - started,
        "first_answer_s": answered - ready,
        "stop_s": time.monotonic() - stopping,
        "tokens_per_s": tokens_per_s,
    }


def _decode_rate(url: str, requests: int = 32, max_tokens: int = 64) -> float:
    """Generated tokens per second of `requests` concurrent sampled answers: the engine's steady decoding."""
    import asyncio

    import httpx

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {
            "messages": [{"role": "user", "content": f"{i}+{i}="}],
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": i,
            "ignore_eos": True,
        }
        r = await client.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        return r.raise_for_status().json()["usage"]["completion_tokens"]

    async def all_of_them() -> float:
        async with httpx.AsyncClient() as client:
            started = time.monotonic()
            tokens = await asyncio.gather(*(one(client, i) for i in range(requests)))
            return sum(tokens) / (time.monotonic() - started)

    return asyncio.run(all_of_them())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", type=Path, default=None, help="default: the tiny demo model, built here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="server-start-") as tmp:
        tmp_dir = Path(tmp)
        model = args.model
        if model is None:
            from pipeline_rl.demo.tiny_model import build_tiny_model

            model = build_tiny_model(tmp_dir / "tiny")
        runs: dict[str, list[dict]] = {m: [] for m in METHODS}
        for i in range(args.repeats):
            for method in METHODS if i % 2 == 0 else reversed(METHODS):  # alternate which goes first
                runs[method].append(_one_start(model, method, tmp_dir, i))
                print(f"start {i + 1}/{args.repeats} {method}: {runs[method][-1]}", flush=True)
    medians = {m: {k: statistics.median(r[k] for r in runs[m]) for k in runs[m][0]} for m in METHODS}
    keys = ("ready_s", "first_answer_s", "stop_s", "tokens_per_s")
    rows = [[m, *(medians[m][k] for k in keys)] for m in METHODS]
    rows.append(["fork / spawn", *(medians["fork"][k] / medians["spawn"][k] for k in keys)])
    print(f"\nmedians of {args.repeats} interleaved starts per method, one server at a time:")
    print(markdown_table(["start method", "ready s", "first answer s", "stop s", "decode tokens/s"], rows))


if __name__ == "__main__":
    main()
