"""The command line starts instantly (heavy modules load inside the subcommand that needs them), and the
outsider's example trainer uses the contract alone (examples/minimal_trainer.py imports no project code;
tests/integration/test_minimal_trainer_example.py runs it against a real server)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "minimal_trainer.py"
OUTSIDE_MODULES = {"__future__", "argparse", "datetime", "hashlib", "hmac", "json", "threading", "uuid"}
OUTSIDE_MODULES |= {"pathlib", "socket"}
OUTSIDE_MODULES |= {"httpx", "torch", "safetensors"}


def test_cli_help_imports_no_heavy_modules():
    code = "import sys; from pipeline_rl import cli; cli.build_parser(); print(sorted({'torch','vllm','transformers'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"
    help_text = subprocess.run(
        [sys.executable, "-m", "pipeline_rl.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "serve" in help_text.stdout and "tiny-model" in help_text.stdout


def test_example_imports_nothing_from_this_project():
    imported = set()
    for node in ast.walk(ast.parse(EXAMPLE.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= OUTSIDE_MODULES, (
        f"the example must use only the contract: {imported - OUTSIDE_MODULES}"
    )
