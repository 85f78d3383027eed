"""The trainer-strategy package's shape (pipeline_rl/trainer/strategies): one-way imports, a complete registry,
and the checkpoint's gather buckets planned by the push's planner; ZeRO on CPU builds no DeepSpeed op. No
distributed group, no model.

    .venv/bin/python -m pytest -q tests/unit/test_strategies.py
"""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import torch

import pipeline_rl.trainer.strategies as strategies
from inference_shim.protocol import plan_buckets
from pipeline_rl.config import TrainerConfig
from pipeline_rl.trainer.model import weight_metas

PACKAGE = Path(strategies.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_base_imports_no_strategy_and_strategies_import_no_sibling():
    siblings = {f"pipeline_rl.trainer.strategies.{m}" for m in ("ddp", "zero", "fsdp")}
    assert not _imported_modules(PACKAGE / "base.py") & (siblings | {"pipeline_rl.trainer.strategies"})
    for name in ("ddp", "zero", "fsdp"):
        imported = _imported_modules(PACKAGE / f"{name}.py")
        assert not imported & (siblings - {f"pipeline_rl.trainer.strategies.{name}"}), name
        assert "pipeline_rl.trainer.strategies" not in imported, name  # only .base, never the package


def test_registry_holds_exactly_the_names_the_config_allows():
    allowed = set(typing.get_args(TrainerConfig.model_fields["strategy"].annotation))
    assert set(strategies.STRATEGIES) == allowed
    assert all(cls.name == name for name, cls in strategies.STRATEGIES.items())


def test_full_state_dict_gathers_the_push_buckets_in_order():
    specs = [(f"w{i}", [n], torch.float32) for i, n in enumerate([100, 300, 50, 2000, 10])]
    gathered: list[list[int]] = []

    class Recording(strategies.Strategy):
        """Only weight_specs/gather matter to full_state_dict; the rest is never called."""

        name = "recording"

        def backward(self, loss):
            raise NotImplementedError

        def optimizer_step(self):
            raise NotImplementedError

        def lr(self):
            raise NotImplementedError

        def save_optimizer(self, directory):
            raise NotImplementedError

        def load_optimizer(self, directory):
            raise NotImplementedError

        def weight_specs(self):
            return specs

        def gather(self, indices):
            gathered.append(indices)
            return [torch.full(specs[i][1], float(i)) for i in indices]

    comm = type("Comm", (), {"is_main": True})()
    state = Recording(cfg=None, comm=comm).full_state_dict(bucket_bytes=1600)  # type: ignore[arg-type]
    expected = [[s.index for s in b.slots] for b in plan_buckets(weight_metas(specs), 1600)]
    assert gathered == expected and len(expected) > 1
    assert list(state) == [s[0] for s in specs]
    assert all(torch.equal(state[f"w{i}"], torch.full(specs[i][1], float(i))) for i in range(len(specs)))


def test_a_cpu_zero_trainer_does_not_build_deepspeeds_shared_memory_op():
    """DeepSpeed's CPU communication backend would JIT-compile its shared-memory all-reduce op in
    `init_distributed` (minutes on a fresh machine); the ZeRO strategy marks it unavailable first, so the
    backend's own builder function returns no op, and compiles nothing."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    from pipeline_rl.trainer.strategies.zero import SHARED_MEMORY_OP, skip_shared_memory_op

    assert get_accelerator().device_name() == "cpu"
    assert get_accelerator().create_op_builder("ShareMemCommBuilder") is not None
    # Left alone, DeepSpeed would build it here: its probe finds the op buildable on this machine.
    assert deepspeed.ops.__compatible_ops__[SHARED_MEMORY_OP], "no compiler for DeepSpeed's CPU ops?"
    skip_shared_memory_op()
    assert build_shm_op() is None
