"""A trainer written from docs/contract.md alone: pushes weights into one running inference server.

    python examples/minimal_trainer.py --server http://127.0.0.1:8000 --model MODEL_DIR [--token T]
    python examples/minimal_trainer.py ... --restore --version 0   # push MODEL_DIR's own weights back

Needs torch, httpx and safetensors, and imports nothing from pipeline-rl: it exists to prove the
document is enough (tests/integration/test_minimal_trainer_example.py runs it against a real server).
It reads the weights of MODEL_DIR (the server's Hugging Face directory), perturbs them (unless
--restore), hosts the TCPStore and the gloo group, joins the server, pushes the weights as --version,
and checks /debug/state and the chat route's logprobs. Exits non-zero, saying why, on any failure.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import hmac
import json
import socket
import threading
import uuid
from pathlib import Path

import httpx
import torch
import torch.distributed as dist
from safetensors.torch import load_file

ALIGN = 64  # every tensor starts at a multiple of 64 bytes inside its bucket
GROUP = "weights"  # group_name; the process group's rendezvous keys live under "<group_name>/pg"
PROMPT = [{"role": "user", "content": "2+3="}]


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[tuple[list[tuple[int, int]], int]]:
    """[([(tensor index, offset)], bucket length)]: the layout both sides compute (contract § 3)."""
    buckets, current, used = [], [], 0
    for i, size in enumerate(sizes):
        offset = -(-used // ALIGN) * ALIGN
        if current and offset + size > bucket_bytes:
            buckets.append((current, used))
            current, used, offset = [], 0, 0
        current.append((i, offset))
        used = offset + size
    return buckets + [(current, used)] if current else buckets


def sign(token: str | None, key: str, payload: str) -> str:
    """A store value (contract § Store values): HMAC-SHA256 keyed by the server's token over the key
    name (length-prefixed) and the payload. Without a token (a loopback-only server) values are bare."""
    if token is None:
        return payload
    k = key.encode()
    mac = hmac.new(token.encode(), b"%d:%s%s" % (len(k), k, payload.encode()), hashlib.sha256).hexdigest()
    return f"hmac-sha256:{mac}:{payload}"


def verified(token: str | None, key: str, value: bytes) -> str:
    """The payload of a value the server wrote, after checking its HMAC (a forgery fails the run)."""
    text = value.decode()
    payload = text.split(":", 2)[2] if text.startswith("hmac-sha256:") else text
    if token is not None:  # re-sign the payload and compare in constant time; unsigned never matches
        good = hmac.compare_digest(sign(token, key, payload).encode(), text.encode())
        check(good, f"{key} is not signed with our token")
    return payload


def check(ok: bool, message: str) -> None:
    if not ok:
        raise SystemExit(f"minimal_trainer: {message}")


def chat_logprobs(http: httpx.Client) -> tuple[list[int], list[float]]:
    body = {"messages": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": True, "ignore_eos": True}
    choice = http.post("/v1/chat/completions", json=body).raise_for_status().json()["choices"][0]
    return choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", required=True, help="base URL of the inference server")
    p.add_argument("--model", required=True, help="Hugging Face directory with *.safetensors")
    p.add_argument("--token", default=None, help="the server's --token (control routes)")
    p.add_argument("--version", type=int, default=1, help="weight version to push")
    p.add_argument("--restore", action="store_true", help="push the checkpoint unchanged, restore: true")
    p.add_argument("--bucket-bytes", type=int, default=64 * 1024)
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    server = args.server.rstrip("/")
    http = httpx.Client(base_url=server, headers=headers, timeout=args.timeout + 30)

    caps = http.get("/capabilities").raise_for_status().json()
    check("gloo" in caps["transports"], f"server offers no gloo wire format: {caps['transports']}")
    dtype = getattr(torch, caps["dtypes"][0])
    before = chat_logprobs(http)

    # The weights: every tensor of the checkpoint, in the server's dtype; perturbed unless restoring.
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(Path(args.model).glob("*.safetensors")):
        weights.update(load_file(str(path)))
    gen = torch.Generator().manual_seed(args.version)
    names = sorted(weights)
    tensors = [weights[n].to(dtype).contiguous() for n in names]
    if not args.restore:
        tensors = [t + 0.05 * torch.randn(t.shape, generator=gen, dtype=dtype) for t in tensors]

    # § 1. The group: we host the store and are rank 0; the server joins while we do (POST from a thread).
    # Listening ourselves binds the store to this address only (torch alone listens on every interface).
    listener = socket.create_server(("127.0.0.1", 0))
    timeout = dt.timedelta(seconds=args.timeout)
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1", port, None, True, timeout=timeout, master_listen_fd=listener.detach(), use_libuv=True
    )
    world_size = 1 + caps["workers"]
    init = {
        "master_address": "127.0.0.1",
        "master_port": store.port,
        "rank_offset": 1,
        "world_size": world_size,
        "backend": "gloo",
        "group_name": GROUP,
        "server_id": server,
        "timeout_s": args.timeout,
    }
    answer: dict = {}
    poster = threading.Thread(target=lambda: answer.update(r=http.post("/init_process_group", json=init)))
    poster.start()
    pg = dist.ProcessGroupGloo(
        dist.PrefixStore(f"{GROUP}/pg", store), 0, world_size, dt.timedelta(seconds=args.timeout)
    )
    pg.allreduce([torch.zeros(1, dtype=torch.float32)]).wait()  # the join probe every rank runs
    poster.join()
    check(answer["r"].status_code == 200, f"join refused: {answer['r'].status_code} {answer['r'].text}")

    try:
        # § 2 announce, § 3 decide and broadcast, § 4 wait for the result key.
        update_id = uuid.uuid4().hex  # fresh for every attempt
        metas = [
            {"name": n, "dtype": caps["dtypes"][0], "shape": list(t.shape)}
            for n, t in zip(names, tensors, strict=True)
        ]
        request = {
            "version": args.version,
            "update_id": update_id,
            "restore": args.restore,
            "bucket_bytes": args.bucket_bytes,
            "timeout_s": args.timeout,
            "tensors": metas,
            "store_signing": "hmac-sha256",  # contract 2.0: we sign every store value (§ Store values)
        }
        r = http.post("/request_weight_update", json=request)
        decision = f"{GROUP}/update/{update_id}/decision"
        if r.status_code != 200:
            store.set(decision, sign(args.token, decision, "abort"))
            raise SystemExit(f"update refused: {r.status_code} {r.text}")
        store.set(decision, sign(args.token, decision, "go"))  # an unsigned "go" is an abort
        sizes = [t.numel() * t.element_size() for t in tensors]
        for slots, length in plan_buckets(sizes, args.bucket_bytes):
            flat = torch.zeros(length, dtype=torch.uint8)  # exactly the bucket's length
            for i, offset in slots:
                flat[offset : offset + sizes[i]] = tensors[i].reshape(-1).view(torch.uint8)
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
            pg.broadcast([flat], opts).wait()
        result_key = f"{GROUP}/update/{update_id}/result/{server}"
        store.wait([result_key], dt.timedelta(seconds=args.timeout))
        result = json.loads(verified(args.token, result_key, store.get(result_key)))
        check(result["ok"], f"server failed to apply version {args.version}: {result['error']}")
    finally:
        http.post("/destroy_process_group").raise_for_status()

    state = http.get("/debug/state").raise_for_status().json()
    check(state["weight_version"] == args.version, f"server serves {state['weight_version']}")
    check(state["last_error"] is None, f"last_error after a good update: {state['last_error']}")
    after = chat_logprobs(http)
    if not args.restore:
        check(after != before, "the served logprobs did not change after pushing perturbed weights")
    print(json.dumps({"version": args.version, "result": result, "before": before, "after": after}))


if __name__ == "__main__":
    main()
