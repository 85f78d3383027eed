"""A stand-in trainer for benchmarks: a separate process that pushes a model's weights into servers on
command, so the pushing costs what a trainer's push costs and never shares the measuring process's GIL.

    python -m benchmarks.pusher --model DIR --url http://127.0.0.1:8000 [--url ...] [--bucket-mib 256]

Reads one JSON command per line on stdin and answers one JSON line on stdout:
    {"cmd": "run", "every_s": 1.0, "duration_s": 10}  -> push every every_s seconds (0: back to back)
        until duration_s has passed; answers {"pushes": [{"start", "end", "total_seconds", ...}]}
    {"cmd": "quit"}                                    -> close the weight group and exit
Push times are time.monotonic() (shared by all processes), so the caller can place them in its windows.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from benchmarks.models import load_named_tensors
from inference_shim.client import served_version
from inference_shim.weight_sender import WeightSender


def _run(
    sender: WeightSender, named: list, version: int, every_s: float, duration_s: float
) -> tuple[list[dict], int]:
    pushes = []
    start = time.monotonic()
    next_at = start
    while True:
        now = time.monotonic()
        if now - start >= duration_s:
            break
        if now < next_at:
            time.sleep(min(next_at - now, duration_s - (now - start)))
            continue
        version += 1
        t0 = time.monotonic()
        report = sender.push_tensors(version, named)
        pushes.append(
            {
                "start": t0,
                "end": time.monotonic(),
                "version": version,
                "total_seconds": report.total_seconds,
                "broadcast_seconds": report.broadcast_seconds,
                "pause_seconds": report.max_pause_seconds,
                "apply_seconds": max(r.apply_seconds for r in report.results),
                "receive_seconds": max(r.receive_seconds for r in report.results),
            }
        )
        next_at = t0 + every_s
    return pushes, version


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--url", action="append", required=True)
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    named = load_named_tensors(args.model)
    version = served_version(args.url)
    sender = WeightSender(args.url, bucket_bytes=args.bucket_mib * 2**20, timeout_s=300)
    sender.connect()
    try:
        print(json.dumps({"ready": True, "version": version}), flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            if command["cmd"] == "quit":
                break
            pushes, version = _run(sender, named, version, command["every_s"], command["duration_s"])
            print(json.dumps({"pushes": pushes}), flush=True)
    finally:
        sender.close()


if __name__ == "__main__":
    main()
