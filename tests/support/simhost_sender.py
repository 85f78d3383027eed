"""The trainer side of tests/integration/test_multihost_push.py: one WeightSender in a process of its own,
started on a simulated host and driven through files (harness children get no stdin).

    python tests/support/simhost_sender.py --rpc-dir DIR --master 10.231.0.1 --timeout-s 20 URL [URL ...]
    (the servers' token comes from $PIPELINE_RL_TOKEN)

The driver writes DIR/cmd-<n>.json, n = 0, 1, 2, ...: {"op": "connect"}, {"op": "push", "version": V,
"model": MODEL_DIR} (every parameter of that checkpoint, float32), {"op": "reconnect"}, {"op": "close"}.
This process answers each with DIR/reply-<n>.json (written whole, then renamed): {"ok": true,
"seconds": s, ...} or {"ok": false, "seconds": s, "error": text, "servers": [urls at fault]}. It exits
after "close", or when the driver's process is gone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path


def _params(model_dir: str) -> list:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [(name, p.detach()) for name, p in model.named_parameters()]


def _execute(sender, command: dict) -> dict:
    from inference_shim.weight_sender import WeightPushError

    op = command["op"]
    try:
        if op == "connect":
            sender.connect()
            return {"ok": True}
        if op == "push":
            named = _params(command["model"])  # loaded before the clock starts for the driver's deadline
            start = time.monotonic()
            try:
                report = sender.push_tensors(command["version"], named)
            finally:
                command["push_seconds"] = time.monotonic() - start
            return {"ok": True, "total_bytes": report.total_bytes, "broadcast_s": report.broadcast_seconds}
        if op == "reconnect":
            sender.reconnect()
            return {"ok": True}
        if op == "close":
            sender.close()
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}", "servers": []}
    except WeightPushError as e:
        return {"ok": False, "error": str(e), "servers": e.servers}
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "servers": []}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rpc-dir", required=True)
    p.add_argument("--master", required=True, help="this host's address: the servers reach the store there")
    p.add_argument("--timeout-s", type=float, default=20.0)
    p.add_argument("urls", nargs="+")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from inference_shim.weight_sender import WeightSender

    sender = WeightSender(
        args.urls,
        token=os.environ["PIPELINE_RL_TOKEN"],
        timeout_s=args.timeout_s,
        master_address=args.master,
    )
    rpc, driver = Path(args.rpc_dir), os.getppid()
    n = 0
    while True:
        command_path = rpc / f"cmd-{n}.json"
        if not command_path.exists():
            if os.getppid() != driver:  # the driver died: nothing will ever ask us to close
                return
            time.sleep(0.05)
            continue
        command = json.loads(command_path.read_text())
        start = time.monotonic()
        reply = _execute(sender, command)
        reply["seconds"] = time.monotonic() - start
        reply["push_seconds"] = command.get("push_seconds")
        logging.info("command %d %s -> %s", n, command, reply)
        tmp = rpc / f".reply-{n}.json"
        tmp.write_text(json.dumps(reply))
        tmp.rename(rpc / f"reply-{n}.json")
        if command["op"] == "close":
            return
        n += 1


if __name__ == "__main__":
    main()
