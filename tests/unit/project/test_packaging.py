"""The wheel a user installs: it carries the configs, and `pipeline-rl launch --dry-run` plans a run from
an installed copy, outside any checkout (conf/ found as package data, not beside the sources)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_the_wheel_holds_the_configs_and_an_installed_copy_plans_a_run(tmp_path: Path) -> None:
    source = tmp_path / "src"  # a copy: building in the checkout would leave build/ behind
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("pipeline_rl", "inference_shim"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            ".",
        ],
        cwd=source,
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("pipeline_rl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n for n in names if n.startswith("pipeline_rl/conf/")}
    expected = {
        f"pipeline_rl/{p.relative_to(REPO / 'pipeline_rl').as_posix()}"
        for p in (REPO / "pipeline_rl" / "conf").rglob("*")
        if p.is_file()
    }
    assert shipped == expected, sorted(expected ^ shipped)
    assert not any(n.startswith(("benchmarks/", "tests/")) for n in names), (
        "benchmarks and tests are not installed"
    )

    target = tmp_path / "installed"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )
    model = tmp_path / "model"  # a checkpoint's config is all a plan reads
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    )
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = (
        "import pipeline_rl, sys; assert pipeline_rl.__file__.startswith(sys.argv[1]), pipeline_rl.__file__; "
        "from pipeline_rl.cli import main; main(sys.argv[2:])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(target), "launch", "--dry-run", f"model_path={model}"],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"model: {model}" in result.stdout and "cmd/trainer.sh" in result.stdout, result.stdout
