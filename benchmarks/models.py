"""Benchmark models: tiny Qwen2-style models of fixed sizes, built once into artifacts/bench-models/.

    python -m benchmarks.models            # builds (or checks) every size and prints its weight bytes

A model is rebuilt only when its directory is missing or was built from a different spec, so repeated
benchmark runs reuse the same bytes. Sizes are float32 weight bytes; the vocabulary is the character
tokenizer's (~100 tokens), so almost every byte sits in the transformer blocks, as in a real LLM.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import ARTIFACTS, MB
from pipeline_rl.demo.tiny_model import TinyModelSpec
from pipeline_rl.testing.models import load_named_tensors  # noqa: F401 - re-exported for the benchmarks

MODEL_DIR = ARTIFACTS / "bench-models"

# name -> spec. head_dim 64 everywhere (vLLM-CPU needs >= 32, a multiple of 16).
SIZES: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(),  # ~0.3 MB: smoke tests
    "10mb": TinyModelSpec(hidden_size=256, num_heads=4, num_layers=3, intermediate_size=1024),
    "100mb": TinyModelSpec(hidden_size=768, num_heads=12, num_layers=3, intermediate_size=3072),
    "400mb": TinyModelSpec(hidden_size=768, num_heads=12, num_layers=12, intermediate_size=3072),
    # 15 blocks of 768: a realistic number of tensors per byte (~180 tensors), not a few huge ones.
    "500mb": TinyModelSpec(hidden_size=768, num_heads=12, num_layers=15, intermediate_size=3072),
}


def weight_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def bench_model(name: str) -> Path:
    """Directory of the bench model `name` (built on first use)."""
    from pipeline_rl.demo.tiny_model import build_tiny_model

    spec = SIZES[name]
    out = MODEL_DIR / name
    spec_file = out / "tiny_model_spec.json"
    if spec_file.exists() and json.loads(spec_file.read_text()) == spec.model_dump():
        return out
    return build_tiny_model(out, spec)


if __name__ == "__main__":
    for size in SIZES:
        directory = bench_model(size)
        print(f"{size:>6}: {weight_bytes(directory) / MB:8.1f} MB  {directory}")
