"""GET /health, /capabilities and /v1/models of every backend, pinned byte for byte: base.Backend builds
them from what each backend declares, and these bodies are what clients and the trainer read.

    .venv/bin/python -m pytest -q tests/unit/shim/test_backend_declarations.py

The capture backend runs its real start() (it reads a checkpoint's safetensors headers, no engine).
The engine backends (torch, vLLM, SGLang) are built but never started: a unit test starts no engine, so
their "started" states set the attributes start() sets (engine handle, tensor table, engine version,
model length), and an engine's death is a stand-in flag. tests/integration (test_torch_engine,
test_contract_suite) checks the same routes against the real engines.
"""

from __future__ import annotations

import asyncio
import json
import sys
import types
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save_file

from inference_shim.backends.capture_backend import CaptureBackend, CaptureOptions
from inference_shim.backends.sglang_backend import SglangBackend, SglangOptions
from inference_shim.backends.torch_backend import TorchBackend, TorchOptions
from inference_shim.backends.vllm_backend import VllmBackend, VllmOptions
from inference_shim.metrics import ShimMetrics
from inference_shim.server import create_app

# tests/unit's stand-in backend: on sys.path only when pytest collected a file of tests/unit first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.fake_backend import FakeBackend  # noqa: E402

TABLE = {"w": ("float32", [2]), "b": ("bfloat16", [1]), "c": ("float32", [3])}


def _get(backend, path: str) -> tuple[int, bytes]:
    # No `with`: the app's lifespan (which would start the engine) never runs.
    response = TestClient(create_app(backend, backend.metrics)).get(path)
    return response.status_code, response.content


def _body(fields: dict) -> bytes:
    """The exact bytes of a JSON route's answer with these fields, in this order."""
    return json.dumps(fields, separators=(",", ":")).encode()


# ------------------------------------------------------------------ the backends, new and "started"
def _capture(tmp_path: Path, start: bool = False, **options) -> CaptureBackend:
    model = tmp_path / "tiny-x"
    model.mkdir(exist_ok=True)
    tensors = {"w": torch.zeros(2), "b": torch.zeros(1, dtype=torch.bfloat16), "c": torch.zeros(3)}
    save_file(tensors, str(model / "model.safetensors"))
    backend = CaptureBackend(CaptureOptions(model=str(model), **options), ShimMetrics())
    if start:
        asyncio.run(backend.start())
    return backend


def _torch(started: bool) -> TorchBackend:
    backend = TorchBackend(TorchOptions(model="/m/tiny-t"), ShimMetrics())
    if started:  # what start() sets
        backend.model, backend.table = object(), TABLE
        backend.engine_version, backend.max_model_len = "torch 9.9", 128
    return backend


def _vllm(started: bool, **options) -> VllmBackend:
    backend = VllmBackend(VllmOptions(model="/m/tiny-v", tensor_parallel_size=2, **options), ShimMetrics())
    if started:
        backend.engine, backend.table = types.SimpleNamespace(errored=False), TABLE
        backend.engine_version, backend.max_model_len = "0.32", 256
    return backend


def _sglang(started: bool) -> SglangBackend:
    options = SglangOptions(
        model="/m/tiny-s", tensor_parallel_size=2, max_model_len=512, engine_python=sys.executable
    )
    backend = SglangBackend(options, ShimMetrics())
    if started:  # a client, a running child process (poll(): None), the table, the engine's version
        backend.client, backend.process.proc = object(), types.SimpleNamespace(poll=lambda: None)
        backend.table, backend.engine_version = TABLE, "0.5"
    return backend


BACKENDS = {
    "capture": lambda tmp_path: _capture(tmp_path),
    "capture started": lambda tmp_path: _capture(tmp_path, start=True),
    "capture named": lambda tmp_path: _capture(tmp_path, start=True, served_model_name="srv"),
    "torch": lambda _: _torch(started=False),
    "torch started": lambda _: _torch(started=True),
    "vllm": lambda _: _vllm(started=False),
    "vllm started": lambda _: _vllm(started=True),
    "vllm no parser": lambda _: _vllm(started=True, tool_call_parser=None, served_model_name="v"),
    "sglang": lambda _: _sglang(started=False),
    "sglang started": lambda _: _sglang(started=True),
    "fake": lambda _: FakeBackend(),  # writes its own health() and capabilities()
}

# ------------------------------------------------------------------ /capabilities and /v1/models
BOTH = ["bfloat16", "float32"]
CAPTURE = {
    "contract_version": "2.2",
    "backend": "capture",
    "engine_version": "none",
    "model": "tiny-x",
    "workers": 1,
    "transports": ["gloo"],
    "pause_modes": [],
    "dtypes": [],
    "per_token_versions": False,
    "staged_receive": True,
    "max_model_len": 0,
    "fanouts": ["broadcast", "chain"],
    "tool_call_parser": None,
    "structured_output": False,
    "lora": "none",
    "lora_max_rank": None,
    "update_mode": "inflight",
    "drain_timeout_s": None,
}
TORCH = CAPTURE | {
    "backend": "torch",
    "engine_version": "unknown",
    "model": "tiny-t",
    "pause_modes": ["keep"],
    "per_token_versions": True,
}
VLLM = TORCH | {
    "backend": "vllm",
    "model": "tiny-v",
    "workers": 2,
    "transports": ["gloo", "nccl"],
    "tool_call_parser": "hermes",
    "structured_output": True,
}
SGLANG = TORCH | {
    "backend": "sglang",
    "model": "tiny-s",
    "workers": 2,
    "transports": ["nccl:c10d", "gloo:c10d"],
    "pause_modes": ["retract", "in_place"],
    "dtypes": ["bfloat16"],  # the engine's --dtype, known before start()
    "staged_receive": False,
    "max_model_len": 512,
    "fanouts": ["broadcast"],
}
CAPABILITIES = {
    "capture": CAPTURE,
    "capture started": CAPTURE | {"dtypes": BOTH},
    "capture named": CAPTURE | {"model": "srv", "dtypes": BOTH},
    "torch": TORCH,
    "torch started": TORCH | {"engine_version": "torch 9.9", "dtypes": BOTH, "max_model_len": 128},
    "vllm": VLLM,
    "vllm started": VLLM | {"engine_version": "0.32", "dtypes": BOTH, "max_model_len": 256},
    "vllm no parser": VLLM
    | {
        "engine_version": "0.32",
        "model": "v",
        "dtypes": BOTH,
        "max_model_len": 256,
        "tool_call_parser": None,
    },
    "sglang": SGLANG,
    "sglang started": SGLANG | {"engine_version": "0.5"},
    "fake": TORCH
    | {"backend": "fake", "engine_version": "0", "model": "fake", "dtypes": ["float32"], "max_model_len": 64}
    | {"fanouts": ["broadcast"]},
}


@pytest.mark.parametrize("label", sorted(CAPABILITIES))
def test_capabilities_and_models_are_pinned(label: str, tmp_path: Path):
    backend = BACKENDS[label](tmp_path)
    assert _get(backend, "/capabilities") == (200, _body(CAPABILITIES[label]))
    model = CAPABILITIES[label]["model"]
    models = {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": 0, "owned_by": "pipeline-rl"}],
    }
    assert _get(backend, "/v1/models") == (200, _body(models))


# ------------------------------------------------------------------ /health
def _health(status: str, detail: str | None = None, version: int = 0) -> bytes:
    return _body({"status": status, "weight_version": version, "detail": detail})


OK = (200, _health("ok"))
STARTING = (503, _health("starting"))
MIXED = (503, _health("unhealthy", "mixed"))
AWAITING = (
    503,
    _health(
        "awaiting_weights", "started with --await-weights: generation begins with the trainer's first update"
    ),
)
EVENTS = {
    "nothing": lambda b: None,
    "update failed mid-apply": lambda b: setattr(b, "unhealthy", "mixed"),
    "await weights": lambda b: setattr(b, "awaiting_weights", True),
    "torch thread died": lambda b: setattr(b, "_failure", "thread died"),
    "vllm engine died": lambda b: setattr(b.engine, "errored", True),
    "sglang exited": lambda b: setattr(b.process, "proc", types.SimpleNamespace(poll=lambda: -9)),
}
HEALTH = [
    # (backend, what happened (in order), expected (status code, body))
    ("capture", [], OK),
    ("capture", ["update failed mid-apply"], MIXED),
    ("capture", ["await weights"], AWAITING),
    ("capture", ["await weights", "update failed mid-apply"], MIXED),
    ("fake", [], OK),
    ("fake", ["update failed mid-apply"], MIXED),
    ("fake", ["await weights"], AWAITING),
    ("torch", [], STARTING),
    ("torch", ["await weights"], STARTING),
    ("torch started", [], OK),
    ("torch started", ["update failed mid-apply"], MIXED),
    ("torch started", ["await weights"], AWAITING),
    ("torch started", ["torch thread died"], (503, _health("unhealthy", "thread died"))),
    ("torch started", ["torch thread died", "update failed mid-apply"], MIXED),
    ("vllm", [], STARTING),
    ("vllm started", [], OK),
    ("vllm started", ["update failed mid-apply"], MIXED),
    ("vllm started", ["await weights"], AWAITING),
    ("vllm started", ["vllm engine died"], (503, _health("unhealthy", "engine died"))),
    ("vllm started", ["vllm engine died", "update failed mid-apply"], MIXED),
    ("sglang", [], STARTING),
    ("sglang started", [], OK),
    ("sglang started", ["update failed mid-apply"], MIXED),
    ("sglang started", ["await weights"], AWAITING),
    ("sglang started", ["sglang exited"], (503, _health("unhealthy", "SGLang exited with -9"))),
    # SGLang reports its dead child first; vLLM and torch a failed update first.
    ("sglang started", ["sglang exited", "update failed mid-apply"], (503, _health("unhealthy", "SGLang exited with -9"))),
]  # fmt: skip


@pytest.mark.parametrize(
    ("label", "events", "expected"),
    HEALTH,
    ids=[f"{label}: {' + '.join(e) or 'ok'}" for label, e, _ in HEALTH],
)
def test_health_is_pinned(label: str, events: list[str], expected: tuple[int, bytes], tmp_path: Path):
    backend = BACKENDS[label](tmp_path)
    for event in events:
        EVENTS[event](backend)
    assert _get(backend, "/health") == expected


def test_health_reports_the_served_version(tmp_path: Path):
    backend = BACKENDS["vllm started"](tmp_path)
    backend.version, backend.unhealthy = 7, "mixed"
    assert _get(backend, "/health") == (503, _health("unhealthy", "mixed", version=7))
