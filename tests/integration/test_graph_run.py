"""A launched run of a declared graph with a user stage added by config alone: a filter with a worker
process of its own between the actors and the preprocessors (torch engine: the graph, not the engine,
is under test). The run ends cleanly with its ledger balanced, every trained sample passed the filter,
and the samples it dropped are in the ledger under the stage's reason.

    .venv/bin/python -m pytest -q tests/integration/test_graph_run.py     (about a minute)
"""

from __future__ import annotations

import os

import pytest
from support.launching import REPO, SMALL_RUN, assert_clean_finish, finish, launch

from inference_shim.procs import free_port
from pipeline_rl.config import RunConfig
from pipeline_rl.ledger import ledger_dir, ledger_summary, read_records

pytestmark = pytest.mark.slow

STEPS = 3


def test_a_filter_stage_added_by_config_runs_in_its_own_worker(launch_model, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    )
    proc = launch(
        [
            "--status-port",
            str(free_port()),
            f"model_path={launch_model}",
            f"run_dir={run_dir}",
            *SMALL_RUN,
            "inference.backend=torch",
            "graph.name=grpo-with-filter",
            "graph.stages.odd={kind: filter, fn: 'support.stage_fns:odd_attempts', inputs: [rollouts], outputs: [kept]}",
            "graph.stages.advantages.inputs=[kept]",
            "placement.stages.odd={replicas: 1}",
            "trainer.batch_size=8",
            f"trainer.max_steps={STEPS}",
        ],
        env=env,
    )
    output = finish(proc, "", timeout_s=300)
    assert_clean_finish(proc, output, run_dir, STEPS, servers=1)
    assert "odd             filter        rollouts              kept                  odd0" in output, output[
        :3000
    ]
    ledger = ledger_summary(run_dir)
    assert ledger.dropped.get("odd:odd", 0) > 0, "\n".join(ledger.lines())
    trained = [i for f in ledger_dir(run_dir).glob("trainer*.jsonl") for r in read_records(f)[0]
               if r.get("event") == "trained" for i in r["ids"]]  # fmt: skip
    assert trained and all(int(i.rsplit("/", 1)[1]) % 2 == 0 for i in trained)
    cfg = RunConfig.model_validate_json((run_dir / "config.json").read_text())
    assert cfg.graph.name == "grpo-with-filter" and (run_dir / "cmd" / "odd0.sh").exists()
