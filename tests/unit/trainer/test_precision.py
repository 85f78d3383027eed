"""trainer.mixed_precision=bf16 is refused on a CPU without native bf16 (pipeline_rl/trainer/precision.py).

The unit tests patch whether the CPU has it, both ways; the last test runs a real trainer process on this
machine's CPU, whichever it is, and checks that it fails fast with the fix in its message, or starts."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from pipeline_rl.trainer import precision

CPU = torch.device("cpu")


def test_bf16_on_a_cpu_without_native_bf16_is_refused_with_the_fix(monkeypatch) -> None:
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    with pytest.raises(ValueError) as e:
        precision.check_mixed_precision("bf16", CPU)
    assert "set trainer.mixed_precision=no" in str(e.value)
    assert precision.cpu_capability() in str(e.value)
    precision.check_mixed_precision("no", CPU)  # float32 is always fine
    precision.check_mixed_precision("bf16", torch.device("cuda", 0))  # a GPU's bf16 is not the CPU's


def test_bf16_on_a_cpu_with_native_bf16_is_accepted(monkeypatch) -> None:
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    precision.check_mixed_precision("bf16", CPU)


def test_on_x86_native_bf16_means_the_cpu_flags_not_torchs_check(monkeypatch) -> None:
    """torch's own check says yes on any AVX-512 x86, where without AVX512_BF16 oneDNN converts bf16 to
    float32 and a matmul is slower than in float32 (docs/trainer.md, "Mixed precision"): only the bf16
    flags count there."""
    avx512 = {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    monkeypatch.setattr(precision, "x86_cpu_flags", lambda: avx512)
    assert not precision.cpu_has_native_bf16()
    monkeypatch.setattr(precision, "x86_cpu_flags", lambda: avx512 | {"avx512_bf16"})
    assert precision.cpu_has_native_bf16()
    monkeypatch.setattr(precision, "x86_cpu_flags", lambda: avx512 | {"amx_bf16", "amx_tile"})
    assert precision.cpu_has_native_bf16()


def test_off_x86_native_bf16_is_torchs_check(monkeypatch) -> None:
    monkeypatch.setattr(precision, "x86_cpu_flags", lambda: None)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    assert precision.cpu_has_native_bf16()
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    assert not precision.cpu_has_native_bf16()


def test_the_flags_line_is_read_not_the_vmx_flags_line(tmp_path, monkeypatch) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\nvmx flags\t: vnmi avx512_bf16_fake\n"
        "flags\t\t: fpu sse2 avx2 avx512f avx512_vnni\nbugs\t\t: spectre_v1\n\n"
        "processor\t: 1\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16\n"
    )
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert precision.x86_cpu_flags(str(cpuinfo)) == {"fpu", "sse2", "avx2", "avx512f", "avx512_vnni"}
    assert precision.x86_cpu_flags(str(tmp_path / "missing")) is None
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")  # an Arm cpuinfo says "Features"
    assert precision.x86_cpu_flags(str(cpuinfo)) is None


def test_this_machines_flags_are_read_on_x86() -> None:
    flags = precision.x86_cpu_flags()
    if platform.machine().lower() in precision.X86_MACHINES and os.path.exists("/proc/cpuinfo"):
        assert flags is not None and "sse2" in flags  # every x86 CPU that runs torch has it
    else:
        assert flags is None


def test_the_trainer_process_checks_before_it_loads_anything(tmp_path) -> None:
    """A real `pipeline-rl train` with bf16 on this CPU: without native bf16 it exits 1 within seconds,
    before it needs Redis, a model or a server (none exist here), saying what to set; with native bf16 it
    gets past the check and fails later, on the missing model."""
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "run_dir": str(tmp_path / "run"),
                "model_path": str(tmp_path / "no-model"),
                "trainer": {"mixed_precision": "bf16"},
                "streams": {"backend": "redis", "redis_url": "redis://127.0.0.1:1/0"},
            }
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "pipeline_rl.cli", "train", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},  # the CPU's check, on a GPU host too
    )
    assert result.returncode != 0
    if precision.cpu_has_native_bf16():
        assert "set trainer.mixed_precision=no" not in result.stderr
        assert "no-model" in result.stderr, result.stderr[-3000:]  # got past the check, to the model
    else:
        assert "set trainer.mixed_precision=no" in result.stderr, result.stderr[-3000:]
        assert "no-model" not in result.stderr  # refused before it looked for the model
